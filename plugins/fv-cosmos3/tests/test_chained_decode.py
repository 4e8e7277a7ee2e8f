"""Chained decode steps (``compute.decode_tokens_per_step``, docs/models/cosmos3.md): one scheduled ``ar_token`` step
samples several tokens, each fed to the next sub-step on the device. The tokens must be exactly those of one-token
steps at the same uniforms, on the graphed tier (its context buckets crossed mid-chain, padded rows) and on the
eager fallback, and a stop token inside a chain ends the request where one-token steps end it."""

from __future__ import annotations

import pytest
import torch

from fv_cosmos3 import graphed_decode
from fv_cosmos3.cards import cosmos3_card
from fv_cosmos3.graphed_decode import GraphedDecode, logits_health
from fv_kernel.api import (
    ARParams,
    Done,
    Engine,
    LoopContext,
    Request,
    SchedulerConfig,
    ShapeSignature,
    StepResult,
    TaskType,
    TextPart,
    WorkKind,
    build_instance,
    resolve_request,
)
from fv_kernel.runtime.cost import CostModel


def _instance(chain: int, buckets: tuple[int, ...] = (1, 2, 4)):
    """cosmos3-tiny with the static (graph-free) decode tier, contexts of 32 tokens up (a chain crosses a bucket),
    running ``chain`` tokens per step."""
    instance = build_instance(cosmos3_card("cosmos3-tiny"))
    instance.graphed_decode = GraphedDecode(buckets, capture=False, min_context=32)
    instance.decode_tokens_per_step = chain
    return instance


def _chat(prompt: str = "a red ball", **ar) -> Request:
    ar.setdefault("stop_token_ids", ())
    return Request(model="cosmos3-tiny", task=TaskType.TEXT_GENERATION, inputs=(TextPart(text=prompt),),
                   ar=ARParams(**ar))


def _start(instance, requests: list[Request]):
    """The decode loop and one prefilled state per request (each prefill alone)."""
    instance.load_for_task(TaskType.TEXT_GENERATION)
    loop = instance.loop("ar_decode")

    async def never(plan):
        raise AssertionError("the test runs each plan itself")

    states = []
    for request in requests:
        request = resolve_request(instance.card, request)
        state = loop.init(request, instance, LoopContext(request=request, executor=never))
        plan = loop.next(state)
        with torch.inference_mode():
            outputs = instance.op(plan.op).fn(plan.inputs, plan.params)
        states.append(loop.advance(state, StepResult(outputs=outputs)))
    return loop, states


def _decode_together(instance, requests: list[Request], record: list | None = None):
    """Every request's token steps run as one batch per step (as the executor fuses them), until all finish."""
    loop, states = _start(instance, requests)
    op = instance.op("ar_token")
    while True:
        live = [i for i, s in enumerate(states) if not isinstance(loop.next(s), Done)]
        if not live:
            return loop, states
        plans = [loop.next(states[i]) for i in live]
        assert len({plan.batch_key() for plan in plans}) == 1
        inputs = {name: torch.cat([plan.inputs[name] for plan in plans]) for name in plans[0].inputs}
        with torch.inference_mode():
            outputs = op.fn(inputs, plans[0].params)
        if record is not None:
            record.append((plans[0], outputs))
        for row, i in enumerate(live):
            mine = {name: tensor[row : row + 1] for name, tensor in outputs.items()}
            states[i] = loop.advance(states[i], StepResult(outputs=mine))


SAMPLERS = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=0.9, top_k=8, top_p=0.9, presence_penalty=1.5, seed=3),
}


