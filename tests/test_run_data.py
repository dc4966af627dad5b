"""What a node that came without a config needs of its run's files (``config_choice.needs_run_data``): peers never
say where they keep theirs, so a joiner of a run on a prepared corpus or a tokenizer of its own names its copy."""

import pytest
import torch

from p2ploco.config import Config, with_overrides
from p2ploco.config_choice import fits_memory, needs_run_data
from p2ploco.errors import ConfigError
from p2ploco.host_memory import total_memory
from p2ploco.metrics import human_bytes
from p2ploco.model import Transformer, parameter_count
from p2ploco.swarm.messages import decode
from p2ploco.swarm.run_config import Document

DIGEST = "ab" * 32


def document(data: str) -> dict:
    return with_overrides(Config(), ["model.vocab_size=300", "run_id=ours"]).run_document(data)


def test_a_run_document_names_no_path_of_its_peer():
    run = with_overrides(Config(), ["data.prepared=/home/someone/corpus", "data.tokenizer=/home/someone/t.json"])
    served = str(run.run_document(f"prepared:{DIGEST}"))
    assert "/home/someone" not in served
    decode(Document, run.run_document(f"prepared:{DIGEST}"))


@pytest.mark.parametrize("data, key, what", [(f"prepared:{DIGEST}", "data.prepared", "a prepared corpus"),
                                             (f"tokenizer:{DIGEST}", "data.tokenizer", "a tokenizer of its own")])
def test_a_joiner_without_its_copy_of_the_runs_files_is_told_in_one_line(data, key, what):
    with pytest.raises(ConfigError) as refused:
        needs_run_data(with_overrides(Config(), ["run_id=ours"]), document(data))
    assert str(refused.value) == (f"run 'ours' trains on {what} (digest {DIGEST[:16]}); pass --set {key}=PATH, "
                                  f"your copy of it (its digest must be the run's)")
    needs_run_data(with_overrides(Config(), ["run_id=ours", f"{key}=/mine"]), document(data))
    needs_run_data(with_overrides(Config(), ["run_id=ours"]), document(""))  # the default corpus: nothing


@pytest.mark.parametrize("overrides", [[], ["model.tie_embeddings=false"], ["model.d_ff=100", "model.n_layer=3"]])
def test_a_models_parameters_are_counted_as_it_holds_them(overrides):
    config = with_overrides(Config(), overrides).model
    assert parameter_count(config) == sum(p.numel() for p in Transformer(config, seed=0).parameters())


def test_a_run_whose_model_would_not_fit_this_machines_memory_is_refused_in_one_line():
    """A run document sets its model's size, and a newcomer takes it from peers it does not know: one naming a model
    of 10^14 parameters used to be built, and exhaust the machine."""
    huge = with_overrides(Config(), ["run_id=ours", "model.d_model=1048576", "model.n_head=1024", "model.n_layer=64"])
    with pytest.raises(ConfigError) as refused:
        fits_memory(huge, torch.device("cpu"))
    needed = parameter_count(huge.model) * 24
    assert str(refused.value) == (f"run 'ours' trains a model of {parameter_count(huge.model) / 1e6:,.1f}M parameters: "
                                  f"at least {human_bytes(needed)} of training state in this machine's memory, which "
                                  f"holds {human_bytes(total_memory())}; join a run of a smaller model, or use a "
                                  f"machine with more memory")
    fits_memory(with_overrides(Config(), ["run_id=ours"]), torch.device("cpu"))
