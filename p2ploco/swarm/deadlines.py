"""How long one transfer of a round may take: long enough for its bytes over the slowest link of the group.

A fixed timeout either drops a slow but honest link (a dense fp32 contribution over 20 Mbit/s takes far
longer than a compressed one over 1 Gbit/s) or lets a dead peer stall fast rounds for minutes. So a
transfer's deadline is the fixed allowance (``swarm.allreduce_timeout``: latency, a peer's compute,
waiting for the slowest sender) plus its payload at the slowest rate the group's members report
(``swarm.bandwidth_mbit`` in their records). No report counts as ``swarm.min_bandwidth_mbit``, and no
report counts as slower: a peer cannot make the others wait longer than that floor by claiming a slow
link. ``swarm.max_transfer_timeout`` caps the result.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class TransferDeadline:
    base: float  # seconds any transfer may take, whatever its size
    min_mbit: float  # the slowest link a deadline allows for (Mbit/s)
    cap: float  # the longest any transfer may take (seconds)

    def seconds(self, payload_bytes: int, reported_mbit: Iterable[float] = ()) -> float:
        """The deadline of a transfer of ``payload_bytes`` among peers that report these link rates (0: none)."""
        rate = max(self.min_mbit, min((r for r in reported_mbit if r > 0), default=self.min_mbit))
        return min(self.cap, self.base + 8 * payload_bytes / (rate * 1e6))
