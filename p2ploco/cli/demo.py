"""``p2ploco demo``: a bootstrap peer and nodes training together on loopback, on one machine."""

from __future__ import annotations

import signal
import sys
import tempfile
from pathlib import Path

import click

from p2ploco.cli.command import interrupt, reports_errors
from p2ploco.errors import ConfigError


@click.command()
@click.option("--replicas", type=click.IntRange(0, 16),
              help="Full replicas to start [3; 1 with a pipeline config].")
@click.option("--groups", "pipelines", type=click.IntRange(0, 8),
              help="Pipeline groups to start, one stage peer per stage [0; 1 with a pipeline config].")
@click.option("--rounds", default=16, show_default=True, type=click.IntRange(min=1), help="Outer rounds to train.")
@click.option("--nproc-per-node", type=click.IntRange(1, 64), default=1, show_default=True,
              help="node0 trains on this many local ranks, data parallel, as one peer (`node start "
                   "--nproc-per-node`); the run counts them all (training.max_ranks).")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False),
              help="Run config [configs/tiny.yaml].")
@click.option("--workdir", type=click.Path(file_okay=False), help="Where logs and metrics go [a new temp folder].")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a config key on every node, e.g. --set data.paths=corpus.txt (repeatable).")
@click.option("--status-port", type=click.IntRange(0, 65535),
              help="node0 serves its status and the live dashboard on this loopback port (0: any free one).")
@reports_errors
def demo(replicas: int | None, pipelines: int | None, rounds: int, nproc_per_node: int, config_path: str | None,
         workdir: str | None, overrides: tuple[str, ...], status_port: int | None) -> None:
    """The main job on one machine: a bootstrap peer and nodes (full replicas, and the stage peers of pipeline
    groups) training together on loopback."""
    from p2ploco.config import load_config
    from p2ploco.demo import run_demo
    from p2ploco.launch import TINY_CONFIG

    config = Path(config_path) if config_path else TINY_CONFIG
    if not config.is_file():
        raise ConfigError(f"{config} not found; pass --config PATH to a run config")
    stages = load_config(config, overrides).pipeline.stages  # a bad key or value ends here, not in every node
    replicas = replicas if replicas is not None else (3 if stages == 1 else 1)
    pipelines = pipelines if pipelines is not None else (0 if stages == 1 else 1)
    if pipelines and stages == 1:
        raise ConfigError(f"--groups needs a config with pipeline.stages >= 2 ({config} has 1), e.g. "
                          f"configs/tiny-pipeline.yaml")
    if replicas + pipelines * stages == 0:
        raise ConfigError("--replicas 0 --groups 0 starts nobody")
    if nproc_per_node > 1 and not replicas:
        raise ConfigError("--nproc-per-node goes to node0, a full replica: pass --replicas 1 or more")
    folder = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="p2ploco-demo-"))
    signal.signal(signal.SIGTERM, interrupt)  # as Ctrl-C: the swarm it started is stopped, none of it left running
    try:
        ok = run_demo(replicas, pipelines, stages, rounds, config, folder, overrides, ranks=nproc_per_node,
                      status_port=status_port)
    except KeyboardInterrupt:
        click.echo("demo interrupted; all nodes stopped")
        sys.exit(130)
    sys.exit(0 if ok else 1)
