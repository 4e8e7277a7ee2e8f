"""Realtime sessions on the Engine (docs/realtime.md, "Sessions"): lifecycle, prompt updates at chunk
boundaries, cancel scopes, idle timeout, admission, interleaving with batch jobs, failure isolation,
suspend/resume in a fresh process. All on the toy-chunk card (fv_kernel/testing/chunk_kit.py), CPU fp32."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from fv_kernel.api import (
    CapacityError,
    InvalidRequest,
    SessionClosed,
    SessionRequest,
    UnknownModel,
    build_instance,
)
from fv_kernel.extend.observers import Observer, StepRecord
from fv_kernel.runtime.engine import Engine
from fv_kernel.runtime.scheduler import SchedulerConfig
from fv_kernel.testing.batching import StepRecorder
from fv_kernel.testing.chunk_kit import ToyChunkLoop, chunk_toy_card
from fv_kernel.testing.toy import toy_card

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")

TIMEOUT = 30.0


class Trigger(Observer):
    """Calls ``action`` once, right after the ``nth`` (1-based) executed ``op`` step of ``session``:
    between that step and the next, where a client message lands mid-chunk."""

    name = "trigger"

    def __init__(self, session: str, op: str, nth: int, action: Callable[[], None]) -> None:
        self.session, self.op, self.nth, self.action = session, op, nth, action
        self.seen = 0

    def on_step(self, record: StepRecord) -> None:
        if self.session in record.request_ids and record.op == self.op:
            self.seen += 1
            if self.seen == self.nth:
                self.action()


def make_engine(*cards: Any, config: SchedulerConfig | None = None) -> tuple[Engine, StepRecorder]:
    engine = Engine(config or SchedulerConfig(device_thread=False))
    for card in cards or (chunk_toy_card(),):
        engine.add_instance(build_instance(card))
    recorder = StepRecorder()
    engine.observers.append(recorder)
    return engine, recorder


def session(sid: str, **fields: Any) -> SessionRequest:
    fields.setdefault("prompt", "a red fox runs")
    fields.setdefault("max_chunks", 4)
    fields.setdefault("seed", 3)
    return SessionRequest(session_id=sid, model="toy-chunk", **fields)


async def collect(handle: Any, on_event: Callable[[Any], None] | None = None) -> list[Any]:
    async def go() -> list[Any]:
        events = []
        async for event in handle.events():
            events.append(event)
            if on_event is not None:
                on_event(event)
        return events

    return await asyncio.wait_for(go(), TIMEOUT)


def chunks(events: list[Any]) -> list[Any]:
    return [e for e in events if e.type == "media.chunk"]


def run_one(req: SessionRequest, setup: Callable[[Engine, Any], None] | None = None) -> list[Any]:
    """Run one session alone on a fresh engine and return its events."""

    async def go() -> list[Any]:
        engine, _ = make_engine()
        async with engine.running():
            handle = engine.open_session(req)
            if setup is not None:
                setup(engine, handle)
            return await collect(handle)

    return asyncio.run(go())


def ops_of(recorder: StepRecorder, sid: str) -> list[str]:
    return [r.op for r in recorder.records if sid in r.request_ids]


# -- lifecycle -----------------------------------------------------------------------------------


def test_a_session_streams_typed_chunks_with_continuous_frame_ranges_and_completes() -> None:
    events = run_one(session("s", max_chunks=3))
    types = [e.type for e in events]
    assert types[:3] == ["request.queued", "session.started", "media.init"]
    assert types[-2:] == ["media.complete", "session.closed"]
    assert events[-1].reason == "completed" and events[-1].chunks == 3
    got = chunks(events)
    assert [c.index for c in got] == [0, 1, 2]
    assert [(c.frame_start, c.num_frames) for c in got] == [(0, 2), (2, 2), (4, 2)]
    assert [c.pts for c in got] == [(0.0, 0.25), (0.25, 0.5), (0.5, 0.75)], "pts = frame range / fps (8)"
    assert all(c.frames.shape == (2, 3, 8, 8) and not c.preview and c.prompt_version == 0 for c in got)
    assert [e.seq for e in events] == list(range(len(events)))


def _update_mid_chunk(sid: str, req: SessionRequest) -> tuple[list[Any], list[str]]:
    """A session whose prompt is updated right after the first denoise step of its chunk 1 (mid-chunk)."""
    async def go() -> tuple[list[Any], list[str]]:
        engine, recorder = make_engine()
        async with engine.running():
            handle = engine.open_session(req)
            versions: list[int] = []
            engine.observers.append(Trigger(sid, "chunk_denoise", 3, lambda: versions.append(
                handle.push_text("a blue bird glides", event_id="upd-1"))))
            events = await collect(handle)
            assert versions == [1]
            return events, ops_of(recorder, sid)

    return asyncio.run(go())


def check_prompt_update_applied_at_boundary(sid: str = "u") -> None:
    req = session(sid, max_chunks=4)
    events, ops = _update_mid_chunk(sid, req)
    reference = chunks(run_one(req))
    got = chunks(events)
    queued = [e for e in events if e.type == "session.prompt_queued"]
    applied = [e for e in events if e.type == "session.prompt_applied"]
    assert [(e.event_id, e.version) for e in queued] == [("upd-1", 1)], "acknowledged with its version"
    assert [(e.version, e.chunk_index) for e in applied] == [(1, 2)], "applies at the boundary after chunk 1"
    assert [c.prompt_version for c in got] == [0, 0, 1, 1], "each chunk records the version it was generated under"
    # The chunk in progress when the update arrived is exactly the chunk without the update.
    for index in (0, 1):
        assert torch.equal(got[index].frames, reference[index].frames), f"chunk {index} must not see the update"
    assert not torch.equal(got[2].frames, reference[2].frames), "chunk 2 is generated under the new prompt"
    # The text encode of the new prompt runs at a chunk boundary: right after a decode, never mid-chunk.
    for i, op in enumerate(ops):
        if op == "chunk_text":
            assert i == 0 or ops[i - 1] == "chunk_decode", f"text encode mid-chunk at op {i}: {ops}"
    assert applied[0].seq > got[1].seq, "applied is reported after the last chunk of the old prompt"


def test_a_prompt_update_is_acknowledged_and_applied_at_the_next_chunk_boundary() -> None:
    check_prompt_update_applied_at_boundary()


def test_negative_control_a_prompt_update_applied_mid_chunk_fails_the_boundary_check(monkeypatch: pytest.MonkeyPatch) -> None:
    def immediate(self: ToyChunkLoop, state: Any, prompt: str, version: int) -> Any:
        return state.model_copy(update={"prompt": prompt, "prompt_version": version})

    monkeypatch.setattr(ToyChunkLoop, "update_prompt", immediate)
    with pytest.raises(AssertionError):
        check_prompt_update_applied_at_boundary("n")


def test_stop_ends_the_session_frees_its_slabs_and_refuses_later_messages() -> None:
    async def go() -> None:
        engine, _ = make_engine()
        pool = engine.instances["toy-chunk"].pool
        async with engine.running():
            handle = engine.open_session(session("s", max_chunks=None))

            def on_event(event: Any) -> None:
                if event.type == "media.chunk" and event.index == 1:
                    assert pool.used_slabs > 0, "a running session holds its window's slabs"
                    handle.stop()

            events = await collect(handle, on_event)
            assert events[-1].type == "session.closed" and events[-1].reason == "stopped"
            assert handle.closed and handle.close_reason == "stopped"
            assert pool.used_slabs == 0 and "s" not in engine.admission.reservations, "slabs and reservation released"
            assert "s" not in engine.scheduler.running
            with pytest.raises(SessionClosed) as err:
                handle.push_text("too late")
            assert err.value.param == "session_id" and "stopped" in err.value.message
            with pytest.raises(SessionClosed):
                await handle.suspend()

    asyncio.run(go())


def test_idle_timeout_ends_a_session_without_client_messages_and_touch_keeps_it_alive() -> None:
    async def go() -> None:
        engine, _ = make_engine()
        async with engine.running():
            idle = engine.open_session(session("idle", max_chunks=None, idle_timeout_s=0.3))
            kept = engine.open_session(session("kept", max_chunks=None, idle_timeout_s=0.3))
            idle_events = asyncio.ensure_future(collect(idle))
            kept_events = asyncio.ensure_future(collect(kept))
            for _ in range(8):  # 0.8 s of pings, every 0.1 s: well past the 0.3 s timeout
                await asyncio.sleep(0.1)
                kept.touch()
            events = await idle_events
            assert events[-1].reason == "idle_timeout" and len(chunks(events)) > 0
            assert not kept.closed, "a touched session stays open past its idle timeout"
            kept.stop()
            assert (await kept_events)[-1].reason == "stopped"

    asyncio.run(go())


# -- cancel scopes ---------------------------------------------------------------------------------


def test_cancel_stream_abandons_the_chunk_in_progress_and_the_session_continues() -> None:
    req = session("c", max_chunks=4)
    reference = chunks(run_one(req))

    def setup(engine: Engine, handle: Any) -> None:
        engine.observers.append(Trigger("c", "chunk_denoise", 3, lambda: handle.cancel("stream")))

    events = run_one(req, setup)
    got = chunks(events)
    assert events[-1].reason == "completed" and [c.index for c in got] == [0, 1, 2, 3]
    assert [c.frame_start for c in got] == [0, 2, 4, 6], "the timeline stays continuous"
    assert torch.equal(got[0].frames, reference[0].frames)
    assert not torch.equal(got[1].frames, reference[1].frames), "chunk 1 was restarted from fresh noise"


def test_cancel_session_ends_it_and_an_unknown_scope_is_a_typed_error_the_session_survives() -> None:
    async def go() -> None:
        engine, _ = make_engine()
        async with engine.running():
            handle = engine.open_session(session("s", max_chunks=None))

            def on_event(event: Any) -> None:
                if event.type == "media.chunk" and event.index == 0:
                    with pytest.raises(InvalidRequest) as err:
                        handle.cancel("everything")
                    assert err.value.param == "scope" and "stream" in err.value.message
                if event.type == "media.chunk" and event.index == 2:
                    handle.cancel("session")

            events = await collect(handle, on_event)
            errors = [e for e in events if e.type == "session.error"]
            assert [e.error.param for e in errors] == ["scope"], "bad input is a session.error event"
            assert len(chunks(events)) >= 3, "the session lived on after the bad cancel"
            assert events[-1].reason == "cancelled"

    asyncio.run(go())


def test_bad_prompt_updates_are_typed_errors_and_the_session_lives_on() -> None:
    async def go() -> None:
        engine, _ = make_engine()
        async with engine.running():
            handle = engine.open_session(session("s", max_chunks=3))
            with pytest.raises(InvalidRequest) as err:
                handle.push_text("   ", event_id="e1")
            assert err.value.param == "prompt"
            with pytest.raises(InvalidRequest):
                handle.push_text("x" * 5000, event_id="e2")
            events = await collect(handle)
            errors = [(e.event_id, e.error.param) for e in events if e.type == "session.error"]
            assert errors == [("e1", "prompt"), ("e2", "prompt")]
            assert events[-1].reason == "completed" and len(chunks(events)) == 3

    asyncio.run(go())


def test_opening_a_session_validates_with_typed_errors() -> None:
    async def go() -> None:
        engine, _ = make_engine(chunk_toy_card(), toy_card("toy-dit"))
        async with engine.running():
            with pytest.raises(UnknownModel):
                engine.open_session(SessionRequest(model="nope", prompt="x"))
            with pytest.raises(InvalidRequest) as err:
                engine.open_session(SessionRequest(model="toy-dit", prompt="x"))
            assert err.value.param == "model" and "toy-chunk" in err.value.message, "names the cards that can stream"
            engine.open_session(session("dup"))
            with pytest.raises(InvalidRequest) as err:
                engine.open_session(session("dup"))
            assert err.value.param == "session_id"

    asyncio.run(go())
    with pytest.raises(InvalidRequest) as err:
        SessionRequest.of(model="toy-chunk", prompt="x", max_chunks=0)
    assert err.value.param == "max_chunks"


# -- admission, scheduling, isolation ------------------------------------------------------------------


def test_sessions_are_admitted_by_their_slab_reservation_and_wait_when_the_pool_is_full() -> None:
    """A pool of one window (3 slabs): the second session waits until the first ends; both complete."""

    class Live(Observer):
        name = "live"

        def __init__(self) -> None:
            self.running: list[int] = []
            self.slabs: list[int] = []

        def on_step(self, record: StepRecord) -> None:
            self.running.append(engine.running_count())
            self.slabs.append(pool.used_slabs)

    engine, _ = make_engine(chunk_toy_card(pool_slabs=3))
    pool = engine.instances["toy-chunk"].pool
    live = Live()
    engine.observers.append(live)

    async def go() -> list[list[Any]]:
        async with engine.running():
            handles = [engine.open_session(session(f"s{i}", max_chunks=4)) for i in range(2)]
            return list(await asyncio.gather(*(collect(h) for h in handles)))

    results = asyncio.run(go())
    assert [r[-1].reason for r in results] == ["completed", "completed"]
    assert max(live.running) == 1 and max(live.slabs) <= 3, "never two windows in a pool of one"


def test_a_session_that_can_never_fit_is_refused_at_open() -> None:
    async def go() -> None:
        engine, _ = make_engine(chunk_toy_card(pool_slabs=2))  # a window needs 3 slabs
        async with engine.running():
            with pytest.raises(CapacityError):
                engine.open_session(session("big"))

    asyncio.run(go())


def interleaved(sequence: list[str], a: str, b: str) -> bool:
    """Whether a unit of ``b`` ran between ``a``'s first and last unit."""
    positions = [i for i, rid in enumerate(sequence) if rid == a]
    return any(rid == b for rid in sequence[positions[0]:positions[-1]])


