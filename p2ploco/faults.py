"""Fault injection for tests: fail, stall or kill this peer at a named point of a round.

Set ``P2PLOCO_FAULTS`` to a comma-separated list of ``point@round=action``, for example
``allreduce.contribute@3=kill,inner.step@5=stall:20``. Actions: ``kill`` (SIGKILL this process, as a
crash would), ``stall:SECONDS`` (hang there), ``fail`` (raise InjectedFault, a TransportError, as a broken
link would), ``fail:N`` (only the first N times the point is reached in that round: a link that breaks
once), ``slow:FACTOR`` (``inner.step`` only: every step takes FACTOR times its own compute time, as on a
slower GPU). ``@round`` may be left out to hit the point in every round. Points:

- ``inner.step``           before each inner step
- ``matchmaking.join``     as this peer asks a coordinator (itself included) to take it into the round's
                           group (a failure there is an answer that never arrives)
- ``matchmaking.grouped``  after this peer learnt its group
- ``allreduce.contribute`` after sending the first contribution to another reducer
- ``allreduce.reduce``     before this peer answers the senders of its span
- ``commit.vote``          as this peer asks the coordinator for the round's outcome (a failure there is a
                           decision that never arrives)
- ``state.serve``          before this peer serves a range of its state to a peer catching up
- ``start.load``           (``node start``, round 0) before the config is read: a signal there ends the start-up
- ``start.join``           (``node start``, round 0) once the node has joined the swarm, before it trains or says so

A stall says on stderr where it stalls (``fault: stalling at POINT``), so that a test acts once it is there. Without
the variable every hit is a dictionary lookup that finds nothing.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from p2ploco.errors import TransportError

POINTS = ("inner.step", "matchmaking.join", "matchmaking.grouped", "allreduce.contribute", "allreduce.reduce",
          "commit.vote", "state.serve", "start.load", "start.join")


class InjectedFault(TransportError):
    """Raised where a ``fail`` fault was asked for; handled like any broken connection."""


@dataclass(frozen=True)
class Fault:
    action: str  # kill, stall, fail, slow
    seconds: float = 0.0  # how long a stall lasts
    factor: float = 1.0  # how many times its compute time a slowed step takes
    times: int = 0  # a failure only at the first this many hits (0: at every one)


def parse(spec: str) -> dict[tuple[str, int | None], Fault]:
    faults = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        where, _, action = item.partition("=")
        point, _, round_text = where.partition("@")
        if point not in POINTS:
            raise ValueError(f"P2PLOCO_FAULTS: unknown point {point!r}; known: {', '.join(POINTS)}")
        kind, _, value = action.partition(":")
        valid = ((kind == "kill" and not value) or (kind == "stall" and bool(value))
                 or (kind == "fail" and (not value or value.isdigit() and int(value) > 0))
                 or (kind == "slow" and point == "inner.step" and _factor(value) >= 1))
        if not valid:
            raise ValueError(f"P2PLOCO_FAULTS: bad action {action!r}; use kill, fail, fail:TIMES, stall:SECONDS or "
                             f"(at inner.step) slow:FACTOR")
        faults[(point, int(round_text) if round_text else None)] = (
            Fault(kind, float(value)) if kind == "stall" else Fault(kind, factor=float(value)) if kind == "slow"
            else Fault(kind, times=int(value or 0)))
    return faults


def _factor(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return 0.0


ACTIVE = parse(os.environ.get("P2PLOCO_FAULTS", ""))
_hits: Counter[tuple[str, int]] = Counter()  # (point, round) -> times reached, for fail:N


def _find(point: str, round_index: int) -> Fault | None:
    return ACTIVE.get((point, round_index)) or ACTIVE.get((point, None))


def hit(point: str, round_index: int) -> None:
    """A fault point in synchronous code."""
    fault = _find(point, round_index)
    if fault is None:
        return
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.action == "stall":
        print(f"fault: stalling at {point}", file=sys.stderr, flush=True)
        time.sleep(fault.seconds)
    if fault.action == "fail":
        _hits[(point, round_index)] += 1
        if not fault.times or _hits[(point, round_index)] <= fault.times:
            raise InjectedFault(f"injected failure at {point} in round {round_index}")


def stretch(point: str, round_index: int, seconds: float) -> None:
    """After work that took ``seconds`` at ``point``: with a ``slow:FACTOR`` fault there, wait until it has taken
    FACTOR times as long."""
    fault = _find(point, round_index)
    if fault is not None and fault.action == "slow":
        time.sleep((fault.factor - 1.0) * seconds)


async def hit_async(point: str, round_index: int) -> None:
    """A fault point on the event loop (a stall must not block the loop's other work)."""
    fault = _find(point, round_index)
    if fault is not None and fault.action == "stall":
        print(f"fault: stalling at {point}", file=sys.stderr, flush=True)
        await asyncio.sleep(fault.seconds)
    elif fault is not None:
        hit(point, round_index)


# ---- seams: where a test puts a hostile behaviour in place of an honest one, by name ---------------------------------
#
# A hostile peer in the tests (``tests/hostile.py``) is a real node with one behaviour swapped. It swaps it here, at a
# named seam, never by patching a private name: a seam that is renamed or removed makes ``swap`` fail at once, where a
# patched private name would leave the attack silently disarmed.

SEAMS = {
    "sync.forming": "a sync's FORMING state (``sync/communicator.py``), given the sync: what it syncs, what it sends "
                    "before it joins",
    "reduce.contribute": "how a member sends its contribution to one reducer (``ButterflyAllReduce``)",
    "answer.contributions": "how a reducer answers the streams of contributions to its spans",
    "answer.state": "how a donor answers peers catching up (``StateServer``)",
    "answer.dialback": "how a public peer answers dial-back requests (``DialBack``)",
    "reduce.result": "the result a reducer answers for its own span of a sparse exchange, from the span's mean "
                     "(``SparseExchange.resparsify``; its audits of others' results stay honest)",
    "coordinator.decide": "how a coordinator decides a round from its members' votes (``sync/tally.py``'s ``decide``)",
    "audit.check": "how a member re-reduces the piece it audits and judges the result (``collective/exchange.audit``)",
}
_swapped: dict[str, Callable[[Any, Callable[..., Any]], Callable[..., Any]]] = {}


def swap(seam: str, replacement: Callable[[Any, Callable[..., Any]], Callable[..., Any]] | None) -> None:
    """From now on, this process does ``replacement(owner, honest)`` at ``seam`` instead of ``honest`` (``owner``:
    the object whose behaviour it is; None: the honest behaviour again). For hostile peers in tests, and for the
    simulation's peers that share one process (``simulation/``), only."""
    if seam not in SEAMS:
        raise ValueError(f"no seam {seam!r}; seams: {', '.join(SEAMS)}")
    if replacement is None:
        _swapped.pop(seam, None)
    else:
        _swapped[seam] = replacement


def seam(name: str, owner: Any, honest: Callable[..., Any]) -> Callable[..., Any]:
    """What ``owner`` does at seam ``name``: ``honest``, unless a test swapped it (``swap``)."""
    replacement = _swapped.get(name)
    return honest if replacement is None else replacement(owner, honest)