@pytest.mark.parametrize("sampler", sorted(SAMPLERS))
@pytest.mark.parametrize("chain", [3, 8])
def test_a_chain_samples_the_tokens_of_one_token_steps(chain, sampler):
    """One request, 30 tokens: one-token steps and chains of 3 or 8 give the same tokens and generator state.
    The prompt and 30 tokens cross the 32-token context bucket inside a chain (a second capture mid-chain)."""
    ar = dict(max_tokens=30, **SAMPLERS[sampler])
    _, one = _decode_together(_instance(1), [_chat(**ar)])
    record: list = []
    chained_instance = _instance(chain)
    _, chained = _decode_together(chained_instance, [_chat(**ar)], record)
    assert chained[0].generated == one[0].generated and len(one[0].generated) == 30
    assert torch.equal(chained[0].rng_state, one[0].rng_state)
    assert chained[0].table.length == one[0].table.length
    # 29 token steps after the prefill's token: full chains and one shorter one, each priced ``repeat`` times one.
    chains = [plan.inputs["uniform"].shape[-1] if plan.inputs["uniform"].ndim == 2 else 1 for plan, _ in record]
    assert chains == [chain] * (29 // chain) + ([29 % chain] if 29 % chain else [])
    assert [plan.shape_sig.repeat for plan, _ in record] == chains
    contexts = {key.context for key in chained_instance.graphed_decode.keys()}
    assert contexts == {32, 64}, contexts


@pytest.mark.parametrize("rows", [3, 4])
def test_a_batch_of_chains_samples_each_rows_one_token_steps(rows):
    """Rows of different prompt lengths decoded together (3 rows: a padded bucket of 4), sampling with a presence
    penalty: each row's chained tokens are its one-token steps' tokens, and no row's K/V is touched by another's."""
    prompts = ["a fox", "a boat drifting on a calm lake", "snow", "city lights at night"][:rows]
    requests = [_chat(p, max_tokens=20, temperature=0.8, top_k=12, presence_penalty=2.0, seed=i)
                for i, p in enumerate(prompts)]
    _, one = _decode_together(_instance(1), requests)
    _, chained = _decode_together(_instance(5), requests)
    assert [s.generated for s in chained] == [s.generated for s in one]
    assert len({tuple(s.generated) for s in one}) == rows  # the rows differ: a row copied from another would show


def test_the_eager_fallback_chains_the_same_tokens():
    """Three rows with graphs for batch 1 only: the step runs eagerly, chaining on the host side of the op, and
    gives the one-token steps' tokens."""
    requests = [_chat(p, max_tokens=14, temperature=0.7, top_p=0.8, presence_penalty=1.0, seed=9)
                for p in ("a fox", "waves", "a slow train")]
    one_instance, chained_instance = _instance(1, buckets=(1,)), _instance(4, buckets=(1,))
    _, one = _decode_together(one_instance, requests)
    _, chained = _decode_together(chained_instance, requests)
    assert [s.generated for s in chained] == [s.generated for s in one]
    graphed = chained_instance.graphed_decode
    assert graphed.replays == graphed.prefill_replays == 3 and graphed.eager_steps > 0  # no decode step replayed


def test_a_stop_token_inside_a_chain_ends_the_request_where_one_token_steps_do():
    ar = dict(max_tokens=30, temperature=0.9, top_k=20, seed=1)
    _, one = _decode_together(_instance(1), [_chat(**ar)])
    tokens = one[0].generated
    # A token whose first appearance is inside a chain of 8 (token steps sample tokens[1:]; chains of 8).
    index = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i] and (i - 1) % 8 not in (0, 7))
    stop = tokens[index]
    _, one_stopped = _decode_together(_instance(1), [_chat(stop_token_ids=(stop,), **ar)])
    _, chained = _decode_together(_instance(8), [_chat(stop_token_ids=(stop,), **ar)])
    assert one_stopped[0].generated == tokens[: index + 1]
    assert chained[0].generated == one_stopped[0].generated and chained[0].finished
    assert torch.equal(chained[0].rng_state, one_stopped[0].rng_state)  # only the accepted draws were taken