def run_two_sessions_and_a_batch_job(config: SchedulerConfig) -> tuple[list[str], dict[str, str]]:
    from fv_kernel.api import DiffusionParams, Request, TaskType, TextPart

    engine, recorder = make_engine(chunk_toy_card(), toy_card("toy-dit"), config=config)
    # Loaded up front: a first request's load runs on a thread, and on a loaded machine the job's could
    # outlast both sessions, which would then finish before the job's first unit (a test timing, not scheduling).
    for model_id in ("toy-chunk", "toy-dit"):
        engine.instances[model_id].load_for_task(TaskType.TEXT_TO_VIDEO)

    async def go() -> dict[str, str]:
        async with engine.running():
            a = engine.open_session(session("A", max_chunks=4))
            b = engine.open_session(session("B", max_chunks=4, seed=4))
            job = engine.submit(Request(request_id="job", model="toy-dit", task=TaskType.TEXT_TO_VIDEO,
                                        inputs=(TextPart(text="a batch job"),), diffusion=DiffusionParams(steps=4)))
            ea, eb = await asyncio.gather(collect(a), collect(b))
            return {"A": ea[-1].reason, "B": eb[-1].reason, "job": (await job.result()).status}

    outcome = asyncio.run(go())
    sequence = [rid for r in recorder.records for rid in r.request_ids]
    return sequence, outcome


