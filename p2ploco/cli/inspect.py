"""``p2ploco peers``, ``status`` and ``dashboard``: look at a run, from a node's status port or through the DHT."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import click

from p2ploco.cli.command import reports_errors
from p2ploco.errors import ConfigError, SwarmError

CLIENT_HOST_MADDRS = ("/ip4/127.0.0.1/tcp/0",)  # a client only dials out: nothing needs to reach it
inspect_options = [
    click.option("--initial-peers", multiple=True,
                 help="Look through the DHT: the multiaddr of any peer of the swarm, e.g. its bootstrap peer "
                      "(repeatable)."),
    click.option("--from", "status_from", metavar="HOST:PORT",
                 help="Ask the node serving its status at HOST:PORT (its --status-port): a fraction of a second, "
                      "where the DHT takes seconds."),
    click.option("--run-id", help="The run to look at [the only run in the swarm]."),
    click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table."),
]


def with_inspect_options(command: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(inspect_options):
        command = option(command)
    return command


def look_at_swarm(initial_peers: tuple[str, ...], status_from: str | None, run_id: str | None,
                  show: Callable[[Callable[[], Any]], None]) -> None:
    """Hand ``show`` a function that surveys the run afresh: from the node serving its status at ``status_from``,
    or else from the DHT, joined as a client through ``initial_peers``."""
    choice = "--from HOST:PORT (a node's --status-port, fast) or --initial-peers MULTIADDR (any peer of the swarm)"
    if initial_peers and status_from:
        raise ConfigError(f"give {choice}, not both")
    if not initial_peers and not status_from:
        raise ConfigError(f"say where the swarm is: {choice}")
    if status_from is not None:
        from p2ploco.swarm.status_client import read_status

        def look() -> Any:
            found = read_status(status_from)
            if run_id is not None and found.run_id != run_id:
                raise SwarmError(f"the node at {status_from} trains run '{found.run_id}', not '{run_id}'")
            return found

        try:
            show(look)
        except KeyboardInterrupt:
            pass
        return

    from p2ploco.swarm.dht import check_addresses, start_dht_node
    from p2ploco.swarm.loop import EventLoopThread, finishes_within
    from p2ploco.swarm.survey import find_run, survey

    check_addresses(initial_peers, (), ())
    logging.getLogger("hivemind").setLevel(logging.CRITICAL)  # a client's daemon chatter is noise to its user
    # so is asyncio's note that the daemon exited after the loop closed (seen on a busy machine, after the error)
    logging.getLogger("asyncio").setLevel(logging.ERROR)
    loop = EventLoopThread()
    node = None
    try:
        node, _ = loop.run(start_dht_node(initial_peers, CLIENT_HOST_MADDRS, client_mode=True))
        run = loop.run(find_run(node, run_id))
        show(lambda: loop.run(survey(node, run), 60))
    except KeyboardInterrupt:
        pass
    finally:
        if node is not None:
            loop.run(finishes_within(node.shutdown(), 5), 10)
        loop.stop()


@click.command()
@with_inspect_options
@click.option("--watch", is_flag=True, help="Refresh until Ctrl-C.")
@click.option("--interval", default=2.0, show_default=True, type=click.FloatRange(min=0.2),
              help="Seconds between refreshes with --watch.")
@reports_errors
def peers(initial_peers: tuple[str, ...], status_from: str | None, run_id: str | None, as_json: bool, watch: bool,
          interval: float) -> None:
    """List the live peers of a run: role, state, round, loss, throughput, traffic. A narrow terminal shows the
    columns that fit; --json and piped output always have them all."""
    import json
    import time

    from p2ploco.monitor import peers_rich, peers_text
    from p2ploco.swarm.status_document import peers_json

    def show(look: Callable[[], Any]) -> None:
        rich_terminal = sys.stdout.isatty() and not as_json
        if rich_terminal:
            from rich.console import Console
            from rich.live import Live

            console = Console()
            if watch:
                with Live(peers_rich(look(), console.width), console=console, auto_refresh=False) as live:
                    while True:
                        time.sleep(interval)
                        live.update(peers_rich(look(), console.width), refresh=True)
        while True:
            survey = look()
            if as_json:
                click.echo(json.dumps(peers_json(survey)))
            elif rich_terminal:
                console.print(peers_rich(survey, console.width))
            else:
                click.echo(peers_text(survey) + ("\n" if watch else ""))
            if not watch:
                return
            sys.stdout.flush()
            time.sleep(interval)

    look_at_swarm(initial_peers, status_from, run_id, show)


@click.command()
@with_inspect_options
@reports_errors
def status(initial_peers: tuple[str, ...], status_from: str | None, run_id: str | None, as_json: bool) -> None:
    """The run at a glance: round, peers by role, total throughput, last round's time and bytes, eval trend."""
    import json

    from p2ploco.monitor import status_json, status_text

    def show(look: Callable[[], Any]) -> None:
        survey = look()
        click.echo(json.dumps(status_json(survey)) if as_json else status_text(survey))

    look_at_swarm(initial_peers, status_from, run_id, show)


@click.command()
@click.option("--from", "status_from", required=True, metavar="HOST:PORT",
              help="The --status-port of a node of the run (its own machine serves the same page at /).")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True,
              help="Port to serve the page on (0: any free one).")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to serve it on (0.0.0.0: every interface of this machine).")
@reports_errors
def dashboard(status_from: str, port: int, host: str) -> None:
    """Serve the live dashboard of a node's run on this machine: loss, peers, rounds, traffic, how to join."""
    from p2ploco.dashboard.relay import serve_dashboard

    def say(line: str) -> None:
        click.echo(line)
        sys.stdout.flush()  # the address, at once, to whoever reads this output through a pipe

    try:
        serve_dashboard(status_from, host, port, say)
    except KeyboardInterrupt:
        pass
