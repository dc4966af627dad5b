"""``p2ploco``: run a bootstrap peer, a training node, or a local demo swarm.

Errors a person can fix print as one ``error: ...`` line with a non-zero exit code, never as a
traceback.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

# hivemind reads its log level at import: keep its INFO chatter out of a node's progress output.
os.environ.setdefault("HIVEMIND_LOGLEVEL", "WARNING")

import click  # noqa: E402

from p2ploco import __version__  # noqa: E402
from p2ploco.errors import ConfigError, P2PLocoError, ProtocolError, SwarmError  # noqa: E402
from p2ploco.swarm import DEFAULT_HOST_MADDRS  # noqa: E402
from p2ploco.swarm.records import PeerRole  # noqa: E402

if TYPE_CHECKING:
    from p2ploco.node import Node


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


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def stop_gracefully(stop: Callable[[], str]) -> None:
    """The first SIGINT or SIGTERM calls ``stop`` (leave cleanly, exit 0: ``Node.stop``), and prints what it says
    happens next; a second one stops at once."""
    def handler(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGINT, _interrupt)
        signal.signal(signal.SIGTERM, _interrupt)
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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="p2ploco")
def main() -> None:
    """Peer-to-peer low-communication LLM pre-training over a hivemind DHT."""
    setup_logging()


@main.command()
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
    from p2ploco.hosted_hub import PLAIN_NAME, HostedHub, HubSettings, hub_maddrs, next_port
    from p2ploco.swarm.bootstrap import start_bootstrap, stop_bootstrap
    from p2ploco.swarm.dht import check_addresses, taken_listen_address
    from p2ploco.swarm.loop import EventLoopThread

    check_addresses(initial_peers, host_maddrs, announce_maddrs)

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
    port = next_port(host_maddrs) if hub_port is None else hub_port
    if not no_hub and port and (taken := taken_listen_address(hub_maddrs(host_maddrs, port))) is not None:
        raise ConfigError(f"the hub's port {port} ({taken}; the bootstrap's port + 1 unless --hub-port says) is in use "
                          f"by another process; pick another with --hub-port (0: any free one), or pass --no-hub")
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


@main.group()
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
@click.option("--group", "pipeline_group", help="With --role stage: join this pipeline group [any with a free slot].")
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
               role: str, pipeline_group: str | None, stage: int | None, status_port: int | None, status_host: str,
               reachability: str | None) -> None:
    """Join (or start) a swarm and train."""
    from p2ploco import faults

    for signum in (signal.SIGINT, signal.SIGTERM):  # until the node can leave cleanly, a signal ends the start-up
        signal.signal(signum, _interrupt)
    try:
        faults.hit("start.load", 0)
        _start_node(config_path, initial_peers, run_document, host_maddrs, announce_maddrs, identity, run_id,
                    max_rounds, nproc_per_node, log_dir, overrides, resume, name, role, pipeline_group, stage,
                    status_port, status_host, reachability)
    except KeyboardInterrupt:  # 128 + SIGINT, as a shell reports an interrupted command
        click.echo("error: stopped during start-up, before the node trained anything: no checkpoint was written; "
                   "start it again in the same way", err=True)
        sys.exit(130)


def _start_node(config_path: str | None, initial_peers: tuple[str, ...], run_document: str | None,
                host_maddrs: tuple[str, ...], announce_maddrs: tuple[str, ...], identity: str | None,
                run_id: str | None, max_rounds: int | None, nproc_per_node: int | None, log_dir: str | None,
                overrides: tuple[str, ...], resume: str | None, name: str, role: str, pipeline_group: str | None,
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
    if role != PeerRole.STAGE and (pipeline_group is not None or stage is not None):
        raise ConfigError("--group and --stage go with --role stage")
    if pipeline_group is not None and not 0 < len(pipeline_group) <= 64:
        raise ConfigError("--group must be a name of 1 to 64 characters")
    train_until_stopped(Node(config, SwarmOptions(initial_peers, host_maddrs, announce_maddrs, identity, name),
                             Path(log_dir) if log_dir else None, config_path, resume=resume, out=click.echo,
                             document_path=Path(run_document) if run_document else None,
                             role=RoleOptions(role, pipeline_group, stage),
                             status_address=None if status_port is None else (status_host, status_port),
                             overrides=list(overrides) + extra))


def train_until_stopped(node: Node) -> None:
    """Run ``node`` until its run is done or a signal stops it (``stop_gracefully``)."""
    stop_gracefully(node.stop)
    node.run()


@main.group()
def data() -> None:
    """Prepare corpora and tokenizers for training."""


def _progress() -> Any:
    """A progress bar on stderr (bytes done, speed, time left), shown on a terminal only: logs get the summary."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    console = Console(stderr=True)
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                    TimeRemainingColumn(), console=console, disable=not console.is_terminal)


