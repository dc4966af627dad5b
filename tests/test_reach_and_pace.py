"""Peers that cannot be dialled and peers of unequal speed, with real node processes on loopback: a peer in client
mode (as behind a NAT) trains in every round without reducing a span, trainers that all are so train together
through a hub, a slowed peer trains fewer steps in the
round's time budget while its work, weighted by its tokens, is applied every round, and a peer whose one step
outlasts the round sits rounds out while the others train on without it, and its work is applied after all."""

import re

import pytest

from p2ploco.launch import TINY_CONFIG, LocalSwarm

FAST = ["--set", "swarm.matchmaking_timeout=10", "--set", "swarm.allreduce_timeout=5",
        "--set", "swarm.heartbeat_interval=0.5", "--set", "swarm.min_peers=3"]
ROUNDS = 4


def identical_every_round(runs: list[list[dict]]) -> None:
    for index in range(ROUNDS):
        rows = [records[index] for records in runs]
        assert all(r["round"] == index and r["applied"] and r["peers"] == 3 for r in rows), rows
        assert len({r["params_digest"] for r in rows}) == 1, rows


@pytest.mark.timeout(300)
def test_a_peer_that_only_dials_out_takes_part_in_every_round(tmp_path):
    with LocalSwarm(tmp_path) as swarm:
        nodes = [swarm.start_node(name, TINY_CONFIG, *FAST, "--max-rounds", str(ROUNDS),
                                  *(["--reachability", "client"] if name == "c" else []))
                 for name in "abc"]
        for node in nodes:
            assert node.process.wait(240) == 0
        runs = [swarm.summaries(name) for name in "abc"]
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


JOINED = re.compile(r"peer (\w+) joined run")
STRANDED = re.compile(r"round (\d+): 1 other trainer\(s\) of this run are live \((\w+)\), but no coordinator answered: "
                      r"none of them can be dialled, and no hub serves the run. This peer applies nothing until one "
                      r"can .*Fix: a hub")


@pytest.mark.slow  # 56 s; the default run keeps a peer that only dials out taking part in every round
@pytest.mark.timeout(300)
def test_trainers_that_only_dial_out_apply_nothing_alone_say_why_once_and_train_together_once_a_hub_starts(tmp_path):
    """Two trainers in client mode (as behind home routers) and a bootstrap without a hub: nobody can coordinate. Each
    used to apply rounds alone, a private model each, and said nothing. Now each applies nothing and says why, once;
    a hub that starts later serves them, and from then on they apply rounds together with one digest."""
    rounds = 30
    with LocalSwarm(tmp_path) as swarm:
        trainers = {name: swarm.start_node(name, TINY_CONFIG, *FAST, "--set", "swarm.min_peers=2", "--max-rounds",
                                           str(rounds), "--reachability", "client") for name in "ab"}
        ids = {name: node.wait_for_line(JOINED, timeout=60).group(1) for name, node in trainers.items()}
        stranded = {name: node.wait_for_line(STRANDED, timeout=120) for name, node in trainers.items()}
        hub = swarm.start_node("hub", TINY_CONFIG, *FAST, "--set", "swarm.min_peers=2", "--role", "hub",
                               "--max-rounds", str(rounds))
        assert [node.process.wait(240) for node in trainers.values()] == [0, 0]
        runs = {name: swarm.summaries(name) for name in "ab"}
        hub.terminate()
    for name, records in runs.items():
        assert len(STRANDED.findall((tmp_path / f"{name}.log").read_text())) == 1, name  # said once
        other = next(n for n in "ab" if n != name)
        assert stranded[name].group(2) == ids[other][-8:]
        assert not any(r["applied"] and r["peers"] == 1 for r in records), name  # never alone
        assert records[0]["failures"] == {"no coordinator": 1}, records[0]
        together = min(r["round"] for r in records if r["applied"])  # from the hub's first round on: every round
        assert [r["applied"] for r in records] == [r["round"] >= together for r in records], name
    applied = {name: {r["round"]: r for r in records if r["applied"]} for name, records in runs.items()}
    assert applied["a"].keys() == applied["b"].keys()
    for index in applied["a"]:
        a, b = applied["a"][index], applied["b"][index]
        assert a["params_digest"] == b["params_digest"] and a["peers"] == b["peers"] == 3, (a, b)
    # The hub's lines say what a hub does (they used to read "loss nan | eval - | 0.0k tok/s")
    hub_lines = [line for line in (tmp_path / "hub.log").read_text().splitlines()
                 if re.search(r"\] round\s+\d+ \|", line)]
    assert hub_lines and all(re.search(r"\] round\s+\d+ \| hub \| group [1-3] \| reduced \S+ \S+ \| served \S+ \S+ \| "
                                       r"comm [\d.]+s", line) and "loss" not in line for line in hub_lines), hub_lines
    assert any(" | group 3 | " in line for line in hub_lines), hub_lines


