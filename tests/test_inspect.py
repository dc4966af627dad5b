"""Peer records are signed and schema-checked; `p2ploco peers` and `p2ploco status` against real swarms."""

import importlib.util
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from p2ploco.launch import TINY_CONFIG, LocalSwarm, cli
from p2ploco.metrics import RoundSummary, TensorBoardLog
from p2ploco.monitor import COLUMNS, peer_rows, peers_rich, peers_text, status_json, status_text
from p2ploco.swarm.dht import start_dht_node
from p2ploco.swarm.identity import Identity, peer_id_of
from p2ploco.swarm.loop import EventLoopThread
from p2ploco.swarm.records import PeerRecord, key_index, run_records
from p2ploco.swarm.schema import record_validator
from p2ploco.swarm.status_document import Survey

JOINED = re.compile(r"peer (\w+) joined run")
STATUS_AT = re.compile(r"status served at http://(\S+)/peers")
# The benchmarks' headless Chromium driver (the dashboard's benchmark uses it too).
_spec = importlib.util.spec_from_file_location("browser", Path(__file__).parents[1] / "benchmarks" / "browser.py")
browser_driver = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(browser_driver)
Browser, find_browser = browser_driver.Browser, browser_driver.find_browser
# node c's name in its record: markup that would run if a page wrote it as HTML
HOSTILE_NAME = "<img src=x onerror=injected=1><script>injected=2</script>"
NOBODY = "12D3KooWJFBvJXaPgQ1XAX5u5MCmZYfgVUgvyeTA2BwcCGJhu78u"  # a well-formed peer id nobody runs


def valid_value(**changes) -> dict:
    record = PeerRecord(peer_id="12D3KooWExample", round=3, state="training", fingerprint="f" * 16,
                        params_digest="a" * 64, name="swift-otter-mple", eval_history=[[1, 4.5], [2, 4.0]])
    return {**record.to_value(), **changes}


@pytest.mark.parametrize("changes", [
    {"round": -1}, {"round": 1.0}, {"round": True}, {"state": "dancing"}, {"role": "king"}, {"loss": math.nan},
    {"tokens_per_second": math.inf}, {"bytes_sent": -5}, {"name": "x" * 65}, {"addresses": ["a"] * 17},
    {"addresses": "not a list"}, {"eval_history": [[1, 2.0, 3.0]]}, {"peer_id": ""}, {"peer_id": None},
    {"ranks": 0}, {"ranks": 1025}, {"ranks": "2"},
])
def test_records_that_break_the_schema_are_refused(changes):
    assert PeerRecord.parse(valid_value()) is not None
    assert PeerRecord.parse(valid_value(**changes)) is None


def test_unknown_fields_are_ignored_and_missing_ones_refused():
    assert PeerRecord.parse(valid_value(future_field=1)).round == 3
    value = valid_value()
    del value["state"]
    assert PeerRecord.parse(value) is None


@pytest.mark.parametrize("width, hidden", [(80, {"address", "device", "peer"}), (250, set())])
def test_the_terminal_table_keeps_to_the_terminal_width(width, hidden):
    from rich.console import Console

    peers = [PeerRecord.parse(valid_value(peer_id=f"12D3KooWPeer{i}", addresses=[f"/ip4/10.0.0.{i}/tcp/31337/p2p/"
                                                                                  f"12D3KooWPeer{i}"]))
             for i in range(3)]
    console = Console(width=width, record=True, color_system=None)
    console.print(peers_rich(Survey("tiny", peers, {p.peer_id: 5.0 for p in peers}), width))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= width and "swift-otter-mple" in text
    header = next(line for line in text.splitlines() if "name" in line).split()
    assert not hidden & set(header) and ("address" in header) == (width == 250)


