"""A node's resident memory over a whole run, per phase, in bytes per parameter: real nodes on loopback.

    python benchmarks/memory.py                               # the 21.4M setting, then configs/150m.yaml
    python benchmarks/memory.py --size 150m --replicas 2      # two trainers and a joiner at 150M
    python benchmarks/memory.py --size 150m --replicas 1 --no-joiner --json

``p2ploco demo``'s local swarm (a bootstrap peer and ``p2ploco node start`` processes) trains with short steps
(2 inner steps of 1 x 128 tokens) and a checkpoint every ``--checkpoint-every`` rounds: ``--replicas`` trainers
start together, and once they have trained ``--join-after`` rounds a joiner starts, catches up from them (it
fetches the state they serve) and trains with them to the last round; every node then writes its exit checkpoint
and leaves. Every ``--interval`` seconds this process reads each node's resident memory (``/proc/<pid>/status``:
VmRSS, and VmHWM, the kernel's own peak, which a peak between two samples raises) and its p2p daemon's (the
node's child process ``p2pd``), and puts the sample in the phase the node is in by what it has printed (and,
for a periodic checkpoint, written):

- ``start-up``: from its start to "starting" (a joiner: to its catch-up line, "...; fetching the state" or "...;
  fetching N rounds' updates": a joiner whose state is the run's first can catch up by the rounds' updates);
- ``catching up``: a joiner from that line to "caught up to round";
- ``serving state``: a trainer while a joiner catches up from it;
- ``rounds``: training rounds;
- ``checkpoint``: from the round line of a round that ends with a periodic checkpoint to the checkpoint's list
  being rewritten (the save runs beside the next round's inner steps);
- ``exit``: from its last round line to its exit (the exit checkpoint, leaving).

A phase's peak is the largest resident size sampled in it, or VmHWM where the kernel's peak rose during it (a
peak shorter than the interval). It prints, per node and per phase, the peak in GB and in bytes per parameter
(the node's own process; its daemon in a column of its own), and each process's exit code. The floor in fp32 on
a CPU is 24 bytes a parameter (``p2ploco/host_memory.py``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from p2ploco.config import load_config
from p2ploco.demo import scratch_folder
from p2ploco.launch import REPO_ROOT, TINY_CONFIG, Child, LocalSwarm
from p2ploco.metrics import format_table
from p2ploco.model import parameter_count

SHORT_STEPS = ["inner.steps=2", "data.seq_len=128", "inner.batch_size=1", "inner.grad_accum=1"]
SIZES = {  # the 21.4M setting of issues 12 and 20 (benchmarks/utilisation.py), and the 150M config
    "21m": (TINY_CONFIG, ["model.d_model=768", "model.n_layer=3", "model.n_head=12"]),
    "150m": (REPO_ROOT / "configs" / "150m.yaml", []),
}
PHASES = ("start-up", "catching up", "serving state", "rounds", "checkpoint", "exit")
ROUND_LINE = re.compile(r"\] round +(\d+) \|")
FETCHING = re.compile(r"\(this peer: \d+\); fetching ")
CAUGHT_UP = re.compile(r"caught up to round|could not catch up")
STARTED = re.compile(r"starting$|caught up to round")


def status_kb(pid: int) -> tuple[int, int] | None:
    """(VmRSS, VmHWM) of ``pid`` in kB; None once it has exited."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    try:
        return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])
    except (KeyError, ValueError):  # a zombie has no memory lines
        return None


