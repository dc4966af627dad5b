"""Tokens for training: tokenizers, corpora, the train/eval split, prepared shards and per-peer sampling.

- ``tokenizer``: byte-level (the default), a local Hugging Face ``tokenizer.json``, BPE training.
- ``entries``: a corpus's entries: text files, JSONL lines, folders, the embedded standard-library corpus.
- ``split``: hold out whole entries when there are enough, else an evenly spread share of blocks.
- ``tokenize``: a corpus through a tokenizer into a training and a held-out token stream.
- ``streams``: token streams read as windows; ``prepared``: shards on disk, manifest, memmap.
- ``sampler``: each peer's walk over the training windows, the fixed held-out windows.
- ``load``: what a node trains on, loaded and checked before it joins a swarm.
"""

from p2ploco.data.entries import Entry, Sources
from p2ploco.data.load import TrainingData, load_training_data
from p2ploco.data.prepared import Manifest, open_prepared, prepare, read_manifest
from p2ploco.data.sampler import Batch, Permutation, ShardSampler, eval_batches
from p2ploco.data.split import Split, is_held_out, plan_split
from p2ploco.data.streams import MemorySink, TokenStream
from p2ploco.data.tokenizer import ByteTokenizer, HuggingFaceTokenizer, Tokenizer, load_tokenizer, train_bpe

__all__ = [
    "Batch", "ByteTokenizer", "Entry", "HuggingFaceTokenizer", "Manifest", "MemorySink", "Permutation",
    "ShardSampler", "Sources", "Split", "TokenStream", "Tokenizer", "TrainingData", "eval_batches", "is_held_out",
    "load_tokenizer", "load_training_data", "open_prepared", "plan_split", "prepare", "read_manifest", "train_bpe",
]
