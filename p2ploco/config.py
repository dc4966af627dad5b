"""Typed run configuration: dataclasses, YAML files, ``--set key=value`` overrides, validation.

Every key of every section can be set from YAML or from the command line; unknown keys, wrong
types and impossible values are rejected with one line that names the key and the fix.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import hashlib
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from p2ploco import PROTOCOL_VERSION
from p2ploco.errors import ConfigError

MIN_PEER_TTL = 8.0  # seconds; hivemind's DHT waits up to 3 s for a peer in a lookup
MAX_WAIT = 3600.0  # seconds: the longest any one wait of a round may be set to (every wait is bounded)
MAX_STARTUP_WAIT = 86400.0
MAX_BAN_ROUNDS = 1000
MAX_GROUP_SIZE = 1 << 20  # LoCo's quantization groups: one scale per at most this many values


@dataclass
class ModelConfig:
    """LLaMA-style decoder shape (see ``p2ploco.model``)."""

    vocab_size: int = 257
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    d_ff: int = 0  # SwiGLU hidden width; 0 means 8/3 * d_model rounded up to a multiple of 64
    max_seq_len: int = 256
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02


@dataclass
class DataConfig:
    """Where tokens come from: text read at start (``paths``; empty means the embedded standard-library
    corpus), or a corpus tokenized beforehand by ``p2ploco data prepare`` (``prepared``, memory-mapped)."""

    paths: list[str] = field(default_factory=list)  # text files, JSONL files (a "text" per line), folders
    prepared: str = ""  # a folder written by `p2ploco data prepare`; its manifest decides tokenizer and split
    tokenizer: str = ""  # a Hugging Face tokenizer.json; empty means byte-level (256 bytes + end-of-text)
    seq_len: int = 128
    eval_percent: float = 2.0  # share held out for the eval loss: of the documents, or of blocks of text when few
    eval_sequences: int = 32  # held-out windows scored after each round


@dataclass
class InnerConfig:
    """The H local AdamW steps each replica runs between outer rounds."""

    steps: int = 20  # H
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 4e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    warmup_steps: int = 50
    # Cosine horizon in inner steps; 0 means training.rounds * steps, or a constant lr
    # after warm-up when the run has no round limit.
    total_steps: int = 0
    min_lr_ratio: float = 0.1
    # A round trains as many of its H steps as fit in the swarm's round budget (budget.py): this many seconds, or
    # (0) H times the fastest peer's step. fixed_steps: train H steps every round, however long they take.
    round_seconds: float = 0.0
    fixed_steps: bool = False


@dataclass
class OverlapConfig:
    """Whether a round's all-reduce runs while the next round's inner steps do (docs/design.md, "Overlapped
    rounds"), and how the replica trains on meanwhile."""

    overlap: bool = False
    # eager: the replica trains on from where its inner steps ended (its own pseudo-gradient standing in for the
    # round's average) and is rebased onto the new global params as soon as they land; naive: it keeps its own
    # progress and takes the outer step one round late.
    overlap_update: Literal["eager", "naive"] = "eager"


@dataclass
class DiLoCoConfig(OverlapConfig):
    """Dense mean of pseudo-gradients, outer SGD with Nesterov momentum (Douillard et al. 2023)."""

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    # Element type of pseudo-gradients on the wire; the reducer sums in float32.
    wire_dtype: Literal["float32", "float16", "bfloat16"] = "float32"


@dataclass
class SparseLoCoConfig(OverlapConfig):
    """Error feedback, chunked Top-k, 2-bit values (Sarfi et al. 2025)."""

    lr: float = 1.0  # alpha: scales the pseudo-gradient into the error buffer and the aggregate into the params
    error_decay: float = 0.95  # beta
    chunk_size: int = 64  # 2-D tensors are cut into tiles of up to chunk_size x chunk_size
    topk: int = 64  # values kept per full chunk_size^2 tile (64 of 4096 = 1/64 density)
    # mean: per coordinate over the replicas that selected it (reference code); sum: divide by all replicas.
    aggregate: Literal["mean", "sum"] = "mean"
    # What each span's reducer sends back. resparsified: the Top-k of the mean in 2 bits (per-peer traffic flat in
    # the swarm's size); exact: the contributions relayed or their union with float32 values (grows linearly).
    result: Literal["resparsified", "exact"] = "resparsified"
    result_topk: int = 128  # values a resparsified result keeps per full chunk_size^2 tile (1/32 density)
    # The reducer keeps what a result leaves out, e = result_error_decay * e + mean. 0: dropped (the next
    # pseudo-gradients bring it again, as the global params did not move that way); 1: kept whole, and counted
    # twice with what the senders bring again (docs/design.md, "Hundreds of peers": 0.5 measured best).
    result_error_decay: float = 0.5


@dataclass
class LoCoConfig(OverlapConfig):
    """Error-compensated low-bit pseudo-gradients (Xie et al. 2024) with DiLoCo's outer step.

    What quantization drops is kept in a buffer e, a moving average of past errors, and added back before
    the next quantization, by every hop that quantizes (the sender, and the reducer of each span)."""

    bits: int = 4  # per value on the wire: 2, 4 or 8 (symmetric codes in [-(2^(bits-1) - 1), 2^(bits-1) - 1])
    group_size: int = 128  # consecutive values of a tensor that share one float32 scale
    beta: float = 0.8  # e <- beta * e + (1 - beta) * (what this quantization dropped)
    reset_every: int = 1024  # rounds whose index is a multiple of this start with empty buffers
    lr: float = 0.7  # outer SGD with Nesterov momentum on the aggregate, as DiLoCo
    momentum: float = 0.9


@dataclass
class StreamingConfig:
    """Streaming DiLoCo (Douillard et al. 2025): the model in fragments that sync at staggered inner steps, each
    fragment's all-reduce overlapped with inner steps, 4-bit exchanged values.

    Fragment p (of P) is a strided group of blocks (p, p + P, ...; the embedding with fragment 0, the final norm
    and head with fragment P - 1). Within each round of H inner steps fragment p's all-reduce starts after inner
    step (p + 1)·H/P - delay and is applied after step (p + 1)·H/P; the local copy of the fragment then becomes
    alpha·local + (1 - alpha)·global."""

    fragments: int = 2  # P
    delay: int = 1  # tau: inner steps an all-reduce runs while training goes on; < inner.steps / fragments
    alpha: float = 0.5  # share of the local fragment kept when the synced one arrives (0: take the global one)
    lr: float = 0.7  # outer SGD with Nesterov momentum, per fragment
    momentum: float = 0.9
    bits: int = 4  # exchanged values: 4 (E3M0 floats, one float32 scale per 128) or 32 (float32)


@dataclass
class OuterConfig:
    """The outer algorithm applied to the replicas' pseudo-gradients; each has its own section."""

    algorithm: Literal["sparseloco", "diloco", "loco", "streaming"] = "sparseloco"
    # Each contribution to a span is scaled down to at most clip_factor x the median norm of the span's
    # contributions, scaled to the tokens it trained, before they are combined (a defence against poisoned updates);
    # 0: no clipping.
    clip_factor: float = 2.0
    # A contribution that points against the others of its span (among three or more) is left out of it, and its
    # sender banned by the reducers that catch it repeatedly (collective/robust.py, docs/design.md "Threat model").
    drop_opposed: bool = True
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)
    sparseloco: SparseLoCoConfig = field(default_factory=SparseLoCoConfig)
    loco: LoCoConfig = field(default_factory=LoCoConfig)
    streaming: StreamingConfig = field(default_factory=StreamingConfig)

    @property
    def overlap(self) -> Literal["eager", "naive"] | None:
        """How the chosen algorithm overlaps a round's all-reduce with the next round's inner steps (None: it does
        not; Streaming DiLoCo overlaps fragment by fragment within its own round)."""
        section = getattr(self, self.algorithm)
        return section.overlap_update if isinstance(section, OverlapConfig) and section.overlap else None


