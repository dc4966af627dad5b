"""Whether members a round waits for are still there. One that can be dialled is probed: a daemon that cannot be
reached has crashed. One behind a NAT cannot be dialled: its tether to this peer tells, if it held one and it broke
(``sync/tether.py``), else its record, once it is no longer renewed (``PeerDirectory.stopped``). The coordinator's
ballot waits for no vote, and a reducer for no contribution, of a member gone so; every PROBE_EVERY seconds they look
again at whom they still wait for."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable

from hivemind.p2p import P2P

from p2ploco.swarm import wire
from p2ploco.sync.tether import BROKE

Stopped = Callable[[Iterable[str]], Awaitable[set[str]]]  # of the given peers, those whose records lapse, read afresh
# of the given peers behind NATs, those gone, each with how that is known (``lost_behind_nats``)
Lost = Callable[[set[str]], Awaitable[dict[str, str]]]


def lost_behind_nats(cut: Callable[[set[str]], set[str]], stopped: Stopped) -> Lost:
    """How this peer tells that peers behind NATs are gone: ``cut``, their tethers to it broke (``Tethers.cut``), or
    else ``stopped``, their records are no longer renewed."""
    async def lost(peers: set[str]) -> dict[str, str]:
        gone = dict.fromkeys(cut(peers), BROKE)
        gone.update((p, "its record is no longer renewed") for p in await stopped(peers - set(gone)))
        return gone

    return lost


async def gone(p2p: P2P, handler: str, peers: Iterable[str], dial_out: Iterable[str], lost: Lost) -> dict[str, str]:
    """Of ``peers`` (``dial_out``: those behind a NAT), the ones that crashed, each with how that is known."""
    peers = set(peers)
    natted = peers & set(dial_out)
    dialled = sorted(peers - natted)
    alive = await asyncio.gather(*(wire.reachable(p2p, p, handler, wire.PROBE_EVERY) for p in dialled))
    crashed = {p: "it cannot be reached" for p, ok in zip(dialled, alive) if not ok}
    crashed.update(await lost(natted))
    return crashed
