"""Job metadata in SQLite (stdlib ``sqlite3``) and each unfinished job's program checkpoint on disk.

Rows are the source of truth for every job the server ever accepted: a restarted
server lists completed jobs and serves their content from the output directory. A job
that was queued or running when the previous process died still has its row (status
``queued`` / ``in_progress``) and its checkpoint file (:class:`CheckpointStore`), from
which the restarted server resumes it.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from fv_kernel.program.resume import ProgramCheckpoint
from fv_kernel.serving.schemas import JOB_ID_PATTERN, TERMINAL_STATUSES

__all__ = ["JobRecord", "JobStore", "CheckpointStore"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    model TEXT NOT NULL,
    status TEXT NOT NULL,
    progress INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    started_at REAL,
    completed_at REAL,
    params TEXT NOT NULL,
    error TEXT,
    variants TEXT NOT NULL DEFAULT '[]'
);
CREATE INDEX IF NOT EXISTS jobs_status ON jobs(status);
"""

_COLUMNS = "id, model, status, progress, created_at, started_at, completed_at, params, error, variants"


@dataclass
class JobRecord:
    """One job row. ``params`` holds the resolved generation settings; ``variants`` the content written."""

    id: str
    model: str
    status: str
    created_at: float
    params: dict[str, Any]
    progress: int = 0
    started_at: float | None = None
    completed_at: float | None = None
    error: dict[str, Any] | None = None
    variants: list[str] = field(default_factory=list)

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES


def _row_to_record(row: tuple[Any, ...]) -> JobRecord:
    id_, model, status, progress, created, started, completed, params, error, variants = row
    return JobRecord(
        id=id_, model=model, status=status, progress=progress, created_at=created, started_at=started,
        completed_at=completed, params=json.loads(params), error=json.loads(error) if error else None,
        variants=json.loads(variants),
    )


class JobStore:
    """Thread-safe access to the jobs table (one connection, one lock; writes are few per job)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _execute(self, sql: str, args: tuple[Any, ...] = ()) -> sqlite3.Cursor:
        with self._lock:
            return self._db.execute(sql, args)

    def _fetch(self, sql: str, args: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # -- writes ---------------------------------------------------------------------
    def insert(self, job: JobRecord) -> None:
        self._execute(
            f"INSERT INTO jobs ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (job.id, job.model, job.status, job.progress, job.created_at, job.started_at, job.completed_at,
             json.dumps(job.params), json.dumps(job.error) if job.error else None, json.dumps(job.variants)),
        )

    def mark_started(self, job_id: str, at: float) -> None:
        self._execute("UPDATE jobs SET status='in_progress', started_at=? WHERE id=? AND status='queued'", (at, job_id))

    def finish(
        self,
        job_id: str,
        status: str,
        *,
        at: float,
        progress: int,
        error: dict[str, Any] | None = None,
        variants: list[str] | None = None,
    ) -> None:
        if status not in TERMINAL_STATUSES:
            raise ValueError(f"finish() takes a terminal status; allowed: {sorted(TERMINAL_STATUSES)}")
        self._execute(
            "UPDATE jobs SET status=?, completed_at=?, progress=?, error=?, variants=? WHERE id=?",
            (status, at, progress, json.dumps(error) if error else None, json.dumps(variants or []), job_id),
        )

    def delete(self, job_id: str) -> bool:
        return self._execute("DELETE FROM jobs WHERE id=?", (job_id,)).rowcount > 0

    # -- reads ----------------------------------------------------------------------
    def unfinished(self) -> list[JobRecord]:
        """Jobs left queued or in progress (by a process that stopped without finishing them), oldest first."""
        rows = self._fetch(f"SELECT {_COLUMNS} FROM jobs WHERE status IN ('queued', 'in_progress') ORDER BY seq")
        return [_row_to_record(r) for r in rows]

    def get(self, job_id: str) -> JobRecord | None:
        rows = self._fetch(f"SELECT {_COLUMNS} FROM jobs WHERE id=?", (job_id,))
        return _row_to_record(rows[0]) if rows else None

    def page(self, *, limit: int, after: str | None = None, order: str = "desc") -> tuple[list[JobRecord], bool]:
        """Up to ``limit`` jobs after the job ``after`` in creation order; and whether more follow.

        Raises KeyError when ``after`` names no job.
        """
        direction, compare = ("DESC", "<") if order == "desc" else ("ASC", ">")
        where, args = "", ()
        if after is not None:
            found = self._fetch("SELECT seq FROM jobs WHERE id=?", (after,))
            if not found:
                raise KeyError(after)
            where, args = f"WHERE seq {compare} ?", (found[0][0],)
        rows = self._fetch(f"SELECT {_COLUMNS} FROM jobs {where} ORDER BY seq {direction} LIMIT ?", (*args, limit + 1))
        return [_row_to_record(r) for r in rows[:limit]], len(rows) > limit

    def count(self, status: str | None = None) -> int:
        if status is None:
            return int(self._fetch("SELECT COUNT(*) FROM jobs")[0][0])
        return int(self._fetch("SELECT COUNT(*) FROM jobs WHERE status=?", (status,))[0][0])

    def counts_by_status(self) -> dict[str, int]:
        return {status: int(n) for status, n in self._fetch("SELECT status, COUNT(*) FROM jobs GROUP BY status")}

    def ids(self) -> Iterator[str]:
        for (job_id,) in self._fetch("SELECT id FROM jobs ORDER BY seq"):
            yield job_id


class CheckpointStore:
    """One :class:`ProgramCheckpoint` file per unfinished job: ``<folder>/<job id>.pt``.

    A write goes to a temporary file that is flushed to disk and then renamed over the
    previous checkpoint, so a process killed mid-write leaves the previous one intact.
    File names are the server-generated job ids (checked against their pattern).
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def path(self, job_id: str) -> Path:
        if not JOB_ID_PATTERN.match(job_id):
            raise ValueError(f"not a job id: {job_id!r}")
        return self.folder / f"{job_id}.pt"

    def write(self, job_id: str, data: bytes) -> None:
        final = self.path(job_id)
        temporary = final.with_name(f".{final.name}.tmp")
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, final)

    def read(self, job_id: str) -> ProgramCheckpoint:
        """The job's checkpoint; FileNotFoundError when it has none, StateFormatError when it is unreadable."""
        return ProgramCheckpoint.load(self.path(job_id))

    def delete(self, job_id: str) -> None:
        final = self.path(job_id)
        final.unlink(missing_ok=True)
        final.with_name(f".{final.name}.tmp").unlink(missing_ok=True)

    def job_ids(self) -> list[str]:
        """Jobs that have a checkpoint file."""
        return sorted(p.stem for p in self.folder.glob("*.pt") if JOB_ID_PATTERN.match(p.stem))