@dataclass
class PipelineConfig:
    """Pipeline groups of weak peers: the model cut into stages, and how stage boundaries are compressed.

    With ``stages > 1`` the parameters are exchanged as one named slice per stage (``stage0``, ...), so a
    group of stage peers can stand in for one replica next to full replicas (docs/pipeline.md).
    """

    stages: int = 1  # S: consecutive slices of the layers; 1 means no pipeline groups
    # Subspace compression of the activations crossing stage boundaries (Protocol Models):
    # selective: stage peers compress, full replicas train unconstrained (heterogeneous SparseLoCo);
    # uniform: every replica keeps its residual-writing weights in the subspace; none: boundaries send h.
    compression: Literal["selective", "uniform", "none"] = "selective"
    rank: int = 16  # k: values per token that cross a boundary (d_model / rank is the ratio)
    wire_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"  # element type of boundary messages

    @property
    def compressed(self) -> bool:
        """Whether boundaries are subspace-compressed (the model then adds a frozen token table)."""
        return self.stages > 1 and self.compression != "none"


@dataclass
class SwarmConfig:
    """Timeouts and sizes of the peer-to-peer rounds; every wait in a round is bounded."""

    matchmaking_timeout: float = 20.0  # longest wait from the first ready peer to the round's start
    allreduce_timeout: float = 60.0  # longest wait for any one transfer of an all-reduce, plus its bytes' time:
    min_bandwidth_mbit: float = 10.0  # the slowest link a transfer's deadline allows for (swarm/deadlines.py)
    bandwidth_mbit: float = 0.0  # this peer's link, published so others' deadlines fit it (0: not stated)
    max_transfer_timeout: float = 900.0  # cap on any one transfer's deadline, however large its payload
    heartbeat_interval: float = 2.0  # how often a node refreshes its record in the DHT
    peer_ttl: float = 10.0  # a record not refreshed for this long marks its peer as gone
    min_peers: int = 1  # peers (self included) to wait for before the first round
    startup_timeout: float = 120.0  # longest wait for min_peers at start; then train anyway
    ban_rounds: int = 10  # rounds a peer caught sending malformed data is left out of this node's rounds
    # whether other peers can dial this one (swarm/reachability.py): auto asks a peer to dial it back at start;
    # public, relayed (only through a circuit relay) or client (it can only dial out) skip the probe
    reachability: Literal["auto", "public", "relayed", "client"] = "auto"


