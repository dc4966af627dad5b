"""The config's sections, each key with its meaning and bound, each rule between keys on the smallest section that
holds them; ``Config``, all of them, and the run's document: what of it travels with the run."""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal

from pydantic import model_validator

from p2ploco import PROTOCOL_VERSION
from p2ploco.config.fields import (
    MAX_BAN_ROUNDS,
    MAX_GROUP_SIZE,
    MAX_REDUCERS,
    MAX_STARTUP_WAIT,
    MAX_WAIT,
    MIN_PEER_TTL,
    REDUCERS_BOUNDS,
    Fraction,
    LearningRate,
    Momentum,
    Number,
    Paths,
    Section,
    Text,
    bound,
)

AtLeastOne = Annotated[int, bound(lambda n: n >= 1, "{key} must be at least 1")]
ModelScale = Annotated[Number, bound(lambda x: x > 0,
                                     "model.init_std, model.norm_eps and model.rope_theta must be > 0")]


class ModelConfig(Section):
    """LLaMA-style decoder shape (see ``p2ploco.model``)."""

    vocab_size: Annotated[int, bound(lambda n: n >= 2, "{key} ({value}) must be at least 2 (and match the "
                                                       "tokenizer)")] = 257
    n_layer: AtLeastOne = 2
    n_head: int = 4
    d_model: int = 128
    # SwiGLU hidden width; 0 means 8/3 * d_model rounded up to a multiple of 64
    d_ff: Annotated[int, bound(lambda d: d >= 0, "{key} must be >= 0 (0 picks 8/3 * d_model)")] = 0
    max_seq_len: int = 256
    tie_embeddings: bool = True
    rope_theta: ModelScale = 10000.0
    norm_eps: ModelScale = 1e-5
    init_std: ModelScale = 0.02

    @model_validator(mode="after")
    def _heads_split_the_width_evenly(self) -> ModelConfig:
        if self.n_head < 1 or self.d_model % self.n_head:
            raise ValueError(f"model.d_model ({self.d_model}) must be divisible by model.n_head ({self.n_head})")
        if (self.d_model // self.n_head) % 2:
            raise ValueError("model.d_model / model.n_head must be even for rotary embeddings")
        return self


class DataConfig(Section):
    """Where tokens come from: text read at start (``paths``; empty means the embedded standard-library
    corpus), or a corpus tokenized beforehand by ``p2ploco data prepare`` (``prepared``, memory-mapped)."""

    paths: Paths = []  # text files, JSONL files (a "text" per line), folders
    prepared: Text = ""  # a folder written by `p2ploco data prepare`; its manifest decides tokenizer and split
    tokenizer: Text = ""  # a Hugging Face tokenizer.json; empty means byte-level (256 bytes + end-of-text)
    seq_len: int = 128  # in [2, model.max_seq_len] (Config)
    # share held out for the eval loss: of the documents, or of blocks of text when few
    eval_percent: Annotated[Number, bound(lambda p: 0 < p < 50, "{key} ({value}) must be in (0, 50)")] = 2.0
    # held-out windows scored after each round
    eval_sequences: AtLeastOne = 32

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if self.paths and self.prepared:
            raise ValueError("set data.paths (text read at start) or data.prepared (a prepared folder), not both")
        return self


AT_LEAST_ONE_SAMPLE = "inner.batch_size and inner.grad_accum must be at least 1"
NOT_NEGATIVE_DECAY = "inner.weight_decay and inner.grad_clip must be >= 0 (0 disables clipping)"
NOT_NEGATIVE_STEPS = "inner.warmup_steps and inner.total_steps must be >= 0"


class InnerConfig(Section):
    """The H local AdamW steps each replica runs between outer rounds."""

    steps: Annotated[int, bound(lambda h: h >= 1, "{key} (H) must be at least 1")] = 20  # H
    batch_size: Annotated[int, bound(lambda n: n >= 1, AT_LEAST_ONE_SAMPLE)] = 8
    grad_accum: Annotated[int, bound(lambda n: n >= 1, AT_LEAST_ONE_SAMPLE)] = 1
    lr: LearningRate = 4e-4
    betas: Annotated[list[Number], bound(lambda b: len(b) == 2 and all(0 <= x < 1 for x in b),
                                         "{key} ({value}) must be two numbers in [0, 1)")] = [0.9, 0.95]
    weight_decay: Annotated[Number, bound(lambda x: x >= 0, NOT_NEGATIVE_DECAY)] = 0.1
    grad_clip: Annotated[Number, bound(lambda x: x >= 0, NOT_NEGATIVE_DECAY)] = 1.0
    warmup_steps: Annotated[int, bound(lambda n: n >= 0, NOT_NEGATIVE_STEPS)] = 50
    # Cosine horizon in inner steps; 0 means training.rounds * steps, or a constant lr
    # after warm-up when the run has no round limit.
    total_steps: Annotated[int, bound(lambda n: n >= 0, NOT_NEGATIVE_STEPS)] = 0
    min_lr_ratio: Annotated[Number, bound(lambda r: 0 <= r <= 1, "{key} must be in [0, 1]")] = 0.1
    # A round trains as many of its H steps as fit in the swarm's round budget (budget.py): this many seconds, or
    # (0) H times the fastest peer's step. fixed_steps: train H steps every round, however long they take.
    round_seconds: Number = 0.0
    fixed_steps: bool = False


class OverlapConfig(Section):
    """Whether a round's all-reduce runs while the next round's inner steps do (docs/design.md, "Overlapped
    rounds"), and how the replica trains on meanwhile."""

    overlap: bool = False
    # eager: the replica trains on from where its inner steps ended (its own pseudo-gradient standing in for the
    # round's average) and is rebased onto the new global params as soon as they land; naive: it keeps its own
    # progress and takes the outer step one round late.
    overlap_update: Literal["eager", "naive"] = "eager"


class DiLoCoConfig(OverlapConfig):
    """Dense mean of pseudo-gradients, outer SGD with Nesterov momentum (Douillard et al. 2023)."""

    # Tuned for runs of up to a few hundred rounds (docs/design.md, "Tuned defaults"): an outer step of about one
    # pseudo-gradient, lr / (1 - momentum) = 1; the paper's 0.7 and 0.9 (for H = 500) overshoot there.
    lr: LearningRate = 0.5
    momentum: Momentum = 0.5
    nesterov: bool = True
    # Element type of pseudo-gradients on the wire; the reducer sums in float32.
    wire_dtype: Literal["float32", "float16", "bfloat16"] = "float32"


class SparseLoCoConfig(OverlapConfig):
    """Error feedback, chunked Top-k, 2-bit values (Sarfi et al. 2025)."""

    # alpha: scales the pseudo-gradient into the error buffer and the aggregate into the params. Tuned for runs of up
    # to a few hundred rounds (docs/design.md, "Tuned defaults"), as beta: the paper's 1.0 and 0.95 are for long runs.
    lr: LearningRate = 1.2
    error_decay: Fraction = 0.8  # beta: the buffer remembers about 1 / (1 - beta) = 5 rounds
    # 2-D tensors are cut into tiles of up to chunk_size x chunk_size
    chunk_size: Annotated[int, bound(lambda c: 2 <= c <= 128, "{key} must be in [2, 128]")] = 64
    topk: int = 64  # values kept per full chunk_size^2 tile (64 of 4096 = 1/64 density)
    # mean: per coordinate over the replicas that selected it (reference code); sum: divide by all replicas.
    aggregate: Literal["mean", "sum"] = "mean"
    # What each span's reducer sends back. resparsified: the Top-k of the mean in 2 bits (per-peer traffic flat in
    # the swarm's size); exact: the contributions relayed or their union with float32 values (grows linearly).
    result: Literal["resparsified", "exact"] = "resparsified"
    # The most values a resparsified result keeps per full chunk_size^2 tile (1/16 density); a result of n
    # contributions keeps min(result_topk, n x topk): every value they selected, while n x topk fits. A larger group
    # of n sends result_topk // n values each (at least 1), so that a result still holds every value sent.
    result_topk: int = 256

    @model_validator(mode="after")
    def _kept_values_fit_a_tile(self) -> SparseLoCoConfig:
        tile = self.chunk_size ** 2
        for name in ("topk", "result_topk"):
            if not 1 <= getattr(self, name) <= tile:
                raise ValueError(f"outer.sparseloco.{name} ({getattr(self, name)}) must be in [1, chunk_size^2={tile}]")
        return self


class LoCoConfig(OverlapConfig):
    """Error-compensated low-bit pseudo-gradients (Xie et al. 2024) with DiLoCo's outer step.

    What quantization drops is kept in a buffer e, a moving average of past errors, and added back before
    the next quantization, by every hop that quantizes (the sender, and the reducer of each span)."""

    # per value on the wire (symmetric codes in [-(2^(bits-1) - 1), 2^(bits-1) - 1])
    bits: Annotated[int, bound(lambda b: b in (2, 4, 8), "{key} ({value}) must be 2, 4 or 8")] = 4
    # consecutive values of a tensor that share one float32 scale
    group_size: Annotated[int, bound(lambda g: 1 <= g <= MAX_GROUP_SIZE,
                                     f"{{key}} ({{value}}) must be in [1, {MAX_GROUP_SIZE}] (values per scale)")] = 128
    beta: Momentum = 0.8  # e <- beta * e + (1 - beta) * (what this quantization dropped)
    # rounds whose index is a multiple of this start with empty buffers
    reset_every: Annotated[int, bound(lambda n: n >= 1, "{key} ({value}) must be at least 1 (rounds between resets of "
                                                        "the error buffers; a large value never resets them)")] = 1024
    lr: LearningRate = 0.5  # outer SGD with Nesterov momentum on the aggregate, as DiLoCo (and tuned alike)
    momentum: Momentum = 0.5


class StreamingConfig(Section):
    """Streaming DiLoCo (Douillard et al. 2025): the model in fragments that sync at staggered inner steps, each
    fragment's all-reduce overlapped with inner steps, 4-bit exchanged values.

    Fragment p (of P) is a strided group of blocks (p, p + P, ...; the embedding with fragment 0, the final norm
    and head with fragment P - 1). Within each round of H inner steps fragment p's all-reduce starts after inner
    step ⌊(p + 1)·H/P⌋ - delay and is applied after step ⌊(p + 1)·H/P⌋ (evenly spaced, H/P apart where P divides
    H); the local copy of the fragment then becomes alpha·local + (1 - alpha)·global."""

    fragments: int = 2  # P: in [1, min(model.n_layer, inner.steps)] (Config)
    delay: int = 1  # tau: inner steps an all-reduce runs while training goes on; < inner.steps / fragments (Config)
    alpha: Fraction = 0.5  # share of the local fragment kept when the synced one arrives (0: take the global one)
    lr: LearningRate = 0.5  # outer SGD with Nesterov momentum, per fragment (tuned as DiLoCo's)
    momentum: Momentum = 0.5
    # exchanged values: 4 (E3M0 floats, one float32 scale per 128) or 32 (float32)
    bits: Annotated[int, bound(lambda b: b in (4, 32), "{key} ({value}) must be 4 (E3M0) or 32 (float32)")] = 4


class OuterConfig(Section):
    """The outer algorithm applied to the replicas' pseudo-gradients; each has its own section."""

    algorithm: Literal["sparseloco", "diloco", "loco", "streaming"] = "sparseloco"
    # Each contribution to a span is scaled down to at most clip_factor x the median norm of the span's
    # contributions, scaled to the tokens it trained, before they are combined (a defence against poisoned updates);
    # 0: no clipping.
    clip_factor: Annotated[Number, bound(lambda f: f == 0 or 1 <= f <= 100,
                                         "{key} ({value}) must be in [1, 100] (a multiple of the median norm), or 0 to "
                                         "turn clipping off")] = 2.0
    # A contribution that points against the others of its span (among three or more) is left out of it, and its
    # sender banned by the reducers that catch it repeatedly (collective/robust.py, docs/design.md "Threat model").
    drop_opposed: bool = True
    diloco: DiLoCoConfig = DiLoCoConfig()
    sparseloco: SparseLoCoConfig = SparseLoCoConfig()
    loco: LoCoConfig = LoCoConfig()
    streaming: StreamingConfig = StreamingConfig()

    @property
    def overlap(self) -> Literal["eager", "naive"] | None:
        """How the chosen algorithm overlaps a round's all-reduce with the next round's inner steps (None: it does
        not; Streaming DiLoCo overlaps fragment by fragment within its own round)."""
        section = getattr(self, self.algorithm)
        return section.overlap_update if isinstance(section, OverlapConfig) and section.overlap else None


class PipelineConfig(Section):
    """Pipeline groups of weak peers: the model cut into stages, and how stage boundaries are compressed.

    With ``stages > 1`` the parameters are exchanged as one named slice per stage (``stage0``, ...), so a
    group of stage peers can stand in for one replica next to full replicas (docs/pipeline.md).
    """

    stages: int = 1  # S: consecutive slices of the layers, in [1, model.n_layer] (Config); 1 means no pipeline groups
    # Subspace compression of the activations crossing stage boundaries (Protocol Models):
    # selective: stage peers compress, full replicas train unconstrained (heterogeneous SparseLoCo);
    # uniform: every replica keeps its residual-writing weights in the subspace; none: boundaries send h.
    compression: Literal["selective", "uniform", "none"] = "selective"
    # k: values per token that cross a boundary (d_model / rank is the ratio), in [1, model.d_model) (Config)
    rank: int = 16
    wire_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"  # element type of boundary messages

    @property
    def compressed(self) -> bool:
        """Whether boundaries are subspace-compressed (the model then adds a frozen token table)."""
        return self.stages > 1 and self.compression != "none"


WAITS = (f"swarm.matchmaking_timeout, allreduce_timeout, heartbeat_interval and peer_ttl must be in "
         f"(0, {MAX_WAIT:.0f}] seconds and swarm.startup_timeout in (0, {MAX_STARTUP_WAIT:.0f}]: every wait is bounded")
Wait = Annotated[Number, bound(lambda t: 0 < t <= MAX_WAIT, WAITS)]


class SwarmConfig(Section):
    """Timeouts and sizes of the peer-to-peer rounds; every wait in a round is bounded."""

    # Bounds, not settings: a round waits what its peer measured (swarm/deadlines.py), at most these. The longest
    # wait from a round's first contribution for the peers it expects (their step times size it) ...
    matchmaking_timeout: Wait = 300.0
    # ... and the longest allowance of any one transfer of an all-reduce (its recent arrivals size it), plus its
    # bytes' time:
    allreduce_timeout: Wait = 300.0
    min_bandwidth_mbit: Number = 10.0  # the slowest link a transfer's deadline allows for (swarm/deadlines.py)
    bandwidth_mbit: Number = 0.0  # this peer's link, published so others' deadlines fit it (0: not stated)
    max_upload_mbit: Number = 0.0  # the most this peer sends per second, all streams together (0: no cap)
    # cap on any one transfer's deadline, however large its payload; in [allreduce_timeout, MAX_WAIT]
    max_transfer_timeout: Number = 900.0
    heartbeat_interval: Wait = 2.0  # how often a node refreshes its record in the DHT
    peer_ttl: Wait = 10.0  # a record not refreshed for this long marks its peer as gone
    min_peers: AtLeastOne = 1  # peers (self included) to wait for before the first round
    # longest wait for min_peers at start; then train anyway
    startup_timeout: Annotated[Number, bound(lambda t: 0 < t <= MAX_STARTUP_WAIT, WAITS)] = 120.0
    # rounds a peer caught sending malformed data is left out of this node's rounds
    ban_rounds: Annotated[int, bound(lambda n: 0 <= n <= MAX_BAN_ROUNDS,
                                     f"{{key}} ({{value}}) must be in [0, {MAX_BAN_ROUNDS}] (0: a peer caught sending "
                                     f"malformed data is dropped only from the round it was caught in)")] = 10
    # after each butterfly, re-reduce one random piece another reducer answered (sync/audit.py): about one
    # contribution's bytes more a round; a node that does not audit still shows its pieces to those that do
    audit: bool = True
    # the most members that reduce spans of a slice: a group of more dialable holders draws this many
    # (sync/group.py). Each member opens this many streams and reads as many receipts naming every member; each
    # drawn reducer carries N / this many members' share of its span
    max_reducers: Annotated[int, bound(lambda n: REDUCERS_BOUNDS[0] <= n <= REDUCERS_BOUNDS[1],
                                       f"{{key}} ({{value}}) must be in [{REDUCERS_BOUNDS[0]}, {REDUCERS_BOUNDS[1]}]: "
                                       f"fewer hands one reducer a quarter of a slice or more, more makes every member "
                                       f"read that many receipts naming every member a round")] = MAX_REDUCERS
    # whether other peers can dial this one (swarm/reachability.py): auto asks a peer to dial it back at start;
    # public, relayed (only through a circuit relay) or client (it can only dial out) skip the probe
    reachability: Literal["auto", "public", "relayed", "client"] = "auto"

    @property
    def published_mbit(self) -> float:
        """The link rate this peer's record states: its link, or its upload cap where that is slower (0: neither
        stated), so that others' transfer deadlines allow for what it will send."""
        return min((r for r in (self.bandwidth_mbit, self.max_upload_mbit) if r > 0), default=0.0)

    @model_validator(mode="after")
    def _records_outlive_lookups(self) -> SwarmConfig:
        if self.peer_ttl < max(3 * self.heartbeat_interval, MIN_PEER_TTL):
            raise ValueError(f"swarm.peer_ttl ({self.peer_ttl}) must be at least 3 x swarm.heartbeat_interval "
                             f"({self.heartbeat_interval}) and {MIN_PEER_TTL:.0f} s (a DHT lookup may take 3 s, and "
                             f"records must outlive it)")
        return self

    @model_validator(mode="after")
    def _links_are_plausible(self) -> SwarmConfig:  # one line for both: it shows both values
        if not (0 < self.min_bandwidth_mbit <= 1e6 and 0 <= self.bandwidth_mbit <= 1e6):
            raise ValueError(f"swarm.min_bandwidth_mbit ({self.min_bandwidth_mbit}) must be in (0, 1e6] and "
                             f"swarm.bandwidth_mbit ({self.bandwidth_mbit}) in [0, 1e6] Mbit/s (0: not stated)")
        if not 0 <= self.max_upload_mbit <= 1e6 or 0 < self.max_upload_mbit < self.min_bandwidth_mbit:
            raise ValueError(f"swarm.max_upload_mbit ({self.max_upload_mbit}) must be 0 (no cap) or in "
                             f"[swarm.min_bandwidth_mbit={self.min_bandwidth_mbit}, 1e6] Mbit/s: a slower sender "
                             f"would miss the transfer deadlines peers allow for")
        return self

    @model_validator(mode="after")
    def _transfer_cap_above_transfer_wait(self) -> SwarmConfig:
        if not self.allreduce_timeout <= self.max_transfer_timeout <= MAX_WAIT:
            raise ValueError(f"swarm.max_transfer_timeout ({self.max_transfer_timeout}) must be in "
                             f"[swarm.allreduce_timeout={self.allreduce_timeout}, {MAX_WAIT:.0f}] seconds")
        return self


THREADS_AND_EVALS = "training.threads must be >= 0 and training.eval_every >= 1"
MAX_RANKS = 64
RANKS = f"training.ranks and training.max_ranks must be in [1, {MAX_RANKS}]"


class TrainingConfig(Section):
    """How long to train, where, and how often to evaluate."""

    rounds: Annotated[int, bound(lambda n: n >= 0, "{key} must be >= 0 (0 trains until stopped)")] = 0
    seed: int = 0
    device: Annotated[Text, bound(lambda d: d in ("auto", "cpu") or d.startswith("cuda"),
                                  "{key} ({value!r}) must be auto, cpu, cuda or cuda:N")] = "auto"
    threads: Annotated[int, bound(lambda n: n >= 0, THREADS_AND_EVALS)] = 0  # torch CPU threads; 0: torch's default
    eval_every: Annotated[int, bound(lambda n: n >= 1, THREADS_AND_EVALS)] = 1  # rounds between eval-loss measurements
    # rounds between checkpoints (0: only on exit)
    checkpoint_every: Annotated[int, bound(lambda n: n >= 0, "{key} must be >= 0 (0: only on exit)")] = 10
    # compile the model's forward and backward with torch.compile (a one-off compile of seconds to minutes at the
    # first step; then faster steps where the device gains from fused kernels: a GPU)
    compile: bool = False
    # local processes that train this peer's replica together, data parallel, one device each (``p2ploco.ranks``);
    # `node start --nproc-per-node N` sets it
    ranks: Annotated[int, bound(lambda n: 1 <= n <= MAX_RANKS, RANKS)] = 1
    # the most local ranks a peer's contribution counts: it weighs at most this many full rounds' tokens, so that no
    # key weighs more than this many full peers (``collective/robust.py``); a run that welcomes multi-GPU servers
    # raises it
    max_ranks: Annotated[int, bound(lambda n: 1 <= n <= MAX_RANKS, RANKS)] = 1
    # shard the replica's params, gradients and inner AdamW state over the local ranks (FSDP2), for a model whose
    # training does not fit one device; rank 0 keeps the whole params in host memory for the outer step
    # (``ranks/sharded.py``). A node on one rank has nothing to shard it over and trains it whole.
    shard: bool = False

    def evaluates_after(self, round_index: int) -> bool:
        """Whether a peer that can score the held-out data (``Role.evaluates``) does after ``round_index``: every
        ``eval_every`` rounds, and after the run's last."""
        return round_index % self.eval_every == 0 or round_index + 1 == self.rounds


class Config(Section):
    """The run: one section per part of a node, and the rules between sections."""

    run_id: Annotated[Text, bound(lambda r: bool(r.strip()) and "/" not in r,
                                  "run_id must be a non-empty name without '/'")] = "p2ploco"
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    inner: InnerConfig = InnerConfig()
    outer: OuterConfig = OuterConfig()
    pipeline: PipelineConfig = PipelineConfig()
    swarm: SwarmConfig = SwarmConfig()
    training: TrainingConfig = TrainingConfig()

    @model_validator(mode="after")
    def _windows_fit_the_model(self) -> Config:
        if not 2 <= self.data.seq_len <= self.model.max_seq_len:
            raise ValueError(f"data.seq_len ({self.data.seq_len}) must be in [2, model.max_seq_len="
                             f"{self.model.max_seq_len}]")
        return self

    @model_validator(mode="after")
    def _fragments_fit_model_and_round(self) -> Config:
        if self.outer.algorithm != "streaming":
            return self
        s, steps, layers = self.outer.streaming, self.inner.steps, self.model.n_layer
        if not 1 <= s.fragments <= layers:
            raise ValueError(f"outer.streaming.fragments ({s.fragments}) must be in [1, model.n_layer={layers}]: every "
                             f"fragment holds a block")
        if s.fragments > steps:
            raise ValueError(f"outer.streaming.fragments ({s.fragments}) must be at most inner.steps ({steps}): each "
                             f"fragment syncs after an inner step of its own")
        if not 0 <= s.delay < steps // s.fragments:
            raise ValueError(f"outer.streaming.delay ({s.delay}) must be in [0, inner.steps / fragments = "
                             f"{steps // s.fragments}): a fragment's all-reduce must land before the next one starts")
        if self.pipeline.stages != 1:
            raise ValueError(f"outer.algorithm=streaming needs pipeline.stages=1 (got {self.pipeline.stages}): "
                             f"fragments cut the whole model, stage peers hold a part of it")
        return self

    @model_validator(mode="after")
    def _stages_fit_the_model(self) -> Config:
        p, m = self.pipeline, self.model
        if not 1 <= p.stages <= m.n_layer:
            raise ValueError(f"pipeline.stages ({p.stages}) must be in [1, model.n_layer={m.n_layer}]: every stage "
                             f"holds a layer")
        if p.compressed and not 1 <= p.rank < m.d_model:
            raise ValueError(f"pipeline.rank ({p.rank}) must be in [1, model.d_model={m.d_model}): it is the number of "
                             f"values per token a compressed stage boundary sends")
        if p.stages > 1 and self.outer.overlap is not None:
            raise ValueError(f"outer.{self.outer.algorithm}.overlap needs pipeline.stages=1: pipeline groups run their "
                             f"rounds without overlap")
        if p.stages > 1 and m.tie_embeddings:
            raise ValueError(f"pipeline.stages={p.stages} needs model.tie_embeddings: false (the embedding lives on "
                             f"the first stage, the head on the last)")
        return self

    @model_validator(mode="after")
    def _ranks_count(self) -> Config:
        t = self.training
        if t.ranks > t.max_ranks:
            raise ValueError(f"training.ranks ({t.ranks}) is more than training.max_ranks ({t.max_ranks}), the most "
                             f"local ranks this run counts in one peer's contribution: train on {t.max_ranks} "
                             f"rank(s), or start the run with training.max_ranks >= {t.ranks}")
        if t.shard and self.pipeline.compressed and self.pipeline.compression == "uniform":
            raise ValueError("training.shard does not go with pipeline.compression=uniform (whose replicas project "
                             "their weights whole): use selective compression, or training.shard=false")
        return self

    @property
    def round_tokens(self) -> int:
        """What a round holds on one local rank: H inner steps of the run's batch. Every peer of a run must share it
        (``max_contribution_tokens`` follows from it)."""
        i = self.inner
        return i.steps * i.batch_size * i.grad_accum * self.data.seq_len

    @property
    def inner_horizon(self) -> int:
        """The inner step where the learning rate's cosine reaches its floor (0: constant after warm-up)."""
        return self.inner.total_steps or self.training.rounds * self.inner.steps

    @property
    def max_contribution_tokens(self) -> int:
        """The most tokens one contribution may weigh: a full round's on each of the most local ranks the run counts
        (``training.max_ranks``). A peer's claim is capped by it (``collective/robust.py``) and coordinators leave out
        a peer that claims more (``sync/form.py``)."""
        return self.round_tokens * self.training.max_ranks

    def run_document(self, data: str = "") -> dict[str, Any]:
        """What travels with the run (``swarm/run_config.py``): every setting but this peer's own (``LOCAL_KEYS``),
        by dotted key; what a round holds (``round_tokens``: a peer may split it into batch and accumulation as its
        memory allows); ``data``, ``TrainingData.fingerprint`` (a prepared corpus's digest, a non-default
        tokenizer's, or ""); and the protocol version the run's messages speak. Never where this peer keeps its
        files: a joiner names its own copy, and the digest decides."""
        settings = {key: value for key, value in flattened(self.model_dump(mode="json")).items()
                    if key not in LOCAL_KEYS}
        return {"settings": settings, "round_tokens": self.round_tokens, "data": data, "protocol": PROTOCOL_VERSION}

    def swarm_fingerprint(self, data: str = "") -> str:
        """Digest of the run's document (``run_document``): what every peer of a round shares, so that their global
        parameters end identical and their rounds weigh alike; records carry it."""
        return document_fingerprint(self.run_document(data))


# A peer's own settings: its machine and memory, its files, how long it stays, its link. They stay with the peer
# (README, "Joining with one address"); every other setting travels with the run and is part of its fingerprint. The
# batch split is the peer's, its product the run's: where the person sets neither key, the peer picks one
# (``batch_split``).
LOCAL_KEYS = frozenset({
    "run_id", "data.paths", "data.prepared", "data.tokenizer", "inner.batch_size", "inner.grad_accum",
    "inner.fixed_steps", "swarm.bandwidth_mbit", "swarm.max_upload_mbit", "swarm.min_peers", "swarm.startup_timeout",
    "swarm.reachability", "training.rounds", "training.device", "training.threads", "training.eval_every",
    "training.checkpoint_every", "training.compile", "training.ranks", "training.shard"})


def document_fingerprint(document: dict[str, Any]) -> str:
    """The digest of a run document (``Config.run_document``)."""
    return hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()[:16]


def flattened(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(flattened(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
