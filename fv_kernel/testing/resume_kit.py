"""Resume conformance: every loop of every card continues bit-identically in a fresh process.

::

    from fv_kernel.testing import ResumeConformance

    class TestMyResume(ResumeConformance):
        card_ids = ["my-tiny"]

For each card and each of its kit requests (:meth:`requests_for`, the same requests
as the card kit), the check runs the request once in this process, writing a
:class:`~fv_kernel.program.resume.ProgramCheckpoint` at every step boundary (so a
state that cannot be serialized fails here, when it is written, naming the loop and
the field). It then resumes **every** checkpoint, i.e. every step index of every loop,
in **one fresh Python process** per conformance class: there the card is loaded and
built again (through this class's :meth:`load_card` / :meth:`build`, so a class that
overrides them must be importable at module level), and the request continues from the
checkpoint. Its artifacts must be bit-identical to the uninterrupted run's (CPU, fp32).
The fresh process copies this one's torch thread count, deterministic-algorithms flag and
default dtype: CPU kernels split reductions by thread, so bit-identity across processes
holds at equal settings.

Denoise trajectories are made long enough for the sampler's history to matter: a
request whose denoise loop runs fewer steps than its sampler's
:meth:`~fv_kernel.loop.samplers.Sampler.resume_check_steps` (4 for UniPC at order 2: on
3 steps its full-order corrector runs only on the last step, which it does not change)
is raised to it (unless the recipe fixes the steps), so a class attribute ``steps = 3``
cannot shorten the check below it. Every multistep sampler a denoise loop of the card binds
(``resume_check_steps() > 2``) is resumed too: when no request runs that sampler, the kit
adds one (:func:`~fv_kernel.testing.card_kit.sample_requests` with that sampler), and fails
naming the loop when it cannot build one.

What it catches: a loop that keeps something it needs outside its state (a counter or
an RNG on the loop object, a module global), a loop whose ``restore`` does not
re-attach a per-process resource (K/V in a pool), a program whose control flow cannot
be replayed, a state that loses part of its history when written (e.g. a sampler's), and
unserializable state. The resumes of one card share one process and one instance; a
request's resumes run from its latest checkpoint to its earliest, so a resume never
follows one that already computed the steps before its checkpoint (state kept outside the state
from an earlier step of the same request cannot stand in for the saved state). What it
cannot see: state that survives in the fresh process between two resumes of the same card
and that a resume from a later checkpoint would also have produced.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Sequence

import torch
from pydantic import Field

from fv_kernel.model.instance import ModelInstance
from fv_kernel.card.spec import ModelCard
from fv_kernel.card.recipe import select_denoise_loop
from fv_kernel.loop.samplers import Sampler, bound_sampler, use_samplers
from fv_kernel.model.validate import resolve_request
from fv_kernel.state import TensorState
from fv_kernel.program.resume import ProgramCheckpoint, ProgramRun
from fv_kernel.request.artifacts import Artifact
from fv_kernel.request.request import Request
from fv_kernel.request.types import TaskType
from fv_kernel.runtime.local import run_local
from fv_kernel.testing.card_kit import _CardKitBase, assert_artifacts_identical, sample_requests

__all__ = ["ResumeConformance", "ResumePoint", "checkpoints_inside_every_loop", "resume_in_fresh_process"]


class _ResumedArtifacts(TensorState):
    """What a fresh process sends back: the resumed request's artifacts, or the error it raised."""

    artifacts: list[Artifact] = Field(default_factory=list)
    error: str | None = None


@dataclass(frozen=True)
class ResumePoint:
    """A checkpoint taken at one step boundary of an uninterrupted run."""

    request_id: str
    #: Where the request stood (e.g. ``denoise at step 2``).
    position: str
    data: bytes = field(repr=False)


def checkpoints_inside_every_loop(request: Request, instance: ModelInstance) -> tuple[list[Artifact], list[ResumePoint]]:
    """Run ``request`` writing a checkpoint at every step boundary; return its artifacts and every
    checkpoint, in the order they were written: each step index of each loop that ran steps."""
    points: list[ResumePoint] = []

    def write(run: ProgramRun) -> None:
        checkpoint = run.checkpoint()
        points.append(ResumePoint(request.request_id, checkpoint.position(), checkpoint.to_bytes()))

    artifacts = run_local(request, instance, on_step=write)
    return artifacts, points


