from pathlib import Path

import pytest

from p2ploco.config import Config, batch_split, config_of_run, differences, keys_set, load_config, split_for_run
from p2ploco.config import sections as config_sections
from p2ploco.errors import ConfigError

TINY = "configs/tiny.yaml"


def test_tiny_config_loads_and_overrides_reach_every_section():
    config = load_config(TINY, ["inner.lr=3e-4", "outer.diloco.momentum=0.8", "data.paths=[a.txt, b.jsonl]",
                                "model.tie_embeddings=false", "inner.betas=[0.8, 0.9]", "run_id=other"])
    assert config.inner.lr == 3e-4 and isinstance(config.inner.lr, float)
    assert config.outer.diloco.momentum == 0.8
    assert config.outer.algorithm == "sparseloco" and config.outer.sparseloco.topk == 64
    assert config.data.paths == ["a.txt", "b.jsonl"]
    assert config.model.tie_embeddings is False
    assert config.inner.betas == [0.8, 0.9]
    assert config.run_id == "other"
    assert config.model.n_layer == 2  # from the file
    loco = load_config(TINY, ["outer.algorithm=loco", "outer.loco.bits=8", "outer.loco.beta=0.5"]).outer
    assert (loco.algorithm, loco.loco.bits, loco.loco.beta, loco.loco.group_size) == ("loco", 8, 0.5, 128)


@pytest.mark.parametrize("override, message", [
    ("inner.lrr=1", "unknown config key 'inner.lrr' (did you mean 'inner.lr'?)"),
    ("nosuch.key=1", "unknown config key 'nosuch.key'"),
    ("inner.lr.x=1", "'inner.lr' is a value, not a section"),
    ("inner.lr=fast", "inner.lr must be a number; got 'fast'"),
    ("inner.steps=2.5", "inner.steps must be an integer; got 2.5"),
    ("model.tie_embeddings=maybe", "model.tie_embeddings must be true or false"),
    ("outer.algorithm=adam", "outer.algorithm must be one of sparseloco, diloco, loco"),
    ("outer.loco.bits=3", "outer.loco.bits (3) must be 2, 4 or 8"),
    ("outer.loco.group_size=0", "outer.loco.group_size (0) must be in [1, 1048576]"),
    ("outer.loco.beta=1", "outer.loco.beta (1.0) must be in [0, 1)"),
    ("outer.loco.beta=-0.1", "outer.loco.beta (-0.1) must be in [0, 1)"),
    ("outer.loco.reset_every=0", "outer.loco.reset_every (0) must be at least 1"),
    ("outer.loco.lr=0", "outer.loco.lr (0.0) must be > 0"),
    ("outer.loco.momentum=1", "outer.loco.momentum (1.0) must be in [0, 1)"),
    ("outer.loco.bits=four", "outer.loco.bits must be an integer; got 'four'"),
    ("outer.sparseloco.topk=5000", "outer.sparseloco.topk (5000) must be in [1, chunk_size^2=4096]"),
    ("outer.sparseloco.aggregate=median", "outer.sparseloco.aggregate must be one of mean, sum"),
    ("outer.sparseloco=3", "'outer.sparseloco' is a section, not a value"),
    ("inner.betas=0.9", "inner.betas must be a list"),
    ("model.d_model=130", "model.d_model (130) must be divisible by model.n_head (4)"),
    ("inner.lr=-1", "inner.lr (-1.0) must be > 0"),
    ("data.seq_len=4096", "data.seq_len (4096) must be in [2, model.max_seq_len=128]"),
    ("swarm.peer_ttl=5", "swarm.peer_ttl (5.0) must be at least 3 x swarm.heartbeat_interval"),
    ("training.device=tpu", "training.device ('tpu') must be auto, cpu, cuda or cuda:N"),
    ("swarm.allreduce_timeout=inf", "swarm.allreduce_timeout must be a finite number; got 'inf'"),
    ("swarm.matchmaking_timeout=.nan", "swarm.matchmaking_timeout must be a finite number"),
    ("swarm.allreduce_timeout=1e9", "must be in (0, 3600] seconds"),
    ("swarm.ban_rounds=-1", "swarm.ban_rounds (-1) must be in [0, 1000]"),
    ("swarm.max_reducers=2", "swarm.max_reducers (2) must be in [4, 1024]: fewer hands one reducer a quarter"),
    ("swarm.min_bandwidth_mbit=0", "swarm.min_bandwidth_mbit (0.0) must be in (0, 1e6]"),
    ("swarm.bandwidth_mbit=-5", "swarm.bandwidth_mbit (-5.0) in [0, 1e6] Mbit/s"),
    ("swarm.max_transfer_timeout=10", "swarm.max_transfer_timeout (10.0) must be in [swarm.allreduce_timeout=300.0"),
    ("outer.clip_factor=0.5", "outer.clip_factor (0.5) must be in [1, 100]"),
    ("training.ranks=0", "training.ranks and training.max_ranks must be in [1, 64]"),
    ("training.max_ranks=65", "training.ranks and training.max_ranks must be in [1, 64]"),
    ("training.ranks=2", "training.ranks (2) is more than training.max_ranks (1), the most local ranks this run "
                         "counts in one peer's contribution: train on 1 rank(s), or start the run with "
                         "training.max_ranks >= 2"),
    ("inner", "expected key=value"),
])
def test_bad_overrides_are_rejected_with_one_clear_line(override, message):
    with pytest.raises(ConfigError) as error:
        load_config(TINY, [override])
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_bad_config_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML at line 2"):
        load_config(broken)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("model: 3\n")
    with pytest.raises(ConfigError, match="'model' is a section"):
        load_config(scalar)
    typo = tmp_path / "typo.yaml"
    typo.write_text("inner:\n  setps: 3\n")
    did_you_mean = r"typo.yaml: unknown config key 'inner.setps' \(did you mean 'inner.steps'\?\)"
    with pytest.raises(ConfigError, match=did_you_mean):
        load_config(typo)


