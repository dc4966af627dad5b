"""The butterfly all-reduce over real hivemind DHT nodes and p2p daemons (three peers in this process)."""

import asyncio
import hashlib
import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from helpers import LOOPBACK, in_process_mean, join_swarms, run_document
from hivemind.p2p import P2P, PeerID

from p2ploco import faults
from p2ploco.budget import StepTimes, WallClockBudget
from p2ploco.collective import exchange as exchange_module
from p2ploco.collective.dense import DenseMean, tensor_to_bytes
from p2ploco.collective.exchange import partition, pieces
from p2ploco.collective.robust import UNBOUNDED, Policy
from p2ploco.collective.sliced import as_sliced
from p2ploco.collective.sparse import SparseExchange
from p2ploco.compression.chunking import chunk_grid
from p2ploco.compression.sparse_format import SparseLayout
from p2ploco.compression.topk import compress
from p2ploco.config import SparseLoCoConfig, SwarmConfig, document_fingerprint
from p2ploco.errors import Failure, PayloadError
from p2ploco.outer.sparseloco import SparseLoCo
from p2ploco.peer import Swarm
from p2ploco.swarm import wire
from p2ploco.swarm.messages import MAX_TOKENS
from p2ploco.swarm.records import Phase
from p2ploco.sync.communicator import PARTNER_ROUNDS
from p2ploco.sync.contribute import parse_reply
from p2ploco.sync.group import Group
from p2ploco.sync.join import best_coordinator
from p2ploco.sync.liveness import ELSEWHERE
from p2ploco.sync.reduce_values import ReducerElsewhere, ReduceStatus
from p2ploco.sync.serve import Inbox
from p2ploco.testing.communicator import InProcessGroup

CONFIG = SwarmConfig(matchmaking_timeout=5, allreduce_timeout=3, heartbeat_interval=0.5, peer_ttl=10, ban_rounds=0)
DEFENDED = Policy(clip_factor=2.0, drop_opposed=True)  # the default config's
SHAPES = [(64, 33), (33,), (7, 5)]
rounds = itertools.count()


@pytest.fixture(scope="module")
def trio():
    swarms = []
    try:
        join_swarms("test", 3, CONFIG, swarms)
        for s in swarms:
            s.announce_progress(0, Phase.JOINING, "start-state", {"params": "start-state"})
        assert all(s.wait_for_peers(3, 30) == 3 for s in swarms)
        yield sorted(swarms, key=lambda s: s.peer_id)  # canonical order: the order of the sum
    finally:
        for s in swarms:
            s.leave()


def random_tensors(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for shape in SHAPES]


def agreeing_tensors(seed: int, count: int = 3) -> list[list[torch.Tensor]]:
    """``count`` peers' tensors that share a direction, as honest pseudo-gradients do."""
    shared = random_tensors(seed)
    return [[a + b for a, b in zip(shared, random_tensors(seed + 1 + i))] for i in range(count)]


def all_reduce(swarms, exchanges):
    round_index = next(rounds)
    for s in swarms:
        s.announce_progress(round_index, Phase.AVERAGING, "start-state", {"params": "start-state"})
    return all_reduce_at(swarms, exchanges, round_index)


def all_reduce_at(swarms, exchanges, round_index):
    with ThreadPoolExecutor(len(swarms)) as pool:
        futures = [pool.submit(s.communicator.all_reduce, e, round_index, "params") for s, e in zip(swarms, exchanges)]
        return [f.result(timeout=60) for f in futures]



def test_all_peers_get_the_reference_aggregate_bit_for_bit(trio):
    inputs = [random_tensors(seed) for seed in range(3)]
    exchanges = [DenseMean(t) for t in inputs]
    stats = all_reduce(trio, exchanges)
    expected = in_process_mean(inputs)
    for exchange in exchanges:
        assert all(torch.equal(a, b) for a, b in zip(exchange.mean(), expected))
    ids = [s.peer_id for s in trio]
    for s in stats:
        assert s.peers == ids and s.dropped == []
        assert s.traffic.bytes_sent + s.traffic.bytes_received == s.traffic.dense_fp32_bytes > 0


class CorruptingExchange(DenseMean):
    """A peer whose contributions to other peers' spans are malformed in one way."""

    def __init__(self, tensors, own_span, corrupt):
        super().__init__(tensors)
        self.own_span, self.corrupt = own_span, corrupt

    def encode(self, span):
        payload = super().encode(span)
        return payload if span in (self.own_span, range(self.num_units)) else self.corrupt(payload)