@data.command("prepare")
@click.argument("paths", nargs=-1, required=True)
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="New (or empty) folder for the token shards and manifest.json.")
@click.option("--tokenizer", default="", help="A Hugging Face tokenizer.json [byte-level].")
@click.option("--eval-percent", default=2.0, show_default=True, type=float,
              help="Share held out for the eval loss: of the documents, or of blocks of text when few.")
@click.option("--shard-tokens", default=None, type=click.IntRange(min=1),
              help="Tokens per shard file [134217728: 256 MiB of uint16].")
@reports_errors
def data_prepare(paths: tuple[str, ...], out: str, tokenizer: str, eval_percent: float,
                 shard_tokens: int | None) -> None:
    """Tokenize text files, JSONL files (one "text" per line) and folders of them once, into token shards
    that nodes read through numpy.memmap (--set data.prepared=OUT)."""
    import time

    from p2ploco.data import Split, load_tokenizer, prepare
    from p2ploco.data.prepared import DEFAULT_SHARD_TOKENS
    from p2ploco.metrics import format_table, human_bytes

    chosen = load_tokenizer(tokenizer)
    started = time.perf_counter()
    with _progress() as bar:
        listing = bar.add_task("listing documents", total=None)

        def scanned(split: Any) -> None:
            bar.update(listing, total=split.bytes, completed=split.bytes)
            bar.update(tokenizing, total=split.bytes, visible=True)

        tokenizing = bar.add_task("tokenizing", total=None, visible=False)
        manifest = prepare(paths, Path(out), chosen, eval_percent, shard_tokens or DEFAULT_SHARD_TOKENS, scanned,
                           lambda done: bar.advance(tokenizing, done))
    seconds = time.perf_counter() - started
    text_bytes = manifest.split.bytes
    itemsize = 2 if manifest.dtype == "uint16" else 4
    rows = [
        ("text", f"{human_bytes(text_bytes)} in {manifest.split.documents:,} "
                 f"document{'s' if manifest.split.documents != 1 else ''}"),
        ("tokenizer", f"{chosen.name} ({manifest.tokenizer.vocab_size:,} tokens, {manifest.dtype})"),
        ("split", Split(**manifest.split.model_dump()).describe()),
        ("train", f"{manifest.train.tokens:,} tokens in {len(manifest.train.shards)} shard(s)"),
        ("eval", f"{manifest.eval.tokens:,} tokens in {len(manifest.eval.shards)} shard(s)"),
        ("on disk", human_bytes((manifest.train.tokens + manifest.eval.tokens) * itemsize)),
        ("time", f"{seconds:.2f} s ({text_bytes / 1e6 / max(seconds, 1e-9):.1f} MB/s of text)"),
        ("digest", manifest.digest[:16]),
    ]
    click.echo(format_table(("prepared", str(out)), rows))
    click.echo(f"train on it with: --set data.prepared={out} --set model.vocab_size={manifest.tokenizer.vocab_size}")


@data.command("train-tokenizer")
@click.argument("paths", nargs=-1, required=True)
@click.option("--vocab-size", required=True, type=click.IntRange(min=2), help="Tokens in the vocabulary.")
@click.option("--out", required=True, type=click.Path(dir_okay=False), help="Where the tokenizer.json goes (new).")
@reports_errors
def data_train_tokenizer(paths: tuple[str, ...], vocab_size: int, out: str) -> None:
    """Train a byte-level BPE tokenizer (with <|endoftext|>) on text files, JSONL files or folders."""
    import time

    from p2ploco.data import Sources
    from p2ploco.data.tokenizer import train_bpe_on_sources
    from p2ploco.metrics import format_table, human_bytes

    if Path(out).exists():
        raise ConfigError(f"--out {out} already exists; choose a new file (nothing was written)")
    sources = Sources(paths, origin="PATHS")
    started = time.perf_counter()
    with _progress() as bar:
        reading = bar.add_task("training on", total=sources.file_bytes)
        tokenizer, read = train_bpe_on_sources(
            sources, vocab_size, Path(out), lambda done: bar.update(reading, completed=min(done, sources.file_bytes)))
    seconds = time.perf_counter() - started
    rows = [("text", human_bytes(read)), ("vocabulary", f"{tokenizer.vocab_size:,} tokens"),
            ("end of text", f"id {tokenizer.eot}"), ("time", f"{seconds:.1f} s")]
    click.echo(format_table(("tokenizer", out), rows))
    if tokenizer.vocab_size < vocab_size:
        click.echo(f"note: the vocabulary has {tokenizer.vocab_size:,} tokens, not the {vocab_size:,} asked for: the "
                   f"text offers no more merges; train on more text for a larger one")
    click.echo(f"use it with: --set data.tokenizer={out} --set model.vocab_size={tokenizer.vocab_size}, "
               f"or p2ploco data prepare PATHS... --tokenizer {out} --out DIR")


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


