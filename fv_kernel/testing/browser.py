"""Headless Chromium for page tests, driven through ChromeDriver's W3C HTTP API with plain httpx.

No browser download and no extra Python package: it needs Debian's ``chromium`` and
``chromium-driver`` (``apt-get install -y chromium chromium-driver``). :func:`require_browser`
skips a test when they are absent, or fails it when ``FV_REQUIRE_BROWSER=1`` (CI sets it, so a
machine that lost its browser cannot pass the page tests by skipping them).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["Browser", "CHROMEDRIVER", "CHROMIUM", "require_browser"]

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

    def __init__(self, profile: Path) -> None:
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
        caps = {"browserName": "chrome", "goog:chromeOptions": {
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
