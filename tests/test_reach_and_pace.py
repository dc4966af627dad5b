"""Peers that cannot be dialled and peers of unequal speed, with real node processes on loopback: a peer in client
mode (as behind a NAT) trains in every round without reducing a span, and a slowed peer trains fewer steps in the
round's time budget while its work, weighted by its tokens, is applied every round."""


import pytest

from p2ploco.launch import TINY_CONFIG, LocalSwarm

FAST = ["--set", "swarm.matchmaking_timeout=10", "--set", "swarm.allreduce_timeout=5",
        "--set", "swarm.heartbeat_interval=0.5", "--set", "swarm.min_peers=3"]
ROUNDS = 4


def identical_every_round(runs: list[list[dict]]) -> None:
    for index in range(ROUNDS):
        rows = [records[index] for records in runs]
        assert all(r["round"] == index and r["applied"] and r["peers"] == 3 for r in rows), rows
        assert len({r["params_sha256"] for r in rows}) == 1, rows


@pytest.mark.timeout(300)
def test_a_peer_that_only_dials_out_takes_part_in_every_round(tmp_path):
    with LocalSwarm(tmp_path) as swarm:
        nodes = [swarm.start_node(name, TINY_CONFIG, *FAST, "--max-rounds", str(ROUNDS),
                                  *(["--reachability", "client"] if name == "c" else []))
                 for name in "abc"]
        for node in nodes:
            assert node.process.wait(240) == 0
        runs = [swarm.records(name) for name in "abc"]
    identical_every_round(runs)
    assert [r["reachability"] for r in runs[2]] == ["client"] * ROUNDS
    assert {r["reachability"] for records in runs[:2] for r in records} == {"public"}  # detected by dial-back
    # The client reduced no span: all it sent was its own contribution (a reducer sends results back too), and a
    # dense butterfly would have had it send and receive every value once.
    for client_round, public_round in zip(runs[2], runs[0]):
        params = client_round["dense_fp32_bytes"] / 8
        uploaded = client_round["bits_per_param"] * params / 8
        assert client_round["bytes_sent"] == pytest.approx(uploaded, abs=1)
        assert public_round["bytes_sent"] > public_round["bits_per_param"] * params / 8 + 1


@pytest.mark.timeout(300)
def test_a_slow_peer_trains_fewer_steps_and_its_tokens_count(tmp_path):
    with LocalSwarm(tmp_path) as swarm:
        nodes = [swarm.start_node(name, TINY_CONFIG, *FAST, "--max-rounds", str(ROUNDS),
                                  env={"P2PLOCO_FAULTS": "inner.step=slow:4"} if name == "s" else None)
                 for name in "abs"]
        for node in nodes:
            assert node.process.wait(240) == 0
        runs = [swarm.records(name) for name in "abs"]
    identical_every_round(runs)
    fast, slow = runs[0], runs[2]
    # Once the fast peers' step times are known the slow peer trains a fraction of H, and says so.
    later = slow[1:]
    assert all(r["inner_steps"] < 10 for r in later), [r["inner_steps"] for r in slow]
    assert all(r["tokens"] == r["inner_steps"] * 8 * 128 for r in slow)
    # Its contribution carried what it trained (every round applied: nothing left over to carry).
    assert [r["contributed_tokens"] for r in slow] == [r["tokens"] for r in slow]
    # The fast peers train H (a fast peer's steps may look 2x slow for a while on a busy machine: then fewer).
    assert sum(r["inner_steps"] for r in fast) >= 3 * sum(r["inner_steps"] for r in slow)
