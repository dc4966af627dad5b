"""The all-reduce's values (``sync/reduce.py``): its wire messages, what came of one transfer of a piece, and what came
of one attempt for this peer."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Annotated

from pydantic import Field, StringConstraints, model_validator

from p2ploco.collective.exchange import CONTRIBUTION_DIGEST_BYTES, Receipt, Span, SpanReduction, Traffic
from p2ploco.errors import Failure, ProtocolError
from p2ploco.swarm.evidence import MAX_SIGNATURE
from p2ploco.swarm.messages import (
    MAX_PEERS,
    Digest,
    Message,
    Norm,
    PeerId,
    Positions,
    Reason,
    Round,
    SliceName,
    status_of,
)

MAX_UNITS = 1 << 40  # units (values, or chunks) of a slice a piece may name


class ReduceStatus(enum.StrEnum):
    OK = "ok"  # the piece's aggregate follows
    REJECTED = "rejected"  # the sender's contribution was malformed: it is out of this round
    MISSED = "missed"  # the sender's contribution is not in the aggregate: its link failed, or it came too late


class AllReduceError(ProtocolError):
    """This peer could not obtain the aggregate of some piece; the round's all-reduce failed for it.
    ``failure``: what went wrong, as the round's record counts it."""

    def __init__(self, message: str, failure: Failure):
        super().__init__(message)
        self.failure = failure


class DroppedFromRound(AllReduceError):
    """A reducer rejected this peer's contribution as malformed: it is out of this round, and must not block
    the others."""


class ReducerElsewhere(AllReduceError):
    """A reducer takes part in this round in a group another coordinator formed, or in another version of this
    group: it never takes part in this peer's group, sends it nothing, and reduces nothing for it."""


class OtherVersion(ReducerElsewhere):
    """A reducer holds another version of this peer's group: ``version`` (its digest), which the coordinator signed
    (``grant``) as it signed this peer's: with both, the coordinator is proven to have handed out two."""

    def __init__(self, message: str, version: str, grant: bytes):
        super().__init__(message, Failure.MISSED)
        self.version, self.grant = version, grant


class TransferOutcome(enum.Enum):
    """What came of one transfer of a piece between a member and a reducer, as either side saw it. What this peer
    does about the other side follows from it alone (``ButterflyAllReduce._act_on``)."""

    DELIVERED = "delivered"  # the piece's result came back (a member) or went out (a reducer)
    REFUSED = "refused"  # the other side said no, or is out of the piece already: nothing more to do
    LATE = "late"  # a reducer did not answer in time: slow is not dead (its own contributions may still come)
    MISSED = "missed"  # the other side's link failed, or it is too late: this peer goes on without it, no blame
    ELSEWHERE = "elsewhere"  # it takes part in this round in another group, or in another version of this one
    OPPOSED = "opposed"  # a reducer's result pointed against this peer's contribution: struck, and accused
    MALFORMED = "malformed"  # its message was malformed: rejected from this peer's pieces and banned (accused)


@dataclass(frozen=True)
class Evidence:
    """A piece's aggregate as this peer took it: its reducer, its digest (``Exchange.receive``) and the reducer's
    signature of it (``evidence.result_statement``). A vote lists them, so that a reducer that answered members
    different results is caught by its own signatures."""

    slice: str
    piece: Span
    reducer: str
    digest: bytes
    signature: bytes
    # what an auditor of the piece needs (``sync/audit.py``), where this peer took it from another reducer: the
    # receipt it came with, and the senders of the contributions the receipt names, in its order
    receipt: Receipt | None = field(default=None, compare=False)
    weighed: tuple[str, ...] = field(default=(), compare=False)


@dataclass(frozen=True, kw_only=True)
class Delivery:
    """Our contribution to one piece, sent to its reducer, and what came of it."""

    reducer: str
    encoded: int  # bytes of our contribution
    outcome: TransferOutcome = TransferOutcome.DELIVERED
    reason: str = ""  # why, where the outcome is not DELIVERED: what this peer records against the reducer
    sent: int = 0  # of them on the wire (0: it never went out)
    received: int = 0  # bytes of the aggregate that came back
    left_out: frozenset[str] = frozenset()  # contributors to the slice whose contributions are not in that aggregate
    combined: frozenset[str] = frozenset()  # members whose contributions are in it, as the reducer's answer names them
    opposed_ours: bool = False  # the reducer left our contribution out: it pointed against the others'
    error: AllReduceError | None = None  # None: we hold the piece's aggregate
    evidence: Evidence | None = None  # the piece's aggregate as we took it, with the reducer's signature

    @property
    def accused(self) -> bool:
        """Its answer was malformed, or its result pointed against our contribution: our vote accuses it."""
        return self.outcome in (TransferOutcome.OPPOSED, TransferOutcome.MALFORMED)