@dataclass
class TrainingConfig:
    """How long to train, where, and how often to evaluate."""

    rounds: int = 0  # 0 means until stopped
    seed: int = 0
    device: str = "auto"  # auto, cpu, cuda, cuda:N
    threads: int = 0  # torch CPU threads; 0 keeps torch's default
    eval_every: int = 1  # rounds between eval-loss measurements
    checkpoint_every: int = 10  # rounds between checkpoints (0: only on exit)


@dataclass
class Config:
    run_id: str = "p2ploco"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    inner: InnerConfig = field(default_factory=InnerConfig)
    outer: OuterConfig = field(default_factory=OuterConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def round_tokens(self) -> int:
        """What a round can hold: H inner steps of the run's batch. No contribution weighs more (a peer's claim of
        its tokens is capped by it, ``collective/robust.py``), so every peer of a run must share it."""
        i = self.inner
        return i.steps * i.batch_size * i.grad_accum * self.data.seq_len

    def swarm_fingerprint(self, data: str = "") -> str:
        """Digest of what every peer of a round must share for identical global parameters and weights (and the
        protocol version their messages speak); ``data`` is ``TrainingData.fingerprint`` (a prepared corpus's
        digest, a non-default tokenizer's, or "")."""
        shared = {"model": dataclasses.asdict(self.model), "outer": dataclasses.asdict(self.outer),
                  "pipeline": dataclasses.asdict(self.pipeline), "seed": self.training.seed,
                  "round_tokens": self.round_tokens, "protocol": PROTOCOL_VERSION}
        if data:
            shared["data"] = data
        return hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:16]


def load_config(path: str | Path | None, overrides: typing.Sequence[str] = ()) -> Config:
    """Build a validated Config from an optional YAML file and ``key=value`` overrides."""
    config = Config()
    if path is not None:
        _apply_mapping(config, _read_yaml(Path(path)), source=str(path))
    return with_overrides(config, overrides)


def with_overrides(config: Config, overrides: typing.Sequence[str]) -> Config:
    """A validated copy of ``config`` with ``key=value`` overrides applied (as ``--set`` does)."""
    config = copy.deepcopy(config)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r}: expected key=value, e.g. --set inner.lr=3e-4")
        set_key(config, key.strip(), _parse_scalar(raw), source="--set")
    validate(config)
    return config


