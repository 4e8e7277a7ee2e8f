"""Headless Chromium for page tests, driven through ChromeDriver's W3C HTTP API with plain httpx.

No browser download and no extra Python package: it needs Debian's ``chromium`` and
``chromium-driver`` (``apt-get install -y chromium chromium-driver``). :func:`require_browser`
skips a test when they are absent, or fails it when ``FV_REQUIRE_BROWSER=1`` (CI sets it, so a
machine that lost its browser cannot pass the page tests by skipping them).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

__all__ = ["Browser", "CHROMEDRIVER", "CHROMIUM", "drive_realtime_page", "realtime_page_browser", "require_browser",
           "start_realtime_page"]

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
# Flags for a closed network and a root user (Debian's /usr/bin/chromium, headless).
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--autoplay-policy=no-user-gesture-required", "--mute-audio"]


def require_browser() -> None:
    """Skip the calling test when Chromium or ChromeDriver is missing (fail under ``FV_REQUIRE_BROWSER=1``)."""
    import pytest

    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not Path(p).exists()]
    if not missing:
        return
    message = (f"needs Debian chromium and chromium-driver ({', '.join(missing)} not found): "
               "apt-get install -y chromium chromium-driver")
    if os.environ.get("FV_REQUIRE_BROWSER") == "1":
        pytest.fail(f"FV_REQUIRE_BROWSER=1 but the browser is missing: {message}")
    pytest.skip(message)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Browser:
    """One ChromeDriver session: load a page, run scripts in it, wait for a condition."""

    def __init__(self, profile: Path, *, page_load_strategy: str = "normal") -> None:
        """``page_load_strategy`` is W3C's: ``normal`` (``get`` waits for the load event) or ``none``."""
        import httpx

        self._httpx = httpx
        #: What a timed-out :meth:`wait` reports about the page (a test sets it, e.g. to the page's log).
        self.describe_page: Callable[[], Any] | None = None
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
                self.close()
                raise RuntimeError("chromedriver did not start")
            time.sleep(0.1)
        caps = {"browserName": "chrome", "pageLoadStrategy": page_load_strategy, "goog:chromeOptions": {
            "binary": CHROMIUM, "args": [*FLAGS, f"--user-data-dir={profile}"]}}
        reply = self.http.post("/session", json={"capabilities": {"alwaysMatch": caps}}).json()["value"]
        if "sessionId" not in reply:
            self.close()
            raise RuntimeError(f"chromedriver could not start chromium: {reply}")
        self.session: str | None = reply["sessionId"]

    def get(self, url: str) -> None:
        self.http.post(f"/session/{self.session}/url", json={"url": url}).raise_for_status()

    def js(self, script: str, *args: Any) -> Any:
        reply = self.http.post(f"/session/{self.session}/execute/sync", json={"script": script, "args": list(args)})
        value = reply.json()["value"]
        if reply.status_code != 200:
            raise RuntimeError(f"script failed: {value}")
        return value

    def wait(self, what: str, check: Callable[[], Any], timeout: float = 60.0,
             describe: Callable[[], Any] | None = None) -> Any:
        """Poll ``check`` until it returns a truthy value (returned); on timeout, fail with ``describe()``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = check()
            if value:
                return value
            time.sleep(0.2)
        describe = describe or self.describe_page
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}"
                             + ("" if describe is None else f"; page state: {describe()}"))

    def close(self) -> None:
        try:
            if getattr(self, "session", None) is not None:
                self.http.delete(f"/session/{self.session}")
        except self._httpx.HTTPError:
            pass
        finally:
            self.http.close()
            self.driver.terminate()
            self.driver.wait(timeout=10)


# -- the /realtime page (fv_kernel/serving/static/realtime.html): the kernel's and the families' page tests


@contextlib.contextmanager
def realtime_page_browser(profile: Path, *, page_load_strategy: str = "normal") -> Iterator[Browser]:
    """A :class:`Browser` (after :func:`require_browser`) whose timeouts report the realtime page's state and log."""
    require_browser()
    browser = Browser(profile, page_load_strategy=page_load_strategy)
    browser.describe_page = lambda: (browser.js("return window.fvRealtime"),
                                     browser.js("return document.getElementById('log').innerText"))
    try:
        yield browser
    finally:
        browser.close()


def start_realtime_page(browser: Browser, server_url: str, *, prompt: str, size: tuple[int, int], frames: int,
                        fps: int = 8, model: str | None = None, previews: bool = False) -> None:
    """Open ``/realtime`` and start a session from its form (``size`` is width, height; ``previews`` ticks its box)."""
    browser.get(f"{server_url}/realtime")
    # The page enables Start once its script has attached the form's handlers.
    browser.wait("the page's Start button to be enabled", lambda: browser.js(
        "const b = document.getElementById('start'); return !!window.fvRealtime && !!b && !b.disabled"), timeout=60)
    fields = {"prompt": prompt, "width": size[0], "height": size[1], "fps": fps, "num-frames": frames,
              **({"model": model} if model is not None else {})}
    browser.js("""
        for (const [id, value] of Object.entries(arguments[0])) { document.getElementById(id).value = value; }
        document.getElementById('previews').checked = arguments[1];
        document.getElementById('start').click();
    """, fields, previews)
    browser.wait("the page to send session.start", lambda: browser.js(
        "return document.getElementById('log').innerText.includes('session.start sent')"), timeout=60)


def drive_realtime_page(browser: Browser, server_url: str, *, prompt: str, update: str, size: tuple[int, int],
                        frames: int, model: str | None = None, timeout: float = 60.0) -> dict[str, Any]:
    """What the page tests check, in order: a session started from the page; 3 chunks arrive; the video
    element plays (``currentTime`` advances); a prompt update typed into the page is acknowledged
    (the page's ``queued`` event ids) and applied to a later chunk; no error event and no media error; stop
    ends the session with ``session.done`` after at least 3 chunks. Returns that ``session.done``."""
    start_realtime_page(browser, server_url, prompt=prompt, size=size, frames=frames, model=model)
    assert browser.js("return MediaSource.isTypeSupported('video/mp4; codecs=\"avc1.64000A\"')"), \
        "this chromium cannot play H.264 through MSE"
    browser.wait("3 chunks", lambda: browser.js("return window.fvRealtime.chunks") >= 3, timeout=3 * timeout)
    first = browser.wait("playback to start", lambda: browser.js(
        "const v = document.getElementById('video'); return v.currentTime > 0 && v.currentTime"), timeout=timeout)
    browser.wait("currentTime to advance", lambda: browser.js(
        "return document.getElementById('video').currentTime") > first + 0.2, timeout=timeout)
    browser.js(f"""
        document.getElementById('update').value = {json.dumps(update)};
        document.getElementById('send-update').click();
    """)
    queued = browser.wait("the prompt update's ack", lambda: browser.js("return window.fvRealtime.queued"), timeout=timeout)
    applied = browser.wait("the prompt update applied", lambda: browser.js("return window.fvRealtime.applied"),
                           timeout=3 * timeout)
    assert applied == queued and len(queued) == 1, (queued, applied)
    assert browser.js("return window.fvRealtime.errors") == []
    assert browser.js("return document.getElementById('video').error") is None
    browser.js("document.getElementById('stop').click()")
    done: dict[str, Any] = browser.wait("session.done", lambda: browser.js("return window.fvRealtime.done"),
                                        timeout=2 * timeout)
    assert done["chunks"] >= 3, done
    return done
