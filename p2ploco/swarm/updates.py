"""Catching up by the rounds' updates: a peer that missed a few rounds fetches what they changed, not the state.

A round of SparseLoCo changes a few percent of a slice's values (its aggregate is sparse); a peer that sat it out
used to fetch the whole state again (600 MB at 150M) for a change of a few MB. Now every peer keeps what its last
rounds changed, and serves it like a snapshot.

**An update** is the change between two states of one slice that a peer served one after the other (the states
its record vouched for at two rounds, ``Snapshot``): for every tensor (params and shared outer state) that changed,
the flat positions whose float32 bits differ and the new values there, nothing else. Applying one is an assignment
(``tensor[positions] = values``), never arithmetic: the result is bit-identical to the state it leads to, whatever
the outer algorithm (SparseLoCo's sparse step, DiLoCo's momentum, Streaming DiLoCo's fragments, a state a peer
fetched itself), and nothing but the two states decides the bytes, so every honest peer that served the same two
states serves the same update (the same manifest) and donors agree on it as they agree on a state. A dense
algorithm changes every value: its update would be larger than the state, so none is kept and the state is
fetched, as before. Positions are int32 (int64 for a tensor of 2^31 values or more): 8 bytes a changed value.

**Keeping** (``UpdateKeeper``): each peer diffs the state it serves against the one it served before, before it serves
it and says so in its record (so that a peer that reads the record finds the update kept; a pass over the state, 0.27 s
a round at 150M on two cores: ``benchmarks/catchup.py --updates``), and keeps per slice the newest updates whose bytes
add up to at most a quarter of the state's (``KEEP_SHARE``). A chain is fetched only while its bytes are fewer than the
state's, so a longer one is never used; a quarter costs a peer at most 1 byte a parameter in fp32 (the memory floor is
24-32), and holds the last three rounds of SparseLoCo at 150M with two peers (38 MB each, a sixteenth of the state; a
peer that missed more fetches the state). The keeper holds the last state it served by reference (the server holds it
anyway: ``KEEP_SNAPSHOTS``), never a copy.

**Fetching** (``describe_chain``, ``fetch_chain``, ``applied``): a peer behind asks the vouched state's holders
for the update from its own state's digest (``StateRequest`` with ``blob: update`` and ``base``), learns from the
description the state it leads to, and asks again from there, until the chain reaches the vouched state (at most
``MAX_CHAIN`` links, each description a round trip). If the chain's bytes are fewer than the state's it fetches
them through the state's range machinery (``state_fetch.fetch_blob``: every range checked against the manifest most
donors describe, donors whose ranges do not match blamed), applies them to new tensors (the published state is
never written: ``outer/base.py``) and hashes the result once. The state the swarm vouches for is the judge: a
result that does not hash to it is replayed link by link, hashing after each, and the donors of the first link
whose result is not the state they said it leads to are blamed (an honest link applied to the state it starts
from always is); then the state is fetched instead. A missing link, one larger than what is left of the budget,
or a chain that leads elsewhere (a donor that fetched its state itself kept another history) blames nobody and
fetches the state.

What does a donor gain by lying? An update that leads elsewhere is caught by the vouched digest: its donors are
banned (``swarm/bans.py``) and the peer fetches the state, a round lost at most, as with a lying snapshot. A
donor that describes a chain that never ends, or a huge link, is bounded by ``MAX_CHAIN`` and the budget. k keys
that outnumber the honest donors win a link's ranking, and are all banned once it is applied.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from hivemind.p2p import P2P
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from p2ploco.errors import PayloadError, TransportError
from p2ploco.metrics import state_digest
from p2ploco.swarm.consensus import SwarmState
from p2ploco.swarm.deadlines import TransferDeadline
from p2ploco.swarm.messages import decode
from p2ploco.swarm.state import LATEST, MAX_MANIFEST_BYTES, RANGE_BYTES, BytesBlob, Snapshot, StateAnswer, StateStatus
from p2ploco.swarm.state_fetch import Blame, Description, fetch_blob, request_range
from p2ploco.swarm.state_server import Served

logger = logging.getLogger(__name__)

KEEP_SHARE = 4  # a slice's kept updates take at most 1/KEEP_SHARE of its state's bytes (see the docstring)
# links of a chain a peer follows: each costs a description's round trip to every donor (up to a second across
# continents); a chain of real updates meets the byte budget first (16 rounds of SparseLoCo at 150M outweigh the
# state): this bounds a chain of tiny links that lying donors describe
MAX_CHAIN = 64
WIDE_POSITIONS = 1 << 31  # a tensor with this many values or more has its positions in int64

Changes = dict[str, tuple[torch.Tensor, torch.Tensor]]  # "param/<name>" or "shared/<key>" -> (positions, values)


def named_tensors(snapshot: Snapshot) -> dict[str, torch.Tensor]:
    """A snapshot's tensors as its blob names them: ``param/<name>``, ``shared/<key>``."""
    return {**{f"param/{k}": v for k, v in snapshot.params.items()},
            **{f"shared/{k}": v for k, v in snapshot.shared.items()}}


