"""C1 text: the reasoner's ar_decode loop over the paged text-KV pool equals full recompute and transformers.

* greedy: tokens equal full-recompute greedy decoding and transformers' ``generate``;
* seeded sampling: every step's logits equal the full-recompute logits of the same
  prefix, and replaying the request's RNG stream over the recomputed logits picks the
  same tokens;
* a fused ``ar_token`` group of requests at different context lengths equals running
  them one by one.
CPU fp32, tiny seeded weights.
"""

from __future__ import annotations

import pytest
import torch
from cosmos3_testutils import assert_close, drive_loop
from test_parity_reasoner import _transformers_reasoner

from fv_cosmos3.cards import cosmos3_card
from fv_kernel.api import ARParams, Request, TaskType, TextPart, apply_presence_penalty, build_instance, sample_next_token

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def instance():
    inst = build_instance(cosmos3_card("cosmos3-tiny"))
    inst.load_for_task(TaskType.TEXT_GENERATION)
    return inst


def _request(text: str, **ar) -> Request:
    return Request(model="cosmos3-tiny", task=TaskType.TEXT_GENERATION, inputs=(TextPart(text=text),), ar=ARParams(**ar))


def _recompute_logits(mot, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits, _ = mot.text_prefill(torch.tensor([ids]))
    return logits[0, -1]


def test_greedy_equals_recompute_and_transformers(instance):
    mot = instance.component("transformer")
    record: list = []
    state, result = drive_loop(instance, "ar_decode", _request("hello fox", max_tokens=12), record=record)
    tokens = state.generated
    assert [p.op for p, _ in record] == ["ar_prefill"] + ["ar_token"] * (len(tokens) - 1)
    # Full recompute, greedy.
    ids, expected = list(state.prompt_ids), []
    for _ in range(len(tokens)):
        token = int(torch.argmax(_recompute_logits(mot, ids)))
        expected.append(token)
        ids.append(token)
        if token in state.stop_ids:
            break
    assert tokens == expected
    # transformers' generate on the same weights.
    hf = _transformers_reasoner(mot.config, mot.state_dict())
    with torch.no_grad():
        out = hf.generate(torch.tensor([state.prompt_ids]), max_new_tokens=12, do_sample=False,
                          eos_token_id=state.stop_ids, pad_token_id=state.stop_ids[0])
    assert out[0, len(state.prompt_ids):].tolist() == tokens
    assert result.artifacts[0].name == "text" and result.artifacts[0].token_ids == tokens
    assert instance.text_kv_pool.free_owner(state.request_id) > 0  # blocks were held until the program frees them


def test_seeded_sampling_equals_recompute(instance):
    mot = instance.component("transformer")
    record: list = []
    params = dict(max_tokens=10, temperature=0.9, top_k=20, top_p=0.9, presence_penalty=1.5, seed=7)
    state, _ = drive_loop(instance, "ar_decode", _request("a cat", **params), record=record)
    instance.text_kv_pool.free_owner(state.request_id)
    ids = list(state.prompt_ids)
    generator = torch.Generator().manual_seed(7)
    for step, ((plan, outputs), token) in enumerate(zip(record, state.generated)):
        recomputed = _recompute_logits(mot, ids)
        assert_close(outputs["logits"][0], recomputed)
        penalised = apply_presence_penalty(recomputed, state.generated[:step], 1.5)
        assert sample_next_token(penalised, temperature=0.9, top_k=20, top_p=0.9, generator=generator) == token
        ids.append(token)
    assert len(set(state.generated)) > 1


def test_fused_ar_token_group_of_different_lengths_equals_one_by_one(instance):
    pool = instance.text_kv_pool
    op = instance.op("ar_token")
    plans = []
    for text in ("short", "a much longer prompt than the other one"):
        record: list = []
        state, _ = drive_loop(instance, "ar_decode", _request(text, max_tokens=3), record=record)
        plans.append((state, record[-1][0]))  # the last ar_token plan (its K/V slot is rewritten idempotently)
    assert plans[0][1].batch_key() == plans[1][1].batch_key()  # context length is not in the batch key
    inputs = [p.inputs for _, p in plans]
    with torch.inference_mode():
        fused = op.run_fused(inputs, {})
        single = op.run_per_sample(inputs, {})
    for a, b in zip(fused, single):
        assert_close(a["logits"], b["logits"])
    for state, _ in plans:
        pool.free_owner(state.request_id)
    assert pool.used_blocks == 0
