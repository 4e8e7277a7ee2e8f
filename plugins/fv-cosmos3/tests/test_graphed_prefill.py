"""The captured prompt prefill (``GraphedDecode.prefill``, docs/models/cosmos3.md "Captured prefills"): a prompt
right-padded to its length bucket gives the eager prefill's logits and K/V, writes no slot past the prompt, and
shares a capture with every prompt of its bucket. On the CPU the same static function runs without a graph."""

from __future__ import annotations

import pytest
import torch

from fv_cosmos3 import graphed_decode
from fv_cosmos3.cards import cosmos3_card
from fv_cosmos3.graphed_decode import GraphedDecode
from fv_kernel.api import ARParams, LoopContext, Request, TaskType, TextPart, build_instance, resolve_request


def _instance(graphed: bool):
    instance = build_instance(cosmos3_card("cosmos3-tiny"))
    if graphed:
        instance.graphed_decode = GraphedDecode((1, 2, 4), capture=False, min_context=32)
    instance.load_for_task(TaskType.TEXT_GENERATION)
    return instance


def prefill_plan(instance, prompt: str, max_tokens: int = 8):
    """The first plan (the prefill) of a chat request on ``instance``, and the loop state it came from."""
    request = resolve_request(instance.card, Request(model="cosmos3-tiny", task=TaskType.TEXT_GENERATION,
                                                     inputs=(TextPart(text=prompt),), ar=ARParams(max_tokens=max_tokens)))

    async def never(plan):
        raise AssertionError("unused")

    loop = instance.loop("ar_decode")
    state = loop.init(request, instance, LoopContext(request=request, executor=never))
    return loop.next(state), state


def _prefill(instance, prompt: str):
    """The prefill plan of a chat request and its outputs; the request's block table."""
    plan, state = prefill_plan(instance, prompt)
    with torch.inference_mode():
        outputs = instance.op("ar_prefill").fn(plan.inputs, plan.params)
    return plan, outputs, state.table


def _slots(instance, table, length: int) -> torch.Tensor:
    """Flat slot ids of a table's first ``length`` positions."""
    block_size = instance.text_kv_pool.config.block_size
    positions = torch.arange(length)
    return torch.tensor(table.blocks)[positions // block_size] * block_size + positions % block_size


def _flat(storage: torch.Tensor) -> torch.Tensor:
    layers, heads, blocks, size, dim = storage.shape
    return storage.reshape(layers, heads, blocks * size, dim)


# Prompt lengths around the 32-token bucket's edges (the chat template adds tokens around the text).
PROMPTS = ["a", "a red ball", "a red ball rolls across a wooden floor and stops by the door",
           "snow falls on the quiet town"]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_a_captured_prefill_gives_the_eager_prefills_logits_and_kv(prompt):
    eager, graphed = _instance(False), _instance(True)
    plan, expected, table = _prefill(eager, prompt)
    _, actual, table_g = _prefill(graphed, prompt)
    length = plan.inputs["ids"].shape[1]
    assert graphed.graphed_decode.prefill_replays == 1
    torch.testing.assert_close(actual["logits"], expected["logits"], rtol=0, atol=1e-5)
    for side in (0, 1):
        want = _flat(eager.text_kv_pool.storage()[side])[:, :, _slots(eager, table, length)]
        got = _flat(graphed.text_kv_pool.storage()[side])[:, :, _slots(graphed, table_g, length)]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_a_captured_prefill_writes_no_slot_past_the_prompt():
    graphed = _instance(True)
    keys_before = graphed.text_kv_pool.storage()[0].clone()
    plan, _, table = _prefill(graphed, "a red ball")
    length = plan.inputs["ids"].shape[1]
    bucket = graphed.graphed_decode.prefill_keys()[0].length
    assert bucket > length  # padded: the padding had slots it could have written
    changed = (_flat(graphed.text_kv_pool.storage()[0]) != _flat(keys_before)).any(dim=-1).any(dim=1).any(dim=0)
    assert set(changed.nonzero().view(-1).tolist()) <= set(_slots(graphed, table, length).tolist())


def test_prompts_share_their_buckets_capture():
    graphed = _instance(True)
    lengths = [_prefill(graphed, prompt)[0].inputs["ids"].shape[1] for prompt in PROMPTS]
    buckets = {key.length for key in graphed.graphed_decode.prefill_keys()}
    assert buckets == {max(32, 1 << (n - 1).bit_length()) for n in lengths}
    assert graphed.graphed_decode.captures == len(buckets) < len(lengths)


def test_the_last_real_tokens_logits_are_the_ones_returned(monkeypatch):
    """Negative control: a prefill that reads the logits at the bucket's last (padded) position is caught."""
    original = graphed_decode.static_prefill_step

    def reads_the_padding(mot, store, buffers):
        shifted = dict(buffers, last=torch.full_like(buffers["last"], buffers["ids"].shape[1] - 1))
        return original(mot, store, shifted)

    monkeypatch.setattr(graphed_decode, "static_prefill_step", reads_the_padding)
    eager, graphed = _instance(False), _instance(True)
    _, expected, _ = _prefill(eager, "a red ball")
    _, actual, _ = _prefill(graphed, "a red ball")
    assert not torch.allclose(actual["logits"], expected["logits"], atol=1e-3)


def test_a_new_weights_version_drops_the_prefill_captures():
    graphed = _instance(True)
    _prefill(graphed, "a red ball")
    assert graphed.graphed_decode.prefill_keys()
    graphed.weights_version = "v-next"
    _prefill(graphed, "a red ball")
    assert [key.weights_version for key in graphed.graphed_decode.prefill_keys()] == ["v-next"]


def test_a_table_narrower_than_the_prompt_is_left_to_the_eager_prefill():
    """A table without a block for every prompt position: the captured prefill declines (the eager prefill grows
    the table), before it reads a column that is not there."""
    graphed = _instance(True)
    plan, _ = prefill_plan(graphed, "a red ball")
    narrow = dict(plan.inputs, table=plan.inputs["table"][:, :1])  # one block: fewer slots than the prompt's tokens
    assert plan.inputs["ids"].shape[1] > graphed.text_kv_pool.config.block_size
    decode = graphed.graphed_decode
    with torch.inference_mode():
        assert decode.prefill(graphed.component("transformer"), graphed.text_kv_pool, graphed.weights_version, narrow) is None
    assert decode.eager_steps == 1 and decode.prefill_replays == 0
