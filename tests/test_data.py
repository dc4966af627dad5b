"""Corpora, the train/eval split, tokenizers and the sampler (in-process; see test_data_prepared.py for shards)."""

import json
import re

import numpy as np
import pytest
import torch

from p2ploco.config import Config, load_config
from p2ploco.data import (
    ByteTokenizer,
    Permutation,
    ShardSampler,
    Sources,
    Split,
    TokenStream,
    eval_batches,
    is_held_out,
    load_tokenizer,
    load_training_data,
    plan_split,
    train_bpe,
)
from p2ploco.data.split import PART_BYTES
from p2ploco.errors import ConfigError
from p2ploco.metrics import human_count

EOT = ByteTokenizer.eot


def config(*overrides: str) -> Config:
    return load_config(None, list(overrides))


def entries_of(stream: TokenStream) -> list[bytes]:
    """The runs of text between end-of-text tokens of a byte-level stream."""
    (tokens,) = stream.shards
    ends = np.flatnonzero(tokens == EOT)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokens[s:e].astype(np.uint8).tobytes() for s, e in zip(starts, ends)]


@pytest.fixture
def text_folder(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(200):
        (docs / f"doc{i:03d}.txt").write_text(f"document {i}: " + "lorem ipsum dolor sit amet " * 20)
    return docs


def test_stdlib_is_the_default_corpus():
    data = load_training_data(Config())
    assert "standard library" in data.source and "documents held out" in data.split
    assert data.train.tokens > 5_000_000 and 0 < data.eval.tokens < data.train.tokens / 10
    assert data.train.shards[0].max() == EOT and data.fingerprint == ""


def test_the_start_up_line_counts_a_small_corpus_in_tokens_it_has(tmp_path):
    path = tmp_path / "small.txt"
    path.write_text("x" * 47_000)  # byte-level: one token a byte (it used to read "0.0M train / 0.00M eval")
    data = load_training_data(config(f"data.paths={path}", "data.seq_len=16"))
    train, held_out = re.search(r": (\S+) train / (\S+) eval tokens", data.describe()).groups()
    assert (train, held_out) == (human_count(data.train.tokens), human_count(data.eval.tokens))
    assert re.fullmatch(r"4\d(\.\d)?k", train) and re.fullmatch(r"\d+(\.\d+)?k?", held_out)
    assert [human_count(n) for n in (812, 47_123, 999_999, 1_250_000, 3.4e9)] == ["812", "47.1k", "1M", "1.25M", "3.4B"]


def test_text_and_jsonl_files(tmp_path, text_folder):
    jsonl = tmp_path / "more.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": f"record {i} " * 50}) for i in range(100)) + "\n\n")
    sources = Sources([str(text_folder), str(jsonl)])
    names = [name for name, _ in sources.sizes()]
    assert len(names) == 300 and names[0] == "docs/doc000.txt" and names[-1] == "more.jsonl:100"
    data = load_training_data(config(f"data.paths=[{text_folder}, {jsonl}]", "data.seq_len=16", "data.eval_percent=10"))
    texts = entries_of(data.train) + entries_of(data.eval)
    assert len(texts) == 300 and texts[0].startswith(b"document 0: lorem")


def test_one_entry_holds_out_evenly_spread_blocks(tmp_path):
    """The issue's case: one plain text file used to land wholly on one side."""
    lines = [f"line {i:06d} of the only document\n" for i in range(60_000)]  # ~2 MB
    text = "".join(lines).encode()
    path = tmp_path / "corpus.txt"
    path.write_bytes(text)
    split = plan_split(Sources([str(path)]).sizes(), 2.0)
    assert split.kind == "blocks" and split.documents == 1 and split.held_out_blocks == 16
    parts = list(split.parts("corpus.txt", [text], 0))
    assert b"".join(part for _, part in parts) == text  # every byte goes to exactly one side
    held = b"".join(part for held, part in parts if held)
    assert 0.015 < len(held) / len(text) < 0.025
    # spread over the whole file, not one end of it
    held_lines = [int(m.group(1)) for m in re.finditer(rb"^line (\d{6}) of the only document$", held, re.M)]
    assert min(held_lines) < 6_000 and max(held_lines) > 54_000
    data = load_training_data(config(f"data.paths={path}"))
    assert data.eval.tokens == len(held) + 16  # each held-out block ends with end-of-text
    assert data.train.tokens + data.eval.tokens == len(text) + 16 + 17
    assert b"".join(entries_of(data.eval)) == held


