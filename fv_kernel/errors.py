"""Typed errors of the model plane and the runtime.

Every error a user can cause names the field it is about and, where there is a
finite set, the allowed values. Products map them to structured responses
(``{"error": {"type", "message", "param"}}``) through :meth:`FvError.info`.
"""

from __future__ import annotations

import difflib
from typing import Any, Iterable

__all__ = [
    "FvError",
    "InvalidRequest",
    "UnknownModel",
    "RecipeMismatch",
    "UnknownAdapter",
    "AdapterFileError",
    "CheckpointKeyError",
    "CheckpointNotFound",
    "CapacityError",
    "QueueFull",
    "StepFailed",
    "NonFiniteOutput",
    "RequestCancelled",
]


class FvError(Exception):
    """Base of fv's typed errors."""

    error_type: str = "fv_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def info(self) -> dict[str, Any]:
        return {"type": self.error_type, "message": self.message, "param": self.param}


class InvalidRequest(FvError, ValueError):
    """A request field has a value the card or deployment does not accept."""

    error_type = "invalid_request"

    def __init__(self, param: str, message: str, *, allowed: Iterable[Any] | str | None = None) -> None:
        if allowed is not None:
            allowed_text = allowed if isinstance(allowed, str) else ", ".join(str(a) for a in allowed)
            message = f"{message}; allowed: {allowed_text}"
        super().__init__(f"{param}: {message}", param=param)
        self.allowed = allowed


class UnknownModel(InvalidRequest):
    """A model id no installed (or served) card has; the message offers the closest ids first."""

    error_type = "unknown_model"

    def __init__(self, model: str, known: Iterable[str]) -> None:
        known = sorted(known)
        #: The known ids closest to ``model`` (a typo's likely target), best first.
        self.suggestions: list[str] = difflib.get_close_matches(model, known, n=3, cutoff=0.6)
        names = [repr(s) for s in self.suggestions]
        hint = f" (did you mean {' or '.join(filter(None, [', '.join(names[:-1]), names[-1]]))}?)" if names else ""
        super().__init__("model", f"unknown card {model!r}{hint}", allowed=known or "none installed")


class RecipeMismatch(InvalidRequest):
    """A request asks a card to run a loop or precision its recipe did not bake in (design §4.2)."""

    error_type = "recipe_mismatch"

    def __init__(self, param: str, *, model_id: str, method: str, assumes: str, asked: str, subject: str | None = None) -> None:
        # ``subject``: what assumes it when not the card's own recipe (a distilled adapter).
        who = subject or f"card {model_id!r} (recipe {method!r})"
        FvError.__init__(self, f"{param}: {who} assumes {assumes}; the request asked for {asked}", param=param)
        self.allowed = assumes
        self.assumes = assumes
        self.asked = asked


class UnknownAdapter(InvalidRequest):
    """A request (or a card's default stack) names an adapter the deployment has not registered."""

    error_type = "unknown_adapter"

    def __init__(self, name: str, known: Iterable[str], *, param: str = "adapters") -> None:
        known = sorted(known)
        #: The registered names closest to ``name``, best first.
        self.suggestions: list[str] = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
        hint = f" (did you mean {' or '.join(repr(s) for s in self.suggestions)}?)" if self.suggestions else ""
        super().__init__(param, f"unknown adapter {name!r}{hint}", allowed=known or "none registered")
        self.name = name


class AdapterFileError(FvError, ValueError):
    """An adapter file (or upload) that cannot be registered: unreadable, too large, a bad name or path."""

    error_type = "invalid_adapter_file"

    def __init__(self, message: str, *, param: str = "adapters") -> None:
        super().__init__(message, param=param)


class CheckpointKeyError(FvError, KeyError):
    """A state dict does not match the module: lists missing and unexpected keys."""

    error_type = "checkpoint_keys"

    def __init__(self, component: str, missing: list[str], unexpected: list[str]) -> None:
        def summary(keys: list[str]) -> str:
            shown = ", ".join(keys[:8])
            return shown + (f", ... ({len(keys) - 8} more)" if len(keys) > 8 else "")

        parts = []
        if missing:
            parts.append(f"{len(missing)} missing key(s): {summary(missing)}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected key(s): {summary(unexpected)}")
        super().__init__(f"component {component!r}: " + "; ".join(parts), param=component)
        self.missing = missing
        self.unexpected = unexpected

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.message


class CheckpointNotFound(FvError, FileNotFoundError):
    error_type = "checkpoint_not_found"


class CapacityError(FvError):
    """A unit of work can never fit the deployment's budgets."""

    error_type = "capacity"


class QueueFull(FvError):
    error_type = "queue_full"

    def __init__(self, limit: int, retry_after_s: float = 1.0) -> None:
        super().__init__(f"the queue holds its maximum of {limit} requests; retry later")
        self.retry_after_s = retry_after_s


class StepFailed(FvError):
    """One request's step raised; only that request is aborted."""

    error_type = "step_failed"


class NonFiniteOutput(StepFailed):
    error_type = "non_finite"


class RequestCancelled(FvError):
    error_type = "cancelled"