@dataclass
class Update(Served):
    """What turned a slice's state ``base`` (at ``round``, the round it starts from) into ``state_digest``, served
    as a blob: a safetensors file of ``at/<tensor>`` positions and ``to/<tensor>`` values."""

    base: str = ""  # ``metrics.state_digest`` of the state it applies to

    @classmethod
    def between(cls, before: Snapshot, after: Snapshot, limit: int) -> Update | None:
        """The update from ``before`` to ``after`` (two states of one slice); None if its changes take more than
        ``limit`` bytes (found out tensor by tensor: a dense step's update is never built), or if the two are not
        states of the same tensors (names or shapes differ)."""
        old, new = named_tensors(before), named_tensors(after)
        if set(old) != set(new) or any(old[k].shape != new[k].shape or {old[k].dtype, new[k].dtype} != {torch.float32}
                                       for k in new):
            return None
        tensors, size = {}, 0
        for key in sorted(new):
            if new[key] is old[key]:  # a tensor the step did not replace (never written in place: unchanged)
                continue
            flat_old, flat_new = old[key].reshape(-1), new[key].reshape(-1)
            # bits, not values: -0.0 and 0.0 differ, and an assignment of the new bits is exact
            changed = flat_old.view(torch.int32) != flat_new.view(torch.int32)
            wide = flat_new.numel() >= WIDE_POSITIONS
            size += int(changed.sum()) * (12 if wide else 8)
            if size > limit:
                return None
            at = torch.nonzero(changed).squeeze(1)
            if at.numel():
                tensors[f"at/{key}"] = at.to(torch.int64 if wide else torch.int32)
                tensors[f"to/{key}"] = flat_new[at].contiguous()
        return cls(before.round, after.slice, after.state_digest, BytesBlob(save_tensors(tensors)),
                   base=before.state_digest)


def changes_of(blob: bytes, shapes: dict[str, torch.Size]) -> Changes:
    """The changes ``blob`` (an update) holds, checked against the slice's tensors (``shapes``: by blob name);
    PayloadError if it is not an update of them: positions that are not strictly increasing flat positions of the
    tensor, values that are not as many finite float32."""
    try:
        tensors = load_tensors(blob)
    except (SafetensorError, ValueError, TypeError, OverflowError) as e:  # what safetensors raises on garbage
        raise PayloadError(f"update blob is not a safetensors file: {e}") from None
    changes: Changes = {}
    for key, at in tensors.items():
        section, _, name = key.partition("/")
        if section == "to" and name in shapes and f"at/{name}" in tensors:
            continue  # read with its positions
        if section != "at" or name not in shapes or f"to/{name}" not in tensors:
            raise PayloadError(f"update blob holds an unexpected tensor {key[:64]!r}")
        values, numel = tensors[f"to/{name}"], shapes[name].numel()
        if at.dtype not in (torch.int32, torch.int64) or at.dim() != 1 or not len(at):
            raise PayloadError(f"update positions of {name[:64]!r} are not a list of integers")
        if bool((at[1:] <= at[:-1]).any()) or int(at[0]) < 0 or int(at[-1]) >= numel:
            raise PayloadError(f"update positions of {name[:64]!r} are not increasing positions of its "
                               f"{numel} values")
        if values.dtype != torch.float32 or values.shape != at.shape or not bool(torch.isfinite(values).all()):
            raise PayloadError(f"update values of {name[:64]!r} are not {len(at)} finite float32")
        changes[name] = (at.to(torch.int64), values)
    return changes


