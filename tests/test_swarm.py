"""Real node processes over hivemind on loopback: the demo, a stock bootstrap peer, clean errors, SIGTERM."""

import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from p2ploco.demo import how_it_ended
from p2ploco.launch import TINY_CONFIG, LocalSwarm, cli
from p2ploco.metrics import read_summaries

PEER_ID = "12D3KooWJ4cJv1Dk5qw6xcEgp53RK6D3ijRbFuB8UvPLECdd6ED9"
FIELDS = {"round", "peers", "loss", "eval_loss", "params_digest", "bytes_sent", "bytes_received", "dense_fp32_bytes",
          "tokens", "inner_seconds", "comm_seconds", "round_seconds"}


def p2ploco(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "p2ploco.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.timeout(300)
def test_a_node_that_died_of_a_signal_is_named_so():
    assert how_it_ended(-signal.SIGKILL) == ("was killed by SIGKILL (the kernel's out-of-memory killer sends it: "
                                             "see dmesg)")
    assert how_it_ended(-signal.SIGTERM) == "was killed by SIGTERM"
    assert how_it_ended(2) == "exited with code 2"


def test_demo_three_nodes_train_together_with_identical_params(tmp_path):
    result = p2ploco("demo", "--replicas", "3", "--rounds", "3", "--workdir", str(tmp_path), timeout=280)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "identical global parameters on all 3 nodes after every round: yes" in result.stdout
    assert re.search(r"round\s+2 \| peers 3 \|", result.stdout)
    # It ends with a sample from the final checkpoint: a heading that says how to draw more, then the text.
    assert re.search(rf"^logs, metrics and checkpoints: {re.escape(str(tmp_path))} \(\d+(\.\d)? [kM]B; it stays "
                     rf"until you delete it\)$", result.stdout, re.MULTILINE)
    lines = result.stdout.rstrip("\n").splitlines()
    heading = next(i for i, line in enumerate(lines) if line.startswith("sample from the final checkpoint"))
    assert f"p2ploco sample {tmp_path / 'node0' / 'checkpoint'}" in lines[heading]
    assert heading < len(lines) - 1 and all(line.startswith("  | ") for line in lines[heading + 1:])
    runs = [read_summaries(tmp_path / f"node{i}" / "metrics.jsonl") for i in range(3)]
    for records in runs:
        assert [r["round"] for r in records] == [0, 1, 2]
        assert all(FIELDS <= set(r) and r["peers"] == 3 for r in records)
        assert records[-1]["eval_loss"] < records[0]["eval_loss"]
        for r in records:  # SparseLoCo at 1/64: traffic far below a dense fp32 all-reduce
            assert 0 < 50 * (r["bytes_sent"] + r["bytes_received"]) <= r["dense_fp32_bytes"]
            assert 0 < r["bits_per_param"] <= 0.25 and abs(r["density"] - 1 / 64) < 0.01
            assert r["dht_bytes_sent"] > 0  # its record, stored at least as it moved to the round
        assert sum(r["dht_bytes_received"] for r in records) > 0
    for round_index in range(3):
        assert len({records[round_index]["params_digest"] for records in runs}) == 1
        # The aggregate every node applied weighed every member's contribution: the tokens the dashboard plots
        weighed = sum(records[round_index]["contributed_tokens"] for records in runs)
        assert {records[round_index]["aggregate_tokens"] for records in runs} == {weighed} and weighed > 0
    assert len({records[0]["peer_id"] for records in runs}) == 3


@pytest.mark.slow  # nodes train through a stock hivemind DHT in the default run (test_pipeline_swarm.py)
@pytest.mark.timeout(240)
def test_nodes_join_through_a_stock_hivemind_dht(tmp_path):
    with LocalSwarm(tmp_path, bootstrap="hivemind") as swarm:
        nodes = [swarm.start_node(name, TINY_CONFIG, "--max-rounds", "2", "--set", "swarm.min_peers=2")
                 for name in ("a", "b")]
        assert [node.process.wait(200) for node in nodes] == [0, 0]
        a, b = swarm.summaries("a"), swarm.summaries("b")
    assert [r["peers"] for r in a] == [2, 2]
    assert [r["params_digest"] for r in a] == [r["params_digest"] for r in b]


@pytest.mark.slow  # a clean leave on SIGTERM is in the default run (test_elastic.py: crash, leave, join and rejoin)
@pytest.mark.timeout(120)
def test_sigterm_stops_a_node_cleanly(tmp_path):
    with LocalSwarm(tmp_path) as swarm:
        node = swarm.start_node("solo", TINY_CONFIG, "--set", "inner.steps=2")
        node.wait_for_line(re.compile(r"round\s+1 \|"), timeout=90)
        node.signal(signal.SIGTERM)
        assert node.process.wait(30) == 0
        log = node.log_path.read_text()
    assert "SIGTERM: leaving: the round's inner steps stop here" in log
    assert "left the swarm after" in log and "summary" in log
    assert "checkpoint of round" in log
    assert "Traceback" not in log


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args, code, message", [
    (["--config", "no/such.yaml"], 2, "error: config file no/such.yaml does not exist"),
    (["--config", str(TINY_CONFIG), "--set", "inner.lr=fast"], 2, "error: --set: inner.lr must be a number"),
    (["--config", str(TINY_CONFIG), "--set", "model.n_head=3"], 2, "must be divisible by model.n_head"),
    (["--config", str(TINY_CONFIG), "--initial-peers", "localhost:1234"], 2,
     "error: --initial-peers 'localhost:1234' is not a multiaddr; expected e.g. /ip4/203.0.113.7/tcp/31337/p2p/Qm..."),
    (["--config", str(TINY_CONFIG), "--host-maddrs", "0.0.0.0:31600"], 2,  # a listening address has no /p2p/ part
     "error: --host-maddrs '0.0.0.0:31600' is not a multiaddr; expected e.g. /ip4/0.0.0.0/tcp/31350"),
    (["--config", str(TINY_CONFIG), "--nproc-per-node", "2"], 2, "training.ranks (2) is more than training.max_ranks"),
    (["--config", str(TINY_CONFIG), "--role", "hub", "--nproc-per-node", "2", "--set", "training.max_ranks=2"], 2,
     "error: --role hub runs on one rank; --nproc-per-node 2 (training.ranks) goes with full replicas"),
    (["--config", str(TINY_CONFIG), "--initial-peers", "/ip4/127.0.0.1/tcp/1"], 2, "lacks the peer id part"),
    (["--config", str(TINY_CONFIG), "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
      "--initial-peers", f"/ip4/127.0.0.1/tcp/9/p2p/{PEER_ID}"],
     1, "could not reach any bootstrap peer"),
])
def test_bad_input_gives_one_clear_line_and_nonzero_exit(args, code, message):
    started = time.monotonic()
    result = p2ploco("node", "start", *args, timeout=90)
    assert result.returncode == code
    assert message in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert len(result.stderr.strip().splitlines()) == 1
    assert time.monotonic() - started < 60


