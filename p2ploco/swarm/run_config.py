"""The run's config travels with the run: a peer that joins with one address trains what the run trains.

Every node serves its run's document (``Config.run_document``: every setting but a peer's own, the training data's
digest and the protocol version), whose fingerprint its record carries. A joiner reads the run's records and counts
the fresh ones that are not leaving (renewed within the last half of their ttl: an abandoned record, or one whose
daemon was stopped, soon counts for nothing), and the fingerprint most of them hold is the run's config. It asks
the peer whose address the person typed first (where that peer trains another config than most, the joiner stops,
naming both: ``ConfigConflict``), then that fingerprint's holders in random order (from the system's random source:
a key ground to sort first is drawn no sooner), until one serves a document whose digest is the fingerprint: a donor
can withhold a document, never change one. It never falls through to a fingerprint fewer records hold: where
nobody serves the most held one, it says so (``ConfigUnserved``), and starts no run of its own. A joiner whose
config (its own file's, or the run's with its own settings) turns out to differ from the run's names its fingerprint
to the donor (``tell_conflict``), which says so once in its log: that joiner stops instead of joining (``node.py``).
It names none as it asks: a config file that differs from the run's in its batch split alone is fitted to the run's
step once the document is in (``config.split_for_run``), and joins.

What k keys that add records gain: k fresh records of one fingerprint, against n live honest peers' records, make it
the run's for a newcomer where k > n (k = n: the newcomer's own fingerprint, then the lower, wins the tie). Then a
newcomer without a config trains the k keys' config, apart from the honest peers (their fingerprints differ), if one
of the keys serves its document, and stops in one line if none does; one with the honest config stops in one line
(``node.py``); and a newcomer that typed an honest peer's address stops naming both. Records that carry the honest
fingerprint only add holders to ask. No running node stops for any of it.

A config request, a wire message (``swarm/wire.py``) with no payload::

    {v, fingerprint: the asker's own ("": it has none)}

answered ``{v, fingerprint}`` + the document as JSON (at most ``MAX_DOCUMENT_BYTES``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from hivemind.p2p import P2P
from pydantic import Field, StringConstraints

from p2ploco.aio import in_time
from p2ploco.config import document_fingerprint
from p2ploco.errors import ConfigError, PayloadError, SwarmError, TransportError, shown
from p2ploco.swarm import wire
from p2ploco.swarm.messages import MAX_TOKENS, Digest, Message, decode
from p2ploco.swarm.records import PeerRecord, PeerRole, Phase

logger = logging.getLogger(__name__)

MAX_DOCUMENT_BYTES = 1 << 16  # a run's document is a few kB
MAX_DOCUMENT_DEPTH = 4
MAX_SETTINGS = 512
ASK_TIMEOUT = 10.0
DRAWN = random.SystemRandom()  # the order holders are asked in: no key can be ground to be asked first


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


@dataclass(frozen=True)
class RunDocument:
    """A run's document, the peer that served it, and how many of the run's live peers hold its fingerprint, of
    how many (an asker whose own config is the run's fetches nothing: no document, no donor)."""

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
            header, _ = await in_time(wire.read_message(reader, max_payload=0), self.timeout)
            request = decode(ConfigRequest, header)
            if request.fingerprint not in ("", self.fingerprint) and asker not in self.told:
                self.told.add(asker)
                logger.warning(f"peer {asker[-8:]} asked for run '{self.run_id}''s config with another config of "
                               f"its own (fingerprint {shown(request.fingerprint)}, the run's {self.fingerprint}): "
                               f"it stops instead of joining")
            await wire.write_message(writer, {"fingerprint": self.fingerprint}, self.payload)


class ConfigConflict(ConfigError):
    """The peer whose address the person typed trains another config than most of the run's peers."""


class ConfigUnserved(SwarmError):
    """Most of the run's fresh records carry a config that none of their peers serves."""


def fresh(record: PeerRecord, expires_in: float) -> bool:
    """Whether a record with ``expires_in`` seconds left was renewed within the last half of its ttl, as a live
    peer's is on every heartbeat (a record that states no ttl is taken for fresh while it lives)."""
    return expires_in >= record.ttl / 2


def ranked_fingerprints(records: Iterable[PeerRecord], me: str, mine: str = "",
                        expires_in: Mapping[str, float] | None = None) -> list[tuple[str, list[str]]]:
    """The configs of a run's training peers, most held first, each with its holders: fresh records that are not
    leaving (``expires_in``: each record's seconds left; None: all are fresh); bootstrap peers and ``me`` do not
    count. A tie goes to ``mine`` (the asker's own fingerprint: a peer is not told to stop for a config as many
    peers train with as with its own), then to the lower fingerprint."""
    holders: dict[str, list[str]] = {}
    for record in records:
        if (record.role != PeerRole.BOOTSTRAP and record.fingerprint and record.peer_id != me
                and record.state != Phase.LEAVING
                and (expires_in is None or fresh(record, expires_in.get(record.peer_id, 0.0)))):
            holders.setdefault(record.fingerprint, []).append(record.peer_id)
    counts = Counter({fingerprint: len(peers) for fingerprint, peers in holders.items()})
    return [(fingerprint, sorted(holders[fingerprint]))
            for fingerprint, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0] != mine, item[0]))]


