"""One record per outer round: the single source for logs, progress lines, summaries and benchmarks."""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import blake3

if TYPE_CHECKING:
    import torch


# What a round record reads of the round's results, as the modules that make them (above this one, which the
# data and the status pages import) have them
class InnerSteps(Protocol):  # ``inner.InnerStats``
    loss: float
    tokens: int
    steps: int
    seconds: float


class Syncs(Protocol):  # ``outer.base.Synced``: its ``all_reduce`` is a ``collective.exchange.AllReduceResult``
    all_reduce: Any
    applied: bool


class StateOrigin(Protocol):  # ``standing.Membership``
    joined_round: int
    source: str
    catchup_seconds: float
    catchup_bytes: int
    catchup_updates: int


@dataclass
class RoundSummary:
    round: int
    peers: int  # size of the group this node all-reduced with (1 when alone)
    loss: float  # mean inner training loss of the round
    eval_loss: float | None  # held-out loss of the global params after the round (None if not measured)
    params_digest: str  # hash of the global params this node holds after the round: equal on every peer of the group
    round_seconds: float
    bytes_sent: int = 0  # payload bytes of this node's all-reduce traffic in the round
    bytes_received: int = 0
    dense_fp32_bytes: int = 0  # what a dense fp32 butterfly among the same peers would send + receive
    density: float = 1.0  # share of coordinates this node sent (1.0 for dense algorithms)
    bits_per_param: float = 0.0  # size of this node's encoded pseudo-gradient (its upload), in bits per parameter
    tokens: int = 0  # tokens this node trained on in the round (a pipeline group's, for each of its stages)
    inner_steps: int = 0  # inner steps it trained: H, or fewer where the round's time budget allowed fewer
    # the weight its contribution to the round's all-reduce carried: its tokens, plus those of earlier work that no
    # aggregate had applied yet (docs/design.md, "Slow peers"); in the aggregate if ``applied``
    contributed_tokens: int = 0
    # the tokens the aggregate it applied weighed, every member's (0 if it applied none): the run's tokens so far
    aggregate_tokens: int = 0
    reachability: str = "public"  # whether others could dial it: public, relayed or client (swarm/reachability.py)
    inner_seconds: float = 0.0
    comm_seconds: float = 0.0
    peer_id: str = ""
    role: str = "replica"  # replica (the whole model) or stage (one stage of a pipeline group)
    group: str | None = None  # a stage's pipeline group (None for replicas)
    stage: int | None = None  # a stage's stage in that group (None for replicas)
    slice_digest: dict[str, str] = field(default_factory=dict)  # slice -> hash of its global params after the round
    boundary_bytes_sent: int = 0  # a stage's activations and gradients sent to its group's other stages
    boundary_bytes_received: int = 0
    boundary_seconds: float = 0.0  # of inner_seconds, a stage's time sending to or waiting on its group's stages
    # this node's record traffic with the DHT since its previous round record: the serialized records it stored
    # and those its lookups returned (``PeerDirectory.dht_bytes``; not hivemind's routing or replication)
    dht_bytes_sent: int = 0
    dht_bytes_received: int = 0
    dropped_peers: list[str] = field(default_factory=list)  # left out of the aggregate (bad or missing data)
    clipped_peers: list[str] = field(default_factory=list)  # whose contribution to this node's span was scaled down
    # whose contribution to this node's span it left out: it pointed against the others' (collective/robust.py)
    opposed_peers: list[str] = field(default_factory=list)
    update_norm: float = 0.0  # L2 norm of the change the round made to the global params (0 if not applied)
    applied: bool = True  # False: the round did not commit here (late, aborted, dropped); params unchanged
    excluded: bool = False  # True: others applied this round without this node (late or dropped): it catches up
    refused_by: list[str] = field(default_factory=list)  # reducers that rejected this node's contribution
    # True: its step outlasts the round, so it trained one while nobody waited for it, and contributes the step's
    # work in its next round (budget.py)
    sat_out: bool = False
    joined_round: int = 0  # the round this node last (re)joined at
    state_source: str = "init"  # where that state came from: init (seed), checkpoint, or peer
    catchup_seconds: float = 0.0  # time spent fetching the swarm's state before this round
    catchup_bytes: int = 0  # what that fetched: the updates of the rounds it missed, or the state (catchup.py)
    catchup_updates: int = 0  # rounds' updates it applied then (0: it fetched the state, or did not catch up)
    timestamp: float = 0.0
    compute_utilisation: float = 0.0  # inner seconds / wall seconds since the previous record (or the round's start)
    # bytes (sent + received) of each all-reduce of the round: one per fragment with Streaming DiLoCo, else one
    fragment_bytes: list[int] = field(default_factory=list)
    peak_sync_bytes: int = 0  # the largest of them: what one sync asks of the link at once
    attempts: int = 1  # butterflies the round's all-reduce ran: 2 when it was redone
    failures: dict[str, int] = field(default_factory=dict)  # what went wrong for this node, by kind (errors.Failure)

    @classmethod
    def of(cls, round_index: int, started: float, previous: Sequence[RoundSummary], membership: StateOrigin,
           inner: InnerSteps | None = None, synced: Syncs | None = None, **fields: Any) -> RoundSummary:
        """The record of ``round_index``, made now: of a round that began at ``started`` (its perf_counter()) after
        the records ``previous``, trained from a state this node came by as ``membership`` says, with its inner
        steps' ``inner`` stats and its syncs' result ``synced`` (either None: the round had none), and ``fields``,
        the rest by name (this node's, its state's and its role's)."""
        values = {"peers": 1, "eval_loss": None, **(_inner_fields(inner) if inner is not None else {}),
                  **(_sync_fields(synced) if synced is not None else {}), **fields}
        utilisation = cls.utilisation(float(values.get("inner_seconds", 0.0)), previous, started)
        return cls(round=round_index, **values, compute_utilisation=utilisation,
                   round_seconds=time.perf_counter() - started, joined_round=membership.joined_round,
                   state_source=membership.source, catchup_seconds=membership.catchup_seconds,
                   catchup_bytes=membership.catchup_bytes, catchup_updates=membership.catchup_updates,
                   timestamp=time.time())

    @staticmethod
    def utilisation(inner_seconds: float, previous: Sequence[RoundSummary], started: float) -> float:
        """``compute_utilisation`` of a record made now: inner seconds over the wall seconds since the previous
        record (``previous[-1]``; for a node's first record, since ``started``, the round's perf_counter())."""
        wall = time.time() - previous[-1].timestamp if previous else time.perf_counter() - started
        return min(1.0, inner_seconds / wall) if wall > 0 else 0.0


