"""Where a node that came without a config finds its run's files (``Node._with_run_data``): a run peer's path is a
hint, taken only where it holds, here, the files of the run's digest."""

import sysconfig
from pathlib import Path

import pytest

from p2ploco.config import Config, with_overrides
from p2ploco.data import prepare, read_manifest, train_bpe
from p2ploco.errors import ConfigError
from p2ploco.node import Node

STDLIB = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """Two prepared corpora of one tokenizer: the run's, and another a peer's path could hold on this machine."""
    root = tmp_path_factory.mktemp("corpora")
    tokenizer = train_bpe((path.read_text(errors="replace") for path in STDLIB[:10]), 300, root / "tokenizer.json")
    prepare([str(path) for path in STDLIB[:10]], root / "runs", tokenizer, 2.0)
    prepare([str(path) for path in STDLIB[10:20]], root / "other", tokenizer, 2.0)
    return root


def document(corpora: Path, hint: Path) -> dict:
    run = with_overrides(Config(), [f"data.prepared={hint}", "model.vocab_size=300", "run_id=ours"])
    return run.run_document(f"prepared:{read_manifest(corpora / 'runs').digest}")


def test_the_run_peers_path_is_taken_where_it_holds_the_runs_corpus(corpora):
    config = Node._with_run_data(with_overrides(Config(), ["run_id=ours"]), document(corpora, corpora / "runs"))
    assert config.data.prepared == str(corpora / "runs")


def test_a_peers_path_that_here_holds_another_corpus_is_refused_with_one_line(corpora):
    digest, other = (read_manifest(corpora / name).digest for name in ("runs", "other"))
    with pytest.raises(ConfigError) as refused:
        Node._with_run_data(with_overrides(Config(), ["run_id=ours"]), document(corpora, corpora / "other"))
    assert str(refused.value) == (f"run 'ours' trains on a prepared corpus (digest {digest[:16]}), kept by its peer at "
                                  f"{corpora / 'other'}, which here holds another (digest {other[:16]}); pass --set "
                                  f"data.prepared=PATH, your copy of it")


def test_a_peers_path_that_is_not_here_is_refused_with_one_line(corpora):
    digest = read_manifest(corpora / "runs").digest
    with pytest.raises(ConfigError) as refused:
        Node._with_run_data(with_overrides(Config(), ["run_id=ours"]), document(corpora, corpora / "gone"))
    assert str(refused.value) == (f"run 'ours' trains on a prepared corpus (digest {digest[:16]}), kept by its peer at "
                                  f"{corpora / 'gone'}, which is not here; pass --set data.prepared=PATH, your copy "
                                  f"of it")
