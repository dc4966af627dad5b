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

    @classmethod
    def read(cls, directories: list[Path]) -> TrainedModel:
        """The model of the checkpoints in ``directories``: one full replica's, or one per stage of a pipeline
        group, all of one round of one run. CheckpointError (one line) if a directory is no checkpoint of a run,
        or they do not make one whole model."""
        configs, params, rounds = [], {}, set()
        for directory in directories:
            if not checkpoint.exists(directory):
                raise CheckpointError(f"{directory} is not a checkpoint (no {checkpoint.POINTER}): pass the "
                                      f"checkpoint folder of a run's --log-dir, e.g. runs/RUN/PEER/checkpoint")
            config_file = directory.parent / "config.json"
            if not config_file.is_file():
                raise CheckpointError(f"no config.json next to {directory}: the checkpoint must sit in the "
                                      f"--log-dir its node wrote")
            try:
                configs.append(load_config(config_file))
            except ConfigError as e:
                raise CheckpointError(f"{config_file}: {e}") from None
            saved = checkpoint.load(directory, None, None)
            rounds.add(saved.round)
            params.update(saved.params)
        config = configs[0]
        runs = sorted({c.run_id for c in configs})
        if len(runs) > 1:
            raise CheckpointError(f"the checkpoints are of different runs ({', '.join(runs)}): pass the stages of "
                                  f"one pipeline group")
        if any(c.model != config.model or c.training.seed != config.training.seed for c in configs):
            raise CheckpointError("the checkpoints are of different models: pass the stages of one pipeline group")
        if len(rounds) > 1:
            raise CheckpointError(f"the checkpoints are of different rounds ({', '.join(map(str, sorted(rounds)))}): "
                                  f"pass the stages' checkpoints of one round")
        with torch.device("meta"):
            expected = [name for name, _ in Transformer(config.model, config.training.seed).named_parameters()]
        missing = [name for name in expected if name not in params]
        if missing:
            layers = sorted({int(name.split(".")[1]) for name in missing if name.startswith("blocks.")})
            what = f"layer(s) {_ranges(layers)}" if layers else ", ".join(missing)
            raise CheckpointError(f"the checkpoints hold no {what} of the model: pass every stage's checkpoint of "
                                  f"the pipeline group")
        return cls(config, {name: params[name] for name in expected}, rounds.pop())

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


def _ranges(numbers: list[int]) -> str:
    """Sorted ``numbers`` as runs: [0, 1, 4, 5, 7] -> "0-1, 4-5, 7"."""
    runs: list[list[int]] = []
    for n in numbers:
        if runs and runs[-1][-1] == n - 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
