"""The join command a node prints, pasted as printed, joins its run: for every config in configs/, a run started with
a batch split of its own (issue 61: the joiner's defaults used to make another step, and it exited 2); and a node
with the run's config file fits the file's split to the run's step."""

import re
import shlex
from pathlib import Path

import pytest

from p2ploco.launch import LOOPBACK, REPO_ROOT, Child, LocalSwarm, cli
from p2ploco.metrics import read_summaries

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
    runs = [read_summaries(child.metrics_dir / "metrics.jsonl") for child in children]
    assert [[(r["round"], r["peers"], r["applied"]) for r in records] for records in runs] == [[(0, 2, True)]] * 2
    assert runs[0][0]["params_digest"] == runs[1][0]["params_digest"]


@pytest.mark.slow
@pytest.mark.swarm
@pytest.mark.timeout(300)
def test_a_node_with_the_config_file_fits_its_split_to_the_runs_step_and_one_that_cannot_stops(tmp_path: Path):
    """node/README's start: the run started from 150m.yaml (16 x 2); a node with the same file and `--set
    inner.batch_size=8` takes 8 x 4 and trains with it; one that sets both to another step stops naming only them,
    and the first node logs that once, and nothing of the one that joined."""
    config, common = REPO_ROOT / "configs" / "150m.yaml", [*sets(SMALL), "--run-id", "my-run"]
    with LocalSwarm(tmp_path) as swarm:
        first = swarm.start_node("first", config, *common, "--set", "swarm.min_peers=2", "--max-rounds", "1")
        first.wait_for_line(PRINTED, 120)
        refused = swarm.start_node("refused", config, *common, *sets(["inner.batch_size=8", "inner.grad_accum=1"]))
        assert refused.process.wait(120) == 2
        fitted = swarm.start_node("fitted", config, *common, "--set", "inner.batch_size=8", "--max-rounds", "1")
        assert fitted.process.wait(180) == 0
        assert first.process.wait(60) == 0
        runs = [swarm.summaries(name) for name in ("first", "fitted")]
    assert (tmp_path / "refused.log").read_text().strip().splitlines()[-1] == (
        "error: --set inner.batch_size=8 --set inner.grad_accum=1 make 8 sequences a step, where run 'my-run' trains "
        "32: set two whose product is 32, or drop them (the node then splits the run's step itself)")
    assert "the run's 32 sequences a step, split 8 x 4" in (tmp_path / "fitted.log").read_text()
    assert (tmp_path / "first.log").read_text().count("with another config of its own") == 1
    assert [[(r["round"], r["peers"], r["applied"]) for r in records] for records in runs] == [[(0, 2, True)]] * 2
    assert runs[0][0]["params_digest"] == runs[1][0]["params_digest"]
