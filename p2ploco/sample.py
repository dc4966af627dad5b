"""Text from a trained model: autoregressive sampling with p2ploco's own model (no KV cache: each new token runs
the whole window again, which is fine for the short samples a person reads)."""

from __future__ import annotations

from pathlib import Path

import torch

from p2ploco.data.tokenizer import Tokenizer
from p2ploco.model import Transformer
from p2ploco.trained import TrainedModel


@torch.no_grad()
def generate(model: Transformer, ids: list[int], max_new_tokens: int, temperature: float = 0.0,
             generator: torch.Generator | None = None, stop: int | None = None) -> list[int]:
    """``ids`` continued by up to ``max_new_tokens`` tokens: the most likely one at ``temperature`` 0 (greedy),
    else drawn from softmax(logits / temperature); ends early at ``stop``. The window is the model's last
    ``max_seq_len`` tokens."""
    device = next(model.parameters()).device
    out = list(ids)
    for _ in range(max_new_tokens):
        window = torch.tensor([out[-model.config.max_seq_len:]], device=device)
        logits = model(window)[0, -1].float()
        if temperature <= 0:
            token = int(logits.argmax())
        else:
            # less the largest logit first: a tiny temperature gives -inf (probability 0), never inf - inf (NaN)
            probs = torch.softmax((logits - logits.max()) / temperature, dim=-1).cpu()
            token = int(torch.multinomial(probs, 1, generator=generator))
        out.append(token)
        if token == stop:
            break
    return out[len(ids):]


def continue_text(model: Transformer, tokenizer: Tokenizer, prompt: str, max_new_tokens: int,
                  temperature: float, generator: torch.Generator | None = None) -> str:
    """The text the model writes after ``prompt`` (after a document's start when it is empty), up to the end of
    its document or ``max_new_tokens`` tokens."""
    ids = [tokenizer.eot, *(int(i) for i in tokenizer.encode_batch([prompt.encode()])[0])]
    new = generate(model, ids, max_new_tokens, temperature, generator, stop=tokenizer.eot)
    return tokenizer.decode([i for i in new if i != tokenizer.eot])


def sample_checkpoints(directories: list[Path], prompt: str, max_new_tokens: int, temperature: float = 0.8,
                       seed: int = 0) -> str:
    """What the model of the checkpoints in ``directories`` (``TrainedModel.read``) writes after ``prompt``, with
    draws seeded by ``seed``: ``p2ploco sample``, and the demo's last lines."""
    trained = TrainedModel.read(directories)
    return continue_text(trained.model(), trained.tokenizer(), prompt, max_new_tokens, temperature,
                         torch.Generator().manual_seed(seed))
