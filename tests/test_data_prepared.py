"""Prepared corpora: shards + manifest written once, read back through numpy.memmap, checked at start."""

import json

import numpy as np
import pytest

from p2ploco.config import Config, load_config
from p2ploco.data import ByteTokenizer, load_tokenizer, load_training_data, open_prepared, prepare, train_bpe
from p2ploco.errors import ConfigError


def config(*overrides: str) -> Config:
    return load_config(None, list(overrides))


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "text"
    folder.mkdir()
    for i in range(40):
        (folder / f"part{i:02d}.txt").write_text("".join(f"part {i} line {j}: some words here\n" for j in range(300)))
    (folder / "records.jsonl").write_text("".join(json.dumps({"text": f"record {j} " * 30}) + "\n" for j in range(500)))
    return folder


def test_prepare_round_trip_matches_reading_the_text(tmp_path, corpus):
    manifest = prepare([str(corpus)], tmp_path / "prep", ByteTokenizer(), 2.0, shard_tokens=100_000)
    assert manifest.dtype == "uint16" and manifest.tokenizer.vocab_size == 257 and manifest.split.documents == 540
    assert len(manifest.train.shards) > 3 and all(s.tokens == 100_000 for s in manifest.train.shards[:-1])
    _, train, held_out = open_prepared(tmp_path / "prep")
    assert all(isinstance(shard, np.memmap) for shard in train.shards + held_out.shards)
    in_memory = load_training_data(config(f"data.paths={corpus}"))
    assert np.array_equal(np.concatenate(train.shards), in_memory.train.shards[0])  # same tokens, same split
    assert np.array_equal(np.concatenate(held_out.shards), in_memory.eval.shards[0])
    prepared = load_training_data(config(f"data.prepared={tmp_path / 'prep'}"))
    assert prepared.fingerprint == f"prepared:{manifest.digest}" and prepared.split == in_memory.split


def test_the_digest_depends_on_the_data_not_on_where_or_when(tmp_path, corpus):
    first = prepare([str(corpus)], tmp_path / "a", ByteTokenizer(), 2.0)
    again = prepare([str(corpus)], tmp_path / "b", ByteTokenizer(), 2.0)
    assert first.digest == again.digest
    assert prepare([str(corpus)], tmp_path / "c", ByteTokenizer(), 5.0).digest != first.digest
    (corpus / "part00.txt").write_text("other text\n" * 900)
    assert prepare([str(corpus)], tmp_path / "d", ByteTokenizer(), 2.0).digest != first.digest


def test_peers_on_different_prepared_corpora_have_different_fingerprints(tmp_path, corpus):
    prepare([str(corpus)], tmp_path / "a", ByteTokenizer(), 2.0)
    prepare([str(corpus / "part01.txt"), str(corpus / "records.jsonl")], tmp_path / "b", ByteTokenizer(), 2.0)
    a = load_training_data(config(f"data.prepared={tmp_path / 'a'}"))
    b = load_training_data(config(f"data.prepared={tmp_path / 'b'}"))
    plain = load_training_data(config(f"data.paths={corpus}"))
    fingerprints = {Config().swarm_fingerprint(d.fingerprint) for d in (a, b, plain)}
    assert len(fingerprints) == 3  # the swarm refuses a peer whose fingerprint differs (test_data_nodes.py)


@pytest.fixture
def prepared(tmp_path, corpus):
    prepare([str(corpus)], tmp_path / "prep", ByteTokenizer(), 2.0, shard_tokens=100_000)
    return tmp_path / "prep"


def test_a_truncated_shard_is_found(prepared):
    shard = prepared / "train-00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ConfigError, match=r"shard .*train-00001.bin is truncated \(199,998 bytes, the manifest says "
                                          r"200,000\); copy it again or prepare the corpus again"):
        load_training_data(config(f"data.prepared={prepared}"))


def test_an_edited_shard_is_found_by_its_sha256(prepared):
    shard = prepared / "eval-00000.bin"
    data = bytearray(shard.read_bytes())
    data[1000] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"shard .*eval-00000.bin does not match its sha256 in the manifest"):
        load_training_data(config(f"data.prepared={prepared}"))


def test_a_missing_or_edited_manifest_is_found(prepared, tmp_path):
    manifest = json.loads((prepared / "manifest.json").read_text())
    manifest["train"]["tokens"] += 1
    (prepared / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match=r"manifest.json was edited \(its digest does not match"):
        load_training_data(config(f"data.prepared={prepared}"))
    (prepared / "manifest.json").write_text('{"format": "p2ploco-tokens/1"}')
    with pytest.raises(ConfigError, match=r"is not a valid manifest \(tokenizer: Field required\)"):
        load_training_data(config(f"data.prepared={prepared}"))
    (prepared / "manifest.json").unlink()
    with pytest.raises(ConfigError, match="holds no manifest.json"):
        load_training_data(config(f"data.prepared={prepared}"))
    with pytest.raises(ConfigError, match="is not a folder"):
        load_training_data(config(f"data.prepared={tmp_path / 'elsewhere'}"))


def test_prepare_never_writes_into_a_folder_in_use(prepared, corpus):
    before = sorted(p.name for p in prepared.iterdir())
    with pytest.raises(ConfigError, match="already exists and is not an empty folder; choose a new one"):
        prepare([str(corpus)], prepared, ByteTokenizer(), 2.0)
    assert sorted(p.name for p in prepared.iterdir()) == before


def test_a_prepared_bpe_corpus_checks_the_model_vocab_and_tokenizer(tmp_path, corpus):
    texts = (path.read_text() for path in sorted(corpus.glob("*.txt")))
    tokenizer = train_bpe(texts, 400, tmp_path / "tok.json")
    manifest = prepare([str(corpus)], tmp_path / "prep", tokenizer, 2.0)
    assert manifest.tokenizer.kind == "huggingface" and manifest.tokenizer.sha256 == tokenizer.digest
    assert (tmp_path / "prep" / "tokenizer.json").is_file()  # the folder says how to decode it
    with pytest.raises(ConfigError, match=r"model.vocab_size is 257 but the .*prep/tokenizer.json tokenizer has 400 "
                                          r"tokens; set model.vocab_size=400"):
        load_training_data(config(f"data.prepared={tmp_path / 'prep'}"))
    data = load_training_data(config(f"data.prepared={tmp_path / 'prep'}", "model.vocab_size=400",
                                     f"data.tokenizer={tmp_path / 'prep' / 'tokenizer.json'}"))
    assert data.vocab_size == 400
    decoded = load_tokenizer(str(tmp_path / "tok.json")).decode(np.asarray(data.train.shards[0][:50]).tolist())
    assert decoded.startswith("part 0 line 0: some words here")
    train_bpe((path.read_text() for path in sorted(corpus.glob("*.txt"))[:3]), 400, tmp_path / "other.json")
    with pytest.raises(ConfigError, match="is not the tokenizer .* was prepared with"):
        load_training_data(config(f"data.prepared={tmp_path / 'prep'}", "model.vocab_size=400",
                                  f"data.tokenizer={tmp_path / 'other.json'}"))
