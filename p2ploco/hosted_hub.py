"""The hub a bootstrap peer hosts (``p2ploco dht``): a public machine that trains nothing still serves the run's
rounds, so that trainers which are all behind NAT train together (docs/design.md, "Hubs").

The hub is ``p2ploco node start --role hub``, a child process of its own with its own peer id and port (the next
port after the bootstrap's, by default), so that a crash or a bad round of it never takes the bootstrap down. Given
the run's config (``p2ploco dht --config``), it starts at once and serves that config to joiners, so that trainers
which are all behind NAT (none of whom can be dialled to hand out the config) join with one address. Without one it
fetches the run's config as any joiner does, from a peer that can be dialled, once the run has a trainer; without
``--run-id`` too, it serves the one run trained in the swarm once there is exactly one (an operator who wants it to
serve only their run names it: a key of another run could otherwise be there first). It starts again when it
exits, after a pause that grows while it keeps failing; a start it refuses for its config (a streamed or overlapped
run: exit code 2) ends the hosting, and the bootstrap goes on alone.
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hivemind.dht.node import DHTNode

from p2ploco.errors import SwarmError, shown
from p2ploco.launch import HUB_LEAVE_SECONDS, Child, cli
from p2ploco.swarm.loop import EventLoopThread
from p2ploco.swarm.survey import find_run, runs_trained, survey

LOOK_EVERY = 5.0  # seconds between looks for the run's first trainer
RESTART_PAUSES = (5.0, 300.0)  # the first pause before a restart, and the longest; it doubles while the hub fails
STEADY_SECONDS = 600.0  # a hub that ran this long before it exited starts again after the first pause
REFUSED = 2  # `node start`'s exit code for a config it refuses (cli.reports_errors)
TCP_PORT = re.compile(r"/tcp/(\d+)")
PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,63}")  # a run the hub serves: never '..', '/' or '-x'


def hub_maddrs(maddrs: Sequence[str], port: int) -> list[str]:
    """``maddrs`` with their TCP port replaced by ``port``."""
    return [TCP_PORT.sub(f"/tcp/{port}", m, count=1) for m in maddrs]


def next_port(maddrs: Sequence[str]) -> int:
    """The port after the first TCP port in ``maddrs``; 0 (any free one) if that is 0 or there is none."""
    for m in maddrs:
        if found := TCP_PORT.search(m):
            port = int(found.group(1))
            return port + 1 if 0 < port < 65535 else 0
    return 0


@dataclass(frozen=True)
class HubSettings:
    run_id: str | None  # None: the one run the swarm trains (or, with ``config``, the config's run id)
    config: str | None  # the run's config file (None: fetched from the run's peers) and --set on top of it
    overrides: tuple[str, ...]
    port: int  # 0: any free port (then the hub announces no address of its own: it shows the ones it listens on)
    host_maddrs: tuple[str, ...]  # the bootstrap's; the hub listens on the same interfaces
    announce_maddrs: tuple[str, ...]
    identity: str | None  # the bootstrap's key file; the hub's is next to it (a stable peer id across restarts)
    log_dir: Path
    max_mbit: float  # the hub's upload cap and its stated link (0: no cap)

    def argv(self, run_id: str, bootstrap_address: str) -> list[str]:
        announce = hub_maddrs(self.announce_maddrs, self.port) if self.port else []
        extra = [f"swarm.bandwidth_mbit={self.max_mbit:g}", f"swarm.max_upload_mbit={self.max_mbit:g}"] \
            if self.max_mbit else []
        identity = str(Path(self.identity).with_suffix(".hub.key")) if self.identity else None
        config = [*(["--config", self.config] if self.config is not None else []),
                  *[a for item in self.overrides for a in ("--set", item)]]
        return cli("node", "start", "--role", "hub", "--run-id", run_id, "--initial-peers", bootstrap_address, *config,
                   *[a for m in hub_maddrs(self.host_maddrs, self.port) for a in ("--host-maddrs", m)],
                   *[a for m in announce for a in ("--announce-maddrs", m)],
                   *(["--identity", identity] if identity else []), "--log-dir", str(self.log_dir / run_id),
                   *[a for item in extra for a in ("--set", item)])


class HostedHub:
    """Runs the hub child for as long as the bootstrap is up (``start``, ``stop``)."""

    def __init__(self, settings: HubSettings, loop: EventLoopThread, node: DHTNode, bootstrap_address: str,
                 out: Callable[[str], None]):
        self.settings, self.loop, self.node, self.bootstrap_address = settings, loop, node, bootstrap_address
        self.out = out
        self.stopping = threading.Event()
        self.run_id: str | None = None  # the run it serves, once found
        self.thread = threading.Thread(target=self._host, name="hosted-hub", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Ask the hub to leave, kill it after HUB_LEAVE_SECONDS, and reap it."""
        self.stopping.set()
        self.thread.join()

    def _host(self) -> None:
        pause = RESTART_PAUSES[0]
        while (run_id := self._wait_for_trainer()) is not None:
            started = time.monotonic()
            code = self._serve(run_id)
            if self.stopping.is_set():
                return
            if code == REFUSED:
                self.out(f"hub: not started for run '{shown(run_id)}': {self._error_line(run_id)}; this peer goes on "
                         f"as a bootstrap only")
                return
            if time.monotonic() - started >= STEADY_SECONDS:
                pause = RESTART_PAUSES[0]
            self.out(f"hub: exited with code {code}: {self._error_line(run_id)}; starting it again in {pause:.0f} s")
            if self.stopping.wait(pause):
                return
            pause = min(2 * pause, RESTART_PAUSES[1])

    def _wait_for_trainer(self) -> str | None:
        """The run to serve: at once with a config of its own, else once the run has a trainer (its config can be
        fetched then); None once stopping."""
        if self.settings.config is not None:
            return None if self.stopping.is_set() else self.settings.run_id
        said = ""
        while not self.stopping.is_set():
            if self.run_id is None:  # found once: a run the hub served is the one it serves again
                why = self._find_run()
            if self.run_id is not None:
                if self.loop.run(survey(self.node, self.run_id)).trainers:
                    return self.run_id
                why = f"hub: waiting for run '{shown(self.run_id)}''s first trainer"
            if why != said:
                self.out(why)
                said = why
            self.stopping.wait(LOOK_EVERY)
        return None

    def _find_run(self) -> str:
        """Set ``run_id`` to the run to serve, if there is one now; else say what the hub waits for."""
        named, trained = self.settings.run_id, self.loop.run(runs_trained(self.node))
        if named is None and len(trained) > 1:
            return (f"hub: several runs train through this bootstrap ({', '.join(map(shown, trained))}); start it "
                    f"with --run-id to serve one")
        chosen = named if named is not None else next(iter(trained), None)
        if chosen is None or chosen not in trained:
            return f"hub: waiting for {'a run' if chosen is None else f'run {shown(chosen)!r}'} to train through " \
                   f"this bootstrap"
        if not PLAIN_NAME.fullmatch(chosen):  # a run found in the DHT (a name given is checked at start): it names
            # the hub's log folder and goes on its argv
            return f"hub: run '{shown(chosen)}' is not a plain name (letters, digits, '.', '_', '-'): not served"
        try:
            self.run_id = self.loop.run(find_run(self.node, chosen))  # its records are schema-checked from now on
        except SwarmError as e:  # its last peer left meanwhile
            return f"hub: waiting ({e})"
        return ""

    def _log_path(self, run_id: str) -> Path:
        return self.settings.log_dir / f"{run_id}.log"

    def _error_line(self, run_id: str) -> str:
        """What the hub said last on why it stopped (`node start`'s one-line ``error:``), or where its log is."""
        lines = self._log_path(run_id).read_text(errors="replace").splitlines()
        said = [line.removeprefix("error: ") for line in lines if line.startswith("error: ")]
        return said[-1] if said else f"see its log, {self._log_path(run_id)}"

    def _serve(self, run_id: str) -> int:
        """Run the hub until it exits or the bootstrap stops; its exit code. Either way its session is ended and
        reaped (its p2p daemon too)."""
        self.settings.log_dir.mkdir(parents=True, exist_ok=True)
        child = Child("hub", self.settings.argv(run_id, self.bootstrap_address), self._log_path(run_id),
                      keep_lines=False)
        self.out(f"hub: serving run '{shown(run_id)}' as a peer of its own, pid {child.process.pid} (its log: "
                 f"{self._log_path(run_id)})")
        while not self.stopping.is_set():
            try:
                child.process.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                continue
        return child.stop(HUB_LEAVE_SECONDS)
