"""A Dynamo frontend, N fv workers and optionally fv's realtime gateway on this machine, on 127.0.0.1 only, with
file discovery.

For tests, benchmarks and trying the fleet on one box. Every process is started here and
stopped by its own PID (SIGTERM, then SIGKILL after a grace period); the discovery store is
a directory of its own, so fleets never see each other.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = ["LocalFleet", "loopback_env", "free_port"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def loopback_env(store: Path) -> dict[str, str]:
    """Dynamo's settings for one machine: file discovery in ``store``, TCP/ZMQ planes bound to 127.0.0.1."""
    return {
        "DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(store), "DYN_REQUEST_PLANE": "tcp", "DYN_EVENT_PLANE": "zmq",
        "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1", "DYN_EVENT_PLANE_HOST": "127.0.0.1",
        "DYN_SYSTEM_HOST": "127.0.0.1",
    }


@dataclass
class LocalFleet:
    workdir: Path
    deploy_config: Path
    workers: int = 2
    frontend: bool = True
    namespace: str = "fv"
    worker_args: Sequence[str] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)
    port: int = 0
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def store(self) -> Path:
        return self.workdir / "discovery"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(loopback_env(self.store))
        env.update(self.extra_env)
        return env

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        out = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - the child owns it until it exits
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env(), cwd=self.workdir)
        out.close()
        self.processes[name] = proc
        return proc

    def start_worker(self, name: str) -> subprocess.Popen[bytes]:
        # `fv worker`, the command fv-dynamo's manifest declares, from this interpreter's environment.
        fv = Path(sys.executable).with_name("fv")
        return self._spawn(name, [str(fv), "worker", "--config", str(self.deploy_config),
                                  "--namespace", self.namespace, *self.worker_args])

    def start(self, timeout_s: float = 120.0) -> "LocalFleet":
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.store.mkdir(parents=True, exist_ok=True)
        if self.frontend:
            self.port = self.port or free_port()
            self._spawn("frontend", [sys.executable, "-m", "dynamo.frontend", "--http-host", "127.0.0.1",
                                     "--http-port", str(self.port)])
        for i in range(self.workers):
            self.start_worker(f"worker{i}")
        self.wait_ready([f"worker{i}" for i in range(self.workers)], timeout_s)
        return self

    def wait_ready(self, names: Sequence[str], timeout_s: float = 120.0) -> None:
        """Until each named worker said it is ready and the frontend (if any) lists its model."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in self.processes.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log(name)[-3000:]}")
            if all("fv worker ready" in self.log(n) for n in names) and (not self.frontend or self.models()):
                time.sleep(0.5)  # the frontend's discovery watch picks up the last instance
                return
            time.sleep(0.2)
        raise TimeoutError(f"fleet not ready in {timeout_s} s:\n" + "\n".join(
            f"--- {n}\n{self.log(n)[-2000:]}" for n in self.processes))

    def start_gateway(self, name: str = "gateway", *, timeout_s: float = 60.0, args: Sequence[str] = ()) -> int:
        """Start ``fv realtime-gateway`` over this fleet's workers on a free port; its port, once ``/health``
        answers 200 (a worker serves sessions)."""
        port = free_port()
        fv = Path(sys.executable).with_name("fv")
        self._spawn(name, [str(fv), "realtime-gateway", "--namespace", self.namespace, "--port", str(port), *args])
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            proc = self.processes[name]
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log(name)[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                    if response.status == 200:
                        return port
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{name} not ready in {timeout_s} s:\n{self.log(name)[-2000:]}")

    def models(self) -> list[str]:
        try:
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as response:
                return [m["id"] for m in json.load(response)["data"]]
        except (urllib.error.URLError, OSError, ValueError):
            return []

    def instance_entries(self, endpoint: str = "videos") -> list[str]:
        """The discovery store's instance entries of ``endpoint`` (one per registered worker)."""
        folder = self.store / "v1" / "instances"
        if not folder.is_dir():
            return []
        return sorted(p.name for p in folder.iterdir() if f"%2F{endpoint}%2F" in p.name)

    def signal(self, name: str, sig: int) -> None:
        self.processes[name].send_signal(sig)

    def stop(self, grace_s: float = 10.0) -> dict[str, int | None]:
        """Stop every process this fleet started, workers first, each by its PID; their exit codes."""
        codes: dict[str, int | None] = {}
        order = [n for n in self.processes if n != "frontend"] + [n for n in self.processes if n == "frontend"]
        for name in order:
            proc = self.processes[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(grace_s)
            codes[name] = proc.returncode
        return codes

    def __enter__(self) -> "LocalFleet":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
