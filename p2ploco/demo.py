"""``p2ploco demo``: the main job on one machine, a local swarm training together on loopback."""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from p2ploco.launch import LocalSwarm
from p2ploco.metrics import format_table, human_bytes
from p2ploco.swarm.records import PeerRole

POLL_SECONDS = 0.5  # how often the demo looks at the nodes' metrics files to print progress
SAMPLE_TOKENS = 80  # tokens of the sample that ends the demo
DASHBOARD_AT = re.compile(r"dashboard at (http://\S+)")  # what a node prints once it serves its status port
STARTUP_SECONDS = 120.0  # for a node to start and print it


def run_demo(replicas: int, pipelines: int, stages: int, rounds: int, config: Path, workdir: Path,
             overrides: Sequence[str] = (), out: Callable[[str], None] = print, ranks: int = 1,
             status_port: int | None = None, scratch: bool = False) -> bool:
    """Run the swarm to completion, printing a line per round and a summary; True if all went well.
    ``pipelines`` pipelines get one stage peer per stage (pinned, so the run is the same every time).
    ``overrides`` (``key=value``) go to every node as ``--set``. ``ranks``: node0 trains on that many local ranks
    (``p2ploco.ranks``), and the run counts them all (``training.max_ranks``). ``status_port``: the first node serves
    its status and the dashboard there, on loopback (0: a port the OS picks; None: not served). ``scratch``: ``workdir``
    is a benchmark's ``scratch_folder``, removed once read if the run went well."""
    members = _members(replicas, pipelines, stages, ranks, status_port)
    if ranks > 1:
        overrides = [f"training.max_ranks={ranks}", *overrides]
    what = (f"{replicas} full replica(s)" + (f" (node0 on {ranks} local ranks)" if ranks > 1 else "")
            + (f" and {pipelines} pipeline(s) of {stages} stages" if pipelines else ""))
    out(f"p2ploco demo: a bootstrap peer, {what} on loopback, {rounds} rounds of {config.name}")
    out(f"logs and metrics: {workdir}")
    started = time.monotonic()
    names = [name for name, _ in members]
    with LocalSwarm(workdir) as swarm:
        out(f"bootstrap peer: {swarm.bootstrap_address}")
        for name, role in members:
            swarm.start_node(name, config, *role, "--max-rounds", str(rounds), "--set", f"swarm.min_peers={len(names)}",
                             *(arg for item in overrides for arg in ("--set", item)))
        if status_port is not None:  # printed before the node joins: a port that is taken ends it at once
            url = swarm.nodes[names[0]].wait_for_line(DASHBOARD_AT, STARTUP_SECONDS).group(1)
            out(f"dashboard: {url} (open it in a browser: it draws the run as it trains, until the demo ends)")
        codes = _watch(swarm, names, out)
    summaries = {n: swarm.summaries(n) for n in names}
    out(_summary(summaries, time.monotonic() - started))
    ok = _report(summaries, codes, rounds, workdir, scratch, out)
    if ok:
        # A replica's final checkpoint, or the stages' of the first pipeline: the model the swarm trained.
        sources = [workdir / "node0"] if replicas else [workdir / f"g0s{s}" for s in range(stages)]
        out(_sample(sources))
    return ok


def _members(replicas: int, pipelines: int, stages: int, ranks: int, status_port: int | None
             ) -> list[tuple[str, tuple[str, ...]]]:
    """Each node of the demo and its arguments: the replicas, then one stage peer per stage of each pipeline; the
    first of them serves the status port, if asked."""
    serves = ("--status-port", str(status_port)) if status_port is not None else ()  # the first node started
    members = [("node0", (("--nproc-per-node", str(ranks)) if ranks > 1 else ()) + serves)] if replicas else []
    members += [(f"node{i}", ()) for i in range(1, replicas)]
    members += [(f"g{g}s{s}", ("--role", PeerRole.STAGE.value, "--group", f"g{g}", "--stage", str(s))
                 + (serves if not replicas and g == s == 0 else ()))
                for g in range(pipelines) for s in range(stages)]
    return members


def _watch(swarm: LocalSwarm, names: list[str], out: Callable[[str], None]) -> dict[str, int]:
    """A line per round as every node has recorded it, until every node has exited; their exit codes."""
    shown = 0
    while True:
        done = all(swarm.nodes[n].process.poll() is not None for n in names)
        summaries = {n: swarm.summaries(n) for n in names}
        while all(any(r["round"] == shown for r in summaries[n]) for n in names):
            out(_round_line(shown, [r for n in names for r in summaries[n] if r["round"] == shown]))
            shown += 1
        if done:
            return {n: swarm.nodes[n].process.returncode for n in names}
        time.sleep(POLL_SECONDS)


