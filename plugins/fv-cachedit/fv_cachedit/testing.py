"""The cached interleave gate, as a conformance base class any interceptor plugin can subclass.

PYTEST_DONT_REWRITE: checks report through plain ``assert`` messages built here.

Written against the kernel's public kit only (``InterleaveConformance``,
``ExtensionSet``, ``run_local``), so it can move into ``fv_kernel.testing.card_kit``
unchanged apart from its import lines::

    from fv_cachedit.testing import CachedInterleaveConformance
    from fv_cachedit import DBCache

    class TestDBCacheInterleave(CachedInterleaveConformance):
        card_ids = ["wan-tiny"]
        interceptors = {"dbcache": DBCache}
        plugin_params = {"dbcache": {"fn_compute_blocks": 1, "residual_diff_threshold": 0.5, "max_warmup_steps": 1}}
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping, Sequence

import torch

from fv_kernel.api import Engine, ExtensionSet, ModelCard, Request, run_local
from fv_kernel.testing.card_kit import InterleaveConformance

__all__ = ["CachedInterleaveConformance"]


class CachedInterleaveConformance(InterleaveConformance):
    """The interleave gate with interceptors on: N requests with caching enabled, interleaved
    and batched through the Engine, are bit-identical to the same requests run serially.

    Set :attr:`card_ids`, :attr:`interceptors` (plugin id -> class, as the deploy config's
    ``extensions:`` enables them) and :attr:`plugin_params` (what every gate request sends).
    The gate also checks that the parameters really change the output on at least one
    request (an interceptor that never fires would pass the gate vacuously), unless
    :attr:`require_effect` is False.
    """

    interceptors: ClassVar[Mapping[str, type]] = {}
    #: Deploy-time settings per plugin id (``ExtensionSettings`` fields: ``default_on``, ``config``).
    extension_settings: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    plugin_params: ClassVar[Mapping[str, Mapping[str, Any]]] = {}
    require_effect: ClassVar[bool] = True

    def make_extensions(self) -> ExtensionSet:
        assert self.interceptors, "set interceptors (plugin id -> class) on the cached interleave conformance class"
        settings = {name: dict(self.extension_settings.get(name, {})) for name in self.interceptors}
        return ExtensionSet.build(settings, dict(self.interceptors))

    def make_engine(self, cards: Sequence[ModelCard]) -> Engine:
        engine = Engine(self.scheduler, extensions=self.make_extensions())
        for card in cards:
            engine.add_instance(self.build(card))
        return engine

    def gate_requests(self, cards: Sequence[ModelCard], prefix: str) -> list[Request]:
        params = {name: dict(values) for name, values in self.plugin_params.items()}
        return [r.with_updates(plugin_params=params) for r in super().gate_requests(cards, prefix)]

    def test_interceptor_changes_the_output(self) -> None:
        if not self.require_effect:
            return
        cards = [self.load_card(m) for m in self.card_ids]
        extensions = self.make_extensions()
        changed = []
        for card in cards:
            instance = self.build(card)
            for request in self.gate_requests([card], "effect-"):
                cached = run_local(request, instance, extensions=extensions)
                plain = run_local(request.with_updates(plugin_params={}), instance)
                changed.append(any(_differs(a, b) for a, b in zip(cached, plain)))
        assert any(changed), (
            f"plugin_params {dict(self.plugin_params)} never changed an output on {list(self.card_ids)}: "
            "the interleave gate would pass without the interceptor doing anything"
        )


def _differs(a: Any, b: Any) -> bool:
    da, db = a.to_dict(), b.to_dict()
    return any(isinstance(v, torch.Tensor) and not torch.equal(v, db[k]) for k, v in da.items() if k != "provenance")