def applied(own: Snapshot, chain: Sequence[Changes], round_index: int) -> Snapshot:
    """``own`` with the changes of ``chain`` assigned in turn, as the state of ``round_index``: new tensors for the
    ones changed (``own``'s, a published state, are never written), the others shared; hashed."""
    tensors = named_tensors(own)
    fresh: dict[str, torch.Tensor] = {}
    for changes in chain:
        for name, (at, values) in changes.items():
            if name not in fresh:
                fresh[name] = tensors[name].clone()
            fresh[name].view(-1)[at] = values
    tensors.update(fresh)
    params = {k.partition("/")[2]: v for k, v in tensors.items() if k.startswith("param/")}
    shared = {k.partition("/")[2]: v for k, v in tensors.items() if k.startswith("shared/")}
    return Snapshot(round_index, own.slice, params, shared, state_digest(params, shared))


class UpdateKeeper:
    """The updates this peer serves: per slice, the newest whose bytes fit in 1/KEEP_SHARE of the state's, each
    found by the digest of the state it starts from."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # ``keep`` runs on the training thread, ``find`` on the server's loop
        self.last: dict[str, Snapshot] = {}  # slice -> the state served last (by reference: never written)
        self.kept: dict[str, OrderedDict[str, Update]] = {}  # slice -> base digest -> update, oldest first

    def keep(self, snapshots: Sequence[Snapshot]) -> None:
        """Serve ``snapshots`` (one per slice held) from now on as the states reached last: keep the update from the
        state served before them, if it fits."""
        for snapshot in snapshots:
            before = self.last.get(snapshot.slice)
            self.last[snapshot.slice] = snapshot
            if before is None or before.state_digest == snapshot.state_digest:
                continue
            bound = sum(t.numel() * t.element_size() for t in named_tensors(snapshot).values()) // KEEP_SHARE
            update = Update.between(before, snapshot, bound)
            if update is None:
                continue
            with self.lock:
                kept = self.kept.setdefault(snapshot.slice, OrderedDict())
                kept.pop(update.base, None)
                kept[update.base] = update
                while sum(u.blob.total for u in kept.values()) > bound:
                    kept.popitem(last=False)

    def find(self, slice_name: str, base: str) -> Update | None:
        """The update of ``slice_name`` from the state ``base``, if kept."""
        with self.lock:
            return self.kept.get(slice_name, {}).get(base)


# ---- a peer that catches up --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Link:
    """One update of a chain, as the donors that agree on it describe it."""

    base: str  # the state it starts from
    target: SwarmState  # the round it starts, the state it leads to, and its donors
    description: Description


@dataclass(frozen=True)
class Chain:
    """The updates that lead from a peer's own state of a slice to the one the swarm vouches for."""

    own: Snapshot
    target: SwarmState
    links: tuple[Link, ...]

    @property
    def bytes(self) -> int:
        return sum(link.description.total for link in self.links)

    @property
    def donors(self) -> set[str]:
        return {donor for link in self.links for donor in link.target.holders}


