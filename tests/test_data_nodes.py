"""Real node processes on loopback training on one's own data: a prepared corpus (and a peer on another
prepared corpus refused), and one plain ~10 MB text file."""

import re
import signal
import sysconfig
from pathlib import Path

import pytest

from p2ploco.data import ByteTokenizer, prepare
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
        assert len({records[round_index]["params_sha256"] for records in runs.values()}) == 1


@pytest.mark.swarm
@pytest.mark.timeout(240)
def test_nodes_train_on_a_prepared_corpus_and_ignore_a_peer_on_another(tmp_path):
    """A node on another prepared corpus (another config fingerprint) starts, says in one line that the run's
    peers train another config, and never shares a round with them; the two on the same corpus train together.
    (It used to be refused: then one record of another config, which anyone can publish, stopped every new node.)"""
    modules = sorted(STDLIB.glob("*.py"))
    prepare([str(p) for p in modules[:60]], tmp_path / "ours", ByteTokenizer(), 2.0)
    prepare([str(p) for p in modules[60:120]], tmp_path / "other", ByteTokenizer(), 2.0)
    rounds = 4
    with LocalSwarm(tmp_path / "swarm") as swarm:
        def start(name: str, corpus: str):
            return swarm.start_node(name, TINY_CONFIG, *FAST, "--max-rounds", str(rounds), "--set",
                                    "swarm.min_peers=2", "--set", f"data.prepared={tmp_path / corpus}")

        a = start("a", "ours")
        a.wait_for_line(JOINED, 60)
        b = start("b", "other")
        b.wait_for_line(re.compile(r"run 'tiny' has peers of another config \(fingerprint \w+, yours \w+\)"), 60)
        c = start("c", "ours")
        assert [a.process.wait(180), c.process.wait(60)] == [0, 0]
        b.signal(signal.SIGTERM)
        assert b.process.wait(60) == 0
        runs = {name: swarm.records(name) for name in "ac"}
        others = swarm.records("b")
    assert "(prepared)" in (tmp_path / "swarm" / "a.log").read_text()
    assert_trained_together(runs, rounds)
    assert all(r["peers"] == 1 for r in others)  # b never averaged with a or c


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
        runs = {name: swarm.records(name) for name in "ab"}
    assert "blocks of" in (tmp_path / "swarm" / "a.log").read_text()
    assert_trained_together(runs, rounds)