CORRUPTIONS = {
    "truncated": lambda p: p[: len(p) // 2],
    "too long": lambda p: p + b"\0" * 8,
    "oversized": lambda p: p * 50,
    "nan": lambda p: tensor_to_bytes(torch.full((len(p) // 4,), float("nan"))),
    "inf": lambda p: tensor_to_bytes(torch.full((len(p) // 4,), float("inf"))),
}


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_malformed_contribution_drops_its_sender_and_the_rest_carry_on(trio, kind):
    inputs = [random_tensors(10 + seed) for seed in range(3)]
    bad = 1
    units = sum(torch.Size(s).numel() for s in SHAPES)
    exchanges = [DenseMean(t) for t in inputs]
    exchanges[bad] = CorruptingExchange(inputs[bad], partition(units, 3)[bad], CORRUPTIONS[kind])
    stats = all_reduce(trio, exchanges)
    honest = [i for i in range(3) if i != bad]
    for i in honest:
        assert stats[i].dropped == [trio[bad].peer_id]
        assert len(stats[i].peers) == 3
    # Honest peers agree bit for bit; the spans they reduce average just the honest contributions.
    means = [exchanges[i].mean() for i in honest]
    assert all(torch.equal(a, b) for a, b in zip(*means))
    flat = torch.cat([m.flatten() for m in means[0]])
    first, second = (torch.cat([t.flatten() for t in inputs[i]]) for i in honest)
    expected = (first + second) / 2
    for i in honest:
        span = partition(units, 3)[i]
        assert torch.equal(flat[span.start:span.stop], expected[span.start:span.stop])
    # The honest peers commit; the dropped one applies nothing, and is still in the swarm for the next round.
    assert stats[honest[0]].committed and stats[honest[1]].committed and not stats[bad].committed
    follow_up = all_reduce(trio, [DenseMean(random_tensors(seed)) for seed in range(3)])
    assert all(len(s.peers) == 3 and s.dropped == [] for s in follow_up)


def sparse_exchanges(seeds, layout):
    exchanges = []
    for seed in seeds:
        generator = torch.Generator().manual_seed(seed)
        compressed = [compress(torch.randn(g.shape, generator=generator), g)[0] for g in layout.grids]
        exchanges.append(SparseExchange(layout, compressed, "mean"))
    return exchanges


def test_pieces_cover_a_span_in_order_and_fit_the_piece_size(monkeypatch):
    monkeypatch.setattr(exchange_module, "PIECE_BYTES", 1000)
    dense = DenseMean([torch.zeros(2180)])
    cut = pieces(dense, range(100, 1100))
    assert [(p.start, p.stop) for p in cut] == [(100, 350), (350, 600), (600, 850), (850, 1100)]
    assert all(dense.max_payload_bytes(p) <= 1000 for p in cut)
    assert pieces(dense, range(5, 5)) == [range(5, 5)]  # an empty span is one (empty) piece
    assert pieces(dense, range(0, 200)) == [range(0, 200)]


@pytest.mark.parametrize("policy", [UNBOUNDED, Policy(clip_factor=1.5, drop_opposed=True)])
def test_spans_reduced_in_pieces_give_the_in_process_aggregate_bit_for_bit(trio, monkeypatch, policy):
    monkeypatch.setattr(exchange_module, "PIECE_BYTES", 1000)  # each peer's span of 2,180 values: 3 pieces
    inputs = agreeing_tensors(20)
    inputs[2] = [t * 50 for t in inputs[2]]  # one contribution far larger than the others: clipped, piece by piece
    exchanges = [DenseMean(t, policy=policy) for t in inputs]
    assert all(len(pieces(exchanges[0], span)) == 3 for span in exchanges[0].partition(3))
    stats = all_reduce(trio, exchanges)
    group = InProcessGroup(3)
    local = [DenseMean(t, policy=policy) for t in inputs]
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda rank: group.communicator(rank).all_reduce(local[rank], 0, "params"), range(3)))
    for exchange in exchanges:
        assert all(torch.equal(a, b) for a, b in zip(exchange.mean(), local[0].mean()))
    assert all(s.dropped == [] and s.traffic.bytes_sent + s.traffic.bytes_received == s.traffic.dense_fp32_bytes
               for s in stats)
    assert bool(policy.clip_factor) == any(s.clipped == [trio[2].peer_id] for s in stats)
    assert all(s.opposed == [] for s in stats)


class ScalingReducer(DenseMean):
    """A hostile reducer: it answers every member with its span's mean times ``factor`` (well-formed, finite), and
    takes that as the mean it made."""

    factor = 1e4

    def combine(self, span, contributions, factors) -> bytes:
        mean = super().combine(span, contributions, factors)
        self._combined[span] = (np.frombuffer(mean, dtype=np.float32) * np.float32(self.factor)).tobytes()
        return self._combined[span]


def test_a_reducer_whose_result_is_longer_than_what_it_combined_is_refused_and_the_round_redone_without_it(trio):
    inputs = agreeing_tensors(30)
    exchanges = [DenseMean(t, policy=DEFENDED) for t in inputs[:2]] + [ScalingReducer(inputs[2], policy=DEFENDED)]
    stats = all_reduce(trio, exchanges)
    honest, hostile = [trio[0].peer_id, trio[1].peer_id], trio[2].peer_id
    for s, exchange in zip(stats[:2], exchanges[:2]):
        # both honest members refused the x1e4 span, accused its reducer, and redid the round without it
        assert s.committed and s.attempts == 2 and s.peers == honest and hostile in s.dropped
        assert all(torch.equal(a, (b + c) / 2) for a, b, c in zip(exchange.mean(), *inputs[:2]))
    assert not stats[2].committed
    expected = in_process_mean(inputs)  # what an honest third reducer would have given, for scale
    assert all(float(a.norm()) < 2 * float(b.norm()) + 1 for a, b in zip(exchanges[0].mean(), expected))


def test_a_sign_flipped_contribution_is_left_out_by_every_reducer_over_hivemind(trio):
    inputs = agreeing_tensors(40)
    inputs[2] = [t * -1.9 for t in inputs[2]]  # inside the clip bound, against the others
    exchanges = [DenseMean(t, policy=DEFENDED) for t in inputs]
    stats = all_reduce(trio, exchanges)
    flipped = trio[2].peer_id
    assert all(s.committed and s.attempts == 1 and s.opposed == [flipped] for s in stats)  # every reducer
    assert stats[2].failures.count(Failure.OPPOSED) == 2  # told so by the other two
    for exchange in exchanges:  # the honest two's mean, on every member, the flipped one included
        assert all(torch.equal(a, (b + c) / 2) for a, b, c in zip(exchange.mean(), *inputs[:2]))


def test_a_join_that_claims_more_tokens_than_a_round_holds_is_left_out(trio):
    coordinator, joiner = trio[0].communicator.matchmaker.coordinator, trio[1]
    round_index = next(rounds)
    request = {"round": round_index, "name": "params", "config": coordinator.directory.me.fingerprint,
               "state": "start-state", "pipeline": "", "unreachable": [], "tokens": 5001, "dial_out": False,
               "slices": {"params": ["fp", "start-state"]}}
    coordinator.max_tokens = 5000
    try:
        answer, _ = joiner.loop.run(wire.call(joiner.communicator.butterfly.p2p, coordinator.me,
                                              coordinator.handler_name, request), 15)
    finally:
        coordinator.max_tokens = MAX_TOKENS
    assert answer == {"v": wire.PROTOCOL_VERSION, "status": "left out",
                      "reason": "this peer claims 5001 tokens, more than a contribution may weigh (5000)"}


def test_sparse_all_reduce_over_hivemind_equals_the_in_process_one(trio):
    layout = SparseLayout([chunk_grid(s, 64, 64) for s in [(128, 192), (257, 64), (192,)]])
    over_hivemind = sparse_exchanges(range(3), layout)
    stats = all_reduce(trio, over_hivemind)
    in_process = sparse_exchanges(range(3), layout)
    group = InProcessGroup(3)
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda rank: group.communicator(rank).all_reduce(in_process[rank], 0, "params"), range(3)))
    for exchange in over_hivemind:
        assert all(torch.equal(a, b) for a, b in zip(exchange.aggregate(), in_process[0].aggregate()))
    for s in stats:
        assert s.dropped == [] and 50 * (s.traffic.bytes_sent + s.traffic.bytes_received) < s.traffic.dense_fp32_bytes


def fitted_contributions():
    """Three SparseLoCo replicas' contributions under a result cap of 96 values per chunk: 3 x 64 would not fit."""
    generator = torch.Generator().manual_seed(5)
    params = [torch.randn(s, generator=generator) for s in [(128, 192), (257, 64), (192,)]]
    outers = [SparseLoCo(params, SparseLoCoConfig(result_topk=96), torch.device("cpu")) for _ in range(3)]
    return [outer.contribute([p + 0.05 * torch.randn(p.shape, generator=generator) for p in params], 0)
            .exchange.parts["stage0"] for outer in outers]


def test_a_group_too_large_for_its_results_sends_fewer_values_over_hivemind_as_in_process(trio):
    """Formed, the group of 3 sends 32 values per chunk each (compressed again before anything is encoded), so a
    result holds every value sent; over hivemind every member ends with the in-process aggregate."""
    over_hivemind = fitted_contributions()
    stats = all_reduce(trio, over_hivemind)
    in_process = fitted_contributions()
    group = InProcessGroup(3)
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda rank: group.communicator(rank).all_reduce(in_process[rank], 0, "params"), range(3)))
    assert all(s.committed and s.dropped == [] for s in stats)
    for exchange in over_hivemind:
        assert exchange.layout.grids[0].k == 32
        assert all(torch.equal(a, b) for a, b in zip(exchange.aggregate(), in_process[0].aggregate()))


def test_a_member_fitted_to_a_group_that_died_fits_its_contribution_to_the_next_group(trio):
    """The first member fitted its contribution to a group of 4 that died (24 values per chunk) and joins the round's
    group of 3 at the next coordinator, whose other members fitted to no group before: it sends 32 values as they do,
    and all three end with the in-process aggregate. It used to keep the dead group's layout, and the others refused
    its contributions as malformed ("layout digest differs") and banned it."""
    over_hivemind = fitted_contributions()
    over_hivemind[0].fit_group(4)
    assert over_hivemind[0].layout.grids[0].k == 24
    stats = all_reduce(trio, over_hivemind)
    in_process = fitted_contributions()
    group = InProcessGroup(3)
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda rank: group.communicator(rank).all_reduce(in_process[rank], 0, "params"), range(3)))
    assert [(s.committed, s.dropped) for s in stats] == [(True, [])] * 3
    for exchange in over_hivemind:
        assert exchange.layout.grids[0].k == 32
        assert all(torch.equal(a, b) for a, b in zip(exchange.aggregate(), in_process[0].aggregate()))


