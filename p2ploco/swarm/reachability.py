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

Detection (``detect``): the peer asks other peers, its *helpers*, to dial it back. A helper opens a plain TCP
connection to the address it sees the request come from, at each port the asker listens on, and says which ports
answered. It dials nothing else, so the probe cannot be turned against a third party. Any peer can be a helper and
lie, so a verdict takes two voices: ``public`` needs two distinct helpers that reached a port, ``client`` (or
``relayed``, where the daemon holds a relay address) two that dialled and reached none, and more voices for it
than against (``judge``). A helper that refuses, hangs, serves no probe (a stock hivemind peer) or answers
garbage gives no voice, and makes way for the next helper. ``ANSWERS_WANTED`` helpers are asked at once, at most
``ASK_AT_MOST`` in all: the bootstrap peers the user named first, then public peers of the run in random order
(an attacker can grind keys to sort first by peer id, never to be drawn first). Where no two voices settle it (the
answers tie, or fewer than two agree), the bootstrap peers the user named decide if those that answered agree
(the user trusts them already: the peer joins the swarm through them); otherwise the peer is ``public``, as a first
peer with nobody to ask is. It says so in one line: a WARNING where helpers disagree or none answered, INFO where
the bootstrap peers alone answered, as in a swarm with one.
``--reachability`` forces the answer and skips the probe. A peer starts as a DHT client and
serves the DHT once it is found to be public (``dht.start_serving``): nobody lists in a routing table a peer it
cannot dial.

Serving the probe (``DialBack``, on every public node and bootstrap peer): a helper dials back a global address
always; a private, loopback, link-local or unique-local one only if it is itself on such a network (none of its
own addresses is global: a LAN, a local swarm on loopback, namespaces on 10.x), so that a peer on the Internet
cannot be aimed at its operator's LAN through a proxy that makes requests seem to come from inside; never a
multicast, unspecified or reserved one (``Admission``). It dials one asker at most once per ``MIN_INTERVAL`` and
all askers together at most ``DIALS_PER_INTERVAL`` times per ``MIN_INTERVAL``; a refused request is answered
``dialled: false``.
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import logging
import secrets
import time
from collections.abc import Collection, Sequence
from typing import Annotated, Any

from hivemind.p2p import P2P
from hivemind.utils.multiaddr import Multiaddr
from pydantic import Field

from p2ploco import faults
from p2ploco.aio import in_time
from p2ploco.errors import PayloadError, TransportError, shown
from p2ploco.swarm import wire
from p2ploco.swarm.messages import Message, decode
from p2ploco.swarm.records import Reachability

logger = logging.getLogger(__name__)

HANDLER = "p2ploco/dialback"  # served by every public node and bootstrap peer, whatever run it serves
DIAL_TIMEOUT = 3.0  # a TCP connect that has not completed by then counts as dropped by a NAT
ASK_TIMEOUT = 2 * DIAL_TIMEOUT + 5.0
MAX_PORTS = 4  # ports one request may ask to be dialled at
MIN_INTERVAL = 10.0  # seconds between two dial-backs for the same peer: a peer cannot keep this one dialling
DIALS_PER_INTERVAL = 32  # dial-backs for all askers together per MIN_INTERVAL: fresh keys cannot either
ANSWERS_WANTED = 8  # helpers asked at once, and voices counted: k keys decide only where they outvote the others
ASK_AT_MOST = 16  # helpers asked in all (one that gives no voice makes way for the next)
Port = Annotated[int, Field(ge=1, le=65535)]


class DialBackRequest(Message):
    ports: Annotated[list[Port], Field(min_length=1, max_length=MAX_PORTS)]


class DialBackAnswer(Message):
    dialled: bool  # False: it dialled nothing (module docstring: which requests a helper refuses)
    reached: Annotated[list[Port], Field(max_length=MAX_PORTS)]
    seen_at: Annotated[str, Field(max_length=64)]  # the host the asker's request came from


def parse_dial_back(header: Any, ports: Sequence[int]) -> DialBackAnswer:
    """A helper's answer to a request for ``ports``; PayloadError if malformed or if it names a port not asked."""
    answer = decode(DialBackAnswer, header)
    if not set(answer.reached) <= set(ports):
        raise PayloadError("DialBackAnswer: reached: names a port that was not asked")
    return answer


