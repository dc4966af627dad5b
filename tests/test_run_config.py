"""The run's config as peers serve it (``swarm/run_config.py``), over real hivemind peers on loopback: the document
most live peers' records vouch for, never one whose digest is not the fingerprint asked for, and nothing a donor
answers stops the asker."""

import json

import pytest
from helpers import LOOPBACK, run_document

from p2ploco.config import SwarmConfig, document_fingerprint
from p2ploco.peer import Arrival, Swarm
from p2ploco.swarm.records import PeerRecord, Phase
from p2ploco.swarm.run_config import ConfigConflict, ConfigUnserved, ranked_fingerprints

CONFIG = SwarmConfig(matchmaking_timeout=5, allreduce_timeout=3, heartbeat_interval=0.5, peer_ttl=10)
OURS, THEIRS = run_document("ours"), run_document("theirs")


@pytest.fixture(scope="module")
def swarms():
    """Two peers of one config and one of another, in run "test"."""
    started = []
    try:
        for document in (OURS, OURS, THEIRS):
            peers = started[0].addresses() if started else ()
            started.append(Swarm.join("test", CONFIG, document, initial_peers=peers, host_maddrs=LOOPBACK))
        for s in started:
            s.announce_progress(0, Phase.JOINING, "start", {"params": "start"})
        assert all(s.wait_for_peers(2, 30) == 2 for s in started[:2])  # each sees the other of its config
        yield started
    finally:
        for s in started:
            s.leave()


def ask(swarms, mine: str = ""):
    arrival = Arrival.start("test", "public", swarms[0].addresses(), LOOPBACK)
    try:
        return arrival.run_document(mine)
    finally:
        arrival.abandon()


@pytest.mark.timeout(120)
def test_a_joiner_gets_the_document_most_live_peers_vouch_for(swarms):
    run = ask(swarms)
    assert (run.document, run.fingerprint, run.holders, run.peers) == (OURS, document_fingerprint(OURS), 2, 3)
    assert run.donor in {s.peer_id for s in swarms[:2]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("payload", [
    json.dumps(THEIRS).encode(),  # another run's document under this fingerprint
    json.dumps({**OURS, "round_tokens": 2}).encode(),  # one setting changed
    b"[" * 60_000,  # deeper than the JSON parser goes
    b"\xff not json",
    json.dumps({**OURS, "settings": {"inner.lr": {"deep": [[[[1]]]]}}}).encode(),  # not a setting's value
])
def test_a_document_that_is_not_its_fingerprints_is_refused_and_no_config_fewer_peers_hold_is_taken(swarms, payload):
    """Both peers of the run's config serve something else under its fingerprint: the joiner takes nothing (it used to
    fall through to the next fingerprint, and four keys made a newcomer train their config), and says so."""
    honest = swarms[0].config_server.payload
    try:
        for liar in swarms[:2]:
            liar.config_server.payload = payload
        with pytest.raises(ConfigUnserved, match=f"2 of the 3 peers of run 'test' carry config "
                                                 f"{document_fingerprint(OURS)} in their records, and none of them "
                                                 f"serves it"):
            ask(swarms)
    finally:
        for liar in swarms[:2]:
            liar.config_server.payload = honest


@pytest.mark.timeout(120)
def test_the_peer_whose_address_was_typed_is_asked_first_and_one_of_another_config_stops_the_joiner(swarms):
    run = ask(swarms)  # swarms[0], the typed one, trains the run's config: it is asked first
    assert run.donor == swarms[0].peer_id
    arrival = Arrival.start("test", "public", swarms[2].addresses(), LOOPBACK)  # a peer of the other config
    try:
        theirs, ours = document_fingerprint(THEIRS), document_fingerprint(OURS)
        with pytest.raises(ConfigConflict, match=f"the peer you named \\({swarms[2].peer_id[-8:]}\\) trains another "
                                                 f"config of run 'test' \\(fingerprint {theirs}\\) than 2 of its 3 "
                                                 f"peers do \\({ours}\\)"):
            arrival.run_document()
    finally:
        arrival.abandon()


@pytest.mark.timeout(120)
def test_a_joiner_with_another_config_is_logged_once_by_the_peer_it_asked_once_it_tells_it(swarms, caplog):
    """Asking names no config (a config file that differs in its batch split alone joins once fitted to the run's
    step); a joiner whose config still differs tells the donor, which logs it once however often it is told."""
    mine = document_fingerprint(run_document("mine"))
    arrival = Arrival.start("test", "public", swarms[0].addresses(), LOOPBACK)
    try:
        with caplog.at_level("WARNING", logger="p2ploco.swarm.run_config"):
            runs = [arrival.run_document(mine) for _ in range(2)]
            asked = [r.getMessage() for r in caplog.records if "with another config of its own" in r.getMessage()]
            for run in runs:
                arrival.tell_conflict(run, mine)
    finally:
        arrival.abandon()
    assert {run.fingerprint for run in runs} == {document_fingerprint(OURS)} and asked == []
    told = [r.getMessage() for r in caplog.records if "with another config of its own" in r.getMessage()]
    assert told == [f"peer {arrival.peer_id[-8:]} asked for run 'test''s config with another config of its own "
                    f"(fingerprint {mine}, the run's {runs[0].fingerprint}): it stops instead of joining"]


def test_a_tie_between_configs_goes_to_the_askers_own():
    records = [PeerRecord(peer_id=f"peer{i}", round=0, state="training", fingerprint=fingerprint)
               for i, fingerprint in enumerate(["a" * 16, "b" * 16, "c" * 16, "c" * 16])]
    assert [f for f, _ in ranked_fingerprints(records, "me")] == ["c" * 16, "a" * 16, "b" * 16]
    assert [f for f, _ in ranked_fingerprints(records, "me", mine="b" * 16)] == ["c" * 16, "b" * 16, "a" * 16]
    assert [f for f, _ in ranked_fingerprints(records, "peer2", mine="b" * 16)] == ["b" * 16, "a" * 16, "c" * 16]


def test_only_fresh_records_that_are_not_leaving_count_for_a_runs_config():
    """Three records of one config whose peers stopped renewing them (their daemons are gone, or they leave) count for
    nothing against two live peers of another: a record counts while at least half of its ttl is left."""
    def record(peer: str, fingerprint: str, state: str = "training") -> PeerRecord:
        return PeerRecord(peer_id=peer, round=3, state=state, fingerprint=fingerprint, ttl=10.0)

    records = [record("x1", "x" * 16), record("x2", "x" * 16), record("x3", "x" * 16, "leaving"),
               record("a", "a" * 16), record("b", "a" * 16)]
    left = {"x1": 4.9, "x2": 3.0, "x3": 9.9, "a": 9.5, "b": 5.0}
    assert ranked_fingerprints(records, "me", expires_in=left) == [("a" * 16, ["a", "b"])]
    renewed = [*records, record("x4", "x" * 16)]  # while they are renewed, they outnumber a and b
    assert ranked_fingerprints(renewed, "me", expires_in={**left, "x1": 9.0, "x2": 8.0, "x4": 9.9})[0] == (
        "x" * 16, ["x1", "x2", "x4"])
