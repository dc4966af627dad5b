"""A node's rank 1..N-1: ``python -m p2ploco.rank_process RENDEZVOUS RANK WORLD KIND``, started by rank 0
(``LocalRanks.start``); never by hand.

It builds its share of the node's replica from rank 0's setup and repeats what rank 0 leads (``leader.py``): takes
its params or optimizer state (or its shards of them, and sends them back: ``sharded.py``), takes each inner step
with it, until told to exit. Rank 0 owns its lifetime: the signals a terminal or a supervisor sends the node's
process group are rank 0's to act on (it leaves the swarm, then tells the ranks to exit), and the kernel kills a
rank whose rank 0 died.
"""

from __future__ import annotations

import ctypes
import signal
import sys

import torch
import torch.distributed as dist

from p2ploco.build import build_rank_trainer
from p2ploco.config import Config
from p2ploco.data import ShardSampler, load_training_data
from p2ploco.host_memory import keep_freed_memory
from p2ploco.ranks.processes import Command, LocalRanks

PR_SET_PDEATHSIG = 1


def repeat_rank_0(rendezvous: str, rank: int, world: int, kind: str) -> None:
    keep_freed_memory()
    ranks, setup = LocalRanks.join(rendezvous, rank, world, kind)
    config = Config.model_validate(setup.config)
    if config.training.threads:
        torch.set_num_threads(config.training.threads)
    data = load_training_data(config)
    sampler = ShardSampler(data.train, config.data.seq_len, config.inner.batch_size, config.run_id, setup.peer_id)
    trainer = build_rank_trainer(config, ranks.device, sampler, ranks)
    sharded = None
    if config.training.shard:
        from p2ploco.ranks.sharded import ShardedState  # as build.py: its imports take a second

        sharded = ShardedState(ranks, trainer.model)
    while True:
        kind_of, value = ranks.command()
        if kind_of is Command.STEP:
            trainer.step(value)
        elif kind_of is Command.EXIT:
            return
        elif sharded is not None:
            sharded.take_part(kind_of, trainer.optimizer)
        elif kind_of is Command.PARAMS:
            ranks.share_params(trainer.params)
        elif kind_of is Command.OPTIMIZER:
            ranks.share_optimizer(trainer.optimizer)
        else:
            raise ValueError(f"{kind_of.name} is not a replicated state's command")


def main() -> None:
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    rendezvous, rank, world, kind = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    try:
        repeat_rank_0(rendezvous, rank, world, kind)
    except dist.DistError as e:  # rank 0 is gone or broke the group off: nothing to train for
        print(f"local rank {rank} stops: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
