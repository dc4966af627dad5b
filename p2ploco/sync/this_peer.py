"""What a sync needs to know about the peer that runs it: passed in by whoever starts the peer (``peer.py``), never
borrowed from the matchmaker or the directory."""

from __future__ import annotations

from dataclasses import dataclass

HUB = "hub"  # the role of a peer that trains nothing (``roles.py``): it joins with no weight


@dataclass(frozen=True)
class ThisPeer:
    peer_id: str
    role: str  # as its record says: replica, stage or hub
    fingerprint: str  # of the run document it trains (``Config.run_document``)

    @property
    def hub(self) -> bool:
        return self.role == HUB

    def weight(self, tokens: int) -> int:
        """What this peer's contribution weighs in a sync: the tokens its outer algorithm gave it (``weigh``: those
        trained, plus those of work not applied yet), at least 1; 0 for a hub, which sends none. The one rule:
        the join claims it, the coordinator caps it, and the result reports it."""
        return 0 if self.hub else max(1, tokens)