def children_of(pid: int) -> list[int]:
    """The child processes of ``pid``, started by any of its threads."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # the thread has ended
            continue
    return found


@dataclass
class Watched:
    """One node process: its phase (from its output), and the peak resident bytes seen in each phase."""

    name: str
    child: Child
    rounds: int  # its last round is rounds - 1
    checkpoint_every: int
    joiner: bool = False
    peaks: dict[str, int] = field(default_factory=dict)  # phase -> peak bytes of the node's own process
    daemon_peak: int = 0
    hwm: int = 0
    phase: str = "start-up"
    saving_since: float | None = None  # a periodic checkpoint's round line: its save is under way

    def log_lines(self) -> list[str]:
        return self.child.log_path.read_text(errors="replace").splitlines()

    def update_phase(self, lines: list[str], joiners_catching_up: bool) -> None:
        fetching = any(FETCHING.search(line) for line in lines)
        round_lines = [int(m.group(1)) for line in lines if (m := ROUND_LINE.search(line))]
        if round_lines and round_lines[-1] >= self.rounds - 1:
            self.phase = "exit"
            return
        if self.joiner and fetching and not any(CAUGHT_UP.search(line) for line in lines):
            self.phase = "catching up"
            return
        if not round_lines and not any(STARTED.search(line) for line in lines):
            self.phase = "start-up"
            return
        pointer = self.child.metrics_dir / "checkpoint" / "checkpoint.json"
        if round_lines and self.checkpoint_every and (round_lines[-1] + 1) % self.checkpoint_every == 0:
            written = pointer.stat().st_mtime if pointer.exists() else 0.0
            if self.saving_since is None:
                self.saving_since = time.time()
            if written < self.saving_since:
                self.phase = "checkpoint"
                return
        else:
            self.saving_since = None
        self.phase = "serving state" if joiners_catching_up and not self.joiner else "rounds"

    def sample(self) -> None:
        own = status_kb(self.child.process.pid)
        if own is None:
            return
        rss, hwm = own[0] * 1024, own[1] * 1024
        peak = max(rss, hwm if hwm > self.hwm else 0)
        self.hwm = max(self.hwm, hwm)
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), peak)
        for pid in children_of(self.child.process.pid):
            daemon = status_kb(pid)
            if daemon is not None:
                self.daemon_peak = max(self.daemon_peak, daemon[1] * 1024)


def measure(size: str, replicas: int, joiner: bool, rounds: int, join_after: int, checkpoint_every: int,
            interval: float, overrides: list[str], log) -> dict:
    config, setting = SIZES[size]
    settings = [*setting, *SHORT_STEPS, f"training.checkpoint_every={checkpoint_every}", *overrides]
    parameters = parameter_count(load_config(config, settings).model)
    log(f"{size}: {parameters / 1e6:.1f}M parameters, {replicas} trainer(s)"
        + (f" and a joiner after round {join_after}" if joiner else "") + f", {rounds} rounds")
    common = ["--max-rounds", str(rounds), *(arg for item in settings for arg in ("--set", item))]
    with scratch_folder("p2ploco-memory-") as workdir:
        with LocalSwarm(workdir) as swarm:
            watched = [Watched(f"node{i}", swarm.start_node(f"node{i}", config, *common, "--set",
                                                            f"swarm.min_peers={replicas}"), rounds, checkpoint_every)
                       for i in range(replicas)]
            done = threading.Event()

            def sample_all() -> None:
                while not done.is_set():
                    catching_up = any(w.joiner and w.phase == "catching up" for w in watched)
                    for w in watched:
                        if w.child.process.poll() is None:
                            w.update_phase(w.log_lines(), catching_up)
                            w.sample()
                    time.sleep(interval)

            sampler = threading.Thread(target=sample_all, daemon=True)
            sampler.start()
            try:
                if joiner:
                    while not all(any(int(m.group(1)) >= join_after - 1 for line in w.log_lines()
                                      if (m := ROUND_LINE.search(line))) for w in watched):
                        if any(w.child.process.poll() is not None for w in watched):
                            break
                        time.sleep(interval)
                    watched.append(Watched("joiner", swarm.start_node("joiner", config, *common), rounds,
                                           checkpoint_every, joiner=True))
                for w in watched:
                    w.child.process.wait()
            finally:
                done.set()
                sampler.join()
            codes = {w.name: w.child.process.returncode for w in watched}
        rows = [{"node": w.name, "role": "joiner" if w.joiner else "trainer", "exit_code": codes[w.name],
                 "peak_bytes": {phase: w.peaks[phase] for phase in PHASES if phase in w.peaks},
                 "peak_hwm_bytes": w.hwm, "daemon_peak_bytes": w.daemon_peak,
                 "rounds": sum(1 for line in w.log_lines() if ROUND_LINE.search(line))} for w in watched]
        if any(code != 0 for code in codes.values()):
            log(f"a node exited nonzero: {codes}; its logs stay in {workdir}")
            raise SystemExit(1) from None  # kept: scratch_folder keeps the folder when its block raises
    return {"size": size, "parameters": parameters, "replicas": replicas, "joiner": joiner, "rounds": rounds,
            "nodes": rows, "all_exited_0": all(code == 0 for code in codes.values())}


def table(result: dict) -> str:
    n = result["parameters"]
    rows = []
    for node in result["nodes"]:
        cells = [f"{node['peak_bytes'][p] / 1e9:.2f} ({node['peak_bytes'][p] / n:.0f})" if p in node["peak_bytes"]
                 else "-" for p in PHASES]
        rows.append((node["node"], node["role"], node["rounds"], *cells,
                     f"{node['peak_hwm_bytes'] / 1e9:.2f} ({node['peak_hwm_bytes'] / n:.0f})",
                     f"{node['daemon_peak_bytes'] / 1e9:.2f}", node["exit_code"]))
    return format_table(("node", "role", "rounds", *PHASES, "VmHWM", "p2pd GB", "exit"), rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", nargs="+", default=["21m", "150m"], choices=sorted(SIZES))
    parser.add_argument("--replicas", type=int, default=2, help="trainers that start together")
    parser.add_argument("--no-joiner", dest="joiner", action="store_false", help="no node joins late")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--join-after", type=int, default=2, help="rounds the trainers train before the joiner starts")
    parser.add_argument("--checkpoint-every", type=int, default=2)
    parser.add_argument("--interval", type=float, default=0.1, help="seconds between samples")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--json", action="store_true", help="print the results as JSON (progress on stderr)")
    args = parser.parse_args()
    if args.joiner and not 0 < args.join_after < args.rounds - 1:
        raise SystemExit("--join-after must leave the joiner at least two rounds: 0 < --join-after < --rounds - 1")

    def log(line: str) -> None:
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    results = [measure(size, args.replicas, args.joiner, args.rounds, args.join_after, args.checkpoint_every,
                       args.interval, args.overrides, log) for size in args.size]
    if args.json:
        print(json.dumps(results, indent=1))
        return
    for result in results:
        print()
        print(f"{result['size']} ({result['parameters'] / 1e6:.1f}M params): peak resident memory per phase, GB "
              f"(bytes/param); floor 24 B/param in fp32 on a CPU")
        print(table(result))
        print(f"every process exited 0: {'yes' if result['all_exited_0'] else 'NO'}")


if __name__ == "__main__":
    main()
