"""The run's tokenizer as a Hugging Face fast tokenizer: ``tokenizer.json`` and ``tokenizer_config.json``, which
``AutoTokenizer.from_pretrained`` loads as ``PreTrainedTokenizerFast`` with no custom code.

A BPE tokenizer of ``p2ploco data`` is a ``tokenizers`` tokenizer already and is written as it is. The byte-level
one (UTF-8 bytes are ids 0..255, 256 ends a document) becomes a byte-level BPE without merges: GPT-2's byte-level
pre-tokenizer maps every byte to one printable character, and the vocabulary gives the character of byte b the
id b, so any text encodes to its UTF-8 bytes and decodes back exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors

from p2ploco.data.tokenizer import EOT_NAMES, ByteTokenizer, HuggingFaceTokenizer, Tokenizer


def byte_level() -> RustTokenizer:
    """``ByteTokenizer`` as a ``tokenizers`` tokenizer (same ids, same end-of-text)."""
    characters = _bytes_to_unicode()
    vocab = {characters[b]: b for b in range(256)}
    tokenizer = RustTokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([EOT_NAMES[0]])  # id 256, ByteTokenizer.eot
    return tokenizer


def write(tokenizer: Tokenizer, out: Path, max_length: int) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` of ``tokenizer`` in ``out``."""
    # p2ploco's byte-level tokenizer reads "<|endoftext|>" in text as its 13 bytes (only document ends are 256);
    # a BPE tokenizer of ``p2ploco data`` reads it as the special token, as transformers does by default.
    if isinstance(tokenizer, HuggingFaceTokenizer):
        rust = RustTokenizer.from_str(tokenizer.tokenizer.to_str())
        eot, split_special = rust.id_to_token(tokenizer.eot), False
    elif isinstance(tokenizer, ByteTokenizer):
        rust, eot, split_special = byte_level(), EOT_NAMES[0], True
    else:
        raise TypeError(f"no export for {type(tokenizer).__name__}")
    # A document starts after an end-of-text in training, and ``p2ploco sample`` starts a prompt so: the exported
    # tokenizer puts it in front of a text too (transformers applies a tokenizer.json's post-processor by default),
    # and nothing else (a tokenizer.json's own post-processor, which p2ploco never applied, is replaced).
    rust.post_processor = processors.TemplateProcessing(single=f"{eot} $A", pair=f"{eot} $A {eot} $B",
                                                        special_tokens=[(eot, tokenizer.eot)])
    rust.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eot, "bos_token": eot, "pad_token": None,
              "unk_token": None, "model_max_length": max_length, "clean_up_tokenization_spaces": False,
              "split_special_tokens": split_special}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of the 256 bytes to printable characters (what the byte-level pre-tokenizer emits)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    characters, extra = {}, 0
    for b in range(256):
        if b in printable:
            characters[b] = chr(b)
        else:
            characters[b] = chr(256 + extra)
            extra += 1
    return characters