def test_two_sessions_and_a_batch_job_interleave_their_work_units_in_one_scheduler() -> None:
    sequence, outcome = run_two_sessions_and_a_batch_job(SchedulerConfig(device_thread=False))
    assert outcome == {"A": "completed", "B": "completed", "job": "completed"}
    for a, b in (("A", "B"), ("B", "A"), ("A", "job"), ("job", "A")):
        assert interleaved(sequence, a, b), f"{b}'s units run between {a}'s first and last: {sequence}"


def test_negative_control_request_at_a_time_scheduling_does_not_interleave() -> None:
    sequence, outcome = run_two_sessions_and_a_batch_job(SchedulerConfig(device_thread=False, scheduling="request"))
    assert outcome == {"A": "completed", "B": "completed", "job": "completed"}
    assert not interleaved(sequence, "A", "B") and not interleaved(sequence, "A", "job")


def test_a_failing_session_does_not_take_the_other_down() -> None:
    async def go() -> None:
        engine, _ = make_engine()
        async with engine.running():
            good = engine.open_session(session("good", max_chunks=4))
            bad = engine.open_session(session("bad", max_chunks=4, seed=9))
            late = engine.open_session(session("late", max_chunks=None))

            def on_event(event: Any) -> None:
                if event.type == "media.chunk" and event.index == 1:
                    late.push_text("a boom in the night")  # its text encode raises (the toy's fault injection)

            bad.push_text("boom goes the toy")
            eg, eb, el = await asyncio.gather(collect(good), collect(bad), collect(late, on_event))
            assert eg[-1].reason == "completed" and len(chunks(eg)) == 4
            for events in (eb, el):
                assert events[-1].reason == "failed" and events[-1].error.type == "step_failed"
                assert "toy fault" in events[-1].error.message
            assert len(chunks(el)) >= 2, "the late failure came after chunks were streamed"
            assert engine.instances["toy-chunk"].pool.used_slabs == 0, "failed sessions free their slabs"

    asyncio.run(go())


