"""Real node processes on loopback training on one's own data: a prepared corpus with its own tokenizer (and a
node that joins with one address, and one whose config conflicts), and one plain ~10 MB text file."""

import re
import sysconfig
from pathlib import Path

import pytest

from p2ploco.data import prepare, train_bpe
from p2ploco.launch import TINY_CONFIG, LocalSwarm

FAST = ["--set", "inner.steps=5", "--set", "swarm.matchmaking_timeout=10", "--set", "swarm.allreduce_timeout=4",
        "--set", "swarm.heartbeat_interval=0.5"]
STDLIB = Path(sysconfig.get_paths()["stdlib"])
JOINED = re.compile(r"joined run")


def assert_trained_together(runs: dict[str, list[dict]], rounds: int) -> None:
    for records in runs.values():
        assert [r["round"] for r in records] == list(range(rounds))
        assert all(r["applied"] and r["peers"] == len(runs) for r in records)
        assert records[-1]["eval_loss"] < records[0]["eval_loss"] - 0.3
    for round_index in range(rounds):
        assert len({records[round_index]["params_digest"] for records in runs.values()}) == 1


@pytest.mark.swarm
@pytest.mark.timeout(300)
def test_a_node_joins_with_one_address_trains_the_runs_config_and_a_conflicting_one_stops(tmp_path):
    """A run started with overrides (a prepared corpus with a tokenizer of its own, its vocabulary, H = 4); a node
    given only --initial-peers and --run-id (its copy of the corpus, how long it stays, and its pace: every round's
    H steps, a peer's own setting, so that a loaded host's slow first steps do not make it sit rounds out) fetches
    the run's config from it and trains every round with it, identical; a node whose --set conflicts exits 2 with
    one line naming the key, and the first node logs that once."""
    modules = sorted(STDLIB.glob("*.py"))[:60]
    tokenizer = train_bpe((path.read_text(errors="replace") for path in modules), 300, tmp_path / "tokenizer.json")
    prepare([str(path) for path in modules], tmp_path / "ours", tokenizer, 2.0)
    rounds, run = 4, ["--run-id", "ours", "--max-rounds", "4", "--set", "inner.fixed_steps=true"]
    with LocalSwarm(tmp_path / "swarm") as swarm:
        a = swarm.start_node("a", TINY_CONFIG, *FAST, *run, "--set", "swarm.min_peers=2", "--set",
                             f"data.prepared={tmp_path / 'ours'}", "--set", "model.vocab_size=300", "--set",
                             "inner.steps=4")
        a.wait_for_line(re.compile(r"  p2ploco node start --run-id ours --initial-peers /ip4/\S+$"), 60)
        corpus = ["--set", f"data.prepared={tmp_path / 'ours'}"]  # a joiner names its own copy
        conflicting = swarm.start_node("c", None, *run, *corpus, "--set", "inner.lr=0.01")
        assert conflicting.process.wait(60) == 2
        b = swarm.start_node("b", None, *run, *corpus)
        assert [a.process.wait(180), b.process.wait(60)] == [0, 0]
        runs = {name: swarm.summaries(name) for name in "ab"}
    refused = (tmp_path / "swarm" / "c.log").read_text().strip().splitlines()
    assert refused[-1] == ("error: this node's config differs from that of run 'ours', which 1 of its 1 peer(s) "
                           "(trainers and hubs) hold: inner.lr=0.01 (run: 0.002); drop those --set")
    b_log = (tmp_path / "swarm" / "b.log").read_text()
    assert "training the config of run 'ours': 1 of its 1 peer(s) (trainers and hubs) hold it" in b_log
    assert f"{tmp_path / 'ours'} (prepared)" in b_log and "H=4" in b_log
    assert (tmp_path / "swarm" / "a.log").read_text().count("with another config of its own") == 1
    assert_trained_together(runs, rounds)
    assert [r["inner_steps"] for r in runs["b"]] == [4] * rounds  # the run's H (tiny.yaml's own is 5)


@pytest.mark.slow
@pytest.mark.swarm
@pytest.mark.timeout(300)
def test_two_nodes_train_on_one_plain_ten_megabyte_text_file(tmp_path):
    """The issue's first experience: one plain text file in data.paths (it used to fail: no eval split)."""
    corpus = tmp_path / "corpus.txt"
    with corpus.open("wb") as out:
        for path in sorted(STDLIB.glob("*.py")) + sorted(STDLIB.glob("[a-s]*/*.py")):
            out.write(path.read_bytes())
    assert corpus.stat().st_size > 9_000_000
    rounds = 6
    with LocalSwarm(tmp_path / "swarm") as swarm:
        nodes = [swarm.start_node(name, TINY_CONFIG, *FAST, "--max-rounds", str(rounds), "--set", "swarm.min_peers=2",
                                  "--set", f"data.paths={corpus}") for name in "ab"]
        assert [node.process.wait(240) for node in nodes] == [0, 0]
        runs = {name: swarm.summaries(name) for name in "ab"}
    assert "blocks of" in (tmp_path / "swarm" / "a.log").read_text()
    assert_trained_together(runs, rounds)
