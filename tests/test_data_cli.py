"""`p2ploco data prepare` / `train-tokenizer`, and a node's data errors: one line, before anything is joined."""

import json
import re
import subprocess
import sys

import pytest

from p2ploco.launch import TINY_CONFIG

UNREACHABLE_PEER = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWDgAVb34MbWtokGvzCzHb2tXN2p71qFBJFrKJBcGpt3Mb"


def p2ploco(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "p2ploco.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.fixture
def text(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(20_000)))
    return path  # 1 MB


@pytest.mark.timeout(120)
def test_prepare_prints_a_summary_and_refuses_bad_input(tmp_path, text):
    result = p2ploco("data", "prepare", str(text), "--out", str(tmp_path / "prep"))
    assert result.returncode == 0, result.stderr
    assert re.search(r"16 of \d+ blocks of [\d,]+ bytes held out: 1 document", result.stdout), result.stdout
    assert "MB/s of text" in result.stdout
    assert f"--set data.prepared={tmp_path / 'prep'} --set model.vocab_size=257" in result.stdout
    assert json.loads((tmp_path / "prep" / "manifest.json").read_text())["train"]["tokens"] > 200_000

    line = one_error_line(p2ploco("data", "prepare", str(text), "--out", str(tmp_path / "prep")))
    assert "already exists and is not an empty folder; choose a new one (nothing was written)" in line
    line = one_error_line(p2ploco("data", "prepare", str(tmp_path / "nope.txt"), "--out", str(tmp_path / "x")))
    assert line == f"error: PATHS: {tmp_path / 'nope.txt'} does not exist; list text/JSONL files or folders"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": "also fine"}\n{"txt": "typo"}\n')
    line = one_error_line(p2ploco("data", "prepare", str(text), str(bad), "--out", str(tmp_path / "y")))
    assert line.startswith(f"error: {bad}:3: expected a JSON object with a string field \"text\"")
    assert not (tmp_path / "y").exists()  # found while listing the documents, before anything was written
    line = one_error_line(p2ploco("data", "prepare", str(text), "--out", str(tmp_path / "z"), "--tokenizer",
                                  str(text)))
    assert "is not a Hugging Face tokenizer.json" in line


@pytest.mark.timeout(120)
def test_train_tokenizer_then_prepare_with_it(tmp_path, text):
    out = tmp_path / "tok.json"
    result = p2ploco("data", "train-tokenizer", str(text), "--vocab-size", "300", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "300 tokens" in result.stdout and f"--set data.tokenizer={out} --set model.vocab_size=300" in result.stdout
    result = p2ploco("data", "prepare", str(text), "--out", str(tmp_path / "prep"), "--tokenizer", str(out))
    assert result.returncode == 0, result.stderr
    assert "(300 tokens, uint16)" in result.stdout

    line = one_error_line(p2ploco("data", "train-tokenizer", str(text), "--vocab-size", "300", "--out", str(out)))
    assert line == f"error: --out {out} already exists; choose a new file (nothing was written)"
    line = one_error_line(p2ploco("data", "train-tokenizer", str(text), "--vocab-size", "100", "--out",
                                  str(tmp_path / "small.json")))
    assert line == "error: --vocab-size 100 is too small: a byte-level BPE needs at least 257 (256 bytes + end-of-text)"
    # The text has fewer merges to make than asked for: the tokenizer is smaller, and it says so
    small = tmp_path / "small.txt"
    small.write_text("the quick brown fox jumps over the lazy dog\n" * 100)
    result = p2ploco("data", "train-tokenizer", str(small), "--vocab-size", "4096", "--out", str(tmp_path / "big.json"))
    made = json.loads((tmp_path / "big.json").read_text())
    size = len(made["model"]["vocab"]) + sum(t["id"] >= len(made["model"]["vocab"]) for t in made["added_tokens"])
    assert result.returncode == 0 and size < 4096, result.stderr
    assert (f"note: the vocabulary has {size:,} tokens, not the 4,096 asked for: the text offers no more merges; train "
            f"on more text for a larger one") in result.stdout.splitlines()


@pytest.mark.timeout(120)
def test_a_node_finds_data_problems_before_it_joins(tmp_path, text):
    """The bootstrap address is unreachable: had the node tried to join first, it would fail on that instead."""
    def start(*overrides: str) -> str:
        result = p2ploco("node", "start", "--config", str(TINY_CONFIG), "--initial-peers", UNREACHABLE_PEER,
                         "--log-dir", str(tmp_path / "log"), *(arg for o in overrides for arg in ("--set", o)))
        assert "joined run" not in result.stdout
        return one_error_line(result)

    assert start(f"data.paths={text}", "model.vocab_size=300") == (
        "error: model.vocab_size is 300 but the byte-level tokenizer has 257 tokens; set model.vocab_size=257")
    small = tmp_path / "small.txt"
    small.write_text("a few short lines\n" * 400)
    assert start(f"data.paths={small}", "model.max_seq_len=2048", "data.seq_len=2000") == (
        f"error: corpus {small}: the held-out share (1 of 8 blocks of 1,024 bytes held out: 1 document, too few to "
        f"hold out whole ones) holds 1,025 tokens, not one window of data.seq_len+1=2001; raise data.eval_percent, "
        f"or lower data.seq_len")
    assert start(f"data.prepared={tmp_path}").startswith(f"error: data.prepared: {tmp_path} holds no manifest.json")
