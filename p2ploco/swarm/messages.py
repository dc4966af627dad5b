"""The one decoder of what other peers say: typed, bounded fields and ``decode``.

Every message a peer sends (a join, a group, a vote, a decision, a contribution, a reducer's answer, a state
request or description, a stage message) is a pydantic model of its own, next to the protocol that uses it,
built from the field types below. The models are strict (an int is no float and no bool, a string is no bytes),
every string, list, map and integer is bounded, and a status is checked against its Enum as a string before it is
looked up, so that no value, however deep or odd, is ever formatted or hashed. ``decode`` turns any mismatch
into one PayloadError that names the message and the field, never the value; no other exception can come out of
it. (A header is a msgpack map no deeper than ``wire.MAX_DEPTH``: the wire refuses deeper ones before any of
this runs.) Checks that need context (a group that must name this peer, a span that must be this reducer's)
stay with the code that has the context. A peer's text (a reason) is for people only: it is decoded as
``errors.shown`` writes it, escaped and bounded, so that no log line or terminal that shows it acts on it; a peer
id is letters and digits, as base58 is, so that its tail in a log line is too.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PlainValidator, StringConstraints, ValidationError

from p2ploco.errors import PayloadError, shown

MAX_PEER_ID = 128  # a base58 peer id is ~52 characters
MAX_PEERS = 4096  # members of one group; peers one message may list
# The header a message that may name every member of a group takes (a group answer to a joiner that follows no group,
# as all do in a run's first round: ~170 bytes a full replica, 700 kB at MAX_PEERS, more for stage peers, which name
# more slices; a reducer's receipt: ~30 bytes a contribution; a vote's drops, a redo's members: ~50 bytes a peer),
# past the 64 KiB of any other (``wire.MAX_HEADER_BYTES``): with that limit every joiner of a group of more than ~380
# refused its coordinator's answer in the simulation
MAX_GROUP_HEADER = 1 << 20
MAX_SLICES = 64  # named slices (pipeline stages, fragments) one message may list
MAX_ROUND = 1 << 48  # rounds, at one a second, for nine million years
MAX_REASON = 1000  # characters of a reason kept (longer ones are cut, not refused)
MAX_TOKENS = 1 << 48  # tokens one contribution may claim on the wire (a run caps them at its round's, far lower)

PeerId = Annotated[str, StringConstraints(min_length=1, max_length=MAX_PEER_ID, pattern="^[0-9A-Za-z]+$")]
SliceName = Annotated[str, StringConstraints(min_length=1, max_length=32)]
Digest = Annotated[str, StringConstraints(max_length=128)]  # a hash, a fingerprint or a group id
Name = Annotated[str, StringConstraints(max_length=64)]  # an all-reduce's or a pipeline group's name
Round = Annotated[int, Field(ge=0, le=MAX_ROUND)]
# tokens a contribution was trained on: its weight (0: a hub's join, which contributes nothing)
Tokens = Annotated[int, Field(ge=0, le=MAX_TOKENS)]
Norm = Annotated[float, Field(ge=0.0, lt=2.0**64, allow_inf_nan=False)]  # of a contribution (collective/robust.py)
Reason = Annotated[str, AfterValidator(lambda text: shown(text, MAX_REASON))]  # escaped, cut (not refused)
Digests = Annotated[dict[SliceName, Digest], Field(max_length=MAX_SLICES)]  # slice -> hash


def _sorted_distinct(items: list[Any]) -> list[Any]:
    if items != sorted(set(items)):
        raise ValueError("not a sorted list of distinct items")
    return items


PeerIds = Annotated[list[PeerId], Field(max_length=MAX_PEERS), AfterValidator(_sorted_distinct)]
# members named by their place in a group's sorted member list: 1-3 bytes each on the wire where an id takes ~54
Positions = Annotated[list[Annotated[int, Field(ge=0, lt=MAX_PEERS)]], Field(max_length=MAX_PEERS),
                      AfterValidator(_sorted_distinct)]

E = TypeVar("E", bound=enum.Enum)
M = TypeVar("M", bound="Message")


def status_of(kind: type[E]) -> Any:
    """The field type of a status that must be one of ``kind``'s values, given as its string. Checked as a string
    first: Enum's own lookup would hash any other value and format it in its error. (A dict, not a walk over the
    members: every record of a lookup has three statuses, and the walk was a tenth of a simulated peer's CPU.)"""
    by_value = {member.value: member for member in kind}

    def parse(value: Any) -> E:
        if isinstance(value, str) and value in by_value:
            return by_value[value]
        raise ValueError(f"not one of {', '.join(str(member.value) for member in kind)}")

    return Annotated[kind, PlainValidator(parse)]


class Message(BaseModel):
    """A message from another peer: strict types, unknown fields ignored (newer peers may add some)."""

    model_config = ConfigDict(strict=True, frozen=True, extra="ignore")


def decode(model: type[M], header: Any) -> M:
    """``header`` as a ``model``, or PayloadError naming the first field that does not fit (never its value)."""
    try:
        return model.model_validate(header)
    except ValidationError as e:
        error = e.errors(include_url=False, include_context=False, include_input=False)[0]
        where = ".".join(shown(str(part), 32) for part in error["loc"]) or "the message"  # a key may be the peer's
        raise PayloadError(f"{model.__name__}: {where}: {shown(error['msg'], 200)}") from None