def test_the_table_names_each_stage_peers_group_and_stage():
    replica = PeerRecord.parse(valid_value(peer_id="12D3KooWReplica"))
    stage = PeerRecord.parse(valid_value(peer_id="12D3KooWStage", role="stage", group="g7", stage=1, state="standby"))
    rows = [dict(zip(COLUMNS, row)) for row in peer_rows(Survey("tiny", [replica, stage], {}))]
    assert [(r["role"], r["group"], r["stage"], r["state"]) for r in rows] == [
        ("replica", "-", "-", "training"), ("stage", "g7", "1", "standby")]


def test_peers_and_status_show_each_nodes_local_ranks_and_devices():
    two = PeerRecord.parse(valid_value(peer_id="12D3KooWTwo", ranks=2, device="cpu x2"))
    ones = [PeerRecord.parse(valid_value(peer_id=f"12D3KooWOne{i}", device="cpu")) for i in range(2)]
    survey = Survey("tiny", [two, *ones], {})
    rows = [dict(zip(COLUMNS, row)) for row in peer_rows(survey)]
    assert [(r["peer"][-3:], r["ranks"], r["device"]) for r in rows] == [
        ("Two", "2", "cpu x2"), ("ne0", "1", "cpu"), ("ne1", "1", "cpu")]
    assert (status_json(survey)["ranks"], status_json(survey)["devices"]) == (4, {"cpu x2": 1, "cpu": 2})
    devices_row = next(line for line in status_text(survey).splitlines() if line.split()[0] == "devices")
    assert devices_row.split(None, 1)[1] == "4 local rank(s) on 3 peer(s): 2 on cpu, 1 on cpu x2"


def test_status_shows_each_hub_and_how_much_of_its_link_its_last_round_took():
    replica = PeerRecord.parse(valid_value(peer_id="12D3KooWReplica"))
    hub = PeerRecord.parse(valid_value(peer_id="12D3KooWHub", role="hub", name="calm-heron", bandwidth_mbit=100.0,
                                       round_seconds=2.0, bytes_sent=5_000_000, bytes_received=1_000_000))
    unstated = PeerRecord.parse(valid_value(peer_id="12D3KooWHub2", role="hub", name="quiet-lark", round_seconds=2.0,
                                            bytes_sent=10, bytes_received=10))
    survey = Survey("tiny", [replica, hub, unstated], {})
    assert [p.peer_id for p in survey.trainers] == [replica.peer_id]
    loads = status_json(survey)["hubs"]
    assert [(h["name"], h["bytes_per_round"], h["link_use"]) for h in loads] == [
        ("calm-heron", 6_000_000, 0.2), ("quiet-lark", 20, None)]
    hubs_row = next(line for line in status_text(survey).splitlines() if line.split()[0] == "hubs")
    assert "calm-heron: 6.0 MB a round, 20% of its 100 Mbit/s" in hubs_row
    assert "quiet-lark: 20 B a round (its link's rate not stated)" in hubs_row
    assert peers_text(survey).splitlines()[0] == "run 'tiny': 1 training peer(s), 2 hub(s), 0 bootstrap"


def test_peers_say_how_each_trainer_takes_part_and_status_warns_where_nobody_can_coordinate():
    def peer(name: str, **changes) -> PeerRecord:
        return PeerRecord.parse(valid_value(peer_id=f"12D3KooW{name}", **changes))

    home = [peer(f"Home{i}", reachability="client") for i in range(2)]
    public, hub = peer("Public"), peer("Hub", role="hub")
    relayed = peer("Relayed", reachability="relayed")

    def parts(*peers: PeerRecord) -> list[str]:
        return [dict(zip(COLUMNS, row))["takes part"] for row in peer_rows(Survey("tiny", list(peers), {}))]

    assert parts(public, *home, hub) == ["direct", "through a hub", "through a hub", "hub"]
    assert parts(public, relayed, *home) == ["direct", "through public peers", "through public peers",
                                             "through public peers"]
    stranded = Survey("tiny", [relayed, *home], {})
    assert parts(*stranded.peers) == ["nobody to coordinate"] * 3
    assert status_json(stranded)["coordinators"] == 0
    warning = status_text(stranded).splitlines()[-1]
    assert warning.startswith("warning: 3 trainer(s), none of which can be dialled, and no hub: nobody can "
                                                "coordinate a round")
    for served in (Survey("tiny", [public, *home], {}), Survey("tiny", [hub, *home], {})):
        assert not any(line.startswith("warning") for line in status_text(served).splitlines())


