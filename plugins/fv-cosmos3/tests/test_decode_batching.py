"""Concurrent chat requests' token steps, through the path ``bench/bench_cosmos3.py``'s decode section takes.

Issue 36 §1: on an H100, 8 concurrent chat requests on cosmos3-nano decoded at 1.1x the tokens per second of
one at a time, although the bench reported "largest batch 8". The scheduler did group the 8 requests'
``ar_token`` units, but the executor fuses a card's steps only where the card declares
``parity.batched_vs_alone`` at the instance's precision, and cosmos3-nano declares none: each group ran as 8
calls of one row (8 bucket-1 graph replays per token). The bench now reports rows per call and the graph
shapes replayed, and measures the fused run under a declaring copy of the card (``batch8_fused``).
CPU, fp32, cosmos3-tiny with random weights; the graphed tier's static step runs eagerly (``capture=False``).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Iterator

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import bench_cosmos3 as bench  # noqa: E402

from fv_cosmos3.cards import cosmos3_card
from fv_cosmos3.graphed_decode import GraphedDecode
from fv_cosmos3.instance import Cosmos3Instance
from fv_kernel.api import ARParams, ModelCard, Request, TaskType, TextPart

PROMPTS = ["a fox", "a boat drifting on a calm lake", "snow", "city lights at night in the rain", "a dog", "waves",
           "a bird over a field of wheat", "a slow train"]
TOKENS = 6


def _bench() -> bench.Bench:
    args = argparse.Namespace(smoke=True, card="cosmos3-tiny", device="cpu", repeats=1, concurrent=2, decode_tokens=4,
                              upsample_tokens=4, profile=None)
    return bench.Bench(args)


def _undeclared(card: ModelCard) -> ModelCard:
    """``card`` promising nothing about batching, as cosmos3-nano and -super do (at any precision, today)."""
    return card.model_copy(update={"parity": card.parity.model_copy(update={"batched_vs_alone": ()})})


def _chat(prefix: str) -> list[Request]:
    return [Request(request_id=f"{prefix}{i}", model="cosmos3-tiny", task=TaskType.TEXT_GENERATION,
                    inputs=(TextPart(text=text),),
                    ar=ARParams(max_tokens=TOKENS, temperature=0.8, top_k=20, seed=i, stop_token_ids=()))
            for i, text in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def b() -> Iterator[bench.Bench]:
    # One intra-op thread, as the bench runs on the CPU: tiny ops on a shared 2-core machine are ~10x slower with two.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield _bench()
    finally:
        torch.set_num_threads(threads)


def _graphed_instance(b: bench.Bench, card: ModelCard) -> tuple[Cosmos3Instance, GraphedDecode]:
    instance = bench.random_instance(b, card)
    graphed = GraphedDecode(capture=False)
    instance.graphed_decode = graphed
    return instance, graphed


def test_nano_promises_its_token_steps_at_bf16_and_super_nothing():
    """The cause was on the cards: no ``batched_vs_alone`` at bf16. Nano now promises its token step only
    (measured on an H100), with text that may diverge; super, not measured, still promises nothing."""
    nano = cosmos3_card("cosmos3-nano")
    promise = nano.parity.batching_tolerance("bf16")
    assert promise is not None and promise.ops == ("ar_token",) and promise.text == "may_diverge"
    assert promise.covers("ar_token") and not promise.covers("generate") and promise.max_abs == 0.0
    super_card = cosmos3_card("cosmos3-super")
    assert super_card.parity.batching_tolerance(super_card.precision.default) is None
    tiny = cosmos3_card("cosmos3-tiny")
    assert tiny.parity.batching_tolerance(tiny.precision.default) is not None


def test_a_declaring_card_decodes_eight_concurrent_requests_as_one_graphed_call_per_token(b):
    """Every token step of the 8 requests is one replay of 8 live rows in bucket 8, and each request's text is the
    one it decodes alone (fp32 on the CPU, the tiny card's promise)."""
    instance, graphed = _graphed_instance(b, cosmos3_card("cosmos3-tiny"))
    batched = bench._engine_run(b, instance, _chat("b-"), batched=True)
    assert graphed.replayed_shapes == Counter({(8, 8): TOKENS - 1})  # the first token comes from the prefill
    assert batched["call_rows"]["ar_token"] == {"8": TOKENS - 1}
    alone = bench._engine_run(b, instance, _chat("s-"), batched=False)
    assert alone["call_rows"]["ar_token"] == {"1": len(PROMPTS) * (TOKENS - 1)}
    assert batched["_token_ids"] == alone["_token_ids"] and all(len(t) == TOKENS for t in batched["_token_ids"])


def test_without_a_declaration_the_scheduled_batch_of_eight_runs_row_by_row(b):
    """Negative control, and the H100 run's reading: the scheduler's batches are still 8 units (what the record's
    "largest batch 8" counted), but every row is its own call, a bucket-1 replay. Under a declaring copy of the
    card, the same run is one 8-row replay per token again; the instance's card is restored after it."""
    card = _undeclared(cosmos3_card("cosmos3-tiny"))
    instance, graphed = _graphed_instance(b, card)
    run = bench._engine_run(b, instance, _chat("u-"), batched=True)
    assert run["batch_sizes"]["ar_token"] == {"8": TOKENS - 1} and run["largest_batch"]["ar_token"] == 8
    assert run["call_rows"]["ar_token"] == {"1": len(PROMPTS) * (TOKENS - 1)}
    assert graphed.replayed_shapes == Counter({(1, 1): len(PROMPTS) * (TOKENS - 1)})
    graphed.replayed_shapes.clear()
    before = instance.card
    with bench._batching_declared(instance):
        assert bench._declares_batching(instance)
        fused = bench._engine_run(b, instance, _chat("f-"), batched=True)
    assert instance.card is before and not bench._declares_batching(instance)
    assert fused["call_rows"]["ar_token"] == {"8": TOKENS - 1}
    assert graphed.replayed_shapes == Counter({(8, 8): TOKENS - 1})
    assert fused["_token_ids"] == run["_token_ids"]


def test_the_decode_section_reports_the_unfused_batch_and_measures_the_fused_one(b):
    """``bench_decode`` on a card without a declaration: ``batch8`` says it ran one row per call, ``batch8_fused``
    ran 8 rows per call on both tiers, and one fused step's logits match each row alone (fp32)."""
    instance = bench.random_instance(b, _undeclared(cosmos3_card("cosmos3-tiny")))
    out = bench.bench_decode(b, instance)
    assert out["batching_declared"] is False
    for tier in ("eager", "graphed"):
        t = out[tier]
        assert set(t["batch8"]["call_rows"]["ar_token"]) == {"1"}, tier
        assert set(t["batch8_fused"]["call_rows"]["ar_token"]) == {"8"}, tier
        assert t["batch8_fused"]["same_text_as_batch1"] == len(PROMPTS), tier
        one = t["one_step_fused_vs_alone"]
        assert one["rows"] == 8 and one["logits_max_abs"] <= 1e-5 and one["same_greedy_token_rows"] == 8, (tier, one)
    assert set(out["graphed"]["batch8"]["replayed_rows_bucket"]) == {"1/1"}
    assert set(out["graphed"]["batch8_fused"]["replayed_rows_bucket"]) == {"8/8"}
    assert out["graphed"]["batch8_fused"]["captures"] == 0  # the warm-up captured bucket 8 under the declaration
    assert "graphed_vs_eager_batch8_fused" in out
    rows = dict(bench._rows({"decode": out, "memory": bench.bench_memory(b)}))
    assert any("batch 8 fused" in name for name in rows)