async def fetch_run_document(p2p: P2P, run_id: str, records: Iterable[PeerRecord], me: str, mine: str = "",
                             expires_in: Mapping[str, float] | None = None, typed: Sequence[str] = ()
                             ) -> RunDocument | None:
    """The document of the config most of the run's fresh records hold, as one of its holders serves it (module
    docstring); None if the run has no such record. ``mine``: the asker's own fingerprint ("" if it has no config);
    ``typed``: the peers whose addresses the person typed, asked first. ConfigConflict where a typed peer trains
    another config; ConfigUnserved where no holder serves the run's."""
    records = list(records)
    ranked = ranked_fingerprints(records, me, mine, expires_in)
    if not ranked:
        return None
    peers = sum(len(holders) for _, holders in ranked)
    fingerprint, holders = ranked[0]
    trainers = {r.peer_id: r.fingerprint for r in records if r.role != PeerRole.BOOTSTRAP and r.fingerprint}
    for peer in (p for p in dict.fromkeys(typed) if trainers.get(p, fingerprint) != fingerprint and p != me):
        if await _ask(p2p, run_id, peer, trainers[peer], mine) is not None:
            raise ConfigConflict(f"the peer you named ({peer[-8:]}) trains another config of run '{shown(run_id)}' "
                                 f"(fingerprint {trainers[peer]}) than {len(holders)} of its {peers} peers do "
                                 f"({fingerprint}): name a peer of the config you mean to join, or check --run-id")
    if fingerprint == mine:  # this peer holds the run's config already: nothing to fetch
        return RunDocument(fingerprint, {}, "", len(holders), peers)
    others = [p for p in holders if p not in typed]
    for donor in [p for p in holders if p in typed] + DRAWN.sample(others, len(others)):
        document = await _ask(p2p, run_id, donor, fingerprint, "")  # a conflict is named once known (tell_conflict)
        if document is not None:
            return RunDocument(fingerprint, document, donor, len(holders), peers)
    raise ConfigUnserved(f"{len(holders)} of the {peers} peers of run '{shown(run_id)}' carry config {fingerprint} "
                         f"in their records, and none of them serves it: try again in a moment, or name a peer that "
                         f"trains it with --initial-peers")


async def tell_conflict(p2p: P2P, run_id: str, run: RunDocument, mine: str) -> None:
    """Ask ``run``'s donor again, naming ``mine``: a joiner whose config turned out to conflict with the run's, so
    that the donor logs it."""
    await _ask(p2p, run_id, run.donor, run.fingerprint, mine)


def parse_document(payload: bytes) -> dict[str, Any]:
    """A run document as JSON bytes, checked as a served one is; PayloadError if it is none."""
    if len(payload) > MAX_DOCUMENT_BYTES:
        raise PayloadError(f"a config document over {MAX_DOCUMENT_BYTES} bytes")
    try:
        document = json.loads(payload)
    except (ValueError, RecursionError):  # not JSON or not UTF-8; nested deeper than the parser goes
        raise PayloadError("a config document that is not JSON") from None
    if not wire.nested_within(document, MAX_DOCUMENT_DEPTH):
        raise PayloadError("a config document nested too deep")
    decode(Document, document)
    return document


def save_run_document(run: RunDocument, path: Path) -> None:
    """Write ``run`` where ``load_run_document`` reads it (``p2ploco dht`` hands its hub the run's document so)."""
    path.write_text(json.dumps({"document": run.document, "donor": run.donor, "holders": run.holders,
                                "peers": run.peers}, sort_keys=True))


def load_run_document(path: Path) -> RunDocument:
    """The run document ``save_run_document`` wrote at ``path``; ConfigError, in one line, if it is not one."""
    try:
        saved = json.loads(path.read_text())
        document = parse_document(json.dumps(saved["document"]).encode())
        donor, holders, peers = str(saved["donor"]), int(saved["holders"]), int(saved["peers"])
    except OSError as e:
        raise ConfigError(f"--run-document {path}: cannot read it ({e.strerror})") from None
    except (ValueError, RecursionError, KeyError, TypeError, PayloadError) as e:
        raise ConfigError(f"--run-document {path}: not a run document as `p2ploco dht` writes one "
                          f"({shown(str(e), 100)})") from None
    return RunDocument(document_fingerprint(document), document, donor, holders, peers)


async def _ask(p2p: P2P, run_id: str, donor: str, fingerprint: str, mine: str) -> dict[str, Any] | None:
    """``donor``'s document if its digest is ``fingerprint``; None if the donor does not answer with one."""
    try:
        header, payload = await in_time(
            wire.call(p2p, donor, handler_name(run_id), {"fingerprint": mine}, max_payload=MAX_DOCUMENT_BYTES),
            ASK_TIMEOUT)
        decode(ConfigAnswer, header)
        document = parse_document(payload)
    except (PayloadError, TransportError, TimeoutError) as e:
        logger.info(f"peer {donor[-8:]} gave no config document: {shown(str(e), 200)}")
        return None
    if document_fingerprint(document) != fingerprint:
        logger.info(f"peer {donor[-8:]} served a config document whose digest is not its record's fingerprint")
        return None
    return document
