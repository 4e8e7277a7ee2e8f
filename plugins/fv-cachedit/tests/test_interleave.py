"""The cached interleave gate (``fv_kernel.testing.CachedInterleaveConformance``) on the kernel's
toy card and on wan-tiny: varied requests with caching on, interleaved and batched through the
Engine, are bit-identical to each request run alone on a fresh instance with fresh interceptors."""

from __future__ import annotations

from typing import Sequence

from cachedit_testutils import any_card

from fv_cachedit import DBCache, TaylorSeer
from fv_kernel.testing import CachedInterleaveConformance
from fv_kernel.card.spec import ModelCard


class _TinyRequests:
    card_ids: Sequence[str] = ()
    # Enough steps for the caches to warm up and then skip (the gate runs 10 and 11).
    steps = 10

    def load_card(self, model_id: str) -> ModelCard:
        return any_card(model_id)


class TestDBCacheInterleaveToy(_TinyRequests, CachedInterleaveConformance):
    card_ids = ["toy-dit"]
    concurrency = 3
    interceptors = {"dbcache": DBCache}
    extension_settings = {"dbcache": {"config": {"fn_compute_blocks": 1, "max_warmup_steps": 2}}}
    plugin_params = {"dbcache": {"residual_diff_threshold": 0.3}}


class TestTaylorSeerInterleaveWan(_TinyRequests, CachedInterleaveConformance):
    card_ids = ["wan-tiny"]
    interceptors = {"taylorseer": TaylorSeer}
    extension_settings = {"taylorseer": {"config": {"fn_compute_blocks": 1, "max_warmup_steps": 3}}}
    plugin_params = {"taylorseer": {"residual_diff_threshold": 0.3, "taylorseer_order": 2}}


class _SharedStateDBCache(DBCache):
    """What every cache fork outside fv does: one state per model, shared by all requests."""

    plugin_id = "dbcache"

    def __init__(self, config: object = None) -> None:
        super().__init__(config)  # type: ignore[arg-type]
        self.shared: dict[str, dict[str, object]] = {}

    def run_blocks(self, blocks, hidden, state, params, call):  # type: ignore[no-untyped-def]
        return super().run_blocks(blocks, hidden, self.shared.setdefault(call.branch, {}), params, call)


def test_the_gate_catches_a_cache_whose_state_is_shared_between_requests() -> None:
    class Gate(TestDBCacheInterleaveToy):
        interceptors = {"dbcache": _SharedStateDBCache}

    try:
        Gate().test_interleaved_equals_each_alone()
    except AssertionError as exc:
        assert "interleaved vs alone on a fresh instance" in str(exc)
    else:  # pragma: no cover - the gate failed to notice
        raise AssertionError("the cached interleave gate passed with state shared across requests")
