"""The parallel plan (design §8): named axes, validated up front, checked against the card.

A :class:`ParallelPlan` is what an operator writes in the deploy config's ``parallel:``
section. Its axes are ``dp`` (replicas), ``sp`` = ``ulysses`` x ``ring`` (sequence
parallel), ``cfgp`` (classifier-free-guidance branches on their own ranks, at most 2),
``tp`` (tensor parallel) and ``vae`` (parallel VAE decode). The product of ``dp``,
``cfgp``, ``sp`` and ``tp`` is the world size; ``vae`` reuses the ranks of one replica.

Everything here is checked before a process group exists or a weight is read: the
plan alone (:class:`ParallelPlan` validation), the plan against the world it is
launched into (:meth:`ParallelPlan.check_world`), and the plan against every card of
the deployment (:func:`check_plan_against_card`). Each refusal is a
:class:`ParallelPlanError` naming the axis (``param = "parallel.<axis>"``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fv_kernel.errors import FvError

if TYPE_CHECKING:  # pragma: no cover
    from fv_kernel.card.spec import ModelCard

__all__ = ["ParallelPlan", "ParallelPlanError", "MESH_ORDER", "check_plan_against_card", "plan_axis_degrees"]

#: Mesh dimensions, outermost first. Ulysses is innermost: its all-to-alls are the most
#: frequent exchange and go between the closest ranks (xDiT orders them the same way).
MESH_ORDER: tuple[str, ...] = ("dp", "cfgp", "ring", "ulysses", "tp")


class ParallelPlanError(FvError):
    """A parallel plan the deployment cannot honour; names the axis and what is allowed.

    Not a ``ValueError`` on purpose: pydantic would wrap it in a ValidationError and lose the type.
    """

    error_type = "parallel_plan"

    def __init__(self, axis: str, message: str, *, allowed: str | None = None) -> None:
        text = f"parallel.{axis}: {message}" + (f"; allowed: {allowed}" if allowed else "")
        super().__init__(text, param=f"parallel.{axis}")
        self.axis = axis
        self.allowed = allowed


class ParallelPlan(BaseModel):
    """How one pool's ranks are laid out. Degree-one axes are trivial (size-one mesh dimensions)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dp: int = Field(default=1, ge=1)
    #: Sequence-parallel degree; ``ulysses * ring``. Given alone it means all-Ulysses.
    sp: int | None = Field(default=None, ge=1)
    ulysses: int | None = Field(default=None, ge=1)
    ring: int | None = Field(default=None, ge=1)
    cfgp: int = Field(default=1, ge=1)
    tp: int = Field(default=1, ge=1)
    #: Ranks the VAE decode is split over: 1, or every rank of a replica (``world_size / dp``).
    vae: int = Field(default=1, ge=1)
    #: ``None``: NCCL when the deployment's device is CUDA, gloo otherwise.
    backend: Literal["gloo", "nccl"] | None = None
    #: Seconds a collective may wait for a peer before the pool is declared failed.
    timeout_s: float = Field(default=120.0, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _axis_errors(cls, data: Any) -> Any:
        # Degrees below one are refused here as ParallelPlanError (naming the axis), not as
        # a generic validation error, so every bad plan reads the same way.
        if isinstance(data, dict):
            for axis in ("dp", "sp", "ulysses", "ring", "cfgp", "tp", "vae"):
                value = data.get(axis)
                if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                    raise ParallelPlanError(axis, f"degree must be an integer >= 1, got {value!r}")
        return data

    @model_validator(mode="after")
    def _consistent(self) -> "ParallelPlan":
        ulysses, ring, sp = self.ulysses, self.ring, self.sp
        if sp is not None and ulysses is None and ring is None:
            ulysses, ring = sp, 1
        elif sp is not None and (ulysses is None) != (ring is None):  # the other factor is implied
            given = ulysses or ring or 1
            if sp % given:
                raise ParallelPlanError("sp", f"sp={sp} is not a multiple of {'ulysses' if ulysses else 'ring'}={given}",
                                        allowed="sp = ulysses x ring")
            ulysses, ring = (given, sp // given) if ulysses else (sp // given, given)
        ulysses, ring = ulysses or 1, ring or 1
        if sp is not None and sp != ulysses * ring:
            raise ParallelPlanError("sp", f"sp={sp} but ulysses x ring = {ulysses} x {ring} = {ulysses * ring}",
                                    allowed=f"sp = ulysses x ring ({ulysses * ring})")
        object.__setattr__(self, "ulysses", ulysses)
        object.__setattr__(self, "ring", ring)
        object.__setattr__(self, "sp", ulysses * ring)
        if self.cfgp > 2:
            raise ParallelPlanError("cfgp", f"degree {self.cfgp}: classifier-free guidance has two branches", allowed="1 or 2")
        replica = self.world_size // self.dp
        if self.vae not in (1, replica):
            raise ParallelPlanError(
                "vae", f"degree {self.vae}: the VAE decode splits over every rank of a replica or none",
                allowed=f"1 or {replica} (world_size / dp)",
            )
        return self

    @property
    def world_size(self) -> int:
        return self.dp * self.cfgp * (self.sp or 1) * self.tp

    @property
    def is_single(self) -> bool:
        return self.world_size == 1 and self.vae == 1

    def mesh_shape(self) -> tuple[int, ...]:
        degrees = {"dp": self.dp, "cfgp": self.cfgp, "ring": self.ring, "ulysses": self.ulysses, "tp": self.tp}
        return tuple(int(degrees[axis]) for axis in MESH_ORDER)

    def label(self) -> str:
        """A stable short name (compile and cache keys): ``dp1.cfgp2.ring1.ulysses2.tp1.vae1``."""
        shape = dict(zip(MESH_ORDER, self.mesh_shape()))
        return ".".join(f"{axis}{shape[axis]}" for axis in MESH_ORDER) + f".vae{self.vae}"

    def check_world(self, world_size: int) -> None:
        """The plan's degrees multiply to the number of launched processes."""
        if world_size != self.world_size:
            raise ParallelPlanError(
                "world_size",
                f"the plan needs dp x cfgp x sp x tp = {self.dp} x {self.cfgp} x {self.sp} x {self.tp} = "
                f"{self.world_size} processes but {world_size} were launched",
                allowed=f"launch {self.world_size} processes (torchrun --nproc-per-node {self.world_size}) or change the degrees",
            )

    def check_tokens(self, tokens: int) -> None:
        """Sequence parallel splits the token sequence evenly over ``sp`` ranks."""
        if tokens % (self.sp or 1):
            axis = "ring" if (self.ring or 1) > 1 else "ulysses"
            raise ParallelPlanError(
                axis, f"sp degree {self.sp} (ulysses {self.ulysses} x ring {self.ring}) does not divide the "
                f"{tokens} tokens of this shape", allowed=f"a degree dividing {tokens}, or another frame count / size",
            )


def plan_axis_degrees(plan: ParallelPlan) -> dict[str, int]:
    """The plan's degrees by the card's axis names (``PARALLEL_AXES``): ``sp`` covers ulysses and ring."""
    return {"dp": plan.dp, "sp": int(plan.sp or 1), "cfgp": plan.cfgp, "tp": plan.tp, "vae": plan.vae}


def check_plan_against_card(plan: ParallelPlan, card: "ModelCard") -> None:
    """The plan is within what ``card`` declares (``parallelism`` and ``valid_parallel_axes``).

    Then the card's parallel implementation checks what only the model knows (heads a
    Ulysses degree must divide, for example) through its ``check_plan``.
    """
    degrees = plan_axis_degrees(plan)
    contract = card.parallelism
    for axis, degree in degrees.items():
        if degree == 1:
            continue
        if axis == "dp":
            raise ParallelPlanError(
                "dp", f"degree {degree}: one engine serves one replica; data parallel is one pool per replica "
                "behind a router (design §8: pools are single-node, scale-out is more pools)", allowed="1",
            )
        declared = contract.max_degree.get(axis, 1)
        listing = [loop_id for loop_id, loop in card.loops.items() if axis in loop.valid_parallel_axes]
        if not listing:
            raise ParallelPlanError(axis, f"card {card.model_id!r} lists {axis!r} on none of its loops", allowed="1")
        if degree > declared:
            raise ParallelPlanError(
                axis, f"degree {degree} is above card {card.model_id!r}'s parallelism.max_degree[{axis!r}] = {declared}",
                allowed=f"1..{declared}",
            )
    if plan.cfgp > 1:
        if not card.capabilities.uses_guidance:
            raise ParallelPlanError("cfgp", f"card {card.model_id!r} has no classifier-free guidance (uses_guidance is false)",
                                    allowed="1")
        for loop_id, loop in card.loops.items():
            if "cfgp" not in loop.valid_parallel_axes:
                continue
            if loop.guidance == "none":
                raise ParallelPlanError("cfgp", f"loop {loop_id!r} runs no guidance (guidance 'none')", allowed="1")
            # CFG has one owner: a batched-CFG dispatch puts both branches in one forward, a cfgp
            # group puts them on two ranks; both at once would run each branch twice or not at all.
            if loop.config.get("cfg_dispatch") == "batched":
                raise ParallelPlanError(
                    "cfgp", f"loop {loop_id!r} owns CFG by a batched dispatch (config.cfg_dispatch 'batched'); "
                    "a cfgp group cannot own it too", allowed="1, or cfg_dispatch 'sequential' on the loop",
                )
    if any(degree > 1 for degree in degrees.values()):
        if contract.implementation is None:
            raise ParallelPlanError(
                next(axis for axis, degree in degrees.items() if degree > 1),
                f"card {card.model_id!r} names no parallelism.implementation", allowed="1",
            )
        from fv_kernel.card.refs import import_object

        implementation = import_object(contract.implementation)
        implementation.check_plan(card, plan)

