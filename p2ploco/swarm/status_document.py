"""The status document: what a node's status endpoint serves (``swarm/status.py``, ``GET STATUS_PATH``) and
``p2ploco peers --json`` prints, and the ``Survey`` of a run it carries. Format 1::

    {"format": 1, "run_id": RUN, "truncated": N, "takes_part": {PEER_ID: HOW, ...},
     "peers": [{...a peer record..., "expires_in": SECONDS}, ...]}

``truncated`` counts the records a node left out to keep its answer within MAX_STATUS_BYTES (``status_answer``: the
largest go first); it is 0 from the DHT. ``takes_part`` is how each peer takes part in rounds as the serving node
judges it (``Survey.takes_part``), for the dashboard; a client recomputes it from the records. A change that an
older client would misread gets a new format. A client decodes the document with a strict, bounded model
(``StatusDocument``), since anyone may answer at an address; every string a record holds is anyone's, and whoever
shows it passes it through ``errors.shown``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, StringConstraints

from p2ploco.swarm.messages import decode
from p2ploco.swarm.records import Amount, Count, PeerRecord, PeerRole

STATUS_PATH = "/peers"  # what a node's status endpoint serves: ``status_answer`` of its survey
PEERS_DOCUMENT = "/api/v1/peers"  # the same, among the dashboard's documents (``dashboard/documents.py``)
STATUS_FORMAT = 1  # of the status document (above)
# What a node's status answer holds at most, and what a client reads: about 3,500 honest records (about 1.2 KB of
# JSON each); records padded out to 24 KB each are left out first.
MAX_STATUS_BYTES = 4 << 20


@dataclass
class Survey:
    """One look at a run: its live peers (bootstrap peers included) and when each record lapses."""

    run_id: str
    peers: list[PeerRecord]
    expires_in: dict[str, float]  # peer id -> seconds until its record lapses
    truncated: int = 0  # records a node left out of its status answer (``status_answer``)

    @property
    def trainers(self) -> list[PeerRecord]:
        return [p for p in self.peers if p.role not in (PeerRole.BOOTSTRAP, PeerRole.HUB)]

    @property
    def hubs(self) -> list[PeerRecord]:
        """The public machines that serve the run's rounds without training (``roles.py``)."""
        return [p for p in self.peers if p.role == PeerRole.HUB]

    @property
    def coordinators(self) -> list[PeerRecord]:
        """The peers that can coordinate and reduce a round: those others can dial, hubs among them."""
        return [p for p in self.peers if p.role != PeerRole.BOOTSTRAP and not p.dials_out]

    def takes_part(self, peer: PeerRecord) -> str:
        """How ``peer`` takes part in the run's rounds: directly (others dial it: it coordinates and reduces), as a
        hub, or, where it only dials out, through the hubs or the public trainers that reduce for it; "nobody to
        coordinate" where there are none (it applies no round: ``SwarmCommunicator._stranded``)."""
        if peer.role == PeerRole.BOOTSTRAP:
            return "-"
        if peer.role == PeerRole.HUB:
            return PeerRole.HUB.value
        if not peer.dials_out:
            return "direct"
        if self.hubs:
            return "through a hub"
        return "through public peers" if self.coordinators else "nobody to coordinate"

    @classmethod
    def from_json(cls, document: object) -> Survey:
        """The survey in ``peers_json``'s form; PayloadError names the first field that does not fit it."""
        served = decode(StatusDocument, document)
        return cls(served.run_id, list(served.peers), {p.peer_id: p.expires_in for p in served.peers},
                   served.truncated)


def _run_name(run_id: str) -> str:
    if "/" in run_id or not run_id.isprintable():
        raise ValueError("not a run's name")
    return run_id


def _status_format(number: int) -> int:
    if number != STATUS_FORMAT:
        raise ValueError(f"this p2ploco reads status format {STATUS_FORMAT}")
    return number


class ServedRecord(PeerRecord):
    """A peer record as a status document lists it: with the seconds until it lapses."""

    expires_in: Amount


class StatusDocument(BaseModel):
    """The status document (format 1, above), as a client decodes it: strict and bounded, since anyone may answer
    at an address (a JSON integer may have thousands of digits; ``Amount`` refuses what no float holds)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    format: Annotated[int, AfterValidator(_status_format)]
    run_id: Annotated[str, StringConstraints(min_length=1, max_length=64), AfterValidator(_run_name)]
    truncated: Count
    peers: list[ServedRecord]


def _served(p: PeerRecord, s: Survey) -> dict[str, Any]:
    return {**p.to_value(), "expires_in": s.expires_in[p.peer_id]}


def peers_json(s: Survey) -> dict[str, Any]:
    """The status document of ``s`` (format 1, above)."""
    return {"format": STATUS_FORMAT, "run_id": s.run_id, "truncated": s.truncated, "takes_part": _takes_part(s),
            "peers": [_served(p, s) for p in s.peers]}


def _takes_part(s: Survey) -> dict[str, str]:
    """How each peer takes part in rounds (``Survey.takes_part``), by peer id: what the dashboard shows."""
    return {p.peer_id: s.takes_part(p) for p in s.peers}


def status_answer(s: Survey, limit: int = MAX_STATUS_BYTES) -> bytes:
    """``peers_json(s)`` as UTF-8 JSON of at most ``limit`` bytes: what a node's status endpoint serves.

    Records are serialized one at a time: a node runs this in a thread, and json.dumps holds the GIL for all it
    serializes in one call (a whole survey of 1,800 padded records in one call stalled the node's event loop for
    as long as from the loop itself). When the records do not all fit, the smallest are kept (listed in the
    survey's order) and ``truncated`` counts the others: an honest record is about 1.2 KB of JSON, one padded with
    control characters (six bytes of JSON each) up to 24 KB, so it is padding that is left out first."""
    def opening(truncated: int) -> bytes:  # the document up to its list of records, as json.dumps writes it
        head = {"format": STATUS_FORMAT, "run_id": s.run_id, "truncated": truncated, "takes_part": _takes_part(s)}
        return json.dumps(head, ensure_ascii=False).encode()[:-1] + b', "peers": ['

    records = [json.dumps(_served(p, s), ensure_ascii=False).encode() for p in s.peers]
    room = limit - len(opening(len(records))) - len(b"]}")  # the largest count takes the most room
    kept = set()
    for i in sorted(range(len(records)), key=lambda i: len(records[i])):
        if len(records[i]) + 2 > room:  # with its separator
            break
        kept.add(i)
        room -= len(records[i]) + 2
    return opening(len(records) - len(kept)) + b", ".join(r for i, r in enumerate(records) if i in kept) + b"]}"