def _report(summaries: dict[str, list[dict]], codes: dict[str, int], rounds: int, workdir: Path, scratch: bool,
            out: Callable[[str], None]) -> bool:
    """What failed, whether every holder of each slice agreed after every round, and where the files are; True if
    every node exited 0, agreed, and recorded every round."""
    failed = [n for n, code in codes.items() if code != 0]
    for name in failed:
        log = workdir / (name + ".log")
        errors = [line for line in log.read_text().splitlines() if line.startswith("error: ")]
        out(f"FAILED: {name} {how_it_ended(codes[name])}{f' ({errors[-1]})' if errors else ''}; its log: {log}")
    agreement = slices_agree(summaries)
    for slice_name, agree in agreement.items():
        holders = sum(any(slice_name in r["slice_digest"] for r in rs) for rs in summaries.values())
        which = f"all {holders} nodes" if len(agreement) == 1 else f"all {holders} holders of {slice_name}"
        out(f"identical global parameters on {which} after every round: {'yes' if agree else 'NO'}")
    ok = not failed and all(agreement.values()) and all(len(r) == rounds for r in summaries.values())
    size = sum(path.stat().st_size for path in workdir.rglob("*") if path.is_file())
    fate = "removed once the benchmark has read it" if scratch and ok else "it stays until you delete it"
    out(f"logs, metrics and checkpoints: {workdir} ({human_bytes(size)}; {fate})")
    if failed:
        out(f"demo FAILED: {'; '.join(f'{name} {how_it_ended(codes[name])}' for name in failed)}")
    return ok


def how_it_ended(code: int) -> str:
    """A node's nonzero exit status in words: its code, or the signal that killed it."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = f"signal {-code}"
    why = " (the kernel's out-of-memory killer sends it: see dmesg)" if -code == signal.SIGKILL else ""
    return f"was killed by {name}{why}"


@contextlib.contextmanager
def scratch_folder(prefix: str) -> Iterator[Path]:
    """A new folder for a benchmark's run (``run_demo(..., scratch=True)``): removed when the block ends, kept
    when it raises, as a benchmark does for a run that failed (its logs are what to read then)."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    yield folder
    shutil.rmtree(folder)


def _sample(log_dirs: list[Path]) -> str:
    """A short sample from the final checkpoint, and the command that draws more."""
    from p2ploco.sample import sample_checkpoints

    folders = [folder / "checkpoint" for folder in log_dirs]
    text = sample_checkpoints(folders, "", SAMPLE_TOKENS)
    shown = "\n".join("  | " + line for line in text.splitlines() or [""])
    return (f"sample from the final checkpoint (more: p2ploco sample {' '.join(map(str, folders))} --prompt TEXT; "
            f"for transformers: p2ploco export ... --out DIR):\n{shown}")


def _round_line(round_index: int, summaries: list[dict]) -> str:
    def mean(key: str) -> float:
        return sum(r[key] for r in summaries) / len(summaries)

    evals = [r["eval_loss"] for r in summaries if r["eval_loss"] is not None]
    sync_sizes = sorted({r["peers"] for r in summaries})
    identical = all(slices_agree({"round": summaries}).values())
    return (f"round {round_index:>3} | peers {'/'.join(map(str, sync_sizes))} | loss {mean('loss'):.3f} | "
            f"eval {f'{evals[0]:.3f}' if evals else '-'} | "
            f"traffic/node {human_bytes(mean('bytes_sent') + mean('bytes_received'))} | "
            f"inner {mean('inner_seconds'):.1f}s comm {mean('comm_seconds'):.1f}s "
            f"util {mean('compute_utilisation'):.2f} | "
            f"params {'identical' if identical else 'DIFFER'}")


def slices_agree(summaries: dict[str, list[dict]]) -> dict[str, bool]:
    """For each slice, whether every node that applied a round holds the same parameters of it after that round."""
    seen: dict[tuple[str, int], set[str]] = {}
    for node_summaries in summaries.values():
        for r in node_summaries:
            if not r["applied"]:
                continue
            for slice_name, digest in r["slice_digest"].items():
                seen.setdefault((slice_name, r["round"]), set()).add(digest)
    names = sorted({slice_name for slice_name, _ in seen})
    return {name: all(len(d) == 1 for (n, _), d in seen.items() if n == name) for name in names}


def _summary(summaries: dict[str, list[dict]], seconds: float) -> str:
    rows = []
    for name, rs in summaries.items():
        evals = [r["eval_loss"] for r in rs if r["eval_loss"] is not None]

        def per_round(key: str, rs: list[dict] = rs) -> float:
            return sum(r[key] for r in rs) / max(len(rs), 1)

        traffic = per_round("bytes_sent") + per_round("bytes_received")
        rows.append((
            name, rs[-1]["role"] if rs else "-", len(rs), f"{per_round('tokens'):,.0f}",
            f"{evals[0]:.3f} -> {evals[-1]:.3f}" if evals else "-",
            human_bytes(traffic), human_bytes(per_round("peak_sync_bytes")), human_bytes(per_round("dense_fp32_bytes")),
            f"{per_round('dense_fp32_bytes') / traffic:.0f}x" if traffic else "-",
            f"{per_round('bits_per_param'):.3f}",
            human_bytes(per_round("boundary_bytes_sent") + per_round("boundary_bytes_received"))
            if rs and rs[-1]["role"] == PeerRole.STAGE else "-",
            f"{per_round('inner_seconds'):.1f}", f"{per_round('comm_seconds'):.2f}",
            f"{per_round('round_seconds'):.1f}", f"{per_round('compute_utilisation'):.2f}",
        ))
    table = format_table(("node", "role", "rounds", "tokens/round", "eval loss first -> last", "bytes/round",
                          "peak/sync", "dense fp32/round", "saving", "upload bits/param", "boundary/round",
                          "inner s/round", "comm s/round", "round s", "utilisation"), rows)
    return f"{table}\nwall time {seconds:.1f} s"
