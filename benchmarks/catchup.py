"""Catch-up time: how long a peer joining a run takes to download and verify the swarm's state.

Donor processes (real hivemind peers on loopback, one p2p daemon each) publish a peer record and
serve the snapshot a round starts from: global parameters plus the outer state all peers share.
This process joins the same DHT and fetches it exactly as a joining node does (``fetch_state``:
4 MiB ranges spread over all donors, blob checksum and parameter hash verified). The first fetch
includes the donors serializing their snapshot on first request; later fetches find it cached.

    python benchmarks/catchup.py                                   # tiny and ~150M, 1 and 3 donors
    python benchmarks/catchup.py --config configs/tiny.yaml --donors 1 2 --repeats 5

``--updates``: what a peer that missed 1, 3 and 10 rounds fetches, the rounds' updates (``swarm/updates.py``)
against the state, at the config's shapes. Two replicas of the config's model run real SparseLoCo outer rounds in
this process (compression, error feedback, resparsified all-reduce, outer step), on random pseudo-gradients: each
replica picks its top-k apart from the other's, so the aggregate's support (and the update) is as large as it gets
for two peers; real pseudo-gradients of one data distribution overlap more. Each update is kept (diffed) as a peer
keeps it; each chain is applied to the state the peer held and checked against the swarm's digest.

    python benchmarks/catchup.py --updates --config configs/150m.yaml --missed 1 3 10 [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import threading
import time
from multiprocessing.connection import Connection

import torch

from p2ploco.build import build_stage
from p2ploco.config import load_config
from p2ploco.metrics import format_table, human_bytes
from p2ploco.outer import build_outer
from p2ploco.peer import Swarm
from p2ploco.slices import slice_name
from p2ploco.swarm.records import Phase
from p2ploco.swarm.state import Snapshot
from p2ploco.swarm.updates import KEEP_SHARE, Update, applied, changes_of, named_tensors
from p2ploco.testing.communicator import InProcessGroup

RUN_ID = "catchup-benchmark"
SLICE = slice_name(0)  # a whole-model run has one slice
ROUND = 7
STARTUP_TIMEOUT = 120.0


def snapshot_of(config_path: str) -> Snapshot:
    """The state a round of ``config_path``'s run starts from, as every donor would serve it (``Worker.snapshots``;
    stage 0 of a one-stage model is the whole model, and needs no training data)."""
    worker, _ = build_stage(load_config(config_path), torch.device("cpu"), 0)
    (snapshot,) = worker.snapshots(ROUND)
    return snapshot


def donor(config_path: str, initial_peers: list[str], pipe: Connection) -> None:
    """A peer that serves the snapshot until the benchmark closes its pipe."""
    config = load_config(config_path)
    snapshot = snapshot_of(config_path)
    swarm = Swarm.join(RUN_ID, config.swarm, config.run_document(), initial_peers)
    try:
        swarm.serve_state([snapshot])
        swarm.announce_progress(ROUND, Phase.TRAINING, snapshot.state_digest, {SLICE: snapshot.state_digest})
        swarm.flush()  # the record goes out in the background: the joiner looks for it at once
        pipe.send(snapshot.state_digest)
        pipe.recv()  # returns or raises EOFError when the benchmark is done
    except EOFError:
        pass
    finally:
        swarm.leave()


def measure(config_path: str, donors: int, repeats: int) -> tuple[int, int, list[float]]:
    """Parameters, state bytes and the seconds of each fetch of ``config_path``'s state from ``donors`` peers."""
    config = load_config(config_path)
    joiner = Swarm.join(RUN_ID, config.swarm, config.run_document())
    context = multiprocessing.get_context("spawn")  # donors get their own daemon and event loop
    processes, pipes = [], []
    try:
        for _ in range(donors):
            here, there = context.Pipe()
            process = context.Process(target=donor, args=(config_path, joiner.addresses(), there), daemon=True)
            process.start()
            processes.append(process)
            pipes.append(here)
        expected = {pipe.recv() if pipe.poll(STARTUP_TIMEOUT) else None for pipe in pipes}
        if None in expected or len(expected) != 1:
            raise RuntimeError("donors did not start, or hold different states")
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while (target := joiner.swarm_state(0, {SLICE: ""}).get(SLICE)) is None or len(target.holders) < donors:
            if time.monotonic() > deadline:
                raise RuntimeError("the donors' records did not appear in the DHT")
            time.sleep(0.2)  # records propagate through the DHT: poll until all are visible
        own = snapshot_of(config_path)
        tensors = sum(t.numel() * t.element_size() for t in [*own.params.values(), *own.shared.values()])
        seconds = []
        for _ in range(repeats):
            started = time.perf_counter()
            snapshot = joiner.fetch_state(target, tensors)
            seconds.append(time.perf_counter() - started)
        state_bytes = snapshot.blob().total
        parameters = sum(t.numel() for t in snapshot.params.values())
        return parameters, state_bytes, seconds
    finally:
        for pipe in pipes:
            pipe.close()
        for process in processes:
            process.join(30)
            if process.is_alive():
                process.kill()
                process.join()
        joiner.leave()


