"""The hubs a bootstrap peer hosts (``p2ploco dht``): a public machine that trains nothing still serves the run's
rounds, so that trainers which are all behind NAT train together (docs/design.md, "Hubs").

A hub is ``p2ploco node start --role hub``, a child process of its own with its own peer id and port (the next port
after the bootstrap's, by default), so that a crash or a bad round of it never takes the bootstrap down. Given the
run's config (``p2ploco dht --config``), it starts at once and serves that config to joiners. Without one, the
bootstrap fetches the run's document itself, as a joiner does (``swarm/run_config.py``: the fingerprint most fresh
records carry, from one of its holders), once the run has a trainer, and hands it to the hub (``--run-document``):
the bootstrap's daemon reaches a trainer behind NAT over the connection the trainer opened to it, where no fresh
dial can, so trainers that are all behind NAT need nothing more than the bootstrap's address. Without ``--run-id``
too, it serves each run trained through it, up to ``MAX_RUNS``, the k-th on the port after the (k-1)-th's (an
operator who wants it to serve only their run names it: keys of other runs could otherwise take the slots first).
Each hub starts again when it exits, after a pause that grows while it keeps failing; a start it refuses for its
config (a streamed or overlapped run: exit code 2) ends that run's hosting, and the bootstrap goes on without it.
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
from p2ploco.swarm.records import PeerRole
from p2ploco.swarm.run_config import ConfigUnserved, fetch_run_document, ranked_fingerprints, save_run_document
from p2ploco.swarm.survey import find_run, runs_trained, survey

LOOK_EVERY = 5.0  # seconds between looks for runs to serve, and for a run's first trainer
MAX_RUNS = 4  # runs one bootstrap hosts hubs for (each is a full replica): records alone take no more
CHECK_EVERY = 30.0  # seconds between checks that a fetched config is still the one most of the run's trainers train
RESTART_PAUSES = (5.0, 300.0)  # the first pause before a restart, and the longest; it doubles while the hub fails
STEADY_SECONDS = 600.0  # a hub that ran this long before it exited starts again after the first pause
REFUSED = 2  # `node start`'s exit code for a config it refuses (cli/command.py: reports_errors)
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

    def argv(self, run_id: str, bootstrap_address: str, slot: int = 0, document: Path | None = None) -> list[str]:
        """The hub's command line: the ``slot``-th hub of this bootstrap (its port and key follow the first's), given
        the run's ``document`` where it has no config of its own."""
        port = self.port + slot if self.port else 0
        announce = hub_maddrs(self.announce_maddrs, port) if port else []
        extra = [f"swarm.bandwidth_mbit={self.max_mbit:g}", f"swarm.max_upload_mbit={self.max_mbit:g}"] \
            if self.max_mbit else []
        identity = str(Path(self.identity).with_suffix(f".hub{slot + 1 if slot else ''}.key")) if self.identity \
            else None
        config = [*(["--config", self.config] if self.config is not None else []),
                  *(["--run-document", str(document)] if document is not None else []),
                  *[a for item in self.overrides for a in ("--set", item)]]
        return cli("node", "start", "--role", PeerRole.HUB.value, "--run-id", run_id, "--initial-peers",
                   bootstrap_address, *config,
                   *[a for m in hub_maddrs(self.host_maddrs, port) for a in ("--host-maddrs", m)],
                   *[a for m in announce for a in ("--announce-maddrs", m)],
                   *(["--identity", identity] if identity else []), "--log-dir", str(self.log_dir / run_id),
                   *[a for item in extra for a in ("--set", item)])