def test_sparse_contribution_with_nan_side_info_is_dropped(trio):
    layout = SparseLayout([chunk_grid(s, 64, 64) for s in [(128, 192), (192,)]])
    exchanges = sparse_exchanges(range(3), layout)
    bad = exchanges[2]
    bad.compressed[0].shift = np.float32("nan")
    bad.compressed = bad.compressed  # what it sends, encoded anew
    stats = all_reduce(trio, exchanges)
    assert stats[0].dropped == stats[1].dropped == [trio[2].peer_id]
    assert all(torch.equal(a, b) for a, b in zip(exchanges[0].aggregate(), exchanges[1].aggregate()))
    assert stats[0].committed and stats[1].committed and not stats[2].committed


def test_garbage_on_the_reduce_stream_does_not_hurt_the_reducer(trio):
    sender, reducer = trio[0], trio[1]

    async def send_garbage():
        butterfly = sender.communicator.butterfly
        _, reader, writer = await butterfly.p2p.call_binary_stream_handler(PeerID.from_base58(reducer.peer_id),
                                                                           butterfly.handler_name)
        try:
            writer.write(b"\xff" * 64)
            await writer.drain()
            await wire.write_message(writer, {"group_id": "no-such-group", "span": [0, 1]}, b"\0" * 4)
        except ConnectionError:  # the reducer may hang up as soon as it has read the bad header
            pass
        finally:
            writer.close()

    sender.loop.run(send_garbage(), 10)
    stats = all_reduce(trio, [DenseMean(random_tensors(seed)) for seed in range(3)])
    assert all(len(s.peers) == 3 and s.dropped == [] for s in stats)


def test_a_reducer_shows_what_it_weighed_to_the_members_of_the_group_only_and_twice_each(trio):
    """After an honest round every member audited a piece (none was refused). A reducer keeps the payloads it weighed
    for a piece and shows them to a member that asks, in the receipt's order, twice a group; a peer outside the
    group and a piece it did not reduce get one-line refusals."""
    stats = all_reduce(trio, [DenseMean(random_tensors(seed)) for seed in range(3)])
    assert all(s.committed and s.attempts == 1 for s in stats)
    reducer, member, outsider = trio
    group = Group("audited", 7, "params", (reducer.peer_id, member.peer_id), reducer.peer_id)
    reducer.communicator.butterfly.audits.keep(group, "params", range(0, 10), (b"first", b"second"))

    def ask(asker, span=(0, 10)):
        audits = asker.communicator.butterfly.audits
        return asker.loop.run(wire.call(audits.p2p, reducer.peer_id, audits.handler_name,
                                        {"group_id": "audited", "slice": "params", "span": list(span)},
                                        max_payload=64), 10)

    assert ask(outsider)[0] == {"v": wire.PROTOCOL_VERSION, "status": "unknown",
                                "reason": "no group of this id with the asker in it is kept here"}
    assert ask(member, (0, 9))[0]["reason"] == "no such piece was reduced here in that group"
    answer, payload = ask(member)
    assert (answer["status"], answer["lengths"], payload) == ("ok", [5, 6], b"firstsecond")
    assert ask(member)[0]["reason"] == "the asker audited this group 2 times already"


def test_a_reducer_that_refuses_a_contribution_on_its_header_still_answers_its_sender(trio):
    """A reducer refuses a contribution on its header and never reads the 16 MiB behind it: the sender, still
    writing them, must read the refusal (and be told it is out), not find its stream reset (a lost link)."""
    sender, reducer = trio[0], trio[1]
    butterfly = sender.communicator.butterfly
    header = {"group_id": "g", "round": 0, "slice": "params", "span": "not a span"}
    answer, _ = sender.loop.run(wire.call(butterfly.p2p, reducer.peer_id, butterfly.handler_name, header,
                                          payload=bytes(16 << 20)), 60)
    assert answer["status"] == ReduceStatus.REJECTED
    assert "Contribution: span: Input should be a valid list" in answer["reason"]


