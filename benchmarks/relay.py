"""libp2p circuit relay through hivemind's p2pd, between two peers behind two different NATs.

On wan.py's emulated WAN (its Network: a namespace per host on a bridge), ``--public`` public hosts h0.. and two
hosts, A and B, each behind a masquerading router of its own (a home router without port forwarding: neither can
be dialled, not even by the other). The relay is the public bootstrap peer: a hivemind ``P2P`` in the bridge's
namespace at <subnet>.254 with p2pd's relay service on (its default). A, B and the public hosts start as
``P2P.create(initial_peers=[relay], use_relay=True, use_auto_relay=True)`` (the public ones without auto relay),
each listening on its own address. Every p2pd with the relay on also serves as a relay itself, so B may hold
reservations at h0.. too.

One network per subnet, link rate, reachability and relay setting (the cap is on every host's link, never on the
relay's): how long B takes to show a /p2p-circuit address among its own, whether A can open a stream to B at B's
circuit address through the bootstrap peer (``/ip4/<relay>/tcp/<port>/p2p/<relay id>/p2p-circuit/p2p/<B id>``;
A drops any connection to B it already has first, but libp2p dials every address it knows for B at once, so the
stream may go through another relay: its path says which), the throughput of 1, 16 and 128 MiB sent A -> B that way and
A -> h0 direct, and whether a transfer the size of a round's dense fp32 payload (the tiny config's, 459,520
parameters; the 21.4M-parameter setting of issue 12) gets through. A stream's path (relayed, through which
relay, or direct) is the remote address p2pd reports for it. Then whether A and B can dial each other directly
and what connection A holds to B at the end (a relayed one that hole punching, DCUtR, made direct would show).

The settings, and why they matter (go-libp2p 0.32 in the p2pd hivemind 1.1.12 ships):

- ``--subnet``: libp2p leaves private addresses aside. On 10.77.0.x AutoNAT never finds a peer private (nor the
  relay public), autorelay never advertises a circuit address through a relay with a private address, and hole
  punching waits for a public address forever. A public-looking /24 (default also 7.77.0; the namespaces reach
  nothing outside the machine) shows what happens on the Internet.
- ``--reachability``: A's and B's, left to AutoNAT (``auto``) or forced private (``-forceReachabilityPrivate``).
  Autorelay looks for relays only once the peer is private.
- ``--relays``: ``discovered`` is what hivemind does (``-autoRelay`` with relay discovery: candidates come from
  p2pd's DHT, and autorelay waits for 4 of them or 3 minutes before it reserves); ``static`` gives the relay as a
  static relay (``-trustedRelays=<relay> -relayDiscovery=0``, which ``P2P.create`` cannot express: the flag is
  added to its command line), reserved at once.
- The relay's limits: ``-relayDataLimit`` (4 GiB each way) and ``-relayTimeLimit`` (30 min) per relayed connection
  apply only once the relay's own AutoNAT found it public; p2pd then starts the relay service so configured,
  which replaces the one it started with, and the reservations made with that one are gone. Until then (on
  private addresses, always) the relay runs with go-libp2p's defaults: 128 KiB each way and 2 minutes per relayed
  connection. ``--relay-data-limit`` / ``--relay-time-limit`` lower the configured ones, to see them bite;
  ``--relay-reachability public`` forces the relay public.
- ``--public``: a peer's address as others observe it counts once 4 peers saw it, and DCUtR waits for one;
  ``--nat-inbound drop`` makes the routers drop a connection dialled at them instead of refusing it, as a
  "stealth" home router does, through which a TCP hole punch can pass.

It also says whether the shipped p2pd can hole-punch: its flags (``p2pd -h``) and the libp2p protocols linked into
the binary (UPX-packed, so they are read from a running daemon's memory).

Needs root (namespaces, tc, iptables or nft); without them it says so in one line and exits 0. Each network takes
up to ``--reserve-timeout`` (240 s) waiting for B's reservation, as long as autorelay may take.

    sudo python benchmarks/relay.py                           # 10.77.0 and 7.77.0, uncapped and 100 Mbit/s
    sudo python benchmarks/relay.py --subnet 7.77.0 --rate 100 --relays discovered static --json
    sudo python benchmarks/relay.py --subnet 10.77.0 --reachability private --relays static   # default limits
    sudo python benchmarks/relay.py --subnet 7.77.0 --public 4 --nat-inbound drop --relays static  # DCUtR
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

sys.path.insert(0, str(Path(__file__).resolve().parent))

import wan  # noqa: E402  (benchmarks/wan.py: its Network, checks and clean-up)

from p2ploco.metrics import format_table  # noqa: E402
from p2ploco.swarm.wire import DAEMON_ERRORS  # noqa: E402

MIB = 1 << 20
HANDLER = "p2ploco-relay-bench/sink"
TINY_PARAMS = 459_520  # configs/tiny.yaml
ISSUE12_PARAMS = 21_400_000  # the 21.4M dense model of issue 12 (d_model 768, 3 layers)
ROUND_SIZES = {"tiny round": 4 * TINY_PARAMS, "21.4M round": 4 * ISSUE12_PARAMS}  # dense fp32 bytes
DEFAULT_DATA_LIMIT = 1 << 32  # p2pd's -relayDataLimit default (bytes each direction, per relayed connection)
DEFAULT_TIME_LIMIT = 30 * 60  # p2pd's -relayTimeLimit default (seconds, per relayed connection)
DEFAULT_LIMIT_DATA = 1 << 17  # go-libp2p's relay default (relay.DefaultResources), used until the above apply


# ---------------------------------------------------------------------------------------------------- worker
# One per host, run by ``ip netns exec <namespace> python relay.py --worker ...``: a hivemind P2P that prints
# JSON lines (its events) and takes JSON lines on stdin (commands).

def emit(**event: object) -> None:
    print(json.dumps(event), flush=True)


async def worker(args: argparse.Namespace) -> None:
    from hivemind.p2p import P2P, PeerID
    from hivemind.utils.multiaddr import Multiaddr

    extra: dict[str, object] = {}  # p2pd flags that P2P.create does not offer
    if args.relay_data_limit:
        extra["relayDataLimit"] = args.relay_data_limit
    if args.relay_time_limit:
        extra["relayTimeLimit"] = f"{args.relay_time_limit}s"
    if args.static_relay:
        extra["relayDiscovery"] = False  # with -trustedRelays: autorelay's static relays, reserved at once
    if extra:
        make = P2P._make_process_args

        def with_extra(*argv: object, **kwargs: object) -> list[str]:
            return make(*argv, **kwargs, **extra)

        P2P._make_process_args = staticmethod(with_extra)

    started = time.monotonic()
    options: dict = {"host_maddrs": [args.listen]}
    if not args.initial_peer and args.force_reachability != "auto":  # the relay
        options["force_reachability"] = args.force_reachability
    if args.initial_peer:
        options.update(initial_peers=[args.initial_peer], use_relay=True, use_auto_relay=args.auto_relay)
        if args.force_reachability != "auto":
            options["force_reachability"] = args.force_reachability
        if args.static_relay:
            options["trusted_relays"] = [args.initial_peer]
    p2p = await P2P.create(**options)

    async def sink(info: object, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            size = int.from_bytes(await reader.readexactly(8), "big")
            left = size
            while left:
                left -= len(await reader.read(min(left, MIB)))
                if reader.at_eof() and left:
                    raise ConnectionError(f"stream ended {left} bytes short")
            writer.write(size.to_bytes(8, "big"))
            await writer.drain()
        except Exception as e:  # noqa: BLE001  (a reset transfer: the sender reports it)
            emit(event="sink_error", error=repr(e))
        finally:
            writer.close()

    if args.initial_peer:
        await p2p.add_binary_stream_handler(HANDLER, sink)
    maddrs = [str(m) for m in await p2p.get_visible_maddrs(latest=True)]
    emit(event="ready", id=p2p.peer_id.to_base58(), maddrs=maddrs, seconds=time.monotonic() - started)

    async def watch_addresses() -> None:
        shown = maddrs
        while True:
            await asyncio.sleep(0.5)
            try:
                now = [str(m) for m in await p2p.get_visible_maddrs(latest=True)]
            except DAEMON_ERRORS:  # the daemon is busy or going away: look again next time
                continue
            if sorted(now) != sorted(shown):
                emit(event="maddrs", maddrs=now, seconds=time.monotonic() - started)
                shown = now

    async def send(peer: str, addresses: Sequence[str], size: int, timeout: float, fresh: bool) -> dict:
        peer_id = PeerID.from_base58(peer)
        began = time.monotonic()
        try:
            if fresh:  # drop a connection to the peer through another way (another relay) first
                await asyncio.wait_for(p2p._client.control.disconnect(peer_id), 10)
            for attempt in range(4):  # a redial right after a disconnect, or of an address that failed a moment
                try:                   # ago (libp2p's dial backoff), fails at once: try again a little later
                    await asyncio.wait_for(
                        p2p._client.connect(peer_id, [wire_multiaddr(a, Multiaddr) for a in addresses]), 30)
                    break
                except DAEMON_ERRORS as e:
                    if attempt == 3 or not ("connection failed" in str(e) or "dial backoff" in str(e)):
                        raise
                    await asyncio.sleep(5)
            connected = time.monotonic() - began
            info, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(peer_id, HANDLER), 30)
            path = str(info.addr)
            began = time.monotonic()

            async def transfer() -> int:
                writer.write(size.to_bytes(8, "big"))
                chunk, left = bytes(MIB), size
                while left:
                    writer.write(chunk[:min(left, MIB)])
                    left -= min(left, MIB)
                    await writer.drain()
                return int.from_bytes(await reader.readexactly(8), "big")

            got = await asyncio.wait_for(transfer(), timeout)
            seconds = time.monotonic() - began
            writer.close()
            return dict(ok=got == size, seconds=seconds, connect_seconds=connected, path=path)
        except Exception as e:  # noqa: BLE001  (what failed is the measurement)
            return dict(ok=False, seconds=time.monotonic() - began, error=f"{type(e).__name__}: {e}"[:1200])

    async def connections() -> list[dict]:
        return [{"id": info.peer_id.to_base58(), "addrs": [str(a) for a in info.addrs]}
                for info in await p2p.list_peers()]

    watcher = asyncio.create_task(watch_addresses())
    loop = asyncio.get_running_loop()
    try:
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            command = json.loads(line)
            if command["op"] == "send":
                emit(event="sent", **await send(command["peer"], command["maddrs"], command["bytes"],
                                                 command["timeout"], command.get("fresh", False)))
            elif command["op"] == "peers":
                emit(event="peers", peers=await connections())
    finally:
        watcher.cancel()
        await p2p.shutdown()


def wire_multiaddr(text: str, multiaddr: type) -> object:
    """``text`` as a hivemind Multiaddr whose /p2p/ parts are bare multihashes on the wire. hivemind's own
    encoder writes a peer id as a CIDv1 (0x01 0x72 ...), which the p2pd it ships rejects ("length greater than
    remaining number of bytes in buffer"): a circuit address /.../p2p/<relay>/p2p-circuit cannot be given to
    its ``connect`` as hivemind encodes it."""
    out = b""
    for part in re.split(r"(/p2p/[^/]+)", text):
        if part.startswith("/p2p/"):
            digest = base58_decode(part[len("/p2p/"):])
            out += varint(421) + varint(len(digest)) + digest
        elif part:
            out += multiaddr(part).to_bytes()
    return multiaddr(out)


def base58_decode(text: str) -> bytes:
    import base58  # hivemind's dependency

    return base58.b58decode(text)


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


# ------------------------------------------------------------------------------------------------ orchestrator

class Worker:
    """A worker process in a namespace, in a session of its own (stopping it stops its p2pd too)."""

    def __init__(self, name: str, argv: Sequence[str], log_path: Path):
        self.name, self.log_path = name, log_path
        self._log: IO[str] = log_path.open("a")
        self.process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                        text=True, start_new_session=True)
        self.events: queue.Queue[dict] = queue.Queue()
        self.maddrs: list[str] = []
        self.circuit_seconds: float | None = None  # when its first /p2p-circuit address showed
        self._reader = threading.Thread(target=self._collect, daemon=True)
        self._reader.start()

    def _collect(self) -> None:
        for line in self.process.stdout:  # type: ignore[union-attr]
            self._log.write(line)
            self._log.flush()
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if "maddrs" in event:
                self.maddrs = event["maddrs"]
                if self.circuit_seconds is None and any("/p2p-circuit" in m for m in self.maddrs):
                    self.circuit_seconds = event["seconds"]
            self.events.put(event)

    def wait_for(self, kind: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                event = self.events.get(timeout=min(left, 1.0))
            except queue.Empty:
                if self.process.poll() is not None:
                    break
                continue
            if event.get("event") == kind:
                return event
        ended = f"it exited with code {self.process.returncode}" if self.process.poll() is not None else \
            f"not in {timeout:.0f} s"
        raise TimeoutError(f"worker {self.name} sent no {kind!r}: {ended} (see {self.log_path})")

    def command(self, **command: object) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def stop(self) -> None:
        with wan.signals_held():
            try:
                if self.process.stdin:
                    self.process.stdin.close()
                self.process.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                pass
            try:
                os.killpg(self.process.pid, signal.SIGKILL)  # its p2pd too
            except ProcessLookupError:
                pass
            self.process.wait()
            self._reader.join(5)
            self._log.close()


def start_worker(network: wan.Network, namespace: str, name: str, workdir: Path, listen: str,
                 *extra: str) -> Worker:
    argv = network.run_in(namespace, [sys.executable, str(Path(__file__).resolve()), "--worker", "--listen", listen,
                                      *extra])
    return Worker(name, argv, workdir / f"{name}.log")


def rate_label(rate: float) -> str:
    return "uncapped" if math.isinf(rate) else f"{rate:g} Mbit/s"


def transfer_timeout(size: int, rate: float) -> float:
    return 60 + (3 * size * 8 / (rate * 1e6) if not math.isinf(rate) else size / (20 * MIB))


def measure(subnet: str, rate: float, reachability: str, relays: str, sizes: Sequence[int],
            args: argparse.Namespace, workdir: Path) -> tuple[list[dict], dict]:
    """One fresh network: reservation, connectivity and transfers. Returns transfer rows and a setting summary."""
    workers: list[Worker] = []
    rows: list[dict] = []
    label = f"{subnet}.0/24, {rate_label(rate)}, {reachability}, {relays} relay"
    with wan.Network([rate] * (args.public + 2), f"{os.getpid()}-relay", nat=2, subnet=subnet,
                     nat_inbound=args.nat_inbound) as network:
        try:
            *publics, a_host, b_host = network.hosts
            public = publics[0]
            limits = []
            if args.relay_data_limit:
                limits += ["--relay-data-limit", str(args.relay_data_limit)]
            if args.relay_time_limit:
                limits += ["--relay-time-limit", str(args.relay_time_limit)]
            relay = start_worker(network, network.bridge, "relay", workdir, f"/ip4/{network.bridge_address}/tcp/0",
                                 "--force-reachability", args.relay_reachability, *limits)
            workers.append(relay)
            ready = relay.wait_for("ready", 60)
            relay_maddr = next(m for m in ready["maddrs"] if network.bridge_address in m)
            peer_args = ["--initial-peer", relay_maddr, "--force-reachability", reachability,
                         *(["--static-relay"] if relays == "static" else [])]
            others = [start_worker(network, host.namespace, f"h{i}", workdir, f"/ip4/{host.address}/tcp/0",
                                   "--initial-peer", relay_maddr) for i, host in enumerate(publics)]
            h0 = others[0]
            b = start_worker(network, b_host.namespace, "B", workdir, f"/ip4/{b_host.address}/tcp/0", "--auto-relay",
                             *peer_args)
            a = start_worker(network, a_host.namespace, "A", workdir, f"/ip4/{a_host.address}/tcp/0", "--auto-relay",
                             *peer_args)
            workers += [*others, b, a]
            ids = {w.name: w.wait_for("ready", 60)["id"] for w in (*others, b, a)}
            print(f"[{label}] relay {relay_maddr}; {'h0' if len(others) == 1 else f'h0..h{len(others) - 1}'} "
                  f"public from {public.address}, A {a_host.address} behind "
                  f"{a_host.public_address}, B {b_host.address} behind {b_host.public_address}; logs in {workdir}",
                  flush=True)
            started = time.monotonic()
            deadline = started + args.reserve_timeout
            while b.circuit_seconds is None and time.monotonic() < deadline:
                time.sleep(0.5)
            time.sleep(max(0.0, started + args.settle - time.monotonic()))
            circuit = f"{relay_maddr}/p2p-circuit/p2p/{ids['B']}"  # B's circuit address (connect takes it bare)
            summary = {"subnet": subnet, "rate_mbit": None if math.isinf(rate) else rate,
                       "reachability": reachability, "relays": relays, "public_hosts": len(others),
                       "b_reservation_seconds": b.circuit_seconds, "b_maddrs": b.maddrs, "circuit": circuit,
                       "relay_data_limit": args.relay_data_limit or DEFAULT_DATA_LIMIT,
                       "relay_time_limit_s": args.relay_time_limit or DEFAULT_TIME_LIMIT}
            waited = b.circuit_seconds if b.circuit_seconds is not None else args.reserve_timeout
            print(f"[{label}] B's addresses after {waited:.1f} s: {', '.join(b.maddrs)}", flush=True)
            plan = [(f"{size // MIB} MiB", size) for size in sizes]
            plan += [(name, size) for name, size in ROUND_SIZES.items()]
            for what, size in plan:
                routes = [("relay", a, ids["B"], [circuit.rsplit("/p2p/", 1)[0]])]
                if what.endswith("MiB"):
                    routes.append(("direct", a, ids["h0"], [m.split("/p2p/")[0] for m in h0.maddrs]))
                for via, sender, target, addresses in routes:
                    sender.command(op="send", peer=target, maddrs=addresses, bytes=size,
                                   timeout=transfer_timeout(size, rate), fresh=via == "relay")
                    result = sender.wait_for("sent", transfer_timeout(size, rate) + 120)
                    if not result["ok"]:
                        result["error"] = short_error(result.get("error", ""), size, b if via == "relay" else h0)
                    row = {"subnet": subnet, "rate_mbit": summary["rate_mbit"], "reachability": reachability,
                           "relays": relays, "what": what,
                           "bytes": size, "via": "A -> B relay" if via == "relay" else "A -> h0 direct",
                           "ok": result["ok"], "seconds": round(result["seconds"], 3),
                           "mbit_s": round(size * 8 / result["seconds"] / 1e6, 1) if result["ok"] else None,
                           "path": path_of(result.get("path")), "error": result.get("error")}
                    rows.append(row)
                    outcome = (f"{row['seconds']:.2f} s, {row['mbit_s']} Mbit/s over {row['path']}" if row["ok"]
                               else f"FAILED: {row['error']}")
                    print(f"[{label}] {what} {row['via']}: {outcome}", flush=True)
            # Direct dials that must fail behind the NATs: A -> B at B's own (LAN) addresses and at its router's,
            # and h0 -> B, unless B already dialled h0 (then h0 reaches B over B's own connection).
            own = [m.split("/p2p/")[0] for m in b.maddrs if "/p2p-circuit" not in m]
            own.append(own[0].replace(b_host.address, b_host.public_address))
            for sender, name in ((a, "A -> B direct"), (h0, "h0 -> B direct")):
                sender.command(op="peers")
                connected = [p["addrs"] for p in sender.wait_for("peers", 30)["peers"] if p["id"] == ids["B"]]
                if connected:
                    summary[name] = "connected: " + ", ".join(path_of(x) or "" for x in connected[0])
                    print(f"[{label}] {name}: {summary[name]}", flush=True)
                    continue
                sender.command(op="send", peer=ids["B"], maddrs=own, bytes=MIB, timeout=30)
                result = sender.wait_for("sent", 120)
                summary[name] = "works" if result["ok"] else "fails"
                print(f"[{label}] {name} at {', '.join(own)}: {summary[name]}"
                      f"{'' if result['ok'] else ': ' + result.get('error', '')[:160]}", flush=True)
            a.command(op="peers")
            peers = a.wait_for("peers", 30)["peers"]
            summary["a_to_b_connections"] = next((p["addrs"] for p in peers if p["id"] == ids["B"]), [])
            summary["relay_works"] = any(r["ok"] for r in rows if r["via"] == "A -> B relay")
            return rows, summary
        finally:
            for worker in reversed(workers):
                worker.stop()


def short_error(error: str, size: int, receiver: Worker) -> str:
    """The reason a transfer failed, in a few words: what the relay answered, or how far the stream got before it
    was reset (from the receiver's account, if it gave one)."""
    time.sleep(0.5)
    got = None
    while True:
        try:
            event = receiver.events.get_nowait()
        except queue.Empty:
            break
        short = re.search(r"stream ended (\d+) bytes short", event.get("error", ""))
        if event.get("event") == "sink_error":
            got = size - int(short.group(1)) if short else 0
    if "NO_RESERVATION" in error:
        return "the relay holds no reservation for B (NO_RESERVATION)"
    if "dial backoff" in error and "NO_RESERVATION" not in error:
        return "dial backoff (libp2p waits before it redials addresses that just failed)"
    if "all dials failed" in error:
        return "no route: " + "; ".join(re.findall(r"\] ([^\n]*)", error))[:200]
    if got is not None:
        return f"stream reset after B got {got:,} of {size:,} bytes ({error.split(':')[0]})"
    return error[:200]


def path_of(address: str | None) -> str | None:
    if not address:
        return None
    if "/p2p-circuit" in address:
        relay = re.search(r"/ip4/([^/]+)/", address)
        return f"relayed via {relay.group(1) if relay else '?'}"
    return f"direct ({address})"


def holepunch_support() -> dict:
    """What the shipped p2pd offers for hole punching: a flag in ``-h``, and DCUtR linked into the binary (read
    from a running daemon's memory: the file is UPX-packed)."""
    from hivemind.p2p import p2p_daemon

    binary = Path(p2p_daemon.__file__).parent.parent / "hivemind_cli" / "p2pd"
    help_text = subprocess.run([str(binary), "-h"], capture_output=True, text=True).stderr
    flags = re.findall(r"^\s+-(\w+)", help_text, flags=re.M)
    found: dict[str, bool] = {}
    socket_path = Path(tempfile.gettempdir()) / f"p2ploco-relay-probe-{os.getpid()}.sock"
    daemon = subprocess.Popen([str(binary), f"-listen=/unix{socket_path}", "-hostAddrs=/ip4/127.0.0.1/tcp/0"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.5)
        memory = read_memory(daemon.pid)
        for needle in ("/libp2p/dcutr", "p2p/protocol/holepunch", "go-libp2p.EnableHolePunching",
                       "/libp2p/circuit/relay/0.2.0/hop", "/libp2p/autonat/1.0.0"):
            found[needle] = needle.encode() in memory
        version = re.search(rb"go-libp2p@(v[0-9.]+)", memory)
    finally:
        daemon.kill()
        daemon.wait()
        socket_path.unlink(missing_ok=True)
    return {"binary": str(binary), "hole_punch_flags": [f for f in flags if re.search("hole|punch|dcutr", f, re.I)],
            "autonat_flag": "autonat" in flags, "linked": found,
            "go_libp2p": version.group(1).decode() if version else None}


def read_memory(pid: int) -> bytes:
    chunks = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        span, perms = line.split()[:2]
        start, end = (int(x, 16) for x in span.split("-"))
        if "r" not in perms or end - start > 256 * MIB:
            continue
        try:
            with open(f"/proc/{pid}/mem", "rb") as f:
                f.seek(start)
                chunks.append(f.read(end - start))
        except OSError:
            continue
    return b"".join(chunks)


def print_tables(holepunch: dict, summaries: list[dict], rows: list[dict], args: argparse.Namespace) -> None:
    def link(row: dict) -> str:
        return rate_label(row["rate_mbit"] or math.inf)

    def setting_row(s: dict) -> tuple:
        if "error" in s:
            return s["subnet"], link(s), s["reachability"], s["relays"], "error", s["error"][:60], "", "", ""
        reserved = f"{s['b_reservation_seconds']:.1f} s" if s["b_reservation_seconds"] is not None else "not seen"
        return (s["subnet"], link(s), s["reachability"], s["relays"], reserved,
                "works" if s["relay_works"] else "fails",
                ", ".join(path_of(x) or "" for x in s["a_to_b_connections"]) or "none",
                s["A -> B direct"], s["h0 -> B direct"])

    print(f"\nsettings (B reserved: when a /p2p-circuit address showed among B's own, 'not seen' in "
          f"{args.reserve_timeout:.0f} s; relay A -> B: a stream at B's circuit address through the relay; A's "
          f"connection to B: after the transfers)")
    print(format_table(("subnet", "link", "reachability", "relays", "B reserved", "relay A -> B",
                        "A's connection to B", "A dials B", "h0 dials B"), [setting_row(s) for s in summaries]))
    print("\ntransfers (Mbit/s: payload bits over the seconds from the first byte sent to the receiver's answer)")
    print(format_table(("subnet", "link", "reachability", "relays", "size", "via", "ok", "seconds", "Mbit/s or why",
                        "path"),
                       [(r["subnet"], link(r), r["reachability"], r["relays"],
                         r["what"] + (f" ({r['bytes'] / 1e6:.1f} MB)" if "round" in r["what"] else ""),
                         r["via"], "yes" if r["ok"] else "NO", f"{r['seconds']:.2f}",
                         r["mbit_s"] if r["ok"] else (r["error"] or "")[:70], r["path"] or "")
                        for r in rows]))
    limit_gib = (args.relay_data_limit or DEFAULT_DATA_LIMIT) / 2**30
    minutes = (args.relay_time_limit or DEFAULT_TIME_LIMIT) / 60
    print(f"\nrelay limits per relayed connection, then the relay resets it: {limit_gib:g} GiB each way and "
          f"{minutes:g} min (-relayDataLimit, -relayTimeLimit) once the relay's AutoNAT found it public; until then, "
          f"and always on private addresses, go-libp2p's defaults of 128 KiB and 2 min. Round payloads: " + "; ".join(
              f"a {name} ({size / 1e6:.1f} MB) fits {int(limit_gib * 2**30 // size)} times in the first, "
              f"{'not' if size > DEFAULT_LIMIT_DATA else 'once'} in the second" for name, size in ROUND_SIZES.items()))
    flags = holepunch["hole_punch_flags"]
    linked = holepunch["linked"]
    with_autonat = (" and on with -autonat (hivemind passes -autonat=1): it starts once a peer has a public "
                    "observed address (4 peers saw it); whether it turned A-B direct: the column A's connection to B"
                    if linked.get("go-libp2p.EnableHolePunching") and holepunch["autonat_flag"] else "")
    print(f"hole punching: p2pd ({holepunch['go_libp2p'] or 'go-libp2p ?'}) has "
          f"{'the flag(s) ' + ', '.join(flags) if flags else 'no flag for it'}; DCUtR (/libp2p/dcutr) is "
          f"{'linked in' if linked.get('/libp2p/dcutr') else 'not in the binary'}{with_autonat}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", nargs="+", default=["uncapped", "100"], metavar="MBIT",
                        help="every host's link cap, one network each: Mbit/s or 'uncapped'")
    parser.add_argument("--reachability", nargs="+", default=["auto"], choices=["auto", "private"],
                        help="A's and B's reachability: left to AutoNAT, or forced private (one network each)")
    parser.add_argument("--sizes", nargs="+", type=int, default=[1, 16, 128], metavar="MIB",
                        help="transfer sizes in MiB, each through the relay and direct")
    parser.add_argument("--reserve-timeout", type=float, default=240,
                        help="seconds to wait for B to hold a relay reservation")
    parser.add_argument("--relays", nargs="+", default=["discovered"], choices=["discovered", "static"],
                        help="how A and B find the relay: hivemind's way (-autoRelay with relay discovery: p2pd "
                             "feeds candidates from its DHT and waits for 4 of them or 3 minutes), or the relay as "
                             "a static relay (-trustedRelays=<relay> -relayDiscovery=0: reserved at once); one "
                             "network each")
    parser.add_argument("--settle", type=float, default=0, metavar="SECONDS",
                        help="wait at least this long after the peers start before the transfers (AutoNAT settles)")
    parser.add_argument("--relay-reachability", default="auto", choices=["auto", "public"],
                        help="the relay's own reachability: left to AutoNAT, or forced public "
                             "(-forceReachabilityPublic)")
    parser.add_argument("--relay-data-limit", type=int, default=0, metavar="BYTES",
                        help="start the relay with this -relayDataLimit [p2pd's default, 4 GiB]")
    parser.add_argument("--relay-time-limit", type=int, default=0, metavar="SECONDS",
                        help="start the relay with this -relayTimeLimit [p2pd's default, 30 min]")
    parser.add_argument("--subnet", nargs="+", default=[wan.SUBNET, "7.77.0"], metavar="A.B.C",
                        help="the bridge's /24, one network each [10.77.0 7.77.0]: libp2p leaves private addresses "
                             "aside (AutoNAT, relay addresses, hole punching), so a public-looking one (nothing "
                             "leaves the namespaces) shows what it does on the Internet")
    parser.add_argument("--nat-inbound", default="reject", choices=wan.NAT_INBOUND,
                        help="what A's and B's routers do with a connection dialled at them: refuse it (a reset) or "
                             "drop it unanswered, which lets a TCP hole punch through [reject]")
    parser.add_argument("--public", type=int, default=1, metavar="N",
                        help="public hosts besides the relay [1]; a NATed peer's observed address counts once 4 "
                             "peers saw it, and hole punching waits for one")
    parser.add_argument("--workdir", type=Path, help="where the workers' logs go [a temporary folder]")
    parser.add_argument("--json", action="store_true", help="print everything as one JSON object")
    # the worker's own options
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--listen", help=argparse.SUPPRESS)
    parser.add_argument("--initial-peer", help=argparse.SUPPRESS)
    parser.add_argument("--auto-relay", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--force-reachability", default="auto", help=argparse.SUPPRESS)
    parser.add_argument("--static-relay", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        asyncio.run(worker(args))
        return 0
    try:
        rates = [math.inf if r == "uncapped" else float(r) for r in args.rate]
    except ValueError:
        raise SystemExit("error: --rate takes Mbit/s or 'uncapped'") from None
    if any(not 0 < r for r in rates) or any(s < 1 for s in args.sizes):
        raise SystemExit("error: rates and sizes must be positive")
    holepunch = holepunch_support()
    try:
        wan.check_namespaces(nat=True)
    except wan.NoNamespaces as e:
        print(f"relay.py: cannot emulate NATs here: {e}; nothing measured")
        return 0
    wan.stop_on_sigterm()
    wan.remove_stale_namespaces()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="p2ploco-relay-"))
    rows, summaries = [], []
    for subnet, rate, reachability, relays in itertools.product(args.subnet, rates, args.reachability, args.relays):
        label = f"{subnet}.0/24, {rate_label(rate)}, {reachability}, {relays} relay"
        where = workdir / re.sub(r"[^\w.]+", "-", label)
        where.mkdir(parents=True, exist_ok=True)
        try:
            got, summary = measure(subnet, rate, reachability, relays, [s * MIB for s in args.sizes], args, where)
        except (TimeoutError, subprocess.CalledProcessError) as e:
            print(f"[{label}] failed: {e}", flush=True)
            summaries.append({"subnet": subnet, "rate_mbit": None if math.isinf(rate) else rate,
                              "reachability": reachability, "relays": relays, "error": str(e)})
            continue
        rows += got
        summaries.append(summary)
    if args.json:
        print(json.dumps({"holepunch": holepunch, "settings": summaries, "transfers": rows}))
    else:
        print_tables(holepunch, summaries, rows, args)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("relay.py: interrupted; everything it made is removed", file=sys.stderr)
        sys.exit(130)
