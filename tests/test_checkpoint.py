"""Checkpoints: atomic, verified, and refused with one clear line when corrupt or foreign."""

import json

import pytest
import torch

from p2ploco import checkpoint
from p2ploco.checkpoint import Checkpoint
from p2ploco.errors import CheckpointError


def sample(round_index: int = 7) -> Checkpoint:
    generator = torch.Generator().manual_seed(round_index)
    return Checkpoint(
        round_index,
        {"embed.weight": torch.randn(5, 4, generator=generator), "norm.weight": torch.ones(4)},
        {"momentum.0": torch.randn(5, 4, generator=generator)},
        {"outer/error.0": torch.randn(5, 4, generator=generator), "inner/0.step": torch.tensor(3.0)},
        {"inner": {"param_groups": [{"lr": 0.1, "params": [0, 1]}]}},
    )


def test_round_trip(tmp_path):
    saved = sample()
    checkpoint.save(tmp_path, saved, "run", "fp")
    loaded = checkpoint.load(tmp_path, "run", "fp")
    assert loaded.round == 7 and loaded.extras == saved.extras
    for a, b in ((saved.params, loaded.params), (saved.shared, loaded.shared), (saved.local, loaded.local)):
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_new_checkpoints_replace_old_ones_and_keep_one_previous(tmp_path):
    for round_index in (2, 4, 6):
        checkpoint.save(tmp_path, sample(round_index), "run", "fp")
    assert sorted(p.name for p in tmp_path.glob("state-*")) == ["state-4.safetensors", "state-6.safetensors"]
    assert checkpoint.load(tmp_path, "run", "fp").round == 6
    assert not list(tmp_path.glob("*.tmp-*"))  # no temporary file left behind


def test_a_background_save_holds_the_state_of_the_moment_it_was_asked_for(tmp_path):
    saver = checkpoint.BackgroundSaver(tmp_path, "run", "fp")
    live = sample()
    expected = {name: t.clone() for name, t in live.params.items()}
    saver.save(live)
    for tensor in live.params.values():  # training goes on while the checkpoint is written
        tensor.add_(1.0)
    saver.close()
    loaded = checkpoint.load(tmp_path, "run", "fp")
    assert all(torch.equal(loaded.params[k], expected[k]) for k in expected)


def test_a_background_save_that_fails_says_so_on_the_next_wait(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    saver = checkpoint.BackgroundSaver(blocked, "run", "fp")
    saver.save(sample())
    with pytest.raises(FileExistsError):
        saver.close()


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "checkpoint.json").write_text("{not json"), "unreadable or corrupt"),
    (lambda d: (d / "checkpoint.json").write_text("[1, 2]"), "not a JSON object"),
    (lambda d: (d / "state-7.safetensors").write_bytes(b"\0" * 40), "checksum mismatch"),
    (lambda d: (d / "state-7.safetensors").unlink(), "missing or unreadable"),
    (lambda d: _edit_pointer(d, file="../etc/passwd"), "bad 'file' or 'round' field"),
    (lambda d: _edit_pointer(d, format=99), "this p2ploco reads format 1"),
])
def test_damaged_checkpoints_are_refused(tmp_path, damage, message):
    checkpoint.save(tmp_path, sample(), "run", "fp")
    damage(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(CheckpointError, match=message) as error:
        checkpoint.load(tmp_path, "run", "fp")
    assert "\n" not in str(error.value)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing overwritten


def _edit_pointer(directory, **fields):
    pointer = json.loads((directory / "checkpoint.json").read_text())
    pointer.update(fields)
    (directory / "checkpoint.json").write_text(json.dumps(pointer))


def test_a_checkpoint_of_another_run_or_config_is_refused(tmp_path):
    checkpoint.save(tmp_path, sample(), "run", "fp")
    with pytest.raises(CheckpointError, match="is from run 'run' with config fp, not run 'other'"):
        checkpoint.load(tmp_path, "other", "fp")
    with pytest.raises(CheckpointError, match="not run 'run' with fp2"):
        checkpoint.load(tmp_path, "run", "fp2")
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        checkpoint.load(tmp_path / "empty", "run", "fp")


def test_tensors_that_do_not_match_their_hash_are_refused(tmp_path):
    checkpoint.save(tmp_path, sample(), "run", "fp")
    _edit_pointer(tmp_path, params_sha256="0" * 64)
    with pytest.raises(CheckpointError, match="do not match their hash"):
        checkpoint.load(tmp_path, "run", "fp")