@pytest.mark.slow  # CI's second stage; the default run keeps a peer that only dials out (above) and hubs in process
@pytest.mark.timeout(300)
def test_trainers_that_all_only_dial_out_train_together_through_the_bootstraps_hub(tmp_path):
    """Both trainers are in client mode (as behind home routers): neither can coordinate or reduce. The bootstrap
    (``p2ploco dht``) hosts a hub by default, a peer that trains nothing: with it they apply every round together,
    and the hub ends each with their params; it trains and contributes nothing. Without it, no round of theirs
    would have a coordinator."""
    with LocalSwarm(tmp_path, hub=True) as swarm:
        nodes = [swarm.start_node(name, TINY_CONFIG, *FAST, "--max-rounds", str(ROUNDS), "--reachability", "client")
                 for name in "ab"]
        for node in nodes:
            assert node.process.wait(240) == 0
        hub = swarm.hub_summaries("tiny")[:ROUNDS]  # it serves the run until the bootstrap stops
        runs = {"a": swarm.summaries("a"), "b": swarm.summaries("b")}
    identical_every_round([hub, *runs.values()])
    assert all(r["tokens"] == 0 and r["contributed_tokens"] == 0 and r["role"] == "hub" for r in hub)
    assert all(r["reachability"] == "public" for r in hub)  # dialled back at the bootstrap's machine
    for name in "ab":
        assert all(r["reachability"] == "client" and r["contributed_tokens"] == r["tokens"] > 0 for r in runs[name])


@pytest.mark.slow  # CI's second stage: four nodes and two hubs
@pytest.mark.timeout(300)
def test_a_bootstrap_hosts_a_hub_for_each_run_trained_through_it(tmp_path):
    """Two runs through one bootstrap, each of one trainer that only dials out: the bootstrap fetches each run's
    config and hosts a hub for each (it used to serve one run only, and none where there were several), and each
    trainer applies every round with its run's hub."""
    runs = {"a": "one", "b": "two"}
    with LocalSwarm(tmp_path, hub=True) as swarm:
        nodes = [swarm.start_node(name, TINY_CONFIG, *FAST, "--set", "swarm.min_peers=2", "--max-rounds", str(ROUNDS),
                                  "--run-id", run, "--reachability", "client") for name, run in runs.items()]
        assert [node.process.wait(240) for node in nodes] == [0, 0]
        trained = {run: (swarm.summaries(name), swarm.hub_summaries(run)[:ROUNDS]) for name, run in runs.items()}
    for run, (records, hub) in trained.items():
        assert [r["round"] for r in records] == [r["round"] for r in hub] == list(range(ROUNDS)), run
        assert all(r["applied"] and r["peers"] == 2 for r in records + hub), run
        assert [r["params_digest"] for r in records] == [r["params_digest"] for r in hub], run