@pytest.mark.timeout(60)
def test_a_reducer_that_takes_part_in_the_round_elsewhere_refuses_a_contribution_for_another_group_at_once(trio):
    """A member takes part in one group per round: a reducer that joins round r at one coordinator never takes part
    in a group of r that another one formed. A contribution for such a group is refused at once, saying so, where
    it used to wait ``allreduce_timeout`` for the group and answer "unknown group"; one for a group of the
    coordinator it joins at waits, and is refused as soon as the reducer moves on to another coordinator."""
    sender, reducer, third = trio
    round_index = next(rounds)
    butterfly = sender.communicator.butterfly
    whereabouts = reducer.communicator.butterfly.whereabouts

    async def note(coordinator: str) -> None:  # on the reducer's loop, as its matchmaker notes a coordinator
        whereabouts.join(round_index, "params", coordinator)

    def send(coordinator: str, group_id: str):
        header = {"group_id": group_id, "round": round_index, "slice": "params", "span": [0, 10],
                  "coordinator": coordinator, "version": "0" * 64}
        return asyncio.run_coroutine_threadsafe(wire.call(butterfly.p2p, reducer.peer_id, butterfly.handler_name,
                                                          header, payload=bytes(40)), sender.loop.loop)

    reducer.loop.run(note(third.peer_id), 10)
    started = time.monotonic()
    answer, _ = send(sender.peer_id, "dead-group").result(timeout=30)
    assert time.monotonic() - started < CONFIG.allreduce_timeout
    assert {k: v for k, v in answer.items() if k != "v"} == {
        "status": ReduceStatus.MISSED, "elsewhere": True,
        "reason": f"contribution for a group this peer is not in: it takes part in round {round_index} at "
                  f"coordinator {third.peer_id[-8:]}"}
    group = Group("dead-group", round_index, "params", tuple(s.peer_id for s in trio), sender.peer_id)
    elsewhere = parse_reply(answer, group, sender.peer_id, bytes(40))
    assert isinstance(elsewhere, ReducerElsewhere)
    assert str(elsewhere).startswith("a reducer is not in this peer's group: contribution for a group")
    with pytest.raises(PayloadError, match="elsewhere, with another status than missed"):
        parse_reply({"status": "rejected", "reason": "", "elsewhere": True}, group, sender.peer_id, bytes(40))

    # A contribution for a group of the coordinator the reducer joins at waits for it, until the reducer moves on.
    waiting = send(third.peer_id, "forming-group")
    deadline = time.monotonic() + 30
    while ("forming-group", "params", 0) not in reducer.communicator.butterfly.reducer._awaited_by:
        assert time.monotonic() < deadline and not waiting.done()
        time.sleep(0.01)
    started = time.monotonic()
    reducer.loop.run(note(sender.peer_id), 10)
    answer, _ = waiting.result(timeout=30)
    assert time.monotonic() - started < CONFIG.allreduce_timeout
    assert (answer["status"], answer.get("elsewhere")) == (ReduceStatus.MISSED, True)
    assert answer["reason"].endswith(f"at coordinator {sender.peer_id[-8:]}")


def test_a_peer_with_another_config_is_warned_and_never_counts_the_others(trio, caplog):
    """Anyone can publish a record of another config under a run's key: it never stops a node from starting (it
    used to), and a node never counts a peer of another config as one to average with or follow."""
    with caplog.at_level(logging.WARNING, logger="p2ploco.peer"):
        other = Swarm.join("test", CONFIG, run_document("other-cfg"), initial_peers=trio[0].addresses(),
                           host_maddrs=LOOPBACK)
    try:
        assert (f"run 'test' has peers of another config (fingerprint {document_fingerprint(run_document())}, yours "
                f"{document_fingerprint(run_document('other-cfg'))}: other settings") in caplog.text
        assert other.swarm_state(0, {"params": "mine"}) == {}
        assert set(other.directory.live) > {other.peer_id} and other.step_seconds() == []  # nor goes by their pace
    finally:
        other.leave()


def test_a_group_naming_unknown_peers_or_leaving_out_its_member_is_refused(trio):
    matchmaker, me = trio[0].communicator.matchmaker, trio[0].peer_id
    ids = sorted(s.peer_id for s in trio)
    trio[0].loop.run(matchmaker._check_plausible(Group("g", 0, "params", tuple(ids), ids[-1])), 10)
    for peers, why in ((tuple(p for p in ids if p != me), "without this peer"),
                       (tuple(sorted([*ids, "12D3KooWNobodyRunsThisPeerId"])), "does not know")):
        with pytest.raises(PayloadError, match=why):
            trio[0].loop.run(matchmaker._check_plausible(Group("g", 0, "params", peers, ids[-1])), 10)


def test_a_formation_waits_for_a_peer_still_finishing_the_previous_round(trio):
    """Streaming DiLoCo syncs its first fragment a step into the round: a peer whose record still shows the
    previous round when the others have all joined is waited for (the joiners' grace), not told it is late."""
    next(rounds)
    round_index = next(rounds)  # >= 1, so that the previous round exists
    early, moving = trio[:2], trio[2]
    moving.announce_progress(round_index - 1, Phase.TRAINING, "start-state", {"params": "start-state"})
    for s in early:
        s.announce_progress(round_index, Phase.AVERAGING, "start-state", {"params": "start-state"})
    assert all(s.flush() for s in trio)
    tensors = [random_tensors(60 + i) for i in range(3)]

    def joined_or_closed() -> bool:
        coordinators = [s.communicator.matchmaker.coordinator for s in trio]
        return any(k[0] == round_index and len(f.members) == 2
                   for c in coordinators for k, f in list(c._forming.items())) \
            or any(k[0] == round_index for c in coordinators for k in c.book.formations())

    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(s.communicator.all_reduce, DenseMean(t), round_index, "params")
                   for s, t in zip(early, tensors)]
        deadline = time.monotonic() + 30
        while not joined_or_closed() and time.monotonic() < deadline:
            time.sleep(0.01)
        moving.announce_progress(round_index, Phase.AVERAGING, "start-state", {"params": "start-state"})
        futures.append(pool.submit(moving.communicator.all_reduce, DenseMean(tensors[2]), round_index, "params"))
        stats = [f.result(timeout=60) for f in futures]
    assert [len(s.peers) for s in stats] == [3, 3, 3] and all(s.committed for s in stats)


def test_the_coordinator_of_a_round_does_not_follow_the_state_it_starts_from(trio):
    """Reducers shape the next round's starting state: were its coordinator seeded by that state's hash, a
    reducer could try low-bit variants of its span until the hash picked it, every round (grinding). Here the
    round starts from a state under whose hash another peer would have won; the coordinator is the round's."""
    round_index = next(rounds)
    ids = sorted(s.peer_id for s in trio)
    by_round = best_coordinator(set(ids), round_index)
    state = next(f"ground-{k}" for k in itertools.count() if by_round != min(
        ids, key=lambda p: hashlib.sha256(f"{round_index}/ground-{k}/{p}".encode()).digest()))
    for s in trio:
        s.announce_progress(round_index, Phase.AVERAGING, state, {"params": state})
    assert all(s.flush() for s in trio)
    exchanges = [DenseMean(random_tensors(80 + i)) for i in range(3)]
    with ThreadPoolExecutor(3) as pool:
        stats = [f.result(timeout=60) for f in [pool.submit(s.communicator.all_reduce, e, round_index, "params")
                                                for s, e in zip(trio, exchanges)]]
    assert all(len(s.peers) == 3 and s.committed for s in stats)
    [coordinator] = [s.peer_id for s in trio
                     for k in s.communicator.matchmaker.coordinator.book.formations() if k[0] == round_index]
    assert coordinator == by_round


