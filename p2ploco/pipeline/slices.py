"""Named parameter slices: the unit of exchange in a round.

With ``pipeline.stages = S`` the parameters fall into S slices ``stage0 .. stage{S-1}``: slice s holds
the blocks of stage s, plus the embedding (stage 0) or the final norm and head (the last stage). A
full replica holds every slice, a stage peer one; in a round each slice is averaged among all of its
holders, so a pipeline group counts as one replica next to the full ones.
"""

from __future__ import annotations

from collections.abc import Sequence

from p2ploco.config import ModelConfig
from p2ploco.model import stage_layers


def slice_name(stage: int) -> str:
    return f"stage{stage}"


def slice_of(param_name: str, config: ModelConfig, stages: int) -> str:
    """The slice a parameter (by its global name) belongs to."""
    if param_name.startswith("embed."):
        return slice_name(0)
    if param_name.startswith(("norm.", "lm_head.")):
        return slice_name(stages - 1)
    layer = int(param_name.split(".")[1])  # blocks.<layer>....
    return slice_name(next(s for s, layers in enumerate(stage_layers(config.n_layer, stages)) if layer in layers))


def group_by_slice(param_names: Sequence[str], config: ModelConfig, stages: int) -> dict[str, list[int]]:
    """Slice name -> positions in ``param_names`` of its parameters, slices in stage order."""
    slices: dict[str, list[int]] = {}
    for position, name in enumerate(param_names):
        slices.setdefault(slice_of(name, config, stages), []).append(position)
    return dict(sorted(slices.items(), key=lambda item: int(item[0].removeprefix("stage"))))
