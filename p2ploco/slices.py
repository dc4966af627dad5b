"""Named parameter slices: the unit of exchange in a round.

With ``pipeline.stages = S`` the parameters fall into S slices ``stage0 .. stage{S-1}``: slice s holds
the blocks of stage s, plus the embedding (stage 0) or the final norm and head (the last stage). A
full replica holds every slice, a stage peer one; in a round each slice is averaged among all of its
holders, so a pipeline group counts as one replica next to the full ones.

Streaming DiLoCo's fragments are slices too: with ``outer.streaming.fragments = P`` the parameters fall
into P slices ``fragment0 .. fragment{P-1}``, fragment p holding the blocks p, p + P, p + 2P, ... (the
strided pattern, which the paper found better than consecutive blocks), the embedding in fragment 0 and
the final norm and head in fragment P - 1. A fragment sync is the all-reduce of one of them; snapshots,
hashes and catch-up work per slice as for stages.
"""

from __future__ import annotations

from collections.abc import Sequence

from p2ploco.config import ModelConfig
from p2ploco.model import stage_layers


def slice_name(stage: int) -> str:
    return f"stage{stage}"


def fragment_name(fragment: int) -> str:
    return f"fragment{fragment}"


def fragment_of(param_name: str, fragments: int) -> str:
    """The fragment a parameter (by its global name) belongs to."""
    if param_name.startswith("embed."):
        return fragment_name(0)
    if param_name.startswith(("norm.", "lm_head.")):
        return fragment_name(fragments - 1)
    return fragment_name(int(param_name.split(".")[1]) % fragments)  # blocks.<layer>....


def slice_of(param_name: str, config: ModelConfig, stages: int) -> str:
    """The slice a parameter (by its global name) belongs to."""
    if param_name.startswith("embed."):
        return slice_name(0)
    if param_name.startswith(("norm.", "lm_head.")):
        return slice_name(stages - 1)
    layer = int(param_name.split(".")[1])  # blocks.<layer>....
    return slice_name(next(s for s, layers in enumerate(stage_layers(config.n_layer, stages)) if layer in layers))


def group_by_slice(param_names: Sequence[str], config: ModelConfig, stages: int,
                   fragments: int = 0) -> dict[str, list[int]]:
    """Slice name -> positions in ``param_names`` of its parameters: by stage, or by Streaming DiLoCo fragment
    when ``fragments`` is given (the model is then not cut into stages); slices in order."""
    slices: dict[str, list[int]] = {}
    for position, name in enumerate(param_names):
        key = fragment_of(name, fragments) if fragments else slice_of(name, config, stages)
        slices.setdefault(key, []).append(position)
    return dict(sorted(slices.items(), key=lambda item: int(item[0].removeprefix("fragment").removeprefix("stage"))))
