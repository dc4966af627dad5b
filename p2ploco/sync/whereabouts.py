"""Where this peer takes part in each round: the coordinator it asks for its group, or whose group it holds.

A member takes part in one group per round and sync. It asks coordinators one after another
(``Matchmaker.form_group``), and once its join at a coordinator failed, or the group it holds from one is dead
(``SwarmCommunicator``), it never takes that coordinator's group of that sync again. The matchmaker notes each
coordinator here before it asks it. So a reducer asked to combine a contribution for a group it does not know
(``sync/reduce.py``) can tell at once whether it ever will: not if the group's coordinator is none of those this
peer takes part in the round at. It then refuses the contribution at once, where it used to wait for the group in
vain; one that waits wakes when this peer moves on to another coordinator.

A round's syncs are told apart by name (Streaming DiLoCo syncs a fragment at a time, perhaps at another
coordinator than the last), and a contribution names its round, not its sync: a peer is elsewhere for a group only
if none of its syncs of that round is at the group's coordinator.
"""

from __future__ import annotations

import asyncio

KEEP_ROUNDS = 8  # rounds noted: an overlapped round's sync may still be under way as the next one forms


class Whereabouts:
    def __init__(self) -> None:
        self._at: dict[tuple[int, str], str] = {}  # (round, sync name) -> the coordinator asked, or whose group held
        self._moved = asyncio.Event()

    def join(self, round_index: int, name: str, coordinator: str) -> None:
        """This peer asks ``coordinator`` for its group of ``round_index``'s sync ``name`` (and holds the group it
        answers)."""
        self._at[(round_index, name)] = coordinator
        newest = max(r for r, _ in self._at)
        self._at = {key: c for key, c in self._at.items() if key[0] > newest - KEEP_ROUNDS}
        self._moved.set()
        self._moved = asyncio.Event()

    def elsewhere(self, round_index: int, coordinator: str) -> str | None:
        """A coordinator this peer takes part in ``round_index`` at, if that is never in a group ``coordinator``
        formed (None: it may be, or this peer has not asked for a group of that round yet)."""
        at = {c for (r, _), c in self._at.items() if r == round_index}
        return None if not at or coordinator in at else min(at)

    def moved(self) -> asyncio.Event:
        """Set when this peer next notes a coordinator."""
        return self._moved
