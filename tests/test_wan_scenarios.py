"""benchmarks/wan.py's scenarios: hosts behind NATs of their own (--nat), hubs for them (--hubs) and slow hosts
(--slow), with real nodes in network namespaces, and the per-host summary (reachability, tokens trained, tokens in
applied aggregates, the rounds a host's work was applied in). The scenario runs are slow (pytest -m slow); they skip,
saying why, where namespaces or NAT cannot be made (not root, no iproute2, no iptables or nft). They check outcomes,
never timings."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

WAN = [sys.executable, "benchmarks/wan.py"]
PREFIX = "p2pwan-"
SHORT = ["--set", "inner.steps=2"]  # rounds of a few seconds: the scenarios test outcomes, not speed
# Every host trains its H steps: where the shared cores starve one, its pace budget would have it sit a round out
# (budget.py), which the reachability scenarios do not test (the slow-host ones do)
EVEN = [*SHORT, "--set", "inner.fixed_steps=true"]


def load_wan(monkeypatch):
    spec = importlib.util.spec_from_file_location("wan", "benchmarks/wan.py")
    wan = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "wan", wan)  # its dataclasses look their module up there
    spec.loader.exec_module(wan)
    return wan


def why_no_nat() -> str | None:
    """Why NATed hosts cannot be emulated here, or None if they can."""
    if sys.platform != "linux" or os.geteuid() != 0:
        return "needs root on Linux for network namespaces"
    missing = [tool for tool in ("ip", "tc") if not shutil.which(tool)]
    if missing:
        return f"needs {' and '.join(missing)} (iproute2)"
    if not (shutil.which("iptables") or shutil.which("nft")):
        return "needs iptables or nft for the NAT routers"
    probe = f"{PREFIX}{os.getpid()}-scenarioprobe"
    try:
        if subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode != 0:
            return "cannot make a network namespace here"
        tool = "iptables" if shutil.which("iptables") else "nft"
        rule = (["iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "lo", "-j", "MASQUERADE"] if tool == "iptables"
                else ["nft", "add", "table", "ip", "p2pwanprobe"])
        if subprocess.run(["ip", "netns", "exec", probe, *rule], capture_output=True).returncode != 0:
            return f"{tool} cannot set NAT rules in a namespace here"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def needs_nat():
    reason = why_no_nat()
    if reason:
        pytest.skip(reason)


def namespaces_of(pid: int) -> list[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    return [name for name in listing if name.startswith(f"{PREFIX}{pid}-")]


def run_wan(tmp_path: Path, *args: str, timeout: float) -> tuple[dict, str]:
    """One wan.py setting with --json: its row, and everything it printed."""
    run = subprocess.Popen([*WAN, "--json", "--workdir", str(tmp_path), *args], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        out, err = run.communicate(timeout=timeout)
    finally:
        if run.poll() is None:
            run.terminate()  # wan.py removes what it made on SIGTERM
            run.communicate(timeout=60)
    logs = "\n".join(f"---- {p}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-30:])
                     for p in sorted(tmp_path.rglob("h*.log")))
    assert run.returncode == 0, out + err + logs
    assert namespaces_of(run.pid) == []  # it removed what it made
    [row] = json.loads(out.splitlines()[-1])
    return row, out + err + logs


def assert_every_round_applied_by_all(row: dict, hosts: int, rounds: int, output: str) -> None:
    assert row["hashes_equal"] is True, output  # every round: applied by every node, one hash
    assert len(row["per_host"]) == hosts
    for host in row["per_host"]:
        assert host["rounds"] == rounds and host["rounds_applied"] == rounds, output
        assert host["tokens"] > 0


def assert_no_trained_work_lost(row: dict, slow_host: int, rounds: int, output: str) -> None:
    """The fast hosts apply every round; the slow host applies each round or sits it out (its step outlasts the
    round: how often depends on the machine's load), and every step it trained lands in an applied aggregate (it
    trains nothing in a last round it sits out: no next round would carry the work)."""
    assert row["appliers_agree"] is True, output  # every round: those that applied it hold one hash
    for i, host in enumerate(row["per_host"]):
        assert host["rounds"] == rounds and host["tokens"] > 0, output
        if i != slow_host:
            assert host["rounds_applied"] == rounds and host["sat_out_rounds"] == [], output
    slow = row["per_host"][slow_host]
    assert slow["rounds_applied"] + len(slow["sat_out_rounds"]) == rounds, output
    assert slow["trained_work_applied"] == slow["rounds_trained"] > 0, output


# ------------------------------------------------------------------------------------- scenarios (real nodes)

@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("reachability", [[], ["--reachability", "public", "client", "client"]],
                         ids=["detected", "told"])
def test_one_public_and_two_natted_hosts_apply_every_round_with_equal_params(tmp_path, reachability):
    needs_nat()
    row, output = run_wan(tmp_path, "--hosts", "3", "--nat", "2", "--rounds", "4", *reachability, *EVEN,
                          timeout=850)
    assert row["nat"] == 2
    assert_every_round_applied_by_all(row, 3, 4, output)
    assert [h["natted"] for h in row["per_host"]] == [False, True, True]
    for host in row["per_host"][1:]:  # a host behind a NAT cannot be dialled: it must not claim to be public
        assert host["reachability"] in ("relayed", "client"), output
    # The public host's work is in every aggregate once the first (start-up) round is done.
    public = row["per_host"][0]
    assert public["work_applied_rounds"] and public["contributed_tokens"] > 0, output


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_three_natted_trainers_and_the_bootstrap_only_apply_every_round_with_equal_params(tmp_path):
    """Every trainer behind a NAT of its own, the bootstrap's machine the only public one: its `p2ploco dht`, started
    with addresses only, hosts a hub by default, with nothing asked of wan.py but --nat. No trainer can be dialled to
    hand the hub the run's config: the bootstrap fetches it over the connection a trainer opened to it."""
    needs_nat()
    row, output = run_wan(tmp_path, "--hosts", "3", "--nat", "3", "--rounds", "4", *EVEN, timeout=850)
    assert_every_round_applied_by_all(row, 3, 4, output)  # the hub applied them too, with the same hash
    assert all(h["natted"] and h["reachability"] in ("relayed", "client") for h in row["per_host"]), output
    assert all(h["work_applied_rounds"] == [0, 1, 2, 3] for h in row["per_host"]), output
    [hub] = row["per_hub"]
    assert hub["hub"] == "bootstrap" and hub["rounds_applied"] == 4 and hub["median_bytes_per_round"] > 0, output


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_natted_trainers_lose_at_most_two_rounds_when_the_bootstraps_hub_is_killed_and_started_again(tmp_path):
    needs_nat()
    row, output = run_wan(tmp_path, "--hosts", "3", "--nat", "3", "--kill-bootstrap-hub", "3", "--rounds", "8",
                          *EVEN, timeout=850)
    assert row["appliers_agree"] is True, output
    for host in row["per_host"]:
        assert host["rounds"] == 8 and host["rounds_applied"] >= 6, output
    assert "hub: exited with code -9" in (tmp_path / "sparseloco-100" / "bootstrap.log").read_text(), output


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_six_natted_trainers_lose_at_most_one_round_when_one_of_two_hubs_dies(tmp_path):
    needs_nat()
    row, output = run_wan(tmp_path, "--hosts", "6", "--nat", "6", "--hubs", "1", "--kill-hub", "3", "--rounds", "6",
                          *EVEN, timeout=850)
    assert row["appliers_agree"] is True, output  # every round: those that applied it hold one hash
    for host in row["per_host"]:
        assert host["rounds"] == 6 and host["rounds_applied"] >= 5, output
    survivor, killed = row["per_hub"]
    assert survivor["hub"] == "bootstrap" and killed["hub"] == "hub0", output
    assert survivor["rounds_applied"] >= 5 and killed["rounds"] <= 3, output


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_slow_host_loses_no_trained_work_and_the_others_apply_every_round(tmp_path):
    needs_nat()
    # H = 4 and a 3x slower host: one step of it fits in a round on an idle machine; under load it can outlast one
    row, output = run_wan(tmp_path, "--hosts", "3", "--slow", "1", "3", "--rounds", "4", *SHORT, "--set",
                          "inner.steps=4", timeout=850)
    assert row["slow"] == [1.0, 3.0, 1.0]
    assert_no_trained_work_lost(row, 1, 4, output)
    for host in row["per_host"]:
        assert 0 <= host["contributed_tokens"] <= host["tokens"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_slow_host_behind_a_nat_loses_no_trained_work_and_the_others_apply_every_round(tmp_path):
    needs_nat()
    row, output = run_wan(tmp_path, "--hosts", "3", "--nat", "1", "--slow", "1", "1", "3", "--rounds", "4", *SHORT,
                          "--set", "inner.steps=4", timeout=850)
    assert_no_trained_work_lost(row, 2, 4, output)
    assert row["per_host"][2]["natted"] and row["per_host"][2]["slow"] == 3.0


# ------------------------------------------------------------------------- the topology and the options (fast)

@pytest.mark.timeout(120)
@pytest.mark.parametrize("inbound", ["reject", "drop"])
def test_natted_hosts_reach_public_ones_but_cannot_be_dialled(monkeypatch, tmp_path, inbound):
    """Plain sockets on wan.py's Network: a NATed host connects out (seen as its router's address); a public host
    and another NATed host cannot connect in, neither at the router's address nor at the host's LAN address."""
    needs_nat()
    wan = load_wan(monkeypatch)
    server = ("import socket\n"
              "s = socket.socket(); s.bind(('0.0.0.0', 5001)); s.listen(); s.settimeout(10)\n"
              "print('listening', flush=True)\n"
              "c, peer = s.accept(); print(peer[0], flush=True)\n")
    client = ("import socket, sys\n"
              "try:\n"
              "    socket.create_connection((sys.argv[1], 5001), timeout=3); print('connected')\n"
              "except OSError as e:\n"
              "    print('failed', e)\n")

    def connect(network, server_ns: str, client_ns: str, address: str) -> tuple[bool, str]:
        """Whether a connection from ``client_ns`` to ``address`` gets through, and where the server sees it from."""
        listening = subprocess.Popen(network.run_in(server_ns, [sys.executable, "-c", server]),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            assert listening.stdout.readline().strip() == "listening"
            result = subprocess.run(network.run_in(client_ns, [sys.executable, "-c", client, address]),
                                    capture_output=True, text=True, timeout=30)
            connected = result.stdout.startswith("connected")
            return connected, listening.stdout.readline().strip() if connected else ""
        finally:
            listening.kill()
            listening.wait()

    with wan.Network([100, 100, 100], f"{os.getpid()}-scen", nat=2, nat_inbound=inbound) as network:
        public, first, second = network.hosts
        assert not public.natted and first.natted and second.natted
        assert first.address.startswith(wan.LAN_SUBNET) and first.public_address.startswith(wan.SUBNET)
        assert connect(network, public.namespace, first.namespace, public.address) == (True, first.public_address)
        assert connect(network, network.bridge, second.namespace, network.bridge_address) == (
            True, second.public_address)  # the bootstrap peer's namespace
        for client_ns in (public.namespace, second.namespace):
            for address in (first.public_address, first.address):
                assert connect(network, first.namespace, client_ns, address) == (False, "")
        made = network.made[:]
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    assert not set(made) & set(listing)  # routers included


@pytest.mark.timeout(120)
def test_nat_without_iptables_or_nft_says_so_in_one_line_and_exits_0(tmp_path):
    """--nat where neither iptables nor nft can be found (ip and tc can): one line, no table, exit 0."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        pytest.skip("needs root and iproute2 to get past the namespace check")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("ip", "tc"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    result = subprocess.run([*WAN, "--nat", "1"], capture_output=True, text=True, timeout=100,
                            env={**os.environ, "PATH": str(bin_dir)})
    assert result.returncode == 0, result.stderr
    [line] = result.stdout.splitlines()
    assert line == ("wan.py: cannot emulate a WAN here: NATed hosts need iptables or nft (apt-get install "
                    "iptables); nothing measured")


def test_slow_factors_and_reachability_reach_each_hosts_node_only(monkeypatch):
    wan = load_wan(monkeypatch)
    slow = wan.parse_slow([1, 3, 10], 4)
    assert slow == [1, 3, 10, 1]
    setting = wan.Setting("sparseloco", "100", [100.0] * 4, nat=2, slow=slow, reachability=["public", "auto"])
    assert [setting.node_env(i) for i in range(4)] == [
        {}, {"P2PLOCO_FAULTS": "inner.step=slow:3"}, {"P2PLOCO_FAULTS": "inner.step=slow:10"}, {}]
    assert [setting.node_args(i) for i in range(4)] == [
        ["--reachability", "public"], ["--reachability", "auto"], [], []]
    assert setting.label == "sparseloco at 100 Mbit/s (2 NATed; slow 1,3,10,1)"
    with pytest.raises(wan.ConfigError):
        wan.parse_slow([0.5], 3)
    with pytest.raises(wan.ConfigError):
        wan.parse_slow([1, 2, 3, 4], 3)
    hold = wan.parse_hold([0, 0, 0, 1.5], wan.parse_slow([], 4))
    held = wan.Setting("sparseloco", "100", [100.0] * 4, hold=hold)
    assert [held.node_env(i) for i in range(4)] == [{}, {}, {}, {"P2PLOCO_FAULTS": "inner.step=stall:1.5"}]
    assert held.label == "sparseloco at 100 Mbit/s (held 0,0,0,1.5 s before each step)"
    with pytest.raises(wan.ConfigError, match="either slowed inside its steps or held between them"):
        wan.parse_hold([0, 1], slow)


def test_per_host_summary_counts_tokens_of_applied_rounds_with_the_hosts_work(monkeypatch):
    wan = load_wan(monkeypatch)

    def record(round_index, applied, contributed, reachability="public", tokens=100, seconds=1.0):
        return {"round": round_index, "applied": applied, "contributed_tokens": contributed, "tokens": tokens,
                "reachability": reachability, "peers": 2, "bytes_sent": 1, "bytes_received": 1,
                "params_digest": "x", "round_seconds": seconds}

    public = [record(0, True, 100), record(1, True, 100), record(2, True, 100)]
    slow = [record(0, True, 0, "client", 50, 3.0), record(1, False, 50, "client", 50, 2.0),
            record(2, True, 50, "relayed", 50, 3.0)]
    setting = wan.Setting("sparseloco", "100", [100.0, 20.0], nat=1, slow=[1, 5])
    table, details = wan.host_summary(setting, [public, slow])
    assert details[0] == {
        "host": 0, "natted": False, "rate_mbit": 100.0, "slow": 1, "reachability": "public",
        "reachabilities": ["public"], "rounds": 3, "rounds_applied": 3, "sat_out_rounds": [], "tokens": 300,
        "contributed_tokens": 300,
        "work_applied_rounds": [0, 1, 2], "work_applied_fraction": 1.0, "token_fraction": 1.0,
        "median_round_seconds": 1.0, "rounds_trained": 3, "trained_work_applied": 3, "trained_after_the_others": 0}
    slow_host = details[1]
    assert slow_host["natted"] and slow_host["slow"] == 5
    assert slow_host["reachability"] == "relayed" and slow_host["reachabilities"] == ["client", "relayed"]
    assert slow_host["rounds_applied"] == 2 and slow_host["sat_out_rounds"] == []  # round 1 did not commit here
    assert slow_host["contributed_tokens"] == 50  # round 1's 50 were in an aggregate this node did not apply
    assert slow_host["work_applied_rounds"] == [2] and slow_host["work_applied_fraction"] == 0.333
    assert slow_host["token_fraction"] == 0.333
    # its median round is round 1's alone (rounds 1..R-2); round 1's work, not applied there, was carried into round 2
    assert table[1] == ("h1", "NAT", "20", "5", "client/relayed", "2/3", "150", "50", "0.33", "1/3", "2", "2.00", "3/3")
    assert wan.contributors([public[0], slow[0]], 2) == "1/2"
    sat_out = {**record(1, False, 0, "client", 50, 2.0), "sat_out": True}  # its step outlasted round 1
    assert wan.host_summary(setting, [public, [slow[0], sat_out, slow[2]]])[1][1]["sat_out_rounds"] == [1]
    assert wan.spans([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8" and wan.spans([]) == "none"


def test_records_without_the_new_fields_show_unknown_rather_than_zero(monkeypatch):
    wan = load_wan(monkeypatch)
    old = [{"round": 0, "applied": True, "tokens": 10, "peers": 2, "bytes_sent": 1, "bytes_received": 1,
            "params_digest": "x"}]
    table, [detail] = wan.host_summary(wan.Setting("diloco", "100", [100.0]), [old])
    assert detail["reachability"] is None and detail["contributed_tokens"] is None
    assert detail["work_applied_rounds"] is None and detail["token_fraction"] is None
    assert table[0][4] == "?" and table[0][7] == "?" and table[0][-1] == "?"
    assert wan.contributors(old, 1) == "?"


def test_relay_benchmark_writes_peer_ids_as_bare_multihashes(monkeypatch):
    """benchmarks/relay.py's circuit addresses reach p2pd as go-multiaddr reads them: hivemind's encoder writes
    /p2p/<id> as a CIDv1 (0x01 0x72 ...), which the daemon rejects."""
    from hivemind.utils.multiaddr import Multiaddr

    load_wan(monkeypatch)
    spec = importlib.util.spec_from_file_location("relay", "benchmarks/relay.py")
    relay = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "relay", relay)
    spec.loader.exec_module(relay)
    peer = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    text = f"/ip4/10.77.0.254/tcp/4001/p2p/{peer}/p2p-circuit"
    wire = relay.wire_multiaddr(text, Multiaddr).to_bytes()
    ours = Multiaddr("/ip4/10.77.0.254/tcp/4001").to_bytes()
    assert wire == ours + bytes([0xA5, 0x03, 34]) + relay.base58_decode(peer) + bytes([0xA2, 0x02])
    assert str(Multiaddr(wire)) == text  # hivemind reads it back the same
    assert Multiaddr(text).to_bytes() != wire  # hivemind's own encoding: the CIDv1 that p2pd rejects
    assert relay.varint(421) == bytes([0xA5, 0x03]) and relay.varint(5) == bytes([5])
