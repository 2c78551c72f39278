"""A headless Chromium driven through the DevTools protocol: enough to read a rendered SPA page.

The Prefect UI renders in the browser, so the test needs a real one. This
starts Debian's ``chromium`` headless with a fresh profile and a debugging
port, connects to its page over a websocket (``websockets``, installed with
Prefect) and offers the few commands the tests use: navigate, read the
rendered text, click an element by its text, screenshot. Polling the rendered
text replaces fixed sleeps: the UI fetches its data after the page loads.
"""

from __future__ import annotations

import base64
import itertools
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--remote-debugging-port=0",
    "--remote-allow-origins=*",
]


class Browser:
    """One Chromium process with one page; a context manager that always stops the process."""

    def __init__(self, *, width: int = 1400, height: int = 1600, startup_timeout: float = 60) -> None:
        from websockets.sync.client import connect

        self.profile = tempfile.mkdtemp(prefix="ckptflow-chromium-")
        self.log = Path(self.profile) / "chromium.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [
                    CHROMIUM,
                    *FLAGS,
                    f"--user-data-dir={self.profile}",
                    f"--window-size={width},{height}",
                    "about:blank",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._ids = itertools.count(1)
        try:
            port = self._debugging_port(startup_timeout)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
                pages = [t for t in json.load(r) if t.get("type") == "page"]
            self.ws = connect(pages[0]["webSocketDebuggerUrl"], max_size=None, open_timeout=20)
            self.call("Page.enable")
            self.call("Runtime.enable")
        except BaseException:
            self.close()
            raise

    def _debugging_port(self, timeout: float) -> int:
        marker = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"chromium exited ({self.proc.returncode}):\n{self.log.read_text()[-2000:]}"
                )
            if marker.exists() and marker.read_text().strip():
                return int(marker.read_text().split()[0])
            time.sleep(0.1)
        raise RuntimeError(f"chromium opened no debugging port within {timeout:.0f}s")

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one DevTools command and return its result (events on the way are dropped)."""
        msg_id = next(self._ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv(timeout=60))
            if message.get("id") == msg_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def text(self) -> str:
        """The page's rendered text (what a user can read), whitespace collapsed."""
        return " ".join((self.evaluate("document.body ? document.body.innerText : ''") or "").split())

    def wait_for_text(self, *needles: str, timeout: float = 60) -> str:
        """Poll the rendered text until it holds every needle; return it (the caller asserts)."""
        deadline = time.monotonic() + timeout
        text = self.text()
        while not all(n in text for n in needles) and time.monotonic() < deadline:
            time.sleep(0.25)
            text = self.text()
        return text

    def click_text(self, text: str, selector: str = "button, a, [role=tab], li") -> bool:
        """Click the first element matching ``selector`` whose own text is ``text``; False if none."""
        script = f"""(() => {{
            const el = [...document.querySelectorAll({json.dumps(selector)})]
                .find(e => e.innerText && e.innerText.trim() === {json.dumps(text)});
            if (!el) return false;
            el.click();
            return true;
        }})()"""
        return bool(self.evaluate(script))

    def scroll_to(self, text: str) -> bool:
        """Scroll the innermost element whose text holds ``text`` to the middle of the view (for a
        screenshot of it); False if there is none."""
        script = f"""(() => {{
            const el = [...document.querySelectorAll('body *')].reverse()
                .find(e => e.innerText && e.innerText.includes({json.dumps(text)}));
            if (!el) return false;
            el.scrollIntoView({{block: 'center'}});
            return true;
        }})()"""
        return bool(self.evaluate(script))

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        ws = getattr(self, "ws", None)
        if ws is not None:
            ws.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
