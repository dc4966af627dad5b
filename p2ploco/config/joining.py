"""The config of a run a peer joins: the run's document with the peer's own settings on top, its batch split one of
the run's step; and how a peer's document differs from the run's."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from p2ploco.config.loading import built, keys_set, override_settings, settings_of
from p2ploco.config.sections import LOCAL_KEYS, Config, InnerConfig, flattened
from p2ploco.errors import ConfigError


def config_of_run(document: dict[str, Any], own: Config, overrides: Sequence[str] = ()) -> Config:
    """The run's config with ``own``'s local settings (``LOCAL_KEYS``) and ``overrides`` (the ``--set`` given, from
    which ``own`` was built) on top: what a peer that joined without a config file trains with, its batch split one
    of the run's step (``split_for_run``). ``document``: a run document (``Config.run_document``) from another peer,
    so checked as a config file is (ConfigError with one line, naming the run's config as the source)."""
    shared = [setting for key, value in document["settings"].items() if key not in LOCAL_KEYS
              for setting in settings_of(str(key), value, source="the run's config")]
    local = {key: value for key, value in flattened(own.model_dump()).items() if key in LOCAL_KEYS}
    run = built(Config(), shared + [(tuple(key.split(".")), value) for key, value in local.items()])
    return built(split_for_run(run, document, keys_set(overrides)), override_settings(overrides))


def split_for_run(config: Config, document: dict[str, Any], given: Collection[str]) -> Config:
    """``config`` with a batch split of the step of the run whose document is ``document`` (``batch_split``; ``given``:
    the dotted keys the person set), where the steps and sequence length that make a round with it are the run's
    (where they are not, the config differs from the run's in those: named as they are). ConfigError, in one line,
    where no split fits."""
    tokens_a_step = config.inner.steps * config.data.seq_len
    if _tokens_a_step(document["settings"]) != tokens_a_step:
        return config
    if document["round_tokens"] % tokens_a_step:
        raise ConfigError(f"run '{config.run_id}''s config says a round holds {document['round_tokens']:,} tokens: "
                          f"no whole number of sequences of data.seq_len={config.data.seq_len} tokens in each of its "
                          f"inner.steps={config.inner.steps} steps; its peers serve a broken config: join another run")
    size, accumulation = batch_split(document["round_tokens"] // tokens_a_step, config.inner, given, config.run_id)
    return built(config, [(("inner", "batch_size"), size), (("inner", "grad_accum"), accumulation)])


BATCH_KEYS = ("inner.batch_size", "inner.grad_accum")


def batch_split(sequences: int, own: InnerConfig, given: Collection[str], run_id: str) -> tuple[int, int]:
    """``(inner.batch_size, inner.grad_accum)`` of a peer of run ``run_id``, whose steps hold ``sequences`` sequences
    (their product), with ``own``'s values of the keys the person set (``given``: the dotted keys of their ``--set``).
    Both set: as set; one set: the other follows; neither: the largest micro-batch that divides ``sequences`` and
    is no larger than ``own``'s (the default one), and as many of them as make the step (where the run's is
    larger, more accumulation of smaller micro-batches: the same step in less memory). ConfigError, in one line
    naming only what the person set and how to fix it, where that makes no split of ``sequences``."""
    size, accumulation = own.batch_size, own.grad_accum
    set_size, set_accumulation = (key in given for key in BATCH_KEYS)
    if set_size and set_accumulation:
        if size * accumulation != sequences:
            raise ConfigError(f"--set inner.batch_size={size} --set inner.grad_accum={accumulation} make "
                              f"{size * accumulation:,} sequences a step, where run '{run_id}' trains {sequences:,}: "
                              f"set two whose product is {sequences:,}, or drop them (the node then splits the "
                              f"run's step itself)")
        return size, accumulation
    if set_size or set_accumulation:
        key, value, other = (("inner.batch_size", size, "inner.grad_accum") if set_size else
                             ("inner.grad_accum", accumulation, "inner.batch_size"))
        if sequences % value:
            divisors = [d for d in range(1, min(sequences, 64) + 1) if sequences % d == 0]
            listed = ", ".join(map(str, divisors)) + (f", ..., {sequences}" if sequences > 64 else "")
            raise ConfigError(f"--set {key}={value} does not divide the {sequences:,} sequences a step run "
                              f"'{run_id}' trains (inner.batch_size x inner.grad_accum): set {key} to one of "
                              f"{listed} ({other} follows), or drop it")
        return (value, sequences // value) if set_size else (sequences // value, value)
    micro_batch = next(d for d in range(min(size, sequences), 0, -1) if sequences % d == 0)
    return micro_batch, sequences // micro_batch


def differences(mine: dict[str, Any], run: dict[str, Any]) -> list[str]:
    """The keys two run documents (``Config.run_document``) differ in, as ``key: mine (run: theirs)``, sorted; the
    data and protocol entries by what they mean. What a round holds differs by the batch split only where the
    steps and sequences that also make it agree (where they do not, their keys are listed)."""
    keys = sorted(set(mine["settings"]) | set(run["settings"]))
    lines = [f"{key}={mine['settings'].get(key)!r} (run: {run['settings'].get(key)!r})" for key in keys
             if mine["settings"].get(key) != run["settings"].get(key)]
    step = _tokens_a_step(mine["settings"])
    if mine["round_tokens"] != run["round_tokens"] and step == _tokens_a_step(run["settings"]) > 0:
        lines.append(f"inner.batch_size x inner.grad_accum: {mine['round_tokens'] // step:,} sequences a step (run: "
                     f"{run['round_tokens'] / step:,g})")
    if mine["data"] != run["data"]:
        lines.append(f"training data {mine['data'][:32] or 'default'} (run: {run['data'][:32] or 'default'}; "
                     f"data.prepared or data.tokenizer: your copy of the run's)")
    if mine["protocol"] != run["protocol"]:
        lines.append(f"protocol version {mine['protocol']} (run: {run['protocol']}; install the run's p2ploco "
                     f"version)")
    return lines


def _tokens_a_step(settings: dict[str, Any]) -> int:
    """inner.steps x data.seq_len of a run document's settings (another peer's: 0 where either is no positive
    integer)."""
    steps, seq_len = settings.get("inner.steps"), settings.get("data.seq_len")
    return steps * seq_len if all(type(value) is int and value > 0 for value in (steps, seq_len)) else 0