def test_a_member_that_asks_its_coordinator_again_gets_the_same_group(trio):
    """A joiner whose answer was lost (its stream broke) asks the coordinator again: it must get the group it is
    in, not "late" (nor form a group of its own elsewhere, while the others wait for it in vain)."""
    round_index = next(rounds)
    for s in trio:
        s.announce_progress(round_index, Phase.AVERAGING, "start-state", {"params": "start-state"})
    exchanges = [DenseMean(random_tensors(70 + i)) for i in range(3)]
    with ThreadPoolExecutor(3) as pool:
        stats = [f.result(timeout=60) for f in [pool.submit(s.communicator.all_reduce, e, round_index, "params")
                                                for s, e in zip(trio, exchanges)]]
    assert all(len(s.peers) == 3 for s in stats)
    [(coordinator, key, group)] = [(s, k, g) for s in trio
                                   for k, g in s.communicator.matchmaker.coordinator.book.formations().items()
                                   if k[0] == round_index]
    member = next(s for s in trio if s is not coordinator)
    request = {"round": key[0], "name": key[1], "config": key[2], "state": key[3], "pipeline": "", "unreachable": [],
               "tokens": 1000, "dial_out": False,
               "slices": {"params": [exchanges[0].fingerprint(), "start-state"]}}
    answer = member.loop.run(member.communicator.matchmaker._ask(coordinator.peer_id, request, 10), 15)
    assert answer["status"] == "group" and answer["group_id"] == group.group_id
    assert answer["peers"] == list(group.peers)


def test_a_member_of_a_dead_group_that_rejoins_after_a_lost_vote_never_opens_a_formation(trio):
    """A member whose vote found no coordinator rejoins the round only where the others already form it: its
    coordinator may be alive for them and still decide, and a group of its own at the next coordinator would split
    the round. A coordinator with no formation of the round open answers it "late" at once."""
    round_index = next(rounds)
    ids = {s.peer_id for s in trio}
    coordinator = next(s for s in trio if s.peer_id == best_coordinator(ids, round_index))
    member = next(s for s in trio if s is not coordinator)
    request = {"round": round_index, "name": "params", "config": member.directory.me.fingerprint,
               "state": "start-state", "pipeline": "", "unreachable": [], "tokens": 1000, "dial_out": False,
               "slices": {"params": ["fp", "start-state"]}, "rejoin": True}
    matchmaker = member.communicator.matchmaker
    answer = member.loop.run(matchmaker._ask(coordinator.peer_id, request, 10), 15)
    assert answer == {"v": answer["v"], "status": "late", "reason": f"no group of round {round_index} is forming at "
                                                                      f"coordinator {coordinator.peer_id[-8:]}"}
    assert not [k for k in coordinator.communicator.matchmaker.coordinator._forming if k[0] == round_index]


def test_joins_from_outside_the_run_are_refused_and_do_not_disturb_its_rounds(trio):
    """Any libp2p peer can open a stream to a coordinator: 40 joins for made-up configs, rounds and states, from a
    peer with no record of the run, are refused, and the run's next round commits as ever (they used to push its
    group out of the coordinator's book, so that every vote failed)."""
    round_index = next(rounds)
    for s in trio:
        s.announce_progress(round_index, Phase.AVERAGING, "start-state", {"params": "start-state"})
    assert all(s.flush() for s in trio)
    coordinator = trio[0].communicator.matchmaker.coordinator
    loop = trio[0].loop
    outsider = loop.run(P2P.create(host_maddrs=LOOPBACK, initial_peers=trio[0].addresses()), 60)
    try:
        async def junk(i: int) -> dict:
            request = {"round": round_index + i % 3, "name": "params",
                       "config": f"made-up-{i}" if i % 2 else trio[0].directory.me.fingerprint,
                       "state": f"s{i}", "pipeline": "", "unreachable": [], "tokens": 1000, "dial_out": False,
                       "slices": {"params": ["fp", f"h{i}"]}}
            answer, _ = await wire.call(outsider, coordinator.me, coordinator.handler_name, request)
            return answer

        answers = [loop.run(junk(i), 30) for i in range(40)]
        assert all(a["status"] == "left out" for a in answers)
        assert {a["reason"].split(" ", 2)[2] for a in answers} == {"trains another config",
                                                                  "sees no live record of this run's config for this "
                                                                  "peer"}
    finally:
        loop.run(outsider.shutdown(), 30)
    exchanges = [DenseMean(random_tensors(80 + i)) for i in range(3)]
    with ThreadPoolExecutor(3) as pool:
        stats = [f.result(timeout=60) for f in [pool.submit(s.communicator.all_reduce, e, round_index, "params")
                                                for s, e in zip(trio, exchanges)]]
    assert all(len(s.peers) == 3 and s.committed for s in stats)


def test_only_the_members_that_delivered_vouch_for_the_group_a_peer_follows(trio):
    """A peer goes without a lookup for as many rounds as members vouch for the group it follows. After an honest
    round every other member does; a member a coordinator names that has no daemon (a record-only Sybil, here
    behind a "NAT" so that it reduces no span and the round still holds) delivers nothing and vouches for nothing."""
    ids = {s.peer_id for s in trio}
    stats = all_reduce(trio, [DenseMean(random_tensors(90 + i)) for i in range(3)])
    assert all(s.committed for s in stats)
    assert [s.communicator.matchmaker.directory.vouched for s in trio] == [ids - {s.peer_id} for s in trio]
    sybil = "12D3KooWSybilWithARecordAndNoDaemonXXXXXXXXXXXXXXXX"
    peers = tuple(sorted([*ids, sybil]))
    padded = Group("padded", next(rounds), "params", peers, trio[0].peer_id,
                   holdings=tuple((p, ("params",)) for p in peers), tokens=tuple((p, 1000) for p in peers),
                   dial_out=(sybil,))

    def run(swarm: Swarm, seed: int) -> frozenset[str]:
        exchange = as_sliced(DenseMean(random_tensors(seed)), "params")
        return swarm.loop.run(swarm.communicator.butterfly.run(padded, exchange), 60).delivered

    with ThreadPoolExecutor(3) as pool:
        delivered = list(pool.map(run, trio, range(95, 98)))
    assert delivered == [ids - {s.peer_id} for s in trio]


