"""One peer, many local ranks: a node that trains on N local devices as one replica of the swarm.

Rank 0 is the node: it talks to the swarm, holds the outer algorithm, evaluates and writes checkpoints. It starts
ranks 1..N-1 as processes of its own (``group.py``). Every rank holds a copy of the model and of the inner AdamW
state and trains its share of each inner step's batches (``data_parallel.py``); DDP averages their gradients, so
every rank takes the same step and the ranks' local params stay equal bit for bit (the backend hands each rank the
same sums). What rank 0 changes outside an inner step (the global params a round starts from, a catch-up, a
checkpoint's optimizer state) it sends the other ranks before its next step (``leader.py``); they repeat the steps
it leads (``p2ploco/rank_process.py``, their process's entry point: above this package, since it builds their
replica with ``build.py``, which builds rank 0's with this one). The swarm sees one identity, one record and one
contribution, trained on N times a rank's batch, which the run counts up to ``training.max_ranks`` full rounds.

A rank that dies breaks the next collective: rank 0 raises ``RankError`` and the node leaves the swarm as a whole,
after writing its checkpoint; the other peers lose at most the round it was in.
"""

from p2ploco.ranks.processes import LocalRanks, RankError

__all__ = ["LocalRanks", "RankError"]
