"""A headless Chromium driven over the DevTools protocol, for the dashboard's tests and benchmark: the browser
reads commands from its fd 3 and writes answers and events to its fd 4 (``--remote-debugging-pipe``), each message
JSON ended by a NUL byte. Standard library only; Debian's ``chromium`` package is the browser (``.ci/run``
installs it).
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def find_browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


class BrowserError(Exception):
    pass


def _above_nine(fd: int) -> int:
    """``fd`` moved to a number above 9."""
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return moved


class Browser:
    """One headless browser with one page (``open``), closed with ``close`` (or as a context manager)."""

    def __init__(self, executable: str, width: int = 1400, height: int = 1800):
        self.profile = tempfile.mkdtemp(prefix="p2ploco-browser-")
        commands_read, self._commands = os.pipe()
        self._answers, answers_write = os.pipe()
        # Bash (dash takes fds 0-9 only) puts the browser's pipe ends at fds 3 and 4, where it looks for them, and
        # closes the originals: moved above 9 first, so that no original is itself 3 or 4 (closed once put there).
        commands_read, answers_write = (_above_nine(fd) for fd in (commands_read, answers_write))
        script = f'exec "$0" "$@" 3<&{commands_read} 4>&{answers_write} {commands_read}<&- {answers_write}>&-'
        self.process = subprocess.Popen(
            ["bash", "-c", script, executable, "--headless", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
             "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check", "--disable-extensions",
             "--hide-scrollbars", "--mute-audio", f"--window-size={width},{height}",
             f"--user-data-dir={self.profile}", "about:blank"],
            pass_fds=(commands_read, answers_write), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(commands_read)
        os.close(answers_write)
        self._next_id = 0
        self._waiting: dict[int, queue.Queue] = {}
        self._lock = threading.Lock()
        self.console: list[str] = []  # console errors, exceptions and CSP reports of the page
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.session: str | None = None  # the open page's
        self.target: str | None = None

    def _read(self) -> None:
        buffered = b""
        while piece := os.read(self._answers, 1 << 16):
            buffered += piece
            *messages, buffered = buffered.split(b"\0")
            for message in messages:
                self._dispatch(json.loads(message))
        with self._lock:  # the browser is gone: nobody waits forever
            for waiting in self._waiting.values():
                waiting.put({"error": {"message": "the browser exited"}})

    def _dispatch(self, message: dict[str, Any]) -> None:
        if "id" in message:
            with self._lock:
                waiting = self._waiting.pop(message["id"], None)
            if waiting is not None:
                waiting.put(message)
            return
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.exceptionThrown":
            self.console.append(f"exception: {params['exceptionDetails'].get('text')} "
                                f"{params['exceptionDetails'].get('exception', {}).get('description', '')}")
        elif method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "warning", "assert"):
            self.console.append(f"console.{params['type']}: "
                                + " ".join(str(a.get("value", a.get("description"))) for a in params["args"]))
        elif method == "Log.entryAdded" and params["entry"]["level"] in ("error", "warning"):
            self.console.append(f"log: {params['entry']['text']}")

    def send(self, method: str, params: dict[str, Any] | None = None, session: bool = True,
             timeout: float = 30.0) -> dict[str, Any]:
        """The result of one DevTools command (on the page's session unless ``session`` is False)."""
        with self._lock:
            self._next_id += 1
            number = self._next_id
            answer: queue.Queue = queue.Queue()
            self._waiting[number] = answer
        message = {"id": number, "method": method, "params": params or {}}
        if session and self.session is not None:
            message["sessionId"] = self.session
        try:
            os.write(self._commands, json.dumps(message).encode() + b"\0")
        except BrokenPipeError:
            raise BrowserError(f"{method}: the browser exited (code {self.process.poll()})") from None
        try:
            reply = answer.get(timeout=timeout)
        except queue.Empty:
            raise BrowserError(f"{method}: no answer from the browser in {timeout:.0f} s") from None
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error'].get('message')}")
        return reply["result"]

    def open(self, url: str) -> None:
        """Open ``url`` in a new page, which every later command is about."""
        self.target = self.send("Target.createTarget", {"url": "about:blank"}, session=False)["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": self.target, "flatten": True},
                                 session=False)["sessionId"]
        for domain in ("Runtime.enable", "Log.enable", "Page.enable"):
            self.send(domain)
        self.send("Page.navigate", {"url": url})

    def close_page(self) -> None:
        """Close the page ``open`` opened."""
        self.send("Target.closeTarget", {"targetId": self.target}, session=False)
        self.session = self.target = None

    def evaluate(self, expression: str, timeout: float = 30.0) -> Any:
        """The value of a JavaScript expression in the page (a promise is awaited), as JSON gives it."""
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                "awaitPromise": True, "timeout": int(timeout * 1000)},
                           timeout=timeout + 5)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression[:80]}: {result['exceptionDetails'].get('text')} "
                               f"{result['exceptionDetails'].get('exception', {}).get('description', '')}")
        return result["result"].get("value")

    def wait_for(self, condition: str, timeout: float) -> Any:
        """The first truthy value of the JavaScript expression ``condition``, which the page checks every 100 ms as
        it runs (a promise it resolves); BrowserError after ``timeout`` seconds."""
        script = (f"new Promise((resolve, reject) => {{ const until = Date.now() + {int(timeout * 1000)};"
                  f" const check = () => {{ let value; try {{ value = ({condition}); }} catch (e) {{ value = null; }}"
                  f" if (value) resolve(value); else if (Date.now() > until) reject(new Error('timed out'));"
                  f" else setTimeout(check, 100); }}; check(); }})")
        try:
            return self.evaluate(script, timeout + 5)
        except BrowserError as e:
            raise BrowserError(f"the page never showed {condition!r} in {timeout:.0f} s ({e})") from None

    def screenshot(self, path: Path) -> None:
        """The whole page (not only the window) as a PNG at ``path``."""
        data = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            if self.process.poll() is None:
                try:
                    self.send("Browser.close", session=False, timeout=10)
                except BrowserError:
                    pass
                try:
                    self.process.wait(10)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait(10)
        finally:
            os.close(self._commands)
            self._reader.join(10)
            os.close(self._answers)
            shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

