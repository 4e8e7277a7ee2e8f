"""Two wan-toy-causal sessions with ``scheduler.overlap_kinds: [vae_tile]``: one session's chunk decode runs
on the overlap lane while the other session's causal forwards run on the main lane. Each session's chunks are
bit for bit the session streamed alone on one lane."""

from __future__ import annotations

import asyncio

import torch

from fv_kernel.api import Engine, SchedulerConfig, SessionRequest, WorkKind, build_instance
from fv_wan.toy_card import wan_toy_causal_card

CHUNKS = 3


def _session(index: int) -> SessionRequest:
    return SessionRequest(session_id=f"ov-session-{index}", model="wan-toy-causal",
                          prompt=["a red square moves left", "a blue circle moves up"][index], seed=index,
                          max_chunks=CHUNKS)


async def _stream(engine: Engine, request: SessionRequest) -> list[torch.Tensor]:
    handle = engine.open_session(request)
    return [event.frames async for event in handle.events() if event.type == "media.chunk"]


def _run(config: SchedulerConfig, requests: list[SessionRequest]) -> tuple[list[list[torch.Tensor]], Engine]:
    card = wan_toy_causal_card()
    assert card is not None
    engine = Engine(config)
    engine.add_instance(build_instance(card))

    async def go() -> list[list[torch.Tensor]]:
        async with engine.running():
            return list(await asyncio.wait_for(asyncio.gather(*(_stream(engine, r) for r in requests)), 300))

    return asyncio.run(go()), engine


def test_two_sessions_decode_beside_each_others_forwards_and_stream_their_own_chunks() -> None:
    requests = [_session(0), _session(1)]
    together, engine = _run(SchedulerConfig(batching="exact", overlap_kinds=(WorkKind.VAE_TILE,)), requests)
    assert engine.metrics.overlapped_batches > 0
    for request, chunks in zip(requests, together):
        alone, _ = _run(SchedulerConfig(batching="exact"), [request])
        assert len(chunks) == CHUNKS == len(alone[0])
        for index, (got, want) in enumerate(zip(chunks, alone[0])):
            assert torch.equal(got, want), f"{request.session_id} chunk {index}"