@pytest.mark.timeout(60)
def test_bootstrap_peer_rejects_a_bad_listen_address():
    result = p2ploco("dht", "--host-maddrs", f"/ip4/127.0.0.1/tcp/0/p2p/{PEER_ID}")
    assert result.returncode == 2
    assert "must not include /p2p/" in result.stderr and "Traceback" not in result.stderr


CLAIM = """
import sys, time
from p2ploco.errors import SwarmError
from p2ploco.swarm.identity import claim_identity
print("ready", flush=True)
sys.stdin.readline()  # both processes claim at the same moment
try:
    claim_identity(sys.argv[1])
    print("claimed", flush=True)
    sys.stdin.readline()  # hold the identity until told to exit
except SwarmError as e:
    print(f"refused: {e}", flush=True)
"""


@pytest.mark.timeout(60)
def test_a_new_identity_file_is_created_once_and_held_by_one_live_node(tmp_path):
    """Two nodes started at the same moment with a not-yet-existing --identity: one key file is written, one node
    holds it, the other is refused with one line (they used to run under the same peer id)."""
    identity = tmp_path / "node.key"
    racers = [subprocess.Popen([sys.executable, "-c", CLAIM, str(identity)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        assert [p.stdout.readline().strip() for p in racers] == ["ready", "ready"]
        for p in racers:
            p.stdin.write("go\n")
            p.stdin.flush()
        outcomes = sorted(p.stdout.readline().strip() for p in racers)
        assert outcomes[0] == "claimed" and outcomes[1].startswith("refused: identity")
        assert "already used by a live peer on this machine" in outcomes[1]
        assert [path.name for path in tmp_path.iterdir()] == ["node.key"]  # no temporary file left behind
        key = identity.read_bytes()
    finally:
        for p in racers:
            p.communicate("exit\n", timeout=30)
    again = subprocess.run([sys.executable, "-c", CLAIM, str(identity)], input="go\nexit\n", capture_output=True,
                           text=True, timeout=30)
    assert "claimed" in again.stdout and identity.read_bytes() == key  # released on exit, the same key kept


@pytest.mark.timeout(240)
def test_a_port_another_peer_listens_on_is_one_error_line_before_anything_starts(tmp_path):
    """p2pd listens with SO_REUSEPORT: a second daemon on a port another holds used to share it; the node said
    "joined" with a join command naming that port, both logged "dial to self attempted", and rounds aborted. Now a
    node, a bootstrap and so a hub on a taken port exit 2 with one line, before anything joins."""
    with LocalSwarm(tmp_path) as swarm:
        taken = "/ip4/127.0.0.1/tcp/" + re.search(r"/tcp/(\d+)/", swarm.bootstrap_address).group(1)
        said = (f"error: --host-maddrs {taken}: the port is in use by another process; pick another port in "
                f"--host-maddrs (/tcp/0: any free one)")
        starts = {"bootstrap": cli("dht", "--host-maddrs", taken, "--no-hub"),
                  "node": cli("node", "start", "--config", str(TINY_CONFIG), "--initial-peers", swarm.bootstrap_address,
                              "--host-maddrs", taken, "--log-dir", str(tmp_path / "node"))}
        for kind, argv in starts.items():
            result = subprocess.run(argv, capture_output=True, text=True, timeout=100)
            assert (result.returncode, result.stderr.splitlines()) == (2, [said]), (kind, result.stdout, result.stderr)
        # a bootstrap whose own port is free, but not its hub's
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            free = probe.getsockname()[1]
        hub_port = taken.rpartition("/")[2]
        result = subprocess.run(cli("dht", "--host-maddrs", f"/ip4/127.0.0.1/tcp/{free}", "--hub-port", hub_port),
                                capture_output=True, text=True, timeout=100)
        assert (result.returncode, result.stderr.splitlines()) == (2, [
            f"error: the hub's port {hub_port} ({taken}; the bootstrap's port + 1 unless --hub-port says) is in use by "
            f"another process; pick another with --hub-port (0: any free one), or pass --no-hub"]), result.stderr


@pytest.mark.timeout(120)
def test_a_signal_before_the_node_can_leave_cleanly_ends_the_start_up_in_one_line(tmp_path):
    """Ctrl-C while the node reads its config (it used to print "Aborted!", rc 1): one error line, rc 130."""
    with LocalSwarm(tmp_path) as swarm:
        node = swarm.start_node("early", TINY_CONFIG, env={"P2PLOCO_FAULTS": "start.load=stall:60"})
        node.wait_for_line(re.compile("fault: stalling at start.load"), timeout=60)
        node.signal(signal.SIGINT)
        assert node.process.wait(30) == 130
    said = (tmp_path / "early.log").read_text().splitlines()
    assert said == ["fault: stalling at start.load",
                    "error: stopped during start-up, before the node trained anything: no checkpoint was written; "
                    "start it again in the same way"]
    assert not (tmp_path / "early").exists()


@pytest.mark.timeout(180)
def test_a_node_stopped_before_its_first_round_writes_no_checkpoint_and_starts_again_without_resume(tmp_path):
    """Ctrl-C once the node has joined, before it trained (it used to write "checkpoint of round 0", so that the next
    start in its folder needed --resume): one line, rc 0, no checkpoint; the same command then trains."""
    with LocalSwarm(tmp_path) as swarm:
        node = swarm.start_node("joiner", TINY_CONFIG, "--max-rounds", "1",
                                env={"P2PLOCO_FAULTS": "start.join=stall:5"})
        node.wait_for_line(re.compile("fault: stalling at start.join"), timeout=90)
        node.signal(signal.SIGINT)
        assert node.process.wait(60) == 0
        after_stall = (tmp_path / "joiner.log").read_text().split("fault: stalling at start.join\n")[1]
        assert after_stall.splitlines() == [
            "SIGINT: leaving before its first round ended: nothing is trained, so no checkpoint is written (start "
            "again in the same way; signal again to stop at once)"]
        assert not (tmp_path / "joiner" / "checkpoint").exists()
        again = swarm.start_node("joiner", TINY_CONFIG, "--max-rounds", "1")
        assert again.process.wait(120) == 0
    assert [r["round"] for r in swarm.summaries("joiner")] == [0]
