"""``p2ploco dht``: a bootstrap DHT peer, and by default a hub for the run trained through it."""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

import click

from p2ploco.cli.command import reports_errors, with_swarm_options
from p2ploco.errors import ConfigError


@click.command()
@click.option("--initial-peers", multiple=True, help="Join an existing DHT through these multiaddrs (repeatable).")
@with_swarm_options
@click.option("--name", default="", help="Name shown by `p2ploco peers` [derived from the peer id].")
@click.option("--no-hub", is_flag=True,
              help="Serve the DHT only. By default this peer also hosts a hub: a peer that trains nothing and "
                   "coordinates and reduces the run's rounds, so that trainers behind NAT train together.")
@click.option("--run-id", help="The run the hub serves [the config's, with --config; else the one run trained in this "
                                "swarm, once there is one].")
@click.option("--config", "config_path", type=click.Path(dir_okay=False),
              help="The run's config: the hub starts at once and serves it to joiners, so that trainers that are all "
                   "behind NAT can join with one address [fetched from a trainer that can be dialled].")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="With --config: override a key of it, as `node start --set` does (repeatable).")
@click.option("--hub-port", type=click.IntRange(0, 65535),
              help="TCP port the hub listens on [the bootstrap's port + 1; any free one if that is 0].")
@click.option("--hub-max-mbit", type=click.FloatRange(min=0), default=0.0,
              help="The most the hub sends, in Mbit/s, to all peers together; its record states it, so that "
                   "transfer deadlines allow for it [0: no cap].")
@click.option("--hub-log-dir", type=click.Path(file_okay=False), default="runs/hub", show_default=True,
              help="Where the hub's log and metrics go.")
@reports_errors
def dht(initial_peers: tuple[str, ...], host_maddrs: tuple[str, ...], announce_maddrs: tuple[str, ...],
        identity: str | None, name: str, no_hub: bool, run_id: str | None, config_path: str | None,
        overrides: tuple[str, ...], hub_port: int | None, hub_max_mbit: float, hub_log_dir: str) -> None:
    """A bootstrap DHT peer, and by default a hub for the run trained through it: prints the addresses nodes join
    through and stays up until stopped."""
    from p2ploco.hosted_hub import HostedHub, HubSettings
    from p2ploco.swarm.bootstrap import start_bootstrap, stop_bootstrap
    from p2ploco.swarm.dht import check_addresses
    from p2ploco.swarm.loop import EventLoopThread

    check_addresses(initial_peers, host_maddrs, announce_maddrs)

    run_id = _hub_run_id(no_hub, run_id, config_path, overrides, hub_port, hub_max_mbit)
    port = _hub_port(no_hub, host_maddrs, hub_port)
    loop = EventLoopThread()
    hub: HostedHub | None = None
    try:
        node, addresses = loop.run(start_bootstrap(initial_peers, host_maddrs, announce_maddrs, identity, name))
        click.echo(f"bootstrap peer {node.peer_id} is up. Nodes join with --initial-peers and one of:")
        for address in addresses:
            click.echo(f"  {address}")
        sys.stdout.flush()
        stopped = threading.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, lambda *_: stopped.set())
        if not no_hub:
            settings = HubSettings(run_id, config_path, overrides, port, host_maddrs, announce_maddrs, identity,
                                   Path(hub_log_dir), hub_max_mbit)
            hub = HostedHub(settings, loop, node, addresses[0], click.echo)
            hub.start()
        stopped.wait()
        click.echo("bootstrap peer stopping")
        if hub is not None:
            hub.stop()  # it leaves its round while the bootstrap still serves the DHT
            hub = None
        trouble = stop_bootstrap(loop, node)
        if trouble is not None:
            click.echo(trouble, err=True)
    finally:
        if hub is not None:  # the start failed after it began: its child is reaped all the same
            hub.stop()
        loop.stop()


def _hub_run_id(no_hub: bool, run_id: str | None, config_path: str | None, overrides: tuple[str, ...],
                hub_port: int | None, hub_max_mbit: float) -> str | None:
    """The run the hub serves, as far as the options name it (``--run-id``, or ``--config``'s with ``--set`` on top);
    ConfigError, in one line, for hub options with ``--no-hub`` or a run id a hub does not serve."""
    from p2ploco.hosted_hub import PLAIN_NAME

    given = [flag for flag, value in (("--run-id", run_id), ("--config", config_path), ("--set", overrides or None),
                                      ("--hub-port", hub_port), ("--hub-max-mbit", hub_max_mbit or None))
             if value is not None]
    if no_hub and given:
        raise ConfigError(f"{', '.join(given)} set the hub up; drop them, or drop --no-hub")
    if overrides and config_path is None:
        raise ConfigError("--set goes with --config (a fetched config is the run's own)")
    if config_path is not None:  # checked here, in one line, before anything starts
        from p2ploco.config import load_config
        run_id = load_config(config_path, list(overrides) + ([f"run_id={run_id}"] if run_id else [])).run_id
    if run_id is not None and not PLAIN_NAME.fullmatch(run_id):  # the config's or the one named, never served
        raise ConfigError(f"run id {run_id!r}: a hub serves runs with plain names only (letters, digits, '.', "
                          f"'_', '-'; at most 64); rename the run, or pass --no-hub")
    return run_id


def _hub_port(no_hub: bool, host_maddrs: tuple[str, ...], hub_port: int | None) -> int:
    """The port the hub listens on (``--hub-port``, else the bootstrap's + 1); ConfigError where another process
    holds it."""
    from p2ploco.hosted_hub import hub_maddrs, next_port
    from p2ploco.swarm.dht import taken_listen_address

    port = next_port(host_maddrs) if hub_port is None else hub_port
    if not no_hub and port and (taken := taken_listen_address(hub_maddrs(host_maddrs, port))) is not None:
        raise ConfigError(f"the hub's port {port} ({taken}; the bootstrap's port + 1 unless --hub-port says) is in use "
                          f"by another process; pick another with --hub-port (0: any free one), or pass --no-hub")
    return port