# -- suspend / resume ----------------------------------------------------------------------------------

RESUME_SCRIPT = textwrap.dedent("""
    import asyncio, sys, torch
    torch.set_num_threads(int(sys.argv[3]))
    from fv_kernel.api import build_instance
    from fv_kernel.runtime.engine import Engine
    from fv_kernel.runtime.scheduler import SchedulerConfig
    from fv_kernel.testing.chunk_kit import chunk_toy_card

    async def main():
        engine = Engine(SchedulerConfig(device_thread=False))
        engine.add_instance(build_instance(chunk_toy_card()))
        async with engine.running():
            handle = engine.resume_session(open(sys.argv[1], "rb").read())
            out = []
            async for event in handle.events():
                if event.type == "media.chunk":
                    out.append((event.index, event.frame_start, event.prompt_version, event.frames))
                last = event
            assert last.reason == "completed", last
        torch.save(out, sys.argv[2])

    asyncio.run(main())
""")


def suspended_part(req: SessionRequest, after_chunk: int) -> tuple[list[Any], bytes]:
    """Run ``req`` until chunk ``after_chunk`` arrives, push a prompt update, suspend; the chunks and the bytes."""
    async def go() -> tuple[list[Any], bytes]:
        engine, _ = make_engine()
        async with engine.running():
            handle = engine.open_session(req)
            got: list[Any] = []
            async for event in handle.events():
                if event.type == "media.chunk":
                    got.append(event)
                    if event.index == after_chunk:
                        handle.push_text("a green frog hops")  # pending at suspend time: must survive it
                        data = await handle.suspend()
                if event.type == "session.closed":
                    assert event.reason == "suspended"
            assert engine.instances["toy-chunk"].pool.used_slabs == 0, "a suspended session frees its slabs"
            return got, data

    return asyncio.run(go())


