"""Checkpoints: atomic, verified, and refused with one clear line when corrupt or foreign."""

import json

import pytest
import torch
from helpers import CPU, sampler, small_config

from p2ploco import checkpoint
from p2ploco.build import build_replica
from p2ploco.checkpoint import Checkpoint
from p2ploco.errors import CheckpointError
from p2ploco.tensorfile import Deferred, made


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
    # the local section is read as the node takes it, each tensor alone (never all of it beside a model being built)
    assert loaded.local and all(isinstance(t, Deferred) for t in loaded.local.values())
    for a, b in ((saved.params, loaded.params), (saved.shared, loaded.shared), (saved.local, loaded.local)):
        assert set(a) == set(b) and all(torch.equal(a[k], made(b[k])) for k in a)


def test_a_directory_keeps_the_last_three_rounds_and_a_round_saved_again_replaces_its_own(tmp_path):
    for round_index in (2, 4, 6, 8, 8):  # the exit checkpoint at the round of the last periodic one: saved again
        checkpoint.save(tmp_path, sample(round_index), "run", "fp")
    assert sorted(p.name for p in tmp_path.glob("state-*")) == [f"state-{r}.safetensors" for r in (4, 6, 8)]
    assert checkpoint.rounds(tmp_path) == [8, 6, 4]
    assert checkpoint.load(tmp_path, "run", "fp").round == 8
    assert checkpoint.load(tmp_path, "run", "fp", round_index=4).round == 4
    with pytest.raises(CheckpointError, match=r"holds no checkpoint of round 2 \(it holds round\(s\) 8, 6, 4\)"):
        checkpoint.load(tmp_path, "run", "fp", round_index=2)
    assert not list(tmp_path.glob("*.tmp-*"))  # no temporary file left behind


def test_a_corrupt_newest_checkpoint_is_skipped_for_the_intact_one_beside_it_in_one_line(tmp_path):
    for round_index in (4, 6):
        checkpoint.save(tmp_path, sample(round_index), "run", "fp")
    (tmp_path / "state-6.safetensors").write_bytes(b"\0" * 40)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    said = []
    loaded = checkpoint.load(tmp_path, "run", "fp", skipped=said.append)
    assert loaded.round == 4 and all(torch.equal(loaded.params[k], sample(4).params[k]) for k in loaded.params)
    assert said == [f"skipped the checkpoint of round 6 (checkpoint file {tmp_path}/state-6.safetensors is corrupt "
                    f"(checksum mismatch)); resuming from round 4, the newest intact checkpoint in {tmp_path}"]
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # the corrupt one is left in place
    with pytest.raises(CheckpointError, match="state-6.safetensors is corrupt"):  # asked for by its round: refused
        checkpoint.load(tmp_path, "run", "fp", round_index=6)
    (tmp_path / "state-4.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"state-6.safetensors is corrupt \(checksum mismatch\) \(and the 1 "
                                              r"older one\(s\) beside it: not intact either\)"):
        checkpoint.load(tmp_path, "run", "fp")


def test_a_checkpoint_of_format_1_is_read_and_kept_beside_the_next(tmp_path):
    """A node of the version before lists kept several: its one checkpoint resumes, and stays beside the next."""
    checkpoint.save(tmp_path, sample(5), "run", "fp")
    entry = json.loads((tmp_path / "checkpoint.json").read_text())["checkpoints"][0]
    (tmp_path / "checkpoint.json").write_text(json.dumps({"format": 1, "run_id": "run", "fingerprint": "fp", **entry}))
    assert checkpoint.load(tmp_path, "run", "fp").round == 5
    checkpoint.save(tmp_path, sample(6), "run", "fp")
    assert checkpoint.rounds(tmp_path) == [6, 5] and checkpoint.load(tmp_path, "run", "fp", round_index=5).round == 5


def test_a_background_save_holds_the_state_of_the_moment_it_was_asked_for(tmp_path):
    saver = checkpoint.BackgroundSaver(tmp_path, "run", "fp")
    """Its local state (what the next steps write in place) is written before ``save`` returns; the global params
    and shared state, which nobody writes, in the background."""
    live = sample()
    expected = {name: t.clone() for name, t in live.local.items()}
    assert expected
    saver.save(live)
    for tensor in live.local.values():  # training goes on while the checkpoint is written
        tensor.add_(1.0)
    saver.close()
    loaded = checkpoint.load(tmp_path, "run", "fp")
    assert all(torch.equal(made(loaded.local[k]), expected[k]) for k in expected)
    assert all(torch.equal(loaded.params[k], live.params[k]) for k in live.params)


def test_a_background_save_that_cannot_start_says_so_at_once(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    saver = checkpoint.BackgroundSaver(blocked, "run", "fp")
    with pytest.raises(FileExistsError):
        saver.save(sample())
    saver.close()


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "checkpoint.json").write_text("{not json"), "unreadable or corrupt"),
    (lambda d: (d / "checkpoint.json").write_text("[1, 2]"), "not a JSON object"),
    (lambda d: (d / "state-7.safetensors").write_bytes(b"\0" * 40), "checksum mismatch"),
    (lambda d: (d / "state-7.safetensors").unlink(), "missing or unreadable"),
    (lambda d: _edit_pointer(d, file="../etc/passwd"), "bad 'file' or 'round' field"),
    (lambda d: _edit_pointer(d, format=99), "this p2ploco reads formats 1 to 2"),
])
def test_damaged_checkpoints_are_refused(tmp_path, damage, message):
    checkpoint.save(tmp_path, sample(), "run", "fp")
    damage(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(CheckpointError, match=message) as error:
        checkpoint.load(tmp_path, "run", "fp")
    assert "\n" not in str(error.value)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing overwritten


def _edit_pointer(directory, format=None, **fields):
    """The pointer with ``format`` changed and its newest entry's ``fields``."""
    pointer = json.loads((directory / "checkpoint.json").read_text())
    pointer["checkpoints"][0].update(fields)
    pointer["format"] = pointer["format"] if format is None else format
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


def test_a_checkpoint_whose_file_goes_before_the_node_takes_its_local_state_says_so(tmp_path):
    """A load leaves the local section in the file until the worker takes it: a file gone meanwhile is one line."""
    config = small_config("outer.algorithm=sparseloco")
    worker = build_replica(config, CPU, sampler(config))
    checkpoint.save(tmp_path, worker.checkpoint(1), "run", "fp")
    loaded = checkpoint.load(tmp_path, "run", "fp")
    (tmp_path / "state-1.safetensors").unlink()
    with pytest.raises(CheckpointError, match="could not be read any more"):
        build_replica(config, CPU, sampler(config)).restore(loaded, tmp_path)
