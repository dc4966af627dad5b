"""The hub a bootstrap peer hosts (``p2ploco dht``, ``hosted_hub.py``): its addresses and argv, the CLI's refusals,
and, with real processes on loopback, a run whose hub refuses it leaving the bootstrap serving. Trainers that all
dial out training through the bootstrap's hub: ``test_reach_and_pace.py``."""

import re
import subprocess
from pathlib import Path

import pytest

from p2ploco.hosted_hub import PLAIN_NAME, HubSettings, hub_maddrs, next_port
from p2ploco.launch import TINY_CONFIG, LocalSwarm, cli


def test_the_hub_listens_on_the_port_after_the_bootstraps_on_the_same_interfaces_and_announces_it():
    assert next_port(["/ip4/0.0.0.0/tcp/31337"]) == 31338
    assert next_port(["/ip4/127.0.0.1/tcp/0"]) == 0 and next_port(["/ip4/0.0.0.0/udp/5/quic"]) == 0
    assert hub_maddrs(["/ip4/0.0.0.0/tcp/31337", "/ip6/::/tcp/31337"], 31338) == [
        "/ip4/0.0.0.0/tcp/31338", "/ip6/::/tcp/31338"]
    settings = HubSettings("my-run", "configs/150m.yaml", ("inner.lr=1e-4",), 31338, ("/ip4/0.0.0.0/tcp/31337",),
                           ("/ip4/203.0.113.1/tcp/31337",), "keys/boot.key", Path("runs/hub"), 50.0)
    argv = settings.argv("my-run", "/ip4/203.0.113.1/tcp/31337/p2p/QmBoot")
    assert argv[argv.index("node"):] == [
        "node", "start", "--role", "hub", "--run-id", "my-run", "--initial-peers",
        "/ip4/203.0.113.1/tcp/31337/p2p/QmBoot", "--config", "configs/150m.yaml", "--set", "inner.lr=1e-4",
        "--host-maddrs", "/ip4/0.0.0.0/tcp/31338",
        "--announce-maddrs", "/ip4/203.0.113.1/tcp/31338", "--identity", "keys/boot.hub.key",
        "--log-dir", "runs/hub/my-run", "--set", "swarm.bandwidth_mbit=50", "--set", "swarm.max_upload_mbit=50"]
    # any free port: it announces nothing of its own (it shows what it listens on); no config, cap or key: no such
    # flags (the config is fetched from the run's peers)
    loose = HubSettings(None, None, (), 0, ("/ip4/127.0.0.1/tcp/0",), ("/ip4/203.0.113.1/tcp/0",), None, Path("h"),
                        0.0)
    argv = loose.argv("r", "/ip4/127.0.0.1/tcp/5/p2p/QmBoot")
    assert not {"--announce-maddrs", "--identity", "--set", "--config", "--run-document"} & set(argv)
    # the third run's hub: two ports and keys on, given the document the bootstrap fetched
    third = HubSettings(None, None, (), 31338, ("/ip4/0.0.0.0/tcp/31337",), ("/ip4/203.0.113.1/tcp/31337",),
                        "keys/boot.key", Path("runs/hub"), 0.0)
    argv = third.argv("r3", "/ip4/203.0.113.1/tcp/31337/p2p/QmBoot", 2, Path("runs/hub/r3.run.json"))
    assert argv[argv.index("--run-document") + 1] == "runs/hub/r3.run.json"
    assert [argv[argv.index(flag) + 1] for flag in ("--host-maddrs", "--announce-maddrs", "--identity")] == [
        "/ip4/0.0.0.0/tcp/31340", "/ip4/203.0.113.1/tcp/31340", "keys/boot.hub3.key"]


@pytest.mark.parametrize("name, plain", [("tiny", True), ("my-run.2", True), ("..", False), ("-x", False),
                                         ("a/b", False), ("a b", False), ("x" * 65, False)])
def test_a_hub_serves_runs_with_plain_names_only(name, plain):
    assert bool(PLAIN_NAME.fullmatch(name)) is plain


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args, said", [
    (["--no-hub", "--run-id", "r", "--hub-max-mbit", "20"],
     "error: --run-id, --hub-max-mbit set the hub up; drop them, or drop --no-hub"),
    (["--set", "inner.lr=1e-4"], "error: --set goes with --config (a fetched config is the run's own)"),
    (["--config", str(TINY_CONFIG), "--set", "inner.lr=x"], "error: --set: inner.lr must be a number; got 'x'"),
    (["--config", str(TINY_CONFIG), "--run-id", "my run"],
     "error: run id 'my run': a hub serves runs with plain names only (letters, digits, '.', '_', '-'; at most 64); "
     "rename the run, or pass --no-hub"),
    (["--run-id", "../x"],
     "error: run id '../x': a hub serves runs with plain names only (letters, digits, '.', '_', '-'; at most 64); "
     "rename the run, or pass --no-hub")])
def test_hub_settings_are_checked_before_anything_starts_in_one_line(args, said):
    result = subprocess.run(cli("dht", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", *args), capture_output=True,
                            text=True, timeout=50)
    assert result.returncode == 2 and result.stderr.splitlines() == [said]


@pytest.mark.timeout(240)
def test_a_run_the_hub_refuses_leaves_the_bootstrap_serving_its_trainers(tmp_path):
    """An overlapped run: a hub takes part in blocking rounds only, so it refuses to start; the bootstrap says
    why in one line, hosts no hub again, and the run's trainers train through it."""
    run = ["--set", "outer.sparseloco.overlap=true", "--set", "swarm.min_peers=2", "--max-rounds", "3",
           "--set", "swarm.heartbeat_interval=0.5"]
    with LocalSwarm(tmp_path, hub=True) as swarm:
        first = swarm.start_node("a", TINY_CONFIG, *run)  # waits for a second peer: it serves its config meanwhile
        bootstrap = swarm.children[0]
        said = bootstrap.wait_for_line(re.compile(r"hub: not started for run 'tiny': (.*)"), timeout=150)
        assert said.group(1).startswith("--role hub takes part in blocking rounds only; this run's outer is "
                                        "sparseloco with overlap"), said.group(0)
        assert said.group(0).endswith("this peer goes on without a hub for it")
        second = swarm.start_node("b", TINY_CONFIG, *run)
        assert first.process.wait(150) == 0 and second.process.wait(150) == 0
        runs = [swarm.summaries(name) for name in "ab"]
        assert bootstrap.process.poll() is None  # still serving
    assert [r["round"] for r in runs[0]] == [r["round"] for r in runs[1]] == [0, 1, 2]
    assert [a["params_digest"] for a in runs[0]] == [b["params_digest"] for b in runs[1]]
    assert not (tmp_path / "hub" / "tiny" / "metrics.jsonl").exists()  # the hub never took part in a round
