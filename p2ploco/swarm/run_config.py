"""The run's config travels with the run: a peer that joins with one address trains what the run trains.

Every node serves its run's document (``Config.run_document``: every setting but a peer's own, the training data's
digest and the protocol version), whose fingerprint its record carries. A joiner reads the run's records and asks
peers for the document of the fingerprint most of them hold, then of the next, and keeps the first document whose
digest is the fingerprint asked for: a donor can withhold a document, never change one. A fingerprint no peer
serves a document of counts for nothing, so a record published without a running node behind it does not make a
run's config. A joiner that brought a config of its own names its fingerprint when it asks, and a donor whose run
it differs from says so once in its log: that joiner stops instead of joining (``node.py``).

A config request, a wire message (``swarm/wire.py``) with no payload::

    {v, fingerprint: the asker's own ("": it has none)}

answered ``{v, fingerprint}`` + the document as JSON (at most ``MAX_DOCUMENT_BYTES``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Any

from hivemind.p2p import P2P
from pydantic import Field, StringConstraints

from p2ploco.config import document_fingerprint
from p2ploco.errors import PayloadError, TransportError, shown
from p2ploco.swarm import wire
from p2ploco.swarm.messages import MAX_TOKENS, Digest, Message, decode
from p2ploco.swarm.records import PeerRecord

logger = logging.getLogger(__name__)

MAX_DOCUMENT_BYTES = 1 << 16  # a run's document is a few kB
MAX_DOCUMENT_DEPTH = 4
MAX_SETTINGS = 512
DONORS_ASKED = 3  # peers asked for one fingerprint's document before the next fingerprint is tried
ASK_TIMEOUT = 10.0


def handler_name(run_id: str) -> str:
    return f"p2ploco/{run_id}/config"


class ConfigRequest(Message):
    fingerprint: Digest  # the asker's own config's, or ""


class ConfigAnswer(Message):
    fingerprint: Digest


Scalar = str | bool | int | float | None
Key = Annotated[str, StringConstraints(min_length=1, max_length=64)]


class Document(Message):
    """A run document as ``Config.run_document`` writes it; what its settings mean is checked as a config file's
    are (``config.config_of_run``)."""

    settings: Annotated[dict[Key, Scalar | Annotated[list[Scalar], Field(max_length=64)]],
                        Field(max_length=MAX_SETTINGS)]
    round_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS)]
    data: Digest
    protocol: Annotated[int, Field(ge=0, le=1 << 16)]
    hints: Annotated[dict[Key, Annotated[str, StringConstraints(max_length=1024)]], Field(max_length=4)] = {}


@dataclass(frozen=True)
class RunDocument:
    """A run's document, the peer that served it, and how many of the run's live peers hold its fingerprint, of
    how many."""

    fingerprint: str
    document: dict[str, Any]
    donor: str
    holders: int
    peers: int


class ConfigServer:
    """Serves this node's run document; notes once per peer that asked with another config."""

    def __init__(self, p2p: P2P, run_id: str, document: dict[str, Any], timeout: float):
        self.p2p, self.run_id, self.timeout = p2p, run_id, timeout
        self.fingerprint = document_fingerprint(document)
        self.payload = json.dumps(document, sort_keys=True).encode()
        self.told: set[str] = set()

    async def start(self) -> None:
        await self.p2p.add_binary_stream_handler(handler_name(self.run_id), self._serve)

    async def _serve(self, stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        asker = str(stream_info.peer_id)
        async with wire.serving(logger, "config request", asker, reader, writer, self.timeout):
            header, _ = await asyncio.wait_for(wire.read_message(reader, max_payload=0), self.timeout)
            request = decode(ConfigRequest, header)
            if request.fingerprint not in ("", self.fingerprint) and asker not in self.told:
                self.told.add(asker)
                logger.warning(f"peer {asker[-8:]} asked for run '{self.run_id}''s config with another config of "
                               f"its own (fingerprint {shown(request.fingerprint)}, the run's {self.fingerprint}): "
                               f"it stops instead of joining")
            await wire.write_message(writer, {"fingerprint": self.fingerprint}, self.payload)


def ranked_fingerprints(records: Iterable[PeerRecord], me: str, mine: str = "") -> list[tuple[str, list[str]]]:
    """The configs of a run's live training peers, most held first, each with its holders; bootstrap peers and
    ``me`` do not count. A tie goes to ``mine`` (the asker's own fingerprint: a peer is not told to stop for a
    config as many peers train with as with its own), then to the lower fingerprint."""
    holders: dict[str, list[str]] = {}
    for record in records:
        if record.role != "bootstrap" and record.fingerprint and record.peer_id != me:
            holders.setdefault(record.fingerprint, []).append(record.peer_id)
    counts = Counter({fingerprint: len(peers) for fingerprint, peers in holders.items()})
    return [(fingerprint, sorted(holders[fingerprint]))
            for fingerprint, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0] != mine, item[0]))]


async def fetch_run_document(p2p: P2P, run_id: str, records: Iterable[PeerRecord], me: str,
                             mine: str = "") -> RunDocument | None:
    """The document of the config most of the run's peers hold that a peer serves (``mine``: the asker's own
    fingerprint, "" if it has no config); None if the run has no peer that serves one."""
    ranked = ranked_fingerprints(records, me, mine)
    peers = sum(len(holders) for _, holders in ranked)
    for fingerprint, holders in ranked:
        for donor in holders[:DONORS_ASKED]:
            document = await _ask(p2p, run_id, donor, fingerprint, mine)
            if document is not None:
                return RunDocument(fingerprint, document, donor, len(holders), peers)
    return None


async def tell_conflict(p2p: P2P, run_id: str, run: RunDocument, mine: str) -> None:
    """Ask ``run``'s donor again, naming ``mine``: a joiner that came without a config and whose own settings turned
    out to conflict with the run's, so that the donor logs it as it logs one that brought its own."""
    await _ask(p2p, run_id, run.donor, run.fingerprint, mine)


async def _ask(p2p: P2P, run_id: str, donor: str, fingerprint: str, mine: str) -> dict[str, Any] | None:
    """``donor``'s document if its digest is ``fingerprint``; None if the donor does not answer with one."""
    try:
        header, payload = await asyncio.wait_for(
            wire.call(p2p, donor, handler_name(run_id), {"fingerprint": mine}, max_payload=MAX_DOCUMENT_BYTES),
            ASK_TIMEOUT)
        decode(ConfigAnswer, header)
        document = json.loads(payload)
        if not wire.nested_within(document, MAX_DOCUMENT_DEPTH):
            raise PayloadError("a config document nested too deep")
        decode(Document, document)
    # ValueError: not JSON or not UTF-8; RecursionError: JSON nested deeper than the parser goes
    except (PayloadError, TransportError, TimeoutError, ValueError, RecursionError) as e:
        logger.info(f"peer {donor[-8:]} gave no config document: {shown(str(e), 200)}")
        return None
    if document_fingerprint(document) != fingerprint:
        logger.info(f"peer {donor[-8:]} served a config document whose digest is not its record's fingerprint")
        return None
    return document
