import pytest
import torch

from p2ploco.config import ModelConfig
from p2ploco.model import Transformer, apply_rotary, rotary_tables, stage_layers


def test_same_seed_same_weights_and_tying():
    config = ModelConfig(n_layer=2, d_model=64, n_head=4, max_seq_len=32)
    a, b, c = Transformer(config, 1), Transformer(config, 1), Transformer(config, 2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.embed.weight, c.embed.weight)
    assert a.lm_head.weight is a.embed.weight
    untied = Transformer(ModelConfig(n_layer=2, d_model=64, n_head=4, max_seq_len=32, tie_embeddings=False), 1)
    assert untied.lm_head.weight is not untied.embed.weight
    assert sum(p.numel() for p in untied.parameters()) == sum(p.numel() for p in a.parameters()) + 257 * 64


def test_forward_is_causal_and_loss_starts_near_uniform():
    config = ModelConfig(n_layer=2, d_model=64, n_head=4, max_seq_len=32)
    model = Transformer(config, 0).eval()
    tokens = torch.randint(0, 257, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 257)
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 257
    assert torch.allclose(model(changed)[:, :10], logits[:, :10], atol=1e-5)  # the future does not leak back
    loss = model(tokens, targets=torch.randint(0, 257, (2, 16)))
    assert abs(loss.item() - torch.log(torch.tensor(257.0)).item()) < 0.5


def test_rotary_preserves_norms_and_is_relative():
    cos, sin = rotary_tables(8, 16, 10000.0)
    q = torch.randn(1, 1, 16, 8)
    rotated = apply_rotary(q, cos, sin)
    assert torch.allclose(rotated.norm(dim=-1), q.norm(dim=-1), atol=1e-5)
    k = torch.randn(1, 1, 1, 8)
    # <R_m q, R_n k> depends on m - n only
    qs, ks = apply_rotary(q[:, :, :1].expand(1, 1, 16, 8), cos, sin), apply_rotary(k.expand(1, 1, 16, 8), cos, sin)
    dots = [(qs[0, 0, m] * ks[0, 0, m - 3]).sum() for m in range(3, 16)]
    assert torch.allclose(torch.stack(dots), dots[0].expand(len(dots)), atol=1e-4)


def test_a_stage_built_alone_holds_the_same_weights_as_that_slice_of_the_whole_model():
    config = ModelConfig(n_layer=5, d_model=64, n_head=4, max_seq_len=32, tie_embeddings=False)
    whole = dict(Transformer(config, 7).named_parameters())
    for stages in (2, 3, 5):
        seen = []
        for layers in stage_layers(config.n_layer, stages):
            stage = Transformer(config, 7, layers)
            names = [name for name, _ in stage.named_parameters()]
            assert ("embed.weight" in names) == (layers.start == 0)
            assert ("lm_head.weight" in names) == (layers.stop == config.n_layer)
            for name, p in stage.named_parameters():
                assert torch.equal(p, whole[name]), name
            seen += names
        assert sorted(seen) == sorted(whole)  # every tensor on exactly one stage
    other_seed = dict(Transformer(config, 8, range(2, 4)).named_parameters())
    assert not torch.equal(other_seed["blocks.2.attn.qkv.weight"], whole["blocks.2.attn.qkv.weight"])


def test_tied_embeddings_cannot_be_split_and_slices_must_fit():
    tied = ModelConfig(n_layer=4, d_model=64, n_head=4, max_seq_len=32)
    with pytest.raises(ValueError, match="tied embeddings"):
        Transformer(tied, 0, range(0, 2))
    with pytest.raises(ValueError, match="not a slice"):
        Transformer(ModelConfig(n_layer=4, tie_embeddings=False), 0, range(2, 6))
