"""Whether other peers can dial this one, found out as it starts, and what a peer that cannot is spared.

Most volunteers sit behind a home router that masquerades its LAN and drops every connection dialled in from
outside. Such a peer can open streams to any public peer (and libp2p reuses the connection both ways), but two of
them can never open one to each other. A round asks peers to dial each other in three places: a joiner dials
the coordinator, every holder of a slice dials each of its reducers, a catching-up peer dials its donor. So a peer
that cannot be dialled must never be any of those three; everything else it does on streams it opens itself:

- ``public``: others can dial it. It may coordinate, reduce spans and serve its state.
- ``relayed``: others reach it only through a libp2p circuit relay (any public peer relays: p2pd's relay service
  is on by default, and a relayed peer's daemon reserves a slot at its bootstrap peers, ``use_auto_relay``).
  Probes and small answers reach it; a round's traffic does not go through a relay's link, so it is treated as
  ``client`` in rounds (``dials_out``).
- ``client``: it can only dial out. Its DHT node runs in client mode, so nobody tries to store records on it.

A coordinator never waits on a dial it cannot make: it gives members that dial out no reducer span
(``Group.reducers``), never picks one as coordinator, and a catching-up peer never asks one for the state.

Detection (``detect``): the peer asks a peer it is connected to (its bootstrap peers first, then public peers of
its run) to dial it back.
The asked peer opens a plain TCP connection to the address it sees the request come from, at each port the asker
listens on, and says which ports answered. It dials nothing else, so the probe cannot be turned against a third
party. A port that answers means ``public``; none, ``relayed`` if the daemon holds a relay address, else
``client``. A first peer with nobody to ask is ``public`` (peers join through it); so is a peer that no one
answered, with a warning. ``--reachability`` forces the answer. A peer starts as a DHT client and serves the
DHT once it is found to be public (``dht.start_serving``): nobody lists in a routing table a peer it cannot dial.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Annotated, Any

from hivemind.p2p import P2P
from hivemind.utils.multiaddr import Multiaddr
from pydantic import Field

from p2ploco.errors import PayloadError, TransportError
from p2ploco.swarm import wire
from p2ploco.swarm.messages import Message, decode
from p2ploco.swarm.records import Reachability

logger = logging.getLogger(__name__)

HANDLER = "p2ploco/dialback"  # served by every public node and bootstrap peer, whatever run it serves
DIAL_TIMEOUT = 3.0  # a TCP connect that has not completed by then counts as dropped by a NAT
ASK_TIMEOUT = 2 * DIAL_TIMEOUT + 5.0
MAX_PORTS = 4  # ports one request may ask to be dialled at
MIN_INTERVAL = 10.0  # seconds between two probes for the same peer: a peer cannot keep this one dialling
ASK_AT_MOST = 4  # peers asked before giving up (a stock hivemind bootstrap peer does not serve the probe)


class DialBackRequest(Message):
    ports: Annotated[list[Annotated[int, Field(ge=1, le=65535)]], Field(min_length=1, max_length=MAX_PORTS)]


class DialBackAnswer(Message):
    dialled: bool  # False: it dialled nothing (asked a moment ago, or the request came through a relay)
    reached: list[Annotated[int, Field(ge=1, le=65535)]]
    seen_at: Annotated[str, Field(max_length=64)]  # the host the asker's request came from


class DialBack:
    """The service side: dial an asker back at the host its request came from."""

    def __init__(self, p2p: P2P):
        self.p2p = p2p
        self._last: dict[str, float] = {}  # peer -> when it was last dialled back

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(HANDLER, self._serve)

    async def _serve(self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sender = str(stream_info.peer_id)
        try:
            header, _ = await asyncio.wait_for(wire.read_message(reader, max_payload=0), ASK_TIMEOUT)
            request = decode(DialBackRequest, header)
            host = observed_host(stream_info.addr)
            now = time.monotonic()
            self._last = {p: t for p, t in self._last.items() if now - t < MIN_INTERVAL}
            answer = {"dialled": False, "reached": [], "seen_at": host or ""}
            if host is not None and sender not in self._last:  # not relayed to us, nor asked a moment ago
                self._last[sender] = now
                ports = sorted(set(request.ports))
                opened = await asyncio.gather(*(dial(host, port) for port in ports))
                answer.update(dialled=True, reached=[port for port, ok in zip(ports, opened) if ok])
            await wire.write_message(writer, answer)
        except PayloadError as e:
            logger.info(f"bad dial-back request from {sender[-8:]}: {e}")
        except (TransportError, TimeoutError) as e:
            logger.debug(f"dial-back request from {sender[-8:]} broke off: {e!r}")
        finally:
            await wire.hang_up(reader, writer, ASK_TIMEOUT)


def observed_host(address: Multiaddr) -> str | None:
    """The IP address a stream came from (None for a relayed or non-IP one)."""
    protocols = {p.name for p in address.protocols()}
    if "p2p-circuit" in protocols:
        return None
    for name in ("ip4", "ip6"):
        if name in protocols:
            return address[name]
    return None


async def dial(host: str, port: int) -> bool:
    """Whether a TCP connection to ``host:port`` opens within DIAL_TIMEOUT (it is closed at once)."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), DIAL_TIMEOUT)
    except (OSError, TimeoutError):
        return False
    writer.close()
    return True


def listening_ports(addresses: Sequence[str]) -> list[int]:
    """The TCP ports among this peer's listening multiaddrs."""
    ports = []
    for text in addresses:
        address = Multiaddr(text)
        if "tcp" in {p.name for p in address.protocols()}:
            ports.append(int(address["tcp"]))
    return sorted(set(ports))[:MAX_PORTS]


async def detect(p2p: P2P, helpers: Sequence[str], addresses: Sequence[str]) -> Reachability:
    """This peer's reachability, by asking ``helpers`` (peer ids it is connected to, best first) to dial it back at
    the ports of ``addresses`` (its listening multiaddrs)."""
    ports = listening_ports(addresses)
    relayed = any("/p2p-circuit" in a for a in addresses)
    if not helpers or not ports:
        return Reachability.PUBLIC
    asked = 0
    for helper in helpers:
        if asked == ASK_AT_MOST:
            break
        try:
            header, _ = await asyncio.wait_for(wire.call(p2p, helper, HANDLER, {"ports": ports}), ASK_TIMEOUT)
            answer = decode(DialBackAnswer, header)
        except wire.Unreachable:  # it serves no probe (a stock hivemind peer), or is gone: not counted
            continue
        except (PayloadError, TransportError, TimeoutError) as e:
            asked += 1
            logger.info(f"could not ask {helper[-8:]} to dial this peer back ({e!r}); asking the next")
            continue
        if not answer.dialled:  # it would not dial (asked a moment ago, e.g. before a restart): no verdict
            continue
        if answer.reached:
            return Reachability.PUBLIC
        logger.warning(f"{helper[-8:]} could not dial this peer back at {answer.seen_at or 'its address'} "
                       f"(ports {', '.join(map(str, ports))}): it is behind a NAT or firewall, and takes part "
                       f"in rounds by dialling out{' (reachable through a relay)' if relayed else ''}")
        return Reachability.RELAYED if relayed else Reachability.CLIENT
    logger.warning("no peer answered the dial-back probe; assuming this peer can be dialled "
                   "(pass --reachability client if it is behind a NAT)")
    return Reachability.PUBLIC
