"""The graphed reasoner decode step captured and replayed on a GPU (skipped without CUDA)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from bench_ar_token import CONFIGS, DecodeBench  # noqa: E402

from fv_cosmos3.graphed_decode import GraphedDecode
from fv_kernel.api import PagedKVPool

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA-graph capture needs a CUDA device")


def _on_cuda(bench: DecodeBench) -> DecodeBench:
    """The bench's weights and pool moved to the GPU: same geometry, tables and contents."""
    bench.mot = bench.mot.to("cuda")
    old = bench.pool
    pool = PagedKVPool(old.config.model_copy(update={"device": "cuda"}))
    pool._free, pool._owner_of = list(old._free), dict(old._owner_of)
    keys, values = old.storage()
    pool._keys, pool._values = keys.to("cuda"), values.to("cuda")
    bench.pool = pool
    return bench


@pytest.mark.parametrize("rows", [1, 3])
def test_captured_steps_replay_and_follow_the_eager_step(rows):
    eager = _on_cuda(DecodeBench.build(CONFIGS["tiny"], rows, history=42, steps=10, seed=3))
    graph = _on_cuda(DecodeBench.build(CONFIGS["tiny"], rows, history=42, steps=10, seed=3))
    eager.ar_token = _cuda_op(eager)
    graphed = GraphedDecode((1, 2, 4, 8), min_context=48)  # captures: the pool is on CUDA
    for _ in range(10):
        with torch.inference_mode():
            expected = eager.ar_token({"token": eager.token.cuda(), "table": eager.table_ids,
                                       "length": torch.tensor(eager.lengths)}, {})["logits"]
            actual = graphed.run(graph.mot, graph.pool, "v1", {"token": graph.token, "table": graph.table_ids,
                                                                "length": torch.tensor(graph.lengths)})
        assert actual is not None
        torch.testing.assert_close(actual["logits"], expected, rtol=0, atol=1e-4)
        for bench, logits in ((eager, expected), (graph, actual["logits"])):
            bench.token = logits.argmax(-1, keepdim=True).cpu()
            bench.lengths = [n + 1 for n in bench.lengths]
        assert torch.equal(graph.token, eager.token)
    assert graphed.captures == 2 and graphed.replays == 10  # two context buckets (48, 64), one batch bucket
    assert all(entry.graph is not None for entry in graphed._entries.values())
    graphed.run(graph.mot, graph.pool, "v2", {"token": graph.token, "table": graph.table_ids,
                                              "length": torch.tensor(graph.lengths)})
    assert [k.weights_version for k in graphed.keys()] == ["v2"]


def _cuda_op(bench: DecodeBench):
    from fv_cosmos3.cards import cosmos3_card
    from fv_cosmos3.instance import Cosmos3Instance, cosmos3_ops
    from fv_kernel.api import InstanceOptions

    instance = Cosmos3Instance(card=cosmos3_card("cosmos3-tiny"), options=InstanceOptions(device="cuda"),
                               component_loader=lambda component_id: None, ops_builder=cosmos3_ops,
                               components={"transformer": bench.mot}, text_kv_pool=bench.pool)
    return cosmos3_ops(instance)["ar_token"].fn


