"""What every subcommand of ``p2ploco`` shares: errors as one line, the signals that stop it, its logging, the
options that place a peer in a swarm."""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

import click

from p2ploco.errors import ConfigError, P2PLocoError, ProtocolError
from p2ploco.swarm import DEFAULT_HOST_MADDRS


def reports_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """Turn P2PLocoError into ``error: message`` and exit code 2 (bad input) or 1 (swarm trouble). A
    ProtocolError is handled where the peer it is about is talked to; one that gets this far is shown the same
    way, as swarm trouble, rather than as a traceback."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except (P2PLocoError, ProtocolError) as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2 if isinstance(e, ConfigError) else 1)

    return wrapper


def interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def stop_gracefully(stop: Callable[[], str]) -> None:
    """The first SIGINT or SIGTERM calls ``stop`` (leave cleanly, exit 0: ``Node.stop``), and prints what it says
    happens next; a second one stops at once."""
    def handler(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGINT, interrupt)
        signal.signal(signal.SIGTERM, interrupt)
        click.echo(f"{signal.Signals(signum).name}: {stop()}", err=True)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, handler)


def setup_logging() -> None:
    """Warnings and errors only, unless P2PLOCO_LOG_LEVEL says otherwise (e.g. INFO, to see every peer lookup)."""
    level = os.environ.get("P2PLOCO_LOG_LEVEL", "WARNING").upper()
    logging.basicConfig(level=level if level in logging.getLevelNamesMapping() else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")


swarm_options = [
    click.option("--host-maddrs", multiple=True, default=DEFAULT_HOST_MADDRS, show_default=True,
                 help="Multiaddr to listen on (repeatable); use /ip4/0.0.0.0/tcp/PORT on a public machine."),
    click.option("--announce-maddrs", multiple=True,
                 help="Multiaddr other peers should dial (repeatable), e.g. your public IP and port."),
    click.option("--identity", type=click.Path(dir_okay=False),
                 help="Private key file: a stable peer id across restarts (created if missing)."),
]


def with_swarm_options(command: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(swarm_options):
        command = option(command)
    return command
