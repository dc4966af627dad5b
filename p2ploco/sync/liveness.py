"""Whether members a round waits for are still there, and still in its group. One that can be dialled is asked
(``gone``): a daemon that cannot be reached has crashed, and a member that answers it takes part in the round at
another coordinator (``Whereabouts``: it refused the group, or never got it, and asked the next) will send nothing to
the group. One behind a NAT cannot be dialled: its tether to this peer tells, if it held one and it broke
(``sync/tether.py``), else its record, once it is no longer renewed (``PeerDirectory.stopped``). The coordinator's
ballot waits for no vote, and a reducer for no contribution, of a member gone so; every PROBE_EVERY seconds they look
again at whom they still wait for.

A member's answer speaks for itself alone: the worst it does by saying it is elsewhere is leave its own round. Before
it could say so, 6 members of 2,045 that refused their group (simulated: docs/design.md, "Scale") cost it 120 s in the
butterfly and 117 s in the ballot, alive and probed every 2 s."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from hivemind.p2p import P2P

from p2ploco.aio import in_time
from p2ploco.errors import PayloadError, TransportError
from p2ploco.swarm import wire
from p2ploco.swarm.messages import Message, PeerId, Round, decode
from p2ploco.sync.group import Group
from p2ploco.sync.tether import BROKE
from p2ploco.sync.whereabouts import Whereabouts

logger = logging.getLogger(__name__)

Stopped = Callable[[Iterable[str]], Awaitable[set[str]]]  # of the given peers, those whose records lapse, read afresh
# of the given peers behind NATs, those gone, each with how that is known (``lost_behind_nats``)
Lost = Callable[[set[str]], Awaitable[dict[str, str]]]
ELSEWHERE = "it takes part in the round elsewhere"


class WhereaboutsAsk(Message):
    round: Round
    coordinator: PeerId  # of the group the asker waits on this peer in


class WhereaboutsAnswer(Message):
    elsewhere: bool  # this peer never takes part in the round in a group the coordinator formed


def whereabouts_handler(run_id: str) -> str:
    """The protocol a run's peers answer probes on."""
    return f"p2ploco/{run_id}/whereabouts"


class ProbeAnswers:
    """This peer's side of the probes: whether it takes part in a round in a given coordinator's group."""

    def __init__(self, p2p: P2P, run_id: str, whereabouts: Whereabouts, timeout: float):
        self.p2p, self.whereabouts, self.timeout = p2p, whereabouts, timeout
        self.handler_name = whereabouts_handler(run_id)

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(self.handler_name, self._serve)

    async def _serve(self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with wire.serving(logger, "probe", str(stream_info.peer_id), reader, writer, self.timeout,
                                logging.DEBUG):
            header, _ = await in_time(wire.read_message(reader, max_payload=0), self.timeout)
            ask = decode(WhereaboutsAsk, header)
            elsewhere = self.whereabouts.elsewhere(ask.round, ask.coordinator) is not None
            await in_time(wire.write_message(writer, {"elsewhere": elsewhere}), self.timeout)


def lost_behind_nats(cut: Callable[[set[str]], set[str]], stopped: Stopped) -> Lost:
    """How this peer tells that peers behind NATs are gone: ``cut``, their tethers to it broke (``Tethers.cut``), or
    else ``stopped``, their records are no longer renewed."""
    async def lost(peers: set[str]) -> dict[str, str]:
        gone = dict.fromkeys(cut(peers), BROKE)
        gone.update((p, "its record is no longer renewed") for p in await stopped(peers - set(gone)))
        return gone

    return lost


async def gone(p2p: P2P, run_id: str, group: Group, peers: Iterable[str], lost: Lost) -> dict[str, str]:
    """Of ``peers``, members of ``group``, the ones that crashed or take part in its round elsewhere, each with how
    that is known."""
    peers = set(peers)
    natted = peers & set(group.dial_out)
    dialled = sorted(peers - natted)
    answers = await asyncio.gather(*(_ask(p2p, run_id, group, p) for p in dialled))
    away = {p: why for p, why in zip(dialled, answers) if why is not None}
    away.update(await lost(natted))
    return away


async def _ask(p2p: P2P, run_id: str, group: Group, peer: str) -> str | None:
    """Why ``peer`` is gone from ``group``, if it is: its daemon cannot be reached, or it says it is elsewhere (None:
    it is there, or merely slow to answer: slow is not dead)."""
    try:
        answer, _ = await in_time(wire.call(p2p, peer, whereabouts_handler(run_id), {
            "round": group.round_index, "coordinator": group.coordinator}), wire.PROBE_EVERY)
        return ELSEWHERE if decode(WhereaboutsAnswer, answer).elsewhere else None
    except TimeoutError:
        return None
    except TransportError:
        return "it cannot be reached"
    except PayloadError:  # its own doing: it speaks for itself alone
        return "its answer to a probe was malformed"
