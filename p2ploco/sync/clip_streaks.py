"""When a reducer's clipping is worth a warning.

A reducer clips a contribution longer than ``outer.clip_factor`` times the lower median norm (``collective/robust.py``).
In a healthy swarm that happens for a few rounds at a time: a peer that trained alone for a while, or whose error
buffer holds more rounds than a newcomer's, sends more than the others until their buffers fill. That is no news
(each round's record counts the peers it clipped, ``RoundSummary.clipped_peers``). A peer clipped round after round
for longer than that is: it moves the model more than the others every round. It is named once, with the count.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

# rounds in a row a peer must be clipped in before it is named: several times the rounds an error buffer of the
# default decay remembers (1 / (1 - 0.8) = 5), so that a newcomer's catching up is not
STREAK_ROUNDS = 20


class ClipStreaks:
    def __init__(self, rounds: int = STREAK_ROUNDS):
        self.rounds = rounds
        self._streaks: dict[str, tuple[int, int]] = {}  # peer -> (the last round it was clipped in, rounds in a row)
        self._named: set[str] = set()

    def clipped(self, peer: str, round_index: int) -> None:
        """``peer``'s contribution was clipped in ``round_index`` (any number of spans count once)."""
        last, streak = self._streaks.get(peer, (-2, 0))
        if last == round_index:
            return
        streak = streak + 1 if last == round_index - 1 else 1
        self._streaks[peer] = (round_index, streak)
        if streak >= self.rounds and peer not in self._named:
            self._named.add(peer)
            logger.warning(f"peer {peer[-8:]}'s contribution was clipped to the span's bound (outer.clip_factor x the "
                           f"median norm) in each of the last {streak} rounds: it moves the model more than the "
                           f"others every round (a far higher learning rate, or an attack); the clipping bounds it")
