"""Resume conformance: every loop of every card continues bit-identically in a fresh process.

::

    from fv_kernel.testing import ResumeConformance

    class TestMyResume(ResumeConformance):
        card_ids = ["my-tiny"]

For each card and each of its kit requests (:meth:`requests_for`, the same requests
as the card kit), the check runs the request once in this process, writing a
:class:`~fv_kernel.program.resume.ProgramCheckpoint` at every step boundary (so a
state that cannot be serialized fails here, when it is written, naming the loop and
the field). It then picks, for every loop that ran steps, a boundary in the middle of
that loop, and resumes each picked checkpoint in **one fresh Python process** per
conformance class: there the card is loaded and built again (through this class's
:meth:`load_card` / :meth:`build`, so a class that overrides them must be importable
at module level), and the request continues from the checkpoint. Its artifacts must be
bit-identical to the uninterrupted run's (CPU, fp32). The fresh process copies this one's
torch thread count, deterministic-algorithms flag and default dtype: CPU kernels split
reductions by thread, so bit-identity across processes holds at equal settings.

What it catches: a loop that keeps something it needs outside its state (a counter or
an RNG on the loop object, a module global), a loop whose ``restore`` does not
re-attach a per-process resource (K/V in a pool), a program whose control flow cannot
be replayed, and unserializable state. What it cannot see: state that survives in the
fresh process between two resumes of the same card (they share one process and one
instance, in checkpoint order; the first resume of each request is the strictest).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Sequence

import torch
from pydantic import Field

from fv_kernel.model.instance import ModelInstance
from fv_kernel.card.spec import ModelCard
from fv_kernel.state import TensorState
from fv_kernel.program.resume import ProgramCheckpoint, ProgramRun
from fv_kernel.request.artifacts import Artifact
from fv_kernel.request.request import Request
from fv_kernel.runtime.local import run_local
from fv_kernel.testing.card_kit import _CardKitBase, assert_artifacts_identical

__all__ = ["ResumeConformance", "ResumePoint", "checkpoints_inside_every_loop", "resume_in_fresh_process"]


class _ResumedArtifacts(TensorState):
    """What a fresh process sends back: the resumed request's artifacts, or the error it raised."""

    artifacts: list[Artifact] = Field(default_factory=list)
    error: str | None = None


@dataclass(frozen=True)
class ResumePoint:
    """A checkpoint taken at one step boundary of an uninterrupted run."""

    request_id: str
    #: Where the request stood (e.g. ``denoise at step 2``).
    position: str
    data: bytes = field(repr=False)