def set_key(config: Config, dotted_key: str, value: Any, source: str) -> None:
    """Set one dotted key (``inner.lr``) with type checking; a mapping value sets a whole section."""
    target: Any = config
    parts = dotted_key.split(".")
    for depth, name in enumerate(parts):
        if not dataclasses.is_dataclass(target):
            raise ConfigError(f"{source}: '{'.'.join(parts[:depth])}' is a value, not a section")
        names = [f.name for f in dataclasses.fields(target)]
        if name not in names:
            prefix = ".".join(parts[:depth])
            known = [f"{prefix}.{n}" if prefix else n for n in names]
            raise ConfigError(f"{source}: unknown config key '{dotted_key}'{_suggest(dotted_key, known)}")
        if depth == len(parts) - 1:
            hint = typing.get_type_hints(type(target))[name]
            if dataclasses.is_dataclass(hint):
                if not isinstance(value, dict):
                    raise ConfigError(f"{source}: '{dotted_key}' is a section, not a value: set its keys "
                                      f"({dotted_key}.KEY=VALUE, or a mapping under {dotted_key}: in YAML)")
                _apply_mapping(config, value, source, prefix=dotted_key)
            else:
                setattr(target, name, _coerce(value, hint, dotted_key, source))
        else:
            target = getattr(target, name)