def test_the_round_budget_goes_by_the_step_times_of_recent_partners_not_of_any_record(trio):
    """A record is free to publish: one that claimed inner steps of 1e-300 s, never joining a round, cut every
    peer's round budget to one step of H. A peer's budget goes by the peers whose contributions were in its recent
    rounds (a joiner, with none yet, by every live record of the run), never a banned one, and believes no claim
    much faster than its group's lower median (``budget.py``)."""
    me, others = trio[0], {s.peer_id for s in trio[1:]}
    own = StepTimes()
    own.add(0.12)
    budget = WallClockBudget(10, own, me.step_seconds)
    next(rounds)
    round_index = next(rounds)  # >= 1: the liar's record at round 0 is no peer the round waits for
    liar = Swarm.join("test", CONFIG, run_document(), initial_peers=trio[0].addresses(), host_maddrs=LOOPBACK)
    try:
        liar.update_record(step_seconds=1e-300)
        for s in trio:
            s.update_record(step_seconds=0.1)
            s.announce_progress(round_index, Phase.AVERAGING, "start-state", {"params": "start-state"})
        assert liar.flush() and all(s.flush() for s in trio)
        stats = all_reduce_at(trio, [DenseMean(random_tensors(90 + i)) for i in range(3)], round_index)
        assert all(len(s.peers) == 3 and s.committed for s in stats)
        for s in (me, liar):
            s.loop.run(s.directory.refresh(), 10)
        assert liar.peer_id in me.directory.live and me.communicator.partners == others
        assert me.step_seconds() == [0.1, 0.1] and budget.seconds() is None  # H steps
        assert sorted(liar.step_seconds()) == [0.1, 0.1, 0.1]  # a joiner goes by every record of the run

        # A partner's absurd claim is left out too, and a banned partner's step is not read.
        round_index = next(rounds)
        for s in (*trio, liar):
            s.announce_progress(round_index, Phase.AVERAGING, "start-state", {"params": "start-state"})
        assert all(s.flush() for s in (*trio, liar))
        stats = all_reduce_at([*trio, liar], [DenseMean(random_tensors(95 + i)) for i in range(4)], round_index)
        assert all(len(s.peers) == 4 and s.committed for s in stats)
        assert me.communicator.partners == others | {liar.peer_id}
        assert sorted(me.step_seconds()) == [1e-300, 0.1, 0.1] and budget.seconds() is None
        me.bans.ban(liar.peer_id, round_index, "a test")
        assert me.step_seconds() == [0.1, 0.1]
    finally:
        liar.leave()


def test_rounds_a_peer_does_not_apply_leave_its_partners_as_they_were(trio, monkeypatch):
    """After four rounds that aborted, a peer's partners used to be none, and its round budget went by every record of
    the run again: a few records claiming fast steps shortened its rounds up to 16x. A round it does not apply now
    leaves its partners as they were."""
    me, others = trio[0], {s.peer_id for s in trio[1:]}

    def all_reduce_now(seed: int) -> list:
        round_index = next(rounds)
        for s in trio:
            s.announce_progress(round_index, Phase.AVERAGING, "start-state", {"params": "start-state"})
        assert all(s.flush() for s in trio)
        return round_index, [DenseMean(random_tensors(seed + i)) for i in range(3)]

    round_index, exchanges = all_reduce_now(110)
    assert all(s.committed for s in all_reduce_at(trio, exchanges, round_index))
    partners = me.communicator.partners  # the others (and peers of earlier tests' rounds)
    assert others <= partners
    for attempt in range(PARTNER_ROUNDS + 1):
        round_index, exchanges = all_reduce_now(120 + 3 * attempt)
        monkeypatch.setitem(faults.ACTIVE, ("commit.vote", round_index), faults.Fault("fail"))  # no decision
        assert not any(s.committed for s in all_reduce_at(trio, exchanges, round_index))
    assert me.communicator.partners == partners


@pytest.mark.timeout(120)
def test_a_peer_alone_because_its_coordinator_is_leaving_applies_its_round():
    """Of two peers, the one that coordinates the round is leaving: it withdrew, and answers so, before its record
    says so. The other, alone, applies its own update, as nobody else will apply the round (it used to apply
    nothing, waiting on the leaver as on a peer that could apply the round without it)."""
    swarms = []
    try:
        a, b = join_swarms("pair", 2, CONFIG, swarms)
        round_index = next(r for r in range(1000) if best_coordinator({a.peer_id, b.peer_id}, r) == b.peer_id)
        for s in (a, b):
            s.announce_progress(round_index, Phase.AVERAGING, "start-state", {"params": "start-state"})
        assert all(s.flush() for s in (a, b))
        b.loop.run(b.communicator.matchmaker.withdraw(), 30)
        result = a.communicator.all_reduce(DenseMean(random_tensors(7)), round_index, "params")
        assert (result.committed, result.peers, Failure.ALONE in result.failures) == (True, [a.peer_id], False)
        assert b.directory.me.state == Phase.AVERAGING  # what its record still says
    finally:
        for s in swarms:
            s.leave()


def test_a_peer_alone_while_the_others_sit_the_round_out_applies_it():
    """Of two peers, b sits rounds out (its one step outlasts a round): its short step of round r is over and its
    record shows round r + 1, as it catches up, yet it applied nothing. a, alone in round r, applies its own update:
    it used to count b as a peer that could apply the round without it, and applied nothing either, losing the
    round for both (`wan.py --slow 1 3 10`: the fast host lost 2 of 12 rounds so)."""
    swarms = []
    try:
        a, b = join_swarms("sitting-out", 2, CONFIG, swarms)
        round_index = next(r for r in range(1000) if best_coordinator({a.peer_id, b.peer_id}, r) == a.peer_id)
        a.announce_progress(round_index, Phase.AVERAGING, "start-state", {"params": "start-state"})
        b.announce_progress(round_index + 1, Phase.JOINING, "start-state", {"params": "start-state"})
        b.update_record(sits_out=True)
        assert all(s.flush() for s in (a, b))
        result = a.communicator.all_reduce(DenseMean(random_tensors(8)), round_index, "params")
        assert (result.committed, result.peers, Failure.ALONE in result.failures) == (True, [a.peer_id], False)
        b.update_record(sits_out=False)  # a peer that trains the rounds: a may not apply alone
        assert b.flush()
        result = a.communicator.all_reduce(DenseMean(random_tensors(9)), round_index, "params")
        assert (result.committed, Failure.ALONE in result.failures) == (False, True)
    finally:
        for s in swarms:
            s.leave()


def coordinator_and_members(run_id: str, count: int, config: SwarmConfig, swarms: list) -> tuple[int, object, list]:
    """``count`` real peers (added to ``swarms``) and a round that the first of them coordinates while the others
    work on it: the coordinator's record stays behind, so it forms the group and is no member of it. Returns the
    round, the coordinator and the members (in id order)."""
    join_swarms(run_id, count, config, swarms)
    for s in swarms:
        s.announce_progress(0, Phase.JOINING, "start-state", {"params": "start-state"})
    assert all(s.wait_for_peers(count, 30) == count for s in swarms)
    ids = {s.peer_id for s in swarms}
    round_index = next(r for r in range(2, 1000) if best_coordinator(ids, r) == swarms[0].peer_id)
    coordinator, members = swarms[0], sorted(swarms[1:], key=lambda s: s.peer_id)
    for s in members:
        s.announce_progress(round_index, Phase.AVERAGING, "start-state", {"params": "start-state"})
    assert all(s.flush() for s in swarms)
    return round_index, coordinator, members


