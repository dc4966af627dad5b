"""``p2ploco export`` and ``sample``: the model of a run's checkpoint, exported or sampled."""

from __future__ import annotations

from pathlib import Path

import click

from p2ploco.cli.command import reports_errors


@click.command()
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


@click.command()
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