class Admission:
    """Which dial-back requests a helper serves (module docstring), given its own listening multiaddrs."""

    def __init__(self, addresses: Sequence[str], limit: int = DIALS_PER_INTERVAL):
        self.local = not any(on_the_internet(address) for address in addresses)  # it may dial private hosts
        self.limit = limit
        self._last: dict[str, float] = {}  # peer -> when it was last dialled back
        self._recent: collections.deque[float] = collections.deque()  # when each of the latest dial-backs began

    def refusal(self, sender: str, host: str | None, now: float) -> str | None:
        """Why ``sender``'s request, seen from ``host`` (None: through a relay), is refused; None: dial it back
        (counted from ``now``)."""
        self._last = {p: t for p, t in self._last.items() if now - t < MIN_INTERVAL}
        while self._recent and now - self._recent[0] >= MIN_INTERVAL:
            self._recent.popleft()
        if host is None:
            return "its request came through a relay"
        if not may_dial(host, self.local):
            why = "not a unicast address" if self.local else "not a global one, and this peer is on the Internet"
            return f"it came from {host}, which this peer does not dial: {why}"
        if sender in self._last:
            return f"it asked less than {MIN_INTERVAL:g} s ago"
        if len(self._recent) >= self.limit:
            return f"{self.limit} peers were dialled back in the last {MIN_INTERVAL:g} s"
        self._last[sender] = now
        self._recent.append(now)
        return None


def may_dial(host: str, local: bool) -> bool:
    """Whether a helper dials back an asker seen at ``host``: a global address always, any other unicast address
    only where the helper is ``local`` itself (module docstring)."""
    address = ipaddress.ip_address(host)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if address.is_multicast or address.is_unspecified or (address.version == 4 and address.is_reserved):
        return False  # IPv4's 240.0.0.0/4 (with the broadcast address); IPv6's "reserved" takes in ::1
    return address.is_global or local


def on_the_internet(address: str) -> bool:
    """Whether one of a peer's own multiaddrs is on the Internet: a global IP address, or a name (/dns4 ...). A
    relay's circuit address says nothing about where the peer is."""
    multiaddr = Multiaddr(address)
    if "p2p-circuit" in {p.name for p in multiaddr.protocols()}:
        return False
    host = ip_host(multiaddr)
    return host is None or ipaddress.ip_address(host).is_global


