"""Export to Hugging Face: transformers' LlamaForCausalLM computes what p2ploco's model computes."""

import pytest
import torch

from p2ploco.config import ModelConfig
from p2ploco.export.hf import hf_config, hf_state_dict
from p2ploco.model import Transformer

transformers = pytest.importorskip("transformers")  # the test extra installs it; the default install does not


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
    from p2ploco.data.tokenizer import ByteTokenizer, train_bpe
    from p2ploco.export.tokenizer import write

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