def checkpoints_inside_every_loop(request: Request, instance: ModelInstance) -> tuple[list[Artifact], list[ResumePoint]]:
    """Run ``request`` writing a checkpoint at every step boundary; return its artifacts and, for
    every loop that ran steps, the checkpoint in the middle of that loop's boundaries (and one
    between two counted steps when the middle falls in the loop's preparation)."""
    boundaries: list[tuple[dict[str, int], ResumePoint]] = []

    def write(run: ProgramRun) -> None:
        checkpoint = run.checkpoint()
        point = ResumePoint(request.request_id, checkpoint.position(), checkpoint.to_bytes())
        boundaries.append(({r.key: r.step for r in checkpoint.running}, point))

    artifacts = run_local(request, instance, on_step=write)
    by_loop: dict[str, list[tuple[int, int]]] = {}
    for index, (running, _) in enumerate(boundaries):
        for key, step in running.items():
            by_loop.setdefault(key, []).append((index, step))
    picked: set[int] = set()
    for seen in by_loop.values():
        index, step = seen[(len(seen) - 1) // 2]
        picked.add(index)
        last = seen[-1][1]
        if step == 0 and last > 0:
            # The middle boundary is still in the loop's preparation (e.g. prompt K/V): also
            # resume between two of its counted steps, where sampler history matters.
            picked.add(next(i for i, s in seen if s == max(1, last // 2)))
    return artifacts, [boundaries[i][1] for i in sorted(picked)]


def _importable(cls: type) -> str:
    name = f"{cls.__module__}:{cls.__qualname__}"
    if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
        raise AssertionError(f"{name}: a resume conformance class must be defined at module level (a fresh process imports it)")
    return name


def resume_in_fresh_process(
    kit: type["ResumeConformance"], jobs: Sequence[tuple[str, ResumePoint]], *, timeout_s: float
) -> list[_ResumedArtifacts]:
    """Resume each ``(model_id, point)`` in one new Python process; their artifacts (or errors) in order."""
    with tempfile.TemporaryDirectory(prefix="fv-resume-") as folder:
        job_file, out_file = Path(folder) / "jobs.pt", Path(folder) / "out.pt"
        torch.save({"kit": _importable(kit), "jobs": [(model_id, p.data) for model_id, p in jobs],
                    "torch": _numerics()}, job_file)
        env = dict(os.environ)
        # The fresh process imports what this one could (the test module, its conftest's folder).
        env["PYTHONPATH"] = os.pathsep.join(p for p in [*sys.path, env.get("PYTHONPATH", "")] if p)
        proc = subprocess.run(
            [sys.executable, "-c", _FRESH_PROCESS, str(job_file), str(out_file)],
            capture_output=True, text=True, timeout=timeout_s, env=env,
        )
        if proc.returncode != 0 or not out_file.exists():
            raise AssertionError(f"the fresh resume process failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
        results = torch.load(out_file, weights_only=True)
    return [_ResumedArtifacts.from_bytes(data) for data in results]


def _numerics() -> dict[str, Any]:
    """The process-wide torch settings results depend on (a conftest may set them); the fresh process copies them."""
    return {
        "num_threads": torch.get_num_threads(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "default_dtype": str(torch.get_default_dtype()).removeprefix("torch."),
    }


class ResumeConformance(_CardKitBase):
    """Checkpoint every loop of every card mid-way and resume it in a fresh process, bit-identically."""

    #: Seconds the fresh process may take for all of this class's resumes.
    resume_timeout_s: ClassVar[float] = 900.0

    def resume_requests(self, card: ModelCard) -> list[Request]:
        """The requests checkpointed and resumed (default: :meth:`requests_for`)."""
        return self.requests_for(card, prefix="resume-")

    def test_resumes_in_a_fresh_process_bit_identically(self) -> None:
        assert self.card_ids, "set card_ids on the resume conformance class"
        self.check_cards(self.card_ids)

    def check_cards(self, model_ids: Sequence[str]) -> None:
        """Raise AssertionError naming the card, request and resume point of the first difference."""
        _importable(type(self))
        jobs: list[tuple[str, ResumePoint]] = []
        references: dict[str, list[Artifact]] = {}
        for model_id in model_ids:
            card = self.load_card(model_id)
            instance = self.build(card)
            for request in self.resume_requests(card):
                program = instance.program(request.task)
                assert program.resumable, (
                    f"{model_id} {request.task.value}: program {type(program).__qualname__} is not resumable "
                    "(run every loop through Program.run_loop and set resumable = True)"
                )
                artifacts, points = checkpoints_inside_every_loop(request, instance)
                assert points, f"{model_id} {request.task.value}: the program ran no steps through run_loop"
                references[request.request_id] = artifacts
                jobs.extend((model_id, point) for point in points)
        outcomes = resume_in_fresh_process(type(self), jobs, timeout_s=self.resume_timeout_s)
        for (model_id, point), outcome in zip(jobs, outcomes):
            what = f"{model_id} {point.request_id} resumed from '{point.position}' in a fresh process"
            if outcome.error is not None:
                raise AssertionError(f"{what} raised:\n{outcome.error}")
            assert_artifacts_identical(references[point.request_id], outcome.artifacts, what=what)


def _resume_jobs(job_file: str, out_file: str) -> None:
    """The fresh process: build each card once with the kit's own loader, resume every checkpoint."""
    from fv_kernel.card.refs import import_object

    job = torch.load(job_file, weights_only=True)
    settings = job["torch"]
    # CPU kernels split reductions by thread: the same numbers need the same thread count.
    torch.set_num_threads(settings["num_threads"])
    torch.use_deterministic_algorithms(settings["deterministic"])
    torch.set_default_dtype(getattr(torch, settings["default_dtype"]))
    kit = import_object(job["kit"])()
    instances: dict[str, ModelInstance] = {}
    results: list[bytes] = []
    for model_id, data in job["jobs"]:
        try:
            if model_id not in instances:
                instances[model_id] = kit.build(kit.load_card(model_id))
            checkpoint = ProgramCheckpoint.from_bytes(data)
            artifacts = run_local(checkpoint.request, instances[model_id], resume_from=checkpoint)
            results.append(_ResumedArtifacts(artifacts=artifacts).to_bytes())
        except Exception:  # noqa: BLE001 - reported to the parent, which fails the check with it
            results.append(_ResumedArtifacts(error=traceback.format_exc()).to_bytes())
    torch.save(results, out_file)


_FRESH_PROCESS = "import sys; from fv_kernel.testing.resume_kit import _resume_jobs; _resume_jobs(*sys.argv[1:3])"
