"""A trained model as a run left it: the config its nodes ran with and the global parameters of their checkpoints.

A node's --log-dir holds ``config.json`` and ``checkpoint/``. A full replica's checkpoint holds the whole model; a
stage peer's, the layers of its stage: the stages of one pipeline group, of one round, make the whole model
together. ``p2ploco export`` and ``p2ploco sample`` read a run this way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from p2ploco import checkpoint
from p2ploco.build import run_subspace
from p2ploco.config import Config, load_config
from p2ploco.data.load import run_tokenizer
from p2ploco.data.tokenizer import Tokenizer
from p2ploco.errors import CheckpointError, ConfigError
from p2ploco.model import Transformer
from p2ploco.pipeline.subspace import Subspace


@dataclass
class TrainedModel:
    config: Config
    params: dict[str, torch.Tensor]  # the whole model's global parameters, by the names Transformer gives them
    round: int  # the next round its run would train
    held: dict[Path, list[int]]  # the rounds each checkpoint directory read holds, newest first

    @classmethod
    def read(cls, directories: list[Path], round_index: int | None = None) -> TrainedModel:
        """The model of the checkpoints in ``directories``: one full replica's, or one per stage of a pipeline
        group, of round ``round_index`` (None: the newest round they all hold; a group whose stages were stopped
        at once may have exit checkpoints a round apart) of one run. CheckpointError (one line) if a directory is
        no checkpoint of a run, or they do not make one whole model."""
        configs, held = zip(*(_config_and_rounds(directory) for directory in directories), strict=True)
        config = configs[0]
        runs = sorted({c.run_id for c in configs})
        if len(runs) > 1:
            raise CheckpointError(f"the checkpoints are of different runs ({', '.join(runs)}): pass the stages of "
                                  f"one pipeline group")
        if any(c.model != config.model or c.training.seed != config.training.seed for c in configs):
            raise CheckpointError("the checkpoints are of different models: pass the stages of one pipeline group")
        rounds = dict(zip(directories, held, strict=True))
        round_index = _round_in_common(rounds, round_index)
        common = set.intersection(*(set(r) for r in rounds.values()))
        params = _params(directories, round_index, sorted(common - {round_index}, reverse=True))
        with torch.device("meta"):
            expected = [name for name, _ in Transformer(config.model, config.training.seed).named_parameters()]
        missing = [name for name in expected if name not in params]
        if missing:
            raise CheckpointError(f"the checkpoints hold no {_describe(missing)} of the model: pass every stage's "
                                  f"checkpoint of the pipeline group")
        return cls(config, {name: params[name] for name in expected}, round_index, rounds)

    def subspace(self) -> Subspace | None:
        """The run's frozen U and F when its stage boundaries are compressed (the input is E[tok] + F[tok])."""
        return run_subspace(self.config, torch.device("cpu"))

    def model(self) -> Transformer:
        """The whole model with these parameters, on the CPU, in eval mode."""
        subspace = self.subspace()
        model = Transformer(self.config.model, self.config.training.seed,
                            token_table=subspace.table if subspace else None)
        with torch.no_grad():  # by parameter, as a checkpoint names them (a tied head is the embedding)
            for name, parameter in model.named_parameters():
                parameter.copy_(self.params[name])
        return model.eval()

    def tokenizer(self) -> Tokenizer:
        return run_tokenizer(self.config)


def _describe(names: list[str]) -> str:
    """Parameter ``names`` as a person reads them: "layer(s) 0-3" for blocks, else the names."""
    layers = sorted({int(name.split(".")[1]) for name in names if name.startswith("blocks.")})
    return f"layer(s) {_ranges(layers)}" if layers else ", ".join(names)


def _ranges(numbers: list[int]) -> str:
    """Sorted ``numbers`` as runs: [0, 1, 4, 5, 7] -> "0-1, 4-5, 7"."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and runs[-1][-1] == n - 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def _config_and_rounds(directory: Path) -> tuple[Config, list[int]]:
    """The config of the node that wrote the checkpoint ``directory``, and the rounds it holds."""
    if not checkpoint.exists(directory):
        raise CheckpointError(f"{directory} is not a checkpoint (no {checkpoint.POINTER}): pass the "
                              f"checkpoint folder of a run's --log-dir, e.g. runs/RUN/PEER/checkpoint")
    config_file = directory.parent / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"no config.json next to {directory}: the checkpoint must sit in the "
                              f"--log-dir its node wrote")
    try:
        return load_config(config_file), checkpoint.rounds(directory)
    except ConfigError as e:
        raise CheckpointError(f"{config_file}: {e}") from None


def _round_in_common(held: dict[Path, list[int]], round_index: int | None) -> int:
    """``round_index`` if every checkpoint holds it (None: the newest round they all hold)."""
    common = set.intersection(*(set(rounds) for rounds in held.values()))
    if round_index is None:
        if not common:
            listing = "; ".join(f"{d}: {', '.join(map(str, rounds))}" for d, rounds in held.items())
            raise CheckpointError(f"the checkpoints hold no round in common ({listing}): pass the stages' "
                                  f"checkpoints of one pipeline group")
        return max(common)
    if round_index not in common:
        lacking = next(d for d, rounds in held.items() if round_index not in rounds)
        choice = (f"--round {' or '.join(map(str, sorted(common, reverse=True)))}" if common else
                  "the stages' checkpoints of one pipeline group")
        raise CheckpointError(f"{lacking} holds no checkpoint of round {round_index} (it holds "
                              f"{', '.join(map(str, held[lacking]))}): pass {choice}")
    return round_index


def _params(directories: list[Path], round_index: int, others: list[int]) -> dict[str, torch.Tensor]:
    """The params every checkpoint holds of ``round_index``, each held once (``others``: the rounds they also all
    hold, named where a file is corrupt)."""
    params: dict[str, torch.Tensor] = {}
    holders: dict[str, Path] = {}
    for directory in directories:
        try:
            saved = checkpoint.load(directory, None, None, round_index)
        except CheckpointError as e:  # a corrupt file: another round they all hold may be intact
            another = f": pass --round {' or '.join(map(str, others))}" if others else ""
            raise CheckpointError(f"{e}{another}") from None
        if twice := [name for name in saved.params if name in params]:
            raise CheckpointError(f"{holders[twice[0]]} and {directory} both hold {_describe(twice)} of the "
                                  f"model: pass one full replica's checkpoint, or one per stage of a pipeline "
                                  f"group")
        params.update(saved.params)
        holders.update(dict.fromkeys(saved.params, directory))
    return params
