"""Peers this node has caught sending malformed data, left out of its rounds for a while.

A ban is local (each node bans what it saw itself, so no peer can get another banned by accusing it)
and bounded (``swarm.ban_rounds`` rounds, then the peer is welcome again: a buggy peer that was
fixed and restarted comes back). While a peer is banned here, this node as coordinator answers its
joins "banned" and does not wait for it, and as a reducer drops its contributions at once. So a
peer that sends garbage every round costs the others at most the round in which it was first caught.
Only malformed content earns a ban; a stream cut short or a timeout (a crash, a slow link) does not.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class Bans:
    def __init__(self, rounds: int):
        self.rounds = rounds
        self._until: dict[str, int] = {}  # peer -> the first round it may take part in again

    def ban(self, peer: str, round_index: int, reason: str) -> None:
        until = round_index + 1 + self.rounds
        if self._until.get(peer, -1) < until:
            if not self.banned(peer, round_index):
                logger.warning(f"round {round_index}: {peer[-8:]} sent malformed data ({reason}); leaving it out "
                               f"of this node's rounds until round {until}")
            self._until[peer] = until

    def banned(self, peer: str, round_index: int) -> bool:
        return self._until.get(peer, -1) > round_index

    def active(self, round_index: int) -> set[str]:
        """The peers banned in ``round_index`` (expired bans are forgotten)."""
        self._until = {p: until for p, until in self._until.items() if until > round_index}
        return set(self._until)
