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
from fv_kernel.testing.browser import Browser, require_browser
from fv_wan.toy_card import wan_toy_causal_card


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Browser]:
    require_browser()
    b = Browser(tmp_path / "profile")
    b.describe_page = lambda: (b.js("return window.fvRealtime"), b.js("return document.getElementById('log').innerText"))
    yield b
    b.close()


def test_page_streams_wan_toy_causal_and_applies_a_prompt_update(browser: Browser, tmp_path: Path) -> None:
    deploy = DeployConfig(output_dir=tmp_path / "out")
    engine = Engine(SchedulerConfig(), limits=deploy.limits)
    engine.add_instance(build_instance(wan_toy_causal_card()))
    server = ServerThread(create_app(engine, deploy)).start()
    try:
        browser.get(f"{server.url}/realtime")
        browser.js("""
            const set = (id, v) => { document.getElementById(id).value = v; };
            set('model', 'wan-toy-causal');
            set('prompt', 'a red circle moves left slowly on a navy background');
            set('width', 64); set('height', 64); set('fps', 8); set('num-frames', 120);
            document.getElementById('start').click();
        """)
        browser.wait("3 chunks", lambda: browser.js("return window.fvRealtime.chunks") >= 3, timeout=180)
        first = browser.wait("playback to start", lambda: browser.js(
            "const v = document.getElementById('video'); return v.currentTime > 0 && v.currentTime"), timeout=60)
        browser.wait("currentTime to advance", lambda: browser.js(
            "return document.getElementById('video').currentTime") > first + 0.2, timeout=60)
        browser.js("""
            document.getElementById('update').value = 'a red circle moves right slowly on a navy background';
            document.getElementById('send-update').click();
        """)
        queued = browser.wait("the prompt update's ack", lambda: browser.js("return window.fvRealtime.queued"), timeout=60)
        applied = browser.wait("the prompt update applied", lambda: browser.js("return window.fvRealtime.applied"),
                               timeout=180)
        assert applied == queued and len(queued) == 1
        assert browser.js("return window.fvRealtime.errors") == []
        assert browser.js("return document.getElementById('video').error") is None
        browser.js("document.getElementById('stop').click()")
        done = browser.wait("session.done", lambda: browser.js("return window.fvRealtime.done"), timeout=120)
        assert done["chunks"] >= 3
    finally:
        server.stop()
