"""Does a card build? Its code references resolve and each component's config parses, with no weights.

Pydantic validation of a :class:`~fv_kernel.card.spec.ModelCard` checks its shape; this
module checks what the shape points at: every ``"module:attr"`` (factory, component
builders, loop implementations, state schemas, program classes) imports to the right kind
of object, and every component config parses through the schema the component declares
(``ComponentSpec.config_schema``). ``fv cards validate`` and card-file resolution run it;
a family's loaders parse their configs with :func:`parse_component_config`, the same code,
so a card that passes is a card whose configs load.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from pydantic import BaseModel, ValidationError

from fv_kernel.card.refs import import_object
from fv_kernel.card.spec import ComponentSpec, ModelCard
from fv_kernel.errors import FvError

if TYPE_CHECKING:  # pragma: no cover
    from fv_kernel.plugins.registry import DeployRegistry

__all__ = ["BuildProblem", "InvalidCard", "check_card_builds", "parse_component_config", "problems_from_validation"]


@dataclass(frozen=True)
class BuildProblem:
    """One thing about a card that would not build: the dotted field and what is wrong with it."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class InvalidCard(FvError):
    """A card whose code references or component configs do not build; names every bad field."""

    error_type = "invalid_card"

    def __init__(self, problems: Sequence[BuildProblem], *, card_id: str | None = None) -> None:
        if not problems:
            raise ValueError("InvalidCard needs at least one problem")
        prefix = f"card {card_id!r}: " if card_id else ""
        super().__init__(prefix + "; ".join(str(p) for p in problems), param=problems[0].field)
        self.problems = tuple(problems)
        self.card_id = card_id


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def problems_from_validation(exc: ValidationError, prefix: str) -> list[BuildProblem]:
    """One problem per pydantic error, its location under ``prefix`` and the offending value named."""
    problems = []
    for err in exc.errors():
        where = ".".join([prefix, *(str(p) for p in err["loc"])]) if prefix else ".".join(str(p) for p in err["loc"])
        message = err["msg"]
        if err.get("loc") and not isinstance(err.get("input"), (dict, list, tuple)):
            message += f" (got {_short(err.get('input'))})"
        problems.append(BuildProblem(where or "<card>", message))
    return problems


def _parse(parser: Any, config: dict[str, Any]) -> Any:
    if isinstance(parser, type) and issubclass(parser, BaseModel):
        return parser.model_validate(config)
    return parser(config)


def parse_component_config(spec: ComponentSpec, default: Callable[[dict[str, Any]], Any] | None = None) -> Any:
    """``spec.config`` parsed through ``spec.config_schema`` (or ``default`` when it declares none).

    With neither, the config dict is returned as is. A config that does not parse raises
    :class:`InvalidCard` naming ``components.<id>.config.<field>`` and the value.
    """
    where = f"components.{spec.component_id}"
    if spec.config_schema is not None:
        try:
            parser = import_object(spec.config_schema)
        except (ImportError, AttributeError) as exc:
            raise InvalidCard([BuildProblem(f"{where}.config_schema", f"{spec.config_schema!r} does not import: {exc}")]) from None
    elif default is not None:
        parser = default
    else:
        return dict(spec.config)
    try:
        return _parse(parser, dict(spec.config))
    except ValidationError as exc:
        raise InvalidCard(problems_from_validation(exc, f"{where}.config")) from None
    except (ValueError, TypeError, KeyError) as exc:
        raise InvalidCard([BuildProblem(f"{where}.config", str(exc) or type(exc).__name__)]) from None


def _resolve(reference: str, field: str, *, want: str) -> tuple[Any, BuildProblem | None]:
    """Import ``reference``; ``want`` is "callable" or "class"."""
    try:
        obj = import_object(reference)
    except (ImportError, AttributeError) as exc:
        return None, BuildProblem(field, f"{reference!r} does not import: {type(exc).__name__}: {exc}")
    if want == "class" and not inspect.isclass(obj):
        return obj, BuildProblem(field, f"{reference!r} is a {type(obj).__name__}, not a class")
    if want == "callable" and not callable(obj):
        return obj, BuildProblem(field, f"{reference!r} is a {type(obj).__name__}, not callable")
    return obj, None


def check_card_builds(card: ModelCard, *, registry: "DeployRegistry | None" = None) -> list[BuildProblem]:
    """Every reason ``card`` would not build, without loading weights; empty when it would.

    Checks the factory, each component's builder (callable) and config (parsed through its
    ``config_schema``), each loop's implementation and state schema (classes), and each
    program class. Components without a ``config_schema`` have their configs left unchecked.
    Names the card gives a deployment to resolve (a registered loop, a sampler) are looked
    up in ``registry``, the deployment's (None: the kernel's built-ins).
    """
    from fv_kernel.plugins.errors import PluginError
    from fv_kernel.plugins.registry import kernel_registry

    names = registry if registry is not None else kernel_registry()
    problems: list[BuildProblem] = []
    checks: list[tuple[str, str, str]] = [(card.factory, "factory", "callable")]
    for cid, comp in card.components.items():
        checks.append((comp.builder, f"components.{cid}.builder", "callable"))
    for lid, loop in card.loops.items():
        lookups = [(names.loop, loop.implementation, f"loops.{lid}.implementation")] if ":" not in loop.implementation else []
        if loop.sampler is not None:
            lookups.append((names.sampler, loop.sampler.name, f"loops.{lid}.sampler.name"))
        for lookup, name, field in lookups:
            try:
                lookup(name)
            except PluginError as exc:
                problems.append(BuildProblem(field, str(exc)))
        if ":" in loop.implementation:
            checks.append((loop.implementation, f"loops.{lid}.implementation", "class"))
        if loop.state_schema is not None:
            checks.append((loop.state_schema, f"loops.{lid}.state_schema", "class"))
    for task, program in card.programs.items():
        if program.implementation is not None:
            checks.append((program.implementation, f"programs.{task.value}.implementation", "class"))
    for reference, field, want in checks:
        _, problem = _resolve(reference, field, want=want)
        if problem is not None:
            problems.append(problem)
    for comp in card.components.values():
        if comp.config_schema is None:
            continue
        _, problem = _resolve(comp.config_schema, f"components.{comp.component_id}.config_schema", want="callable")
        if problem is not None:
            problems.append(problem)
            continue
        try:
            parse_component_config(comp)
        except InvalidCard as exc:
            problems.extend(exc.problems)
    return problems