@main.command()
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


@main.command()
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


@main.command()
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


@main.command()
@click.argument("checkpoints", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--out", required=True, type=click.Path(path_type=Path),
              help="Directory to write the exported model to (created if missing; a folder with files in it only "
                   "with --overwrite).")
@click.option("--round", "round_index", type=click.IntRange(min=0),
              help="The round to export [the newest all CHECKPOINTS hold].")
@click.option("--overwrite", is_flag=True, help="Write over the files of a non-empty --out.")
@click.option("--format", "form", type=click.Choice(["hf"]), default="hf", show_default=True,
              help="hf: transformers' LlamaForCausalLM with its tokenizer.")
@click.option("--dtype", type=click.Choice(["bf16", "fp32"]), default="bf16", show_default=True,
              help="Data type of the exported weights.")
@reports_errors
def export(checkpoints: tuple[Path, ...], out: Path, round_index: int | None, overwrite: bool, form: str,
           dtype: str) -> None:
    """Export the model of a run's checkpoint: a full replica's CHECKPOINT folder (runs/RUN/PEER/checkpoint), or
    one per stage of a pipeline group. A folder keeps the checkpoints of its last few rounds; the newest round all
    of them hold is exported, or --round's."""
    import torch

    from p2ploco.export.hf import export as export_hf

    trained = export_hf(list(checkpoints), out, torch.bfloat16 if dtype == "bf16" else torch.float32, round_index,
                        overwrite)
    # a stage stopped a round ahead of the others holds a newer round than the one exported: say why
    passed_over = round_index is None and any(rounds[0] != trained.round for rounds in trained.held.values())
    click.echo(f"exported {trained.config.run_id} at round {trained.round}"
               f"{', the newest round they all hold' if passed_over else ''} from "
               f"{', '.join(map(str, checkpoints))} ({form}, {dtype}) to {out}: load it with "
               f"transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")


@main.command()
@click.argument("checkpoints", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--prompt", default="", help="Text the sample continues [none: from a document's start].")
@click.option("--max-new-tokens", default=100, show_default=True, type=click.IntRange(1, 100_000))
@click.option("--temperature", default=0.8, show_default=True, type=click.FloatRange(min=0.0),
              help="0: the most likely token each time (greedy).")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the draws.")
@reports_errors
def sample(checkpoints: tuple[Path, ...], prompt: str, max_new_tokens: int, temperature: float, seed: int) -> None:
    """Generate text with the model of a run's checkpoint (as ``export`` takes it), with p2ploco's own model."""
    from p2ploco.sample import sample_checkpoints

    click.echo(prompt + sample_checkpoints(list(checkpoints), prompt, max_new_tokens, temperature, seed))


@main.command()
@click.option("--replicas", type=click.IntRange(0, 16),
              help="Full replicas to start [3; 1 with a pipeline config].")
@click.option("--groups", type=click.IntRange(0, 8),
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
def demo(replicas: int | None, groups: int | None, rounds: int, nproc_per_node: int, config_path: str | None,
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
    groups = groups if groups is not None else (0 if stages == 1 else 1)
    if groups and stages == 1:
        raise ConfigError(f"--groups needs a config with pipeline.stages >= 2 ({config} has 1), e.g. "
                          f"configs/tiny-pipeline.yaml")
    if replicas + groups * stages == 0:
        raise ConfigError("--replicas 0 --groups 0 starts nobody")
    if nproc_per_node > 1 and not replicas:
        raise ConfigError("--nproc-per-node goes to node0, a full replica: pass --replicas 1 or more")
    folder = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="p2ploco-demo-"))
    signal.signal(signal.SIGTERM, _interrupt)  # as Ctrl-C: the swarm it started is stopped, none of it left running
    try:
        ok = run_demo(replicas, groups, stages, rounds, config, folder, overrides, ranks=nproc_per_node,
                      status_port=status_port)
    except KeyboardInterrupt:
        click.echo("demo interrupted; all nodes stopped")
        sys.exit(130)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
