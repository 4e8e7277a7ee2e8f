"""Interceptors: plugins that may alter compute (design §11).

An interceptor's per-request state lives in ``LoopState.plugin_state[plugin_id][branch]``
(never on the interceptor or the model), so interleaved requests cannot see each
other's caches. Interceptors are enabled at deploy scope only; a request can only
parameterise an enabled one through its validated ``request_model``.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict

__all__ = ["Interceptor", "InterceptorClass", "NoParams"]

#: What an interceptor does to a loop; cards may refuse a class (e.g. few-step loops refuse step skipping).
InterceptorClass = Literal["step_skip", "block_cache"]


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Interceptor(abc.ABC):
    """Base of the plugin contribution kind ``interceptors``."""

    #: The plugin id under which its state is kept in ``LoopState.plugin_state``.
    plugin_id: ClassVar[str]
    interceptor_class: ClassVar[InterceptorClass]
    #: Deploy-time configuration schema (the ``extensions:`` entry of the deploy config).
    config_model: ClassVar[type[BaseModel]] = NoParams
    #: Per-request parameter schema (``Request.plugin_params[plugin_id]``).
    request_model: ClassVar[type[BaseModel]] = NoParams
    #: Plugin ids this interceptor cannot be enabled together with.
    conflicts_with: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, config: BaseModel | None = None) -> None:
        self.config = config if config is not None else self.config_model()

    @abc.abstractmethod
    def distribution_altering(self, params: BaseModel) -> bool:
        """Whether these request parameters can change the output distribution (exact mode refuses them)."""

    def parse_params(self, raw: dict[str, Any] | None) -> BaseModel:
        """Validate a request's parameters for this interceptor (unknown fields rejected)."""
        return self.request_model.model_validate(raw or {})