def validate(config: Config) -> None:
    """Reject values that parse but cannot work, naming the key and the way out."""
    m, d, i, o, s, t = config.model, config.data, config.inner, config.outer, config.swarm, config.training
    p = config.pipeline
    checks = [
        (bool(config.run_id.strip()) and "/" not in config.run_id, "run_id must be a non-empty name without '/'"),
        (m.vocab_size >= 2, f"model.vocab_size ({m.vocab_size}) must be at least 2 (and match the tokenizer)"),
        (m.n_layer >= 1, "model.n_layer must be at least 1"),
        (m.n_head >= 1 and m.d_model % m.n_head == 0,
         f"model.d_model ({m.d_model}) must be divisible by model.n_head ({m.n_head})"),
        (m.n_head >= 1 and (m.d_model // max(m.n_head, 1)) % 2 == 0,
         "model.d_model / model.n_head must be even for rotary embeddings"),
        (m.d_ff >= 0, "model.d_ff must be >= 0 (0 picks 8/3 * d_model)"),
        (m.init_std > 0 and m.norm_eps > 0 and m.rope_theta > 0,
         "model.init_std, model.norm_eps and model.rope_theta must be > 0"),
        (2 <= d.seq_len <= m.max_seq_len,
         f"data.seq_len ({d.seq_len}) must be in [2, model.max_seq_len={m.max_seq_len}]"),
        (0 < d.eval_percent < 50, f"data.eval_percent ({d.eval_percent}) must be in (0, 50)"),
        (not (d.paths and d.prepared), "set data.paths (text read at start) or data.prepared (a prepared folder), "
                                       "not both"),
        (d.eval_sequences >= 1, "data.eval_sequences must be at least 1"),
        (i.steps >= 1, "inner.steps (H) must be at least 1"),
        (i.batch_size >= 1 and i.grad_accum >= 1, "inner.batch_size and inner.grad_accum must be at least 1"),
        (i.lr > 0, f"inner.lr ({i.lr}) must be > 0"),
        (len(i.betas) == 2 and all(0 <= b < 1 for b in i.betas),
         f"inner.betas ({i.betas}) must be two numbers in [0, 1)"),
        (i.weight_decay >= 0 and i.grad_clip >= 0,
         "inner.weight_decay and inner.grad_clip must be >= 0 (0 disables clipping)"),
        (i.warmup_steps >= 0 and i.total_steps >= 0, "inner.warmup_steps and inner.total_steps must be >= 0"),
        (0 <= i.min_lr_ratio <= 1, "inner.min_lr_ratio must be in [0, 1]"),
        (o.diloco.lr > 0, f"outer.diloco.lr ({o.diloco.lr}) must be > 0"),
        (0 <= o.diloco.momentum < 1, f"outer.diloco.momentum ({o.diloco.momentum}) must be in [0, 1)"),
        (o.clip_factor == 0 or 1 <= o.clip_factor <= 100,
         f"outer.clip_factor ({o.clip_factor}) must be in [1, 100] (a multiple of the median norm), or 0 to turn "
         f"clipping off"),
        (o.sparseloco.lr > 0, f"outer.sparseloco.lr ({o.sparseloco.lr}) must be > 0"),
        (0 <= o.sparseloco.error_decay <= 1,
         f"outer.sparseloco.error_decay ({o.sparseloco.error_decay}) must be in [0, 1]"),
        (2 <= o.sparseloco.chunk_size <= 128, "outer.sparseloco.chunk_size must be in [2, 128]"),
        (1 <= o.sparseloco.topk <= o.sparseloco.chunk_size ** 2,
         f"outer.sparseloco.topk ({o.sparseloco.topk}) must be in [1, chunk_size^2="
         f"{o.sparseloco.chunk_size ** 2}]"),
        (1 <= o.sparseloco.result_topk <= o.sparseloco.chunk_size ** 2,
         f"outer.sparseloco.result_topk ({o.sparseloco.result_topk}) must be in [1, chunk_size^2="
         f"{o.sparseloco.chunk_size ** 2}]"),
        (0 <= o.sparseloco.result_error_decay <= 1,
         f"outer.sparseloco.result_error_decay ({o.sparseloco.result_error_decay}) must be in [0, 1]"),
        (o.loco.bits in (2, 4, 8), f"outer.loco.bits ({o.loco.bits}) must be 2, 4 or 8"),
        (1 <= o.loco.group_size <= MAX_GROUP_SIZE,
         f"outer.loco.group_size ({o.loco.group_size}) must be in [1, {MAX_GROUP_SIZE}] (values per scale)"),
        (0 <= o.loco.beta < 1, f"outer.loco.beta ({o.loco.beta}) must be in [0, 1)"),
        (o.loco.reset_every >= 1,
         f"outer.loco.reset_every ({o.loco.reset_every}) must be at least 1 (rounds between resets of the error "
         f"buffers; a large value never resets them)"),
        (o.loco.lr > 0, f"outer.loco.lr ({o.loco.lr}) must be > 0"),
        (0 <= o.loco.momentum < 1, f"outer.loco.momentum ({o.loco.momentum}) must be in [0, 1)"),
        (o.algorithm != "streaming" or 1 <= o.streaming.fragments <= m.n_layer,
         f"outer.streaming.fragments ({o.streaming.fragments}) must be in [1, model.n_layer={m.n_layer}]: every "
         f"fragment holds a block"),
        (o.algorithm != "streaming" or i.steps % max(o.streaming.fragments, 1) == 0,
         f"outer.streaming.fragments ({o.streaming.fragments}) must divide inner.steps ({i.steps}): fragments sync "
         f"at equal distances within a round"),
        (o.algorithm != "streaming" or 0 <= o.streaming.delay < i.steps // max(o.streaming.fragments, 1),
         f"outer.streaming.delay ({o.streaming.delay}) must be in [0, inner.steps / fragments = "
         f"{i.steps // max(o.streaming.fragments, 1)}): a fragment's all-reduce must land before the next one starts"),
        (0 <= o.streaming.alpha <= 1, f"outer.streaming.alpha ({o.streaming.alpha}) must be in [0, 1]"),
        (o.streaming.lr > 0, f"outer.streaming.lr ({o.streaming.lr}) must be > 0"),
        (0 <= o.streaming.momentum < 1, f"outer.streaming.momentum ({o.streaming.momentum}) must be in [0, 1)"),
        (o.streaming.bits in (4, 32), f"outer.streaming.bits ({o.streaming.bits}) must be 4 (E3M0) or 32 (float32)"),
        (o.algorithm != "streaming" or p.stages == 1,
         f"outer.algorithm=streaming needs pipeline.stages=1 (got {p.stages}): fragments cut the whole model, stage "
         f"peers hold a part of it"),
        (1 <= p.stages <= m.n_layer,
         f"pipeline.stages ({p.stages}) must be in [1, model.n_layer={m.n_layer}]: every stage holds a layer"),
        (not p.compressed or 1 <= p.rank < m.d_model,
         f"pipeline.rank ({p.rank}) must be in [1, model.d_model={m.d_model}): it is the number of values per token "
         f"a compressed stage boundary sends"),
        (p.stages == 1 or o.overlap is None,
         f"outer.{o.algorithm}.overlap needs pipeline.stages=1: pipeline groups run their rounds without overlap"),
        (p.stages == 1 or not m.tie_embeddings,
         f"pipeline.stages={p.stages} needs model.tie_embeddings: false (the embedding lives on the first stage, the "
         f"head on the last)"),
        (all(0 < t <= MAX_WAIT for t in (s.matchmaking_timeout, s.allreduce_timeout, s.heartbeat_interval,
                                           s.peer_ttl)) and 0 < s.startup_timeout <= MAX_STARTUP_WAIT,
         f"swarm.matchmaking_timeout, allreduce_timeout, heartbeat_interval and peer_ttl must be in (0, "
         f"{MAX_WAIT:.0f}] seconds and swarm.startup_timeout in (0, {MAX_STARTUP_WAIT:.0f}]: every wait is bounded"),
        (s.peer_ttl >= max(3 * s.heartbeat_interval, MIN_PEER_TTL),
         f"swarm.peer_ttl ({s.peer_ttl}) must be at least 3 x swarm.heartbeat_interval ({s.heartbeat_interval}) "
         f"and {MIN_PEER_TTL:.0f} s (a DHT lookup may take 3 s, and records must outlive it)"),
        (s.min_peers >= 1, "swarm.min_peers must be at least 1"),
        (0 < s.min_bandwidth_mbit <= 1e6 and 0 <= s.bandwidth_mbit <= 1e6,
         f"swarm.min_bandwidth_mbit ({s.min_bandwidth_mbit}) must be in (0, 1e6] and swarm.bandwidth_mbit "
         f"({s.bandwidth_mbit}) in [0, 1e6] Mbit/s (0: not stated)"),
        (s.allreduce_timeout <= s.max_transfer_timeout <= MAX_WAIT,
         f"swarm.max_transfer_timeout ({s.max_transfer_timeout}) must be in [swarm.allreduce_timeout="
         f"{s.allreduce_timeout}, {MAX_WAIT:.0f}] seconds"),
        (0 <= s.ban_rounds <= MAX_BAN_ROUNDS,
         f"swarm.ban_rounds ({s.ban_rounds}) must be in [0, {MAX_BAN_ROUNDS}] (0: a peer caught sending malformed "
         f"data is dropped only from the round it was caught in)"),
        (t.rounds >= 0, "training.rounds must be >= 0 (0 trains until stopped)"),
        (t.threads >= 0 and t.eval_every >= 1, "training.threads must be >= 0 and training.eval_every >= 1"),
        (t.checkpoint_every >= 0, "training.checkpoint_every must be >= 0 (0: only on exit)"),
        (t.device == "auto" or t.device == "cpu" or t.device.startswith("cuda"),
         f"training.device ({t.device!r}) must be auto, cpu, cuda or cuda:N"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass an existing YAML file to --config")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config file {path} is not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections (model:, inner:, ...)")
    return data


def _apply_mapping(config: Config, mapping: dict[str, Any], source: str, prefix: str = "") -> None:
    for key, value in mapping.items():
        set_key(config, f"{prefix}.{key}" if prefix else str(key), value, source)


def _parse_scalar(raw: str) -> Any:
    try:
        return yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        return raw


def _coerce(value: Any, hint: Any, key: str, source: str) -> Any:
    origin = typing.get_origin(hint)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ConfigError(f"{source}: {key} must be one of {', '.join(map(str, choices))}; got {value!r}")
        return value
    if origin in (list, list):
        (item_type,) = typing.get_args(hint)
        if isinstance(value, str) and item_type is str:
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{source}: {key} must be a list, e.g. [a, b]; got {value!r}")
        return [_coerce(item, item_type, key, source) for item in value]
    if origin in (typing.Union, types.UnionType):
        raise ConfigError(f"{source}: {key} has an unsupported type")
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{source}: {key} must be true or false; got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{source}: {key} must be an integer; got {value!r}")
    if hint is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is None:
            raise ConfigError(f"{source}: {key} must be a number; got {value!r}")
        if not math.isfinite(number):  # no key of the config means anything with NaN or infinity
            raise ConfigError(f"{source}: {key} must be a finite number; got {value!r}")
        return number
    if hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{source}: {key} must be a string; got {value!r}")
    raise ConfigError(f"{source}: {key} has an unsupported type {hint}")


def _suggest(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    return f" (did you mean '{close[0]}'?)" if close else f"; known keys here: {', '.join(known)}"
