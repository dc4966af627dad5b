"""The ``p2ploco`` command: its group, and the subcommands of the modules beside this one."""

from __future__ import annotations

import click

from p2ploco import __version__
from p2ploco.cli.command import setup_logging
from p2ploco.cli.data import data
from p2ploco.cli.demo import demo
from p2ploco.cli.dht import dht
from p2ploco.cli.inspect import dashboard, peers, status
from p2ploco.cli.model import export, sample
from p2ploco.cli.node import node


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="p2ploco")
def main() -> None:
    """Peer-to-peer low-communication LLM pre-training over a hivemind DHT."""
    setup_logging()


for command in (dht, node, data, peers, status, dashboard, export, sample, demo):
    main.add_command(command)
