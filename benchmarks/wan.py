"""WAN emulation: real p2ploco nodes on hosts of their own, behind capped links, one table per setting.

Every host is a network namespace with its own address on one bridge (10.77.0.0/24, in a namespace of its
own too, which also runs the bootstrap peer `p2ploco dht` at 10.77.0.254). A host's link is capped both ways
by a tbf qdisc (its upload on its side of the veth, its download on the bridge's side). Each host runs one
real `p2ploco node start` (with its p2p daemon) that joins through the bootstrap peer and trains `--rounds`
rounds with the others, stating its cap as its link rate (``swarm.bandwidth_mbit``: transfer deadlines
follow it). A setting is an algorithm and a rate: uniform (`100`: every host at 100 Mbit/s) or
mixed (`1000,20`: host 0 at 1 Gbit/s, the rest at 20 Mbit/s; the last rate repeats). Nothing leaves the
machine: the namespaces reach only each other.

`--nat N` puts the last N hosts each behind a router of its own: a namespace between the host (10.78.<i>.2) and
the bridge (the router's 10.77.0.<i+1>), which masquerades what the host sends out and lets in only the replies
(iptables, or nft: a home router without port forwarding). A NATed host reaches the bootstrap peer and the public
hosts; nobody can dial it, not even another NATed host. Its cap stays on its own link (host to router). A
connection dialled at a router's own address is refused (a reset); `--nat-inbound drop` drops it unanswered
instead, as a "stealth" router does.
With `--nat` equal to `--hosts`, every trainer is behind a NAT of its own and the bootstrap's machine is the only
public one; its `p2ploco dht` then hosts a hub, as it does by default (a full replica that trains nothing,
coordinates, reduces the trainers' spans and takes every result: `hosted_hub.py`). It is started with addresses only,
as README's shortest path starts it: no NATed trainer can be dialled to hand out the run's config, and the bootstrap
fetches it over the connections they opened to it (`--bootstrap-config` gives it `--config` instead);
`--kill-bootstrap-hub R` SIGKILLs its hub process as round R begins, which the bootstrap starts again.
`--no-bootstrap-hub` passes it `--no-hub`, `--bootstrap-hub` asks for it in any setting. `--hubs N` runs N more hubs
(`p2ploco node start --role hub`) on that machine, public and uncapped. A table of the hubs follows the hosts' (the
rounds each applied, the bytes its link carried a round); `--kill-hub R` SIGKILLs the last of `--hubs`, daemon and
all, as round R begins.
`--slow F0 F1 ...` stretches host i's inner steps to F_i times their compute time (the fault
``inner.step=slow:F`` in its node's P2PLOCO_FAULTS); `--hold S0 S1 ...` holds host i S_i seconds before each
inner step instead (``inner.step=stall:S``: a data loader that waits, a device another job holds);
`--reachability M0 M1 ...` passes ``--reachability M_i`` to host i's node (the default, detection, is left alone
otherwise). `--subnet` moves the bridge: libp2p's AutoNAT, relay addresses and hole punching leave private
addresses such as 10.77.0.x aside, so a public-looking /24 (nothing leaves the namespaces) shows what they do on
the Internet.

Per setting, from the nodes' round records, a table with a row per round: bytes per node (sent +
received), comm, round and inner seconds (means over the nodes), compute utilisation (inner seconds over
the wall seconds since the node's previous record), the time the slowest host needs to move its larger
direction at its cap, how many hosts' work the applied aggregate holds (records' ``contributed_tokens``), and
whether every node applied the same parameters. Then a row per host: NAT or public, its cap and slowdown, its
reachability as its node saw it (``reachability`` of its records), the rounds it applied, the tokens it trained
(``tokens``) and how many of them ended up in aggregates it applied (``contributed_tokens`` of its applied
rounds), that share, the rounds its work was applied in (applied with ``contributed_tokens`` > 0), its median round,
and of the rounds it trained in how many had their work applied, then or carried into a later applied round (a step
it sat rounds out for), and how many trained after the other hosts had applied their last round (`--json`:
``per_host``). `--baseline` first runs each setting with 2 hosts (`--baseline-hosts`), none slowed, held or NATed,
and prints h0's median round against theirs (`h0_vs_baseline`); `--repeat N` runs baseline and setting N times,
alternating, and compares the medians of all their runs' rounds (one run's baseline moved from 0.38 to 0.61 s on 2
cores). The summary lines (and `--json`) leave out round 0, which includes start-up: means over rounds 1.., and
medians over every node's rounds 1 .. R-2 (the last round also evaluates and writes the exit checkpoint;
`median_utilisation`, `median_round_minus_inner`). Settings run one after another; each gets fresh namespaces.

Needs root (network namespaces and tc; with --nat, iptables or nft too). Where they cannot be made it says so in
one line and exits 0.
It always removes what it made (processes, namespaces, and with them the veths and the bridge), also on
Ctrl-C, SIGTERM, a failed node or a crash of its own; namespaces left by a run that was SIGKILLed are
removed by the next run.

    sudo python benchmarks/wan.py                                   # 3 hosts, 100 Mbit/s, SparseLoCo, 5 rounds
    sudo python benchmarks/wan.py --rate 100 20 --algorithm sparseloco diloco \\
        --set model.d_model=768 --set model.n_layer=3 --set model.n_head=12 --set inner.steps=3 \\
        --set inner.batch_size=2 --set data.seq_len=64              # the 21.4M setting of issue 12
    sudo python benchmarks/wan.py --rate 1000,20 --json             # mixed links; rows as one JSON list
    sudo python benchmarks/wan.py --nat 2 --rounds 12               # h1 and h2 behind NATs of their own
    sudo python benchmarks/wan.py --slow 1 3 10 --rounds 12         # h1 computes 3x, h2 10x slower
    sudo python benchmarks/wan.py --hold 0 0 1.5 --rounds 12        # h2 held 1.5 s before each step
    sudo python benchmarks/wan.py --slow 1 3 10 --rounds 12 --baseline   # h0's rounds against 2 hosts alone
    sudo python benchmarks/wan.py --nat 3 --rounds 12 --baseline --baseline-hosts 3
                                                # every trainer NATed: the bootstrap the only public machine
    sudo python benchmarks/wan.py --hosts 6 --nat 6 --hubs 1 --kill-hub 6 --rounds 12
                                                # the bootstrap's hub and one more; that one dies
    sudo python benchmarks/wan.py --nat 3 --kill-bootstrap-hub 6 --rounds 12
                                                # the bootstrap's hub dies, and the bootstrap starts it again
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from p2ploco.config import load_config
from p2ploco.errors import ConfigError, SwarmError
from p2ploco.launch import ADDRESS, TINY_CONFIG, Child, cli
from p2ploco.metrics import format_table, human_bytes, read_summaries
from p2ploco.model import Transformer

PREFIX = "p2pwan-"  # namespaces are p2pwan-<pid of the run>-<role>
SUBNET = "10.77.0"
BRIDGE_ADDRESS = f"{SUBNET}.254"
LAN_SUBNET = "10.78"  # a NATed host i: 10.78.<i>.2 behind its router's 10.78.<i>.1
NAT_INBOUND = ("reject", "drop")  # what a NAT router does with a connection dialled at its own address
POLL = 0.5  # seconds between looks at the nodes' records


class NoNamespaces(Exception):
    """This machine (or user) cannot make network namespaces with capped links."""


def sh(*argv: str) -> None:
    """Run one ip/tc command; CalledProcessError with its stderr if it fails."""
    subprocess.run(argv, check=True, capture_output=True, text=True)


@dataclass
class Host:
    namespace: str
    address: str  # where its node listens: its own address on the bridge, or its LAN address behind its router
    rate_mbit: float
    router: str | None = None  # the namespace of its router, when it sits behind a NAT of its own
    public_address: str = ""  # what the others see: its address, or its router's on the bridge

    @property
    def natted(self) -> bool:
        return self.router is not None


class Network:
    """A bridge and ``len(rates)`` hosts, each with its own address and a link capped both ways at its rate. The
    last ``nat`` hosts sit each behind a masquerading router of its own (a namespace between the host and the
    bridge, ``LAN_SUBNET.<i>.1`` on the host's side and ``SUBNET.<i+1>`` on the bridge): a home router without
    port forwarding, which lets the host's connections out and their replies back in and stops every connection
    that starts on the bridge's side (one dialled at the router itself is refused, or with ``nat_inbound="drop"``
    dropped unanswered). The cap stays on the host's own link (host to router)."""

    def __init__(self, rates: Sequence[float], tag: str, nat: int = 0, subnet: str = SUBNET,
                 nat_inbound: str = "reject"):
        if not 0 <= nat <= len(rates):
            raise ValueError(f"nat={nat}: at most one NATed host per host ({len(rates)})")
        if nat_inbound not in NAT_INBOUND:
            raise ValueError(f"nat_inbound={nat_inbound!r}: one of {', '.join(NAT_INBOUND)}")
        self.tag = tag
        self.nat_inbound = nat_inbound
        self.subnet = subnet  # the bridge's /24 (its first three numbers)
        self.bridge_address = f"{subnet}.254"
        self.bridge = f"{PREFIX}{tag}-br"
        self.hosts = []
        for i, rate in enumerate(rates):
            if i >= len(rates) - nat:
                self.hosts.append(Host(f"{PREFIX}{tag}-h{i}", f"{LAN_SUBNET}.{i}.2", rate, f"{PREFIX}{tag}-r{i}",
                                       f"{subnet}.{i + 1}"))
            else:
                self.hosts.append(Host(f"{PREFIX}{tag}-h{i}", f"{subnet}.{i + 1}", rate,
                                       public_address=f"{subnet}.{i + 1}"))
        self.made: list[str] = []

    def __enter__(self) -> Network:
        try:
            self._make()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _make(self) -> None:
        self._namespace(self.bridge)
        sh("ip", "-n", self.bridge, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.bridge, "addr", "add", f"{self.bridge_address}/24", "dev", "br0")
        sh("ip", "-n", self.bridge, "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts):
            self._namespace(host.namespace)
            if not host.natted:
                self._veth(i, "a", host.namespace, "eth0", self.bridge, f"h{i}")
                sh("ip", "-n", self.bridge, "link", "set", f"h{i}", "master", "br0", "up")
                self._address(host.namespace, "eth0", f"{host.address}/24")
                self._cap(host, (host.namespace, "eth0"), (self.bridge, f"h{i}"))
                continue
            # host eth0 -- lan0 router wan0 -- h<i> on the bridge
            assert host.router is not None
            self._namespace(host.router)
            self._veth(i, "r", host.router, "wan0", self.bridge, f"h{i}")
            sh("ip", "-n", self.bridge, "link", "set", f"h{i}", "master", "br0", "up")
            self._address(host.router, "wan0", f"{host.public_address}/24")
            self._veth(i, "l", host.namespace, "eth0", host.router, "lan0")
            self._address(host.router, "lan0", f"{LAN_SUBNET}.{i}.1/24")
            self._address(host.namespace, "eth0", f"{host.address}/24")
            sh("ip", "-n", host.namespace, "route", "add", "default", "via", f"{LAN_SUBNET}.{i}.1")
            sh("ip", "netns", "exec", host.router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
            masquerade(host.router, wan="wan0", lan="lan0", drop_inbound=self.nat_inbound == "drop")
            self._cap(host, (host.namespace, "eth0"), (host.router, "lan0"))

    def _veth(self, i: int, kind: str, left_ns: str, left: str, right_ns: str, right: str) -> None:
        """A veth pair made here under names unique to the run, then moved into its namespaces and renamed."""
        near, far = f"pw{os.getpid()}{kind}{i}"[:15], f"pw{os.getpid()}{kind.upper()}{i}"[:15]
        sh("ip", "link", "add", near, "type", "veth", "peer", "name", far)
        sh("ip", "link", "set", near, "netns", left_ns)
        sh("ip", "link", "set", far, "netns", right_ns)
        sh("ip", "-n", left_ns, "link", "set", near, "name", left)
        sh("ip", "-n", right_ns, "link", "set", far, "name", right)

    @staticmethod
    def _address(namespace: str, device: str, cidr: str) -> None:
        sh("ip", "-n", namespace, "addr", "add", cidr, "dev", device)
        sh("ip", "-n", namespace, "link", "set", device, "up")

    @staticmethod
    def _cap(host: Host, upload: tuple[str, str], download: tuple[str, str]) -> None:
        """tbf at the host's rate on both ends of its own link: its upload leaves ``upload``, its download
        ``download`` (namespace, device). An infinite rate leaves the link uncapped."""
        if math.isinf(host.rate_mbit):
            return
        for namespace, device in (upload, download):
            sh("tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf", "rate", f"{host.rate_mbit}mbit",
               "burst", f"{burst_bytes(host.rate_mbit)}b", "latency", "100ms")

    def _namespace(self, name: str) -> None:
        sh("ip", "netns", "add", name)
        self.made.append(name)
        sh("ip", "-n", name, "link", "set", "lo", "up")

    def run_in(self, namespace: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", namespace, *argv]

    def remove(self) -> None:
        """Delete every namespace made (their veths, the bridge and the qdiscs go with them)."""
        with signals_held():
            for name in reversed(self.made):
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
            self.made.clear()


def burst_bytes(rate_mbit: float) -> int:
    """tbf bucket: 10 ms at the rate, and at least 128 KiB (a GSO segment on a veth is up to 64 KiB)."""
    return max(128 * 1024, int(rate_mbit * 1e6 / 8 / 100))


def nat_tool() -> str | None:
    """What sets up the routers' NAT and firewall: "iptables", else "nft", else None."""
    return next((tool for tool in ("iptables", "nft") if shutil.which(tool)), None)


def masquerade(router: str, wan: str, lan: str, drop_inbound: bool = False) -> None:
    """In ``router``'s namespace: masquerade what leaves by ``wan``, and forward from ``wan`` to ``lan`` only the
    replies to connections the LAN opened (a home router without port forwarding). A connection dialled at the
    router's own address is refused (the kernel answers a reset), or with ``drop_inbound`` dropped unanswered, as a
    "stealth" router does: then a TCP hole punch (both sides dial at once) can get through."""
    if nat_tool() == "iptables":
        iptables = ["ip", "netns", "exec", router, "iptables"]
        sh(*iptables, "-t", "nat", "-A", "POSTROUTING", "-o", wan, "-j", "MASQUERADE")
        sh(*iptables, "-A", "FORWARD", "-i", wan, "-o", lan, "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
           "-j", "ACCEPT")
        sh(*iptables, "-A", "FORWARD", "-i", wan, "-o", lan, "-j", "DROP")
        if drop_inbound:
            sh(*iptables, "-A", "INPUT", "-i", wan, "-m", "conntrack", "--ctstate", "NEW,INVALID", "-j", "DROP")
        return
    stealth = (f'  chain input {{ type filter hook input priority filter;\n'
               f'    iifname "{wan}" ct state new,invalid drop; }}\n' if drop_inbound else '')
    rules = (f'table ip p2pwan {{\n'
             f'  chain postrouting {{ type nat hook postrouting priority srcnat; oifname "{wan}" masquerade; }}\n'
             f'  chain forward {{ type filter hook forward priority filter;\n'
             f'    iifname "{wan}" oifname "{lan}" ct state established,related accept;\n'
             f'    iifname "{wan}" oifname "{lan}" drop; }}\n'
             f'{stealth}'
             f'}}\n')
    subprocess.run(["ip", "netns", "exec", router, "nft", "-f", "-"], input=rules, check=True, capture_output=True,
                   text=True)


def remove_stale_namespaces() -> list[str]:
    """Namespaces of earlier runs whose process is gone (it was SIGKILLed): removed, and their names returned."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    stale = []
    for name in listing:
        if name.startswith(PREFIX):
            pid = name[len(PREFIX):].split("-")[0]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                subprocess.run(["ip", "netns", "del", name], capture_output=True)
                stale.append(name)
    return stale


def check_namespaces(nat: bool = False) -> None:
    """NoNamespaces, saying why, unless this process can make a namespace with a tbf qdisc (and with ``nat``, a
    host behind a masquerading router)."""
    if sys.platform != "linux":
        raise NoNamespaces("network namespaces need Linux")
    if os.geteuid() != 0:
        raise NoNamespaces("network namespaces and tc need root (run it with sudo)")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NoNamespaces(f"{' and '.join(missing)} not found (install iproute2)")
    if nat and nat_tool() is None:
        raise NoNamespaces("NATed hosts need iptables or nft (apt-get install iptables)")
    try:
        with Network([10.0], f"{os.getpid()}-probe", nat=1 if nat else 0):
            pass
    except subprocess.CalledProcessError as e:
        raise NoNamespaces(f"`{' '.join(e.cmd)}` failed: {e.stderr.strip() or e.returncode}") from None


def parse_rates(text: str, hosts: int) -> list[float]:
    """Per-host rates in Mbit/s from "100" or "1000,20" (the last rate repeats for the remaining hosts)."""
    try:
        rates = [float(part) for part in text.split(",")]
    except ValueError:
        raise ConfigError(f"--rate {text!r}: give Mbit/s as a number, or numbers separated by commas") from None
    if not rates or any(not 0 < r <= 100_000 for r in rates) or len(rates) > hosts:
        raise ConfigError(f"--rate {text!r}: each rate must be in (0, 100000] Mbit/s, at most one per host")
    return rates + [rates[-1]] * (hosts - len(rates))


def parse_slow(factors: Sequence[float], hosts: int) -> list[float]:
    """Per-host compute slowdowns from ``--slow`` (host i gets factor i, the hosts after the last get 1)."""
    if len(factors) > hosts or any(not 1 <= f <= 1000 for f in factors):
        raise ConfigError(f"--slow {' '.join(f'{f:g}' for f in factors)}: each factor must be in [1, 1000], "
                          f"at most one per host")
    return [*factors, *[1.0] * (hosts - len(factors))]


def parse_hold(seconds: Sequence[float], slow: Sequence[float]) -> list[float]:
    """Per-host holds before each inner step from ``--hold`` (host i gets the i-th, the hosts after the last 0)."""
    if len(seconds) > len(slow) or any(not 0 <= h <= 600 for h in seconds):
        raise ConfigError(f"--hold {' '.join(f'{h:g}' for h in seconds)}: each hold must be in [0, 600] seconds, at "
                          f"most one per host")
    if any(h and f != 1 for h, f in zip(seconds, slow)):
        raise ConfigError("--hold and --slow: a host is either slowed inside its steps or held between them; give "
                          "it a hold of 0 or a factor of 1")
    return [*seconds, *[0.0] * (len(slow) - len(seconds))]


@dataclass
class Setting:
    algorithm: str
    rate_text: str
    rates: list[float]
    nat: int = 0  # the last this many hosts sit each behind a NAT of its own
    slow: list[float] = field(default_factory=list)  # per host: its inner steps take this many times as long
    hold: list[float] = field(default_factory=list)  # per host: seconds it is held before each inner step
    reachability: list[str] = field(default_factory=list)  # per host: its node's --reachability (none: the default)
    subnet: str = SUBNET  # the bridge's /24
    nat_inbound: str = "reject"  # NAT routers refuse connections dialled at them, or drop them unanswered
    hubs: int = 0  # hub nodes (``--role hub``) on the bootstrap's machine, besides the bootstrap's own
    kill_hub: int | None = None  # the round at whose start the last hub is SIGKILLed (None: never)
    bootstrap_hub: bool = False  # the bootstrap peer hosts its hub (``p2ploco dht``'s default; off: --no-hub)
    bootstrap_config: bool = False  # it is given the run's config (else it fetches it through its own daemon)
    kill_bootstrap_hub: int | None = None  # the round at whose start the bootstrap's hub process is SIGKILLed

    @property
    def hub_names(self) -> list[str]:
        """The hubs, as their records come after the hosts': the bootstrap's, then the others."""
        return ["bootstrap"] * self.bootstrap_hub + [f"hub{j}" for j in range(self.hubs)]

    @property
    def label(self) -> str:
        extra = [f"{self.nat} NATed"] if self.nat else []
        if self.bootstrap_hub:
            extra.append("the bootstrap hosts a hub")
        if self.hubs:
            extra.append(f"{self.hubs} {'other ' if self.bootstrap_hub else ''}hub{'s' if self.hubs > 1 else ''} on "
                         f"the bootstrap's machine")
        if self.kill_hub is not None:
            extra.append(f"hub{self.hubs - 1} killed at round {self.kill_hub}")
        if self.kill_bootstrap_hub is not None:
            extra.append(f"the bootstrap's hub killed at round {self.kill_bootstrap_hub}")
        if any(f != 1 for f in self.slow):
            extra.append("slow " + ",".join(f"{f:g}" for f in self.slow))
        if any(self.hold):
            extra.append("held " + ",".join(f"{h:g}" for h in self.hold) + " s before each step")
        return f"{self.algorithm} at {self.rate_text} Mbit/s" + (f" ({'; '.join(extra)})" if extra else "")

    def slowdown(self, host: int) -> float:
        return self.slow[host] if host < len(self.slow) else 1.0

    def node_env(self, host: int) -> dict[str, str]:
        """What the host's node gets in its environment: the fault that slows its inner steps, or holds it before
        each (as a data loader that waits, or a device another job holds, would), if any."""
        factor, hold = self.slowdown(host), self.hold[host] if host < len(self.hold) else 0.0
        if factor != 1:
            return {"P2PLOCO_FAULTS": f"inner.step=slow:{factor:g}"}
        return {"P2PLOCO_FAULTS": f"inner.step=stall:{hold:g}"} if hold else {}

    def node_args(self, host: int) -> list[str]:
        return ["--reachability", self.reachability[host]] if host < len(self.reachability) else []


class NodeFailed(Exception):
    """A node process ended before finishing its rounds."""


def run_setting(setting: Setting, config_path: str, overrides: list[str], rounds: int, workdir: Path,
                timeout: float) -> list[list[dict]]:
    """Every node's round records for one setting, on fresh namespaces that are removed on return."""
    hosts = len(setting.rates)
    children: list[Child] = []
    with Network(setting.rates, f"{os.getpid()}-{setting.algorithm}", setting.nat, setting.subnet,
                 setting.nat_inbound) as network:
        try:
            natted = [f"h{i}" for i, host in enumerate(network.hosts) if host.natted]
            behind = (f", {natted[0]} behind a NAT" if len(natted) == 1 else
                      f", {natted[0]}..{natted[-1]} behind NATs" if natted else "")
            print(f"[{setting.label}] {hosts} hosts in namespaces {PREFIX}{network.tag}-*, bridge {network.subnet}.0/24"
                  f"{behind + f' ({LAN_SUBNET}.<i>.2)' if natted else ''}; logs in {workdir}", flush=True)
            sets = [f"swarm.min_peers={hosts + len(setting.hub_names)}", f"outer.algorithm={setting.algorithm}",
                    *overrides]
            # Addresses only, as README's shortest path starts it: its hub fetches the run's config through the
            # bootstrap's own daemon (NATed trainers cannot be dialled to hand it out), or is given it
            given = ["--config", config_path, *[item for s in sets for item in ("--set", s)]] \
                if setting.bootstrap_config else []
            hub = ["--hub-log-dir", str(workdir / "bootstrap-hub"), *given] if setting.bootstrap_hub else ["--no-hub"]
            bootstrap = Child("bootstrap", network.run_in(network.bridge, cli(
                "dht", "--host-maddrs", f"/ip4/{network.bridge_address}/tcp/0", *hub)), workdir / "bootstrap.log")
            children.append(bootstrap)
            address = bootstrap.wait_for_line(ADDRESS, timeout=60).group(1)

            def start_node(name: str, namespace: str, listen: str, *extra: str, env: dict[str, str] | None = None
                           ) -> None:
                argv = cli("node", "start", "--config", config_path, "--initial-peers", address, "--host-maddrs",
                           f"/ip4/{listen}/tcp/0", "--log-dir", str(workdir / name), "--max-rounds", str(rounds),
                           "--identity", str(workdir / f"{name}.key"), *[item for s in sets for item in ("--set", s)],
                           *extra)
                children.append(Child(name, network.run_in(namespace, argv), workdir / f"{name}.log",
                                      metrics_dir=workdir / name, env=env))

            for i, host in enumerate(network.hosts):
                start_node(f"h{i}", host.namespace, host.address, "--set", f"swarm.bandwidth_mbit={setting.rates[i]:g}",
                           *setting.node_args(i), env=setting.node_env(i))
            for j in range(setting.hubs):  # public, and uncapped: the bootstrap's own machine
                start_node(f"hub{j}", network.bridge, network.bridge_address, "--role", "hub", "--reachability",
                           "public")
            served = [workdir / "bootstrap-hub" / run_id(config_path, overrides) / "metrics.jsonl"] \
                if setting.bootstrap_hub else []
            kill = None if setting.kill_hub is None else (setting.kill_hub, children[-1].name, children[-1])
            if setting.kill_bootstrap_hub is not None:
                kill = (setting.kill_bootstrap_hub, "the bootstrap's hub", BootstrapHub(bootstrap.log_path))
            records = watch(setting, children[1:], rounds, timeout, kill, served)
            for path in served:  # it serves the run until the bootstrap stops: its rounds of the run
                records[hosts:hosts] = [[r for r in read_summaries(path) if r["round"] < rounds]]
            return records
        finally:
            stop_all(children)


def stop_all(children: list[Child]) -> None:
    """SIGTERM to all at once, then reap each (SIGKILL to its session if it lingers)."""
    with signals_held():
        for child in children:
            child.terminate()
        for child in reversed(children):
            child.stop()


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """A Ctrl-C or SIGTERM during clean-up waits until it is done (then ends the run as usual)."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


class BootstrapHub:
    """The bootstrap's hub process, as its log names it last ("hub: serving run ... pid N")."""

    def __init__(self, bootstrap_log: Path):
        self.bootstrap_log = bootstrap_log

    def signal(self, signum: int) -> None:
        pids = re.findall(r"hub: serving run .* pid (\d+)", self.bootstrap_log.read_text())
        if not pids:
            raise NodeFailed(f"the bootstrap's log names no hub process to kill ({self.bootstrap_log})")
        os.killpg(int(pids[-1]), signum)  # its session: the hub and its p2p daemon


def watch(setting: Setting, nodes: list[Child], rounds: int, timeout: float,
          kill: tuple[int, str, Child | BootstrapHub] | None = None, also: Sequence[Path] = ()) -> list[list[dict]]:
    """Every node's records once all have exited after their rounds, printing a line per round every node
    finished; NodeFailed if one exits with an error, TimeoutError past ``timeout``. ``kill``: (round, name, process):
    SIGKILL that process (its whole session, daemon included: a machine that crashes) once every other node has
    finished the round before; its exit is no failure. ``also``: the metrics of peers that are not waited for (the
    bootstrap's hub: it serves on once the others are done), read for each round's line."""
    deadline = time.monotonic() + timeout
    shown: set[int] = set()
    killed: Child | BootstrapHub | None = None
    while True:
        records = [read_summaries(node.metrics_dir / "metrics.jsonl") for node in nodes]
        if kill is not None and killed is None and all(any(r["round"] >= kill[0] - 1 for r in got)
                                                       for node, got in zip(nodes, records) if node is not kill[2]):
            killed = kill[2]
            killed.signal(signal.SIGKILL)
            print(f"[{setting.label}] killed {kill[1]} (SIGKILL, its daemon too) as round {kill[0]} began",
                  flush=True)
        alive = [got for node, got in zip(nodes, records) if node is not killed]
        served = [read_summaries(path) for path in also]
        for round_index in sorted(set.intersection(*({r["round"] for r in got} for got in alive + served)) - shown):
            rows = by_round(records, round_index)
            agree = hashes_agree(rows + by_round(served, round_index), len(alive) + len(served))
            print(f"[{setting.label}] round {round_index}: round {mean(r['round_seconds'] for r in rows):.1f} s, "
                  f"comm {mean(r['comm_seconds'] for r in rows):.1f} s, "
                  f"{'same params everywhere' if agree else 'PARAMS DIFFER OR NOT APPLIED'}",
                  flush=True)
            shown.add(round_index)
        codes = [0 if node is killed and node.process.poll() is not None else node.process.poll() for node in nodes]
        for node, code, got in zip(nodes, codes, records):
            if code not in (None, 0):
                raise NodeFailed(f"node {node.name} exited with code {code} after {len(got)} of {rounds} rounds: "
                                 f"{last_line(node.log_path)} (log: {node.log_path})")
        if all(code == 0 for code in codes):
            return records
        if time.monotonic() > deadline:
            raise TimeoutError(f"{setting.label}: {len(shown)} of {rounds} rounds in {timeout:.0f} s")
        time.sleep(POLL)


def by_round(records: list[list[dict]], round_index: int) -> list[dict]:
    """The records of ``round_index``, one per node that has one."""
    return [r for got in records for r in got if r["round"] == round_index]


def last_line(path: Path) -> str:
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()] if path.exists() else []
    return lines[-1].strip()[:300] if lines else "(no output)"


def mean(values: object) -> float:
    values = list(values)  # type: ignore[call-overload]
    return statistics.mean(values) if values else 0.0


def hashes_agree(rows: list[dict], hosts: int) -> bool:
    """Every node applied the round, in one group of all hosts that hold the same parameters after it (or,
    overlapped, landed nothing yet: its first round, which applies nothing); but for nodes that sat the round out
    (their step outlasts it: ``sat_out``) or have no record of it (sitting out a longer step, then catching up):
    those that applied it are one group."""
    def landed_nothing(r: dict) -> bool:
        return not r["applied"] and r["peers"] == 1 and r["bytes_sent"] + r["bytes_received"] == 0

    if len(rows) == hosts and all(map(landed_nothing, rows)):
        return len({r["params_digest"] for r in rows}) == 1
    applied = [r for r in rows if r["applied"]]
    return (bool(applied) and all(r["peers"] == len(applied) for r in applied)
            and all(r.get("sat_out") for r in rows if not r["applied"])
            and len({r["params_digest"] for r in applied}) == 1)


def appliers_agree(rows: list[dict]) -> bool:
    """The nodes that applied the round did so in one group and hold one hash after it (however many others
    missed it: a node late for the round applies nothing and catches up)."""
    applied = [r for r in rows if r["applied"]]
    return all(r["peers"] == len(applied) for r in applied) and len({r["params_digest"] for r in applied}) <= 1


def transfer_seconds(rows: list[dict], rates: list[float]) -> float:
    """The slowest host's time to move its larger direction (links are full duplex) at its cap."""
    return max(max(r["bytes_sent"], r["bytes_received"]) * 8 / (rate * 1e6) for r, rate in zip(rows, rates))


def summarise(setting: Setting, everyone: list[list[dict]], params: int
              ) -> tuple[list[tuple], list[tuple], list[tuple], dict]:
    """Per-round table rows, per-host rows, per-hub rows and the setting's JSON row (means over rounds 1.., or all
    if there is one). ``everyone``: the hosts' records, then the hubs'; the means are the hosts', whether the
    params agree is everyone's."""
    hosts = len(setting.rates)
    records, hubs = everyone[:hosts], everyone[hosts:]
    per_round = [by_round(records, i) for i in sorted({r["round"] for got in records for r in got})]
    agree = {}  # round -> (hashes equal, appliers agree), over the hosts and the hubs
    for rows in per_round:
        everyones = by_round(everyone, rows[0]["round"])
        agree[rows[0]["round"]] = (hashes_agree(everyones, len(everyone)), appliers_agree(everyones))
    table = []
    for rows in per_round:
        table.append((rows[0]["round"], human_bytes(mean(r["bytes_sent"] + r["bytes_received"] for r in rows)),
                      f"{mean(r['comm_seconds'] for r in rows):.2f}", f"{mean(r['round_seconds'] for r in rows):.2f}",
                      f"{mean(r['inner_seconds'] for r in rows):.2f}",
                      f"{mean(r['compute_utilisation'] for r in rows):.2f}",
                      f"{transfer_seconds(rows, setting.rates):.2f}", contributors(rows, hosts),
                      "yes" if agree[rows[0]["round"]][0] else "NO", "yes" if agree[rows[0]["round"]][1] else "NO"))
    measured = per_round[1:] or per_round
    flat = [r for rows in measured for r in rows]
    uniform = len(set(setting.rates)) == 1
    row = {
        "algorithm": setting.algorithm, "rate_mbit": setting.rates[0] if uniform else setting.rates,
        "hosts": hosts, "params": params, "rounds": len(measured),
        "bytes_per_round": round(mean(r["bytes_sent"] + r["bytes_received"] for r in flat)),
        "comm_seconds": round(mean(r["comm_seconds"] for r in flat), 3),
        "round_seconds": round(mean(r["round_seconds"] for r in flat), 3),
        "inner_seconds": round(mean(r["inner_seconds"] for r in flat), 3),
        "utilisation": round(mean(r["compute_utilisation"] for r in flat), 3),
        "transfer_seconds": round(mean(transfer_seconds(rows, setting.rates) for rows in measured), 3),
        "hashes_equal": all(equal for equal, _ in agree.values()),
        "appliers_agree": all(appliers for _, appliers in agree.values()),
    }
    table.append(("mean 1..", human_bytes(row["bytes_per_round"]), f"{row['comm_seconds']:.2f}",
                  f"{row['round_seconds']:.2f}", f"{row['inner_seconds']:.2f}", f"{row['utilisation']:.2f}",
                  f"{row['transfer_seconds']:.2f}", "", "yes" if row["hashes_equal"] else "NO",
                  "yes" if row["appliers_agree"] else "NO"))
    # Medians over rounds 1 .. R-2 of every node: the last round also evaluates and writes the exit checkpoint.
    middle = [r for rows in (per_round[1:-1] or measured) for r in rows]
    medians = {key: round(statistics.median(r[key] for r in middle), 3)
               for key in ("comm_seconds", "round_seconds", "inner_seconds", "compute_utilisation")}
    row["median_utilisation"] = medians["compute_utilisation"]
    row["median_round_minus_inner"] = round(statistics.median(r["round_seconds"] - r["inner_seconds"]
                                                              for r in middle), 3)
    table.append(("median 1..R-2", "", f"{medians['comm_seconds']:.2f}", f"{medians['round_seconds']:.2f}",
                  f"{medians['inner_seconds']:.2f}", f"{medians['compute_utilisation']:.2f}", "", "", "", ""))
    if setting.nat or any(f != 1 for f in setting.slow):
        row["nat"], row["slow"] = setting.nat, [setting.slowdown(i) for i in range(hosts)]
    host_table, row["per_host"] = host_summary(setting, records)
    hub_table, row["per_hub"] = hub_summary(hubs, setting.hub_names)
    return table, host_table, hub_table, row


def hub_summary(hubs: list[list[dict]], names: list[str]) -> tuple[list[tuple], list[dict]]:
    """A row per hub: the rounds it applied, and what its machine's link carried for them a round (sent +
    received: the cost of helping, on the bootstrap's machine), median over rounds 1 .. R-2."""
    table, details = [], []
    for name, got in zip(names, hubs):
        middle = middle_rounds(got) if got else []
        traffic = statistics.median(r["bytes_sent"] + r["bytes_received"] for r in middle) if middle else 0
        timed = statistics.median(r["round_seconds"] for r in middle) if middle else 0.0
        applied = sum(bool(r["applied"]) for r in got)
        details.append({"hub": name, "rounds": len(got), "rounds_applied": applied,
                        "median_bytes_per_round": round(traffic), "median_round_seconds": round(timed, 3)})
        table.append((name, f"{applied}/{len(got)}", human_bytes(traffic), f"{timed:.2f}"))
    return table, details


def worked(record: dict) -> bool:
    """The node's own work is in the aggregate it applied this round."""
    return bool(record["applied"]) and record.get("contributed_tokens", 0) > 0


def contributors(rows: list[dict], hosts: int) -> str:
    """How many hosts' work the round's applied aggregate holds ("?" for records without contributed_tokens)."""
    if any("contributed_tokens" not in r for r in rows):
        return "?"
    return f"{sum(map(worked, rows))}/{hosts}"


def spans(rounds: Sequence[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8"."""
    parts: list[list[int]] = []
    for r in sorted(rounds):
        if parts and r == parts[-1][1] + 1:
            parts[-1][1] = r
        else:
            parts.append([r, r])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in parts) or "none"


def trained_work(got: list[dict], last_round: int) -> tuple[int, int, int]:
    """Of a node's rounds that trained (``tokens`` > 0): how many, how many of them had their work applied (in that
    round's aggregate, or carried into a later applied one: a step sat out for, a round it was late for), and how
    many trained after ``last_round``, the last round any other host applied (the run had ended for the others)."""
    trained, applied, pending = 0, 0, 0
    for r in sorted(got, key=lambda r: r["round"]):
        if r.get("tokens", 0) > 0:
            trained, pending = trained + 1, pending + 1
        if worked(r):
            applied, pending = applied + pending, 0
    after = sum(1 for r in got if r.get("tokens", 0) > 0 and r["round"] > last_round)
    return trained, applied, after


def host_summary(setting: Setting, records: list[list[dict]]) -> tuple[list[tuple], list[dict]]:
    """A row per host over all its rounds: how others reach it, the tokens it trained and how many of them ended
    up in aggregates that were applied (``contributed_tokens`` of its applied rounds), and the rounds its work
    was applied in. Records without ``reachability`` or ``contributed_tokens`` (an older node) show "?"."""
    hosts = len(records)
    table, details = [], []
    for i, got in enumerate(records):
        natted = i >= hosts - setting.nat
        seen = [r["reachability"] for r in got if r.get("reachability")]
        reachability = list(dict.fromkeys(seen))  # distinct, in the order they appeared
        known = bool(got) and all("contributed_tokens" in r for r in got)
        work = [r["round"] for r in got if worked(r)]
        tokens = sum(r.get("tokens", 0) for r in got)
        contributed = sum(r.get("contributed_tokens", 0) for r in got if r["applied"])
        others_last = max((r["round"] for j, other in enumerate(records) if j != i for r in other if r["applied"]),
                          default=-1)
        trained, trained_applied, trained_after = trained_work(got, others_last)
        timed = [r["round_seconds"] for r in middle_rounds(got) if "round_seconds" in r]
        median_round = statistics.median(timed) if timed else 0.0
        detail = {
            "host": i, "natted": natted, "rate_mbit": setting.rates[i], "slow": setting.slowdown(i),
            "reachability": seen[-1] if seen else None, "reachabilities": reachability,
            "rounds": len(got), "rounds_applied": sum(bool(r["applied"]) for r in got),
            "sat_out_rounds": [r["round"] for r in got if r.get("sat_out")],
            "tokens": tokens, "contributed_tokens": contributed if known else None,
            "work_applied_rounds": work if known else None,
            "work_applied_fraction": round(len(work) / len(got), 3) if known and got else None,
            "token_fraction": round(contributed / tokens, 3) if known and tokens else None,
            "median_round_seconds": round(median_round, 3), "rounds_trained": trained,
            "trained_work_applied": trained_applied if known else None, "trained_after_the_others": trained_after,
        }
        details.append(detail)
        table.append((f"h{i}", "NAT" if natted else "public", f"{setting.rates[i]:g}", f"{setting.slowdown(i):g}",
                      "/".join(reachability) or "?", f"{detail['rounds_applied']}/{len(got)}",
                      f"{tokens:,}", f"{contributed:,}" if known else "?",
                      f"{detail['token_fraction']:.2f}" if detail["token_fraction"] is not None else "?",
                      f"{len(work)}/{len(got)}" if known else "?", spans(work) if known else "?",
                      f"{median_round:.2f}",
                      (f"{trained_applied}/{trained}" + (f" ({trained_after} after the others)" if trained_after
                                                         else "")) if known else "?"))
    return table, details


def middle_rounds(got: list[dict]) -> list[dict]:
    """A node's records of rounds 1 .. R-2 (round 0 includes start-up, the last evaluates and writes the exit
    checkpoint), or all of them where there are fewer."""
    last = max(r["round"] for r in got)
    return [r for r in got if 0 < r["round"] < last] or got


def run_id(config_path: str, overrides: list[str]) -> str:
    return load_config(config_path, overrides).run_id


def count_params(config_path: str, overrides: list[str]) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in Transformer(load_config(config_path, overrides).model, seed=0).parameters())


def stop_on_sigterm() -> None:
    """SIGTERM ends the run as Ctrl-C does, so that everything made is removed."""
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=3, help="hosts (nodes), each in its own namespace")
    parser.add_argument("--rate", nargs="+", default=["100"], metavar="MBIT",
                        help="link caps, one setting each: 100 (every host), or 1000,20 (host 0, then the rest)")
    parser.add_argument("--rounds", type=int, default=5, help="outer rounds per setting")
    parser.add_argument("--algorithm", nargs="+", default=["sparseloco"], choices=["sparseloco", "diloco"])
    parser.add_argument("--config", default=str(TINY_CONFIG), help="run config [configs/tiny.yaml]")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for every node (repeatable)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a setting may take at most")
    parser.add_argument("--workdir", type=Path, help="where logs go [a temporary folder]")
    parser.add_argument("--json", action="store_true", help="print the settings' rows as one JSON list")
    parser.add_argument("--nat", type=int, default=0, metavar="N",
                        help="the last N hosts sit each behind a masquerading router of its own (needs iptables or "
                             "nft)")
    parser.add_argument("--slow", type=float, nargs="+", default=[], metavar="FACTOR",
                        help="per host: its inner steps take FACTOR times their compute time (host i gets the i-th "
                             "factor, later hosts 1)")
    parser.add_argument("--hold", type=float, nargs="+", default=[], metavar="SECONDS",
                        help="per host: it is held SECONDS before each inner step, outside its compute (host i gets "
                             "the i-th, later hosts 0; not with --slow on the same host)")
    parser.add_argument("--reachability", nargs="+", default=[], metavar="MODE",
                        choices=["auto", "public", "relayed", "client"],
                        help="per host: pass --reachability MODE to its node (later hosts: the node's default)")
    parser.add_argument("--baseline", action="store_true",
                        help="first run each setting with --baseline-hosts hosts, none slowed, held or NATed, and "
                             "print h0's median round against theirs")
    parser.add_argument("--baseline-hosts", type=int, default=2, metavar="N", help="hosts of the baseline [2]")
    parser.add_argument("--hubs", type=int, default=0, metavar="N",
                        help="run N hubs (`p2ploco node start --role hub`: they train nothing, coordinate and "
                             "reduce) on the bootstrap's machine, public and uncapped; with --nat equal to --hosts "
                             "every trainer is behind a NAT and the bootstrap's machine is the only public one [0]")
    parser.add_argument("--bootstrap-hub", action=argparse.BooleanOptionalAction,
                        help="the bootstrap peer hosts a hub (`p2ploco dht`'s default), or not (its --no-hub) [on "
                             "when every host is NATed (--nat equal to --hosts): the bootstrap's machine is then the "
                             "only public one; off otherwise]")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run each setting (after its baseline, with --baseline) N times, and compare h0's median "
                             "round over all of them with the baselines' over all of theirs [1]")
    parser.add_argument("--subnet", default=SUBNET, metavar="A.B.C",
                        help=f"the bridge's /24 [{SUBNET}]; libp2p's AutoNAT, relay addresses and hole punching "
                             f"ignore private addresses, so a public-looking one (e.g. 7.77.0: the namespaces reach "
                             f"nothing outside) shows what they do on the Internet")
    parser.add_argument("--kill-hub", type=int, metavar="ROUND",
                        help="SIGKILL the last hub (its daemon too) once every other node has finished round ROUND - 1 "
                             "[never]")
    parser.add_argument("--bootstrap-config", action="store_true",
                        help="give the bootstrap's hub the run's config (`p2ploco dht --config`) [off: the bootstrap "
                             "is started with addresses only, and fetches the config through its own daemon]")
    parser.add_argument("--kill-bootstrap-hub", type=int, metavar="ROUND",
                        help="SIGKILL the bootstrap's hub process (its daemon too; the bootstrap starts it again) "
                             "once every node has finished round ROUND - 1 [never]")
    parser.add_argument("--nat-inbound", default="reject", choices=NAT_INBOUND,
                        help="what the NAT routers do with a connection dialled at their own address: refuse it "
                             "(a reset, the kernel's answer) or drop it unanswered (a 'stealth' router, through which "
                             "a TCP hole punch can pass) [reject]")
    args = parser.parse_args()
    if not re.fullmatch(r"(\d{1,3})\.(\d{1,3})\.(\d{1,3})", args.subnet) or args.subnet.startswith(LAN_SUBNET + "."):
        raise SystemExit(f"error: --subnet takes the first three numbers of a /24 outside {LAN_SUBNET}.0.0/16")
    if not 2 <= args.hosts <= 200 or args.rounds < 1 or args.repeat < 1:
        raise SystemExit("error: --hosts must be in [2, 200], and --rounds and --repeat at least 1")
    if not 2 <= args.baseline_hosts <= 200 or not 0 <= args.hubs <= 8:
        raise SystemExit("error: --baseline-hosts must be in [2, 200] and --hubs in [0, 8]")
    bootstrap_hub = args.nat == args.hosts if args.bootstrap_hub is None else args.bootstrap_hub
    if args.kill_hub is not None and (args.hubs + bootstrap_hub < 2 or args.hubs < 1
                                      or not 1 <= args.kill_hub < args.rounds):
        raise SystemExit("error: --kill-hub ROUND needs two hubs or more, one of them of --hubs (it is killed), and "
                         "1 <= ROUND < --rounds")
    if args.kill_bootstrap_hub is not None and (not bootstrap_hub or args.kill_hub is not None
                                                or not 1 <= args.kill_bootstrap_hub < args.rounds):
        raise SystemExit("error: --kill-bootstrap-hub ROUND needs the bootstrap's hub, no --kill-hub, and "
                         "1 <= ROUND < --rounds")
    if not 0 <= args.nat <= args.hosts:
        raise SystemExit("error: --nat must be in [0, --hosts]")
    if len(args.reachability) > args.hosts:
        raise SystemExit("error: --reachability takes at most one mode per host")
    try:
        slow = parse_slow(args.slow, args.hosts)
        hold = parse_hold(args.hold, slow)
        settings = [Setting(a, text, parse_rates(text, args.hosts), args.nat, slow, hold, args.reachability,
                            args.subnet, args.nat_inbound, args.hubs, args.kill_hub, bootstrap_hub,
                            args.bootstrap_config, args.kill_bootstrap_hub)
                    for a in args.algorithm for text in args.rate]
        params = count_params(args.config, args.overrides)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    try:
        check_namespaces(nat=args.nat > 0)
    except NoNamespaces as e:
        print(f"wan.py: cannot emulate a WAN here: {e}; nothing measured")
        return 0
    stop_on_sigterm()
    stale = remove_stale_namespaces()
    if stale:
        print(f"removed {len(stale)} namespace(s) left by an earlier run that was killed", flush=True)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="p2ploco-wan-"))
    print(f"wan: {args.hosts} hosts, {params / 1e6:.1f}M parameters ({Path(args.config).name}"
          f"{' ' + ' '.join(args.overrides) if args.overrides else ''}), {args.rounds} rounds per setting", flush=True)
    rows, failed = [], []

    def run(setting: Setting, where: Path, label: str) -> list[list[dict]] | None:
        """The setting's records, or None (said, and counted as failed) if it failed."""
        where.mkdir(parents=True, exist_ok=True)
        try:
            return run_setting(setting, args.config, args.overrides, args.rounds, where, args.timeout)
        except (NodeFailed, TimeoutError, SwarmError, subprocess.CalledProcessError) as e:
            print(f"[{label}] failed: {e}", flush=True)
            failed.append(label)
            return None

    for setting in settings:
        # Baseline and setting alternate, so that what else the machine does weighs on both alike; the medians pool
        # every run's rounds (one run's median round moved by 0.4x from one run to the next on 2 cores).
        baseline_rounds, h0_rounds = [], []
        for attempt in range(args.repeat):
            name = f"{setting.algorithm}-{setting.rate_text.replace(',', '+')}" + (f"-{attempt}" if attempt else "")
            if args.baseline:
                alone = Setting(setting.algorithm, setting.rate_text,
                                parse_rates(setting.rate_text, args.baseline_hosts), subnet=args.subnet)
                if (records := run(alone, workdir / f"baseline-{name}", f"baseline {setting.label}")) is not None:
                    baseline_rounds += [r["round_seconds"] for got in records for r in middle_rounds(got)]
            if (records := run(setting, workdir / name, setting.label)) is None:
                continue
            h0_rounds += [r["round_seconds"] for r in middle_rounds(records[0])]
            table, host_table, hub_table, row = summarise(setting, records, params)
            if baseline_rounds:
                baseline, h0 = statistics.median(baseline_rounds), statistics.median(h0_rounds)
                row.update(baseline_median_round_seconds=round(baseline, 3), h0_vs_baseline=round(h0 / baseline, 3),
                           runs_compared=attempt + 1)
            rows.append(row)
            if not args.json:
                print(f"\n{setting.label}, {args.hosts} hosts, {params / 1e6:.1f}M parameters "
                      f"(transfer s: the slowest host's larger direction at its cap; work from: hosts whose work the "
                      f"applied aggregate holds; hashes equal: every host applied the round in one group, or sat it "
                      f"out; appliers agree: those that applied it did, with one hash)")
                print(format_table(("round", "bytes/node", "comm s", "round s", "inner s", "utilisation",
                                    "transfer s", "work from", "hashes equal", "appliers agree"), table))
                print("\nper host (applied: rounds the node applied; in aggregates: tokens of its applied work; "
                      "share: of the tokens it trained; median round: rounds 1..R-2; trained work applied: rounds it "
                      "trained in whose work reached an applied aggregate, then or carried later)")
                print(format_table(("host", "link", "Mbit/s", "slow", "reachability", "applied", "tokens trained",
                                    "in aggregates", "share", "work applied", "in rounds", "median round s",
                                    "trained work applied"), host_table))
                if hub_table:
                    print("\nhubs (on the bootstrap's machine, uncapped; bytes: sent + received a round, median of "
                          "rounds 1..R-2)")
                    print(format_table(("hub", "applied", "bytes/round", "median round s"), hub_table))
                if baseline_rounds:
                    print(f"h0's median round {h0:.2f} s against {baseline:.2f} s of {args.baseline_hosts} hosts none "
                          f"slowed, held or NATed (rounds 1..R-2 of {attempt + 1} run(s) each, alternating): "
                          f"{row['h0_vs_baseline']:.2f}x")
                print()
    if args.json:
        print(json.dumps(rows))
    if failed:
        print(f"error: {len(failed)} setting(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("wan.py: interrupted; everything it made is removed", file=sys.stderr)
        sys.exit(130)
