"""Export to Hugging Face: transformers' LlamaForCausalLM computes what p2ploco's model computes."""

import json
from types import SimpleNamespace

import pytest
import torch
import transformers
from click.testing import CliRunner
from safetensors.torch import load_file
from tokenizers import processors

from p2ploco import checkpoint
from p2ploco.build import run_subspace
from p2ploco.cli import main
from p2ploco.config import ModelConfig, load_config
from p2ploco.data.tokenizer import ByteTokenizer, train_bpe
from p2ploco.export.hf import hf_config, hf_state_dict
from p2ploco.export.tokenizer import write
from p2ploco.model import Transformer
from p2ploco.sample import generate


def hf_model(model: Transformer, config: ModelConfig, token_table=None):
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config(config, torch.float32)))
    missing, unexpected = llama.load_state_dict(hf_state_dict(dict(model.state_dict()), config, token_table),
                                                strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied: the head is the embedding
    return llama.eval()


@pytest.mark.parametrize("tied", [True, False])
def test_transformers_logits_equal_ours(tied):
    config = ModelConfig(vocab_size=257, n_layer=2, n_head=4, d_model=64, max_seq_len=64, tie_embeddings=tied)
    model = Transformer(config, seed=3).eval()
    with torch.no_grad():  # trained-looking norm gains, not all ones
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    idx = torch.randint(0, config.vocab_size, (3, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(idx)
        theirs = hf_model(model, config)(idx).logits
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()


TEXTS = ["Hello, world!", "  two spaces, a tab\tand a newline\n", "ünïcödé → 漢字 🙂", "<|endoftext|> is text here"]


def test_auto_tokenizer_round_trips_text_for_the_byte_level_and_a_bpe_tokenizer(tmp_path):
    corpus = ["the quick brown fox jumps over the lazy dog " * 20, "pack my box with five dozen liquor jugs " * 20]
    bpe = train_bpe(iter(corpus), 300, tmp_path / "bpe.json")
    for name, tokenizer in (("bytes", ByteTokenizer()), ("bpe", bpe)):
        out = tmp_path / name
        out.mkdir()
        write(tokenizer, out, 64)
        auto = transformers.AutoTokenizer.from_pretrained(out)
        assert auto.is_fast and auto.eos_token_id == tokenizer.eot
        for text in TEXTS:
            ids = auto.encode(text, add_special_tokens=False)
            assert auto.decode(ids) == text
            if name == "bytes":  # the same ids as p2ploco's: UTF-8 bytes
                assert ids == list(text.encode())
            else:
                assert ids == list(tokenizer.encode_batch([text.encode()])[0])
        # a text starts after an end-of-text, as in training and in `p2ploco sample`
        assert auto.encode(TEXTS[0]) == [tokenizer.eot, *auto.encode(TEXTS[0], add_special_tokens=False)]
        assert auto.decode(auto.encode(TEXTS[0]), skip_special_tokens=True) == TEXTS[0]
    # A tokenizer.json that adds a token after each text: p2ploco never adds it, so the export must not either.
    bpe.tokenizer.post_processor = processors.TemplateProcessing(single="$A <|endoftext|>",
                                                                 special_tokens=[("<|endoftext|>", bpe.eot)])
    write(bpe, tmp_path / "bpe", 64)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "bpe")
    assert auto.encode(TEXTS[0]) == [bpe.eot, *bpe.encode_batch([TEXTS[0].encode()])[0]]


def run_dir(tmp_path, name, config, params, rounds=(5,)):
    """A node's --log-dir as a node leaves it: config.json and checkpoints of ``rounds``, the parameters of each
    ``params`` plus the round's number (by default round 5: ``params``, plus 0)."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config.model_dump()))
    for round_index in rounds:
        shifted = {name: p + (round_index - rounds[-1]) for name, p in params.items()}
        checkpoint.save(folder / "checkpoint", checkpoint.Checkpoint(round_index, shifted, {}, {}), config.run_id, "f")
    return folder / "checkpoint"


def p2ploco(*args: str) -> SimpleNamespace:
    """The CLI run in this process, which has torch and transformers loaded already (a new process spends seconds
    importing them): its exit code and output. An exception other than the CLI's exit is raised here."""
    result = CliRunner().invoke(main, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return SimpleNamespace(returncode=result.exit_code, stdout=result.stdout, stderr=result.stderr)


def test_an_exported_checkpoint_loads_in_transformers_with_the_same_logits_and_greedy_tokens(tmp_path):
    config = load_config("configs/tiny.yaml", ["model.n_layer=4", "model.tie_embeddings=false", "pipeline.stages=2"])
    table = run_subspace(config, torch.device("cpu")).table  # compressed stage boundaries: h0 = E[tok] + F[tok]
    model = Transformer(config.model, config.training.seed, token_table=table).eval()
    params = {name: p.detach() for name, p in model.named_parameters()}
    whole = run_dir(tmp_path, "replica", config, params)
    stages = [run_dir(tmp_path, f"stage{s}", config, {n: p for n, p in params.items() if keep(n)})
              for s, keep in enumerate([lambda n: not n.startswith(("blocks.2", "blocks.3", "norm", "lm_head")),
                                        lambda n: n.startswith(("blocks.2", "blocks.3", "norm", "lm_head"))])]
    idx = torch.randint(0, config.model.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(idx)
    prompt = list(b"The quick brown fox")
    for name, sources in (("whole", [whole]), ("stages", stages)):
        result = p2ploco("export", *map(str, sources), "--out", str(tmp_path / name), "--dtype", "fp32")
        assert result.returncode == 0, result.stderr
        llama = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name).eval()
        assert type(llama).__name__ == "LlamaForCausalLM"
        with torch.no_grad():
            theirs = llama(idx).logits
        assert torch.allclose(ours, theirs, atol=1e-5, rtol=0), (ours - theirs).abs().max()
        print(f"\nexported from {name}: max |logit difference| {(ours - theirs).abs().max():.2e} (fp32)")
        greedy = llama.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, min_new_tokens=20)
        assert greedy[0, len(prompt):].tolist() == generate(model, prompt, 20)


@pytest.mark.parametrize("args, message", [
    (["{tmp}/nothing"], "is not a checkpoint (no checkpoint.json)"),
    (["{tmp}/stage0/checkpoint"], "the checkpoints hold no layer(s) 2-3 of the model"),
    (["{tmp}/stage0/checkpoint", "{tmp}/late/checkpoint"], "the checkpoints hold no round in common ({tmp}/stage0/"
                                                           "checkpoint: 5; {tmp}/late/checkpoint: 6)"),
    (["{tmp}/stage0/checkpoint", "{tmp}/stage0/checkpoint"], "{tmp}/stage0/checkpoint and {tmp}/stage0/checkpoint "
                                                             "both hold layer(s) 0-1 of the model"),
    (["{tmp}/stage0/checkpoint", "--format", "gguf"], "Invalid value for '--format'"),
])
def test_export_refuses_what_is_not_one_whole_model_in_one_line(tmp_path, args, message):
    config = load_config("configs/tiny.yaml", ["model.n_layer=4", "model.tie_embeddings=false", "pipeline.stages=2"])
    params = {name: p.detach() for name, p in Transformer(config.model, config.training.seed).named_parameters()}
    first = {n: p for n, p in params.items() if not n.startswith(("blocks.2", "blocks.3", "norm", "lm_head"))}
    run_dir(tmp_path, "stage0", config, first)
    run_dir(tmp_path, "late", config, {n: p for n, p in params.items() if n not in first}, rounds=(6,))
    (tmp_path / "nothing").mkdir()
    result = p2ploco("export", *[a.format(tmp=tmp_path) for a in args], "--out", str(tmp_path / "out"))
    assert result.returncode != 0 and message.format(tmp=tmp_path) in result.stderr
    assert sum(line.lower().startswith("error") for line in result.stderr.splitlines()) == 1  # one line says it


def two_stages(tmp_path, rounds_0, rounds_1):
    """The checkpoint folders of a pipeline's two stages that saved ``rounds_0`` and ``rounds_1``; the
    whole model's parameters at round r are the seed's plus r."""
    config = load_config("configs/tiny.yaml", ["model.n_layer=4", "model.tie_embeddings=false", "pipeline.stages=2"])
    params = {name: p.detach() for name, p in Transformer(config.model, config.training.seed).named_parameters()}
    first = {n: p for n, p in params.items() if not n.startswith(("blocks.2", "blocks.3", "norm", "lm_head"))}
    return [run_dir(tmp_path, "s0", config, {n: p + rounds_0[-1] for n, p in first.items()}, rounds_0),
            run_dir(tmp_path, "s1", config, {n: p + rounds_1[-1] for n, p in params.items() if n not in first},
                    rounds_1)], params


def exported_norm(out):
    return load_file(out / "model.safetensors")["model.norm.weight"]


def test_export_of_stages_stopped_a_round_apart_takes_the_newest_round_both_hold_or_the_round_asked_for(tmp_path):
    """Stopped with Ctrl-C at once, stage 0 wrote its exit checkpoint of round 79, stage 1 of round 80 (the round
    of its last periodic one, saved again): round 70 is the newest both hold."""
    stages, params = two_stages(tmp_path, (60, 70, 79), (60, 70, 80, 80))
    newest = p2ploco("export", *map(str, stages), "--out", str(tmp_path / "newest"), "--dtype", "fp32")
    assert newest.returncode == 0, newest.stderr
    assert newest.stdout.startswith(f"exported tiny at round 70, the newest round they all hold from {stages[0]}, "
                                    f"{stages[1]} (hf, fp32) to {tmp_path / 'newest'}"), newest.stdout
    assert torch.equal(exported_norm(tmp_path / "newest"), params["norm.weight"] + 70)
    asked = p2ploco("export", *map(str, stages), "--round", "60", "--out", str(tmp_path / "asked"), "--dtype", "fp32")
    assert asked.returncode == 0 and "at round 60 from" in asked.stdout, asked.stderr
    assert torch.equal(exported_norm(tmp_path / "asked"), params["norm.weight"] + 60)
    lacking = p2ploco("export", *map(str, stages), "--round", "79", "--out", str(tmp_path / "lacking"))
    assert lacking.returncode == 1 and lacking.stderr == (f"error: {stages[1]} holds no checkpoint of round 79 (it "
                                                          f"holds 80, 70, 60): pass --round 70 or 60\n")
    assert not (tmp_path / "lacking").exists()
    (stages[1] / "state-70.safetensors").write_bytes(b"\0" * 64)
    corrupt = p2ploco("export", *map(str, stages), "--out", str(tmp_path / "corrupt"))
    assert corrupt.returncode == 1 and corrupt.stderr == (f"error: checkpoint file {stages[1]}/state-70.safetensors is "
                                                          f"corrupt (checksum mismatch): pass --round 60\n")


def test_export_refuses_a_folder_with_files_in_it_unless_told_to_overwrite_and_writes_nothing(tmp_path):
    stages, _ = two_stages(tmp_path, (5,), (5,))
    out = tmp_path / "mine"
    out.mkdir()
    (out / "config.json").write_text("the user's own")
    refused = p2ploco("export", *map(str, stages), "--out", str(out))
    assert refused.returncode == 2 and refused.stderr == (f"error: --out {out} already exists and is not empty; choose "
                                                          f"a new folder, or pass --overwrite to write over its files "
                                                          f"(nothing was written)\n")
    assert [p.name for p in out.iterdir()] == ["config.json"] and (out / "config.json").read_text() == "the user's own"
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    on_a_file = p2ploco("export", *map(str, stages), "--out", str(a_file))
    assert on_a_file.stderr == f"error: --out {a_file} is a file; choose a folder (nothing was written)\n"
    overwritten = p2ploco("export", *map(str, stages), "--out", str(out), "--overwrite")
    assert overwritten.returncode == 0 and "at round 5 from" in overwritten.stdout, overwritten.stderr
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]


def test_sample_continues_a_prompt_with_our_own_model_the_same_way_for_the_same_seed(tmp_path):
    config = load_config("configs/tiny.yaml")
    model = Transformer(config.model, config.training.seed).eval()
    folder = run_dir(tmp_path, "replica", config, {name: p.detach() for name, p in model.named_parameters()})
    drawn = [p2ploco("sample", str(folder), "--prompt", "Once", "--max-new-tokens", "12", "--seed", str(seed))
             for seed in (1, 1, 2)]
    assert all(r.returncode == 0 for r in drawn), drawn[0].stderr
    assert drawn[0].stdout == drawn[1].stdout != drawn[2].stdout and drawn[0].stdout.startswith("Once")
    greedy = p2ploco("sample", str(folder), "--prompt", "Once", "--max-new-tokens", "12", "--temperature", "0")
    expected = bytes(i for i in generate(model, [256, *b"Once"], 12, stop=256) if i < 256)
    assert greedy.stdout == "Once" + expected.decode("utf-8", errors="replace") + "\n"


def test_sample_and_transformers_continue_a_prompt_alike_on_a_trained_checkpoint(tmp_path):
    """Trained until its greedy continuation of the prompt is text, not whitespace: `p2ploco sample` and
    transformers' greedy generation on the export, from the exported tokenizer's encoding of the prompt, write the
    same continuation. The documents continue "x" with 1s at their start and with 2s after it, so what comes
    before the prompt decides (an export that does not start a text as `sample` does continues with 2s)."""
    config = load_config("configs/tiny.yaml", ["model.n_layer=1", "model.d_model=64", "data.seq_len=48"])
    model = Transformer(config.model, config.training.seed)
    stream = torch.tensor([ByteTokenizer().eot, *b"x1111111 x2222222 x2222222 "] * 60)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    for _ in range(150):
        starts = torch.randint(0, len(stream) - 49, (8,), generator=generator)
        windows = torch.stack([stream[s:s + 49] for s in starts.tolist()])
        loss = torch.nn.functional.cross_entropy(model(windows[:, :-1]).flatten(0, 1), windows[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    folder = run_dir(tmp_path, "replica", config, {name: p.detach() for name, p in model.named_parameters()})
    prompt = "x"
    ours = p2ploco("sample", str(folder), "--prompt", prompt, "--max-new-tokens", "24", "--temperature", "0")
    assert ours.returncode == 0, ours.stderr
    continuation = ours.stdout.removesuffix("\n").removeprefix(prompt)
    assert continuation.startswith("1111111 x2222222"), ours.stdout  # trained: text, not whitespace
    assert p2ploco("export", str(folder), "--out", str(tmp_path / "hf"), "--dtype", "fp32").returncode == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    llama = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    greedy = llama.generate(ids, max_new_tokens=24, do_sample=False)
    assert tokenizer.decode(greedy[0], skip_special_tokens=True) == prompt + continuation