def uninterrupted(req: SessionRequest, after_chunk: int) -> list[Any]:
    async def go() -> list[Any]:
        engine, _ = make_engine()
        async with engine.running():
            handle = engine.open_session(req)

            def on_event(event: Any) -> None:
                if event.type == "media.chunk" and event.index == after_chunk:
                    handle.push_text("a green frog hops")

            return chunks(await collect(handle, on_event))

    return asyncio.run(go())


def resume_in_this_process(data: bytes) -> list[tuple[int, int, int, torch.Tensor]]:
    async def go() -> list[tuple[int, int, int, torch.Tensor]]:
        engine, _ = make_engine()
        async with engine.running():
            handle = engine.resume_session(data)
            events = await collect(handle)
            assert events[-1].reason == "completed"
            types = [e.type for e in events]
            resumed = events[types.index("session.resumed")]
            assert types.index("session.started") < types.index("session.resumed") < types.index("media.chunk")
            assert resumed.prompt_version == 0 and resumed.chunk_index >= 2
            return [(c.index, c.frame_start, c.prompt_version, c.frames) for c in chunks(events)]

    return asyncio.run(go())


def check_bit_identical(reference: list[Any], first: list[Any], rest: list[tuple[int, int, int, torch.Tensor]]) -> None:
    joined = [(c.index, c.frame_start, c.prompt_version, c.frames) for c in first] + rest
    assert [j[:3] for j in joined] == [(c.index, c.frame_start, c.prompt_version) for c in reference]
    for (index, _, _, frames), ref in zip(joined, reference):
        assert torch.equal(frames, ref.frames), f"chunk {index} differs after resume"


def test_suspend_then_resume_in_a_fresh_process_is_bit_identical_to_an_uninterrupted_session(tmp_path: Path) -> None:
    req = session("sr", max_chunks=6)
    reference = uninterrupted(req, after_chunk=1)
    first, data = suspended_part(req, after_chunk=1)
    assert 2 <= len(first) < 6 and isinstance(data, bytes)
    state_file, out_file = tmp_path / "session.bin", tmp_path / "rest.pt"
    state_file.write_bytes(data)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run([sys.executable, "-c", RESUME_SCRIPT, str(state_file), str(out_file), str(torch.get_num_threads())],
                   check=True, env=env, timeout=120)
    rest = torch.load(out_file, weights_only=True)
    assert rest, "the resumed session streamed the remaining chunks"
    check_bit_identical(reference, first, rest)
    assert [c.prompt_version for c in reference][-1] == 1, "the update queued before suspend applied after resume"


