"""Shared weights, proven: the text K/V that ``ar_decode``'s prefill writes into the paged pool
equals, bit for bit, the K/V the diffusion loop keeps in its state for the same tokens."""

from __future__ import annotations

import torch
from cosmos3_testutils import drive_loop

from fv_cosmos3.cards import cosmos3_card
from fv_kernel.api import ARParams, DiffusionParams, Request, TaskType, TextPart, build_instance


def test_prefill_kv_equals_denoise_kv():
    instance = build_instance(cosmos3_card("cosmos3-tiny"))
    instance.load_for_task(TaskType.TEXT_TO_VIDEO)
    t2v = Request(model="cosmos3-tiny", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text="a fox"),),
                  diffusion=DiffusionParams(steps=1, guidance=1.0))
    record: list = []
    denoise_state, _ = drive_loop(instance, "denoise", t2v, record=record)
    cond_ids = denoise_state.prompt_ids["cond"]
    assert denoise_state.branches == ["cond"] and [p.op for p, _ in record] == ["text_kv", "generate"]

    # Prefill exactly those tokens through the reasoner's decode path and read the pool back.
    ar_loop = instance.loop("ar_decode")
    chat = Request(model="cosmos3-tiny", task=TaskType.TEXT_GENERATION, inputs=(TextPart(text="x"),),
                   ar=ARParams(max_tokens=1))
    from fv_kernel.api import LoopContext

    state = ar_loop.init(chat, instance, LoopContext(request=chat, executor=None))  # type: ignore[arg-type]
    state = state.model_copy(update={"prompt_ids": cond_ids})
    pool = instance.text_kv_pool
    table = pool.reserve(state.table, len(cond_ids))
    plan = ar_loop.next(state.model_copy(update={"table": table, "table_ids": pool.table_tensor(table)[None]}))
    assert plan.op == "ar_prefill"
    with torch.inference_mode():
        instance.op("ar_prefill").fn(plan.inputs, plan.params)
    keys, values = pool.gather(table.model_copy(update={"length": len(cond_ids)}))
    assert torch.equal(keys, denoise_state.text_keys["cond"])
    assert torch.equal(values, denoise_state.text_values["cond"])
    pool.free_owner(chat.request_id)