def test_a_chain_that_skipped_an_update_gives_other_tokens(monkeypatch):
    """Negative control: a chain whose sub-steps do not record their tokens as seen (the presence penalty)
    diverges from one-token steps; so does one that keeps writing to the first sub-step's slot."""
    ar = dict(max_tokens=20, temperature=0.0, presence_penalty=5.0)
    _, one = _decode_together(_instance(1), [_chat(**ar)])
    original = graphed_decode._advance_buffers

    def forgets_seen(static, previous, sampled, uniform, seen_column, block_size):
        saved = static["seen"].clone() if static is previous else previous["seen"].clone()
        original(static, previous, sampled, uniform, seen_column, block_size)
        static["seen"].copy_(saved)

    monkeypatch.setattr(graphed_decode, "_advance_buffers", forgets_seen)
    _, chained = _decode_together(_instance(8), [_chat(**ar)])
    assert chained[0].generated != one[0].generated

    def stale_slot(static, previous, sampled, uniform, seen_column, block_size):
        slot = previous["slot"].clone()
        original(static, previous, sampled, uniform, seen_column, block_size)
        static["slot"].copy_(slot)

    monkeypatch.setattr(graphed_decode, "_advance_buffers", stale_slot)
    _, chained = _decode_together(_instance(8), [_chat(max_tokens=20, temperature=0.0)])
    _, plain = _decode_together(_instance(1), [_chat(max_tokens=20, temperature=0.0)])
    assert chained[0].generated != plain[0].generated


def test_a_chain_reports_nan_logits_of_any_sub_step():
    """The executor's NaN/Inf check reads ``health``: the sum over sub-steps of 0 per finite row, NaN otherwise."""
    logits = torch.tensor([[1.0, 2.0], [float("nan"), 0.0], [float("-inf"), 1.0]])
    health = logits_health(logits)
    assert health[0] == 0 and torch.isnan(health[1]) and torch.isnan(health[2])


def test_the_estimate_reserves_the_chains_next_plans():
    instance = _instance(8)
    loop = instance.loop("ar_decode")
    request = resolve_request(instance.card, _chat(max_tokens=30))
    steps = [s for s in loop.estimate(request, instance).steps if s.kind is WorkKind.AR_TOKEN]
    assert [(s.shape_sig.repeat, s.count) for s in steps] == [(8, 3), (5, 1)]
    cost = CostModel()
    spec = instance.card.loops["ar_decode"].step_cost
    one = cost.base_seconds(spec, ShapeSignature.of(tokens=1), "fp32")
    assert cost.base_seconds(spec, steps[0].shape_sig, "fp32") == pytest.approx(8 * one)


def test_streamed_text_carries_every_token_through_the_engine():
    """Through the Engine, chained: the text chunks are each non-stop token's text, the last chain's included (a
    ``Done`` carries what no plan will), and the answer is the one-token steps' answer."""

    def run(chain: int):
        engine = Engine(SchedulerConfig(device_thread=False))
        instance = _instance(chain)
        engine.add_instance(instance)
        request = _chat(max_tokens=21, temperature=0.8, top_k=16, seed=4)

        async def go():
            async with engine.running():
                handle = engine.submit(request)
                return [e async for e in handle.events()]

        from fv_kernel.runtime.blocking import run_blocking

        events = run_blocking(go())
        assert events[-1].type == "request.completed"
        text = next(e.artifact for e in events if e.type == "artifact.ready" and e.artifact.kind == "text")
        chunks = [e.text for e in events if e.type == "media.chunk" and e.stream == "text"]
        return list(text.token_ids), chunks, instance

    ids, chunks, instance = run(8)
    assert (ids, chunks) == run(1)[:2]
    tokenizer = instance.component("tokenizer")
    stops = {tokenizer.eos_token_id, tokenizer.token_id("<|endoftext|>")}
    assert chunks == [tokenizer.decode([t]) for t in ids if t not in stops]


def test_a_chained_step_without_its_sampling_inputs_names_what_is_missing():
    instance = _instance(4, buckets=(1,))
    loop, states = _start(instance, [_chat(max_tokens=10, temperature=0.5)])
    plan = loop.next(states[0])
    inputs = {name: tensor for name, tensor in plan.inputs.items() if name != "top_p"}
    with pytest.raises(ValueError, match=r"needs every sampling input; missing: \['top_p'\]"):
        instance.op("ar_token").fn(inputs, plan.params)