def _inner_fields(stats: InnerSteps) -> dict[str, Any]:
    """What a round record says of the round's inner steps."""
    return {"loss": stats.loss, "tokens": stats.tokens, "inner_steps": stats.steps, "inner_seconds": stats.seconds}


def _sync_fields(synced: Syncs) -> dict[str, Any]:
    """What a round record says of the round's syncs: who took part and how it ended, and the traffic."""
    result, traffic = synced.all_reduce, synced.all_reduce.traffic
    syncs = traffic.sync_bytes or [traffic.bytes_sent + traffic.bytes_received]
    return {"peers": len(result.peers), "applied": synced.applied, "excluded": result.excluded,
            "refused_by": result.refused_by,
            "contributed_tokens": result.tokens, "dropped_peers": result.dropped,
            "aggregate_tokens": sum(result.weights.values()) if synced.applied else 0,
            "clipped_peers": result.clipped, "opposed_peers": result.opposed, "attempts": result.attempts,
            "failures": dict(Counter(str(failure) for failure in result.failures)),
            "bytes_sent": traffic.bytes_sent, "bytes_received": traffic.bytes_received,
            "dense_fp32_bytes": traffic.dense_fp32_bytes, "comm_seconds": traffic.seconds,
            "bits_per_param": 8 * traffic.contribution_bytes / traffic.params if traffic.params else 0.0,
            "fragment_bytes": syncs, "peak_sync_bytes": max(syncs)}


