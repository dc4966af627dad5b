"""Set-ups several test modules share: in-process outer-algorithm replicas, and swarms of real peers."""

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hivemind.p2p import PeerID

from p2ploco import PROTOCOL_VERSION
from p2ploco.collective.dense import DenseMean
from p2ploco.config import Config, OuterConfig, SwarmConfig, load_config
from p2ploco.data import ShardSampler
from p2ploco.metrics import state_digest
from p2ploco.outer import build_outer
from p2ploco.peer import Swarm
from p2ploco.swarm.identity import new_key_file
from p2ploco.swarm.state import Snapshot
from p2ploco.sync.join import best_coordinator
from p2ploco.testing.communicator import InProcessGroup

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
CPU = torch.device("cpu")
TOKENS = (np.arange(50_000) * 7919 % 257).astype(np.uint16)


def small_config(*overrides: str) -> Config:
    """tiny-pipeline.yaml shrunk for exactness tests: 4 layers of d = 64, 3 micro-batches of 2 x 16 tokens,
    an active gradient clip and a float32 wire."""
    return load_config("configs/tiny-pipeline.yaml", ["model.d_model=64", "model.n_head=4", "model.max_seq_len=32",
                                                      "data.seq_len=16", "inner.batch_size=2", "inner.grad_accum=3",
                                                      "inner.grad_clip=0.05", "pipeline.wire_dtype=float32",
                                                      *overrides])


def sampler(config: Config) -> ShardSampler:
    """The same batches for every caller: a group's first stage and the unsplit model it is compared with."""
    return ShardSampler(TOKENS, config.data.seq_len, config.inner.batch_size, "run", "group-0")


def run_outer_replicas(outer: OuterConfig, shapes, replicas: int, rounds: int, noise: float, seed: int = 0,
                       slices: dict[str, list[int]] | None = None):
    """K replicas of one outer algorithm in threads over the in-process communicator; in each round every
    replica's local params are the initial ones moved by ``noise`` times a Gaussian direction all replicas of the
    round share plus one of their own, as honest replicas' progress does (the outer algorithms' defences leave
    such contributions untouched). ``slices``: the parameters as named slices (default: one)."""
    generator = torch.Generator().manual_seed(seed)
    initial = [torch.randn(s, generator=generator) for s in shapes]
    locals_per_round = []
    for _ in range(rounds):  # round by round, so that a longer run begins with a shorter one's rounds
        shared = [torch.randn(p.shape, generator=generator) for p in initial]
        locals_per_round.append([[p + noise * (direction + torch.randn(p.shape, generator=generator))
                                  for p, direction in zip(initial, shared)] for _ in range(replicas)])
    group = InProcessGroup(replicas, timeout=60)
    algorithms = [build_outer(outer, initial, slices=slices) for _ in range(replicas)]
    stats = [[] for _ in range(replicas)]

    def replica(rank: int) -> None:
        for r in range(rounds):
            stats[rank].append(algorithms[rank].sync(locals_per_round[r][rank], group.communicator(rank), r))

    threads = [threading.Thread(target=replica, args=(rank,)) for rank in range(replicas)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return initial, locals_per_round, algorithms, stats


def run_document(name: str = "cfg") -> dict[str, Any]:
    """A run document (``Config.run_document``) told apart by ``name``: for swarms that train no model."""
    return {"settings": {}, "round_tokens": 1, "data": name, "protocol": PROTOCOL_VERSION}


def join_swarms(run_id: str, count: int, config: SwarmConfig, swarms: list[Swarm]) -> list[Swarm]:
    """``count`` real peers of ``run_id`` on loopback, the first bootstrapping the others. They are added to
    ``swarms`` as they start, so the caller's ``finally`` can make every one of them leave."""
    swarms.append(Swarm.join(run_id, config, run_document(), host_maddrs=LOOPBACK))
    for _ in range(count - 1):
        swarms.append(Swarm.join(run_id, config, run_document(), initial_peers=swarms[0].addresses(),
                                 host_maddrs=LOOPBACK))
    return swarms


def ground(workdir: Path, names: str, wanted: Callable[[dict[str, str]], bool]) -> dict[str, str]:
    """Identity files ``workdir/NAME.key`` for nodes ``names``, drawn until their peer ids (by name) make
    ``wanted`` true; those peer ids. The coordinator of a round follows from the round index and the peers' ids
    alone, so a test picks the rounds a peer coordinates, as an attacker grinding keys offline would."""
    while True:
        keys = {name: new_key_file() for name in names}
        peer_ids = {name: PeerID.from_identity(key).to_base58() for name, key in keys.items()}
        if wanted(peer_ids):
            break
    for name, key in keys.items():
        (workdir / f"{name}.key").write_bytes(key)
    return peer_ids


def coordinated_by(peer_ids: dict[str, str], name: str, rounds: range) -> list[int]:
    """The rounds among ``rounds`` that node ``name`` coordinates while all of ``peer_ids`` are live."""
    return [r for r in rounds if best_coordinator(set(peer_ids.values()), r) == peer_ids[name]]


def in_process_mean(tensor_lists: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The mean of ``tensor_lists`` (one list per replica) as an in-process group of dense replicas reduces it: the
    reference a group over hivemind must match bit for bit."""
    group = InProcessGroup(len(tensor_lists))
    exchanges = [DenseMean(t) for t in tensor_lists]
    with ThreadPoolExecutor(len(exchanges)) as pool:
        list(pool.map(lambda rank: group.communicator(rank).all_reduce(exchanges[rank], 0, "params"),
                      range(len(exchanges))))
    return exchanges[0].mean()


def sparsely_moved(snapshot: Snapshot, round_index: int, seed: int, share: float = 0.01,
                   scale: float = 0.01) -> Snapshot:
    """``snapshot`` with ``share`` of the values of every parameter moved by noise of ``scale`` (new tensors, as an
    outer step makes them), as the state of ``round_index``: what a round of SparseLoCo changes."""
    generator = torch.Generator().manual_seed(seed)
    params = {}
    for name, tensor in snapshot.params.items():
        moved = tensor.clone()
        flat = moved.view(-1)
        at = torch.randperm(flat.numel(), generator=generator)[: max(1, int(flat.numel() * share))]
        flat[at] += torch.randn(len(at), generator=generator) * scale
        params[name] = moved
    return Snapshot(round_index, snapshot.slice, params, snapshot.shared, state_digest(params, snapshot.shared))
