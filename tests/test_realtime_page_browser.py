"""The ``/realtime`` page in headless Chromium: it opens a session on the toy causal chunk card, plays
the fMP4 chunks through Media Source Extensions, and a prompt update is acknowledged and applied.

Chromium is driven through ChromeDriver's W3C HTTP API with plain httpx (no browser download, no
extra Python package). Needs Debian's ``chromium`` and ``chromium-driver`` (/usr/bin/chromium,
/usr/bin/chromedriver); skipped when they are absent.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("av")

from fv_kernel.config import DeployConfig
from fv_kernel.model.instance import build_instance
from fv_kernel.runtime.engine import Engine
from fv_kernel.runtime.scheduler import SchedulerConfig
from fv_kernel.serving import ServerThread, create_app
from fv_kernel.testing.session_kit import chunk_toy_card

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
# Flags for a closed network and a root user (docs: /usr/bin/chromium headless).
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--autoplay-policy=no-user-gesture-required", "--mute-audio"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Browser:
    """One ChromeDriver session: load a page, run scripts in it."""

    def __init__(self, profile: Path) -> None:
        port = _free_port()
        self.driver = subprocess.Popen([CHROMEDRIVER, f"--port={port}"], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60)
        deadline = time.monotonic() + 30
        while True:
            try:
                if self.http.get("/status").json()["value"]["ready"]:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("chromedriver did not start")
            time.sleep(0.1)
        caps = {"browserName": "chrome", "goog:chromeOptions": {
            "binary": CHROMIUM, "args": [*FLAGS, f"--user-data-dir={profile}"]}}
        reply = self.http.post("/session", json={"capabilities": {"alwaysMatch": caps}}).json()["value"]
        if "sessionId" not in reply:
            raise RuntimeError(f"chromedriver could not start chromium: {reply}")
        self.session = reply["sessionId"]

    def get(self, url: str) -> None:
        self.http.post(f"/session/{self.session}/url", json={"url": url}).raise_for_status()

    def js(self, script: str, *args: Any) -> Any:
        reply = self.http.post(f"/session/{self.session}/execute/sync", json={"script": script, "args": list(args)})
        value = reply.json()["value"]
        if reply.status_code != 200:
            raise RuntimeError(f"script failed: {value}")
        return value

    def wait(self, what: str, check: Callable[[], Any], timeout: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = check()
            if value:
                return value
            time.sleep(0.2)
        page_log = self.js("return document.getElementById('log').innerText")
        raise AssertionError(f"timed out waiting for {what}; page state: {self.js('return window.fvRealtime')}, "
                             f"log: {page_log}")

    def close(self) -> None:
        try:
            self.http.delete(f"/session/{self.session}")
        finally:
            self.http.close()
            self.driver.terminate()
            self.driver.wait(timeout=10)


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).exists()]
    if missing:
        pytest.skip(f"needs Debian chromium and chromium-driver ({', '.join(missing)} not found): "
                    "apt-get install -y chromium chromium-driver")
    b = Browser(tmp_path / "profile")
    yield b
    b.close()


def test_page_plays_chunks_and_acknowledges_a_prompt_update(browser: Browser, tmp_path: Path) -> None:
    deploy = DeployConfig(output_dir=tmp_path / "out")
    engine = Engine(SchedulerConfig(), limits=deploy.limits)
    engine.add_instance(build_instance(chunk_toy_card("toy-chunk", frames_per_chunk=2)))
    server = ServerThread(create_app(engine, deploy)).start()
    try:
        browser.get(f"{server.url}/realtime")
        assert browser.js("return MediaSource.isTypeSupported('video/mp4; codecs=\"avc1.64000A\"')"), \
            "this chromium cannot play H.264 through MSE"
        browser.js("""
            const set = (id, v) => { document.getElementById(id).value = v; };
            set('prompt', 'a red kite'); set('width', 32); set('height', 32); set('fps', 8); set('num-frames', 80);
            document.getElementById('start').click();
        """)
        browser.wait("3 chunks", lambda: browser.js("return window.fvRealtime.chunks") >= 3)
        first = browser.wait("playback to start", lambda: browser.js(
            "const v = document.getElementById('video'); return v.currentTime > 0 && v.currentTime"))
        browser.wait("currentTime to advance", lambda: browser.js(
            "return document.getElementById('video').currentTime") > first + 0.2)
        browser.js("""
            document.getElementById('update').value = 'a blue kite';
            document.getElementById('send-update').click();
        """)
        queued = browser.wait("the prompt update's ack", lambda: browser.js("return window.fvRealtime.queued"))
        applied = browser.wait("the prompt update applied", lambda: browser.js("return window.fvRealtime.applied"))
        assert applied == queued and len(queued) == 1
        assert browser.js("return window.fvRealtime.errors") == []
        assert browser.js("return document.getElementById('video').error") is None
        browser.js("document.getElementById('stop').click()")
        done = browser.wait("session.done", lambda: browser.js("return window.fvRealtime.done"))
        assert done["chunks"] >= 3
    finally:
        server.stop()


def test_negative_control_fragments_without_retiming_do_not_play_on(browser: Browser, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The playback check above can fail: fragments that all start at time 0 stall the video at one chunk."""
    from fv_kernel.serving import fmp4

    def not_retimed(self: Any, muxed: bytes, frame_start: int) -> bytes:
        return b"".join(muxed[o:o + n] for kind, o, n in fmp4.iter_boxes(muxed) if kind in (b"moof", b"mdat"))

    monkeypatch.setattr(fmp4.FragmentedMP4Writer, "_retime", not_retimed)
    deploy = DeployConfig(output_dir=tmp_path / "out")
    engine = Engine(SchedulerConfig(), limits=deploy.limits)
    engine.add_instance(build_instance(chunk_toy_card("toy-chunk", frames_per_chunk=2)))
    server = ServerThread(create_app(engine, deploy)).start()
    try:
        browser.get(f"{server.url}/realtime")
        browser.js("""
            const set = (id, v) => { document.getElementById(id).value = v; };
            set('prompt', 'a red kite'); set('width', 32); set('height', 32); set('fps', 8); set('num-frames', 80);
            document.getElementById('start').click();
        """)
        browser.wait("8 chunks", lambda: browser.js("return window.fvRealtime.chunks") >= 8)  # 2 s of video
        time.sleep(2.0)
        assert browser.js("return document.getElementById('video').currentTime") <= 2 / 8 + 0.05
    finally:
        server.stop()
