"""Job metadata and event histories in SQLite (stdlib ``sqlite3``), each unfinished job's
program checkpoint on disk, and the lock that gives one server a data dir.

Rows are the source of truth for every job the server ever accepted: a restarted
server lists completed jobs and serves their content from the output directory. A job
that was queued or running when the previous process died still has its row (status
``queued`` / ``in_progress``) and its checkpoint file (:class:`CheckpointStore`), from
which the restarted server resumes it. A finished job's whole SSE stream is stored with
it (table ``events``), so a late subscriber replays it from disk, not from memory.
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from fv_kernel.program.resume import ProgramCheckpoint
from fv_kernel.serving.schemas import JOB_ID_PATTERN, TERMINAL_STATUSES

__all__ = ["JobRecord", "JobStore", "CheckpointStore", "DataDirLock", "DataDirInUse", "StoredEvent"]

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
CREATE TABLE IF NOT EXISTS events (
    job_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    event TEXT NOT NULL,
    data TEXT NOT NULL,
    PRIMARY KEY (job_id, seq)
) WITHOUT ROWID;
"""

#: One stored event of a job's stream: (seq, event name, JSON data).
StoredEvent = tuple[int, str, dict[str, Any]]

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
        events: list[tuple[int, str, str]] | None = None,
    ) -> None:
        """Mark the job terminal; with ``events`` (seq, name, JSON text), store its whole stream in the same transaction."""
        if status not in TERMINAL_STATUSES:
            raise ValueError(f"finish() takes a terminal status; allowed: {sorted(TERMINAL_STATUSES)}")
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.execute(
                    "UPDATE jobs SET status=?, completed_at=?, progress=?, error=?, variants=? WHERE id=?",
                    (status, at, progress, json.dumps(error) if error else None, json.dumps(variants or []), job_id),
                )
                if events is not None:
                    self._db.execute("DELETE FROM events WHERE job_id=?", (job_id,))
                    self._db.executemany(
                        "INSERT INTO events (job_id, seq, event, data) VALUES (?, ?, ?, ?)",
                        [(job_id, seq, name, data) for seq, name, data in events],
                    )
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def delete(self, job_id: str) -> bool:
        """Delete the job's row and its stored events."""
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.execute("DELETE FROM events WHERE job_id=?", (job_id,))
                deleted = self._db.execute("DELETE FROM jobs WHERE id=?", (job_id,)).rowcount > 0
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        return deleted

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

    def events(self, job_id: str, *, after: int = -1) -> list[StoredEvent]:
        """The job's stored events with seq > ``after``, in order (empty when none were stored)."""
        rows = self._fetch("SELECT seq, event, data FROM events WHERE job_id=? AND seq>? ORDER BY seq", (job_id, after))
        return [(int(seq), name, json.loads(data)) for seq, name, data in rows]

    def event_count(self) -> int:
        """Stored events of all jobs (a DELETE removes a job's)."""
        return int(self._fetch("SELECT COUNT(*) FROM events")[0][0])


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


class DataDirInUse(Exception):
    """Another live process holds the data dir's lock."""

    def __init__(self, folder: Path, holder: str) -> None:
        super().__init__(
            f"the data dir {folder} is in use by another fv serve (pid {holder}); stop that server or choose "
            "another output_dir"
        )
        self.folder = folder
        self.holder = holder


class DataDirLock:
    """An exclusive lock on a server's data dir: ``<folder>/.fv-serve.lock``, held while the server runs.

    ``fcntl.flock`` locks belong to the open file: the kernel drops them when the holding
    process exits however it exits (``kill -9`` included), so a stale lock file never
    blocks a new server. The file holds the holder's pid, for the refusal message.
    """

    FILE_NAME = ".fv-serve.lock"

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder).resolve()
        self.path = self.folder / self.FILE_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> "DataDirLock":
        """Take the lock or raise :class:`DataDirInUse` naming the holder's pid (never waits)."""
        if self._fd is not None:
            return self
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DataDirInUse(self.folder, holder) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        os.close(fd)  # closing the file drops the flock; the file stays (its content is only informative)

    def __enter__(self) -> "DataDirLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()