def _denoise_sampler(card: ModelCard, request: Request) -> tuple[str, Sampler] | None:
    """The denoise loop ``request`` runs and the sampler it runs there (call inside ``use_samplers``)."""
    if request.task is TaskType.TEXT_GENERATION:
        return None
    loop_id = select_denoise_loop(card, request)
    binding = card.loops[loop_id].sampler if loop_id is not None else None
    if loop_id is None or binding is None:
        return None
    return loop_id, bound_sampler(binding, requested=request.diffusion.sampler, shift=request.diffusion.shift)


def _importable(cls: type) -> str:
    name = f"{cls.__module__}:{cls.__qualname__}"
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        raise AssertionError(f"{name}: a resume conformance class must be defined at module level (a fresh process imports it)")
    return name


def resume_in_fresh_process(
    kit: type["ResumeConformance"], jobs: Sequence[tuple[str, ResumePoint]], *, timeout_s: float
) -> list[_ResumedArtifacts]:
    """Resume each ``(model_id, point)`` in one new Python process; their artifacts (or errors) in order."""
    with tempfile.TemporaryDirectory(prefix="fv-resume-") as folder:
        job_file, out_file = Path(folder) / "jobs.pt", Path(folder) / "out.pt"
        torch.save({"kit": _importable(kit), "jobs": [(model_id, p.data) for model_id, p in jobs],
                    "torch": _numerics()}, job_file)
        env = dict(os.environ)
        # The fresh process imports what this one could (the test module, its conftest's folder).
        env["PYTHONPATH"] = os.pathsep.join(p for p in [*sys.path, env.get("PYTHONPATH", "")] if p)
        proc = subprocess.run(
            [sys.executable, "-c", _FRESH_PROCESS, str(job_file), str(out_file)],
            capture_output=True, text=True, timeout=timeout_s, env=env,
        )
        if proc.returncode != 0 or not out_file.exists():
            raise AssertionError(f"the fresh resume process failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        results = torch.load(out_file, weights_only=True)
    return [_ResumedArtifacts.from_bytes(data) for data in results]


def _numerics() -> dict[str, Any]:
    """The process-wide torch settings results depend on (a conftest may set them); the fresh process copies them."""
    return {
        "num_threads": torch.get_num_threads(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "default_dtype": str(torch.get_default_dtype()).removeprefix("torch."),
    }


class ResumeConformance(_CardKitBase):
    """Checkpoint every loop of every card mid-way and resume it in a fresh process, bit-identically."""

    #: Seconds the fresh process may take for all of this class's resumes.
    resume_timeout_s: ClassVar[float] = 900.0

    def resume_requests(self, card: ModelCard) -> list[Request]:
        """The requests checkpointed and resumed (default: :meth:`requests_for`).

        The check then lengthens short denoise trajectories and adds a request for every
        multistep sampler none of them runs (:meth:`long_enough`)."""
        return self.requests_for(card, prefix="resume-")

    def long_enough(self, card: ModelCard, requests: Sequence[Request]) -> list[Request]:
        """``requests`` with every denoise trajectory at least its sampler's
        :meth:`~fv_kernel.loop.samplers.Sampler.resume_check_steps` long (recipes with fixed steps
        keep theirs), plus a request for each multistep sampler a denoise loop of the card binds
        and none of them runs; AssertionError when the card cannot take such a request."""
        registry = self.registry()
        with use_samplers(registry.samplers):

            def lengthen(request: Request) -> tuple[str | None, Request]:
                """The sampler ``request`` runs (short name) and the request, lengthened if need be."""
                found = _denoise_sampler(card, request)
                if found is None:
                    return None, request
                loop_id, sampler = found
                binding = card.loops[loop_id].sampler
                assert binding is not None
                runs = (request.diffusion.sampler or binding.name).rsplit("/", 1)[-1]
                need = sampler.resume_check_steps()
                steps = resolve_request(card, request, samplers=registry.sampler_names()).diffusion.steps
                if binding.fixed_steps is not None or steps is None or steps >= need:
                    return runs, request
                limit = card.capabilities.max_steps
                assert limit is None or need <= limit, (
                    f"{card.model_id} {request.request_id}: sampler {runs!r} needs {need} denoise steps for its "
                    f"history to matter after a checkpoint, but the card allows at most {limit}"
                )
                return runs, request.with_updates(diffusion=request.diffusion.model_copy(update={"steps": need}))

            checked = [lengthen(r) for r in requests]
            ran = {name for name, _ in checked}
            out = [r for _, r in checked]
            assumed = card.recipe.assumes_loop
            for loop_id, spec in card.denoise_loops().items():
                if spec.sampler is None or (assumed is not None and loop_id != assumed):
                    continue  # a recipe that assumes another loop never runs this one
                name = spec.sampler.name.rsplit("/", 1)[-1]
                if name in ran or bound_sampler(spec.sampler).resume_check_steps() <= 2:
                    continue  # run already, or memoryless (its state carries only the step index)
                candidates = sample_requests(card, prefix=f"resume-{name}-", steps=self.steps, sampler=spec.sampler.name)
                extra = [r for runs, r in map(lengthen, candidates) if runs == name][:1]
                assert extra, (
                    f"{card.model_id}: denoise loop {loop_id!r} binds the multistep sampler {name!r}, whose history a "
                    "resume must carry, but no resume request runs it and the kit cannot build one; add a request "
                    "that runs it to requests_for"
                )
                out.append(extra[0])
                ran.add(name)
        return out

    def test_resumes_in_a_fresh_process_bit_identically(self) -> None:
        assert self.card_ids, "set card_ids on the resume conformance class"
        self.check_cards(self.card_ids)

    def check_cards(self, model_ids: Sequence[str]) -> None:
        """Raise AssertionError naming the card, request and resume point of the first difference."""
        _importable(type(self))
        jobs: list[tuple[str, ResumePoint]] = []
        references: dict[str, list[Artifact]] = {}
        for model_id in model_ids:
            card = self.load_card(model_id)
            instance = self.build(card)
            for request in self.long_enough(card, self.resume_requests(card)):
                program = instance.program(request.task)
                assert program.resumable, (
                    f"{model_id} {request.task.value}: program {type(program).__qualname__} is not resumable "
                    "(run every loop through Program.run_loop and set resumable = True)"
                )
                artifacts, points = checkpoints_inside_every_loop(request, instance)
                assert points, f"{model_id} {request.task.value}: the program ran no steps through run_loop"
                references[request.request_id] = artifacts
                # Latest checkpoint first: no resume follows one that ran the steps before its checkpoint.
                jobs.extend((model_id, point) for point in reversed(points))
        outcomes = resume_in_fresh_process(type(self), jobs, timeout_s=self.resume_timeout_s)
        for (model_id, point), outcome in zip(jobs, outcomes):
            what = f"{model_id} {point.request_id} resumed from '{point.position}' in a fresh process"
            if outcome.error is not None:
                raise AssertionError(f"{what} raised:\n{outcome.error}")
            assert_artifacts_identical(references[point.request_id], outcome.artifacts, what=what)


def _resume_jobs(job_file: str, out_file: str) -> None:
    """The fresh process: build each card once with the kit's own loader, resume every checkpoint."""
    from fv_kernel.card.refs import import_object

    job = torch.load(job_file, weights_only=True)
    settings = job["torch"]
    # CPU kernels split reductions by thread: the same numbers need the same thread count.
    torch.set_num_threads(settings["num_threads"])
    torch.use_deterministic_algorithms(settings["deterministic"])
    torch.set_default_dtype(getattr(torch, settings["default_dtype"]))
    kit = import_object(job["kit"])()
    instances: dict[str, ModelInstance] = {}
    results: list[bytes] = []
    for model_id, data in job["jobs"]:
        try:
            if model_id not in instances:
                instances[model_id] = kit.build(kit.load_card(model_id))
            checkpoint = ProgramCheckpoint.from_bytes(data)
            artifacts = run_local(checkpoint.request, instances[model_id], resume_from=checkpoint)
            results.append(_ResumedArtifacts(artifacts=artifacts).to_bytes())
        except Exception:  # noqa: BLE001 - reported to the parent, which fails the check with it
            results.append(_ResumedArtifacts(error=traceback.format_exc()).to_bytes())
    torch.save(results, out_file)


_FRESH_PROCESS = "import sys; from fv_kernel.testing.resume_kit import _resume_jobs; _resume_jobs(*sys.argv[1:3])"
