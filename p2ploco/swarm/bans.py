"""Peers this node has caught sending malformed data, or repeatedly what honest peers send rarely, left out of
its rounds for a while.

A ban is local (each node bans what it saw itself, so no peer can get another banned by accusing it)
and bounded (``swarm.ban_rounds`` rounds, then the peer is welcome again: a buggy peer that was
fixed and restarted comes back). While a peer is banned here, this node as coordinator answers its
joins "banned" and does not wait for it, and as a reducer drops its contributions at once. So a
peer that sends garbage every round costs the others at most the round in which it was first caught.
Malformed content earns a ban at once; a stream cut short or a timeout (a crash, a slow link) never does. A
contribution that points against the others' (``collective/robust.py``) is left out of the aggregate and earns a
*strike*: an honest peer's does so rarely (noisy data), a sign-flipping peer's every round, so ``STRIKES`` rounds
with a strike within the last ``STRIKE_ROUNDS`` earn a ban.

A key proven to have told peers different things (``swarm/evidence.py``: two different values it signed for one
question) is *convicted*: banned for the rest of the run, here and, as the proof travels, everywhere. Only a proof
that this node checked itself convicts; an accusation alone never does.
"""

from __future__ import annotations

import logging
import math

from p2ploco.swarm.evidence import Proof

logger = logging.getLogger(__name__)

STRIKES = 3  # rounds in which a peer was caught at what honest peers do rarely, that earn it a ban ...
STRIKE_ROUNDS = 10  # ... within this many rounds


class Bans:
    def __init__(self, rounds: int, run_id: str = ""):
        self.rounds, self.run_id = rounds, run_id
        self._bans: dict[str, tuple[float, str]] = {}  # peer -> (the first round it may take part in again, why)
        self._strikes: dict[str, list[int]] = {}  # peer -> the recent rounds in which it was struck
        self.proofs: dict[str, Proof] = {}  # convicted peer -> the proof against it (checked here)

    def ban(self, peer: str, round_index: int, reason: str) -> None:
        until = round_index + 1 + self.rounds
        if self._bans.get(peer, (-1, ""))[0] < until:
            if not self.banned(peer, round_index):
                logger.warning(f"round {round_index}: leaving {peer[-8:]} out of this node's rounds until round "
                               f"{until}: {reason}")
            self._bans[peer] = until, reason

    def convict(self, proof: Proof, round_index: int) -> bool:
        """Ban the key ``proof`` accuses for the rest of the run if the proof holds (checked here: it is anyone's word
        until then); whether it convicted someone new."""
        if proof.accused in self.proofs or not proof.holds(self.run_id):
            return False
        self.proofs[proof.accused] = proof
        logger.warning(f"round {round_index}: leaving {proof.accused[-8:]} out of this run for good: "
                       f"{proof.describe()} (it signed both)")
        self._bans[proof.accused] = math.inf, proof.describe()
        return True

    def strike(self, peer: str, round_index: int, reason: str) -> None:
        """``peer`` was caught in ``round_index`` at what an honest peer does rarely (``reason``); a ban at the
        ``STRIKES``-th round with a strike within ``STRIKE_ROUNDS``. A round counts once, however many spans."""
        recent = [r for r in self._strikes.get(peer, []) if round_index - STRIKE_ROUNDS < r != round_index]
        self._strikes[peer] = [*recent, round_index]
        if len(self._strikes[peer]) >= STRIKES:
            self.ban(peer, round_index, f"{reason}, and so in {STRIKES} of the last {STRIKE_ROUNDS} rounds")
            del self._strikes[peer]

    def banned(self, peer: str, round_index: int) -> bool:
        return self._bans.get(peer, (-1, ""))[0] > round_index

    def reason(self, peer: str) -> str:
        """Why ``peer`` is banned here (the latest ban's reason)."""
        return self._bans[peer][1]

    def active(self, round_index: int) -> set[str]:
        """The peers banned in ``round_index`` (expired bans, and strikes too old to count, are forgotten)."""
        self._bans = {p: ban for p, ban in self._bans.items() if ban[0] > round_index}
        self._strikes = {p: rounds for p, rounds in self._strikes.items() if rounds[-1] > round_index - STRIKE_ROUNDS}
        return set(self._bans)