@dataclass(frozen=True)
class Attempt:
    """One butterfly among a group, as it went for this peer (``ButterflyAllReduce.run``)."""

    traffic: Traffic  # this attempt's bytes and parameters (the communicator times the whole round)
    dropped: frozenset[str]  # members left out of some piece's aggregate
    rejected: frozenset[str]  # members whose contributions to our pieces we rejected as malformed (or banned here)
    refused: frozenset[str]  # reducers whose result we refused (malformed, too long, against our contribution)
    # members whose contributions are in our aggregates, and reducers that sent us theirs: they took part with a
    # daemon of their own (a member the coordinator named that has none delivers nothing)
    delivered: frozenset[str]
    clipped: list[str]  # senders whose contribution to our pieces was scaled down
    opposed: list[str]  # senders we left out of our pieces: against the others'
    failures: list[Failure]  # what went wrong here, one entry per event
    error: AllReduceError | None = None  # None: the exchange holds the aggregate of every piece
    elsewhere: frozenset[str] = frozenset()  # reducers that take part in this round in another group
    refused_by: frozenset[str] = frozenset()  # reducers that rejected our contribution as malformed
    evidence: tuple[Evidence, ...] = ()  # every non-empty piece's aggregate we took, in slice and piece order


@dataclass(frozen=True)
class Reduced:
    """A piece this peer reduced: what it combined, and the result it answers every member, signed."""

    reduction: SpanReduction
    evidence: Evidence


GroupDigest = Annotated[str, StringConstraints(pattern="^[0-9a-f]{64}$")]  # ``Group.digest``
Signature = Annotated[bytes, Field(max_length=MAX_SIGNATURE)]
ContributionDigest = Annotated[bytes, Field(min_length=CONTRIBUTION_DIGEST_BYTES, max_length=CONTRIBUTION_DIGEST_BYTES)]


class Contribution(Message):
    group_id: Digest
    round: Round
    slice: SliceName
    span: Annotated[list[Annotated[int, Field(ge=0, le=MAX_UNITS)]], Field(min_length=2, max_length=2)]  # the piece
    coordinator: PeerId = ""  # who formed the sender's group ("": not said; the reducer waits for the group)
    listen: bool = False  # a hub's request for the piece's result: no payload (``Group.contributors``)
    version: GroupDigest  # the digest of the group as the sender holds it: a reducer holding another refuses it


class ReduceAnswer(Message):
    status: status_of(ReduceStatus)
    reason: Reason = ""
    included: Positions = []  # with ok: the members whose contributions make up the aggregate that follows
    norms: Annotated[list[Norm], Field(max_length=MAX_PEERS)] = []  # of the included contributions, in order
    opposed: Positions = []  # with ok: members whose contributions it left out as pointing against the others
    # with ok: the digest of each contribution it weighed, the included then the opposed (``Receipt``)
    contributions: Annotated[list[ContributionDigest], Field(max_length=MAX_PEERS)] = []
    signature: Signature = b""  # with ok: the reducer's signature of the result (``evidence.result_statement``)
    elsewhere: bool = False  # with missed: the reducer takes part in this round in another group ...
    version: GroupDigest | None = None  # ... or in another version of this group, which its coordinator signed:
    grant: Signature = b""

    @model_validator(mode="after")
    def _aligned(self) -> ReduceAnswer:
        if len(self.norms) != len(self.included):
            raise ValueError("norms that do not name one norm per included contribution")
        if len(self.contributions) != len(self.included) + len(self.opposed):
            raise ValueError("contributions that do not name one digest per contribution weighed")
        if self.elsewhere and self.status != ReduceStatus.MISSED:
            raise ValueError("elsewhere, with another status than missed")
        if self.status == ReduceStatus.OK and not self.signature:
            raise ValueError("a result without its reducer's signature")
        if self.version is not None and not (self.elsewhere and self.grant):
            raise ValueError("another version of the group, not elsewhere or not signed")
        return self
