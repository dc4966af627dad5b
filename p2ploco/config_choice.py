"""Which config a node that joins a run trains with: its own, or the run's as its peers serve it; refused, in one
line, before anything is built, where that config cannot train on this machine or differs from the run's."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from p2ploco.config import Config, config_of_run, differences, keys_set, split_for_run
from p2ploco.data import TrainingData
from p2ploco.errors import ConfigError, SwarmError
from p2ploco.host_memory import host_bytes_needed, total_memory
from p2ploco.metrics import human_bytes
from p2ploco.model import parameter_count
from p2ploco.peer import Arrival
from p2ploco.swarm.run_config import RunDocument, load_run_document


def config_to_train(arrival: Arrival, own: Config, data: TrainingData | None, device: torch.device, *,
                    overrides: Sequence[str], document_path: Path | None, load_data: Callable[[Config], TrainingData],
                    out: Callable[[str], None]) -> tuple[Config, TrainingData]:
    """The config and data this node trains with: its own (``data`` loaded for it), or, without a config file
    (``data`` None), the run's as its peers serve it (or as ``document_path`` holds it) with this node's own settings
    and ``overrides`` (``config.config_of_run``; ConfigError, before anything is built, if its model would not fit
    this machine's memory on ``device``), its data loaded by ``load_data``; either with a batch split of the run's
    step where the person set none (``config.split_for_run``). ConfigError if they differ from what most of the run
    trains with, naming the first keys that do, unless no peer of the run serves a config (this node starts the
    run). ``out``: where the line saying which config it trains goes."""
    run_id = own.run_id
    mine = "" if data is None else own.swarm_fingerprint(data.fingerprint)
    run = arrival.run_document(mine) if document_path is None else load_run_document(document_path)
    if run is None:
        if data is None:  # swarm trouble (exit 1), not bad input: its peers may have left a moment ago
            raise SwarmError(f"no peer of run '{run_id}' answered with its config through --initial-peers; check "
                             f"--run-id (`p2ploco peers --initial-peers ADDR` lists the runs), or start the run "
                             f"with --config FILE")
        return own, data
    if run.fingerprint == mine:
        return own, data
    from_file = data is not None
    if data is None:
        config = config_of_run(run.document, own, overrides)
        fits_memory(config, device)
        needs_run_data(config, run.document)
        data = load_data(config)
        joining = (f"training the config of run '{run_id}': {run.holders} of its {run.peers} peer(s) (trainers and "
                   f"hubs) hold it")
    else:  # its own, with a split of the run's step where the person set none with --set (the file's is a default)
        try:
            config = split_for_run(own, run.document, keys_set(overrides))
        except ConfigError:
            arrival.tell_conflict(run, mine)
            raise
        i = config.inner
        joining = (f"this node's config is that of run '{run_id}' with the run's {i.batch_size * i.grad_accum:,} "
                   f"sequences a step, split {i.batch_size} x {i.grad_accum} (inner.batch_size x "
                   f"inner.grad_accum; its own {own.inner.batch_size} x {own.inner.grad_accum} make another step)")
    theirs = config.swarm_fingerprint(data.fingerprint)
    if theirs == run.fingerprint:
        out(joining)
        return config, data
    arrival.tell_conflict(run, theirs)
    raise differs(config, data, run, from_file)


def differs(config: Config, data: TrainingData, run: RunDocument, from_file: bool) -> ConfigError:
    """The error of a node whose ``config`` (read ``from_file``, or the run's with its --set) differs from that of
    ``run``: the first keys that do, and the fix."""
    differ = differences(config.run_document(data.fingerprint), run.document)
    shown_keys = "; ".join(differ[:3]) + (f"; and {len(differ) - 3} more" if len(differ) > 3 else "")
    fix = ("drop those --set" if not from_file else
           "join without --config to train the run's config (with --set only for your own settings: README, "
           "\"Joining with one address\"), or pick another --run-id")
    return ConfigError(f"this node's config differs from that of run '{config.run_id}', which {run.holders} of its "
                       f"{run.peers} peer(s) (trainers and hubs) hold: {shown_keys}; {fix}")


def fits_memory(config: Config, device: torch.device) -> None:
    """ConfigError, in one line, if the model of ``config`` needs more host memory to train on ``device`` than this
    machine has (``host_memory.host_bytes_needed``): a run's document sets its model's size, and a newcomer takes it
    from peers it does not know."""
    parameters, memory = parameter_count(config.model), total_memory()
    needed = host_bytes_needed(parameters, device.type)
    if needed > memory:
        raise ConfigError(f"run '{config.run_id}' trains a model of {parameters / 1e6:,.1f}M parameters: at least "
                          f"{human_bytes(needed)} of training state in this machine's memory, which holds "
                          f"{human_bytes(memory)}; join a run of a smaller model, or use a machine with more memory")


def needs_run_data(config: Config, document: dict[str, Any]) -> None:
    """ConfigError if the run trains on a prepared corpus or a tokenizer of its own (``document["data"]``) and this
    node was not given its copy: peers never say where they keep their files (the path would be a stranger's
    to read), so a joiner names its own, which the run's digest then checks."""
    kind, _, digest = document["data"].partition(":")
    for key, needed in (("data.prepared", "prepared"), ("data.tokenizer", "tokenizer")):
        if kind == needed and not getattr(config.data, key.split(".")[1]):
            what = "a prepared corpus" if needed == "prepared" else "a tokenizer of its own"
            raise ConfigError(f"run '{config.run_id}' trains on {what} (digest {digest[:16]}); pass --set "
                              f"{key}=PATH, your copy of it (its digest must be the run's)")