class HostedHub:
    """The bootstrap's hubs, one per run served, for as long as the bootstrap is up (``start``, ``stop``)."""

    def __init__(self, settings: HubSettings, loop: EventLoopThread, node: DHTNode, bootstrap_address: str,
                 out: Callable[[str], None]):
        self.settings, self.loop, self.node, self.bootstrap_address = settings, loop, node, bootstrap_address
        self.out = out
        self.stopping = threading.Event()
        self.hubs: dict[str, RunHub] = {}  # run id -> its hub, in the order they were found
        self.thread = threading.Thread(target=self._watch, name="hosted-hubs", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Ask every hub to leave, kill each after HUB_LEAVE_SECONDS, and reap them."""
        self.stopping.set()
        self.thread.join()
        for hub in self.hubs.values():
            hub.thread.join()

    def _watch(self) -> None:
        """Start a hub for each run to serve as it appears: the config's at once, else the one named or every run
        trained through this bootstrap, up to MAX_RUNS."""
        if self.settings.config is not None:
            self._serve(str(self.settings.run_id))
            return
        said = ""
        while not self.stopping.is_set():
            why = self._look()
            if why != said:
                if why:
                    self.out(why)
                said = why
            self.stopping.wait(LOOK_EVERY)

    def _look(self) -> str:
        """Start a hub for every run to serve that has none; what the hosting waits for ("" if nothing)."""
        named, trained = self.settings.run_id, self.loop.run(runs_trained(self.node))
        wanted = [run for run in trained if named in (None, run) and run not in self.hubs]
        if named is not None and named not in trained and not self.hubs:
            return f"hub: waiting for run '{shown(named)}' to train through this bootstrap"
        if named is None and not trained:
            return "hub: waiting for a run to train through this bootstrap"
        said = []
        for run in wanted:
            if not PLAIN_NAME.fullmatch(run):  # a run found in the DHT (a name given is checked at start): it names
                # the hub's log folder and goes on its argv
                said.append(f"hub: run '{shown(run)}' is not a plain name (letters, digits, '.', '_', '-'): not served")
            elif len(self.hubs) >= MAX_RUNS:
                said.append(f"hub: run '{shown(run)}' is not served: this bootstrap serves {MAX_RUNS} runs already "
                            f"({', '.join(self.hubs)}); start it with --run-id to serve one")
            else:
                try:
                    self.loop.run(find_run(self.node, run))  # its records are schema-checked from now on
                except SwarmError as e:  # its last peer left meanwhile
                    said.append(f"hub: run '{shown(run)}': waiting ({e})")
                    continue
                self._serve(run)
        return "; ".join(said)

    def _serve(self, run_id: str) -> None:
        slot = len(self.hubs)
        self.hubs[run_id] = hub = RunHub(self, run_id, slot)
        hub.thread.start()


class RunHub:
    """One run's hub child: started once the run's document is at hand, and again whenever it exits."""

    def __init__(self, host: HostedHub, run_id: str, slot: int):
        self.host, self.run_id, self.slot = host, run_id, slot
        settings = host.settings
        self.document = None if settings.config is not None else settings.log_dir / f"{run_id}.run.json"
        self.fetched = False  # the document is this bootstrap's own fetch (a file left by an earlier one is not)
        self.fingerprint = ""  # the fetched document's
        self.thread = threading.Thread(target=self._host, name=f"hub-{run_id}", daemon=True)

    def _host(self) -> None:
        pause = RESTART_PAUSES[0]
        stopping = self.host.stopping
        while self._wait_for_document():
            started = time.monotonic()
            code = self._run_child()
            if stopping.is_set():
                return
            if self.document is not None and not self.fetched:  # outvoted: the run's config is fetched again
                continue
            if code == REFUSED:
                self.host.out(f"hub: not started for run '{shown(self.run_id)}': {self._error_line()}; this peer "
                              f"goes on without a hub for it")
                return
            if time.monotonic() - started >= STEADY_SECONDS:
                pause = RESTART_PAUSES[0]
            self.host.out(f"hub: exited with code {code}: {self._error_line()}; starting it again in {pause:.0f} s")
            if stopping.wait(pause):
                return
            pause = min(2 * pause, RESTART_PAUSES[1])

    def _wait_for_document(self) -> bool:
        """Whether the hub can start (False once stopping): with a config of its own at once, else once the run's
        document is fetched (once: a hub started again serves the document it served)."""
        if self.document is None or self.fetched:
            return not self.host.stopping.is_set()
        said = ""
        while not self.host.stopping.is_set():
            why = self._fetch_document()
            if not why:
                return True
            if why != said:
                self.host.out(why)
                said = why
            self.host.stopping.wait(LOOK_EVERY)
        return False

    def _fetch_document(self) -> str:
        """Fetch the run's document into ``self.document`` through the bootstrap's own daemon; "" once it is there,
        else what the hub waits for."""
        host = self.host
        surveyed = host.loop.run(survey(host.node, self.run_id))
        try:  # by the trainers' records: a hub's, this bootstrap's own hub's among them, trains nothing
            run = host.loop.run(fetch_run_document(host.node.protocol.p2p, self.run_id, surveyed.trainers,
                                                   str(host.node.peer_id), expires_in=surveyed.expires_in))
        except ConfigUnserved as e:
            return f"hub: waiting for run '{shown(self.run_id)}''s config: {e}"
        if run is None:  # no fresh trainer's record (with a config) yet
            return f"hub: waiting for run '{shown(self.run_id)}''s first trainer"
        host.settings.log_dir.mkdir(parents=True, exist_ok=True)
        save_run_document(run, self.document)
        self.fetched, self.fingerprint = True, run.fingerprint
        host.out(f"hub: fetched run '{shown(self.run_id)}''s config {run.fingerprint}, which {run.holders} of its "
                 f"{run.peers} trainer(s) train, from {run.donor[-8:]}")
        return ""

    def _log_path(self) -> Path:
        return self.host.settings.log_dir / f"{self.run_id}.log"

    def _error_line(self) -> str:
        """What the hub said last on why it stopped (`node start`'s one-line ``error:``), or where its log is."""
        lines = self._log_path().read_text(errors="replace").splitlines()
        said = [line.removeprefix("error: ") for line in lines if line.startswith("error: ")]
        return said[-1] if said else f"see its log, {self._log_path()}"

    def _run_child(self) -> int:
        """Run the hub until it exits or the bootstrap stops; its exit code. Either way its session is ended and
        reaped (its p2p daemon too)."""
        host = self.host
        host.settings.log_dir.mkdir(parents=True, exist_ok=True)
        child = Child("hub", host.settings.argv(self.run_id, host.bootstrap_address, self.slot, self.document),
                      self._log_path(), keep_lines=False)
        host.out(f"hub: serving run '{shown(self.run_id)}' as a peer of its own, pid {child.process.pid} (its log: "
                 f"{self._log_path()})")
        checked = time.monotonic()
        while not host.stopping.is_set():
            try:
                child.process.wait(timeout=1.0)
                break
            except subprocess.TimeoutExpired:
                if self.fetched and time.monotonic() - checked >= CHECK_EVERY:
                    checked = time.monotonic()
                    if self._outvoted():
                        break
        return child.stop(HUB_LEAVE_SECONDS)

    def _outvoted(self) -> bool:
        """Whether more of the run's fresh trainers' records now carry another config than the one this hub serves:
        its document is then fetched again (the first trainers, or keys that only publish records, decide what it
        serves only while nobody outnumbers them). Said in one line."""
        surveyed = self.host.loop.run(survey(self.host.node, self.run_id))
        ranked = dict(ranked_fingerprints(surveyed.trainers, str(self.host.node.peer_id),
                                          expires_in=surveyed.expires_in))
        top = next(iter(ranked), None)
        if top is None or top == self.fingerprint or len(ranked[top]) <= len(ranked.get(self.fingerprint, ())):
            return False
        self.host.out(f"hub: {len(ranked[top])} of run '{shown(self.run_id)}''s trainers train config {top}, more than "
                      f"the {len(ranked.get(self.fingerprint, ()))} that train the one its hub serves "
                      f"({self.fingerprint}): serving theirs")
        self.fetched = False
        return True
