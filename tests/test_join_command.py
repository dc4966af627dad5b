"""The join command a node prints, pasted as printed, joins its run: for every config in configs/, a run started with
a batch split of its own (the issue's: the joiner's defaults used to make another step, and it exited 2)."""

import re
import shlex
from pathlib import Path

import pytest

from p2ploco.launch import LOOPBACK, REPO_ROOT, Child, cli
from p2ploco.metrics import read_records

# each config at a size that trains on a CPU in seconds, through its own overrides
SMALL = ["model.n_layer=2", "model.n_head=2", "model.d_model=32", "model.max_seq_len=32", "data.seq_len=32",
         "data.eval_sequences=4", "inner.steps=2"]
SPLIT = ["inner.batch_size=2", "inner.grad_accum=3"]  # no config's own: 6 sequences a step
PRINTED = re.compile(r"^  (p2ploco node start .*)$")
CONFIGS = sorted((REPO_ROOT / "configs").glob("*.yaml"))


def sets(settings: list[str]) -> list[str]:
    return [argument for setting in settings for argument in ("--set", setting)]


@pytest.mark.swarm
@pytest.mark.timeout(240)
@pytest.mark.parametrize("config", [pytest.param(path, id=path.stem, marks=[] if path.name == "150m.yaml" else
                                                 pytest.mark.slow) for path in CONFIGS])
def test_the_join_command_a_run_prints_joins_it_as_printed(tmp_path: Path, config: Path):
    """The first node starts the run with the config, shrunk, and a split of its own, and waits for a second peer;
    the command it prints runs as printed, with only what a test adds (loopback, its folder, one round): that node
    trains the run's first round with it, applied by both, to the same params."""
    children: list[Child] = []
    try:
        first = Child("first", cli("node", "start", "--config", str(config), *sets(SMALL + SPLIT), "--set",
                                   "swarm.min_peers=2", "--max-rounds", "1", "--host-maddrs", LOOPBACK, "--log-dir",
                                   str(tmp_path / "first")), tmp_path / "first.log", tmp_path / "first")
        children.append(first)
        program, *command = shlex.split(first.wait_for_line(PRINTED, 120).group(1))
        assert program == "p2ploco"
        joiner = Child("joiner", cli(*command, "--host-maddrs", LOOPBACK, "--log-dir", str(tmp_path / "joiner"),
                                     "--max-rounds", "1"), tmp_path / "joiner.log", tmp_path / "joiner")
        children.append(joiner)
        assert joiner.process.wait(180) == 0, joiner.log_path.read_text()[-1000:]
        assert first.process.wait(60) == 0
    finally:
        for child in children:
            child.stop()
    runs = [read_records(child.metrics_dir / "metrics.jsonl") for child in children]
    assert [[(r["round"], r["peers"], r["applied"]) for r in records] for records in runs] == [[(0, 2, True)]] * 2
    assert runs[0][0]["params_digest"] == runs[1][0]["params_digest"]
