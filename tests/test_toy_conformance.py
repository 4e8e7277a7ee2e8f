"""The kernel's toy cards pass the card, loop and interleave conformance kits (the kits' own proof).

The interleave gate's negative controls (buggy toy cards it must fail) are in
``test_interleave_gate.py``."""

from __future__ import annotations

from typing import Sequence

import pytest

from fv_kernel.card.spec import ModelCard
from fv_kernel.request.request import ARParams, Request
from fv_kernel.request.types import TaskType
from fv_kernel.testing import CardConformance, InterleaveConformance, ResumeConformance
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
@pytest.mark.usefixtures("one_intra_op_thread")
class TestToyResume(_ToyCards, ResumeConformance):
    """Every loop of every toy card, checkpointed mid-loop, resumes in a fresh process bit-identically."""

    def requests_for(self, card: ModelCard, *, seeds: Sequence[int] = (0,), prefix: str = "") -> list[Request]:
        requests = super().requests_for(card, seeds=seeds, prefix=prefix)
        if card.model_id == "toy-omni":  # the custom program's other branch: rewrite the prompt, then generate
            t2v = next(r for r in requests if r.task is TaskType.TEXT_TO_VIDEO)
            requests.append(t2v.with_updates(request_id=f"{t2v.request_id}-upsampled", prompt_upsampling=True,
                                             ar=ARParams(max_tokens=4, temperature=0.8, top_k=20, seed=1)))
        return requests
