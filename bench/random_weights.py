"""A downloadable card rebuilt on seeded random weights of the same architecture, for the benches
that time real-size models without their checkpoints (``bench_cachedit.py``, ``bench_rl_rollout.py``,
``bench_tier_parity.py``)."""

from __future__ import annotations

import torch

from fv_kernel.card.spec import ModelCard

__all__ = ["random_weight_card", "seeded_manifest", "wan_card_for_device"]


def random_weight_card(card: ModelCard) -> ModelCard:
    """``card`` on seeded random weights (no download); an embedded card is returned as it is."""
    if card.checkpoint.source is None:
        return card
    components = {cid: ck.model_copy(update={"random_init_seed": i + 1})
                  for i, (cid, ck) in enumerate(card.checkpoint.components.items())}
    checkpoint = card.checkpoint.model_copy(update={"layout": "embedded", "source": None, "components": components})
    specs = dict(card.components)
    text_dim = int(specs["transformer"].config["text_dim"])
    # The real UMT5-XXL is 5.7B parameters of text encoding that the benchmarks do not time.
    specs["text_encoder"] = specs["text_encoder"].model_copy(update={"config": {"tiny": {"d_model": text_dim, "num_layers": 1}}})
    return card.model_copy(update={"checkpoint": checkpoint, "components": specs})


def seeded_manifest(card: ModelCard) -> ModelCard:
    """``card`` with every checkpoint component marked as seeded random weights: for a bench whose own
    loader builds every component on random weights, so preflight asks for no checkpoint."""
    seeded = {cid: entry.model_copy(update={"random_init_seed": i + 1})
              for i, (cid, entry) in enumerate(card.checkpoint.components.items())}
    return card.model_copy(update={"checkpoint": card.checkpoint.model_copy(update={"components": seeded})})


def wan_card_for_device(model_id: str, device: torch.device) -> ModelCard | None:
    """fv-wan's card ``model_id`` on random weights for a bench run on ``device``; None, after printing
    why, when this machine cannot run it (CUDA asked for but absent, or a real-size card off CUDA).
    An unknown id exits naming the ``--card`` flag and the allowed ids."""
    from fv_wan.cards import wan_cards

    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"skipped: --device {device} asked for CUDA, which this machine does not have")
        return None
    cards = {c.model_id: c for c in wan_cards()}
    if model_id not in cards:
        raise SystemExit(f"--card: unknown card {model_id!r}; allowed: {', '.join(sorted(cards))}")
    card = cards[model_id]
    if card.checkpoint.source is not None and device.type != "cuda":
        print(f"skipped: {model_id} is real-size; run it with --device cuda")
        return None
    return random_weight_card(card)