def measure_updates(config_path: str, missed: list[int], log) -> list[dict]:
    """Run ``max(missed)`` SparseLoCo rounds of two replicas of ``config_path``'s model; for each count in
    ``missed``, the bytes of that many rounds' updates against the state's, whether peers keep them, and the
    seconds to apply them and check the digest."""
    config = load_config(config_path, ["outer.algorithm=sparseloco"])
    worker, _ = build_stage(config, torch.device("cpu"), 0)
    other = build_outer(config.outer, worker.outer.params, torch.device("cpu"), worker.slices,
                        config.max_contribution_tokens)
    replicas, group, generator = [worker.outer, other], InProcessGroup(2), torch.Generator().manual_seed(0)
    (state,) = worker.snapshots(0)
    state_bytes = state.blob().total
    tensor_bytes = sum(t.numel() * t.element_size() for t in named_tensors(state).values())
    parameters = sum(t.numel() for t in state.params.values())
    log(f"{config_path}: {parameters / 1e6:.1f}M parameters, a state of {human_bytes(state_bytes)}; "
        f"{max(missed)} SparseLoCo rounds of 2 replicas")
    held = {max(missed) - k: None for k in missed}  # the state a peer that missed k rounds holds: round R - k
    updates, keep_seconds = [], []
    for r in range(max(missed)):
        if r in held:
            held[r] = state
        trained = [[p - torch.randn(p.shape, generator=generator) * 1e-3 for p in outer.params] for outer in replicas]
        synced = [None, None]

        def sync(rank: int, trained: list[torch.Tensor], synced: list, round_index: int) -> None:
            synced[rank] = replicas[rank].sync(trained, group.communicator(rank), round_index)

        threads = [threading.Thread(target=sync, args=(rank, trained[rank], synced, r)) for rank in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if not all(s is not None and s.applied for s in synced) or not all(
                torch.equal(a, b) for a, b in zip(worker.outer.params, other.params)):
            raise RuntimeError(f"round {r} was not applied alike by both replicas")
        worker.refresh_published()
        (after,) = worker.snapshots(r + 1)
        started = time.perf_counter()
        update = Update.between(state, after, 2 * tensor_bytes)
        keep_seconds.append(time.perf_counter() - started)
        updates.append(update)
        log(f"  round {r}: update {human_bytes(update.blob.total)} ({update.blob.total / state_bytes:.1%} of the "
            f"state), diffed in {keep_seconds[-1]:.2f} s")
        state = after
    shapes = {name: t.shape for name, t in named_tensors(state).items()}
    rows = []
    for k in missed:
        chain = updates[len(updates) - k:]
        chain_bytes = sum(u.blob.total for u in chain)
        started = time.perf_counter()
        result = applied(held[max(missed) - k], [changes_of(u.blob.data, shapes) for u in chain], state.round)
        seconds = time.perf_counter() - started
        if result.state_digest != state.state_digest:
            raise RuntimeError(f"{k} updates applied do not give the swarm's state")
        rows.append({"config": config_path, "parameters": parameters, "missed_rounds": k, "update_bytes": chain_bytes,
                     "state_bytes": state_bytes, "share": chain_bytes / state_bytes,
                     "kept": chain_bytes <= tensor_bytes // KEEP_SHARE,
                     "fetched": "updates" if chain_bytes <= tensor_bytes // KEEP_SHARE else "state",
                     "fetched_bytes": chain_bytes if chain_bytes <= tensor_bytes // KEEP_SHARE else state_bytes,
                     "apply_and_check_seconds": seconds,
                     "keep_seconds_per_round": statistics.median(keep_seconds)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", nargs="+", default=["configs/tiny.yaml", "configs/150m.yaml"])
    parser.add_argument("--donors", nargs="+", type=int, default=[1, 3])
    parser.add_argument("--repeats", type=int, default=3, help="fetches per setting (the first is cold)")
    parser.add_argument("--updates", action="store_true",
                        help="the bytes of the rounds' updates a peer that missed --missed rounds fetches, against "
                             "the state's (no network)")
    parser.add_argument("--missed", nargs="+", type=int, default=[1, 3, 10])
    parser.add_argument("--json", action="store_true", help="with --updates: one JSON object per row, and nothing else")
    args = parser.parse_args()
    if args.updates:
        if min(args.missed) < 1:
            parser.error("--missed counts rounds: 1 or more")
        log = (lambda *a, **k: None) if args.json else print  # noqa: E731 (the JSON alone on stdout)
        rows = [row for config_path in args.config for row in measure_updates(config_path, sorted(set(args.missed)),
                                                                               log)]
        if args.json:
            for row in rows:
                print(json.dumps(row))
            return
        print(f"\nCatch-up by the rounds' updates (SparseLoCo, 2 replicas, random pseudo-gradients); peers keep "
              f"updates up to 1/{KEEP_SHARE} of the state")
        print(format_table(("config", "missed", "updates", "state", "updates/state", "kept by peers", "fetched",
                            "apply+check s"),
                           [(r["config"], r["missed_rounds"], human_bytes(r["update_bytes"]),
                             human_bytes(r["state_bytes"]), f"{r['share']:.1%}", "yes" if r["kept"] else "no",
                             f"{r['fetched']} ({human_bytes(r['fetched_bytes'])})",
                             f"{r['apply_and_check_seconds']:.2f}") for r in rows]))
        print("keeping an update (diffing two states), median a round: "
              + ", ".join(f"{r['config']} {r['keep_seconds_per_round']:.2f} s" for r in rows[::len(args.missed)]))
        return
    torch.set_num_threads(1)  # leave the cores to the daemons that move the bytes

    rows = []
    for config_path in args.config:
        for donors in args.donors:
            parameters, state_bytes, seconds = measure(config_path, donors, args.repeats)
            warm = statistics.median(seconds[1:]) if len(seconds) > 1 else seconds[0]
            rows.append((config_path, f"{parameters / 1e6:.1f}M", f"{state_bytes / 1e6:.1f} MB", donors,
                         f"{seconds[0]:.2f}", f"{warm:.2f}", f"{state_bytes / warm / 1e6:.0f} MB/s"))
            print(f"{config_path}, {donors} donor(s): fetches {', '.join(f'{s:.2f}' for s in seconds)} s", flush=True)
    print("\nCatch-up: download and verify the swarm's state on loopback")
    print(format_table(("config", "params", "state", "donors", "first s", "warm s (median)", "throughput"), rows))


if __name__ == "__main__":
    main()