class MetricsLog:
    """Appends round records to ``metrics.jsonl``, one JSON object per line, flushed every round."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, summary: RoundSummary) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(asdict(summary)) + "\n")


class TensorBoardLog:
    """Round records as TensorBoard scalars, when the optional ``tensorboard`` package is installed
    (``pip install p2ploco[tensorboard]``); otherwise it does nothing."""

    SCALARS = ("loss", "eval_loss", "peers", "bytes_sent", "bytes_received", "bits_per_param", "inner_seconds",
               "comm_seconds", "round_seconds", "compute_utilisation")

    def __init__(self, directory: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is an optional extra
            self.writer = None
        else:
            self.writer = SummaryWriter(str(directory))

    def write(self, summary: RoundSummary) -> None:
        if self.writer is None:
            return
        values = asdict(summary)
        for name in self.SCALARS:
            if values[name] is not None:
                self.writer.add_scalar(f"round/{name}", values[name], summary.round)
        if summary.round_seconds:
            self.writer.add_scalar("round/tokens_per_second", summary.tokens / summary.round_seconds, summary.round)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def read_summaries(path: Path) -> list[dict]:
    """Records written so far; a torn last line (a writer killed mid-write) is skipped."""
    summaries = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                summaries.append(json.loads(line))
            except ValueError:
                continue
    return summaries


def steady_rounds(rounds: Sequence[int]) -> list[int]:
    """The rounds a benchmark's per-round means go over: 1 .. R-2 of ``rounds`` (round 0 includes the start-up, the
    last one evaluates and checkpoints, or has no newcomers after it); with fewer than 3, all but round 0; with one,
    that one."""
    rounds = list(rounds)
    if len(rounds) >= 3:
        return rounds[1:-1]
    return rounds[1:] or rounds


def params_sha256(names: Sequence[str], tensors: Iterable[torch.Tensor]) -> str:
    """Digest of parameters by name, shape and float32 bits: equal exactly when the parameters are."""
    return _hexdigest(hashlib.sha256(), sorted(zip(names, tensors), key=lambda item: item[0]))


def state_digest(params: dict[str, torch.Tensor], shared: dict[str, torch.Tensor]) -> str:
    """BLAKE3 digest of a slice's global state: its parameters and the outer state every peer holds alike for them
    (momentum), by name, shape and float32 bits. What a peer's record vouches for, and what a peer that catches up
    checks its download against: the optimizer state that travels with the parameters is covered too.

    Every round hashes the whole state before its record and the next round's announcement can be written (600 MB at
    150m.yaml). BLAKE3 is a cryptographic hash built as a tree: SIMD-wide at several GB/s a core (SHA-256 without
    SHA extensions: 0.17 GB/s on the 2-core development machine), spread over the process's torch threads, and one
    digest whatever the number of threads."""
    import torch  # here, not at the top: `p2ploco peers --from` formats with this module and must start fast

    named = sorted([(f"param/{name}", t) for name, t in params.items()]
                   + [(f"shared/{key}", t) for key, t in shared.items()], key=lambda item: item[0])
    return _hexdigest(blake3.blake3(max_threads=torch.get_num_threads()), named)


def _hexdigest(digest, named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """``digest`` (a hashlib or blake3 object) of each named tensor in turn: its name, shape and float32 bytes."""
    import torch  # here, not at the top: `p2ploco peers --from` formats with this module and must start fast

    for name, tensor in named:
        values = tensor.detach().to("cpu", torch.float32).contiguous()
        digest.update(f"{name}:{tuple(values.shape)};".encode())
        digest.update(values.view(-1).view(torch.uint8).numpy())  # hashed in place: no copy of the state
    return digest.hexdigest()


def human_bytes(count: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(count) < 1000 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} GB"


def human_count(count: float) -> str:
    """``count`` to three significant figures: 812, 47.1k, 1.25M, 3.40B."""
    for unit in ("", "k", "M"):
        if abs(count) < 999.5:  # three figures that round to 1000 are the next unit's 1
            return f"{count:.0f}" if not unit else f"{count:.3g}{unit}"
        count /= 1000
    return f"{count:.3g}B" if abs(count) < 999.5 else f"{count:,.0f}B"


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table with right-aligned columns, readable in any terminal or log."""
    cells = [list(map(str, header))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