async def describe_update(p2p: P2P, handler: str, slice_name: str, base: str, donors: Sequence[str],
                          deadline: TransferDeadline, budget: int, blame: Blame, rates: Sequence[float] = ()
                          ) -> Link | None:
    """The update of ``slice_name`` from the state ``base`` as most of ``donors`` describe it, if one does and it
    is smaller than ``budget`` bytes; a donor whose description is malformed is blamed."""
    async def describe(donor: str) -> tuple[int, str, Description] | None:
        try:
            header, payload = await request_range(p2p, handler, donor, LATEST, slice_name, 0, 0,
                                                  deadline.seconds(MAX_MANIFEST_BYTES, rates), base)
            answer = decode(StateAnswer, header)
            if answer.status != StateStatus.OK:
                return None
            if answer.slice != slice_name or answer.state_digest == base:
                raise PayloadError("it answered for another update")
            if len(payload) != 32 * -(-answer.total // RANGE_BYTES):
                raise PayloadError(f"a manifest of {len(payload)} bytes for a {answer.total}-byte update")
            return answer.round, answer.state_digest, Description(answer.total, payload)
        except PayloadError as e:
            blame(donor, f"it described the update of {slice_name} from {base[:10]} falsely ({e})")
        except (TransportError, TimeoutError) as e:  # unreachable or slow donors are skipped, unblamed
            logger.info(f"donor {donor[-8:]} did not describe its update: {e!r}")
        return None

    described = await asyncio.gather(*(describe(donor) for donor in donors))
    agreeing: dict[tuple[int, str, Description], list[str]] = {}
    for donor, description in zip(donors, described):
        if description is not None:
            agreeing.setdefault(description, []).append(donor)
    if not agreeing:
        return None
    (round_index, digest, description), holders = min(
        agreeing.items(), key=lambda item: (-len(item[1]), hashlib.sha256(item[0][2].manifest).digest()))
    if description.total >= budget:
        return None
    return Link(base, SwarmState(round_index, slice_name, digest, tuple(holders)), description)


async def describe_chain(p2p: P2P, handler: str, own: Snapshot, target: SwarmState, donors: Sequence[str],
                         deadline: TransferDeadline, budget: int, blame: Blame, rates: Sequence[float] = ()
                         ) -> Chain | None:
    """The updates from ``own`` to ``target`` that ``donors`` keep, if they lead there in at most ``MAX_CHAIN``
    links of fewer than ``budget`` bytes in all; None otherwise."""
    base, links, spent = own.state_digest, [], 0
    while base != target.state_digest:
        if len(links) == MAX_CHAIN:
            return None
        link = await describe_update(p2p, handler, target.slice, base, donors, deadline, budget - spent, blame, rates)
        if link is None or link.target.state_digest in {own.state_digest, *(k.base for k in links)}:
            return None  # missing, too large, or a loop: the state it is
        links.append(link)
        spent += link.description.total
        base = link.target.state_digest
    return Chain(own, target, tuple(links))


async def fetch_chain(p2p: P2P, handler: str, chain: Chain, deadline: TransferDeadline, blame: Blame,
                      rates: Sequence[float] = ()) -> list[Changes] | None:
    """The changes of every link of ``chain``, each checked against its manifest and the slice's tensors; None if a
    link could not be fetched (donors whose blob is no update of this slice are blamed)."""
    shapes = {name: t.shape for name, t in named_tensors(chain.own).items()}
    fetched = []
    for link in chain.links:
        blob = await fetch_blob(p2p, handler, link.target, link.description, list(link.target.holders), deadline,
                                blame, rates, link.base)
        if blob is None:
            return None
        try:
            fetched.append(changes_of(bytes(blob.data), shapes))
        except PayloadError as e:
            for donor in link.target.holders:
                blame(donor, f"it served the update of {chain.target.slice} from round {link.target.round} falsely "
                             f"({e})")
            return None
    return fetched


def caught_up(chain: Chain, changes: Sequence[Changes], blame: Blame) -> Snapshot | None:
    """``chain.own`` with ``changes`` (the chain's, in order) applied, if it is the state the swarm vouches for;
    else None, and the donors of the first link whose result is not the state they said it leads to are blamed."""
    result = applied(chain.own, changes, chain.target.round)
    if result.state_digest == chain.target.state_digest:
        return result
    for count, link in enumerate(chain.links, 1):  # replayed: which link led elsewhere
        if applied(chain.own, changes[:count], link.target.round).state_digest != link.target.state_digest:
            for donor in link.target.holders:
                blame(donor, f"its update of {chain.target.slice} from round {link.target.round} does not lead to "
                             f"the state it described")
            break
    return None
