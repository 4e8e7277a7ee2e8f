"""``fv serve`` keeps its jobs across restarts: a job left running by a killed (``kill -9``) or
stopped server resumes from its last checkpoint on the next server over the same data dir,
with output identical to an uninterrupted run; a job that cannot resume fails with a reason.

The served card is toy-dit (kernel tests load no plugin); fv-wan repeats the kill test on
wan-tiny through the real ``fv serve`` command (plugins/fv-wan/tests/test_serving_resume.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

import torch  # noqa: E402

import fv_kernel.serving.jobs as jobs_module  # noqa: E402
from fv_kernel.model.instance import build_instance  # noqa: E402
from fv_kernel.card.spec import ModelCard, ProgramSpec  # noqa: E402
from fv_kernel.config import DeployConfig, ServerConfig  # noqa: E402
from fv_kernel.state import StateFormatError  # noqa: E402
from fv_kernel.program.resume import ProgramCheckpoint  # noqa: E402
from fv_kernel.request.request import Request  # noqa: E402
from fv_kernel.request.types import TaskType  # noqa: E402
from fv_kernel.runtime.engine import Engine  # noqa: E402
from fv_kernel.runtime.scheduler import SchedulerConfig
from fv_kernel.runtime.local import run_local  # noqa: E402
from fv_kernel.serving import JobStore, ServerThread, create_app  # noqa: E402
from fv_kernel.serving.store import CheckpointStore, JobRecord  # noqa: E402
from fv_kernel.testing import job_progress, wait_for_job  # noqa: E402
from fv_kernel.testing.toy import toy_card  # noqa: E402

# One intra-op thread in this process and in the fresh ones it starts (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


# Many cheap steps: the denoise loop lasts long enough to be caught (and killed) in the middle.
LONG_JOB = {"model": "toy-dit", "prompt": "a lighthouse in fog", "seed": 11, "steps": 60, "size": "16x16", "frames": 3}


class KeptFrames:
    """Records the final frames the server encodes (a bit-exact view of what became the MP4)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.frames: dict[str, torch.Tensor] = {}
        original = jobs_module.write_job_files

        def write(artifact: Any, folder: Path) -> list[str]:
            self.frames[folder.name] = artifact.frames.clone()
            return original(artifact, folder)

        monkeypatch.setattr(jobs_module, "write_job_files", write)


def serve(output_dir: Path, card: ModelCard | None = None, *, every: int = 1) -> ServerThread:
    config = DeployConfig(output_dir=output_dir, server=ServerConfig(checkpoint_every_steps=every))
    engine = Engine(SchedulerConfig(), limits=config.limits)
    engine.add_instance(build_instance(card or toy_card("toy-dit")))
    return ServerThread(create_app(engine, config)).start()


def wait_mid_denoise(checkpoints: CheckpointStore, job_id: str, *, at_least: int, timeout_s: float = 300.0) -> ProgramCheckpoint:
    """Poll the job's checkpoint file until it shows the denoise loop past ``at_least`` steps."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError, StateFormatError):
            checkpoint = checkpoints.read(job_id)
            if any(r.loop_id == "denoise" and r.step >= at_least for r in checkpoint.running):
                return checkpoint
        time.sleep(0.01)
    raise AssertionError(f"job {job_id} never checkpointed denoise step {at_least}")


def reference_frames(request: Request, card: ModelCard | None = None) -> torch.Tensor:
    """The same request run uninterrupted, in this process."""
    artifacts = run_local(request, build_instance(card or toy_card("toy-dit")))
    return next(a for a in artifacts if a.kind == "video").frames


_KILLABLE_SERVER = """
import sys
from pathlib import Path
import torch
from fv_kernel.model.instance import build_instance
from fv_kernel.config import DeployConfig
from fv_kernel.runtime.engine import Engine
from fv_kernel.serving import ServerThread, create_app
from fv_kernel.testing.toy import toy_card

