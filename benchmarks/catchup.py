"""Catch-up time: how long a peer joining a run takes to download and verify the swarm's state.

Donor processes (real hivemind peers on loopback, one p2p daemon each) publish a peer record and
serve the snapshot a round starts from: global parameters plus the outer state all peers share.
This process joins the same DHT and fetches it exactly as a joining node does (``fetch_state``:
4 MiB ranges spread over all donors, blob checksum and parameter hash verified). The first fetch
includes the donors serializing their snapshot on first request; later fetches find it cached.

    python benchmarks/catchup.py                                   # tiny and ~150M, 1 and 3 donors
    python benchmarks/catchup.py --config configs/tiny.yaml --donors 1 2 --repeats 5
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from multiprocessing.connection import Connection

import torch

from p2ploco.build import build_stage
from p2ploco.config import load_config
from p2ploco.metrics import format_table
from p2ploco.slices import slice_name
from p2ploco.swarm.records import PeerState
from p2ploco.swarm.runtime import Swarm
from p2ploco.swarm.state import Snapshot

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
        swarm.announce_progress(ROUND, PeerState.TRAINING, snapshot.state_digest, {SLICE: snapshot.state_digest})
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", nargs="+", default=["configs/tiny.yaml", "configs/150m.yaml"])
    parser.add_argument("--donors", nargs="+", type=int, default=[1, 3])
    parser.add_argument("--repeats", type=int, default=3, help="fetches per setting (the first is cold)")
    args = parser.parse_args()
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