class DialBack:
    """The service side: dial an asker back at the host its request came from, if ``Admission`` lets it."""

    def __init__(self, p2p: P2P, addresses: Sequence[str], limit: int = DIALS_PER_INTERVAL):
        self.p2p = p2p
        self.admission = Admission(addresses, limit)

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(HANDLER, faults.seam("answer.dialback", self, self._serve))

    async def _serve(self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sender = str(stream_info.peer_id)
        async with wire.serving(logger, "dial-back request", sender, reader, writer, ASK_TIMEOUT, logging.DEBUG):
            header, _ = await in_time(wire.read_message(reader, max_payload=0), ASK_TIMEOUT)
            request = decode(DialBackRequest, header)
            host = ip_host(stream_info.addr)
            answer = {"dialled": False, "reached": [], "seen_at": host or ""}
            refusal = self.admission.refusal(sender, host, time.monotonic())
            if refusal is None:
                ports = sorted(set(request.ports))
                opened = await asyncio.gather(*(dial(host, port) for port in ports))
                answer.update(dialled=True, reached=[port for port, ok in zip(ports, opened) if ok])
            else:
                logger.debug(f"not dialling {sender[-8:]} back: {refusal}")
            await wire.write_message(writer, answer)


def ip_host(address: Multiaddr) -> str | None:
    """The IP address of a multiaddr (None for a relayed or non-IP one): for a stream, the host it came from."""
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
        _, writer = await in_time(asyncio.open_connection(host, port), DIAL_TIMEOUT)
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


async def ask(p2p: P2P, helper: str, ports: list[int]) -> DialBackAnswer | None:
    """``helper``'s answer to a request to dial this peer back at ``ports``, or None where it gives no voice: it
    serves no probe (a stock hivemind peer) or is gone, would not dial, hung, or answered garbage."""
    try:
        header, _ = await in_time(wire.call(p2p, helper, HANDLER, {"ports": ports}), ASK_TIMEOUT)
        answer = parse_dial_back(header, ports)
    except wire.Unreachable:
        return None
    except PayloadError as e:
        logger.info(f"{helper[-8:]} answered the dial-back probe with malformed data: {e}")
        return None
    except (TransportError, TimeoutError) as e:
        logger.info(f"could not ask {helper[-8:]} to dial this peer back ({e!r})")
        return None
    return answer if answer.dialled else None


def judge(reached: Collection[str], unreached: Collection[str], named: Collection[str]) -> tuple[bool, str | None]:
    """Whether this peer can be dialled, from the helpers that reached one of its ports and those that dialled and
    reached none (``named``: the bootstrap peers the user named), and why, where the answers alone did not settle
    it or some disagreed (None where they agree)."""
    if not reached and not unreached:
        return True, "no helper answered the dial-back probe"
    said = "; ".join(f"{', '.join(sorted(h[-8:] for h in helpers))} reached {what}"
                     for helpers, what in ((reached, "a port"), (unreached, "none")) if helpers)
    for voices, against, public in ((reached, unreached, True), (unreached, reached, False)):
        if len(voices) >= 2 and len(voices) > len(against):
            return public, f"the helpers disagree ({said}): the majority decides" if against else None
    named_reached, named_unreached = set(reached) & set(named), set(unreached) & set(named)
    if bool(named_reached) != bool(named_unreached):
        return bool(named_reached), f"no two helpers agree ({said}): the bootstrap peers you named decide"
    return True, f"no two helpers agree ({said}), nor do the bootstrap peers you named"


async def detect(p2p: P2P, bootstrap: Sequence[str], others: Sequence[str], addresses: Sequence[str]
                 ) -> Reachability:
    """This peer's reachability, by asking helpers it is connected to (the ``bootstrap`` peers the user named, then
    ``others``, in random order) to dial it back at the ports of ``addresses`` (its listening multiaddrs)."""
    ports = listening_ports(addresses)
    relayed = any("/p2p-circuit" in a for a in addresses)
    named = list(dict.fromkeys(bootstrap))
    rest = [h for h in dict.fromkeys(others) if h not in named]
    if not ports or not named + rest:  # a first peer with nobody to ask: peers join through it
        return Reachability.PUBLIC
    secrets.SystemRandom().shuffle(rest)  # not by peer id, which keys can be ground to lead; nor seeded by the run
    helpers = iter([*named, *rest][:ASK_AT_MOST])
    answers: dict[str, DialBackAnswer] = {}

    async def one_voice() -> None:  # helpers in turn, until one answers
        for helper in helpers:
            if (answer := await ask(p2p, helper, ports)) is not None:
                answers[helper] = answer
                return

    await asyncio.gather(*(one_voice() for _ in range(ANSWERS_WANTED)))
    reached = [h for h, answer in answers.items() if answer.reached]
    public, doubt = judge(reached, [h for h in answers if h not in reached], named)
    if public:
        if doubt:  # a warning where helpers disagree; one voice (a local swarm's bootstrap peer) is the usual case
            disputed = not answers or len(reached) < len(answers)  # nobody answered, or some reached no port
            log = logger.warning if disputed else logger.info
            log(f"reachability: {doubt}; taking this peer for public (pass --reachability client if it is behind a "
                f"NAT)")
        return Reachability.PUBLIC
    seen = sorted({shown(answer.seen_at) for answer in answers.values() if not answer.reached and answer.seen_at})
    logger.warning(f"reachability: {doubt + '; ' if doubt else ''}this peer could not be dialled back at "
                   f"{', '.join(seen) or 'its address'} (ports {', '.join(map(str, ports))}): it is behind a NAT or "
                   f"firewall, and takes part in rounds by dialling out"
                   f"{' (reachable through a relay)' if relayed else ''}")
    return Reachability.RELAYED if relayed else Reachability.CLIENT