def test_packing_on_the_gpu_takes_no_memory_and_the_capture_follows_an_in_place_change():
    """The packed q/k/v and gate/up tensors replace the parameters' own (the old ones are freed: allocated memory
    does not grow), and a captured graph reads the parameters themselves: an in-place change with no version bump
    or recapture (what an adapter merge does) reaches the replayed step."""
    from fv_cosmos3.graphed_decode import pack_weights, packing_intact

    graph = _on_cuda(DecodeBench.build(CONFIGS["tiny"], 1, history=42, steps=4, seed=5))
    eager = _on_cuda(DecodeBench.build(CONFIGS["tiny"], 1, history=42, steps=4, seed=5))
    eager.ar_token = _cuda_op(eager)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    packed = pack_weights(graph.mot)
    assert packed and packing_intact(packed) and torch.cuda.memory_allocated() <= allocated
    graphed = GraphedDecode((1,), min_context=48)

    def logits() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.inference_mode():
            inputs = {"token": graph.token, "table": graph.table_ids, "length": torch.tensor(graph.lengths)}
            actual = graphed.run(graph.mot, graph.pool, "v1", inputs)
            expected = eager.ar_token({"token": eager.token.cuda(), "table": eager.table_ids,
                                       "length": torch.tensor(eager.lengths)}, {})["logits"]
        assert actual is not None
        return actual["logits"], expected

    before, expected = logits()
    torch.testing.assert_close(before, expected, rtol=0, atol=1e-4)
    with torch.no_grad():
        for bench in (graph, eager):
            bench.mot.layers[1].self_attn.to_k.weight.mul_(1.5)
            bench.mot.layers[0].mlp.up_proj.weight.add_(0.05)
    actual, expected = logits()
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-4)
    assert (actual - before).abs().max() > 1e-2  # the change is visible: a stale copy would have failed above
    assert graphed.captures == 1 and all(entry.graph is not None for entry in graphed._entries.values())


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_chained_steps_replay_the_captures_and_sample_the_one_token_steps_tokens(temperature):
    """cosmos3-tiny on CUDA with graphs, through the Engine: 8 tokens per scheduled step give the tokens of one
    token per step (the same captures, sub-steps fed on the device)."""
    from fv_cosmos3.cards import cosmos3_card
    from fv_kernel.api import (ARParams, ComputeOptions, Engine, InstanceOptions, Request, SchedulerConfig, TaskType,
                               TextPart, build_instance, run_serially)

    def tokens(chain: int) -> tuple[list[list[int]], int]:
        instance = build_instance(cosmos3_card("cosmos3-tiny"), InstanceOptions(device="cuda", compute=ComputeOptions(
            cuda_graphs=True, decode_tokens_per_step=chain)))
        engine = Engine(SchedulerConfig(device_thread=False))
        engine.add_instance(instance)
        requests = [Request(request_id=f"r{i}", model="cosmos3-tiny", task=TaskType.TEXT_GENERATION,
                            inputs=(TextPart(text=prompt),),
                            ar=ARParams(max_tokens=40, temperature=temperature, top_k=16, presence_penalty=1.0,
                                        seed=i, stop_token_ids=()))
                    for i, prompt in enumerate(["a fox", "a boat drifting on a calm lake"])]
        results = run_serially(engine, requests)
        assert all(r.status == "completed" for r in results), [r.error for r in results]
        ids = [next(list(a.token_ids) for a in r.artifacts if a.kind == "text") for r in results]
        return ids, instance.graphed_decode.replays

    one, one_replays = tokens(1)
    chained, chained_replays = tokens(8)
    assert chained == one
    assert one_replays > 0 and chained_replays >= one_replays  # every sub-step a replay (past a stop token too)


def test_the_prompt_prefill_is_captured_and_follows_the_eager_prefill():
    """cosmos3-tiny on CUDA: with graphs the prefill replays a capture (a graph, not the eager fallback) and
    its last logits follow the eager prefill's."""
    from fv_cosmos3.cards import cosmos3_card
    from fv_kernel.api import ComputeOptions, InstanceOptions, TaskType, build_instance
    from test_graphed_prefill import prefill_plan

    def prefill(graphs: bool) -> tuple[torch.Tensor, object]:
        instance = build_instance(cosmos3_card("cosmos3-tiny"), InstanceOptions(
            device="cuda", compute=ComputeOptions(cuda_graphs=graphs)))
        instance.load_for_task(TaskType.TEXT_GENERATION)
        plan, _ = prefill_plan(instance, "a red ball", max_tokens=4)
        with torch.inference_mode():
            return instance.op("ar_prefill").fn(plan.inputs, plan.params)["logits"], instance.graphed_decode

    expected, _ = prefill(False)
    actual, graphed = prefill(True)
    assert graphed.prefill_replays == 1 and graphed.eager_steps == 0
    assert all(graphed._entries[key].graph is not None for key in graphed.prefill_keys())
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-4)