@pytest.mark.timeout(300)
def test_a_slow_peer_trains_fewer_steps_and_its_tokens_count(tmp_path):
    with LocalSwarm(tmp_path) as swarm:
        # Paces pinned by holds before each step (a step's time is its wall time), whatever the machine's load
        # adds to a step's compute (0.03-0.3 s here): the slow peer's step, 1.2 s and up, is more than 2x the fast
        # peers' (out of their cohort) and shorter than their H = 10 steps (it fits in the round).
        nodes = [swarm.start_node(name, TINY_CONFIG, *FAST, "--max-rounds", str(ROUNDS), "--set", "inner.steps=10",
                                  env={"P2PLOCO_FAULTS": f"inner.step=stall:{1.2 if name == 's' else 0.2}"})
                 for name in "abs"]
        for node in nodes:
            assert node.process.wait(240) == 0
        runs = [swarm.summaries(name) for name in "abs"]
    identical_every_round(runs)
    fast, slow = runs[0], runs[2]
    # Once the fast peers' step times are known the slow peer trains a fraction of H, and says so; a step of it
    # fits in the round, so it never sits a round out.
    later = slow[1:]
    assert all(0 < r["inner_steps"] < 10 and not r["sat_out"] for r in later), [r["inner_steps"] for r in slow]
    assert all(r["tokens"] == r["inner_steps"] * 8 * 128 for r in slow)
    # Its contribution carried what it trained (every round applied: nothing left over to carry).
    assert [r["contributed_tokens"] for r in slow] == [r["tokens"] for r in slow]
    # The fast peers train H, the slow one a fraction of it (each of its first round's H steps was unbudgeted).
    assert all(r["inner_steps"] == 10 for r in fast)
    assert sum(r["inner_steps"] for r in fast[1:]) >= 3 * sum(r["inner_steps"] for r in later)


@pytest.mark.slow  # CI's second stage; the default run keeps a slow peer's real-process test (above)
@pytest.mark.timeout(300)
def test_a_peer_whose_step_outlasts_the_round_sits_rounds_out_and_its_work_is_applied(tmp_path):
    """A peer held 1.5 s before each step beside peers held 0.1 s, at H = 2 (steps of 1.53-1.8 s against 0.13-0.4 s
    whatever the load adds): once its pace is known, one of its steps outlasts the fast peers' round, and their
    steps are within the 16x it believes of anyone.
    It trains a step while its record says it stands by (the others' rounds go on without it, and apply), then
    contributes that step's work in its next round, with no step of that round, and the others apply it."""
    rounds = 10
    with LocalSwarm(tmp_path) as swarm:
        nodes = [swarm.start_node(name, TINY_CONFIG, *FAST, "--max-rounds", str(rounds), "--set", "inner.steps=2",
                                  env={"P2PLOCO_FAULTS": f"inner.step=stall:{1.5 if name == 's' else 0.1}"})
                 for name in "abs"]
        for node in nodes:
            assert node.process.wait(240) == 0
        runs = {name: swarm.summaries(name) for name in "abs"}
    slow = runs["s"]
    # Its last two rounds it sits out idle (a step's work would land after the others finished); before, a step
    idle = [r["round"] for r in slow if r["sat_out"] and not r["inner_steps"]]
    assert set(idle) <= {rounds - 2, rounds - 1}, idle
    sat = [r for r in slow if r["sat_out"] and r["round"] < rounds - 2]
    assert sat and all(r["inner_steps"] == 1 and not r["applied"] and r["contributed_tokens"] == 0 for r in sat)
    for fast in (runs["a"], runs["b"]):
        assert [r["round"] for r in fast] == list(range(rounds)) and all(r["applied"] for r in fast)
        by_round = {r["round"]: r for r in fast}
        assert all(by_round[r["round"]]["peers"] == 2 for r in sat)  # nobody waited for it in the rounds it sat out
    # Every step it sat a round out for is in a later round's applied aggregate, before it sits out again: that
    # round trained no step, and its contribution weighed the step's tokens.
    assert len(sat) >= 2
    for step, again in zip(sat, sat[1:]):
        between = [r for r in slow if step["round"] < r["round"] < again["round"] and r["applied"]]
        assert len(between) == 1, [(r["round"], r["applied"], r["sat_out"]) for r in slow]
        assert between[0]["peers"] == 3 and between[0]["inner_steps"] == 0
        assert between[0]["contributed_tokens"] >= step["tokens"]
    ends = {r["round"]: r["params_digest"] for r in runs["a"]}
    assert all(ends[r["round"]] == r["params_digest"] for r in slow if r["applied"])
    # After each round it sat out it caught up by that round's update (a fraction of the state), not the state, and
    # its lines print no NaN loss for the rounds that trained no step
    caught_up = [r for r in slow if r["catchup_bytes"]]
    assert len(caught_up) >= len(sat) and all(r["catchup_updates"] >= 1 for r in caught_up), caught_up
    assert "loss nan" not in (tmp_path / "s.log").read_text()
