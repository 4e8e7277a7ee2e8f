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
from fv_kernel.testing.browser import Browser, drive_realtime_page, realtime_page_browser, start_realtime_page
from fv_kernel.testing.chunk_kit import chunk_toy_card

@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    with realtime_page_browser(tmp_path / "profile") as b:
        yield b


def test_page_plays_chunks_and_acknowledges_a_prompt_update(browser: Browser, tmp_path: Path) -> None:
    deploy = DeployConfig(output_dir=tmp_path / "out")
    engine = Engine(SchedulerConfig(), limits=deploy.limits)
    engine.add_instance(build_instance(chunk_toy_card("toy-chunk", frames_per_chunk=2)))
    server = ServerThread(create_app(engine, deploy)).start()
    try:
        drive_realtime_page(browser, server.url, prompt="a red kite", update="a blue kite", size=(32, 32), frames=80)
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
        start_realtime_page(browser, server.url, prompt="a red kite", size=(32, 32), frames=80)
        browser.wait("8 chunks", lambda: browser.js("return window.fvRealtime.chunks") >= 8)  # 2 s of video
        time.sleep(2.0)
        assert browser.js("return document.getElementById('video').currentTime") <= 2 / 8 + 0.05
    finally:
        server.stop()


def test_start_clicked_before_the_script_ran_does_not_reload_the_page(tmp_path: Path) -> None:
    """Start stays disabled until realtime.js has attached its handlers. Clicked earlier, an enabled submit
    button would submit the form natively and reload the page, losing the click (a CI flake once did this)."""
    deploy = DeployConfig(output_dir=tmp_path / "out")
    engine = Engine(SchedulerConfig(), limits=deploy.limits)
    engine.add_instance(build_instance(chunk_toy_card("toy-chunk", frames_per_chunk=2)))
    app = create_app(engine, deploy)

    @app.middleware("http")
    async def slow_script(request: Any, call_next: Any) -> Any:
        if request.url.path.endswith("/realtime.js"):
            import asyncio

            await asyncio.sleep(3.0)
        return await call_next(request)

    server = ServerThread(app).start()
    # "none": get() returns before the (slow) script has run, as a user's click can come.
    with realtime_page_browser(tmp_path / "profile", page_load_strategy="none") as browser:
        try:
            browser.get(f"{server.url}/realtime")
            browser.wait("the Start button in the DOM", lambda: browser.js("return !!document.getElementById('start')"))
            browser.js("window.marker = 1; document.getElementById('prompt').value = 'x';"
                       " document.getElementById('start').click();")
            browser.wait("the page's script", lambda: browser.js("return !!window.fvRealtime"), timeout=30)
            assert browser.js("return window.marker") == 1, "the early click reloaded the page"
            assert browser.js("return location.search") == ""
            assert browser.js("return document.getElementById('start').disabled") is False
        finally:
            server.stop()
