"""Shared by the shipped tier-parity record tests: what ``select_compute_tiers`` makes of a record for a Wan card."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fv_kernel.api import ComputeOptions, select_compute_tiers
from fv_wan.cards import wan_cards

RECORDS = Path(__file__).resolve().parents[3] / "bench" / "records"
CARDS = {c.model_id: c for c in wan_cards()}


def select_with_record(record: Path, model_id: str, **compute: Any) -> Any:
    """The tiers ``compute`` (with ``parity_record=record``) resolves to for ``model_id`` on CUDA in bf16,
    under the card's own attention."""
    card = CARDS[model_id]
    assumed = card.recipe.assumes_attention
    return select_compute_tiers(ComputeOptions(parity_record=record, **compute), card, device="cuda", precision="bf16",
                                attention_backend="sdpa" if assumed is None else assumed.kind)