def test_fingerprint_covers_every_setting_but_a_peers_own():
    base = Config()
    own = load_config(None, ["training.device=cpu", "training.threads=2", "inner.fixed_steps=true", "run_id=other",
                             "inner.batch_size=4", "inner.grad_accum=2", "swarm.reachability=client"])
    assert base.swarm_fingerprint() == own.swarm_fingerprint()  # the same tokens a round, split as memory allows
    for shared in ("outer.sparseloco.lr=0.5", "inner.lr=1e-3", "inner.steps=7", "swarm.allreduce_timeout=20"):
        assert load_config(None, [shared]).swarm_fingerprint() != base.swarm_fingerprint(), shared
    # what a round can hold caps every contribution's weight (Config.round_tokens)
    other_batch = load_config(None, ["inner.batch_size=4"])
    assert base.swarm_fingerprint() != other_batch.swarm_fingerprint()
    assert other_batch.round_tokens * 2 == base.round_tokens


def test_a_peers_ranks_are_its_own_and_the_runs_max_ranks_caps_what_a_contribution_weighs():
    base = load_config(TINY)
    assert load_config(TINY, ["training.max_ranks=4", "training.ranks=2"]).swarm_fingerprint() == load_config(
        TINY, ["training.max_ranks=4"]).swarm_fingerprint() != base.swarm_fingerprint()
    assert load_config(TINY, ["training.max_ranks=4"]).max_contribution_tokens == 4 * base.round_tokens
    assert base.max_contribution_tokens == base.round_tokens
    # a peer with more ranks than the run counts is refused as it takes the run's config, in one line
    run = load_config(TINY).run_document()
    with pytest.raises(ConfigError, match=r"^training.ranks \(2\) is more than training.max_ranks \(1\)"):
        config_of_run(run, load_config(TINY, ["training.ranks=2", "training.max_ranks=2"]))


def test_a_run_document_rebuilds_the_run_with_the_peers_own_settings_on_top():
    run = load_config("configs/tiny.yaml", ["inner.lr=1e-3", "model.n_layer=3", "training.device=cpu"])
    given = ["run_id=tiny", "training.threads=3", "inner.batch_size=2", "inner.grad_accum=4"]
    joined = config_of_run(run.run_document(), load_config(None, given), given)
    assert (joined.inner.lr, joined.model.n_layer, joined.inner.steps) == (1e-3, 3, run.inner.steps)
    assert (joined.training.device, joined.training.threads, joined.inner.batch_size) == ("auto", 3, 2)
    assert joined.swarm_fingerprint() == run.swarm_fingerprint()
    assert differences(load_config("configs/tiny.yaml", ["inner.lr=3e-3"]).run_document(), run.run_document()) == [
        "inner.lr=0.003 (run: 0.001)", "model.n_layer=2 (run: 3)"]


