"""A p2ploco model as Hugging Face's Llama: the weights renamed and re-laid out, and the config.

Our decoder is LLaMA's (RMSNorm, rotary embeddings, SwiGLU) up to two exact re-layouts:

- q, k and v are one fused ``qkv`` matrix (rows: q, then k, then v): split into ``q_proj``, ``k_proj``, ``v_proj``;
- the rotary embedding rotates interleaved pairs ``(x[2i], x[2i+1])`` of each head, where HF's Llama rotates
  halves ``(x[i], x[i + D/2])``, both by the angle of frequency i. Permuting each head's q and k rows so that
  the even ones come first and the odd ones after (Meta's checkpoints to HF: the same permutation) makes HF's
  rotation of the permuted rows ours of the originals; the attention scores q·k are unchanged, since q and k
  are permuted alike.

A subspace-compressed run adds a frozen random table to the embedding (h0 = E[tok] + F[tok]): the exported
embedding is E + F. Tied embeddings stay tied.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from p2ploco.config import ModelConfig
from p2ploco.errors import ConfigError
from p2ploco.export.tokenizer import write as write_tokenizer
from p2ploco.model import ffn_width
from p2ploco.trained import TrainedModel

RENAMES = {  # ours (after "blocks.<i>.") -> HF's (after "model.layers.<i>.")
    "attn_norm.weight": "input_layernorm.weight",
    "attn.out.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}


def interleaved_to_halves(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Rows of a q or k projection, re-ordered per head from interleaved rotary pairs to halves."""
    rows, columns = weight.shape
    head_dim = rows // n_head
    return weight.view(n_head, head_dim // 2, 2, columns).transpose(1, 2).reshape(rows, columns)


def hf_state_dict(params: dict[str, torch.Tensor], config: ModelConfig,
                  token_table: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """HF Llama's tensors from the whole model's global parameters (names as ``model.Transformer`` has them)."""
    out: dict[str, torch.Tensor] = {}
    embed = params["embed.weight"]
    out["model.embed_tokens.weight"] = embed + token_table.to(embed.dtype) if token_table is not None else embed
    d = config.d_model
    for i in range(config.n_layer):
        ours, theirs = f"blocks.{i}.", f"model.layers.{i}."
        q, k, v = params[ours + "attn.qkv.weight"].split(d, dim=0)
        out[theirs + "self_attn.q_proj.weight"] = interleaved_to_halves(q, config.n_head)
        out[theirs + "self_attn.k_proj.weight"] = interleaved_to_halves(k, config.n_head)
        out[theirs + "self_attn.v_proj.weight"] = v
        for name, hf_name in RENAMES.items():
            out[theirs + hf_name] = params[ours + name]
    out["model.norm.weight"] = params["norm.weight"]
    if not config.tie_embeddings:
        out["lm_head.weight"] = params["lm_head.weight"]
    return {name: tensor.detach().contiguous() for name, tensor in out.items()}


def hf_config(config: ModelConfig, dtype: torch.dtype, eot: int | None = None) -> dict[str, Any]:
    """``config.json`` of the exported model: LlamaForCausalLM, no custom code. The rotary base is given both
    as transformers 5 reads it (``rope_parameters``) and as older readers and converters do (``rope_theta``). The
    end-of-text token ``eot`` ends a text and starts one (as ``p2ploco sample`` starts a prompt)."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": config.vocab_size, "hidden_size": config.d_model, "intermediate_size": ffn_width(config),
        "num_hidden_layers": config.n_layer, "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_head, "head_dim": config.d_model // config.n_head, "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len, "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "tie_word_embeddings": config.tie_embeddings, "attention_bias": False, "mlp_bias": False,
        "initializer_range": config.init_std, "use_cache": True, "bos_token_id": eot, "eos_token_id": eot,
        "torch_dtype": str(dtype).removeprefix("torch."), "dtype": str(dtype).removeprefix("torch."),
    }


def export(directories: list[Path], out: Path, dtype: torch.dtype, round_index: int | None = None,
           overwrite: bool = False) -> TrainedModel:
    """Write the model of ``directories`` at ``round_index`` (``TrainedModel.read``) to ``out`` as transformers'
    LlamaForCausalLM: config.json, generation_config.json, model.safetensors and the tokenizer. ConfigError, before
    anything is read or written, if ``out`` is a file, or a folder with files in it and not ``overwrite``. Returns
    the model it wrote."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; choose a folder (nothing was written)")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConfigError(f"--out {out} already exists and is not empty; choose a new folder, or pass --overwrite to "
                          f"write over its files (nothing was written)")
    trained = TrainedModel.read(directories, round_index)
    config, subspace, tokenizer = trained.config, trained.subspace(), trained.tokenizer()
    tensors = hf_state_dict(trained.params, config.model, subspace.table if subspace else None)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(config.model, dtype, tokenizer.eot), indent=2))
    # no max_length: transformers warns whenever a caller's max_new_tokens meets one; the config's
    # max_position_embeddings already says how long a window the model knows
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": tokenizer.eot,
                                                            "eos_token_id": tokenizer.eot}, indent=2))
    weights = out / "model.safetensors"
    save_file({name: t.to(dtype) for name, t in tensors.items()}, str(weights), metadata={"format": "pt"})
    weights.chmod((out / "config.json").stat().st_mode & 0o777)  # safetensors writes 0600; the rest follow umask
    write_tokenizer(tokenizer, out, config.model.max_seq_len)
    return trained
