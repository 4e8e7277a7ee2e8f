"""The ``/realtime`` page on ``wan-toy-causal`` in headless Chromium (issue: a real browser on the real card).

The page opens a session over the WebSocket, plays the card's fMP4 chunks through Media Source
Extensions, and a prompt update typed into the page is acknowledged and applied. Needs Debian's
``chromium`` and ``chromium-driver``; skipped without them, failed under ``FV_REQUIRE_BROWSER=1`` (CI).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("httpx")
pytest.importorskip("av")
pytest.importorskip("websockets")

from fv_kernel.api import DeployConfig, Engine, SchedulerConfig, build_instance
from fv_kernel.serving import ServerThread, create_app
from fv_kernel.testing.browser import Browser, drive_realtime_page, realtime_page_browser, start_realtime_page
from fv_wan.toy_card import wan_toy_causal_card


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    with realtime_page_browser(tmp_path / "profile") as b:
        yield b


def _server(tmp_path: Path) -> ServerThread:
    deploy = DeployConfig(output_dir=tmp_path / "out")
    engine = Engine(SchedulerConfig(), limits=deploy.limits)
    engine.add_instance(build_instance(wan_toy_causal_card()))
    return ServerThread(create_app(engine, deploy)).start()


def test_page_streams_wan_toy_causal_and_applies_a_prompt_update(browser: Browser, tmp_path: Path) -> None:
    server = _server(tmp_path)
    try:
        drive_realtime_page(browser, server.url, model="wan-toy-causal",
                            prompt="a red circle moves left slowly on a navy background",
                            update="a red circle moves right slowly on a navy background", size=(64, 64), frames=120)
    finally:
        server.stop()


def test_page_shows_previews_when_asked(browser: Browser, tmp_path: Path) -> None:
    server = _server(tmp_path)
    try:
        start_realtime_page(browser, server.url, model="wan-toy-causal", prompt="a red circle moves left slowly on a navy "
                            "background", size=(64, 64), frames=40, previews=True)
        browser.wait("2 previews and 2 chunks", lambda: browser.js(
            "return window.fvRealtime.previews >= 2 && window.fvRealtime.chunks >= 2"), timeout=120)
        assert browser.js("return document.getElementById('preview').naturalWidth") == 64
        assert browser.js("return window.fvRealtime.errors") == []
        browser.js("document.getElementById('stop').click()")
        browser.wait("session.done", lambda: browser.js("return window.fvRealtime.done"), timeout=60)
    finally:
        server.stop()
