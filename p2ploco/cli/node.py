"""``p2ploco node start``: join (or start) a swarm and train."""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from p2ploco.cli.command import interrupt, reports_errors, stop_gracefully, with_swarm_options
from p2ploco.errors import ConfigError
from p2ploco.swarm.records import PeerRole

if TYPE_CHECKING:
    from p2ploco.node import Node


@click.group()
def node() -> None:
    """Run a training node."""


@node.command("start")
@click.option("--config", "config_path", type=click.Path(dir_okay=False),
              help="YAML run config that starts a run, e.g. configs/tiny.yaml [the run's own, from its peers: needs "
                   "--initial-peers and --run-id].")
@click.option("--initial-peers", multiple=True,
              help="Multiaddr of a peer of the swarm (repeatable); without it this node starts a new swarm.")
@click.option("--run-document", type=click.Path(dir_okay=False),
              help="Without --config: the run's document as `p2ploco dht` fetched it for its hub, instead of one "
                   "fetched from the run's peers.")
@with_swarm_options
@click.option("--run-id", help="Name of the training run (overrides run_id).")
@click.option("--max-rounds", type=click.IntRange(min=1),
              help="The run's length: stop before round N, counted from the run's start, not from this peer's "
                   "join (sets training.rounds).")
@click.option("--nproc-per-node", type=click.IntRange(min=1),
              help="Train on N local devices as one peer: N processes, data parallel, one per GPU (or N on the CPU); "
                   "the run counts up to training.max_ranks of them (sets training.ranks) [1]. With --set "
                   "training.shard=true they shard the model (FSDP2), for one that does not fit a device.")
@click.option("--log-dir", type=click.Path(file_okay=False), help="Where metrics.jsonl goes [runs/RUN/PEER].")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override any config key, e.g. --set inner.lr=3e-4 (repeatable).")
@click.option("--resume", type=click.Choice(["always", "auto"]), is_flag=False, flag_value="always",
              help="Continue from the checkpoint in --log-dir, then catch up with the swarm; `--resume auto`: continue "
                   "one if there is one, else start afresh (for a supervisor that restarts the node).")
@click.option("--name", default="", help="Name shown by `p2ploco peers` [derived from the peer id].")
@click.option("--role", type=click.Choice([r.value for r in (PeerRole.REPLICA, PeerRole.STAGE, PeerRole.HUB)]),
              default=PeerRole.REPLICA.value, show_default=True,
              help="Train the whole model, one stage of a pipeline group (needs pipeline.stages >= 2), or nothing: "
                   "a hub holds the model and coordinates and reduces rounds for trainers that cannot be dialled "
                   "(a public machine).")
@click.option("--group", "pipeline", help="With --role stage: join this pipeline group [any with a free slot].")
@click.option("--stage", type=click.IntRange(min=0), help="With --role stage: hold this stage [any free one].")
@click.option("--status-port", type=click.IntRange(0, 65535),
              help="Serve the run's status over HTTP on this port (0: any free one), read by `p2ploco peers --from "
                   "HOST:PORT` [off].")
@click.option("--status-host", default="127.0.0.1", show_default=True,
              help="Address the status port listens on; 0.0.0.0 lets other machines read it.")
@click.option("--reachability", type=click.Choice(["auto", "public", "relayed", "client"]),
              help="Whether other peers can dial this one [auto: a peer dials it back at start]; client: it is "
                   "behind a NAT and only dials out (sets swarm.reachability).")
@reports_errors
def node_start(config_path: str | None, initial_peers: tuple[str, ...], run_document: str | None,
               host_maddrs: tuple[str, ...],
               announce_maddrs: tuple[str, ...], identity: str | None, run_id: str | None, max_rounds: int | None,
               nproc_per_node: int | None, log_dir: str | None, overrides: tuple[str, ...], resume: str | None,
               name: str,
               role: str, pipeline: str | None, stage: int | None, status_port: int | None, status_host: str,
               reachability: str | None) -> None:
    """Join (or start) a swarm and train."""
    from p2ploco import faults

    for signum in (signal.SIGINT, signal.SIGTERM):  # until the node can leave cleanly, a signal ends the start-up
        signal.signal(signum, interrupt)
    try:
        faults.hit("start.load", 0)
        _start_node(config_path, initial_peers, run_document, host_maddrs, announce_maddrs, identity, run_id,
                    max_rounds, nproc_per_node, log_dir, overrides, resume, name, role, pipeline, stage,
                    status_port, status_host, reachability)
    except KeyboardInterrupt:  # 128 + SIGINT, as a shell reports an interrupted command
        click.echo("error: stopped during start-up, before the node trained anything: no checkpoint was written; "
                   "start it again in the same way", err=True)
        sys.exit(130)


def _start_node(config_path: str | None, initial_peers: tuple[str, ...], run_document: str | None,
                host_maddrs: tuple[str, ...], announce_maddrs: tuple[str, ...], identity: str | None,
                run_id: str | None, max_rounds: int | None, nproc_per_node: int | None, log_dir: str | None,
                overrides: tuple[str, ...], resume: str | None, name: str, role: str, pipeline: str | None,
                stage: int | None, status_port: int | None, status_host: str, reachability: str | None) -> None:
    from p2ploco.config import load_config
    from p2ploco.node import Node, SwarmOptions
    from p2ploco.roles import RoleOptions
    from p2ploco.swarm.dht import check_addresses

    check_addresses(initial_peers, host_maddrs, announce_maddrs)

    extra = ([f"run_id={run_id}"] if run_id else []) + ([f"training.rounds={max_rounds}"] if max_rounds else []) \
        + ([f"swarm.reachability={reachability}"] if reachability else []) \
        + ([f"training.ranks={nproc_per_node}"] if nproc_per_node else [])
    if config_path is None and not (initial_peers and run_id):
        raise ConfigError("without --config a node trains the config of the run it joins: pass --initial-peers ADDR "
                          "and --run-id RUN, or --config FILE to start a run")
    if config_path is not None and run_document is not None:
        raise ConfigError("--run-document goes without --config: it is the run's config")
    config = load_config(config_path, list(overrides) + extra)
    if len(name) > 64:
        raise ConfigError(f"--name is {len(name)} characters long; use at most 64")
    if status_port is None and click.get_current_context().get_parameter_source("status_host") \
            != click.core.ParameterSource.DEFAULT:
        raise ConfigError("--status-host goes with --status-port PORT (0: any free port)")
    if role != PeerRole.STAGE and (pipeline is not None or stage is not None):
        raise ConfigError("--group and --stage go with --role stage")
    if pipeline is not None and not 0 < len(pipeline) <= 64:
        raise ConfigError("--group must be a name of 1 to 64 characters")
    train_until_stopped(Node(config, SwarmOptions(initial_peers, host_maddrs, announce_maddrs, identity, name),
                             Path(log_dir) if log_dir else None, config_path, resume=resume, out=click.echo,
                             document_path=Path(run_document) if run_document else None,
                             role=RoleOptions(role, pipeline, stage),
                             status_address=None if status_port is None else (status_host, status_port),
                             overrides=list(overrides) + extra))


def train_until_stopped(node: Node) -> None:
    """Run ``node`` until its run is done or a signal stops it (``stop_gracefully``)."""
    stop_gracefully(node.stop)
    node.run()