CONFIGS = sorted(str(path) for path in Path("configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS)
@pytest.mark.parametrize("split", [(1, 1), (2, 3), (16, 2)])
def test_a_joiner_that_set_no_batch_key_splits_the_runs_step_and_trains_its_config(path, split):
    """The run's step in micro-batches of at most the joiner's default size (8), whatever split the run was started
    with: no setting the person did not give can keep it out of the run."""
    run = load_config(path, [f"inner.batch_size={split[0]}", f"inner.grad_accum={split[1]}", "run_id=r"])
    joined = config_of_run(run.run_document(), load_config(None, ["run_id=r"]), ["run_id=r"])
    sequences = split[0] * split[1]
    assert (joined.inner.batch_size, joined.inner.grad_accum) == {1: (1, 1), 6: (6, 1), 32: (8, 4)}[sequences]
    assert joined.swarm_fingerprint() == run.swarm_fingerprint()


def test_the_split_a_joiner_picks_is_the_largest_micro_batch_up_to_its_own_that_divides_the_step():
    own = Config().inner  # batch_size 8
    assert [batch_split(n, own, (), "r") for n in (1, 8, 9, 12, 13, 64)] == [
        (1, 1), (8, 1), (3, 3), (6, 2), (1, 13), (8, 8)]
    assert batch_split(64, load_config(None, ["inner.grad_accum=4"]).inner, (), "r") == (8, 8)  # not set: not used


@pytest.mark.parametrize(("given", "split"), [
    (["inner.batch_size=4"], (4, 8)), (["inner.grad_accum=16"], (2, 16)), (["inner={grad_accum: 32}"], (1, 32)),
    (["inner.batch_size=16", "inner.grad_accum=2"], (16, 2)), (["inner.batch_size=32"], (32, 1))])
def test_a_joiner_that_set_batch_keys_keeps_them_and_the_other_follows_the_run(given, split):
    run = load_config("configs/150m.yaml", ["run_id=r"])  # 16 x 2 sequences a step
    joined = config_of_run(run.run_document(), load_config(None, ["run_id=r", *given]), ["run_id=r", *given])
    assert (joined.inner.batch_size, joined.inner.grad_accum) == split
    assert joined.swarm_fingerprint() == run.swarm_fingerprint()


@pytest.mark.parametrize(("given", "line"), [
    (["inner.batch_size=3"], "--set inner.batch_size=3 does not divide the 32 sequences a step run 'r' trains "
                             "(inner.batch_size x inner.grad_accum): set inner.batch_size to one of 1, 2, 4, 8, 16, 32 "
                             "(inner.grad_accum follows), or drop it"),
    (["inner.grad_accum=5"], "--set inner.grad_accum=5 does not divide the 32 sequences a step run 'r' trains "
                             "(inner.batch_size x inner.grad_accum): set inner.grad_accum to one of 1, 2, 4, 8, 16, 32 "
                             "(inner.batch_size follows), or drop it"),
    (["inner.batch_size=8", "inner.grad_accum=1"],
     "--set inner.batch_size=8 --set inner.grad_accum=1 make 8 sequences a step, where run 'r' trains 32: set two "
     "whose product is 32, or drop them (the node then splits the run's step itself)")])
def test_a_split_that_cannot_make_the_runs_step_is_refused_naming_only_what_was_set(given, line):
    run = load_config("configs/150m.yaml", ["run_id=r"])
    with pytest.raises(ConfigError) as refused:
        config_of_run(run.run_document(), load_config(None, ["run_id=r", *given]), ["run_id=r", *given])
    assert str(refused.value) == line


def test_a_config_files_split_is_a_default_the_runs_step_replaces_and_a_set_one_is_kept():
    """A node with its own config file (150m.yaml's 16 x 2) joining a run started with another split: the file's
    split follows the run's step where --set gives none, and no split mends steps or sequences that differ."""
    run = load_config("configs/150m.yaml", ["inner.batch_size=1", "inner.grad_accum=1"]).run_document()
    fitted = split_for_run(load_config("configs/150m.yaml"), run, frozenset())
    assert (fitted.inner.batch_size, fitted.inner.grad_accum) == (1, 1) and fitted.run_document() == run
    given = ["inner.grad_accum=4"]
    with pytest.raises(ConfigError, match=r"^--set inner.grad_accum=4 does not divide the 1 sequences a step"):
        split_for_run(load_config("configs/150m.yaml", given), run, keys_set(given))
    other_steps = load_config("configs/150m.yaml", ["inner.steps=7"])
    assert split_for_run(other_steps, run, frozenset()) == other_steps


def test_what_a_round_holds_is_told_as_the_batch_split_only_where_steps_and_sequences_agree():
    run = load_config(TINY, ["inner.batch_size=1"])
    assert differences(load_config(TINY).run_document(), run.run_document()) == [
        "inner.batch_size x inner.grad_accum: 8 sequences a step (run: 1)"]
    assert differences(load_config(TINY, ["inner.steps=7"]).run_document(), run.run_document()) == [
        "inner.steps=7 (run: 5)"]
    hostile = run.run_document()  # another peer's document: settings of any type never break the comparison
    for steps in ("5", [5], True, None, 0):
        lines = differences(load_config(TINY).run_document(), {**hostile, "settings": {**hostile["settings"],
                                                                                        "inner.steps": steps}})
        assert lines == [f"inner.steps=5 (run: {steps!r})"]


def test_a_run_document_that_does_not_parse_gets_one_line_naming_it():
    document = Config().run_document()
    with pytest.raises(ConfigError, match=r"^the run's config: inner.lr must be a number; got 'fast'$"):
        config_of_run({**document, "settings": {**document["settings"], "inner.lr": "fast"}}, Config())
    with pytest.raises(ConfigError, match=r"^the run's config: unknown config key 'inner.speed'"):
        config_of_run({**document, "settings": {"inner.speed": 1}}, Config())
    with pytest.raises(ConfigError, match=r"^run 'p2ploco''s config says a round holds 2,561 tokens: no whole number "
                                          r"of sequences of data.seq_len=128 tokens in each of its inner.steps=20 "
                                          r"steps; its peers serve a broken config: join another run$"):
        config_of_run({**document, "round_tokens": 2561}, Config())


def test_peers_that_speak_another_protocol_version_have_another_fingerprint(monkeypatch):
    """Messages changed between versions: such peers must never meet in a round (the newcomer refuses to start)."""
    current = Config().swarm_fingerprint()
    monkeypatch.setattr(config_sections, "PROTOCOL_VERSION", config_sections.PROTOCOL_VERSION - 1)
    assert Config().swarm_fingerprint() != current


@pytest.mark.parametrize("overrides, message", [
    (["pipeline.stages=5"], "pipeline.stages (5) must be in [1, model.n_layer=4]: every stage holds a layer"),
    (["pipeline.rank=128"], "pipeline.rank (128) must be in [1, model.d_model=128)"),
    (["pipeline.rank=0"], "pipeline.rank (0) must be in [1, model.d_model=128)"),
    (["model.tie_embeddings=true"], "pipeline.stages=2 needs model.tie_embeddings: false"),
    (["pipeline.compression=lossy"], "pipeline.compression must be one of selective, uniform, none"),
])
def test_bad_pipeline_settings_are_rejected_with_one_line(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config("configs/tiny-pipeline.yaml", overrides)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_pipeline_settings_are_part_of_the_fingerprint_and_rank_only_matters_when_compressed():
    pipeline = load_config("configs/tiny-pipeline.yaml")
    assert pipeline.pipeline.compressed
    assert pipeline.swarm_fingerprint() != load_config("configs/tiny-pipeline.yaml",
                                                       ["pipeline.rank=16"]).swarm_fingerprint()
    plain = load_config("configs/tiny-pipeline.yaml", ["pipeline.compression=none", "pipeline.rank=0"])
    assert not plain.pipeline.compressed  # an uncompressed boundary has no rank to check


def test_a_value_is_checked_where_it_is_set_and_its_bounds_once_all_are(tmp_path):
    """A wrong type is refused in the file that holds it, even if --set gives the key again; a value out of bounds
    may be put right by a later setting, as bounds are checked once the whole config is built."""
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("inner:\n  lr: fast\n")
    with pytest.raises(ConfigError, match=r"wrong.yaml: inner.lr must be a number; got 'fast'"):
        load_config(wrong, ["inner.lr=1e-3"])
    low = tmp_path / "low.yaml"
    low.write_text("inner:\n  lr: -1\n")
    assert load_config(low, ["inner.lr=1e-3"]).inner.lr == 1e-3


def test_a_sharded_replica_is_refused_where_replicas_project_their_weights_whole():
    pipeline = "configs/tiny-pipeline.yaml"
    load_config(pipeline, ["training.shard=true"])  # selective compression: replicas train unconstrained
    with pytest.raises(ConfigError) as error:
        load_config(pipeline, ["training.shard=true", "pipeline.compression=uniform"])
    assert str(error.value) == ("training.shard does not go with pipeline.compression=uniform (whose replicas project "
                                "their weights whole): use selective compression, or training.shard=false")


def test_a_peer_evaluates_every_eval_every_rounds_and_after_the_runs_last():
    training = load_config(None, ["training.eval_every=3", "training.rounds=8"]).training
    assert [r for r in range(8) if training.evaluates_after(r)] == [0, 3, 6, 7]
    endless = load_config(None, ["training.eval_every=3"]).training  # rounds 0: no last round
    assert [r for r in range(8) if endless.evaluates_after(r)] == [0, 3, 6]
