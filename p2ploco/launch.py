"""A local swarm on loopback: one bootstrap DHT peer and N node processes.

Used by ``p2ploco demo`` and by the multi-process tests. Every child runs in a session of its own,
so stopping it kills its p2p daemon too; ``close`` always reaps every child it started.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from p2ploco.errors import SwarmError
from p2ploco.metrics import read_summaries

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
ADDRESS = re.compile(r"(/ip4/\S+/tcp/\d+/p2p/\w+)")
REPO_ROOT = Path(__file__).resolve().parent.parent
TINY_CONFIG = REPO_ROOT / "configs" / "tiny.yaml"
LOG_TAIL = 40  # lines of each child's log shown when a swarm's user fails
HUB_LEAVE_SECONDS = 30.0  # a bootstrap's hub's time to leave its round once stopped, before it is killed


class Child:
    """A child process whose output lines are collected by a thread (so reading never blocks)."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, metrics_dir: Path | None = None,
                 env: dict[str, str] | None = None, keep_lines: bool = True):
        """``keep_lines``: queue the output lines for ``wait_for_line`` (False for a child that runs for days: they
        go to ``log_path`` only)."""
        self.name, self.log_path, self.metrics_dir, self.keep_lines = name, log_path, metrics_dir, keep_lines
        self._log: IO[str] = log_path.open("a")
        self.lines: queue.Queue[str] = queue.Queue()
        self.process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True, env={**os.environ, **(env or {})})
        self._terminated = False
        self._reader = threading.Thread(target=self._collect, daemon=True)
        self._reader.start()

    def _collect(self) -> None:
        for line in self.process.stdout:
            self._log.write(line)
            self._log.flush()
            if self.keep_lines:
                self.lines.put(line)
        self._log.close()

    def wait_for_line(self, pattern: re.Pattern[str], timeout: float) -> re.Match[str]:
        """The first output line matching ``pattern``; SwarmError if the child exits or ``timeout`` passes."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                if self.process.poll() is not None and self.lines.empty():
                    break
                continue
            if match := pattern.search(line):
                return match
        raise SwarmError(f"{self.name} printed no line matching {pattern.pattern!r} in {timeout:.0f} s "
                         f"(see {self.log_path})")

    def signal(self, signum: int) -> None:
        """Signal the child's whole session (the node and its p2p daemon), as a service manager does."""
        try:
            os.killpg(self.process.pid, signum)
        except ProcessLookupError:
            pass

    def terminate(self) -> None:
        """Ask the child to leave (SIGTERM), once: a second SIGTERM would make a node stop at once."""
        if self.process.poll() is None and not self._terminated:
            self._terminated = True
            self.signal(signal.SIGTERM)

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout``; always reaps. Returns the exit code."""
        if self.process.poll() is None:
            self.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        self.signal(signal.SIGKILL)  # also any p2p daemon left in the session
        code = self.process.wait()
        self._reader.join(5)
        return code


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "p2ploco.cli", *args]


class LocalSwarm:
    def __init__(self, workdir: Path, bootstrap: str = "p2ploco", hub: bool = False):
        """``bootstrap``: "p2ploco" runs ``p2ploco dht``; "hivemind" runs the stock ``hivemind-dht``. ``hub``: the
        p2ploco bootstrap hosts a hub for the run (``hosted_hub.py``; its records: ``hub_summaries``)."""
        self.workdir, self.hub = workdir, hub
        workdir.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []
        self.nodes: dict[str, Child] = {}
        self.bootstrap_address = self._start_bootstrap(bootstrap)

    def _start_bootstrap(self, kind: str) -> str:
        env = None
        if kind == "hivemind":
            argv = [str(Path(sys.executable).with_name("hivemind-dht")), "--host_maddrs", "/ip4/127.0.0.1/tcp/0"]
            env = {"HIVEMIND_LOGLEVEL": "INFO"}  # it logs its addresses at INFO; this process may have set WARNING
        else:
            hub = ["--hub-log-dir", str(self.workdir / "hub")] if self.hub else ["--no-hub"]
            argv = cli("dht", "--host-maddrs", LOOPBACK, *hub)
        child = Child("bootstrap", argv, self.workdir / "bootstrap.log", env=env)
        self.children.append(child)
        return child.wait_for_line(ADDRESS, timeout=60).group(1)

    def start_node(self, name: str, config: Path | None, *extra: str, log_dir: Path | None = None,
                   env: dict[str, str] | None = None, program: Sequence[str] = ()) -> Child:
        """A node process (``config`` None: it trains the config of the run it joins, ``extra`` naming its
        --run-id); a second start under the same name (a restart) appends to the same log. ``program`` replaces
        ``python -m p2ploco.cli`` (tests run nodes with a hostile behaviour patched in so)."""
        log_dir = log_dir or self.workdir / name
        argv = [*(program or cli()), "node", "start", *(["--config", str(config)] if config else []),
                "--initial-peers", self.bootstrap_address, "--host-maddrs", LOOPBACK, "--log-dir", str(log_dir),
                *extra]
        child = Child(name, argv, self.workdir / f"{name}.log", metrics_dir=log_dir, env=env)
        self.children.append(child)
        self.nodes[name] = child
        return child

    def summaries(self, name: str) -> list[dict]:
        return read_summaries(self.nodes[name].metrics_dir / "metrics.jsonl")

    def hub_summaries(self, run_id: str) -> list[dict]:
        """The records of the hub the bootstrap hosts (``hub=True``) for ``run_id``."""
        return read_summaries(self.workdir / "hub" / run_id / "metrics.jsonl")

    def close(self) -> None:
        for child in self.children:  # all leave at once, rather than one after another
            child.terminate()
        for child in reversed(self.children):
            # the bootstrap's hub has HUB_LEAVE_SECONDS to leave its round before the bootstrap kills it
            child.stop(HUB_LEAVE_SECONDS + 15 if child.name == "bootstrap" and self.hub else 15)

    def __enter__(self) -> LocalSwarm:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close()
        # A failed test or demo (not ctrl-c): what each process said last is where to start looking.
        if exc_type is not None and issubclass(exc_type, Exception):
            for child in self.children:
                print(f"---- the last lines of {child.log_path}", *child.log_path.read_text().splitlines()[-LOG_TAIL:],
                      sep="\n")
