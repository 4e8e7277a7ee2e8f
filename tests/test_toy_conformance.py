"""The kernel's toy cards pass the card, loop and interleave conformance kits (the kits' own proof)."""

from __future__ import annotations

from fv_kernel.card.spec import ModelCard
from fv_kernel.testing import CardConformance, InterleaveConformance
from fv_kernel.testing.toy import toy_card


class _ToyCards:
    card_ids = ("toy-dit", "toy-lm", "toy-omni")

    def load_card(self, model_id: str) -> ModelCard:
        return toy_card(model_id)


class TestToyCardConformance(_ToyCards, CardConformance):
    pass


class TestToyInterleaveGate(_ToyCards, InterleaveConformance):
    pass


# --------------------------------------------------------------------------- resume (issue 12)
from typing import Sequence  # noqa: E402

from fv_kernel.request.request import ARParams, Request  # noqa: E402
from fv_kernel.request.types import TaskType  # noqa: E402
from fv_kernel.testing import ResumeConformance  # noqa: E402


class TestToyResume(_ToyCards, ResumeConformance):
    """Every loop of every toy card, checkpointed mid-loop, resumes in a fresh process bit-identically."""

    def requests_for(self, card: ModelCard, *, seeds: Sequence[int] = (0,), prefix: str = "") -> list[Request]:
        requests = super().requests_for(card, seeds=seeds, prefix=prefix)
        if card.model_id == "toy-omni":  # the custom program's other branch: rewrite the prompt, then generate
            t2v = next(r for r in requests if r.task is TaskType.TEXT_TO_VIDEO)
            requests.append(t2v.with_updates(request_id=f"{t2v.request_id}-upsampled", prompt_upsampling=True,
                                             ar=ARParams(max_tokens=4, temperature=0.8, top_k=20, seed=1)))
        return requests
