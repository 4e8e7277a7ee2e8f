"""A second device lane (``scheduler.overlap_kinds``): one request's VAE decode beside another's denoise.

The toy card's decode op waits (up to a bound) for a denoise step of another request to run while
it decodes: with the lane, that step runs; with one lane it cannot, and the wait runs out. The
results are the requests' own, bit for bit; memory admits the second batch only beside the first's
peak; a failing decode fails its request only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import threading
from typing import Any, Mapping

import pytest
import torch
from pydantic import ValidationError

from fv_kernel.api import DiffusionParams, Engine, Request, SchedulerConfig, TaskType, TextPart, build_instance
from fv_kernel.loop.plan import ResourceRequest, StepResult, WorkKind, WorkPlan
from fv_kernel.model.instance import ModelInstance
from fv_kernel.parallel.engine import SpmdEngine
from fv_kernel.runtime.batching import BatchPolicy, BatchScheduler, WorkUnit
from fv_kernel.runtime.scheduler import Scheduler
from fv_kernel.runtime.cost import CostModel
from fv_kernel.runtime.metrics import EngineMetrics
from fv_kernel.testing.toy import toy_card

OVERLAP = SchedulerConfig(overlap_kinds=(WorkKind.VAE_TILE,), batching="exact")
ONE_LANE = SchedulerConfig(batching="exact")
#: How long the decode waits for a denoise step to run beside it: long enough for the main lane's next
#: step on a loaded CI machine, short enough that the one-lane control fails in seconds, not a hang.
WAIT_S = 10.0


def _request(seed: int, steps: int) -> Request:
    return Request(model="toy-dit", task=TaskType.TEXT_TO_VIDEO, inputs=(TextPart(text=f"prompt {seed}"),),
                   diffusion=DiffusionParams(seed=seed, steps=steps))


class _Witness:
    """Wraps the instance's ops: the first decode waits until a denoise step runs while it decodes."""

    def __init__(self, instance: ModelInstance, *, fail_first_decode: bool = False) -> None:
        self.decoding = threading.Event()
        self.dit_beside_decode = threading.Event()
        self.threads: dict[str, set[str]] = {}
        self.fail_first_decode = fail_first_decode
        self.waited = False
        self._op = instance.op
        instance.op = self.op  # type: ignore[method-assign]

    def op(self, name: str) -> Any:
        base = self._op(name)

        def run(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> Any:
            self.threads.setdefault(name, set()).add(threading.current_thread().name)
            if name == "dit_forward" and self.decoding.is_set():
                self.dit_beside_decode.set()
            if name == "decode_frame":
                if self.fail_first_decode:
                    self.fail_first_decode = False
                    raise RuntimeError("decode broke")
                if not self.waited:
                    self.waited = True
                    self.decoding.set()  # while this first decode runs
                    try:
                        self.dit_beside_decode.wait(WAIT_S)
                        return base.fn(inputs, params)
                    finally:
                        self.decoding.clear()
            return base.fn(inputs, params)

        return dataclasses.replace(base, fn=run)


def _run(config: SchedulerConfig, requests: list[Request], *, witness: bool = True,
         fail_first_decode: bool = False) -> tuple[list[Any], Engine, _Witness | None]:
    engine = Engine(config)
    instance = build_instance(toy_card("toy-dit"))
    engine.add_instance(instance)
    seen = _Witness(instance, fail_first_decode=fail_first_decode) if witness else None

    async def go() -> list[Any]:
        async with engine.running():
            return list(await asyncio.wait_for(asyncio.gather(*(engine.generate_async(r) for r in requests)), 120))

    return asyncio.run(go()), engine, seen


def test_a_decode_runs_beside_another_requests_denoise_on_its_own_lane() -> None:
    results, engine, seen = _run(OVERLAP, [_request(1, 2), _request(2, 30)])
    assert [r.status for r in results] == ["completed", "completed"]
    assert seen is not None and seen.dit_beside_decode.is_set(), "no denoise step ran while a decode ran"
    assert engine.metrics.overlapped_batches > 0
    assert seen.threads["decode_frame"] == {"fv-device-overlap_0"}
    assert seen.threads["dit_forward"] == {"fv-device_0"}


def test_with_one_lane_the_decode_holds_the_device() -> None:
    # The control: the same requests on one lane; the decode's wait runs out with no step beside it.
    results, engine, seen = _run(ONE_LANE, [_request(1, 2), _request(2, 30)])
    assert [r.status for r in results] == ["completed", "completed"]
    assert seen is not None and not seen.dit_beside_decode.is_set()
    assert engine.metrics.overlapped_batches == 0


def test_overlapped_results_are_each_requests_own_bit_for_bit() -> None:
    requests = [_request(3, 3), _request(4, 12), _request(5, 7)]
    together, engine, _ = _run(OVERLAP, requests, witness=False)
    assert engine.metrics.overlapped_batches > 0
    for request, result in zip(requests, together):
        alone, _, _ = _run(ONE_LANE, [request], witness=False)
        assert torch.equal(result.artifact("video").frames, alone[0].artifact("video").frames), request.diffusion.seed


def test_a_failing_decode_on_the_overlap_lane_fails_its_request_only() -> None:
    # The 2-step request decodes first; its decode raises on the overlap lane.
    results, _, _ = _run(OVERLAP, [_request(7, 2), _request(8, 20)], fail_first_decode=True)
    assert [r.status for r in results] == ["failed", "completed"]
    assert "decode broke" in results[0].error.message


def _unit(kind: WorkKind, peak: int, seq: int) -> WorkUnit:
    plan = WorkPlan(loop_id="l", instance_id="i", kind=kind, op="op",
                    resources=ResourceRequest(peak_bytes=peak))
    return WorkUnit(plan=plan, request_id=f"r{seq}", future=None, enqueued_at=float(seq), price_seconds=0.1,  # type: ignore[arg-type]
                    seq=seq)


def test_a_batch_starts_beside_the_other_lanes_only_if_both_peaks_fit() -> None:
    scheduler = Scheduler(SchedulerConfig(overlap_kinds=(WorkKind.VAE_TILE,), budgets={"memory_bytes": 1000}),
                          CostModel(), EngineMetrics())
    decode, step = _unit(WorkKind.VAE_TILE, 600, 1), _unit(WorkKind.DIFFUSION_STEP, 300, 2)
    scheduler.pending.add(decode)
    scheduler.pending.add(step)
    assert scheduler.next_batch("main", beside_peak_bytes=600) == [step]  # 300 beside 600 fits 1000
    assert scheduler.next_batch("overlap", beside_peak_bytes=500) == []  # 600 beside 500 does not
    assert scheduler.next_batch("overlap") == [decode]  # alone it runs, as admission promised


def test_the_first_unit_must_fit_only_beside_another_batch() -> None:
    units = [_unit(WorkKind.VAE_TILE, 600, 1)]
    assert BatchScheduler().select(units, 0.0, peak_headroom=100) == units
    assert BatchScheduler().select(units, 0.0, peak_headroom=100, head_must_fit=True) == []


def test_each_lane_takes_only_its_kinds() -> None:
    scheduler = Scheduler(OVERLAP, CostModel(), EngineMetrics())
    decode, step = _unit(WorkKind.VAE_TILE, 0, 1), _unit(WorkKind.DIFFUSION_STEP, 0, 2)
    scheduler.pending.add(decode)
    scheduler.pending.add(step)
    assert scheduler.next_batch("main") == [step]
    assert scheduler.next_batch("main") == []
    assert scheduler.next_batch("overlap") == [decode]


def test_a_jumbo_step_waits_only_on_its_own_lanes_work() -> None:
    # 10 s of decode handed back on the overlap lane must not count as work a main-lane jumbo step waited
    # behind: the main lane's older short step still goes first (with one shared batch scheduler, the jumbo would).
    scheduler = Scheduler(OVERLAP.model_copy(update={"batch": BatchPolicy(jumbo_seconds=0.5)}), CostModel(), EngineMetrics())
    loop = asyncio.new_event_loop()
    try:
        decode = _unit(WorkKind.VAE_TILE, 0, 1)
        decode.future = loop.create_future()
        scheduler.hand_back([decode], [StepResult(outputs={})], 10.0, 10.0, {}, lane="overlap")
    finally:
        loop.close()
    short, jumbo = _unit(WorkKind.DIFFUSION_STEP, 0, 2), _unit(WorkKind.DIFFUSION_STEP, 0, 3)
    jumbo.price_seconds = 1.0
    scheduler.pending.add(short)
    scheduler.pending.add(jumbo)
    assert scheduler.next_batch("main") == [short]


def test_overlap_kinds_are_checked() -> None:
    with pytest.raises(ValidationError, match="overlap_kinds.*device_thread"):
        SchedulerConfig(overlap_kinds=("vae_tile",), device_thread=False)
    with pytest.raises(ValidationError, match="vae_tile"):  # the allowed kinds are named
        SchedulerConfig(overlap_kinds=("vae",))
    with pytest.raises(ValidationError, match="twice"):
        SchedulerConfig(overlap_kinds=("vae_tile", "vae_tile"))
    # Kinds whose ops may share KV pools or captured graphs with the card's other steps stay on the main lane.
    with pytest.raises(ValidationError, match=r"\['ar_token', 'encoder_chunk'\] cannot run on a lane of their own.*"
                                              r"allowed: \['vae_tile', 'audio_chunk'\]"):
        SchedulerConfig(overlap_kinds=("ar_token", "encoder_chunk"))
    assert SchedulerConfig(overlap_kinds=("audio_chunk", "vae_tile")).overlap_kinds == (WorkKind.AUDIO_CHUNK,
                                                                                        WorkKind.VAE_TILE)
    assert SchedulerConfig.model_validate({"overlap_kinds": ["vae_tile"]}).overlap_kinds == (WorkKind.VAE_TILE,)


def test_a_parallel_pool_refuses_a_second_lane() -> None:
    with pytest.raises(ValueError, match="overlap_kinds is not supported on a parallel pool"):
        SpmdEngine(OVERLAP, leader=object())


def test_the_merge_gate_is_per_device_thread() -> None:
    instance = build_instance(toy_card("toy-dit"))
    instance.merge_gate = "main lane's gate"  # type: ignore[assignment]
    seen: list[Any] = []
    other = threading.Thread(target=lambda: seen.append(instance.merge_gate))
    other.start()
    other.join()
    assert seen == [None] and instance.merge_gate == "main lane's gate"


def test_counters_the_device_threads_add_to_lose_no_counts() -> None:
    # Two lanes' device threads count adapter transitions and fused fallbacks at once; a thread
    # switch between a counter's read and its write loses the other thread's count.
    metrics, calls = EngineMetrics(), 100_000
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows

    def count() -> None:
        for _ in range(calls):
            metrics.note_adapter_transition(0.25)
            metrics.note_fused_fallback("dit")

    try:
        threads = [threading.Thread(target=count) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(switch)
    assert metrics.fused_fallbacks == {"dit": 2 * calls}
    assert metrics.adapter_transitions == 2 * calls and metrics.adapter_transition_seconds == 0.25 * 2 * calls


def _engine_with_a_blocking_decode() -> tuple[Engine, threading.Event, threading.Event]:
    """An overlap-lane engine whose first decode call sets ``started`` and waits for ``release``."""
    engine = Engine(OVERLAP)
    instance = build_instance(toy_card("toy-dit"))
    engine.add_instance(instance)
    release, started = threading.Event(), threading.Event()
    op_of = instance.op

    def op(name: str) -> Any:
        base = op_of(name)
        if name != "decode_frame":
            return base

        def run(inputs: Mapping[str, torch.Tensor], params: Mapping[str, Any]) -> Any:
            if not started.is_set():
                started.set()
                assert release.wait(WAIT_S), "the test never released the decode"
            return base.fn(inputs, params)

        return dataclasses.replace(base, fn=run)

    instance.op = op  # type: ignore[method-assign]
    return engine, release, started


def test_a_request_cancelled_while_its_decode_runs_on_the_overlap_lane_ends_cancelled() -> None:
    engine, release, started = _engine_with_a_blocking_decode()
    short, long = _request(11, 2), _request(12, 12)

    async def go() -> list[Any]:
        async with engine.running():
            tasks = [asyncio.ensure_future(engine.generate_async(r)) for r in (short, long)]
            while not started.is_set():  # the short request's first decode is on the overlap lane
                await asyncio.sleep(0.01)
            assert engine.cancel(short.request_id)
            release.set()
            return list(await asyncio.wait_for(asyncio.gather(*tasks), 60))

    cancelled, completed = asyncio.run(go())
    assert cancelled.status == "cancelled" and completed.status == "completed"


def test_stopping_the_engine_waits_for_a_batch_on_the_overlap_lane() -> None:
    engine, release, started = _engine_with_a_blocking_decode()

    async def go() -> Any:
        await engine.start()
        task = asyncio.ensure_future(engine.generate_async(_request(13, 2)))
        while not started.is_set():
            await asyncio.sleep(0.01)
        stopping = asyncio.ensure_future(engine.stop())
        await asyncio.sleep(0.2)
        assert not stopping.done(), "the engine stopped with a batch still running on the overlap lane"
        release.set()
        await asyncio.wait_for(stopping, 60)
        return await task

    result = asyncio.run(go())
    assert result.status == "cancelled"
    assert engine.executor._threads == {}  # both lanes' threads joined


def test_sdpa_kernel_flags_are_process_wide() -> None:
    """Why a pinned driver is refused beside a second lane: inside its ``sdpa_kernel`` call, another
    thread's SDPA finds the other kernels disabled. (If torch makes these flags per thread, this fails
    and the refusal below can go.)"""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    seen: list[bool] = []
    with sdpa_kernel(SDPBackend.MATH):
        other = threading.Thread(target=lambda: seen.append(torch.backends.cuda.flash_sdp_enabled()))
        other.start()
        other.join()
    assert seen == [False] and torch.backends.cuda.flash_sdp_enabled()


def test_a_pinned_sdpa_driver_is_refused_beside_a_second_lane() -> None:
    from fv_kernel.api import InstanceOptions
    from fv_kernel.errors import InvalidRequest

    pinned = build_instance(toy_card("toy-dit"), InstanceOptions(attention_backend="sdpa_math"))
    with pytest.raises(InvalidRequest, match=r"attention_backend: 'toy-dit' is deployed with attention driver "
                                             r"'sdpa_math'.*process-wide.*allowed: a driver that sets no "
                                             r"process-wide flags \(.*\bsdpa\b.*\), or scheduler.overlap_kinds: \[\]"):
        Engine(OVERLAP).add_instance(pinned)
    Engine(ONE_LANE).add_instance(pinned)  # one lane: no other thread's attention runs meanwhile
    Engine(OVERLAP).add_instance(build_instance(toy_card("toy-dit")))  # the default 'sdpa' sets no flags


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the lanes' own streams")
def test_lane_streams_are_never_a_capture_side_stream() -> None:
    from types import SimpleNamespace

    from fv_kernel.runtime.executor import Executor

    executor = Executor({"gpu": SimpleNamespace(device=torch.device("cuda"))}, EngineMetrics(),  # type: ignore[dict-item]
                        batching="exact", check_finite=False, device_thread=True, lanes=("main", "overlap"))
    unit = SimpleNamespace(plan=SimpleNamespace(instance_id="gpu"))
    for lane in ("main", "overlap"):
        with executor._lane_stream(lane, [unit]):  # type: ignore[list-item]
            assert torch.cuda.current_stream() == executor._streams[(lane, torch.device("cuda"))]
    streams = list(executor._streams.values())
    assert len(streams) == 2 and streams[0] != streams[1]
    assert all(s.priority < torch.cuda.Stream().priority for s in streams)  # the high-priority pool
    drawn = {torch.cuda.Stream().stream_id for _ in range(64)}  # every stream of the default-priority pool
    assert drawn.isdisjoint({s.stream_id for s in streams})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the caching allocator's streams")
def test_an_output_dropped_on_the_default_stream_is_not_overwritten_by_its_lane_meanwhile() -> None:
    # What must hold, whichever allocator backend runs: the native one keeps the block from the lane
    # until the default stream's queued work is done; cudaMallocAsync may hand the same block straight
    # back, but orders the lane's stream after that work. Without the mark, the lane's next write
    # lands under the queued read.
    from fv_kernel.runtime.executor import LANE_STREAM_PRIORITY, hand_to_default_stream

    lane = torch.cuda.Stream(priority=LANE_STREAM_PRIORITY)
    for stream in (torch.cuda.default_stream(), lane):  # load the kernels first: a kernel's first
        with torch.cuda.stream(stream):  # launch loads its module, which waits for the device
            torch.ones(1 << 20, device="cuda").sum()
            torch.cuda._sleep(1)
    torch.cuda.synchronize()
    with torch.cuda.stream(lane):
        output = torch.ones(1 << 20, device="cuda")
    torch.cuda.synchronize()
    hand_to_default_stream([StepResult(outputs={"frames": output})])
    torch.cuda._sleep(1 << 29)  # the loop's queued work on the default stream, still running ...
    total = output.sum()  # ... which reads the output,
    del output  # and the loop drops it.
    with torch.cuda.stream(lane):
        torch.empty(1 << 20, device="cuda").fill_(2.0)  # the lane's next batch writes a block of that size
    torch.cuda.synchronize()
    assert total.item() == float(1 << 20)