def test_negative_control_a_resume_that_drops_the_kv_is_not_bit_identical(monkeypatch: pytest.MonkeyPatch) -> None:
    req = session("nk", max_chunks=6)
    reference = uninterrupted(req, after_chunk=1)
    first, data = suspended_part(req, after_chunk=1)
    check_bit_identical(reference, first, resume_in_this_process(data))  # the honest resume, in-process

    def drop_kv(self: ToyChunkLoop, state: Any, model: Any, ctx: Any) -> Any:
        assert state.window is not None
        empty = self._pool.open(state.request_id, state.window.spec)
        return state.model_copy(update={"window": empty, "kv": None})

    monkeypatch.setattr(ToyChunkLoop, "restore", drop_kv)
    with pytest.raises(AssertionError, match="differs after resume"):
        check_bit_identical(reference, first, resume_in_this_process(data))


def test_resume_refuses_bytes_that_are_not_a_suspended_session() -> None:
    from fv_kernel.api import StateFormatError

    async def go() -> None:
        engine, _ = make_engine()
        async with engine.running():
            with pytest.raises(StateFormatError) as err:
                engine.resume_session(b"not a session")
            assert err.value.param == "state"

    asyncio.run(go())


# -- backpressure ------------------------------------------------------------------------------------


def run_with_a_slow_listener(max_ahead: int) -> int:
    """Chunks a session emitted while its only listener held its first chunk for 0.3 s."""

    async def go() -> int:
        engine, _ = make_engine()
        async with engine.running():
            handle = engine.open_session(session("slow", max_chunks=None, max_ahead_chunks=max_ahead))
            events = handle.events()
            async for event in events:
                if event.type == "media.chunk":
                    break
            await asyncio.sleep(0.3)
            emitted = handle._record.chunks_emitted
            handle.stop()
            async for _ in events:
                pass
            return emitted

    return asyncio.run(go())


def test_a_session_pauses_when_it_is_max_ahead_chunks_ahead_of_its_listener() -> None:
    # One chunk taken, max_ahead emitted beyond it, and the one that was being made when it paused.
    assert run_with_a_slow_listener(2) <= 1 + 2 + 1


def test_negative_control_without_backpressure_the_session_runs_away() -> None:
    assert run_with_a_slow_listener(64) > 1 + 2 + 1


def test_cancel_scopes_request_and_loop_end_the_session_like_session() -> None:
    for scope in ("request", "loop"):
        def setup(engine: Engine, handle: Any, scope: str = scope) -> None:
            engine.observers.append(Trigger(f"x{scope}", "chunk_decode", 1, lambda: handle.cancel(scope)))

        events = run_one(session(f"x{scope}", max_chunks=None), setup)
        assert events[-1].reason == "cancelled", scope


def test_a_queued_session_also_times_out_and_a_late_subscriber_sees_session_events_then_live() -> None:
    async def go() -> None:
        engine, _ = make_engine(chunk_toy_card(pool_slabs=3))  # room for one window
        async with engine.running():
            running = engine.open_session(session("run", max_chunks=None))
            queued = engine.open_session(session("wait", max_chunks=None, idle_timeout_s=0.3))
            first = running.events()
            seen = 0
            async for event in first:
                seen += event.type == "media.chunk"
                if seen == 3:
                    break
            late = [e async for e in _take(running.events(), 4)]
            assert late[0].type == "request.queued" and "session.started" in [e.type for e in late]
            assert [e.type for e in late].count("media.chunk") <= 1, "past chunks are not replayed to a late subscriber"
            closed = await asyncio.wait_for(queued.wait_closed(), TIMEOUT)
            assert closed == "idle_timeout" and not running.closed
            running.stop()
            assert await asyncio.wait_for(running.wait_closed(), TIMEOUT) == "stopped"

    asyncio.run(go())


async def _take(events: Any, n: int) -> Any:
    count = 0
    async for event in events:
        yield event
        count += 1
        if count == n:
            return


def test_a_suspend_is_taken_while_the_session_waits_for_a_slow_listener() -> None:
    async def go() -> None:
        engine, _ = make_engine()
        async with engine.running():
            handle = engine.open_session(session("p", max_chunks=None, max_ahead_chunks=1))
            events = handle.events()
            async for event in events:
                if event.type == "media.chunk":
                    break
            await asyncio.sleep(0.1)  # the session is paused: its listener holds chunks it has not taken
            data = await asyncio.wait_for(handle.suspend(), TIMEOUT)
            assert data and await asyncio.wait_for(handle.wait_closed(), TIMEOUT) == "suspended"
            await events.aclose()

    asyncio.run(go())
