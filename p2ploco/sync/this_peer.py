"""What a sync needs to know about the peer that runs it: passed in by whoever starts the peer (``peer.py``), never
borrowed from the matchmaker or the directory."""

from __future__ import annotations

from dataclasses import dataclass

from p2ploco.swarm.records import PeerRole


@dataclass(frozen=True)
class ThisPeer:
    peer_id: str
    role: PeerRole  # as its record says
    fingerprint: str  # of the run document it trains (``Config.run_document``)

    @property
    def hub(self) -> bool:
        return self.role == PeerRole.HUB

    def weight(self, tokens: int) -> int:
        """What this peer's contribution weighs in a sync: the tokens its outer algorithm gave it (``weigh``: those
        trained, plus those of work not applied yet), at least 1; 0 for a hub, which sends none. The one rule:
        the join claims it, the coordinator caps it, and the result reports it."""
        return 0 if self.hub else max(1, tokens)
