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


# --------------------------------------------------------------------------- resume (issue 12)
from typing import Sequence  # noqa: E402

import torch  # noqa: E402

from fv_kernel.api import ActionPart, ARParams, ImagePart, ModelCard, VideoPart  # noqa: E402
from fv_kernel.testing import ResumeConformance  # noqa: E402


def resume_requests_for_every_task(card: ModelCard, prefix: str = "") -> list[Request]:
    """One small request per task of cosmos3-tiny, plus prompt upsampling and the Euler denoise loop."""
    d = card.capabilities.defaults
    assert d is not None
    image = torch.rand(3, d.height, d.width, generator=torch.Generator().manual_seed(0))
    clip = torch.rand(d.frames, 3, d.height, d.width, generator=torch.Generator().manual_seed(1))
    actions = torch.rand(4, 6, generator=torch.Generator().manual_seed(2))
    text = (TextPart(text="a robot arm stacks cubes"), TextPart(text="blurry", role="negative_prompt"))
    fast = DiffusionParams(steps=2, seed=5)
    T = TaskType

    def req(name: str, task: TaskType, *parts: object, **changes: object) -> Request:
        return Request(request_id=f"{prefix}cosmos3-tiny-{name}", model=card.model_id, task=task,
                       inputs=(*text, *parts), diffusion=changes.pop("diffusion", fast), **changes)  # type: ignore[arg-type]

    return [
        req("t2v", T.TEXT_TO_VIDEO),
        # 6 reasoner tokens: mid-decode K/V restores at every one; the card's 24 cost the kit's every-step
        # resume (one replay per checkpoint) about a minute for nothing more.
        req("t2v-upsampled", T.TEXT_TO_VIDEO, prompt_upsampling=True, ar=ARParams(max_tokens=6, seed=4)),
        req("t2i-euler", T.TEXT_TO_IMAGE, diffusion=fast.model_copy(update={"sampler": "euler"})),
        req("i2v", T.IMAGE_TO_VIDEO, ImagePart(image=image)),
        req("text", T.TEXT_GENERATION, ar=ARParams(max_tokens=6, temperature=0.8, top_k=20, seed=3)),
        req("t2v-sound", T.TEXT_TO_VIDEO_AUDIO),  # fans out to the video and sound decoders
        req("policy", T.ACTION_POLICY, ImagePart(image=image)),
        req("forward", T.FORWARD_DYNAMICS, ImagePart(image=image), ActionPart(actions=actions, domain=1)),
        req("inverse", T.INVERSE_DYNAMICS, VideoPart(frames=clip, fps=24.0)),
    ]


class TestCosmos3Resume(ResumeConformance):
    """Every loop of cosmos3-tiny (reasoner decode with its paged K/V, both denoise loops, both decoders),
    checkpointed mid-loop for every task, resumes in a fresh process bit-identically."""

    card_ids = ["cosmos3-tiny"]

    def requests_for(self, card: ModelCard, *, seeds: Sequence[int] = (0,), prefix: str = "") -> list[Request]:
        return resume_requests_for_every_task(card, prefix)
