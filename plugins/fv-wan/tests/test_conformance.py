"""The kernel's conformance kit on fv-wan: plugin packaging, every card, loop contract, LoopState
round-trip, and the interleave gate (concurrent varied requests == each request alone on a fresh instance)."""

from __future__ import annotations

from fv_kernel.testing import CardConformance, InterleaveConformance, PluginConformance
from fv_wan.cards import TINY_CARD_IDS, wan_cards

REAL_CARD_IDS = tuple(card.model_id for card in wan_cards() if card.model_id not in TINY_CARD_IDS)


def test_every_card_is_either_run_or_validated() -> None:
    assert len(REAL_CARD_IDS) == 7 and len(TINY_CARD_IDS) == 5
    assert {c.model_id for c in wan_cards()} == set(TINY_CARD_IDS) | set(REAL_CARD_IDS)


class TestWanPlugin(PluginConformance):
    distribution = "fv-wan"


class _ThreeSteps:
    """The kit's sample requests at 3 denoise steps (cards default to 6-8) to keep the suite fast
    (the interleave gate runs 3 and 4; fastwan-tiny keeps its recipe's fixed 3).

    3 steps still reach every path: UniPC's predictor and corrector, and on wan-tiny-a14b
    (shift 12) both experts (t = 999, 960, 857 against the 875 boundary).
    """

    steps = 3


class TestWanCards(_ThreeSteps, CardConformance):
    # Tiny cards run end to end on CPU (every loop, every task); real sizes are validated, never built.
    card_ids = TINY_CARD_IDS
    validate_only_ids = REAL_CARD_IDS


class TestWanInterleave(_ThreeSteps, InterleaveConformance):
    # wan-tiny T2V and T2I, and wan-tiny-i2v (CLIP + VAE encode + 36-channel denoise): per task two requests
    # at the default size and two at a smaller one, differing in prompt, negative prompt, seed, steps
    # (3, 4) and guidance (5, 6), all at once through one Engine, batched across requests, against
    # each request run alone on a fresh instance.
    card_ids = ["wan-tiny", "wan-tiny-i2v"]


# --------------------------------------------------------------------------- resume (issue 12)
from fv_kernel.testing import ResumeConformance  # noqa: E402


class TestWanResume(_ThreeSteps, ResumeConformance):
    # Every tiny card, every task the kit builds: each loop (text/image encode, denoise incl. both
    # experts' routing and UniPC history, the chunked VAE decode with its causal cache) checkpointed
    # mid-loop and resumed in one fresh process, bit-identical to the uninterrupted run.
    card_ids = TINY_CARD_IDS