def dht_record(subkey: bytes, value: dict) -> DHTRecord:
    """``value`` as a record under its peer's record key in run "tiny"."""
    return DHTRecord(DHTID.generate(source=run_records("tiny").of(value["peer_id"])).to_bytes(),
                     MSGPackSerializer.dumps(subkey),
                     MSGPackSerializer.dumps(value), get_dht_time() + 10)


def test_only_the_owner_can_sign_its_record_and_the_schema_is_checked():
    identity = Identity.fresh()
    identity.release()  # no daemon here: only its key is used
    validator, owner = record_validator(identity.key, "tiny")
    mine = peer_id_of(owner)

    def signed(record: DHTRecord) -> DHTRecord:
        return DHTRecord(record.key, record.subkey, validator.sign_value(record), record.expiration_time)

    good = signed(dht_record(owner, valid_value(peer_id=mine)))
    assert validator.validate(good)
    tampered = DHTRecord(good.key, good.subkey, good.value.replace(b"training", b"averaging"), good.expiration_time)
    assert not validator.validate(tampered)
    assert not validator.validate(dht_record(owner, valid_value(peer_id=mine)))  # unsigned
    someone_else = RSASignatureValidator(RSAPrivateKey()).local_public_key
    assert not validator.validate(signed(dht_record(someone_else, valid_value(peer_id=mine))))  # not ours to sign
    # A subkey whose embedded key does not parse is refused (hivemind's validator raised ValueError from its
    # DHT handlers on it; found by benchmarks/fuzz.py).
    garbled = owner.replace(owner[20:24], b"\x1d\xcc!!")
    forged = DHTRecord(good.key, MSGPackSerializer.dumps(garbled), good.value, good.expiration_time)
    assert not validator.validate(forged)
    assert not validator.validate(signed(dht_record(owner, valid_value(peer_id=mine, state="dancing"))))  # junk
    assert not validator.validate(signed(dht_record(b"plain-subkey", valid_value(peer_id=mine))))  # names no owner


def test_a_record_names_its_signer_holds_one_subkey_and_lapses_within_the_longest_ttl():
    """The signer's key is the one behind its peer id: it cannot publish a record for another peer (a forged
    "leaving" record hid its victim; a second record outvoted it), nor more than one record per key, nor one that
    outlives every honest peer's ttl by days (abandoned records used to pile up)."""
    identity = Identity.fresh()
    identity.release()
    validator, owner = record_validator(identity.key, "tiny")
    mine = peer_id_of(owner)

    def signed(subkey: bytes, value: dict, expires: float, index: int | None = None) -> DHTRecord:
        keys = run_records("tiny")
        key = keys.of(value["peer_id"]) if index is None else keys.keys[index]
        record = DHTRecord(DHTID.generate(source=key).to_bytes(), MSGPackSerializer.dumps(subkey),
                           MSGPackSerializer.dumps(value), expires)
        return DHTRecord(record.key, record.subkey, validator.sign_value(record), record.expiration_time)

    soon = get_dht_time() + 10
    assert validator.validate(signed(owner, valid_value(peer_id=mine), soon))
    # only under its own record key: a lookup of that key alone finds it (``PeerDirectory.look_up``)
    other_key = (key_index(mine, len(run_records("tiny").keys)) + 1) % len(run_records("tiny").keys)
    assert not validator.validate(signed(owner, valid_value(peer_id=mine), soon, index=other_key))
    assert not validator.validate(signed(owner, valid_value(peer_id=NOBODY, state="leaving"), soon))
    assert not validator.validate(signed(owner + b"#2", valid_value(peer_id=mine), soon))  # a second subkey
    assert not validator.validate(signed(owner, valid_value(peer_id=mine), get_dht_time() + 10 * 365 * 86400))