# Request-level scheduling: the second job stays queued behind the first.
config = DeployConfig(output_dir=Path(sys.argv[1]), server={"checkpoint_every_steps": 1}, scheduler={"scheduling": "request"})
torch.set_num_threads(int(sys.argv[2]))  # the test process's: CPU results depend on the thread count
engine = Engine(config.scheduler, limits=config.limits)
engine.add_instance(build_instance(toy_card("toy-dit")))
server = ServerThread(create_app(engine, config)).start()
print(server.port, flush=True)
server._thread.join()
"""


@contextlib.contextmanager
def killable_server(output_dir: Path) -> Iterator[tuple[subprocess.Popen[str], str]]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    process = subprocess.Popen([sys.executable, "-c", _KILLABLE_SERVER, str(output_dir), str(torch.get_num_threads())],
                               stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert process.stdout is not None
        yield process, f"http://127.0.0.1:{int(process.stdout.readline())}"
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(30)


def test_kill_9_mid_denoise_then_restart_resumes_the_job_bit_identically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    checkpoints = CheckpointStore(out / "checkpoints")
    with killable_server(out) as (process, url):
        with httpx.Client(base_url=url, timeout=60.0) as client:
            job = client.post("/v1/videos", json=LONG_JOB).json()
            queued = client.post("/v1/videos", json={**LONG_JOB, "steps": 2, "seed": 12}).json()
            seen = wait_mid_denoise(checkpoints, job["id"], at_least=3)
            process.send_signal(signal.SIGKILL)  # a crash: no shutdown hook runs
            process.wait(30)
    # What the dead process left: rows still unfinished, the last checkpoint mid-denoise, intact.
    with contextlib.closing(JobStore(out / "jobs.sqlite3")) as store:
        assert {r.id: r.status for r in store.unfinished()} == {job["id"]: "in_progress", queued["id"]: "queued"}
    left = checkpoints.read(job["id"])
    (denoise,) = [r for r in left.running if r.loop_id == "denoise"]
    assert seen.running[0].step <= denoise.step < LONG_JOB["steps"], "killed mid-denoise"
    assert [f.key for f in left.finished] == ["text_encode"]

    kept = KeptFrames(monkeypatch)
    server = serve(out)
    try:
        with httpx.Client(base_url=server.url, timeout=60.0) as client:
            for job_id in (job["id"], queued["id"]):
                assert wait_for_job(client, job_id, {"completed", "failed"})["status"] == "completed"
            # It continued from the checkpoint (a restart from scratch would be identical too, but slower).
            ran = job_progress(client, job["id"])
            assert ran[0] == ("denoise", denoise.step + 1) and ("text_encode", 1) not in ran, ran[:3]
            resumed_mp4 = client.get(f"/v1/videos/{job['id']}/content").content
            again = client.post("/v1/videos", json=LONG_JOB).json()  # the same request, never interrupted
            assert wait_for_job(client, again["id"], {"completed", "failed"})["status"] == "completed"
            assert client.get(f"/v1/videos/{again['id']}/content").content == resumed_mp4
    finally:
        server.stop()
    assert torch.equal(kept.frames[job["id"]], reference_frames(left.request))
    assert torch.equal(kept.frames[job["id"]], kept.frames[again["id"]])
    assert checkpoints.job_ids() == [], "a finished job's checkpoint is deleted"


def test_a_graceful_stop_suspends_running_jobs_and_the_next_server_finishes_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "out"
    checkpoints = CheckpointStore(out / "checkpoints")
    server = serve(out, every=10)
    with httpx.Client(base_url=server.url, timeout=60.0) as client:
        job = client.post("/v1/videos", json={**LONG_JOB, "steps": 200}).json()
        wait_mid_denoise(checkpoints, job["id"], at_least=10)
    server.stop()  # SIGTERM / Ctrl-C: the engine stops at a step boundary and writes a last checkpoint
    with contextlib.closing(JobStore(out / "jobs.sqlite3")) as store:
        assert store.get(job["id"]).status == "in_progress"
    last = checkpoints.read(job["id"])
    assert last.running and last.running[0].loop_id in ("denoise", "decode")
    kept = KeptFrames(monkeypatch)
    server = serve(out, every=10)
    try:
        with httpx.Client(base_url=server.url, timeout=60.0) as client:
            assert wait_for_job(client, job["id"], {"completed", "failed", "cancelled"})["status"] == "completed"
            assert job_progress(client, job["id"])[0] == (last.running[0].loop_id, last.running[0].step + 1)
    finally:
        server.stop()
    assert torch.equal(kept.frames[job["id"]], reference_frames(last.request))


def test_a_client_cancel_is_final_even_across_a_restart(tmp_path: Path) -> None:
    out = tmp_path / "out"
    server = serve(out)
    with httpx.Client(base_url=server.url, timeout=60.0) as client:
        job = client.post("/v1/videos", json={**LONG_JOB, "steps": 5000}).json()
        wait_for_job(client, job["id"], {"in_progress"})
        client.post(f"/v1/videos/{job['id']}/cancel")
        assert wait_for_job(client, job["id"], {"cancelled", "completed"})["status"] == "cancelled"
    server.stop()
    assert CheckpointStore(out / "checkpoints").job_ids() == []
    server = serve(out)
    try:
        with httpx.Client(base_url=server.url, timeout=60.0) as client:
            assert client.get(f"/v1/videos/{job['id']}").json()["status"] == "cancelled"
    finally:
        server.stop()


# --------------------------------------------------------------------------- cannot resume


def _not_resumable_card() -> ModelCard:
    card = toy_card("toy-dit")
    spec = ProgramSpec(implementation="resume_programs:DrivesItsLoopsItself", returns=frozenset({"video"}))
    return card.model_copy(update={"programs": {**card.programs, TaskType.TEXT_TO_VIDEO: spec}})


def _job_id(n: int) -> str:
    return f"video_{n:032x}"


def _insert(store: JobStore, job_id: str, request: Request, *, status: str, model: str = "toy-dit") -> None:
    d = request.diffusion
    store.insert(JobRecord(id=job_id, model=model, status=status, created_at=time.time(), params={
        "prompt": request.text("prompt"), "task": request.task.value, "width": d.width, "height": d.height,
        "frames": d.frames, "fps": d.fps, "steps": d.steps, "guidance": d.guidance, "seed": d.seed,
    }))


def test_jobs_that_cannot_resume_fail_with_the_reason_and_none_is_lost(tmp_path: Path) -> None:
    out = tmp_path / "out"
    card = _not_resumable_card()
    instance = build_instance(card)
    store, checkpoints = JobStore(out / "jobs.sqlite3"), CheckpointStore(out / "checkpoints")

    def request(n: int, steps: int = 3) -> Request:
        from fv_kernel.model.validate import resolve_request
        from fv_kernel.request.request import DiffusionParams, TextPart

        return resolve_request(card, Request(request_id=_job_id(n), model="toy-dit", task=TaskType.TEXT_TO_VIDEO,
                                             inputs=(TextPart(text=f"job {n}"),), diffusion=DiffusionParams(seed=n, steps=steps)))

    def initial(n: int) -> bytes:
        req = request(n)
        return ProgramCheckpoint.for_request(instance.program(req.task), instance, req).to_bytes()

    gone = request(1).with_updates(model="toy-lm")
    _insert(store, _job_id(1), gone, status="in_progress", model="toy-lm")  # its card is not served any more
    checkpoints.write(_job_id(1), initial(1))
    _insert(store, _job_id(2), request(2), status="in_progress")
    checkpoints.write(_job_id(2), b"\x00 half a checkpoint")  # unreadable
    _insert(store, _job_id(3), request(3), status="queued")  # no checkpoint at all
    _insert(store, _job_id(4), request(4), status="queued")  # saved under other weights, but never started
    checkpoints.write(_job_id(4), ProgramCheckpoint.from_bytes(initial(4)).model_copy(
        update={"weights_version": "retrained"}).to_bytes())
    _insert(store, _job_id(5), request(5), status="in_progress")  # started, and its program cannot resume
    checkpoints.write(_job_id(5), initial(5))
    _insert(store, _job_id(6), request(6), status="queued")  # never started: runs even though not resumable
    checkpoints.write(_job_id(6), initial(6))
    checkpoints.write(_job_id(7), initial(7))  # an orphan: killed between its checkpoint and its row
    store.close()

    server = serve(out, card)
    try:
        with httpx.Client(base_url=server.url, timeout=60.0) as client:
            def failed(n: int) -> str:
                job = client.get(f"/v1/videos/{_job_id(n)}").json()
                assert job["status"] == "failed" and job["error"]["type"] == "not_resumable", job
                assert job["error"]["message"].startswith("the server restarted and could not resume this job: ")
                return str(job["error"]["message"])

            assert "card 'toy-lm' is no longer served (served: toy-dit)" in failed(1)
            assert "its checkpoint is unreadable" in failed(2)
            assert "it has no checkpoint" in failed(3)
            assert "cannot resume" in failed(5) and "DrivesItsLoopsItself" in failed(5)
            assert wait_for_job(client, _job_id(6), {"completed", "failed"})["status"] == "completed"
            job4 = wait_for_job(client, _job_id(4), {"completed", "failed"})
            assert job4["status"] == "completed", "a queued job that never started runs on the weights now served"
    finally:
        server.stop()
    assert CheckpointStore(out / "checkpoints").job_ids() == []


def test_a_started_checkpoint_of_other_weights_is_incompatible(tmp_path: Path) -> None:
    out = tmp_path / "out"
    store, checkpoints = JobStore(out / "jobs.sqlite3"), CheckpointStore(out / "checkpoints")
    saved: list[bytes] = []
    from fv_kernel.model.validate import resolve_request
    from fv_kernel.request.request import DiffusionParams, TextPart

    card = toy_card("toy-dit")
    req = resolve_request(card, Request(request_id=_job_id(9), model="toy-dit", task=TaskType.TEXT_TO_VIDEO,
                                        inputs=(TextPart(text="x"),), diffusion=DiffusionParams(seed=1, steps=4)))
    run_local(req, build_instance(card), on_step=lambda run: saved.append(run.checkpoint().to_bytes()))
    mid = ProgramCheckpoint.from_bytes(saved[2]).model_copy(update={"weights_version": "retrained"})
    _insert(store, _job_id(9), req, status="in_progress")
    checkpoints.write(_job_id(9), mid.to_bytes())
    store.close()
    server = serve(out)
    try:
        with httpx.Client(base_url=server.url, timeout=60.0) as client:
            job = client.get(f"/v1/videos/{_job_id(9)}").json()
            assert job["status"] == "failed" and job["error"]["type"] == "not_resumable"
            assert "checkpoint_incompatible" in job["error"]["message"] and "retrained" in job["error"]["message"]
    finally:
        server.stop()


# --------------------------------------------------------------------------- the knob and the file


class _FakeRun:
    def __init__(self) -> None:
        self.steps = 0

    def checkpoint(self) -> ProgramCheckpoint:
        instance = build_instance(toy_card("toy-lm"))
        from fv_kernel.request.request import TextPart

        request = Request(request_id=_job_id(self.steps), model="toy-lm", task=TaskType.TEXT_GENERATION,
                          inputs=(TextPart(text="x"),))
        return ProgramCheckpoint.for_request(instance.program(request.task), instance, request)


@pytest.mark.parametrize(("every", "written"), [(3, [3, 6]), (1, [1, 2, 3, 4, 5, 6, 7]), (0, [])])
def test_checkpoint_every_steps_sets_how_often_a_running_job_is_written(tmp_path: Path, every: int, written: list[int]) -> None:
    manager = jobs_module.JobManager(
        Engine(SchedulerConfig()), JobStore(tmp_path / "db.sqlite3"), tmp_path, enabled_extensions={}, extension_schemas={},
        rejections=__import__("collections").Counter(), checkpoint_every_steps=every,
    )
    writes: list[int] = []
    manager.checkpoints.write = lambda job_id, data: writes.append(run.steps)  # type: ignore[method-assign]
    on_step = manager._checkpointer(_job_id(1), resumable=True)
    assert (on_step is None) == (every == 0)
    run = _FakeRun()
    for _ in range(7):
        run.steps += 1
        if on_step is not None:
            on_step(run)  # type: ignore[arg-type]
    assert writes == written
    assert manager._checkpointer(_job_id(1), resumable=False) is None, "a program that cannot resume is never checkpointed"
    with pytest.raises(ValueError):
        ServerConfig(checkpoint_every_steps=-1)


def test_a_write_killed_midway_leaves_the_previous_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoints = CheckpointStore(tmp_path)
    first = _FakeRun().checkpoint().to_bytes()
    checkpoints.write(_job_id(1), first)

    def crash(fd: int) -> None:
        raise OSError("killed mid-write")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError):
        checkpoints.write(_job_id(1), first[: len(first) // 2])
    monkeypatch.undo()
    assert checkpoints.path(_job_id(1)).read_bytes() == first
    assert checkpoints.read(_job_id(1)).request.request_id == _job_id(0)
    checkpoints.delete(_job_id(1))
    assert list(tmp_path.iterdir()) == [], "delete() also removes a leftover temporary file"
    with pytest.raises(ValueError, match="not a job id"):
        checkpoints.path("../../etc/passwd")


@pytest.mark.parametrize(("cap", "mid_loop_writes"), [(1, False), (None, True)])
def test_a_checkpoint_over_checkpoint_max_bytes_is_not_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               cap: int | None, mid_loop_writes: bool) -> None:
    """A running job whose in-flight states hold more tensor bytes than ``server.checkpoint_max_bytes``
    keeps its previous checkpoint at that step (a GB-sized decode history would stall the event loop)."""
    import httpx

    writes: list[str] = []
    original = CheckpointStore.write

    def counting(self: CheckpointStore, job_id: str, data: bytes) -> None:
        writes.append(job_id)
        original(self, job_id, data)

    monkeypatch.setattr(CheckpointStore, "write", counting)
    config = DeployConfig(output_dir=tmp_path, server=ServerConfig(checkpoint_every_steps=1, checkpoint_max_bytes=cap))
    engine = Engine(SchedulerConfig(), limits=config.limits)
    engine.add_instance(build_instance(toy_card("toy-dit")))
    app = create_app(engine, config)
    server = ServerThread(app).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            job = client.post("/v1/videos", json={"prompt": "a red fox", "seed": 1}).json()
            assert wait_for_job(client, job["id"], {"completed"})["status"] == "completed"
    finally:
        server.stop()
    manager = app.state.manager
    assert writes.count(job["id"]) >= 1  # the request's own checkpoint, written when the job is created
    assert (writes.count(job["id"]) > 1) is mid_loop_writes
    assert (manager.checkpoints_skipped > 0) is not mid_loop_writes
