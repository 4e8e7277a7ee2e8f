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
