"""A real p2ploco node with one hostile behaviour patched in, for tests of what the others withstand.

    python tests/hostile.py BEHAVIOUR -- node start --config ... (the usual p2ploco arguments)

Behaviours (each starts at round FROM and lasts until the node exits):

- ``scale:FACTOR@FROM``   every contribution is the honest one with all values multiplied by FACTOR
                          (well-formed: it passes every format check)
- ``flip:FACTOR@FROM``    every contribution is the honest one times FACTOR (negative: sign-flipped; -1.9 stays
                          inside the clip bound), and claims a full round's tokens, the largest weight allowed
- ``scale-result:FACTOR@FROM`` as a reducer, answers every member with its span's result times FACTOR (well-formed,
                          finite)
- ``lie-round:ROUND@FROM`` the node's DHT record claims it works on ROUND (it otherwise trains honestly
                          and serves only the states it really has)
- ``bad-header@FROM``     every contribution to another reducer starts with a msgpack list, not a map
- ``deep-status@FROM``    as a reducer, answers every contribution with a header whose ``status`` is a list
                          nested 1020 levels deep (valid msgpack: formatting it overflows Python's stack)
- ``redo-forever@FROM``   as a coordinator, answers every vote "redo" (the round's group, anew), attempt after attempt
- ``lying-donor@FROM``    serves peers catching up a state blob with one byte flipped, described by a manifest of
                          its own (its record vouches for the true state)
- ``huge-state@FROM``     describes the state it holds to peers catching up as a blob of 2**62 bytes (it used to
                          make them allocate it: MemoryError), and serves no range of it
- ``junk-joins@FROM``     before each of its rounds, sends every other peer 40 join requests for made-up configs,
                          rounds and states (it otherwise trains honestly)
- ``never-join@FROM``     its record claims every round from the round's state, but it never joins one: it waits
                          until the others have moved on, applies nothing and catches up
- ``forge-leaving@FROM``  after each store of its own record, stores one per other live peer that names that
                          peer and says it is leaving, signed with its own key
- ``huge-activations@STEP`` as a stage, sends activations scaled by 1e30 from inner step STEP on (finite in bf16;
                          a forward pass over them overflows)
- ``odd-sums@STEP``       as a stage, sends its group one addend too many, and negative ones, from step STEP on
- ``poison-state@FROM``   the node's record claims the round after its own, holding a state of its own making
                          (every parameter 0.5), and it serves that state to peers catching up: two such nodes
                          (two keys of one attacker) agree on it
- ``fast-step@FROM``      the node's record claims inner steps of 1e-300 s (it trains and takes part in rounds
                          honestly): on its word every other peer's round budget shrank to one inner step
- ``deny-dialback@0``     answers every dial-back request "dialled, reached none" (peers ask as they start, before
                          any round: FROM is not used), as if every joiner were behind a NAT
- ``equivocate@FROM``     as a reducer (or a hub), answers every other member a receipt that names another member's
                          norm 1 % longer, signed as every answer is: each member's checks pass (its own norm, the
                          length bound, the direction), and the members hold different digests of the span
- ``refuse-all@FROM``     bans every other member of each of its groups as the round's all-reduce begins: as a
                          reducer it answers each of them "banned here", and its own vote alone holds the aggregate
- ``steer:PUSH@FROM``     as a reducer, adds to its span's mean, before it compresses it as every reducer does, values
                          at positions nobody selected that together are PUSH x the mean's length, the same every
                          round (``p2ploco.testing.attacks.steered``): every member's checks pass
- ``two-versions@FROM``   as a coordinator, hands every other joiner a version of the group in which another member
                          (the victim: the first other member in id order) weighs 1 token, signed as the honest one

Everything else is the real node: the same processes, daemons and protocol as ``p2ploco node start``.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np


def scale_contributions(factor: float, start: int, claim_the_most_tokens: bool = False) -> None:
    from p2ploco import faults
    from p2ploco.compression.topk import CompressedTensor

    # The FORMING state of every sync, whichever entry point started it (all_reduce, or start_all_reduce as outer
    # rounds do): patching one public entry point alone once left the other path honest.
    def forming(communicator: Any, honest: Callable[[Any], Any]) -> Callable[[Any], Any]:
        async def scaled(sync: Any) -> Any:
            if sync.round_index >= start:
                for part in sync.exchange.parts.values():  # every slice's sparse exchange
                    part.compressed = [CompressedTensor(c.grid, c.indices, c.codes, np.float32(c.shift * factor),
                                                        (c.table * np.float32(factor)).astype(np.float32))
                                       for c in part.compressed]
                if claim_the_most_tokens:
                    sync.exchange.tokens = communicator.matchmaker.max_tokens  # the most a coordinator accepts
            return await honest(sync)
        return scaled

    faults.swap("sync.forming", forming)


def flip_contributions(factor: float, start: int) -> None:
    scale_contributions(factor, start, claim_the_most_tokens=True)


def attacking_from(start: int) -> list[bool]:
    """A flag that says, once each sync of this node starts forming, whether its round is one it attacks."""
    from p2ploco import faults

    attacking = [False]

    def forming(_: Any, honest: Callable[[Any], Any]) -> Callable[[Any], Any]:
        async def marked(sync: Any) -> Any:
            attacking[0] = sync.round_index >= start
            return await honest(sync)
        return marked

    faults.swap("sync.forming", forming)
    return attacking


def scale_results(factor: float, start: int) -> None:
    from p2ploco import faults
    from p2ploco.compression.sparse_format import SparseValues

    attacking = attacking_from(start)

    def resulting(_: Any, honest: Callable[..., Any]) -> Callable[..., Any]:
        def scaled(span: Any, mean: Any, contributions: int, limit: float) -> Any:
            if not attacking[0]:
                return honest(span, mean, contributions, limit)
            # the mean and the bound the contributions allow, both times the factor: the result is honest's, scaled
            return honest(span, SparseValues(mean.positions, mean.values * np.float32(factor)), contributions,
                          limit * factor)
        return scaled

    faults.swap("reduce.result", resulting)


def steer_results(push: float, start: int) -> None:
    from p2ploco import faults
    from p2ploco.testing.attacks import steered

    attacking = attacking_from(start)

    def resulting(exchange: Any, honest: Callable[..., Any]) -> Callable[..., Any]:
        def steering(span: Any, mean: Any, *args: Any) -> Any:
            return honest(span, steered(mean, exchange.numel(span), push) if attacking[0] else mean, *args)
        return steering

    faults.swap("reduce.result", resulting)


def lie_about_the_round(claimed: int, start: int) -> None:
    from p2ploco.swarm.records import PeerRecord

    honest = PeerRecord.to_value

    def to_value(self: PeerRecord) -> dict[str, Any]:
        value = honest(self)
        if self.round >= start:
            value["round"] = claimed
        return value

    PeerRecord.to_value = to_value


def send_bad_headers(start: int) -> None:
    from p2ploco import faults
    from p2ploco.errors import Failure, PayloadError, TransportError
    from p2ploco.swarm import wire
    from p2ploco.sync.reduce_values import Delivery, DroppedFromRound, TransferOutcome

    def contributing(butterfly: Any, honest: Callable[..., Any]) -> Callable[..., Any]:
        async def contribute(ours: list[Any], peer: str, *args: Any) -> Delivery:
            inbox = ours[0]  # our pieces of the slice: they all name the same group
            if inbox.group.round_index < start:
                return await honest(ours, peer, *args)
            return await send_a_bad_header(butterfly, inbox.group, peer)
        return contribute

    async def send_a_bad_header(butterfly: Any, group: Any, peer: str) -> Delivery:
        reader, writer = await wire.open_stream(butterfly.p2p, peer, butterfly.handler_name)
        try:
            head = msgpack.packb([group.group_id, group.round_index, "not a map"])
            writer.write(wire.PREFIX.pack(len(head), 0) + head)
            await writer.drain()
            await asyncio.wait_for(wire.read_message(reader, 0), butterfly.timeout)
        except (PayloadError, TransportError, TimeoutError):
            pass
        finally:
            writer.close()
        return Delivery(reducer=peer, encoded=0, outcome=TransferOutcome.REFUSED, error=DroppedFromRound(
            f"sent reducer {peer[-8:]} a malformed header, on purpose", Failure.REJECTED))

    faults.swap("reduce.contribute", contributing)


def answer_with_deep_status(start: int) -> None:
    from p2ploco import faults
    from p2ploco.swarm import wire

    deep = b"\x91" * 1020 + b"\x90"  # [[[...[]...]]], 1021 levels: msgpack.packb refuses to write it, peers read it
    head = b"\x82" + msgpack.packb("v") + msgpack.packb(wire.PROTOCOL_VERSION) + msgpack.packb("status") + deep

    def answering(butterfly: Any, honest: Callable[..., Any]) -> Callable[..., Any]:
        async def serve(stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if butterfly.current_round < start:
                return await honest(stream_info, reader, writer)
            try:
                _, length = await wire.read_header(reader)
                await reader.readexactly(length)
                writer.write(wire.PREFIX.pack(len(head), 0) + head)
                await writer.drain()
            finally:
                await wire.hang_up(reader, writer, butterfly.timeout)
        return serve

    faults.swap("answer.contributions", answering)


def redo_forever(start: int) -> None:
    import secrets

    from p2ploco import faults
    from p2ploco.sync.tally import Decision, Outcome

    def deciding(_: Any, honest: Callable[..., Any]) -> Callable[..., Any]:
        def redo_always(group: Any, votes: Any, me: str, *args: Any) -> Any:
            if group.round_index < start:
                return honest(group, votes, me, *args)
            return Decision(Outcome.REDO, redo=group.among(secrets.token_hex(8), group.peers, me),
                            reason="redoing, on purpose")
        return redo_always

    faults.swap("coordinator.decide", deciding)


def serve_a_false_state(start: int) -> None:
    from p2ploco.peer import Swarm
    from p2ploco.swarm.state import BytesBlob, Snapshot

    honest = Swarm.serve_state

    def serve_state(self: Swarm, snapshots: list[Snapshot]) -> None:
        if snapshots and snapshots[0].round >= start:
            forged = []
            for snapshot in snapshots:
                honest_blob = snapshot.blob()
                blob = bytearray(honest_blob.read(0, honest_blob.total))
                blob[-1] ^= 1  # the last tensor's last byte; the manifest is computed from this blob
                forged.append(Snapshot(snapshot.round, snapshot.slice, snapshot.params, snapshot.shared,
                                       snapshot.state_digest, BytesBlob(bytes(blob))))
            snapshots = forged
        honest(self, snapshots)

    Swarm.serve_state = serve_state


def describe_a_huge_state(start: int) -> None:
    from p2ploco import faults
    from p2ploco.errors import PayloadError, TransportError
    from p2ploco.swarm import wire
    from p2ploco.swarm.messages import decode
    from p2ploco.swarm.state import StateRequest, StateStatus

    def answering(server: Any, honest: Callable[..., Any]) -> Callable[..., Any]:
        async def serve(stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if not server.snapshots or next(reversed(server.snapshots)) < start:
                return await honest(stream_info, reader, writer)
            try:
                header, _ = await wire.read_message(reader, max_payload=0)
                request = decode(StateRequest, header)
                snapshot = server.snapshots.get(request.round, {}).get(request.slice)
                if snapshot is not None and not request.length:
                    await wire.write_message(writer, {"status": str(StateStatus.OK), "round": snapshot.round,
                                                      "slice": snapshot.slice, "total": 2**62,
                                                      "state_digest": snapshot.state_digest})
            except (PayloadError, TransportError):
                pass
            finally:
                await wire.hang_up(reader, writer, server.deadline.base)
        return serve

    faults.swap("answer.state", answering)


def send_junk_joins(start: int) -> None:
    from p2ploco import faults
    from p2ploco.errors import PayloadError, TransportError
    from p2ploco.swarm import wire

    def forming(communicator: Any, honest: Callable[[Any], Any]) -> Callable[[Any], Any]:
        async def with_junk(sync: Any) -> Any:
            if sync.round_index >= start:
                matchmaker, config = communicator.matchmaker, communicator.me.fingerprint

                async def junk(peer: str, i: int) -> None:
                    request = {"round": sync.round_index + i % 3, "name": sync.name,
                               "config": f"made-up-{i}" if i % 2 else config, "state": f"s{i}", "pipeline": "",
                               "unreachable": [], "tokens": 1000, "dial_out": False,
                               "slices": {sync.name: ["fp", f"h{i}"]}}
                    try:
                        await asyncio.wait_for(wire.call(matchmaker.p2p, peer, matchmaker.handler_name, request), 5)
                    except (PayloadError, TransportError, TimeoutError):
                        pass

                others = matchmaker.coordinator.candidates() - {communicator.me.peer_id}
                await asyncio.gather(*(junk(peer, i) for peer in others for i in range(40)))
            return await honest(sync)
        return with_junk

    faults.swap("sync.forming", forming)


def never_join(start: int) -> None:
    from p2ploco.sync.form import Matchmaker

    honest = Matchmaker.form_group

    async def form_group(self: Matchmaker, round_index: int, *args: Any, **kwargs: Any) -> Any:
        if round_index < start:
            return await honest(self, round_index, *args, **kwargs)
        # Until the others have moved on (the round's group formed without it), so that its record claims each round
        # from the round's state, as the others' do: it catches up as a peer left out of a round does.
        # It looks itself: a peer that follows its last group leaves the records to the heartbeat's turns.
        deadline = asyncio.get_running_loop().time() + 3 * self.timeout
        while asyncio.get_running_loop().time() < deadline and not any(
                r.round > round_index for r in (await self.directory.refresh()).values()):
            await asyncio.sleep(0.25)
        return None

    Matchmaker.form_group = form_group


def forge_leaving_records(start: int) -> None:
    from hivemind.utils import get_dht_time

    from p2ploco.swarm.directory import PeerDirectory
    from p2ploco.swarm.records import Phase

    honest = PeerDirectory.store_record

    async def store_record(self: PeerDirectory, list_run: bool = False) -> None:
        await honest(self, list_run)
        if self.me.round >= start:
            for victim in sorted(set(self.live) - {self.me.peer_id}):
                forged = {**self.me.to_value(), "peer_id": victim, "state": str(Phase.LEAVING)}
                await self.node.store(self.key, subkey=self.owner, value=forged,
                                      expiration_time=get_dht_time() + self.ttl)

    PeerDirectory.store_record = store_record


def send_huge_activations(start_step: int) -> None:
    from p2ploco.pipeline.links import RemoteTransport
    from p2ploco.pipeline.transport import Activations

    honest = RemoteTransport.send_activations

    def send_activations(self: RemoteTransport, key: tuple[int, int], activations: Activations) -> None:
        if key[0] >= start_step:
            activations = Activations(activations.ids, activations.values * 1e30)
        honest(self, key, activations)

    RemoteTransport.send_activations = send_activations


def send_odd_sums(start_step: int) -> None:
    from p2ploco.pipeline.links import RemoteTransport

    honest = RemoteTransport.all_sum

    def all_sum(self: RemoteTransport, step: int, values: Any) -> list[float]:
        if step >= start_step:
            values = [-abs(v) - 1.0 for v in values] + [1.0]
        return honest(self, step, values)

    RemoteTransport.all_sum = all_sum


def claim_a_poisoned_next_round(start: int) -> None:
    import torch

    from p2ploco.metrics import state_digest
    from p2ploco.peer import Swarm
    from p2ploco.swarm.state import Snapshot

    honest_serve, honest_progress = Swarm.serve_state, Swarm.announce_progress
    poisoned: dict[str, Snapshot] = {}

    def serve_state(self: Swarm, snapshots: list[Snapshot]) -> None:
        if snapshots and snapshots[0].round >= start:
            for snapshot in snapshots:
                params = {name: torch.full_like(t, 0.5) for name, t in snapshot.params.items()}
                shared = {name: torch.zeros_like(t) for name, t in snapshot.shared.items()}
                poisoned[snapshot.slice] = Snapshot(snapshot.round + 1, snapshot.slice, params, shared,
                                                    state_digest(params, shared))
            snapshots = list(poisoned.values())
        honest_serve(self, snapshots)

    def announce_progress(self: Swarm, round_index: int, state: Any, params_digest: str, slices: dict[str, str],
                          unsettled: bool = False) -> None:
        if round_index >= start and poisoned:
            round_index, slices = round_index + 1, {name: s.state_digest for name, s in poisoned.items()}
            params_digest, unsettled = next(iter(slices.values())), False
        honest_progress(self, round_index, state, params_digest, slices, unsettled)

    Swarm.serve_state, Swarm.announce_progress = serve_state, announce_progress


def claim_a_fast_step(start: int) -> None:
    from p2ploco.swarm.records import PeerRecord

    honest = PeerRecord.to_value

    def to_value(self: PeerRecord) -> dict[str, Any]:
        value = honest(self)
        if self.round >= start:
            value["step_seconds"] = 1e-300
        return value

    PeerRecord.to_value = to_value


def deny_dial_backs() -> None:
    from p2ploco import faults
    from p2ploco.errors import PayloadError, TransportError
    from p2ploco.swarm import wire
    from p2ploco.swarm.messages import decode
    from p2ploco.swarm.reachability import ASK_TIMEOUT, DialBackRequest, ip_host

    async def serve(stream_info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            header, _ = await wire.read_message(reader, max_payload=0)
            decode(DialBackRequest, header)
            await wire.write_message(writer, {"dialled": True, "reached": [],
                                              "seen_at": ip_host(stream_info.addr) or ""})
        except (PayloadError, TransportError):
            pass
        finally:
            await wire.hang_up(reader, writer, ASK_TIMEOUT)

    faults.swap("answer.dialback", lambda dial_back, honest: serve)


def equivocate(start: int) -> None:
    import dataclasses

    from p2ploco.swarm.evidence import result_statement
    from p2ploco.sync.reduce import ButterflyAllReduce

    honest = ButterflyAllReduce.answer

    def answer(self: ButterflyAllReduce, group: Any, exchange: Any, reduced: Any, sender: str) -> Any:
        reply, result = honest(self, group, exchange, reduced, sender)
        norms = list(reply["norms"])
        own = group.peers.index(sender)
        other = next((i for i, place in enumerate(reply["included"]) if place != own), None)
        if group.round_index < start or other is None or own % 2 == 0:
            return reply, result
        norms[other] *= 1.01
        receipt = dataclasses.replace(reduced.reduction.receipt_for(sender), norms=tuple(norms))
        digest = exchange.receive(reduced.evidence.piece, result, receipt)  # this node's own aggregate goes astray
        span = reduced.evidence.piece
        signature = self.signer.sign(result_statement(self.run_id, group.digest, reduced.evidence.slice, span.start,
                                                      span.stop, digest))
        return {**reply, "norms": norms, "signature": signature}, result

    ButterflyAllReduce.answer = answer


def refuse_everyone(start: int) -> None:
    from p2ploco.sync.reduce import ButterflyAllReduce

    honest = ButterflyAllReduce.run

    async def run(self: ButterflyAllReduce, group: Any, *args: Any) -> Any:
        if group.round_index >= start:
            for peer in set(group.peers) - {self.me}:
                self.bans.ban(peer, group.round_index, "refusing everyone, on purpose")
        return await honest(self, group, *args)

    ButterflyAllReduce.run = run


def hand_out_two_versions(start: int) -> None:
    import dataclasses

    from p2ploco.swarm.evidence import group_statement
    from p2ploco.sync import coordinator as coordinating

    honest_start, honest_answer = coordinating.Coordinator.start, coordinating.group_answer
    coordinators: list[Any] = []
    handed: dict[str, int] = {}  # group id -> answers handed out so far

    async def start_serving(self: Any) -> None:  # the coordinator, whose key signs its versions
        coordinators.append(self)
        await honest_start(self)

    def group_answer(group: Any, *args: Any) -> Any:
        handed[group.group_id] = handed.get(group.group_id, 0) + 1
        others = [p for p in group.peers if p != group.coordinator]
        if group.round_index < start or handed[group.group_id] % 2 == 1 or len(others) < 2:
            return honest_answer(group, *args)
        victim, coordinator = others[0], coordinators[0]
        other = dataclasses.replace(group, tokens=tuple((p, 1 if p == victim else t) for p, t in group.tokens))
        other = dataclasses.replace(other, grant=coordinator.signer.sign(group_statement(
            coordinator.run_id, other.group_id, bytes.fromhex(other.digest))))
        return honest_answer(other)  # in full: relative to a followed group it would be another version again

    coordinating.Coordinator.start, coordinating.group_answer = start_serving, group_answer


# behaviour name -> how to patch it in, given the value after ":" (if any) and the round or step after "@"
BEHAVIOURS: dict[str, Callable[[str, int], None]] = {
    "scale": lambda value, start: scale_contributions(float(value), start),
    "flip": lambda value, start: flip_contributions(float(value), start),
    "scale-result": lambda value, start: scale_results(float(value), start),
    "lie-round": lambda value, start: lie_about_the_round(int(value), start),
    "bad-header": lambda _, start: send_bad_headers(start),
    "deep-status": lambda _, start: answer_with_deep_status(start),
    "redo-forever": lambda _, start: redo_forever(start),
    "lying-donor": lambda _, start: serve_a_false_state(start),
    "huge-state": lambda _, start: describe_a_huge_state(start),
    "junk-joins": lambda _, start: send_junk_joins(start),
    "never-join": lambda _, start: never_join(start),
    "forge-leaving": lambda _, start: forge_leaving_records(start),
    "huge-activations": lambda _, start: send_huge_activations(start),
    "odd-sums": lambda _, start: send_odd_sums(start),
    "poison-state": lambda _, start: claim_a_poisoned_next_round(start),
    "fast-step": lambda _, start: claim_a_fast_step(start),
    "deny-dialback": lambda _, start: deny_dial_backs(),
    "equivocate": lambda _, start: equivocate(start),
    "refuse-all": lambda _, start: refuse_everyone(start),
    "two-versions": lambda _, start: hand_out_two_versions(start),
    "steer": lambda value, start: steer_results(float(value), start),
}


def main() -> None:
    behaviour, separator, *arguments = sys.argv[1:]
    assert separator == "--", __doc__
    what, _, start = behaviour.partition("@")
    kind, _, value = what.partition(":")
    if kind not in BEHAVIOURS:
        raise SystemExit(f"unknown behaviour {behaviour!r}\n{__doc__}")
    BEHAVIOURS[kind](value, int(start))
    from p2ploco.cli import main as cli

    cli(arguments, prog_name="p2ploco")


if __name__ == "__main__":
    main()