def test_ten_thousand_tiny_entries_hold_out_whole_entries(tmp_path):
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(json.dumps({"text": f"tiny document number {i}."}) + "\n" for i in range(10_000)))
    data = load_training_data(config(f"data.paths={path}", "data.seq_len=16"))
    assert "documents held out" in data.split
    expected = {f"tiny document number {i - 1}.".encode() for i in range(1, 10_001)
                if is_held_out(f"tiny.jsonl:{i}", 2.0)}
    held = entries_of(data.eval)
    assert 150 < len(held) < 250 and set(held) == expected and len(set(held)) == len(held)
    assert not expected & set(entries_of(data.train))


def test_the_split_is_the_same_on_every_peer(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"".join(f"{i} some text\n".encode() for i in range(50_000)))
    first, second = (load_training_data(config(f"data.paths={path}")) for _ in range(2))
    assert np.array_equal(first.eval.shards[0], second.eval.shards[0])
    assert np.array_equal(first.train.shards[0], second.train.shards[0])


def test_parts_never_cut_a_character_and_do_not_depend_on_how_the_text_is_read():
    text = ("é€😀" * (PART_BYTES // 3)).encode() + b"a line\n" * 30_000  # without, then with line ends
    by_blocks = plan_split([("a", len(text))], 2.0)
    by_entries = Split("documents", 2.0, 1, len(text))  # parts cut by size (and at line ends) only
    assert by_blocks.kind == "blocks"
    for split in (by_blocks, by_entries):
        whole = list(split.parts("a", [text], 0))
        assert len(whole) > 4 and b"".join(part for _, part in whole) == text
        for _, part in whole:
            part.decode("utf-8")  # raises if a part cut a character in two
        for size in (7, 1000, PART_BYTES + 1, 3 * PART_BYTES):  # read in chunks of other sizes: the same parts
            assert list(split.parts("a", (text[i : i + size] for i in range(0, len(text), size)), 0)) == whole
    sizes = [len(part) for _, part in by_entries.parts("a", [text], 0)]
    assert max(sizes) <= PART_BYTES + 3 and sizes[-2] < PART_BYTES  # the last full part ends at a line end


def test_errors_name_the_real_cause(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_training_data(config(f"data.paths={tmp_path / 'nope'}"))
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("short")
    with pytest.raises(ConfigError, match=r"holds 6 tokens, too few for one training and one held-out window of "
                                          r"data.seq_len\+1=65 tokens; add text or lower data.seq_len"):
        load_training_data(config(f"data.paths={tiny}", "data.seq_len=64"))
    small = tmp_path / "small.txt"
    small.write_text("a few short lines\n" * 400)  # 7 kB: one held-out block of 1 kB
    with pytest.raises(ConfigError, match=r"the held-out share \(1 of 8 blocks .*\) holds 1,025 tokens, not one "
                                          r"window of data.seq_len\+1=2001; raise data.eval_percent"):
        load_training_data(config(f"data.paths={small}", "model.max_seq_len=2048", "data.seq_len=2000"))
    with pytest.raises(ConfigError, match="not both"):
        config(f"data.paths={small}", "data.prepared=somewhere")


@pytest.mark.parametrize("problem, line", [
    ("not json at all", r"bad.jsonl:3: expected a JSON object with a string field \"text\""),
    ('{"body": "no text field"}', r"bad.jsonl:3: expected a JSON object"),
    ('{"text": 42}', r"bad.jsonl:3: field \"text\" must be a string, not int"),
])
def test_jsonl_bad_lines_are_reported_with_file_and_line(tmp_path, problem, line):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n\n' + problem + '\n{"text": "never read"}\n')
    with pytest.raises(ConfigError, match=line):
        load_training_data(config(f"data.paths={bad}"))


@pytest.fixture(scope="module")
def bpe_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    texts = (f"def function_{i}(x):\n    return x * {i} + sum(range({i}))\n" for i in range(3000))
    train_bpe(texts, 300, path)
    return path


def test_a_trained_bpe_tokenizer_loads_and_round_trips(bpe_file):
    tokenizer = load_tokenizer(str(bpe_file))
    assert tokenizer.vocab_size == 300 and tokenizer.eot == 0 and len(tokenizer.digest) == 64
    text = "def function_7(x):\n    return x * 7 — ünïcode\n"
    (ids,) = tokenizer.encode_batch([text.encode()])
    assert len(ids) < len(text.encode()) and tokenizer.decode(ids.tolist()) == text


def test_model_vocab_must_match_the_tokenizer(tmp_path, bpe_file):
    corpus = tmp_path / "c.txt"
    corpus.write_text("def f(x):\n    return x\n" * 2000)
    with pytest.raises(ConfigError, match=rf"model.vocab_size is 257 but the {bpe_file} tokenizer has 300 tokens; "
                                          r"set model.vocab_size=300"):
        load_training_data(config(f"data.paths={corpus}", f"data.tokenizer={bpe_file}"))
    with pytest.raises(ConfigError, match="model.vocab_size is 300 but the byte-level tokenizer has 257 tokens"):
        load_training_data(config(f"data.paths={corpus}", "model.vocab_size=300"))
    data = load_training_data(config(f"data.paths={corpus}", f"data.tokenizer={bpe_file}", "model.vocab_size=300",
                                     "data.seq_len=16"))
    assert data.vocab_size == 300 and int(data.train.shards[0].max()) < 300
    assert data.fingerprint.startswith("tokenizer:")  # peers of a run must tokenize alike
    assert Config().swarm_fingerprint(data.fingerprint) != Config().swarm_fingerprint()


def test_bad_tokenizer_files(tmp_path):
    with pytest.raises(ConfigError, match="tokenizer file .*missing.json does not exist"):
        load_tokenizer(str(tmp_path / "missing.json"))
    garbage = tmp_path / "garbage.json"
    garbage.write_text("this is not json")
    with pytest.raises(ConfigError, match=r"garbage.json is not a Hugging Face tokenizer.json \(expected ident"):
        load_tokenizer(str(garbage))
    from tokenizers import Tokenizer, models

    no_eot = tmp_path / "no_eot.json"
    Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]")).save(str(no_eot))
    with pytest.raises(ConfigError, match="has no end-of-text token"):
        load_tokenizer(str(no_eot))


@pytest.mark.parametrize("n", [1, 2, 3, 7, 1000, 4097])
def test_the_window_order_is_a_permutation(n):
    order = Permutation(n, b"seed")(np.arange(n))
    assert sorted(order.tolist()) == list(range(n))
    if n >= 1000:
        assert not np.array_equal(order, Permutation(n, b"other")(np.arange(n)))
        assert abs(np.corrcoef(np.arange(n), order)[0, 1]) < 0.1  # shuffled, not a shifted identity


def test_shards_depend_on_run_and_peer_and_resume_anywhere():
    tokens = np.arange(10_000, dtype=np.uint16) % 257
    a = ShardSampler(tokens, 16, 4, "run", "peer-a")
    x, y = a.batch(7)
    assert x.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(ShardSampler(tokens, 16, 4, "run", "peer-a").batch(7)[0], x)  # computed, not replayed
    assert not torch.equal(ShardSampler(tokens, 16, 4, "run", "peer-b").batch(7)[0], x)
    assert not torch.equal(ShardSampler(tokens, 16, 4, "run2", "peer-a").batch(7)[0], x)
    # one epoch visits every window exactly once, the next epoch in another order
    windows = a.num_windows
    epoch = np.concatenate([a.rows(i) for i in range(windows // 4)])
    assert len(set(epoch.tolist())) == len(epoch) == 4 * (windows // 4)
    assert not np.array_equal(np.concatenate([a.rows(i) for i in range(windows // 4, 2 * (windows // 4))]), epoch)


def test_windows_stay_inside_one_shard():
    shards = [np.arange(start, start + size, dtype=np.uint32) for start, size in ((0, 50), (1000, 17), (5000, 33))]
    stream = TokenStream(shards)
    assert stream.windows(8) == 6 + 2 + 4
    block = stream.gather(np.arange(12), 8)
    assert np.array_equal(block[6], np.arange(1000, 1009)) and np.array_equal(block[8], np.arange(5000, 5009))
    assert all(np.array_equal(np.diff(row), np.ones(8)) for row in block)  # never two shards in one window


def test_eval_batches_are_fixed_and_spread():
    tokens = np.arange(5_000, dtype=np.uint16)
    first, second = eval_batches(tokens, 16, 40), eval_batches(tokens, 16, 40)
    assert sum(len(x) for x, _ in first) == 40
    assert all(torch.equal(x, x2) for (x, _), (x2, _) in zip(first, second))
    starts = torch.cat([x[:, 0] for x, _ in first])
    assert starts[-1] > 200  # from the whole held-out stream, not its first 40 windows