def test_an_identity_file_gives_the_peer_id_its_records_name(tmp_path):
    """The p2p daemon's peer id and the id computed from the record signing key agree, for a claimed identity file
    and a fresh one (whose key file is gone once the daemon runs)."""
    loop = EventLoopThread()
    try:
        for identity in (Identity.claim(str(tmp_path / "node.key")), Identity.fresh()):
            node, owner = loop.run(start_dht_node(host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity=identity), 60)
            try:
                assert str(node.peer_id) == peer_id_of(owner)
                assert os.path.exists(identity.path) != identity.ephemeral
            finally:
                loop.run(node.shutdown(), 30)
                identity.release()
    finally:
        loop.stop()


class Forger(RecordValidatorBase):
    """A hostile peer: signs records that name another peer's public key with its own key, and stores
    anything it is sent."""

    def __init__(self):
        self.key = RSAPrivateKey()

    def validate(self, record: DHTRecord) -> bool:
        return True

    def sign_value(self, record: DHTRecord) -> bytes:
        return record.value + b"[signature:" + self.key.sign(record.value) + b"]"


def run_cli(*args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run(cli(*args), capture_output=True, text=True, timeout=timeout)


def test_round_records_reach_tensorboard(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    board = TensorBoardLog(tmp_path)
    for round_index, loss in enumerate((4.0, 3.5)):
        board.write(RoundSummary(round=round_index, peers=3, loss=loss, eval_loss=loss + 0.1, params_digest="x",
                                bytes_sent=100, bytes_received=200, dense_fp32_bytes=30000, density=1 / 64,
                                bits_per_param=0.15, tokens=4096, inner_seconds=1.0, comm_seconds=0.5,
                                round_seconds=2.0))
    board.close()
    events = event_accumulator.EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("round/loss")] == [(0, 4.0), (1, 3.5)]
    assert [e.value for e in events.Scalars("round/tokens_per_second")] == [2048.0, 2048.0]


def test_clear_errors_without_a_swarm(tmp_path):
    nobody = run_cli("peers", "--initial-peers", f"/ip4/127.0.0.1/tcp/9/p2p/{NOBODY}")
    assert nobody.returncode == 1 and "could not reach any bootstrap peer" in nobody.stderr
    with LocalSwarm(tmp_path) as empty:  # a bootstrap peer, nobody training
        result = run_cli("status", "--initial-peers", empty.bootstrap_address)
    assert result.returncode == 1 and "error: no peers yet" in result.stderr
    for r in (nobody, result):
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


class Answers(BaseHTTPRequestHandler):
    """A server that is not a p2ploco node: ``/peers`` gives the body its class holds."""

    body = b""

    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/peers" else 404)
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


def served(**changes) -> bytes:
    """A status document (format 1) with one valid peer, and ``changes``."""
    return json.dumps({"format": 1, "run_id": "r", "truncated": 0, "peers": [{**valid_value(), "expires_in": 9.5}],
                       **changes}).encode()


@pytest.mark.parametrize("body, why", [
    (b"<html>hello</html>", "did not answer with a p2ploco status (Expecting value"),
    (served(peers=[{"peer_id": "x", "expires_in": 1}]), "(StatusDocument: peers.0.round: Field required)"),
    (served(peers=[{**valid_value(), "expires_in": 10**400}]), "(StatusDocument: peers.0.expires_in: "),
    (served(run_id="\x1b[2J"), "(StatusDocument: run_id: Value error, not a run's name)"),
    (b"[]", "(StatusDocument: the message: Input should be a valid dictionary"),
    (b"[" * 100000, "did not answer with a p2ploco status ("),  # nested past Python's recursion limit
])
def test_a_status_address_that_is_not_a_p2ploco_node_is_named_in_one_line(body, why):
    server = HTTPServer(("127.0.0.1", 0), type("Served", (Answers,), {"body": body}))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        result = run_cli("peers", "--from", f"127.0.0.1:{server.server_port}")
    finally:
        server.shutdown()
        server.server_close()
    assert result.returncode == 1 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert why in result.stderr


def test_where_to_look_is_checked_in_one_line():
    with socket.socket() as taken:  # bound, not listening: nothing answers there
        taken.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{taken.getsockname()[1]}"
        cases = {
            ("peers",): "say where the swarm is: --from HOST:PORT",
            ("peers", "--from", closed, "--initial-peers", f"/ip4/127.0.0.1/tcp/9/p2p/{NOBODY}"): "not both",
            ("status", "--from", "localhost"): "--from localhost: give the HOST:PORT of a node's --status-port",
            ("peers", "--from", "127.0.0.1:99999"): "--from 127.0.0.1:99999: give the HOST:PORT",
            ("peers", "--from", closed): f"cannot read http://{closed}/peers (",
        }
        cases[("node", "start", "--config", str(TINY_CONFIG), "--status-host", "0.0.0.0")] = \
            "--status-host goes with --status-port PORT"
        for args, why in cases.items():
            result = run_cli(*args)
            assert result.returncode in (1, 2) and len(result.stderr.strip().splitlines()) == 1, (args, result.stderr)
            assert result.stderr.startswith("error: ") and why in result.stderr, (args, result.stderr)


def test_a_status_port_that_is_taken_stops_the_node_in_one_line_before_it_joins(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli("node", "start", "--config", str(TINY_CONFIG), "--status-port", str(port), "--log-dir",
                         str(tmp_path / "a"))
    assert result.returncode == 2
    assert result.stderr.strip() == (f"error: --status-host 127.0.0.1 --status-port {port}: cannot listen there "
                                     f"(Address already in use); pick another port (0: any free one) or host")
    assert "joined run" not in result.stdout  # no peer has seen it


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """A bootstrap peer and three training nodes, and the peer id of each node."""
    folder = tmp_path_factory.mktemp("inspect")
    with LocalSwarm(folder) as local:
        nodes = {name: local.start_node(name, TINY_CONFIG, "--set", "swarm.min_peers=3", "--set", "inner.steps=5",
                                        "--set", "swarm.heartbeat_interval=0.5",
                                        *(["--status-port", "0"] if name == "a" else []),
                                        *(["--name", HOSTILE_NAME] if name == "c" else [])) for name in "abc"}
        status_address = nodes["a"].wait_for_line(STATUS_AT, 60).group(1)  # printed before it joins
        ids = {name: node.wait_for_line(JOINED, 60).group(1) for name, node in nodes.items()}
        for node in nodes.values():
            node.wait_for_line(re.compile(r"round\s+1 \|"), 120)
        yield local, ids, status_address


def listing(swarm_address: str, *extra: str) -> dict:
    result = run_cli("peers", "--initial-peers", swarm_address, "--json", *extra)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_peers_lists_exactly_the_running_nodes_with_their_rounds(swarm):
    local, ids, _ = swarm

    def last_finished() -> dict[str, int]:
        return {name: max(r["round"] for r in local.summaries(name)) for name in ids}

    before = last_finished()
    peers = listing(local.bootstrap_address)["peers"]
    after = last_finished()
    trainers = {p["peer_id"]: p for p in peers if p["role"] != "bootstrap"}
    assert set(trainers) == set(ids.values())
    for name, peer_id in ids.items():  # the round each was on while we looked
        assert before[name] <= trainers[peer_id]["round"] <= after[name] + 1
        assert trainers[peer_id]["state"] in ("training", "averaging")
        assert trainers[peer_id]["eval_history"] and trainers[peer_id]["compression"] > 1
    assert [p["role"] for p in peers].count("bootstrap") == 1


def test_a_forged_record_is_never_listed(swarm):
    local, ids, _ = swarm
    victim = RSASignatureValidator(RSAPrivateKey()).local_public_key
    loop = EventLoopThread()
    forger = None
    try:
        forger = loop.run(DHTNode.create(initial_peers=[local.bootstrap_address],
                                         host_maddrs=["/ip4/127.0.0.1/tcp/0"], record_validator=Forger()), 60)
        record_key = run_records("tiny").of("12D3KooWForged")
        loop.run(forger.store(record_key, subkey=victim, value=valid_value(peer_id="12D3KooWForged"),
                              expiration_time=get_dht_time() + 60), 60)  # the honest peers refuse it
        held = forger.protocol.storage.get(DHTID.generate(source=record_key))
        assert held is not None and victim in dict(held.value.items())  # the forger will hand it out
        peers = listing(local.bootstrap_address)["peers"]
        assert "12D3KooWForged" not in {p["peer_id"] for p in peers}
        assert set(ids.values()) <= {p["peer_id"] for p in peers}
    finally:
        if forger is not None:  # its p2p daemon is a child process: always stop it
            loop.run(forger.shutdown(), 30)
        loop.stop()


def test_status_sums_up_the_run(swarm):
    local, _, status_address = swarm
    result = run_cli("status", "--initial-peers", local.bootstrap_address, "--json")
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    assert status["run_id"] == "tiny" and status["peers"] == 3 and status["roles"] == {"replica": 3, "bootstrap": 1}
    assert status["round"] >= 1 and status["tokens_per_second"] > 0 and status["last_round"]["compression"] > 1
    losses = [loss for _, loss in status["eval_loss"]]
    assert len(losses) >= 2 and losses[-1] < losses[0]
    text = run_cli("status", "--from", status_address)  # the same summary, read fast (the DHT's: above)
    assert text.returncode == 0 and "eval loss" in text.stdout
    assert re.search(r", falling: -\d", text.stdout), text.stdout  # not "not falling", which also holds "falling"


def test_an_unknown_run_is_named_in_one_line(swarm):
    local, _, _ = swarm
    result = run_cli("peers", "--initial-peers", local.bootstrap_address, "--run-id", "nope")
    assert result.returncode == 1
    assert result.stderr.strip() == "error: no run 'nope' in this swarm; runs training now: tiny"


def test_a_nodes_status_port_lists_the_peers_the_dht_lists_without_hivemind_or_torch(swarm):
    local, ids, status_address = swarm
    through_dht = {p["peer_id"] for p in listing(local.bootstrap_address)["peers"]}
    from_node = run_cli("peers", "--from", status_address, "--json")
    assert from_node.returncode == 0, from_node.stderr
    served = json.loads(from_node.stdout)
    assert served["run_id"] == "tiny" and {p["peer_id"] for p in served["peers"]} == through_dht
    assert set(ids.values()) < through_dht  # and the bootstrap peer
    status = run_cli("status", "--from", status_address, "--json")
    assert status.returncode == 0 and json.loads(status.stdout)["peers"] == 3, status.stderr
    table = run_cli("peers", "--from", status_address)
    assert table.returncode == 0 and table.stdout.startswith("run 'tiny': 3 training peer(s), 1 bootstrap"), table
    other_run = run_cli("peers", "--from", status_address, "--run-id", "other")
    assert other_run.stderr.strip() == f"error: the node at {status_address} trains run 'tiny', not 'other'"
    # What makes the path fast: the command loads neither hivemind nor torch (seconds of imports).
    loaded = subprocess.run([sys.executable, "-c", (
        "import sys\nfrom p2ploco.cli import main\n"
        f"try:\n    main(['peers', '--from', {status_address!r}, '--json'])\nexcept SystemExit as e:\n"
        "    assert not e.code, e.code\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'hivemind', 'torch'}))")],
        capture_output=True, text=True, timeout=60)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.splitlines()[-1] == "[]", loaded.stdout


def test_the_dashboard_draws_the_run_live_in_a_browser_and_shows_what_peers_wrote_as_text(swarm, tmp_path):
    executable = find_browser()
    if executable is None:
        if os.environ.get("P2PLOCO_REQUIRE_BROWSER"):  # .ci/run installs one: there, a missing browser is a failure
            pytest.fail("no Chromium found, and P2PLOCO_REQUIRE_BROWSER is set")
        pytest.skip("no Chromium here (apt-get install chromium): the dashboard's browser test needs one")
    local, ids, status_address = swarm
    with Browser(executable) as browser:
        browser.open(f"http://{status_address}/")
        loaded = browser.wait_for("window.p2plocoDashboard && p2plocoDashboard.updates >= 1"
                                  " && p2plocoDashboard.rounds.map((r) => r.round)", 60)
        # Live: without a reload, the page draws 3 rounds more than it first held.
        drawn = browser.wait_for(f"p2plocoDashboard.charts.lossByRound.data[0].length >= {len(loaded) + 3}"
                                 " && p2plocoDashboard.charts.lossByRound.data", 60)
        peers = browser.evaluate("Array.from(document.querySelectorAll('#peers tbody tr')).map((row) => "
                                 "Object.fromEntries([['id', row.dataset.peer], ...Array.from(row.cells).map("
                                 "(cell) => [cell.dataset.key, cell.textContent])]))")
        injected = browser.evaluate("[typeof window.injected, document.querySelectorAll('#peers img, #peers script')"
                                    ".length]")
        # A click on a column's head sorts the table by it, and a second click the other way.
        names = []
        for _ in range(2):
            names.append(browser.evaluate("document.querySelector('#peers th[data-key=name]').click(), Array.from("
                                          "document.querySelectorAll('#peers td[data-key=name]')).map((c) => "
                                          "c.textContent)"))
        browser.screenshot(tmp_path / "dashboard.png")
        console = list(browser.console)
    # The loss chart has a point for each of those rounds: node a's loss, as its metrics hold it.
    by_round = {r["round"]: r["loss"] for r in local.summaries("a")}
    rounds, losses = drawn[0], drawn[1]
    assert len(rounds) >= len(loaded) + 3 and rounds == sorted(set(rounds))
    assert losses == [by_round[r] for r in rounds]
    # Every peer with its role; node c's name is shown as the text it is, and nothing it holds ran.
    shown = {row["id"]: row for row in peers}
    assert {peer_id: shown[peer_id]["role"] for peer_id in ids.values()} == dict.fromkeys(ids.values(), "replica")
    assert [row["role"] for row in peers].count("bootstrap") == 1 and len(peers) == 4
    assert shown[ids["c"]]["name"] == HOSTILE_NAME and shown[ids["a"]]["name"] != HOSTILE_NAME
    assert injected == ["undefined", 0]
    assert names[0] == sorted(names[0]) and names[1] == sorted(names[0], reverse=True) and len(names[0]) == 4
    # Each trainer's share of the serving node's last aggregate: what its tokens weighed there, all of it shared.
    shares = [float(shown[peer_id]["share"].removesuffix(" %")) for peer_id in ids.values()]
    assert abs(sum(shares) - 100) < 0.2 and all(share > 0 for share in shares), shares
    assert console == []  # no script error, no refused resource, nothing the page's policy blocked
    assert (tmp_path / "dashboard.png").read_bytes().startswith(b"\x89PNG")


def test_the_dashboard_of_a_remote_node_is_served_without_hivemind_or_torch(swarm):
    _, _, status_address = swarm
    # The command in a process that says, once stopped, which of hivemind and torch it loaded.
    relay = subprocess.Popen([sys.executable, "-c", (
        "import sys\nfrom p2ploco.cli import main\n"
        f"try:\n    main(['dashboard', '--from', {status_address!r}, '--port', '0'])\nexcept SystemExit as e:\n"
        "    assert not e.code, e.code\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'hivemind', 'torch'}), flush=True)")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = relay.stdout.readline()
        served_at = re.fullmatch(rf"dashboard of run 'tiny' \(the node at {re.escape(status_address)}\) at "
                                 r"http://(\S+)/; Ctrl-C stops it\n", line)
        assert served_at, (line, relay.stderr.read() if relay.poll() is not None else "")
        page = ask(served_at.group(1), b"GET / HTTP/1.1\r\n\r\n")
        assert page.startswith(b"HTTP/1.1 200 ") and b"<title>p2ploco dashboard</title>" in page
        run = ask(served_at.group(1), b"GET /api/v1/run HTTP/1.1\r\n\r\n").split(b"\r\n\r\n", 1)[1]
        from_node = ask(status_address, b"GET /api/v1/run HTTP/1.1\r\n\r\n").split(b"\r\n\r\n", 1)[1]
        assert json.loads(run) == json.loads(from_node) and json.loads(run)["run_id"] == "tiny"
        assert json.loads(run)["join_command"].startswith("p2ploco node start --run-id tiny --initial-peers /ip4/")
    finally:
        relay.send_signal(signal.SIGINT)
        out, err = relay.communicate(timeout=30)
    assert relay.returncode == 0, err
    assert out.splitlines()[-1] == "[]", out


def ask(address: str, request: bytes) -> bytes:
    """What the server at ``address`` answers to the raw bytes ``request`` (then end of input)."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(request)
        connection.shutdown(socket.SHUT_WR)
        answer = b""
        while piece := connection.recv(65536):
            answer += piece
    return answer


def test_the_status_port_refuses_broken_requests_and_keeps_serving_and_training(swarm):
    local, _, status_address = swarm
    host, port = status_address.rsplit(":", 1)
    silent = socket.create_connection((host, int(port)), timeout=30)  # sends nothing: must hold up nobody
    try:
        answers = {
            "garbage": ask(status_address, b"\x00\xff\xfe not http\r\n\r\n"),
            "unfinished": ask(status_address, b"GET /peers HTTP/1.1\r\nHost: localhost"),
            "a head too long": ask(status_address, b"GET /peers HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n"),
            "another path": ask(status_address, b"GET /../../etc/passwd HTTP/1.1\r\n\r\n"),
            "a write": ask(status_address, b"POST /peers HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}"),
            # a page of another site whose name was made to resolve to this node (DNS rebinding)
            "another site": ask(status_address, f"GET /peers HTTP/1.1\r\nHost: rebound.example:{port}\r\n\r\n"
                                                .encode()),
        }
        expected = {"garbage": 400, "unfinished": 400, "a head too long": 400, "another path": 404, "a write": 405,
                    "another site": 403}
        for what, code in expected.items():
            assert answers[what].startswith(f"HTTP/1.1 {code} ".encode()), (what, answers[what][:80])
        rounds_before = max(r["round"] for r in local.summaries("a"))
        good = ask(status_address, b"GET /peers HTTP/1.1\r\nHost: localhost\r\n\r\n")
    finally:
        silent.close()
    head, body = good.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200 ") and json.loads(body)["run_id"] == "tiny"
    local.nodes["a"].wait_for_line(re.compile(rf"round\s+{rounds_before + 1} \|"), 60)  # it trains on


@pytest.mark.slow  # a lapsing record is in the default run (test_a_record_names_its_signer_..._within_the_longest_ttl)
def test_a_stopped_node_disappears_when_its_record_lapses(swarm):
    local, ids, _ = swarm
    before = {p["peer_id"]: p for p in listing(local.bootstrap_address)["peers"]}
    gone = ids["c"]
    local.nodes["c"].process.send_signal(signal.SIGKILL)  # no farewell: only expiry can remove it
    local.nodes["c"].process.wait(30)
    lapses_by = time.monotonic() + before[gone]["expires_in"] + 10  # its last refresh may have come after the listing
    while gone in {p["peer_id"] for p in listing(local.bootstrap_address)["peers"]}:
        assert time.monotonic() < lapses_by, "the killed node's record outlived its expiry"
    assert {ids["a"], ids["b"]} <= {p["peer_id"] for p in listing(local.bootstrap_address)["peers"]}
