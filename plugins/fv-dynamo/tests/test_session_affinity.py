"""Session affinity: a realtime session's messages reach the worker that holds its K/V, and a dead
worker ends its sessions with a clear event. Two real FvWorkers (each its own engine with the toy
causal chunk card) behind a stand-in for Dynamo's endpoint client (``instance_ids``/``direct``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fake_dynamo import FakeEndpointClient, Item
from fv_dynamo.sessions import SessionRouter
from fv_dynamo.worker import FvWorker, WorkerOptions

from fv_kernel.api import Engine, SchedulerConfig, build_instance
from fv_kernel.testing.chunk_kit import chunk_toy_card

FPS = 100  # chunks are paced to playback: a high rate keeps the test fast


async def _collect(stream: AsyncIterator[dict[str, Any]], into: list[dict[str, Any]]) -> None:
    async for message in stream:
        into.append(message)


async def _wait_for(messages: list[dict[str, Any]], kind: str, timeout: float = 20.0, **match: Any) -> dict[str, Any]:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        for m in messages:
            if m["type"] == kind and all(m.get(k) == v for k, v in match.items()):
                return m
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"no {kind} {match} in {[m['type'] for m in messages]}")
        await asyncio.sleep(0.01)


def _engine() -> Engine:
    engine = Engine(SchedulerConfig())
    engine.add_instance(build_instance(chunk_toy_card("toy-chunk")))
    return engine


def test_messages_follow_the_session_and_a_dead_worker_ends_its_sessions() -> None:
    async def scenario() -> None:
        engines = {1: _engine(), 2: _engine()}
        async with engines[1].running(), engines[2].running():
            workers = {i: FvWorker(e, WorkerOptions()) for i, e in engines.items()}
            assert all(w.serves_realtime for w in workers.values())
            client = FakeEndpointClient(workers)
            router = SessionRouter(client)
            a: list[dict[str, Any]] = []
            b: list[dict[str, Any]] = []
            start = {"type": "session.start", "prompt": "a kite", "width": 16, "height": 16, "fps": FPS}
            tasks = [asyncio.ensure_future(_collect(router.start(start), a))]
            sid_a = (await _wait_for(a, "video.start"))["request_id"]
            tasks.append(asyncio.ensure_future(_collect(router.start({**start, "prompt": "a boat"}), b)))
            sid_b = (await _wait_for(b, "video.start"))["request_id"]
            # Spread over both workers; each session lives where it was placed.
            assert router.placement == {sid_a: 1, sid_b: 2}
            assert set(workers[1].sessions) == {sid_a} and set(workers[2].sessions) == {sid_b}

            ack = await router.send(sid_b, {"type": "session.interaction",
                                            "interaction": {"event_id": "e1", "event": {"prompt": "a red boat"}}})
            assert ack["type"] == "session.interaction.queued" and ack["event_id"] == "e1"
            assert client.calls[-1] == (2, "session.interaction", sid_b)
            await _wait_for(b, "session.prompt_applied", event_id="e1")
            await _wait_for(b, "video.chunk", active_event_ids=["e1"])
            # Negative control: the same message sent to the other worker finds no such session there.
            stray = [m async for m in _data(await client.direct(
                {"type": "session.ping", "session_id": sid_b}, 1))]
            assert stray[0]["type"] == "error" and stray[0]["error"]["type"] == "not_found"

            client.kill(2)
            lost = await _wait_for(b, "error")
            assert lost["error"]["type"] == "worker_lost" and lost["request_id"] == sid_b
            done = await _wait_for(b, "session.done")
            assert done["reason"] == "failed" and done["stopped"] is False and done["request_id"] == sid_b
            late = await router.send(sid_b, {"type": "session.ping"})
            assert late["type"] == "error" and late["error"]["type"] == "worker_lost"

            # The other worker's session is untouched: it still streams, then stops cleanly.
            before = sum(m["type"] == "video.chunk" for m in a)
            await _wait_for(a, "video.chunk", transport_chunk_index=before)
            assert (await router.send(sid_a, {"type": "session.ping"}))["type"] == "session.pong"
            assert (await router.send(sid_a, {"type": "session.stop"}))["type"] == "session.stopping"
            done_a = await _wait_for(a, "session.done")
            assert done_a["stopped"] is True and done_a["reason"] == "stopped"
            after = await router.send(sid_a, {"type": "session.ping"})
            assert after["error"]["type"] == "session_closed"
            for session in list(workers[2].sessions.values()):  # the "dead" worker's engine is still in-process
                session.disconnect()
            await asyncio.wait_for(asyncio.gather(*tasks), 20)
            # A new session goes to the live worker only.
            assert router.choose() == 1

    asyncio.run(scenario())


async def _data(stream: AsyncIterator[Item]) -> AsyncIterator[dict[str, Any]]:
    async for item in stream:
        yield item.data()


def test_start_with_no_worker_and_bad_input_are_typed_errors() -> None:
    async def scenario() -> None:
        engine = _engine()
        async with engine.running():
            worker = FvWorker(engine, WorkerOptions())
            router = SessionRouter(FakeEndpointClient({}))
            assert [m["error"]["type"] async for m in router.start({"prompt": "x"})] == ["no_workers"]
            router = SessionRouter(FakeEndpointClient({1: worker}))
            replies = [m async for m in router.start({"prompt": "x", "width": 99999})]
            assert [m["type"] for m in replies] == ["error"] and replies[0]["error"]["type"] == "frame_too_large"
            assert router.placement == {}
            assert (await router.send("nope", {"type": "session.ping"}))["error"]["type"] == "not_found"

    asyncio.run(scenario())


class _Context:
    """Dynamo's request context: the frontend (or a client going away) stops the stream."""

    def __init__(self) -> None:
        self.stopped = asyncio.Event()

    async def async_killed_or_stopped(self) -> None:
        await self.stopped.wait()


def test_a_stopped_stream_ends_its_session_on_the_worker() -> None:
    async def scenario() -> None:
        engine = _engine()
        async with engine.running():
            worker = FvWorker(engine, WorkerOptions())
            context = _Context()
            messages: list[dict[str, Any]] = []
            stream = worker.realtime({"type": "session.start", "prompt": "a kite", "fps": FPS}, context)
            task = asyncio.ensure_future(_collect(stream, messages))
            await _wait_for(messages, "video.chunk")
            assert engine.running_count() == 1 and len(worker.sessions) == 1
            context.stopped.set()  # Dynamo stops pulling; the generator may never run again
            deadline = asyncio.get_running_loop().time() + 10
            while engine.running_count() + engine.queue_depth() and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.02)
            assert engine.running_count() + engine.queue_depth() == 0, "the session outlived its stream"
            task.cancel()

    asyncio.run(scenario())
