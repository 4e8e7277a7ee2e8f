"""The ``/realtime`` page in headless Chromium: it opens a session on the toy causal chunk card, plays
the fMP4 chunks through Media Source Extensions, and a prompt update is acknowledged and applied.

Chromium is driven through ChromeDriver's W3C HTTP API with plain httpx (no browser download, no
extra Python package). Needs Debian's ``chromium`` and ``chromium-driver`` (/usr/bin/chromium,
/usr/bin/chromedriver); skipped when they are absent, failed under ``FV_REQUIRE_BROWSER=1`` (CI).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
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
from fv_kernel.testing.browser import Browser, require_browser
from fv_kernel.testing.chunk_kit import chunk_toy_card

@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    require_browser()
    b = Browser(tmp_path / "profile")
    b.describe_page = lambda: (b.js("return window.fvRealtime"), b.js("return document.getElementById('log').innerText"))
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
