"""The CUDA-graphed reasoner decode step (``fv_cosmos3.graphed_decode``), tested on the CPU.

Off CUDA ``GraphedDecode(capture=False)`` runs the very function a graph would capture, on the same
static buffers, so bucketing, padding, masking, invalidation and sampling are all exercised here;
``test_graphed_decode_cuda.py`` captures and replays on a GPU.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from cosmos3_testutils import ATOL, drive_loop

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from bench_ar_token import CONFIGS, NANO_SHAPE, DecodeBench, graphed_launches  # noqa: E402

from fv_cosmos3 import graphed_decode
from fv_cosmos3.cards import cosmos3_card
from fv_cosmos3.graphed_decode import (
    TOP_K_BOUND,
    GraphedDecode,
    bounded_top_k,
    _host_buffers,
    batch_bucket,
    context_bucket,
    sample_tokens,
    stacked_rows,
    static_decode_step,
)
from fv_cosmos3.models import Cosmos3Config, Cosmos3MoT
from fv_kernel.compute.lora import AdapterWeights, LowRankUpdate, merge_adapters
from fv_kernel.api import ARParams, Request, TaskType, TextPart, build_instance, sample_next_token


def _graphed_step(bench: DecodeBench, graphed: GraphedDecode, version: str = "v1") -> torch.Tensor:
    """``DecodeBench.step`` through the graphed path (the same inputs the plugin's ``ar_token`` gets)."""
    inputs = {"token": bench.token, "table": bench.table_ids, "length": torch.tensor(bench.lengths, dtype=torch.long)}
    with torch.inference_mode():
        out = graphed.run(bench.mot, bench.pool, version, inputs)
    assert out is not None
    bench.token = out["logits"].argmax(-1, keepdim=True)
    bench.lengths = [length + 1 for length in bench.lengths]
    return out["logits"]


def _kv(bench: DecodeBench) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [bench.pool.gather(bench.pool.table_from_tensor(bench.table_ids[r], bench.lengths[r]))
            for r in range(len(bench.lengths))]


# --------------------------------------------------------------------------- bucketing


def test_bucketing_picks_the_smallest_bucket_that_holds_the_batch_and_the_context():
    buckets = (8, 1, 2, 4)  # any order
    assert [batch_bucket(b, buckets) for b in (1, 2, 3, 4, 5, 8)] == [1, 2, 4, 4, 8, 8]
    assert batch_bucket(9, buckets) is None  # larger than every bucket: the eager step
    with pytest.raises(ValueError, match="batch must be >= 1"):
        batch_bucket(0, buckets)
    # Powers of two from the minimum, whole blocks, capped at the pool's per-sequence limit.
    assert context_bucket(1, block_size=16, max_tokens=4096) == 256
    assert context_bucket(257, block_size=16, max_tokens=4096) == 512
    assert context_bucket(3000, block_size=16, max_tokens=3000) == 3008
    assert context_bucket(20, block_size=16, max_tokens=4096, minimum=24) == 32
    with pytest.raises(ValueError, match=r"context must be in \[1, 4096\]"):
        context_bucket(4097, block_size=16, max_tokens=4096)


def test_a_batch_replays_the_graph_of_its_bucket_and_a_larger_one_runs_eagerly():
    bench = DecodeBench.build(CONFIGS["tiny"], 3, history=40, steps=4, seed=1)
    graphed = GraphedDecode((1, 2, 4), capture=False, min_context=32)
    _graphed_step(bench, graphed)
    _graphed_step(bench, graphed)
    # 41 tokens: the 64-token bucket, capped at the pool's 48-token sequences.
    assert [(k.bucket, k.context) for k in graphed.keys()] == [(4, 48)]
    assert graphed.captures == 1 and graphed.replays == 2
    too_many = DecodeBench.build(CONFIGS["tiny"], 5, history=40, steps=2, seed=1)
    inputs = {"token": too_many.token, "table": too_many.table_ids, "length": torch.tensor(too_many.lengths)}
    assert graphed.run(too_many.mot, too_many.pool, "v1", inputs) is None
    assert graphed.eager_steps == 1


# --------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("history", [31, 63])
def test_static_step_is_bit_identical_to_the_eager_step_at_the_same_shapes(rows, history):
    """Batch = bucket and context = history + 1 (equal-length rows): logits and written K/V equal bit for bit."""
    eager = DecodeBench.build(CONFIGS["tiny"], rows, history=history, steps=3, seed=2, stride=0)
    graph = DecodeBench.build(CONFIGS["tiny"], rows, history=history, steps=3, seed=2, stride=0)
    graphed = GraphedDecode((rows,), capture=False, min_context=history + 1)
    expected, actual = eager.step(), _graphed_step(graph, graphed)
    assert graphed.keys()[0].context == history + 1
    assert expected.dtype == actual.dtype == torch.float32
    assert torch.equal(actual, expected)
    for (ke, ve), (kg, vg) in zip(_kv(eager), _kv(graph)):
        assert torch.equal(kg, ke) and torch.equal(vg, ve)


@pytest.mark.parametrize("rows", [1, 3, 5])
def test_padded_buckets_follow_the_eager_decode(rows):
    """Ragged rows padded to the next bucket and to a 64-token context, over 10 steps (crossing a block and a
    context bucket): logits agree with eager within the fp32 parity tolerance (1e-5), the greedy tokens and the K/V are the same."""
    eager = DecodeBench.build(CONFIGS["tiny"], rows, history=42, steps=10, seed=3)
    graph = DecodeBench.build(CONFIGS["tiny"], rows, history=42, steps=10, seed=3)
    graphed = GraphedDecode((1, 2, 4, 8), capture=False, min_context=48)
    for _ in range(10):
        expected, actual = eager.step(), _graphed_step(graph, graphed)
        assert actual.shape == expected.shape
        torch.testing.assert_close(actual, expected, rtol=0, atol=ATOL)
        assert torch.equal(graph.token, eager.token)
    assert {(k.bucket, k.context) for k in graphed.keys()} == {(batch_bucket(rows, (1, 2, 4, 8)), 48),
                                                               (batch_bucket(rows, (1, 2, 4, 8)), 64)}
    for (ke, ve), (kg, vg) in zip(_kv(eager), _kv(graph)):
        torch.testing.assert_close(kg, ke, rtol=0, atol=ATOL)
        torch.testing.assert_close(vg, ve, rtol=0, atol=ATOL)


@pytest.mark.parametrize("fp32_multiply", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fused_rms_norm_is_the_modules_norm_bit_for_bit(fp32_multiply, dtype):
    """Both weight conventions (Qwen: cast then multiply; Nemotron: multiply in fp32), fp32 and bf16 weights."""
    from fv_cosmos3.graphed_decode import _rms_norm
    from fv_cosmos3.models.layers import RMSNorm

    norm = RMSNorm(64, 1e-6, multiply_in_fp32=fp32_multiply)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(64, generator=torch.Generator().manual_seed(0)))
    norm = norm.to(dtype)
    x = (3 * torch.randn(5, 1, 64, generator=torch.Generator().manual_seed(1))).to(dtype)
    assert torch.equal(_rms_norm(norm, x), norm(x))
    assert torch.equal(_rms_norm(torch.nn.Identity(), x), x)


#: Layer variants the rewrites must keep exact: Nemotron's norms and squared-ReLU MLP (no gate/up to pack, gains
#: multiplied in fp32), no q/k norms, biased projections (packed biases), and Nano's heads (32 q, 8 KV of 128).
VARIANTS = {
    "relu2": Cosmos3Config.tiny(hidden_act="relu2"),
    "no_qk_norm": Cosmos3Config.tiny(qk_norm_for_text=False),
    "attention_bias": Cosmos3Config.tiny(attention_bias=True),
    "nano_heads": Cosmos3Config(**{**NANO_SHAPE.model_dump(), "num_hidden_layers": 2}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("rows", [1, 3])
def test_static_step_is_bit_identical_to_the_eager_step_for_every_layer_variant(variant, rows):
    eager = DecodeBench.build(VARIANTS[variant], rows, history=31, steps=3, seed=2, stride=0)
    graph = DecodeBench.build(VARIANTS[variant], rows, history=31, steps=3, seed=2, stride=0)
    expected = eager.step()
    actual = _graphed_step(graph, GraphedDecode((rows,), capture=False, min_context=32))
    assert torch.equal(actual, expected)
    for (ke, ve), (kg, vg) in zip(_kv(eager), _kv(graph)):
        assert torch.equal(kg, ke) and torch.equal(vg, ve)


@pytest.mark.parametrize("fp32_multiply", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_joint_qk_norm_is_each_heads_own_norm_bit_for_bit(fp32_multiply, dtype):
    """q's heads through norm_q and k's through norm_k, as one normalisation and a table of gains where that is
    exact (fp32; the Qwen convention in bf16), each norm on its own heads otherwise (Nemotron in bf16)."""
    from fv_cosmos3.graphed_decode import _joint_qk_norms, _qk_norm
    from fv_cosmos3.models.layers import RMSNorm

    gen = torch.Generator().manual_seed(0)
    norms = []
    for _ in range(2):
        norm = RMSNorm(16, 1e-6, multiply_in_fp32=fp32_multiply)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.1 * torch.randn(16, generator=gen))
        norms.append(norm.to(dtype))
    attn = SimpleNamespace(norm_q=norms[0], norm_k=norms[1])
    qk = (3 * torch.randn(5, 1, 6, 16, generator=gen)).to(dtype)  # 4 q heads, 2 k heads
    is_q = (torch.arange(6) < 4)[:, None]
    expected = torch.cat([norms[0](qk[:, :, :4]), norms[1](qk[:, :, 4:])], dim=2)
    assert torch.equal(_qk_norm(attn, qk, 4, is_q, None), expected)
    assert _joint_qk_norms(attn, dtype) == (dtype == torch.float32 or not fp32_multiply)


def _packed_groups(mot: Cosmos3MoT) -> list[list[torch.Tensor]]:
    groups = []
    for layer in mot.layers:
        attn, mlp = layer.self_attn, layer.mlp
        groups += [[attn.to_q.weight, attn.to_k.weight, attn.to_v.weight], [mlp.gate_proj.weight, mlp.up_proj.weight]]
    attns = [layer.self_attn for layer in mot.layers]
    return groups + [[a.norm_q.weight for a in attns] + [a.norm_k.weight for a in attns]]


def _param_bytes(mot: Cosmos3MoT) -> int:
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in mot.parameters()}
    return sum(storages.values())


def test_packed_weights_keep_the_state_dict_and_hold_no_second_copy(tmp_path):
    """After the first graphed step each layer's q/k/v weights are consecutive rows of one tensor (and gate/up, and
    every layer's q/k norm gains): the parameters are views of it. The state dict keeps its keys, shapes and
    values, saves and loads back strictly, and the parameters take no more memory than before. Negative control:
    before the step nothing is packed (the check can tell the two apart)."""
    from safetensors.torch import load_file, save_file

    bench = DecodeBench.build(CONFIGS["tiny"], 2, history=40, steps=2, seed=12)
    before = {name: tensor.clone() for name, tensor in bench.mot.state_dict().items()}
    nbytes = _param_bytes(bench.mot)
    assert all(stacked_rows(group) is None for group in _packed_groups(bench.mot))
    _graphed_step(bench, GraphedDecode((2,), capture=False, min_context=64))
    assert all(stacked_rows(group) is not None for group in _packed_groups(bench.mot))
    after = bench.mot.state_dict()
    assert list(after) == list(before)
    assert all(after[name].shape == before[name].shape and torch.equal(after[name], before[name]) for name in before)
    assert _param_bytes(bench.mot) == nbytes
    save_file(dict(after), str(tmp_path / "reasoner.safetensors"))
    reloaded = Cosmos3MoT(bench.mot.config)
    reloaded.load_state_dict(load_file(str(tmp_path / "reasoner.safetensors")), strict=True)
    assert all(torch.equal(reloaded.state_dict()[name], before[name]) for name in before)


def _logits_now(bench: DecodeBench, graphed: GraphedDecode | None = None) -> torch.Tensor:
    """The logits of the step at the bench's current token and lengths, without moving on (the new token's slot
    is written again, with the current weights' K/V): every weight change is compared at the same shapes."""
    inputs = {"token": bench.token, "table": bench.table_ids, "length": torch.tensor(bench.lengths, dtype=torch.long)}
    with torch.inference_mode():
        out = bench.ar_token(inputs, {}) if graphed is None else graphed.run(bench.mot, bench.pool, "v1", inputs)
    return out["logits"]


def _twin_benches(seed: int) -> tuple[DecodeBench, DecodeBench, GraphedDecode]:
    """Two benches with the same weights and K/V (graphed, eager) and a graphed tier whose capture has the eager
    step's shapes (equal rows, full bucket, context = history + 1): their logits compare bit for bit."""
    graph, eager = (DecodeBench.build(CONFIGS["tiny"], 2, history=31, steps=2, seed=seed, stride=0) for _ in range(2))
    return graph, eager, GraphedDecode((2,), capture=False, min_context=32)


def test_in_place_weight_changes_reach_the_captured_step(monkeypatch):
    """A LoRA merge (to_k's low rank, up_proj's and norm_k's full deltas), its exact restore and a
    ``load_state_dict`` write the parameters in place, with no ``weights_version`` bump and no recapture: the graphed
    step follows each change bit for bit, because the packed rows are the parameters. Negative control: a derived
    packed copy (``torch.cat`` of the weights, taken at capture) goes stale at the merge and the check sees it."""

    def follows_every_change() -> list[bool]:
        graph, eager, graphed = _twin_benches(seed=13)
        same = [torch.equal(_logits_now(graph, graphed), _logits_now(eager))]
        gen = torch.Generator().manual_seed(1)
        config = graph.mot.config
        kv_dim, hidden = config.num_key_value_heads * config.head_dim, config.hidden_size
        to_k = LowRankUpdate(torch.randn(4, hidden, generator=gen), torch.randn(kv_dim, 4, generator=gen), alpha=2.0)
        adapter = AdapterWeights("style", "transformer", low_rank={"layers.1.self_attn.to_k": to_k}, deltas={
            "layers.0.mlp.up_proj.weight": 0.1 * torch.randn(config.intermediate_size, hidden, generator=gen),
            "layers.2.self_attn.norm_k.weight": 0.5 * torch.randn(config.head_dim, generator=gen)})
        merged = [merge_adapters(bench.mot, [(adapter, 0.8)]) for bench in (graph, eager)]
        same.append(torch.equal(_logits_now(graph, graphed), _logits_now(eager)))
        for m in merged:
            m.restore()
        same.append(torch.equal(_logits_now(graph, graphed), _logits_now(eager)))
        new = _reseeded(graph.mot, 5).state_dict()
        for bench in (graph, eager):
            bench.mot.load_state_dict(new)
        same.append(torch.equal(_logits_now(graph, graphed), _logits_now(eager)))
        assert graphed.captures == 1 and graphed.replays == 4
        return same

    assert follows_every_change() == [True, True, True, True]
    monkeypatch.setattr(graphed_decode, "stacked_rows", lambda tensors: torch.cat(list(tensors)))
    assert follows_every_change() == [True, False, True, False]


def test_a_replaced_parameter_is_packed_again_and_recaptured(monkeypatch):
    """``load_state_dict(assign=True)`` replaces the parameters, with no version bump: the packed rows the capture
    reads are no longer the parameters, so the next step packs the new ones and recaptures, and follows the new
    weights bit for bit. Negative control: without that check the capture reads the old packed rows."""

    def follows(check: bool) -> tuple[bool, int]:
        graph, eager, graphed = _twin_benches(seed=14)
        assert torch.equal(_logits_now(graph, graphed), _logits_now(eager))
        new = _reseeded(graph.mot, 21).state_dict()
        if not check:
            monkeypatch.setattr(graphed_decode, "packing_intact", lambda packed: True)
        graph.mot.load_state_dict({name: tensor.clone() for name, tensor in new.items()}, assign=True)
        eager.mot.load_state_dict(new)
        return torch.equal(_logits_now(graph, graphed), _logits_now(eager)), graphed.captures

    assert follows(check=True) == (True, 2)
    assert follows(check=False) == (False, 1)


def test_a_group_without_memory_to_pack_runs_unpacked(monkeypatch, caplog):
    """Packing holds one group's weights twice for a moment; where that does not fit, the group keeps its layout
    (a warning says so) and the step computes it one linear each, with the same logits bit for bit. Negative
    control: the other groups were packed (the failure is per group, and the check can tell packed from not)."""
    real_cat = torch.cat
    calls = []

    def cat(tensors, *args, **kwargs):  # the first packing copy fails, as on a full device
        calls.append(1)
        if len(calls) == 1 and not torch.is_inference_mode_enabled():
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_cat(tensors, *args, **kwargs)

    graph, eager, graphed = _twin_benches(seed=15)
    monkeypatch.setattr(torch, "cat", cat)
    with caplog.at_level("WARNING"):
        actual = _logits_now(graph, graphed)
    monkeypatch.setattr(torch, "cat", real_cat)
    assert "run unpacked" in caplog.text
    groups = [stacked_rows(group) is not None for group in _packed_groups(graph.mot)]
    assert groups[0] is False and all(groups[1:])
    assert torch.equal(actual, _logits_now(eager))


def test_a_graphed_step_launches_the_pinned_kernels_per_layer(monkeypatch):
    """Counted on the CPU (every op that launches a kernel, what a CUDA graph of the step replays) at Nano's layer
    structure in bf16: 21 kernels a layer and 30 more a step, 786 a step over Nano's 36 layers (1,530 before these
    rewrites; 851 while each layer gathered its history out of the pool and stored its new K/V itself: 23 a layer).
    A change that adds a kernel fails here. The history is gathered once a step and each layer's new K/V written
    into it (one ``index_put_`` each for K and V), the pool stored once after the last layer; padded rows add the
    store's source selection once a step, not per layer; fp32 has no gain multiplies after its norms. (The additive
    attention mask built once a step is 2 of the fixed 30: SDPA would build it inside every layer's call on CUDA,
    unseen by this counter.) Negative control: with nothing packed (q/k/v, gate/up one linear each and a
    concatenation, a gain table per layer) the counter sees 6 more a layer."""
    per_layer, fixed = graphed_launches(NANO_SHAPE, 1, bucket=1, dtype=torch.bfloat16)
    assert per_layer == Counter({"mul": 6, "linear": 4, "rms_norm": 3, "add": 3, "index_put_": 2,
                                 "flip": 1, "scaled_dot_product_attention": 1, "silu": 1})
    assert sum(fixed.values()) == 30 and 36 * sum(per_layer.values()) + sum(fixed.values()) == 786
    assert fixed["index_select"] == fixed["index_copy_"] == fixed["stack"] == 2  # K and V: gathered, stored once
    padded, padded_fixed = graphed_launches(NANO_SHAPE, 3, bucket=4, dtype=torch.bfloat16)
    assert padded == per_layer and padded_fixed - fixed == Counter({"index_select": 2})
    fp32, _ = graphed_launches(NANO_SHAPE, 1, bucket=1, dtype=torch.float32)
    assert per_layer - fp32 == Counter({"mul": 2}) and not fp32 - per_layer
    monkeypatch.setattr(graphed_decode, "pack_weights", lambda mot: [])
    unpacked, _ = graphed_launches(NANO_SHAPE, 1, bucket=1, dtype=torch.bfloat16)
    assert unpacked - per_layer == Counter({"linear": 3, "cat": 2, "where": 1}) and not per_layer - unpacked


def _static_inputs(bench: DecodeBench, bucket: int, context: int) -> dict[str, torch.Tensor]:
    lengths = torch.tensor(bench.lengths, dtype=torch.long)
    inputs = {"token": bench.token, "table": bench.table_ids, "length": lengths}
    return _host_buffers(inputs, lengths, len(bench.lengths), bucket, -(-context // bench.pool.block_size),
                         bench.pool.block_size, sampling=False)


def _changed_slots(before: torch.Tensor, after: torch.Tensor) -> set[tuple[int, int]]:
    """(block, offset) of every slot (any layer or head) that differs."""
    diff = (before != after).any(dim=-1).any(dim=1).any(dim=0)  # (blocks, block_size)
    return {(int(b), int(o)) for b, o in diff.nonzero().tolist()}


def test_padded_rows_do_not_touch_live_kv_or_live_logits():
    """Three live rows in a bucket of 8. The only slots a step changes are the live rows' new-token slots, and what
    they hold is the live rows' own K/V, bit for bit the same whatever the padded rows hold (padded rows store row
    0's K/V into row 0's slot); the live rows' logits are bit-identical too. Negative control: with the padded rows
    storing their own K/V (``source`` every row itself), the checker sees row 0's slot hold another row's K/V."""
    bench = DecodeBench.build(CONFIGS["tiny"], 3, history=37, steps=4, seed=4)
    store = bench.pool.storage()
    buffers = _static_inputs(bench, 8, 64)
    live_slots = {(int(bench.table_ids[r, n // 16]), n % 16) for r, n in enumerate(bench.lengths)}

    def step(buffers: dict[str, torch.Tensor]) -> tuple[torch.Tensor, set[tuple[int, int]], list[torch.Tensor]]:
        before = tuple(s.clone() for s in store)
        with torch.inference_mode():
            logits = static_decode_step(bench.mot, store, buffers, context=64, sampling=False)["logits"]
        changed = _changed_slots(before[0], store[0]) | _changed_slots(before[1], store[1])
        written = [s[:, :, b, o].clone() for b, o in sorted(live_slots) for s in store]
        for s, b in zip(store, before):
            s.copy_(b)  # every variant starts from the same pool
        return logits, changed, written

    logits, changed, written = step(buffers)
    assert changed == live_slots
    other = dict(buffers)
    other["token"] = buffers["token"].clone()
    other["token"][3:] = torch.arange(5).view(5, 1) + 100
    other["position"] = buffers["position"].clone()
    other["position"][3:] = 7
    logits_other, changed_other, written_other = step(other)
    assert changed_other == live_slots
    assert all(torch.equal(a, b) for a, b in zip(written_other, written))
    assert torch.equal(logits_other[:3], logits[:3])
    assert not torch.equal(logits_other[3:], logits[3:])  # the padding did change (the test can see it)
    unmasked = dict(other, source=torch.arange(8))
    assert not all(torch.equal(a, b) for a, b in zip(step(unmasked)[2], written)), \
        "the checker must see a padded row's own K/V stored into a live slot"


def test_static_buffers_are_the_captures_own_never_a_callers_tensors():
    """On the host ``tensor.to(device)`` is the tensor itself: static buffers built that way were the first caller's
    token and length tensors, and every later step's copy into them overwrote that caller's inputs (a fused step run
    after eight single ones decoded row 0 with row 7's token at row 7's position: logits off by ~2.8). Negative
    control: the two steps' inputs differ, so an aliased buffer would show."""
    bench = DecodeBench.build(CONFIGS["tiny"], 2, history=40, steps=4, seed=11)
    graphed = GraphedDecode((1,), capture=False, min_context=64)
    inputs = [{"token": bench.token[r : r + 1].clone(), "table": bench.table_ids[r : r + 1],
               "length": torch.tensor(bench.lengths[r : r + 1]),
               "temperature": torch.tensor([0.7 + 0.1 * r]), "top_k": torch.tensor([20 + r]), "top_p": torch.tensor([0.9]),
               "uniform": torch.tensor([0.25 * (r + 1)]), "penalty": torch.tensor([1.5 * r]),
               "seen": torch.full((1, 8), -1 if r == 0 else 3)} for r in range(2)]
    assert all(not torch.equal(inputs[0][name], inputs[1][name]) for name in ("token", "length", "uniform", "seen"))
    kept = {name: tensor.clone() for name, tensor in inputs[0].items()}
    with torch.inference_mode():
        graphed.run(bench.mot, bench.pool, "v1", inputs[0])
        graphed.run(bench.mot, bench.pool, "v1", inputs[1])  # the same capture: its buffers are refilled
    assert graphed.captures == 1 and graphed.replays == 2
    for name, tensor in kept.items():
        assert torch.equal(inputs[0][name], tensor), f"the second step wrote into the first caller's {name!r}"


def test_replaying_a_key_reruns_its_last_step_on_the_buffers_as_they_were_left():
    """``GraphedDecode.replay`` (what the decode bench times as the step alone) gives that key's last step's logits
    again, captured or kernel by kernel; the key picks the capture (two context buckets, two different steps)."""
    graphed = GraphedDecode((1,), capture=False, min_context=64)
    bench = DecodeBench.build(CONFIGS["tiny"], 1, history=62, steps=4, seed=5)
    with torch.inference_mode():
        first = _graphed_step(bench, graphed)  # 63 tokens: the 64-token bucket
        second = _graphed_step(bench, graphed)  # 64 tokens: the same bucket, its buffers refilled
        third = _graphed_step(bench, graphed)  # 65 tokens: the next bucket
    small, large = sorted(graphed.keys(), key=lambda k: k.context)
    assert (small.context, graphed.captures, graphed.replays) == (64, 2, 3) and large.context > 64
    with torch.inference_mode():
        assert torch.equal(graphed.replay(small)["logits"], second)
        assert torch.equal(graphed.replay(small, captured=False)["logits"], second)
        assert torch.equal(graphed.replay(large)["logits"], third)
    assert not torch.equal(first, second) and not torch.equal(second, third)


# --------------------------------------------------------------------------- invalidation


def _reseeded(mot: Cosmos3MoT, seed: int) -> Cosmos3MoT:
    new = Cosmos3MoT(mot.config).eval().requires_grad_(False)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in new.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(noise * p[0].numel() ** -0.5 if p.dim() > 1 else (1 + 0.02 * noise if "norm" in name else 0.02 * noise))
    return new


def _step_logits(bench: DecodeBench, graphed: GraphedDecode, mot: Cosmos3MoT, version: str) -> torch.Tensor:
    bench.mot = mot
    return _graphed_step(bench, graphed, version)


def test_a_weights_version_change_drops_every_capture(monkeypatch):
    """After an RL weight sync (new weights, new ``weights_version``) no capture of the old version is left and
    the step follows the new weights. Negative control: without the invalidation the old captures stay."""

    def run(invalidate: bool) -> tuple[list, torch.Tensor, torch.Tensor]:
        graphed = GraphedDecode((1, 2), capture=False, min_context=32)
        bench = DecodeBench.build(CONFIGS["tiny"], 2, history=40, steps=4, seed=6)
        reference = DecodeBench.build(CONFIGS["tiny"], 2, history=40, steps=4, seed=6)
        _step_logits(bench, graphed, bench.mot, "v1")
        reference.step()
        new = _reseeded(bench.mot, 99)
        if not invalidate:
            monkeypatch.setattr(GraphedDecode, "_check_bound", lambda self, *args: None)
        logits = _step_logits(bench, graphed, new, "v2")
        reference.mot = new
        reference.ar_token = _eager_op(reference, new)
        expected = reference.step()
        return graphed.keys(), logits, expected

    keys, logits, expected = run(invalidate=True)
    assert [k.weights_version for k in keys] == ["v2"]
    torch.testing.assert_close(logits, expected, rtol=0, atol=ATOL)
    stale_keys, _, _ = run(invalidate=False)
    assert [k.weights_version for k in stale_keys] == ["v1", "v2"]  # what the invalidation prevents


def _eager_op(bench: DecodeBench, mot: Cosmos3MoT):
    from fv_cosmos3.instance import Cosmos3Instance, cosmos3_ops
    from fv_kernel.api import InstanceOptions

    instance = Cosmos3Instance(card=cosmos3_card("cosmos3-tiny"), options=InstanceOptions(),
                               component_loader=lambda component_id: None, ops_builder=cosmos3_ops,
                               components={"transformer": mot}, text_kv_pool=bench.pool)
    return cosmos3_ops(instance)["ar_token"].fn


def test_a_rebuilt_pool_or_a_replaced_module_is_recaptured(monkeypatch):
    """Same version, but the K/V storage (or the reasoner module) is a new tensor: a capture bound to the old
    one would write the new token's K/V where nobody reads it. Negative control: without the check it does."""

    def new_token_kv_lands(check: bool) -> bool:
        graphed = GraphedDecode((2,), capture=False, min_context=32)
        bench = DecodeBench.build(CONFIGS["tiny"], 2, history=40, steps=4, seed=7)
        _step_logits(bench, graphed, bench.mot, "v1")
        # The pool rebuilt: the same K/V in new storage.
        old_keys, old_values = bench.pool.storage()
        bench.pool._keys, bench.pool._values = old_keys.clone(), old_values.clone()
        if not check:
            monkeypatch.setattr(GraphedDecode, "_check_bound", lambda self, *args: None)
        _step_logits(bench, graphed, bench.mot, "v1")
        row0 = bench.pool.table_from_tensor(bench.table_ids[0], bench.lengths[0])
        return bool(bench.pool.gather(row0)[0][:, :, -1].abs().sum() > 0) and not torch.equal(
            bench.pool.storage()[0], old_keys)

    assert new_token_kv_lands(check=True)
    assert not new_token_kv_lands(check=False)


def test_a_replaced_reasoner_module_is_recaptured_even_under_the_same_version(monkeypatch):
    """A capture reads the module it was captured with. Negative control: without the check the step still
    computes with the old weights."""

    def distance_to_new_weights(check: bool) -> float:
        graphed = GraphedDecode((2,), capture=False, min_context=32)
        bench = DecodeBench.build(CONFIGS["tiny"], 2, history=40, steps=4, seed=8)
        reference = DecodeBench.build(CONFIGS["tiny"], 2, history=40, steps=4, seed=8)
        _step_logits(bench, graphed, bench.mot, "v1")
        reference.step()
        if not check:
            monkeypatch.setattr(GraphedDecode, "_check_bound", lambda self, *args: None)
        new = _reseeded(bench.mot, 42)
        logits = _step_logits(bench, graphed, new, "v1")
        reference.ar_token = _eager_op(reference, new)
        return float((logits - reference.step()).abs().max())

    assert distance_to_new_weights(check=True) <= ATOL
    assert distance_to_new_weights(check=False) > 1e-2


def test_a_failed_capture_falls_back_to_the_eager_step(monkeypatch, caplog):
    from fv_cosmos3 import graphed_decode

    def refuse(self, *args, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphed_decode._DecodeGraph, "__init__", refuse)
    bench = DecodeBench.build(CONFIGS["tiny"], 2, history=40, steps=4, seed=9)
    graphed = GraphedDecode((2,), capture=False, min_context=32)
    inputs = {"token": bench.token, "table": bench.table_ids, "length": torch.tensor(bench.lengths)}
    with caplog.at_level("WARNING"):
        assert graphed.run(bench.mot, bench.pool, "v1", inputs) is None
        assert graphed.run(bench.mot, bench.pool, "v1", inputs) is None  # not retried for that shape
    assert graphed.eager_steps == 2 and graphed.captures == 0 and not graphed.keys()
    assert "runs eagerly" in caplog.text
    # Through the plugin's op: the eager step's logits.
    from fv_cosmos3.instance import Cosmos3Instance, cosmos3_ops
    from fv_kernel.api import InstanceOptions

    instance = Cosmos3Instance(card=cosmos3_card("cosmos3-tiny"), options=InstanceOptions(),
                               component_loader=lambda component_id: None, ops_builder=cosmos3_ops,
                               components={"transformer": bench.mot}, text_kv_pool=bench.pool, graphed_decode=graphed)
    with torch.inference_mode():
        via_op = cosmos3_ops(instance)["ar_token"].fn(inputs, {})["logits"]
    assert torch.equal(via_op, bench.step())  # same pool slot rewritten with the same values


def test_a_table_without_room_for_the_new_token_or_a_freed_table_is_left_to_the_eager_step():
    """The eager step grows a table that lacks the new token's block, and refuses a freed one; a graph can do
    neither, so it must not guess (writing into the row's first block would corrupt its history)."""
    bench = DecodeBench.build(CONFIGS["tiny"], 2, history=40, steps=4, seed=10)
    graphed = GraphedDecode((2,), capture=False, min_context=32)
    short = bench.table_ids.clone()
    short[1, 40 // 16 :] = -1  # row 1 holds tokens 0..31 only: its new token (position 37) has no block
    lengths = torch.tensor(bench.lengths)
    assert graphed.run(bench.mot, bench.pool, "v1", {"token": bench.token, "table": short, "length": lengths}) is None
    assert graphed.eager_steps == 1 and graphed.captures == 0
    bench.pool.free(bench.pool.table_from_tensor(bench.table_ids[0], bench.lengths[0]))
    with pytest.raises(ValueError, match="not allocated"):
        graphed.run(bench.mot, bench.pool, "v1", {"token": bench.token, "table": bench.table_ids, "length": lengths})


def test_the_graphed_tier_is_built_only_for_cuda_graphs_on_cuda():
    from fv_kernel.api import ComputeOptions, InstanceOptions

    card = cosmos3_card("cosmos3-tiny")
    on_cpu = build_instance(card, InstanceOptions(compute=ComputeOptions(cuda_graphs=True)))
    assert on_cpu.graphed_decode is None and not on_cpu.samples_on_device
    from fv_cosmos3.instance import build_cosmos3_instance

    # The factory's decision, without building CUDA tensors: the pool is lazy, nothing touches the device.
    on_cuda = build_cosmos3_instance(card, InstanceOptions(device="cuda", compute=ComputeOptions(
        cuda_graphs=True, graph_batch_buckets=(1, 8))))
    assert on_cuda.graphed_decode is not None and on_cuda.graphed_decode.buckets == (1, 8)
    assert on_cuda.samples_on_device
    assert on_cuda.decode_tokens_per_step == ComputeOptions().decode_tokens_per_step == 8  # chained by default
    eager_cuda = build_cosmos3_instance(card, InstanceOptions(device="cuda"))
    assert eager_cuda.graphed_decode is None and eager_cuda.decode_tokens_per_step == 1  # host sampling: no chain
    chained = build_cosmos3_instance(card, InstanceOptions(device="cuda", compute=ComputeOptions(
        cuda_graphs=True, decode_tokens_per_step=3)))
    assert chained.decode_tokens_per_step == 3


# --------------------------------------------------------------------------- sampling


def _reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, penalty: float,
                     seen: list[int]) -> torch.Tensor:
    """The sampler's distribution written out from its definition, in float64, one token at a time."""
    x = logits.double().clone()
    for t in set(seen):
        x[t] -= penalty
    x = x / temperature
    if 0 < top_k < x.numel():
        kth = sorted(x.tolist(), reverse=True)[top_k - 1]
        x[x < kth] = float("-inf")
    order = sorted(range(x.numel()), key=lambda i: -x[i].item())
    p = torch.softmax(x, 0)
    kept, mass = [], 0.0
    for i in order:
        if mass > top_p:
            break
        kept.append(i)
        mass += p[i].item()
    out = torch.zeros_like(p)
    out[kept] = p[kept] / p[kept].sum()
    return out


def _frequencies(logits: torch.Tensor, grid: int, **params: float) -> torch.Tensor:
    """Token frequencies of ``sample_tokens`` over ``grid`` evenly spaced uniforms (one batch)."""
    rows = grid
    u = (torch.arange(grid, dtype=torch.float64) + 0.5) / grid
    seen = params.pop("seen", [])
    width = max(len(seen), 1)
    seen_rows = torch.full((rows, width), -1, dtype=torch.long)
    if seen:
        seen_rows[:, : len(seen)] = torch.tensor(seen)
    tokens = sample_tokens(
        logits.expand(rows, -1), torch.full((rows,), params["temperature"]), torch.full((rows,), int(params["top_k"])),
        torch.full((rows,), params["top_p"]), u.float(), torch.full((rows,), params.get("penalty", 0.0)), seen_rows,
    )
    return torch.bincount(tokens, minlength=logits.numel()).double() / grid


@pytest.mark.parametrize("params", [
    dict(temperature=0.7, top_k=20, top_p=0.8, penalty=1.5, seen=[3, 5, 5]),
    dict(temperature=1.3, top_k=0, top_p=1.0),
    dict(temperature=0.9, top_k=4, top_p=1.0),
    dict(temperature=1.0, top_k=0, top_p=0.5),
])
def test_graph_safe_sampling_draws_the_eager_samplers_distribution(params):
    """Inverse-CDF sampling at evenly spaced uniforms reproduces the filtered distribution (penalty, temperature,
    top-k, top-p) to the grid's resolution, and puts nothing outside the eager sampler's support.
    Negative control: the same check fails when top-p is not applied."""
    logits = torch.randn(32, generator=torch.Generator().manual_seed(0)) * 2
    reference = _reference_probs(logits, params["temperature"], params["top_k"], params["top_p"],
                                 params.get("penalty", 0.0), params.get("seen", []))
    grid = 20000
    freq = _frequencies(logits, grid, **params)
    assert (freq - reference).abs().max() <= 2.0 / grid
    assert set(freq.nonzero().flatten().tolist()) == set(reference.nonzero().flatten().tolist())
    eager_support = set()
    penalised = logits.clone()
    for t in set(params.get("seen", [])):
        penalised[t] -= params.get("penalty", 0.0)
    for seed in range(200):
        eager_support.add(sample_next_token(penalised, temperature=params["temperature"], top_k=params["top_k"],
                                            top_p=params["top_p"], generator=torch.Generator().manual_seed(seed)))
    assert eager_support <= set(reference.nonzero().flatten().tolist())
    if params["top_p"] < 1.0:
        unfiltered = _frequencies(logits, grid, **{**params, "top_p": 1.0})
        assert (unfiltered - reference).abs().max() > 2.0 / grid


def _sampling_rows(rows: int, vocab: int, top_k: torch.Tensor, seed: int = 3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    seen = torch.randint(-1, vocab, (rows, 6), generator=gen)
    return {"logits": torch.randn(rows, vocab, generator=gen) * 3,
            "temperature": torch.tensor([0.0, 0.7, 1.0, 1.3])[torch.arange(rows) % 4], "top_k": top_k,
            "top_p": torch.tensor([1.0, 0.9, 0.5])[torch.arange(rows) % 3], "uniform": torch.rand(rows, generator=gen),
            "penalty": torch.tensor([0.0, 1.5])[torch.arange(rows) % 2], "seen": seen}


def _sampled(rows: dict[str, torch.Tensor], bound: int) -> torch.Tensor:
    return sample_tokens(rows["logits"], rows["temperature"], rows["top_k"], rows["top_p"], rows["uniform"],
                         rows["penalty"], rows["seen"], top_k_bound=bound)


def test_a_bounded_top_k_sorts_only_the_kept_logits_and_draws_the_same_tokens():
    """Every sampled row with 1 <= top_k <= TOP_K_BOUND: ``torch.topk`` of the bound instead of a full sort gives the
    same token for the same uniform (1,024 rows over penalties, temperatures, top-p, greedy rows). Negative control:
    rows with top-k off sampled under the bound lose the tail they may draw, and the tokens change."""
    rows, vocab = 1024, 5000
    gen = torch.Generator().manual_seed(4)
    bounded = _sampling_rows(rows, vocab, torch.randint(1, TOP_K_BOUND + 1, (rows,), generator=gen))
    assert bounded_top_k(bounded) == TOP_K_BOUND
    assert torch.equal(_sampled(bounded, TOP_K_BOUND), _sampled(bounded, 0))
    unbounded = dict(bounded, top_k=torch.zeros(rows, dtype=torch.long), top_p=torch.ones(rows),
                     uniform=torch.full((rows,), 0.999))
    assert bounded_top_k(unbounded) == 0
    assert not torch.equal(_sampled(unbounded, TOP_K_BOUND), _sampled(unbounded, 0))


def test_the_bound_applies_only_when_every_sampled_row_is_within_it():
    def rows(temperature: list[float], top_k: list[int]) -> dict[str, torch.Tensor]:
        return {"temperature": torch.tensor(temperature), "top_k": torch.tensor(top_k)}

    assert bounded_top_k(rows([0.7, 0.7], [20, TOP_K_BOUND])) == TOP_K_BOUND
    assert bounded_top_k(rows([0.7, 0.0], [20, 0])) == TOP_K_BOUND  # a greedy row takes the argmax either way
    assert bounded_top_k(rows([0.7, 0.7], [20, 0])) == 0  # top-k off: the whole vocabulary may be drawn
    assert bounded_top_k(rows([0.7, 0.7], [20, TOP_K_BOUND + 1])) == 0
    # A graphed step's capture is keyed by it: chat's top-k 20 and top-k off replay different graphs.
    bench = DecodeBench.build(CONFIGS["tiny"], 1, history=40, steps=4, seed=11)
    graphed = GraphedDecode((1,), capture=False, min_context=64)
    with torch.inference_mode():
        for top_k in (20, 0):
            graphed.run(bench.mot, bench.pool, "v1", {
                "token": bench.token, "table": bench.table_ids, "length": torch.tensor(bench.lengths),
                "temperature": torch.tensor([0.7]), "top_k": torch.tensor([top_k]), "top_p": torch.tensor([0.9]),
                "uniform": torch.tensor([0.5]), "penalty": torch.tensor([0.0]), "seen": torch.full((1, 8), -1)})
    assert sorted(key.top_k_bound for key in graphed.keys()) == [0, TOP_K_BOUND]


def test_graph_safe_sampling_is_greedy_at_temperature_zero_and_rows_are_independent():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 50, generator=gen)
    temperature = torch.tensor([0.0, 0.8, 0.0, 1.2])
    top_k, top_p = torch.tensor([0, 5, 3, 0]), torch.tensor([1.0, 0.9, 0.5, 1.0])
    uniform, penalty = torch.rand(4, generator=gen), torch.tensor([0.0, 1.0, 2.0, 0.0])
    seen = torch.tensor([[-1, -1], [7, -1], [int(logits[2].argmax()), 1], [-1, -1]])
    tokens = sample_tokens(logits, temperature, top_k, top_p, uniform, penalty, seen)
    assert int(tokens[0]) == int(logits[0].argmax())
    penalised = logits[2].clone()
    penalised[seen[2]] -= 2.0
    assert int(tokens[2]) == int(penalised.argmax()) != int(logits[2].argmax())  # the penalty moved the argmax
    for row in range(4):
        alone = sample_tokens(logits[row : row + 1], temperature[row : row + 1], top_k[row : row + 1],
                              top_p[row : row + 1], uniform[row : row + 1], penalty[row : row + 1], seen[row : row + 1])
        assert int(alone) == int(tokens[row])


# --------------------------------------------------------------------------- the loop on the graphed tier


def _chat(**ar) -> Request:
    return Request(model="cosmos3-tiny", task=TaskType.TEXT_GENERATION, inputs=(TextPart(text="a red ball"),),
                   ar=ARParams(**ar))


def test_the_decode_loop_on_the_graphed_tier_samples_in_the_step():
    """An instance with graphed decode: plans carry the sampling inputs, the op's token is the one kept. Greedy
    decodes the eager loop's tokens; a seeded sampled decode is reproducible and advances the generator by
    one draw per token."""
    eager = build_instance(cosmos3_card("cosmos3-tiny"))
    graphed = build_instance(cosmos3_card("cosmos3-tiny"))
    graphed.graphed_decode = GraphedDecode((1, 2, 4), capture=False, min_context=32)
    state_e, result_e = drive_loop(eager, "ar_decode", _chat(max_tokens=24))
    record: list = []
    state_g, result_g = drive_loop(graphed, "ar_decode", _chat(max_tokens=24), record=record)
    assert state_g.device_sampling and not state_e.device_sampling
    assert result_g.outputs["token_ids"] == result_e.outputs["token_ids"]
    # One replay per token step, and the prompt's prefill replayed too.
    assert graphed.graphed_decode.prefill_replays == 1
    assert graphed.graphed_decode.replays - 1 == len(result_g.outputs["token_ids"]) - 1
    token_plans = [plan for plan, _ in record if plan.tag == "token"]
    assert token_plans and all("uniform" in plan.inputs for plan in token_plans)

    record_sampled: list = []
    sampled = [drive_loop(graphed, "ar_decode", _chat(max_tokens=16, temperature=0.9, top_k=8, seed=5, stop_token_ids=()),
                          record=rec) for rec in (record_sampled, None)]
    assert sampled[0][1].outputs["token_ids"] == sampled[1][1].outputs["token_ids"]
    uniforms = [float(plan.inputs["uniform"]) for plan, _ in record_sampled if plan.tag == "token"]
    assert len(set(uniforms)) == len(uniforms) == len(sampled[0][1].outputs["token_ids"]) - 1
    assert all(0.0 <= u < 1.0 for u in uniforms)
