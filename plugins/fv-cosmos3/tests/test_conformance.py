"""Card/loop conformance, the kit's interleave gate, and the issue's omni gate:
two omni requests (prompt upsampling -> T2V) and one plain T2V request interleaved
through the Engine are bit-identical to the same requests run serially."""

from __future__ import annotations

from fv_cosmos3.cards import cosmos3_card
from fv_kernel.api import DiffusionParams, Engine, Request, SchedulerConfig, TaskType, TextPart, build_instance
from fv_kernel.runtime.engine import run_concurrently, run_serially
from fv_kernel.testing import CardConformance, InterleaveConformance
from fv_kernel.testing.card_kit import assert_artifacts_identical


class TestCosmos3Cards(CardConformance):  # cards looked up through the installed plugin
    card_ids = ["cosmos3-tiny"]
    validate_only_ids = ["cosmos3-nano", "cosmos3-super"]


class TestCosmos3Interleave(InterleaveConformance):
    card_ids = ["cosmos3-tiny"]


def _gate_requests(prefix: str) -> list[Request]:
    def t2v(name: str, seed: int, text: str, upsample: bool) -> Request:
        return Request(
            request_id=f"{prefix}{name}", model="cosmos3-tiny", task=TaskType.TEXT_TO_VIDEO,
            inputs=(TextPart(text=text),), prompt_upsampling=upsample, diffusion=DiffusionParams(seed=seed),
        )

    return [t2v("omni-a", 1, "a fox in snow", True), t2v("omni-b", 2, "a boat at dawn", True),
            t2v("plain", 3, "a city at night", False)]


def test_omni_gate_interleaved_equals_serial():
    card = cosmos3_card("cosmos3-tiny")

    def engine() -> Engine:
        e = Engine(SchedulerConfig())
        e.add_instance(build_instance(card))
        return e

    serial = run_serially(engine(), _gate_requests("s-"))
    interleaved_engine = engine()
    interleaved = run_concurrently(interleaved_engine, _gate_requests("i-"))
    # The two omni requests' ar_token steps ran as one group at different context lengths.
    assert interleaved_engine.metrics.units_by_kind.get("ar_token", 0) > 0
    assert max(interleaved_engine.metrics.batches_by_size) > 1
    for s, c in zip(serial, interleaved):
        assert s.status == c.status == "completed", (s.error, c.error)
        assert_artifacts_identical(s.artifacts, c.artifacts, what=f"{c.request_id} interleaved vs serial")
    omni = interleaved[0].artifacts
    assert [a.kind for a in omni] == ["text", "video"] and omni[0].name == "upsampled_prompt"
    assert [a.kind for a in interleaved[2].artifacts] == ["video"]
    pool = interleaved_engine.instances["cosmos3-tiny"].text_kv_pool
    assert pool.used_blocks == 0  # every request's blocks went back
