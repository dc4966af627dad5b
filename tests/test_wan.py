"""benchmarks/wan.py: real nodes on hosts in network namespaces behind capped links; its table and JSON, and
that it removes everything it made when its nodes fail or it is interrupted. Where namespaces cannot be made
(not root, no iproute2) it says so in one line and exits 0."""

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p2ploco.metrics import RoundSummary

WAN = [sys.executable, "benchmarks/wan.py"]
PREFIX = "p2pwan-"


def can_make_namespaces() -> bool:
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"):
        return False
    probe = f"{PREFIX}{os.getpid()}-testprobe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return made


needs_namespaces = pytest.mark.skipif(not can_make_namespaces(), reason="needs root and iproute2 for namespaces")


def namespaces_of(pid: int) -> list[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    return [name for name in listing if name.startswith(f"{PREFIX}{pid}-")]


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line holds ``text`` (the run's work dir: its nodes and bootstrap peer)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:  # it ended while we looked
                continue
    return found


@pytest.mark.timeout(60)
def test_without_namespaces_it_says_so_in_one_line_and_exits_0(tmp_path):
    result = subprocess.run(WAN, capture_output=True, text=True, timeout=50, env={**os.environ, "PATH": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    [line] = result.stdout.splitlines()  # one line, no table
    assert line.startswith("wan.py: cannot emulate a WAN here: ") and line.endswith("; nothing measured")
    if os.geteuid() == 0:
        assert "ip and tc not found (install iproute2)" in line


@needs_namespaces
@pytest.mark.timeout(180)
def test_when_its_nodes_fail_it_removes_processes_and_namespaces(tmp_path):
    run = subprocess.Popen([*WAN, "--hosts", "2", "--rounds", "1", "--workdir", str(tmp_path), "--set",
                            f"data.paths={tmp_path / 'no-such-corpus.txt'}"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    out, err = run.communicate(timeout=170)
    assert run.returncode == 1, out + err
    assert f"namespaces {PREFIX}{run.pid}-sparseloco-*" in out  # it did make them
    assert re.search(r"failed: node h\d exited with code \d+ after 0 of 1 rounds: .*no-such-corpus", out), out
    assert "setting(s) failed" in err
    assert "bootstrap peer" in (tmp_path / "sparseloco-100" / "bootstrap.log").read_text()  # it had started
    assert namespaces_of(run.pid) == []
    assert processes_mentioning(str(tmp_path)) == []


@needs_namespaces
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ctrl_c_mid_run_removes_everything(tmp_path):
    run = subprocess.Popen([*WAN, "--hosts", "2", "--rounds", "50", "--workdir", str(tmp_path)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in run.stdout:  # interrupted once the nodes train: a round is done
            if re.search(r"round 0: ", line):
                break
        assert namespaces_of(run.pid) and processes_mentioning(str(tmp_path))
        run.send_signal(signal.SIGINT)
        out, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 130 and "interrupted; everything it made is removed" in err
    assert namespaces_of(run.pid) == [] and processes_mentioning(str(tmp_path)) == []


@pytest.mark.slow  # hosts in namespaces are in the default run (test_when_its_nodes_fail_it_removes_processes_...)
@needs_namespaces
@pytest.mark.timeout(300)
def test_capped_hosts_train_with_equal_hashes_and_report_json(tmp_path):
    run = subprocess.Popen([*WAN, "--hosts", "2", "--rounds", "2", "--rate", "50", "20,100", "--json", "--workdir",
                            str(tmp_path), "--set", "inner.steps=2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    out, err = run.communicate(timeout=280)
    assert run.returncode == 0, out + err
    rows = json.loads(out.splitlines()[-1])
    assert [row["rate_mbit"] for row in rows] == [50.0, [20.0, 100.0]]
    for row in rows:
        assert {"algorithm", "rate_mbit", "params", "bytes_per_round", "comm_seconds", "round_seconds",
                "inner_seconds", "utilisation", "hashes_equal"} <= set(row)
        assert row["algorithm"] == "sparseloco" and row["hashes_equal"] is True
        assert row["params"] == 459_520 and row["bytes_per_round"] > 0
        assert 0 < row["inner_seconds"] < row["round_seconds"] and 0 < row["utilisation"] <= 1
    assert namespaces_of(run.pid) == [] and processes_mentioning(str(tmp_path)) == []


def test_a_round_agrees_when_every_node_applied_it_in_one_group_with_one_hash(monkeypatch):
    spec = importlib.util.spec_from_file_location("wan", "benchmarks/wan.py")
    wan = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "wan", wan)  # its dataclasses look their module up there
    spec.loader.exec_module(wan)
    row = {"applied": True, "peers": 3, "bytes_sent": 10, "bytes_received": 10, "params_digest": "a"}
    assert wan.hashes_agree([row] * 3, 3)
    assert not wan.hashes_agree([row, row, {**row, "params_digest": "b"}], 3)  # split
    assert not wan.hashes_agree([row, row, {**row, "peers": 2}], 3)  # left out, yet the same hash
    assert not wan.hashes_agree([row, row], 3)  # a node missing
    first = {**row, "applied": False, "peers": 1, "bytes_sent": 0, "bytes_received": 0}  # overlapped: round 0
    assert wan.hashes_agree([first] * 3, 3)  # lands nothing, on every node
    assert not wan.hashes_agree([first, first, {**first, "applied": True}], 3)
    assert not wan.hashes_agree([first, row, row], 3)
    # A node whose step outlasts the round sits it out (or has no record of it: a longer step): the others agree.
    two = {**row, "peers": 2}
    sat = {**first, "sat_out": True, "params_digest": "old"}
    assert wan.hashes_agree([two, two, sat], 3) and wan.hashes_agree([two, two], 3)
    assert not wan.hashes_agree([two, two, {**sat, "sat_out": False}], 3)  # not applied, and not sat out
    assert not wan.hashes_agree([two, two, {**row, "peers": 1, "params_digest": "b"}], 3)  # applied alone: a split
    # A node late for the round applied nothing: not every host took part, yet those that applied agree.
    late = {**first, "params_digest": "old"}
    assert not wan.hashes_agree([two, two, late], 3) and wan.appliers_agree([two, two, late])
    assert not wan.appliers_agree([two, {**two, "params_digest": "b"}, late])
    assert not wan.appliers_agree([two, {**row, "peers": 1}, late])  # one applied alone beside a group of two


def test_a_sat_out_steps_work_counts_as_applied_when_a_later_applied_round_carries_it(monkeypatch):
    spec = importlib.util.spec_from_file_location("wan", "benchmarks/wan.py")
    wan = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "wan", wan)
    spec.loader.exec_module(wan)

    def record(round_index, tokens, applied, contributed):
        return {"round": round_index, "tokens": tokens, "applied": applied, "contributed_tokens": contributed}

    # Round 0 trained and applied; round 1 sat out for a step (trained, nothing applied), whose work round 3 carries
    # without training; round 5 trained, late, and was carried nowhere; round 6 trained after the others' last round.
    got = [record(0, 64, True, 64), record(1, 64, False, 0), record(3, 0, True, 64), record(5, 64, False, 0),
           record(6, 64, True, 0)]
    assert wan.trained_work(got, last_round=5) == (4, 2, 1)
    assert wan.trained_work([*got, record(7, 0, True, 128)], last_round=7) == (4, 4, 0)


def test_compute_utilisation_is_inner_time_over_wall_time_since_the_previous_record():
    previous = RoundSummary(0, 2, 1.0, None, "x", 0, 0, 0, 1.0, 0.1, 0, 1.0, 1.0, 2.0, timestamp=time.time() - 4.0)
    assert RoundSummary.utilisation(1.0, [previous], time.perf_counter()) == pytest.approx(0.25, abs=0.01)
    assert RoundSummary.utilisation(1.0, [], time.perf_counter() - 2.0) == pytest.approx(0.5, abs=0.01)
