"""Same token budget, K replicas in one process: AdamW DDP (gradients averaged every step), DiLoCo,
SparseLoCo and LoCo (every H steps), and heterogeneous SparseLoCo with pipelines. Prints the eval loss
along the way, the final eval loss and the bytes each replica sent + received in total.

The outer algorithms run the same code as real nodes (workers: inner trainer, outer algorithm,
exchange; pipeline stages with their 1F1B schedule), with in-process links instead of hivemind.

    python benchmarks/quality.py                          # tiny model, K=4, 40 rounds of H=10
    python benchmarks/quality.py --rounds 5 --replicas 2  # a quick look
    python benchmarks/quality.py --suite equal-tokens     # the README's table: K=4 and 8, 1000 steps each, 2 seeds
    python benchmarks/quality.py --suite equal-tokens-21m # the same comparison on the 21.4M setting, shorter
    python benchmarks/quality.py --suite sweep-diloco     # the sweep behind DiLoCo's defaults (also: sweep-sparseloco,
                                                          # sweep-loco-streaming, sweep-replicas)
    python benchmarks/quality.py --methods diloco "sparseloco:topk=128,error_decay=0.9"   # variants
    python benchmarks/quality.py --methods diloco loco "loco:bits=2"   # LoCo's low-bit values against fp32
    python benchmarks/quality.py --suite heterogeneous    # full replicas vs 2-stage compressed groups
    python benchmarks/quality.py --suite overlap --seeds 2   # DiLoCo and SparseLoCo: no overlap, naive, eager
    python benchmarks/quality.py --suite streaming        # Streaming DiLoCo (P = 2, 4) next to the others
    python benchmarks/quality.py --suite pace --rounds 20 --seeds 2   # slow replicas next to fast ones
    python benchmarks/quality.py --suite scale --replicas 16   # exact vs resparsified SparseLoCo results
    python benchmarks/quality.py --suite byzantine --replicas 8 --rounds 30 --seeds 2   # sign-flipping replicas

Every method trains the same inner steps per replica (``--steps``, or ``--rounds`` x the config's H), so the same
tokens, with the same inner learning-rate schedule (warm-up, then a cosine over the whole run). DDP is AdamW on the
mean of the K replicas' gradients at every step (one model on their K batches: the same gradient an all-reduce gives).

Methods: ``ddp``; ``diloco`` / ``sparseloco`` / ``loco`` / ``streaming`` (every replica full), each with
optional outer settings after a colon (``H=N``: N inner steps a round, so steps / N rounds); ``uniform:ratio=R``
(every replica a compressed pipeline, d/k = R) and ``selective:ratio=R`` (half the replicas full, half
compressed groups), SparseLoCo per stage.
``ALGORITHM+overlap:UPDATE`` runs overlapped rounds (UPDATE: eager or naive; more settings after a comma). An
in-process all-reduce ends at once, so an eager round lands at a fixed inner step of the next round, as if
its all-reduce took that long: ``landing=K`` inner steps (default 1), ``landing=end`` the whole round (the
naive update always takes its step at the round's end).

``ALGORITHM+speeds:F1,F2,...`` runs one full replica per factor (``--replicas`` is ignored), replica i F_i times
slower than a replica of factor 1, all for the same outer rounds: equal wall time, where every round lasts as long
as the fast replicas' H inner steps (a round's wall-clock budget, ``p2ploco/budget.py``). Simulated by count, so
runs repeat exactly: a replica of factor F trains max(1, round(H / F)) inner steps a round, and its contribution
weighs the tokens it trained, as in a swarm; the word ``unweighted`` weighs every contribution the same instead
(for comparison). It combines with overlap (``diloco+overlap+speeds:eager,1,3``) and outer settings
(``sparseloco+speeds:1,3,10,topk=128``). The pace table shows the tokens trained in all, the slow replicas' share
of them (factor above the smallest) and of the weight in each mean, and how often each replica's contribution to a
span was clipped (``outer.clip_factor`` x the median norm of the span's contributions, scaled to its tokens).

``flipped=K`` makes the last K replicas hostile: each sends its own pseudo-gradient sign-flipped and scaled by 1.9,
inside the clip bound, claiming a full round's tokens (the largest weight allowed); ``defence=off`` runs it without
the direction rule (``outer.drop_opposed=false``: clipping alone, as before it); ``replicas=R`` runs R replicas
whatever ``--replicas`` says (the honest ones alone). ``steer=K`` makes the last K replicas hostile reducers that
add to their span's mean a direction nobody sent, half the mean's length, the same every round, compressed as an
honest result is (``p2ploco.testing.attacks.Steering``: every member's checks pass), and ``equivocate=K`` reducers
that answer every second member a result 1 % shorter (``Equivocating``); both train and contribute honestly. With
the defence on, the in-process group does what the swarm's rules do (``testing/communicator.py``: a proven
equivocator is out of the redo and of the run; a result that fails one member's audit is redone without it) and
off, what they did before issue 58 (a round whose members hold different results is aborted; nobody audits). The
byzantine table compares each attacked run with the honest replicas alone, and shows how often the reducers left out
(``opposed``) an honest and a hostile replica's contribution to a span, the rounds a hostile result was caught in,
those nobody applied and those applied with a hostile result in them (seed 0).

The eval loss is that of the global parameters (projected onto span(U) when replica 0 is a compressed
group). With ``--seeds N`` every method runs N times (model init and data order seeded apart): the tables
show the mean, and ``--json`` prints one object per method with its mean and per-seed final eval losses.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from p2ploco.budget import FixedSteps
from p2ploco.collective.dense import DenseMean
from p2ploco.collective.exchange import AllReduceResult, Communicator, Exchange, dense_fp32_bytes
from p2ploco.collective.robust import mean_factors
from p2ploco.collective.sliced import SlicedExchange, as_sliced
from p2ploco.collective.sparse import SparseExchange
from p2ploco.compression.topk import CompressedTensor
from p2ploco.config import Config, load_config, with_overrides
from p2ploco.data import ShardSampler, eval_batches, load_training_data
from p2ploco.inner import GradientSource, InnerTrainer, evaluate
from p2ploco.metrics import format_table, human_bytes
from p2ploco.model import Transformer
from p2ploco.pipeline.subspace import SubspaceConstraint, constrained_dims
from p2ploco.schedules import Landing
from p2ploco.testing.attacks import Equivocating, Steering
from p2ploco.testing.swarm import FULL, GROUP, InProcessSwarm, build_swarm

CPU = torch.device("cpu")


@dataclass(frozen=True)
class Suite:
    """A config and its methods; ``steps`` (inner steps per replica; None: 40 rounds of the config's H), ``replicas``
    (the suite again for each K) and ``seeds`` are the suite's unless the command line says."""

    config: str
    methods: list[str]
    overrides: list[str] = field(default_factory=list)
    replicas: tuple[int, ...] = (4,)
    steps: int | None = None
    seeds: int = 1


# Besides each method's tuned defaults (docs/design.md, "Tuned defaults"), its papers' settings for long runs: DiLoCo's
# 0.7 and 0.9 overshoot in 40 rounds, as SparseLoCo's error memory of 0.95. LoCo runs DiLoCo's outer step on 4-bit
# values: each of its rows pairs with the DiLoCo row of the same settings, whose values travel in fp32.
SUITES = {
    "default": Suite("configs/tiny.yaml",
                     ["ddp", "diloco", "diloco:lr=0.7,momentum=0.9", "sparseloco", "sparseloco:lr=1.0,error_decay=0.95",
                      "loco", "loco:lr=0.7,momentum=0.9"]),
    # Streaming DiLoCo (P = 2 and 4 fragments of strided blocks, tau = 1, E3M0 values) next to the others, on
    # tiny.yaml with 4 layers (a block per fragment) and H = 12 (P divides H).
    "streaming": Suite("configs/tiny.yaml",
                       ["ddp", "diloco", "sparseloco", "loco", "streaming:fragments=2,delay=1",
                        "streaming:fragments=4,delay=1"], overrides=["model.n_layer=4", "inner.steps=12"]),
    # Heterogeneous SparseLoCo (arXiv 2601.02360): all full replicas, then 2-stage compressed groups for all
    # replicas (uniform) or half of them (selective), at a mild and an aggressive compression d/k.
    # Overlap: each round's all-reduce runs during the next round's inner steps. Naive: the outer step one round
    # late; eager: rebased as soon as it lands (after one inner step, or, at worst, the whole next round).
    "overlap": Suite("configs/tiny.yaml",
                     ["diloco", "diloco+overlap:naive", "diloco+overlap:eager", "diloco+overlap:eager,landing=end",
                      "sparseloco", "sparseloco+overlap:naive", "sparseloco+overlap:eager",
                      "sparseloco+overlap:eager,landing=end"]),
    "heterogeneous": Suite("configs/tiny-pipeline.yaml",
                           ["sparseloco", "selective:ratio=8", "uniform:ratio=8", "selective:ratio=32",
                            "uniform:ratio=32"]),
    # Replicas of unequal speed at equal wall time (the same rounds): the fast replica alone, two and three fast
    # ones, one fast with a 3x and a 10x slower one (tokens-weighted, then unweighted), and two fast with both.
    # DiLoCo with momentum 0.5: at 0.9 its outer step overshoots here, and whatever shrinks the mean update (slow
    # replicas' short pseudo-gradients, the fast one's clipped to twice theirs) wins: 1,3,10 beat 1,1,1.
    "pace": Suite("configs/tiny.yaml",
                  [f"{algorithm}+speeds:{speeds}{settings}" for algorithm, settings in (
                      ("sparseloco", ""), ("diloco", ",lr=0.7,momentum=0.5"))
                   for speeds in ("1", "1,1", "1,1,1", "1,3,10", "1,3,10,unweighted", "1,1,3,10")]),
    # Per-peer traffic flat in the swarm's size (run with --replicas 4 and 16): SparseLoCo's exact results (the
    # all-peer average) against resparsified ones (the default: all that n contributions selected up to 256 values
    # per chunk), and against a cap of 128 (from 2 contributions on, the fixed 128 per chunk of the default before
    # issue 33).
    "scale": Suite("configs/tiny.yaml", ["sparseloco:result=exact", "sparseloco", "sparseloco:result_topk=128"]),
    # k of 8 replicas sign-flipped inside the clip bound, claiming a full round's tokens (run with --replicas 8):
    # the honest 8 - k alone, then attacked with clipping only (the defence before issue 31), then with the
    # direction rule (collective/robust.py); one reducer that steers its span, one that equivocates, each without
    # and with the defence of issue 58 (signed results, audits).
    "byzantine": Suite("configs/tiny.yaml",
                       [*(method for k in (1, 2) for method in (f"sparseloco:replicas={8 - k}",
                                                                f"sparseloco:flipped={k},defence=off",
                                                                f"sparseloco:flipped={k}")),
                        "sparseloco", *(f"sparseloco:{attack}=1{defence}" for attack in ("steer", "equivocate")
                          for defence in (",defence=off", ""))]),
    # Model quality at equal tokens (the README's table): every method 1,000 inner steps per replica with the same
    # inner schedule, K = 4 and 8, 2 seeds; DiLoCo with its defaults before issue 33 next to its tuned ones, and
    # SparseLoCo's exact results next to its default ones. The 21.4M setting (d_model 768, 3 layers) shorter, K = 4.
    "equal-tokens": Suite("configs/tiny.yaml",
                          ["ddp", "diloco:lr=0.7,momentum=0.9,H=10", "diloco", "sparseloco", "sparseloco:result=exact",
                           "loco", "streaming"], replicas=(4, 8), steps=1000, seeds=2),
    "equal-tokens-21m": Suite("configs/tiny.yaml", ["ddp", "diloco:lr=0.7,momentum=0.9,H=10", "diloco", "sparseloco"],
                              overrides=["model.d_model=768", "model.n_layer=3", "model.n_head=12",
                                         "inner.batch_size=2", "data.seq_len=64"], steps=200),
    # The sweeps that chose each outer algorithm's defaults (docs/design.md, "Tuned defaults"): K = 4, 500 inner steps
    # each, seed 0, one or two settings changed at a time from the reference values, every value spelled out so
    # that the rows stay what they were when the defaults move; DDP is the yardstick.
    "sweep-diloco": Suite("configs/tiny.yaml",
                          ["ddp", *(f"diloco:lr={lr},momentum={momentum},H=10" for lr, momentum in (
                              (0.7, 0.9), (0.7, 0.7), (0.7, 0.5), (0.7, 0.3), (1.0, 0.5), (0.5, 0.5), (1.0, 0.0),
                              (0.3, 0.7), (0.1, 0.9)))],
                          steps=500),
    # LoCo and Streaming DiLoCo take DiLoCo's outer step: its old and its tuned settings, and each one's own knob
    # (LoCo's error decay beta, Streaming's share alpha of the local fragment kept); the DDP row: sweep-diloco's.
    "sweep-loco-streaming": Suite("configs/tiny.yaml",
                                  ["loco:lr=0.7,momentum=0.9,beta=0.8,H=10", "loco:lr=0.5,momentum=0.5,beta=0.8,H=10",
                                   "loco:lr=0.5,momentum=0.5,beta=0.95,H=10",
                                   "streaming:lr=0.7,momentum=0.9,alpha=0.5,H=10",
                                   "streaming:lr=0.5,momentum=0.5,alpha=0.5,H=10",
                                   "streaming:lr=0.5,momentum=0.5,alpha=0.0,H=10"], steps=500),
    "sweep-sparseloco": Suite("configs/tiny.yaml",
                              ["ddp", *(f"sparseloco:{settings}" for settings in (
                                  "lr=1.0,error_decay=0.95,topk=64,H=10", "lr=1.0,error_decay=0.9,topk=64,H=10",
                                  "lr=1.0,error_decay=0.8,topk=64,H=10", "lr=1.2,error_decay=0.95,topk=64,H=10",
                                  "lr=1.5,error_decay=0.95,topk=64,H=10", "lr=1.0,error_decay=0.95,topk=128,H=10",
                                  "lr=1.0,error_decay=0.95,topk=64,H=5", "lr=1.0,error_decay=0.95,topk=64,H=20",
                                  "lr=1.0,error_decay=0.7,topk=64,H=10", "lr=1.2,error_decay=0.8,topk=64,H=10"))],
                              steps=500),
    # The outer step size as the swarm grows (the scaling-law study: the best outer lr grows with K): K = 4 and 8,
    # 500 inner steps each, 2 seeds; SparseLoCo's lr at the tuned error decay, DiLoCo's at its tuned momentum.
    "sweep-replicas": Suite("configs/tiny.yaml",
                            ["ddp", *(f"sparseloco:lr={lr},error_decay={decay},topk=64,H=10" for lr, decay in (
                                (1.0, 0.8), (1.2, 0.8), (1.5, 0.8), (1.8, 0.8), (2.0, 0.8), (1.5, 0.9))),
                             *(f"diloco:lr={lr},momentum=0.5,H=10" for lr in (0.5, 0.7, 1.0))],
                            replicas=(4, 8), steps=500, seeds=2),
}
HOSTILE_SCALE = -1.9  # a hostile replica's contribution: its own, sign-flipped, at 1.9 x its length (clip: 2 x)
STEER_PUSH = 5.0  # a steering reducer's push: this times its span's mean's length
ATTACKS = {"flipped": "sign-flipped contributions", "steer": "a reducer that steers its span",
           "equivocate": "a reducer that answers members different results"}


def steps_at(speed: float, steps: int) -> int:
    """Inner steps a replica ``speed`` times slower than the fastest trains in the time of their ``steps``."""
    return max(1, round(steps / speed))


@dataclass(frozen=True)
class Method:
    """How ``run_outer`` runs a method: its config, each replica's kind (full or a pipeline), when an eager
    overlapped round lands, and, for ``+speeds``, each replica's slowdown factor and whether its contribution
    weighs its tokens."""

    config: Config  # its training.rounds: the run's inner steps / H
    kinds: list[str]
    landing: Landing
    speeds: list[float] | None = None
    weighted: bool = True
    attack: str = ""  # what the last ``hostile`` replicas do (``ATTACKS``; "": none)
    hostile: int = 0
    defended: bool = True


@dataclass(frozen=True)
class Pace:
    """What the replicas of a ``+speeds`` method trained, in all rounds."""

    speeds: list[float]
    rounds: int
    steps: list[int]  # inner steps trained, per replica
    tokens: list[int]
    weighted: bool
    clipped: list[float]  # per replica, the share of its contributions to a span that were clipped
    left_out: list[float]  # ... and that were left out as pointing against the others (``opposed``)

    def slow(self) -> list[bool]:
        return [speed > min(self.speeds) for speed in self.speeds]

    def slow_tokens_share(self) -> float:
        return sum(t for t, slow in zip(self.tokens, self.slow()) if slow) / sum(self.tokens)

    def slow_weight_share(self) -> float:
        """The slow replicas' share of the weight in every round's mean (``robust.mean_factors``; every round trains
        the same steps)."""
        uniform = [1.0] * len(self.tokens)
        scales = mean_factors(uniform, self.tokens, 0.0)[0] if self.weighted else uniform
        return sum(s for s, slow in zip(scales, self.slow()) if slow) / len(scales)


@dataclass(frozen=True)
class Byzantine:
    """How often the reducers left out an honest and a hostile replica's contribution to a span (``opposed``)."""

    replicas: int
    attack: str  # ``ATTACKS``
    hostile: int
    defended: bool
    honest_left_out: float  # share of the honest replicas' contributions to spans
    hostile_left_out: float
    caught: int  # rounds a hostile result was caught in (proven, or failed an audit) and redone
    aborted: int  # rounds nobody applied
    landed: int  # rounds applied with a hostile reducer's result in them


class SignFlipped(Communicator):
    """A hostile replica: its contribution is its own pseudo-gradient sign-flipped and scaled (``HOSTILE_SCALE``),
    well-formed and inside the clip bound, and claims a full round's tokens, the largest weight allowed. Its own
    state (error feedback) is what an honest replica's would be: it attacks every round alike."""

    def __init__(self, inner: Communicator, max_tokens: int):
        self.inner, self.max_tokens = inner, max_tokens

    def all_reduce(self, exchange: Exchange, round_index: int, name: str) -> AllReduceResult:
        sliced = as_sliced(exchange, name)
        for part in sliced.parts.values():
            if isinstance(part, SparseExchange):
                part.compressed = flipped(part.compressed)
                if part.resend is not None:  # a group too large for its results compresses it again: flipped too
                    part.resend = partial(lambda layout, resend: flipped(resend(layout)), resend=part.resend)
            elif isinstance(part, DenseMean):
                part.values.mul_(HOSTILE_SCALE)
            else:
                raise SystemExit(f"flipped=K: a hostile {type(part).__name__} is not written (sparseloco, diloco)")
        return self.inner.all_reduce(SlicedExchange(sliced.parts, self.max_tokens), round_index, name)


def flipped(compressed: list[CompressedTensor]) -> list[CompressedTensor]:
    """``compressed`` with every decoded value times ``HOSTILE_SCALE``."""
    factor = np.float32(HOSTILE_SCALE)
    return [CompressedTensor(c.grid, c.indices, c.codes, np.float32(c.shift * factor),
                             (c.table * factor).astype(np.float32)) for c in compressed]


class Setup:
    def __init__(self, config: Config, replicas: int, steps: int):
        """``steps``: inner steps per replica, the same for every method (equal tokens): ``steps / H`` rounds."""
        self.config, self.replicas, self.steps = config, replicas, steps
        self.data = load_training_data(config)
        self.eval = eval_batches(self.data.eval, config.data.seq_len, config.data.eval_sequences)
        h = config.inner.steps  # eval about 8 times, at round ends of the config's H (and of its multiples)
        self.eval_every = max(h, steps // 8 // h * h)

    def evaluates_at(self, step: int, h: int) -> bool:
        """Whether the eval loss is taken after the round of ``h`` inner steps that ends at inner step ``step``:
        the first round end at or past each ``eval_every`` steps, and the last."""
        return step == self.steps or step // self.eval_every > (step - h) // self.eval_every

    def with_replicas(self, replicas: int) -> Setup:
        """The same data and eval batches for another number of replicas."""
        other = copy.copy(self)
        other.replicas = replicas
        return other

    def method_config(self, method: str, seed: int = 0) -> Method:
        """How to run an outer method (``Method``); ``seed`` > 0 seeds the model and the data order apart."""
        name, _, settings = method.partition(":")
        algorithm, *modifiers = name.split("+")
        if not set(modifiers) <= {"overlap", "speeds"} or len(set(modifiers)) < len(modifiers):
            raise SystemExit(f"method {method!r}: expected ALGORITHM[+overlap][+speeds][:SETTINGS]")
        words = [setting for setting in settings.split(",") if setting]
        pairs = dict(word.split("=", 1) for word in words if "=" in word)
        words = [word for word in words if "=" not in word]
        attacks = {attack: int(pairs.pop(attack)) for attack in ATTACKS if attack in pairs}
        if len(attacks) > 1:
            raise SystemExit(f"method {method!r}: one attack at a time ({', '.join(attacks)})")
        attack, hostile = next(iter(attacks.items()), ("", 0))
        h = int(pairs.pop("H", self.config.inner.steps))
        if h < 1 or self.steps % h:
            raise SystemExit(f"method {method!r}: H={h} must divide the {self.steps} inner steps of the run")
        defended = pairs.pop("defence", "on") != "off"
        speeds, weighted = None, True
        if "speeds" in modifiers:
            speeds = [float(word) for word in words if is_number(word)]
            weighted = "unweighted" not in words
            words = [word for word in words if not is_number(word) and word != "unweighted"]
            if not speeds or min(speeds) < 1:
                raise SystemExit(f"method {method!r}: expected slowdown factors of 1 or more, e.g. speeds:1,3,10")
        overlap = "overlap" in modifiers
        if not overlap and words:
            raise SystemExit(f"method {method!r}: unexpected {', '.join(words)}")
        replicas = len(speeds) if speeds else int(pairs.pop("replicas", self.replicas))
        if not 0 <= hostile < replicas:
            raise SystemExit(f"method {method!r}: {attack}={hostile} of {replicas} replicas")
        if attack in ("steer", "equivocate") and (algorithm != "sparseloco" or speeds):
            raise SystemExit(f"method {method!r}: {attack}=K is written for SparseLoCo's full replicas")
        c = self.config
        # the cosine spans the whole run, as in DDP
        overrides = [f"inner.steps={h}", f"inner.total_steps={self.steps}", f"training.rounds={self.steps // h}"]
        if not defended and attack == "flipped":  # the defence against the others: InProcessGroup's
            overrides.append("outer.drop_opposed=false")
        if seed:
            overrides += [f"training.seed={seed}", f"run_id={c.run_id}-seed{seed}"]
        landing = Landing(after=1, wait=True)
        if overlap:
            if len(words) > 1 or not set(words) <= {"eager", "naive"}:
                raise SystemExit(f"method {method!r}: expected ALGORITHM+overlap:eager or ALGORITHM+overlap:naive")
            (update,) = words or ["eager"]
            overrides += [f"outer.{algorithm}.overlap=true", f"outer.{algorithm}.overlap_update={update}"]
            steps = pairs.pop("landing", "1")
            landing = Landing(after=h if steps == "end" else int(steps), wait=True)
        kinds = [FULL] * replicas
        if algorithm in ("selective", "uniform"):
            ratio = int(pairs.pop("ratio", "8"))
            overrides += ["outer.algorithm=sparseloco", f"pipeline.compression={algorithm}",
                          f"pipeline.rank={c.model.d_model // ratio}"]
            groups = replicas if algorithm == "uniform" else int(pairs.pop("groups", replicas // 2))
            kinds = [FULL] * (replicas - groups) + [GROUP] * groups
            algorithm = "sparseloco"
        else:
            overrides += [f"outer.algorithm={algorithm}", "pipeline.compression=none"]
        overrides += [f"outer.{algorithm}.{key}={value}" for key, value in pairs.items()]
        return Method(with_overrides(c, overrides), kinds, landing, speeds, weighted, attack, hostile, defended)


def is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def global_model(swarm: InProcessSwarm, config: Config) -> Transformer:
    """The published global parameters in one whole model (projected onto span(U) if replica 0 is constrained)."""
    workers = swarm.replicas[0]
    model = Transformer(config.model, config.training.seed, token_table=workers[0].model.token_table)
    values = {name: p for w in workers for name, p in zip(w.names, w.published.params)}
    names = [name for name, _ in model.named_parameters()]
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(values[name])
    constraint = workers[0].constraint
    if constraint is not None:
        SubspaceConstraint(constraint.subspace, names, constrained_dims(config.model, config.pipeline.stages)
                           ).project_(list(model.parameters()))
    return model


def global_params(swarm: InProcessSwarm) -> dict[str, torch.Tensor]:
    return {name: p.clone() for w in swarm.workers for name, p in zip(w.names, w.outer.params)}


def off_span_share(swarm: InProcessSwarm, config: Config, initial: dict[str, torch.Tensor]) -> float | None:
    """The share of the global parameters' movement since the start that lies outside span(U), over the
    constrained tensors: ||(I - P) d|| / ||d|| for d = final - initial (None without a compressed group)."""
    constrained = [w for replica in swarm.replicas for w in replica if w.constraint is not None]
    if not constrained:
        return None
    subspace = constrained[0].constraint.subspace
    final = global_params(swarm)
    outside = total = 0.0
    for name, dim in constrained_dims(config.model, config.pipeline.stages).items():
        moved = final[name] - initial[name]
        total += float(moved.pow(2).sum())
        outside += float((moved - subspace.project_(moved.clone(), dim)).pow(2).sum())
    return (outside / total) ** 0.5


Run = tuple[list[tuple[int, float]], int, int, float | None, Pace | None, Byzantine | None]


def run_outer(setup: Setup, method: str, seed: int = 0) -> Run:
    """An outer method: the eval-loss curve (at outer rounds), all-reduce bytes per replica, the
    stage-boundary bytes per pipeline (0 without pipelines), the off-span share of the global update, what
    replicas of unequal speed trained (None without ``+speeds``), and what the reducers left out of hostile
    replicas' and honest ones' contributions, and the rounds hostile results were caught in (None without an
    attack)."""
    plan = setup.method_config(method, seed)
    config = plan.config
    budgets = [FixedSteps(steps_at(speed, config.inner.steps)) for speed in plan.speeds] if plan.speeds else None
    replicas = len(plan.kinds)
    attackers = range(replicas - plan.hostile, replicas)
    flippers = {i: partial(SignFlipped, max_tokens=config.max_contribution_tokens)
                for i in attackers if plan.attack == "flipped"}
    reducers = {i: Steering(STEER_PUSH) if plan.attack == "steer" else Equivocating()
                for i in attackers if plan.attack in ("steer", "equivocate")}
    swarm = build_swarm(config, plan.kinds, setup.data.train, landing=plan.landing, budgets=budgets,
                        weighted=plan.weighted, adversaries=flippers, hostile=reducers, defended=plan.defended)
    initial = global_params(swarm)
    curve: list[tuple[int, float]] = []
    h, rounds = config.inner.steps, config.training.rounds

    def after_round(r: int) -> None:
        if setup.evaluates_at((r + 1) * h, h):
            curve.append(((r + 1) * h, evaluate(global_model(swarm, config), setup.eval, CPU)))

    swarm.train(rounds, after_round)
    all_reduce = sum(swarm.all_reduce_bytes) // len(swarm.replicas)
    groups = [r for r in swarm.replicas if len(r) > 1]
    boundary = sum(t.bytes_sent for t in swarm.transports) // max(1, len(groups))
    pace = None
    if plan.speeds:  # full replicas only: replica i is worker i, and reduces one span of each of its rounds
        spans = rounds * len(swarm.replicas)
        pace = Pace(plan.speeds, rounds, swarm.steps, swarm.tokens, plan.weighted,
                    [swarm.clipped[f"replica-{i}"] / spans for i in range(len(swarm.replicas))],
                    [swarm.opposed[f"replica-{i}"] / spans for i in range(len(swarm.replicas))])
    byzantine = None
    if plan.attack:  # full replicas: each contributes to one span of every reducer a round
        spans = rounds * replicas  # one span of every reducer, its own included, each round
        left_out = [swarm.opposed[f"replica-{i}"] for i in range(replicas)]
        byzantine = Byzantine(replicas, plan.attack, plan.hostile, plan.defended,
                              sum(left_out[: replicas - plan.hostile]) / (spans * (replicas - plan.hostile)),
                              sum(left_out[replicas - plan.hostile:]) / (spans * plan.hostile),
                              swarm.group.caught, swarm.group.aborted, swarm.group.landed)
    return curve, all_reduce, boundary, off_span_share(swarm, config, initial), pace, byzantine


class AllReplicaBatches(GradientSource):
    """DDP's gradient: the mean of the K replicas' gradients, each on its own batch, as an all-reduce of gradients
    makes it. One model on the K batches at once: the mean loss over all their tokens is the mean of the K batches'
    mean losses (equal sizes), so its gradient is the same mean, computed in one pass."""

    def __init__(self, model: Transformer, samplers: list[ShardSampler], micro_batches: int):
        self.model, self.samplers, self.micro_batches = model, samplers, micro_batches
        self.tokens_per_step = len(samplers) * micro_batches * samplers[0].batch_size * samplers[0].seq_len

    def accumulate(self, step: int) -> float:
        total = 0.0
        for micro in range(self.micro_batches):
            batches = [sampler.batch(step * self.micro_batches + micro) for sampler in self.samplers]
            inputs, targets = (torch.cat(parts) for parts in zip(*batches))
            loss = self.model(inputs, targets=targets) / self.micro_batches
            loss.backward()
            total += loss.item()
        return total


def run_ddp(setup: Setup, seed: int = 0) -> Run:
    """AdamW on the mean of the replicas' gradients at every step (replicas stay identical: one model stands for all),
    with the inner steps' learning-rate schedule over the whole run. Bytes: a dense fp32 all-reduce of the gradients
    at every step, the butterfly a replica would run (``dense_fp32_bytes``)."""
    c = with_overrides(setup.config, [f"training.seed={seed}", f"run_id={setup.config.run_id}-seed{seed}"]) if seed \
        else setup.config
    torch.set_num_threads(min(setup.replicas, os.cpu_count() or 1))  # the cores its K replicas' threads would share
    try:
        model = Transformer(c.model, c.training.seed)
        samplers = [ShardSampler(setup.data.train, c.data.seq_len, c.inner.batch_size, c.run_id, f"replica-{rank}")
                    for rank in range(setup.replicas)]
        inner = InnerTrainer(model, c.inner, AllReplicaBatches(model, samplers, c.inner.grad_accum), CPU, setup.steps)
        curve: list[tuple[int, float]] = []
        model.train()
        for step in range(setup.steps):
            inner.step(step)
            if setup.evaluates_at(step + 1, 1):
                curve.append((step + 1, evaluate(model, setup.eval, CPU)))
                model.train()
    finally:
        torch.set_num_threads(1)
    geometry = DenseMean([p.detach() for p in model.parameters()])
    spans = geometry.partition(setup.replicas)
    per_step = sum(dense_fp32_bytes(geometry, spans, i) for i in range(setup.replicas)) // setup.replicas
    return curve, per_step * setup.steps, 0, None, None, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suite", choices=sorted(SUITES), default="default",
                        help="a config, its methods, and (some suites) replicas, steps and seeds")
    parser.add_argument("--config", help="model and training config (default: the suite's)")
    parser.add_argument("--replicas", type=int, nargs="+", help="K; several: the suite again for each (default: 4)")
    parser.add_argument("--steps", type=int, help="inner steps per replica, the same for every method (default: "
                                                  "the suite's, or --rounds x the config's H)")
    parser.add_argument("--rounds", type=int, help="outer rounds of the config's H (default 40): --steps = rounds x H")
    parser.add_argument("--seeds", type=int, help="runs of every method, seeded apart (tables: means; default 1)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--methods", nargs="+", help='e.g. ddp diloco "sparseloco:topk=128" selective:ratio=8')
    parser.add_argument("--json", action="store_true", help="print one JSON object per method instead of tables")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the replicas' threads share the cores
    say = (lambda *_, **__: None) if args.json else print

    suite = SUITES[args.suite]
    config_path = args.config or suite.config
    config = load_config(config_path, list(suite.overrides) + args.overrides)
    if args.steps and args.rounds:
        raise SystemExit("give --steps or --rounds, not both")
    steps = args.steps or (args.rounds * config.inner.steps if args.rounds else suite.steps or 40 * config.inner.steps)
    seeds = args.seeds or suite.seeds
    methods = args.methods or list(suite.methods)
    sizes = args.replicas or suite.replicas
    setup = Setup(config, sizes[0], steps)
    figures = []
    for n, replicas in enumerate(sizes):
        setup = setup.with_replicas(replicas)
        if n:
            say()
        tokens = replicas * steps * config.inner.grad_accum * config.inner.batch_size * config.data.seq_len
        if all("+speeds" in m for m in methods):
            say(f"{steps} inner steps for a replica of speed 1 (one F times slower: 1/F of them), model {config_path}, "
                f"{seeds} seed(s)")
        else:
            say(f"{replicas} replicas, {steps} inner steps each (H={config.inner.steps} unless a method says), "
                f"{tokens / 1e6:.2f}M tokens per method, model {config_path}, {seeds} seed(s)")
        runs: dict[str, list[Run]] = {}
        for method in methods:
            for seed in range(seeds):
                started = time.perf_counter()
                run = run_ddp(setup, seed) if method == "ddp" else run_outer(setup, method, seed)
                runs.setdefault(method, []).append(run)
                say(f"  {method} (seed {seed}): {time.perf_counter() - started:.0f} s, final eval loss "
                    f"{run[0][-1][1]:.3f}", flush=True)
        # Per method: the mean eval-loss curve over seeds, and the first seed's traffic (the same for every seed).
        results = {m: ([(step, statistics.fmean(curve[k][1] for curve, *_ in seeded))
                        for k, (step, _) in enumerate(seeded[0][0])], *seeded[0][1:]) for m, seeded in runs.items()}
        figures += [{"method": m, "final_eval_loss": round(results[m][0][-1][1], 4),
                     "seeds": [round(curve[-1][1], 4) for curve, *_ in seeded], "inner_steps": steps,
                     "replicas": len(pace.speeds) if pace else replicas,
                     "all_reduce_bytes_per_replica": results[m][1], **pace_json(pace),
                     **byzantine_json(results[m][5], honest_alone(results, m))}
                    for m, seeded in runs.items() for pace in [results[m][4]]]
        if not args.json:
            print_tables(results, runs, seeds)
    if args.json:
        print(json.dumps(figures, indent=1))


def print_tables(results: dict[str, Run], runs: dict[str, list[Run]], seeds: int) -> None:
    """The eval-loss curves, final losses by seed, the comparison table, and the overlap, pace and byzantine
    tables where such methods ran."""
    steps = sorted({step for curve, *_ in results.values() for step, _ in curve})
    print()
    print("Eval loss by inner step" + (f" (mean of {seeds} seeds)" if seeds > 1 else ""))
    print(format_table(["step", *results], [
        [step, *(f"{dict(curve)[step]:.3f}" if step in dict(curve) else "-" for curve, *_ in results.values())]
        for step in steps]))
    if seeds > 1:
        print()
        print("Final eval loss by seed")
        print(format_table(["method", *(f"seed {s}" for s in range(seeds)), "mean"], [
            [m, *(f"{curve[-1][1]:.3f}" for curve, *_ in seeded), f"{results[m][0][-1][1]:.3f}"]
            for m, seeded in runs.items()]))
    print()
    final = {m: curve[-1][1] for m, (curve, *_) in results.items()}
    reference = final.get("ddp", final.get("sparseloco"))
    against = "DDP" if "ddp" in final else "SparseLoCo"
    rows = [(m, f"{final[m]:.3f}", f"{100 * (final[m] / reference - 1):+.1f}%" if reference else "-",
             human_bytes(traffic), human_bytes(boundary) if boundary else "-",
             f"{outside:.3f}" if outside is not None else "-")
            for m, (_, traffic, boundary, outside, *_) in results.items()]
    print(format_table(("method", "final eval loss", f"vs {against}", "all-reduce bytes per replica",
                        "stage-boundary bytes per group", "update off span(U)"), rows))
    overlapped = [m for m in final if "+overlap" in m and "+speeds" not in m and m.split("+")[0] in final]
    if overlapped:
        print()
        print("Overlap against the same algorithm without it")
        print(format_table(("method", "final eval loss", "no overlap", "difference"), [
            (m, f"{final[m]:.3f}", f"{final[m.split('+')[0]]:.3f}",
             f"{100 * (final[m] / final[m.split('+')[0]] - 1):+.2f}%") for m in overlapped]))
    paced = {m: result[4] for m, result in results.items() if result[4] is not None}
    if paced:
        print()
        print("Replicas of unequal speed, equal wall time (the same rounds); slow: slower than the fastest")
        print(format_table(("method", "steps/round", "final eval loss", "vs fastest alone", "tokens",
                            "slow tokens", "slow weight", "clipped by replica", "left out by replica"), [
            (m, "/".join(str(s // pace.rounds) for s in pace.steps), f"{final[m]:.3f}", versus(final, m),
             f"{sum(pace.tokens) / 1e6:.2f}M", f"{100 * pace.slow_tokens_share():.0f}%",
             f"{100 * pace.slow_weight_share():.0f}%", "/".join(f"{100 * c:.0f}%" for c in pace.clipped),
             "/".join(f"{100 * c:.0f}%" for c in pace.left_out))
            for m, pace in paced.items()]))
    attacked = {m: result[5] for m, result in results.items() if result[5] is not None}
    if attacked:
        print()
        print(f"Hostile replicas against the honest replicas alone: sign-flipping ones inside the clip bound, claiming "
              f"a full round's tokens ({HOSTILE_SCALE} x their own pseudo-gradient; left out: a reducer's direction "
              f"rule), reducers that steer their span ({STEER_PUSH} x its mean) or answer members different results")
        rows = []
        for m, byzantine in attacked.items():
            alone = honest_alone(results, m)
            rows.append((m, f"{byzantine.hostile} {byzantine.attack}", "on" if byzantine.defended else "off",
                         f"{final[m]:.3f}", f"{alone:.3f}" if alone else "-",
                         f"{100 * (final[m] / alone - 1):+.1f}%" if alone else "-",
                         f"{100 * byzantine.honest_left_out:.1f}%", f"{100 * byzantine.hostile_left_out:.1f}%",
                         *((byzantine.caught, byzantine.aborted, byzantine.landed) if byzantine.attack != "flipped"
                           else ("-", "-", "-"))))
        print(format_table(("method", "hostile", "defence", "final eval loss", "honest alone", "vs honest alone",
                            "honest spans left out", "hostile spans left out", "rounds caught", "rounds aborted",
                            "hostile results applied"),
                           rows))


def versus(final: dict[str, float], method: str) -> str:
    """The final eval loss against the fastest replica alone (``+speeds:1``) with the same algorithm and
    settings, where it ran."""

    def split(m: str) -> tuple[tuple[str, tuple[str, ...]], list[float]]:
        name, _, settings = m.partition(":")
        words = [w for w in settings.split(",") if w and w != "unweighted"]  # one replica: nothing to weigh
        return (name, tuple(w for w in words if not is_number(w))), [float(w) for w in words if is_number(w)]

    key = split(method)[0]
    alone = next((final[m] for m in final if "+speeds" in m and split(m) == (key, [1.0])), None)
    return f"{100 * (final[method] / alone - 1):+.1f}%" if alone else "-"


def honest_alone(results: dict[str, Run], method: str) -> float | None:
    """The final eval loss of an attacked method's honest replicas alone (``replicas=N - K`` with the same algorithm
    and other settings; all N where the attackers contributed honestly), where it ran."""
    byzantine = results[method][5]
    if byzantine is None:
        return None

    def settings(m: str) -> tuple[str, list[str]]:
        name, _, words = m.partition(":")
        plan = (*(f"{attack}=" for attack in ATTACKS), "defence=", "replicas=")
        return name, sorted(w for w in words.split(",") if w and not w.startswith(plan))

    # A steering reducer contributes honestly all along; the other attackers' contributions count for nothing (or,
    # proven, they are out of the run)
    honest = byzantine.replicas - (byzantine.hostile if byzantine.attack != "steer" else 0)

    def replicas(m: str) -> int:
        words = dict(w.split("=", 1) for w in m.partition(":")[2].split(",") if "=" in w)
        return int(words.get("replicas", byzantine.replicas))

    return next((result[0][-1][1] for other, result in results.items()
                 if result[5] is None and settings(other) == settings(method) and replicas(other) == honest), None)


def byzantine_json(byzantine: Byzantine | None, alone: float | None) -> dict:
    if byzantine is None:
        return {}
    return {"attack": byzantine.attack, "hostile": byzantine.hostile, "defended": byzantine.defended,
            "rounds_caught": byzantine.caught, "rounds_aborted": byzantine.aborted,
            "rounds_applied_with_hostile_results": byzantine.landed,
            "honest_left_out_share": round(byzantine.honest_left_out, 4),
            "hostile_left_out_share": round(byzantine.hostile_left_out, 4),
            "honest_alone_final_eval_loss": None if alone is None else round(alone, 4)}


def pace_json(pace: Pace | None) -> dict:
    if pace is None:
        return {}
    return {"speeds": pace.speeds, "weighted": pace.weighted, "steps_per_replica": pace.steps,
            "tokens_per_replica": pace.tokens, "tokens": sum(pace.tokens),
            "slow_tokens_share": round(pace.slow_tokens_share(), 4),
            "slow_weight_share": round(pace.slow_weight_share(), 4),
            "clipped_share_per_replica": [round(c, 4) for c in pace.clipped],
            "left_out_share_per_replica": [round(c, 4) for c in pace.left_out]}


if __name__ == "__main__":
    main()