@pytest.mark.timeout(180)
@pytest.mark.parametrize("answered", [1, pytest.param(2, marks=pytest.mark.slow)])  # 2: in CI's second stage
def test_a_member_whose_coordinator_died_after_answering_it_joins_the_round_at_the_next_coordinator(answered):
    """The coordinator of a round closes its group of three and dies after answering ``answered`` of them: the
    others' asks break, and they join the round at the next coordinator. A member that holds the dead group learns
    it from its reducers (every other member takes part in the round in another group: one answered) or from its
    vote, which finds no coordinator (two answered: they reduced with each other first), and joins the same round
    at the next coordinator, whose formation waits for it: all three commit the same aggregate there. Each member
    that held the dead group used to apply nothing, waiting for a decision that never came, and the others went on
    without it once the next coordinator's wait was up."""
    config = SwarmConfig(matchmaking_timeout=15, allreduce_timeout=5, heartbeat_interval=0.5, peer_ttl=10,
                         ban_rounds=0)
    swarms = []
    try:
        round_index, coordinator, members = coordinator_and_members("dead-coordinator", 4, config, swarms)
        ids = {s.peer_id for s in swarms}
        holders = {s.peer_id for s in members[:answered]}
        serving = coordinator.communicator.matchmaker.coordinator
        join_here, released = serving.join_here, asyncio.Event()

        async def answer_some(sender: str, request: dict) -> dict:
            answer = await join_here(sender, request)
            if sender not in holders:
                await released.wait()  # it dies before it answers the others
            return answer

        serving.join_here = answer_some
        inputs = [random_tensors(110 + i) for i in range(3)]
        exchanges = [DenseMean(t) for t in inputs]
        pending = [s.communicator.start_all_reduce(e, round_index, "params") for s, e in zip(members, exchanges)]
        assert all(p.grouped.wait(30) for s, p in zip(members, pending) if s.peer_id in holders)
        coordinator.loop.run(coordinator.node.protocol.p2p.shutdown(), 30)
        coordinator.loop.loop.call_soon_threadsafe(released.set)
        stats = [p.wait(90) for p in pending]
        assert [(s.committed, s.peers) for s in stats] == [(True, [m.peer_id for m in members])] * 3
        expected = in_process_mean(inputs)
        for exchange in exchanges:
            assert all(torch.equal(a, b) for a, b in zip(exchange.mean(), expected))
        assert [s.attempts for s in stats] == [2 if m.peer_id in holders else 1 for m in members]
        assert all((Failure.NO_DECISION in s.failures) == (answered == 2) for s in stats[:answered])
        nearest = best_coordinator(ids - {coordinator.peer_id}, round_index)
        [group] = [g for s in members for k, g in s.communicator.matchmaker.coordinator.book.formations().items()
                   if k[0] == round_index]
        assert (group.coordinator, group.peers) == (nearest, tuple(m.peer_id for m in members))
    finally:
        for s in swarms:
            s.leave()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("reach", ["public", "client"])
def test_a_member_that_crashes_before_it_sends_its_contributions_is_not_waited_for(reach):
    """Member x crashes before it sends the others its contributions, after it answered theirs (public: it reduces
    a span; behind a NAT it reduces none): no stream of theirs to x is left to break. A reducer looks at the members
    that owe it a contribution and never began to send it, and the coordinator at the voters it awaits: x's daemon
    cannot be reached (public), or x's record is no longer renewed (behind a NAT, where nobody can dial it). Both go
    on without x, where they used to wait their whole deadlines, and the round commits without x's vote."""
    # No audits: one drawn of x's piece would find x gone and refuse it, and the round would be redone, or not, by
    # the draw
    config = SwarmConfig(matchmaking_timeout=15, allreduce_timeout=60, heartbeat_interval=0.5, peer_ttl=10,
                         ban_rounds=0, audit=False)
    swarms = []
    answered = threading.Semaphore(0)
    try:
        join_swarms("crashed-member", 3, config, swarms)
        swarms.append(Swarm.join("crashed-member", config.model_copy(update={"reachability": reach}), run_document(),
                                 initial_peers=swarms[0].addresses(), host_maddrs=LOOPBACK))
        for s in swarms:
            s.announce_progress(0, Phase.JOINING, "start-state", {"params": "start-state"})
        assert all(s.wait_for_peers(4, 30) == 4 for s in swarms)
        coordinator, others, x = swarms[0], sorted(swarms[1:3], key=lambda s: s.peer_id), swarms[3]
        public = {s.peer_id for s in swarms[:3]} | ({x.peer_id} if reach == "public" else set())
        round_index = next(r for r in range(2, 1000) if best_coordinator(public, r) == coordinator.peer_id)
        for s in [*others, x]:
            s.announce_progress(round_index, Phase.AVERAGING, "start-state", {"params": "start-state"})
        assert all(s.flush() for s in swarms)

        def crash_before_sending(owner, honest):
            async def contribute(ours, peer, route, piece):
                if owner.me == x.peer_id:
                    await asyncio.Event().wait()  # x sends nothing: it crashes first
                delivery = await honest(ours, peer, route, piece)
                if peer == x.peer_id:
                    answered.release()
                return delivery

            return contribute

        faults.swap("reduce.contribute", crash_before_sending)
        inputs = [random_tensors(130 + i) for i in range(3)]
        exchanges = [DenseMean(t) for t in inputs]
        pending = [s.communicator.start_all_reduce(e, round_index, "params") for s, e in zip([*others, x], exchanges)]
        assert pending[2].grouped.wait(30)
        if reach == "public":
            assert all(answered.acquire(timeout=60) for _ in others)  # x answered both
        x.loop.run(x.node.protocol.p2p.shutdown(), 30)
        stats = [p.wait(90) for p in pending[:2]]
        assert [s.committed for s in stats] == [True, True]
        assert all(Failure.UNREACHABLE in s.failures and Failure.TIMEOUT not in s.failures for s in stats)
        # x's contribution is in the span x reduced (public), or in none (behind a NAT): the others' mean
        expected = exchanges[0].mean() if reach == "public" else in_process_mean(inputs[:2])
        assert all(torch.equal(a, b) for a, b in zip(exchanges[1].mean(), expected))
    finally:
        faults.swap("reduce.contribute", None)
        for s in swarms:
            s.leave()


