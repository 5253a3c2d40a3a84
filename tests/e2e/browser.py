"""A real headless Chromium (Debian's `chromium`, installed by scripts/install-deps) driven
over the Chrome DevTools Protocol on its websocket (`websocket-client` from PyPI), for the
tests that look at a page as a person would: load it, type, press Enter, read what it
shows, take a screenshot.

Chromium is started with a fresh profile in the test's log directory and every background
service off (this machine has no network beyond loopback); it is stopped by its own PID
like every other process of the tests. Its DevTools port is chosen by Chromium itself
(`--remote-debugging-port=0`, read back from the profile's DevToolsActivePort), so two
pytest workers never race for one.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import time
import urllib.request
from pathlib import Path
from typing import Any, Optional

import harness
from harness import ManagedProcess, ProcessError

try:
    import websocket  # type: ignore  # websocket-client
except ImportError:  # pragma: no cover - scripts/install-deps installs it
    websocket = None


def chromium_binary() -> str:
    """$DIANA_CHROMIUM, else the binary Debian's /usr/bin/chromium wrapper runs (so the PID
    we hold is the browser's), else `chromium` or `chromium-browser` on PATH."""
    env = os.environ.get("DIANA_CHROMIUM")
    if env:
        return env
    debian = Path("/usr/lib/chromium/chromium")
    if debian.is_file():
        return str(debian)
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    raise ProcessError("chromium not found: run scripts/install-deps (Debian package `chromium`)")


class Chromium(ManagedProcess):
    """Headless Chromium with a fresh profile under `log_dir`."""

    def __init__(self, log_dir: Path, *, width: int = 1440, height: int = 1100) -> None:
        if websocket is None:
            raise ProcessError("the Python package websocket-client is missing: run scripts/install-deps")
        self.profile = log_dir / "chromium-profile"
        shutil.rmtree(self.profile, ignore_errors=True)
        self.profile.mkdir(parents=True)
        self.port: Optional[int] = None
        argv = [
            chromium_binary(),
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-extensions",
            "--disable-default-apps",
            "--mute-audio",
            "--hide-scrollbars",
            "--force-device-scale-factor=1",
            f"--window-size={width},{height}",
            f"--user-data-dir={self.profile}",
            "--remote-debugging-address=127.0.0.1",
            "--remote-debugging-port=0",
            "about:blank",
        ]
        super().__init__("chromium", argv, log_dir / "chromium.log")

    def _read_port(self) -> bool:
        text = (self.profile / "DevToolsActivePort").read_text()
        self.port = int(text.splitlines()[0])
        return True

    def start(self, timeout: float = 60.0) -> "Chromium":  # type: ignore[override]
        super().start()
        self.wait_ready(self._read_port, timeout, "listening for DevTools")
        return self

    def page(self) -> "Page":
        """The browser's first tab, connected."""
        with urllib.request.urlopen(f"http://{harness.HOST}:{self.port}/json/list", timeout=10) as answer:
            targets = json.load(answer)
        pages = [t for t in targets if t.get("type") == "page"]
        if not pages:
            raise ProcessError(f"chromium has no page target: {targets}")
        return Page(pages[0]["webSocketDebuggerUrl"])


class Page:
    """One tab over CDP. Events that arrive while waiting for an answer are kept:
    exceptions, console messages and the requests the page made."""

    def __init__(self, ws_url: str) -> None:
        # No Origin header: Chromium refuses DevTools websockets from origins it was not told.
        self.ws = websocket.create_connection(ws_url, timeout=30, suppress_origin=True)
        self.next_id = 0
        self.exceptions: list[str] = []
        self.console: list[str] = []
        self.requests: list[dict[str, Any]] = []
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.send(f"{domain}.enable")

    def close(self) -> None:
        try:
            self.ws.close()
        except Exception:  # noqa: BLE001 - the browser may be gone already
            pass

    def _event(self, message: dict[str, Any]) -> None:
        method = message.get("method")
        params = message.get("params", {})
        if method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.exceptions.append(json.dumps(details)[:2000])
        elif method == "Runtime.consoleAPICalled":
            args = params.get("args", [])
            self.console.append(f"console.{params.get('type')}: " + " ".join(str(a.get("value", a.get("description", ""))) for a in args))
        elif method == "Log.entryAdded":
            entry = params.get("entry", {})
            self.console.append(f"{entry.get('source')}/{entry.get('level')}: {entry.get('text')} {entry.get('url', '')}")
        elif method == "Network.requestWillBeSent":
            request = params.get("request", {})
            self.requests.append({"url": request.get("url", ""), "headers": request.get("headers", {})})

    def send(self, method: str, timeout: float = 30.0, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        mine = self.next_id
        self.ws.send(json.dumps({"id": mine, "method": method, "params": params}))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.ws.settimeout(max(0.05, deadline - time.monotonic()))
            message = json.loads(self.ws.recv())
            if message.get("id") == mine:
                if "error" in message:
                    raise ProcessError(f"{method}: {message['error']}")
                return message.get("result", {})
            self._event(message)
        raise ProcessError(f"{method}: no answer within {timeout} s")

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited)."""
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise ProcessError(f"{expression[:200]}: {result['exceptionDetails']}")
        return result.get("result", {}).get("value")

    def navigate(self, url: str, timeout: float = 30.0) -> None:
        self.send("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'", timeout, f"{url} loaded")

    def wait_for(self, expression: str, timeout: float, what: str, period: float = 0.1) -> Any:
        """Polls `expression` until it is truthy; its value. Bounded by `timeout`."""
        deadline = time.monotonic() + timeout
        value: Any = None
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(period)
        raise ProcessError(f"not {what} within {timeout} s (last value {value!r})")

    def type_text(self, text: str) -> None:
        """Types into the focused element, as a keyboard would."""
        self.send("Input.insertText", text=text)

    def press_enter(self) -> None:
        for kind in ("keyDown", "keyUp"):
            self.send("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter",
                      windowsVirtualKeyCode=13, nativeVirtualKeyCode=13,
                      **({"text": "\r"} if kind == "keyDown" else {}))  # fmt: skip

    def click(self, selector: str) -> None:
        """A mouse click in the middle of the element `selector` names."""
        box = self.evaluate(
            f"(() => {{ const r = document.querySelector({json.dumps(selector)}).getBoundingClientRect();"
            " return {x: r.x + r.width / 2, y: r.y + r.height / 2}; })()"
        )
        for kind in ("mousePressed", "mouseReleased"):
            self.send("Input.dispatchMouseEvent", type=kind, x=box["x"], y=box["y"], button="left", clickCount=1)

    def screenshot(self, path: Path) -> Path:
        """The whole page (beyond the window) as PNG."""
        metrics = self.send("Page.getLayoutMetrics")
        size = metrics.get("cssContentSize") or metrics.get("contentSize")
        shot = self.send(
            "Page.captureScreenshot",
            format="png",
            captureBeyondViewport=True,
            clip={"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1},
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(shot["data"]))
        return path
