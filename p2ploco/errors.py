"""The two kinds of error p2ploco raises, and what went wrong for a peer in a round.

``P2PLocoError`` and its subclasses reach a person: each carries one line that says what is wrong and how to fix
it. ``ProtocolError`` and its subclasses are about another peer: what it sent, or how the link to it behaved.
The code that talks to that peer handles them (drops, bans, misses or asks again), and turns one that decides this
node's fate into a ``P2PLocoError`` that says so (a status endpoint that answers garbage: ``SwarmError``)."""

import enum


class P2PLocoError(Exception):
    """Base class; the CLI prints ``error: <message>`` and exits non-zero, never a traceback."""


class ConfigError(P2PLocoError):
    """A config file, a --set override or a CLI argument is malformed or impossible."""


class SwarmError(P2PLocoError):
    """The swarm cannot be reached or joined (bad address, unreachable bootstrap, identity taken)."""


class TrainingError(P2PLocoError):
    """This node's own training went wrong (e.g. a pseudo-gradient with NaN after divergence)."""


class CheckpointError(P2PLocoError):
    """A checkpoint is missing, corrupt, or belongs to another run or config; nothing is overwritten."""


class PipelineError(P2PLocoError):
    """A pipeline group could not finish a step: a stage did not answer in time or sent a malformed message."""


class ProtocolError(Exception):
    """Base class of what another peer sent or how the link to it behaved; the code that talks to it handles it."""


class PayloadError(ProtocolError):
    """A message from another peer is malformed (it broke the protocol): its sender is dropped from the round,
    and may be banned for it."""


class TransportError(ProtocolError):
    """The link to another peer failed: it could not be dialled, or a stream broke or ended mid-message. Nobody's
    content was at fault and nobody is banned for it: the peer may have crashed, or its link failed for a moment."""


class Failure(enum.StrEnum):
    """What went wrong for a peer in a round. Its record counts them by kind (``RoundSummary.failures``), and
    ``benchmarks/soak.py`` sums them over a run."""

    STREAM_CLOSED = "stream closed"  # a stream ended mid-message
    STREAM_BROKE = "stream broke"  # a stream was reset, or broke while written
    UNREACHABLE = "unreachable"  # no stream to a peer could be opened
    TIMEOUT = "timeout"  # a peer did not send or answer in time
    MALFORMED = "malformed"  # a peer sent what breaks the protocol (it is banned)
    REJECTED = "rejected"  # a reducer refused this peer's contribution as malformed: it was out of the round
    MISSED = "missed"  # a reducer went on without this peer's contribution (its link failed, or it was too late)
    OPPOSED = "opposed"  # a reducer left this peer's contribution out: it pointed against the others'
    LATE = "late"  # the group had started without this peer
    LEFT_OUT = "left out"  # the coordinator left this peer out: another state than the others', or a pipeline
    # group that did not bring every stage
    SMALLER_GROUP = "smaller group"  # the coordinator closed the group without some peers that were expected
    NO_DECISION = "no decision"  # the coordinator's decision on the round never reached this peer
    ABORTED = "aborted"  # the coordinator dropped the round for everyone
    ALONE = "alone"  # this peer could not join the others working on the round: it applied nothing
    NO_COORDINATOR = "no coordinator"  # other trainers of the run live, but none of them, and no hub, can be dialled
    # to coordinate: this peer applied nothing (its work waits for the first round it shares)


MAX_SHOWN = 1000  # characters of someone else's text that one log line or terminal cell shows


def shown(text: str, limit: int = MAX_SHOWN) -> str:
    """``text`` that someone else wrote (a peer's name or reason, a run id from the DHT, a server's answer), as it
    may reach a log or a terminal: every character that is not printable (control characters, among them the ESC
    of ANSI sequences and the line breaks that would forge a log line; bidirectional overrides; unassigned code
    points) written as its Python escape (``\\x1b``, ``\\n``, ``\\u202e``), and the whole cut to ``limit``
    characters. Shown text is shown unchanged, so showing twice does no harm. Rich markup is escaped where rich
    renders (``monitor.peers_rich``), not here: a log or a plain terminal does not interpret it."""
    if not text.isprintable():
        text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[:limit - 3] + "..."