@pytest.mark.timeout(180)
def test_a_member_that_takes_part_in_the_round_elsewhere_says_so_and_is_not_waited_for(caplog):
    """Member x, alive and dialable, got its group and then took part in the round at another coordinator (as a
    member that refuses its group asks the next one): it sends the group nothing. Asked by the reducers that await its
    contribution and by the ballot that awaits its vote, it answers that it is elsewhere, and both go on without it at
    once, where they used to wait their whole deadlines (6 such members of 2,045 simulated cost their group 120 s in
    the butterfly and 117 s in the ballot). No failure is counted: nobody's link failed, and nobody timed out."""
    config = SwarmConfig(matchmaking_timeout=15, allreduce_timeout=60, heartbeat_interval=0.5, peer_ttl=10,
                         ban_rounds=0, audit=False)
    swarms, elsewhere = [], {}  # x's peer id -> the coordinator it takes part at instead

    def go_elsewhere(owner, honest):
        async def form(sync):
            state = await honest(sync)
            if owner.me.peer_id in elsewhere:
                owner.matchmaker.whereabouts.join(sync.round_index, sync.name, elsewhere[owner.me.peer_id])
                await asyncio.Event().wait()  # it sends this group nothing, and never votes
            return state

        return form

    faults.swap("sync.forming", go_elsewhere)  # taken as each communicator starts
    caplog.set_level(logging.INFO, logger="p2ploco.sync")
    try:
        join_swarms("elsewhere-member", 4, config, swarms)
        coordinator = swarms[0]
        round_index = next(r for r in range(2, 1000)
                           if best_coordinator({s.peer_id for s in swarms}, r) == coordinator.peer_id)
        others, x = sorted(swarms[1:3], key=lambda s: s.peer_id), swarms[3]
        for s in swarms[1:]:
            s.announce_progress(round_index, Phase.AVERAGING, "start-state", {"params": "start-state"})
        assert all(s.flush() for s in swarms)
        elsewhere[x.peer_id] = others[0].peer_id
        inputs = [random_tensors(140 + i) for i in range(3)]
        exchanges = [DenseMean(t) for t in inputs]
        pending = [s.communicator.start_all_reduce(e, round_index, "params") for s, e in zip([*others, x], exchanges)]
        stats = [p.wait(90) for p in pending[:2]]
        assert [s.committed for s in stats] == [True, True]
        assert all(Failure.TIMEOUT not in s.failures and Failure.UNREACHABLE not in s.failures for s in stats)
        lines = [r.getMessage() for r in caplog.records]
        votes = {m.rpartition(": ")[2] for m in lines if m.startswith(f"round {round_index}: not waiting for the "
                                                                      f"vote of {x.peer_id[-8:]}: ")}
        assert votes == {ELSEWHERE}  # its vote used to be waited for until the ballot's deadline
        # a reducer does not wait for its contribution (x refuses theirs, where it reduces a span: they know at once)
        assert not [m for m in lines if f"going on without {x.peer_id[-8:]}'s" in m and "sent nothing" in m]
        expected = in_process_mean(inputs[:2])  # without x's contribution, in every span
        assert all(torch.equal(a, b) for e in exchanges[:2] for a, b in zip(e.mean(), expected))
    finally:
        faults.swap("sync.forming", None)
        for s in swarms:
            s.leave()


@pytest.mark.timeout(180)
def test_a_coordinator_that_leaves_decides_the_round_of_the_group_it_formed_first():
    """The coordinator of a round trains none of it (a peer sitting rounds out, idle at the end of its run) and
    leaves as soon as it has formed the group: it used to shut down before the members voted, and they applied
    nothing (no decision). A leaving peer now decides the rounds of the groups it formed first."""
    config = SwarmConfig(matchmaking_timeout=15, allreduce_timeout=5, heartbeat_interval=0.5, peer_ttl=10,
                         ban_rounds=0)
    swarms = []
    try:
        round_index, coordinator, members = coordinator_and_members("leaving-coordinator", 3, config, swarms)
        released = threading.Event()  # the members reduce only once their coordinator is leaving
        for s in members:
            run = s.communicator.butterfly.run

            async def held(group, exchange, run=run):
                await asyncio.to_thread(released.wait, 60)
                return await run(group, exchange)

            s.communicator.butterfly.run = held
        inputs = [random_tensors(120 + i) for i in range(2)]
        exchanges = [DenseMean(t) for t in inputs]
        pending = [s.communicator.start_all_reduce(e, round_index, "params") for s, e in zip(members, exchanges)]
        assert all(p.grouped.wait(30) for p in pending)
        withdrawing, withdraw = threading.Event(), coordinator.communicator.matchmaker.withdraw

        async def noted_withdraw():
            withdrawing.set()
            await withdraw()

        coordinator.communicator.matchmaker.withdraw = noted_withdraw
        leaving = threading.Thread(target=coordinator.leave)
        leaving.start()
        assert withdrawing.wait(30)  # its farewell is under way: it stops joining groups, then shuts down
        released.set()
        stats = [p.wait(90) for p in pending]
        leaving.join(60)
        assert [(s.committed, s.peers, s.attempts) for s in stats] == [(True, [m.peer_id for m in members], 1)] * 2
        expected = in_process_mean(inputs)
        for exchange in exchanges:
            assert all(torch.equal(a, b) for a, b in zip(exchange.mean(), expected))
    finally:
        for s in swarms[1:]:
            s.leave()


def test_a_piece_waits_for_owed_contributions_and_open_streams_only_and_for_a_left_out_sender_that_connects_anyway():
    """``Inbox``: contributions have arrived once every sender delivered or was left out; the result is served once
    every sender's and hub's stream ended, a left-out sender that never connected excepted."""
    async def events() -> list[tuple[bool, bool]]:
        group = Group("g", 3, "params", ("a", "b", "c", "hub"), "a")
        inbox = Inbox(group, "params", range(0, 8), None, {"b", "c"}, {"hub"}, 5.0, time.monotonic() + 5.0)
        seen = []

        def note() -> None:
            seen.append((inbox.arrived.is_set(), inbox.served.is_set()))
        inbox.connect("b")
        inbox.deliver("b", b"payload")
        note()  # c still owed
        inbox.miss("c", Failure.TIMEOUT, "too late")
        note()  # every contribution in or left out; b's and the hub's streams still open
        assert inbox.owing() == set() and inbox.refusal("c") is not None
        inbox.close_stream("b")
        inbox.connect("c")  # left out, connects all the same: it is answered its refusal, and waited on
        inbox.close_stream("hub")
        note()
        inbox.close_stream("c")
        note()
        return seen

    assert asyncio.run(events()) == [(False, False), (True, False), (True, False), (True, True)]


def test_a_sender_left_out_before_it_connected_is_not_waited_on():
    async def served() -> bool:
        group = Group("g", 3, "params", ("a", "b", "c"), "a")
        inbox = Inbox(group, "params", range(0, 8), None, {"b", "c"}, set(), 5.0, time.monotonic() + 5.0)
        inbox.connect("b")
        inbox.deliver("b", b"payload")
        inbox.reject("c", "banned here")
        inbox.close_stream("b")
        return inbox.served.is_set() and inbox.owing() == set()

    assert asyncio.run(served())
