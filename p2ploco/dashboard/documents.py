"""The JSON documents behind the dashboard, served by a node's status endpoint (``swarm/status.py``). Version 1,
in the path; each document says its ``format`` too, and a change an older page would misread gets a new one::

    GET /api/v1/peers           the status document (``swarm/status_document.py``): the run's live peer records
    GET /api/v1/rounds?after=R  the serving node's rounds after round R (all of them without ``after``), oldest
                                first, at most MAX_ROUNDS_PER_ANSWER; "more": true says there are newer ones to ask for
        {"format": 1, "peer_id": ID, "more": false, "weights": {PEER: TOKENS, ...},
         "rounds": [{"round", "time", "peers", "loss", "eval_loss", "tokens", "aggregate_tokens", "applied",
                     "outcome", "attempts", "inner_seconds", "comm_seconds", "round_seconds", "bytes_sent",
                     "bytes_received", "dense_fp32_bytes", "dropped", "clipped", "opposed"}, ...]}
    GET /api/v1/run             {"format": 1, "run_id", "peer_id", "name", "peer_ttl", "join_command",
                                 "config": [[LABEL, TEXT], ...]}

A round's ``aggregate_tokens`` is what the aggregate it applied weighed in all (every member's tokens, as the group
settled them: ``AllReduceResult.weights``; 0 if it applied none): the x axis of loss against tokens. ``weights`` are
those of the newest aggregate the node applied, by peer: each peer's share of it. ``outcome`` says how the
round ended for the serving node (``outcome_of``). A float no JSON holds (a diverged loss) is null.

Records are the node's own; peer records are anyone's, and the page shows every string as text. This module loads
neither hivemind nor torch (``p2ploco dashboard --from`` serves these paths from a remote node).
"""

from __future__ import annotations

import asyncio
import json
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from p2ploco.swarm.status import Answer

if TYPE_CHECKING:
    from p2ploco.config import Config
    from p2ploco.metrics import RoundSummary

ROUNDS_DOCUMENT = "/api/v1/rounds"
RUN_STATUS = "/api/v1/run"
DOCUMENT_FORMAT = 1
MAX_ROUNDS_PER_ANSWER = 2000  # about 0.8 MB of JSON: a page holding none asks a few times for a long run's
MAX_AFTER_DIGITS = 12


def finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def outcome_of(r: RoundSummary) -> str:
    """How round ``r`` ended for its node, in a few words: applied (alone, after a redo), sat out, or not applied
    and why (what went wrong for it: ``errors.Failure``)."""
    if r.sat_out:
        return "sat out"
    if r.applied:
        return "applied alone" if r.peers == 1 else "applied after a redo" if r.attempts > 1 else "applied"
    why = ", ".join(sorted(r.failures)) or ("others went on without it" if r.excluded else "no aggregate")
    return f"not applied: {why}"


def round_entry(r: RoundSummary) -> dict[str, Any]:
    return {"round": r.round, "time": r.timestamp, "peers": r.peers, "loss": finite(r.loss),
            "eval_loss": finite(r.eval_loss), "tokens": r.tokens, "aggregate_tokens": r.aggregate_tokens,
            "applied": r.applied, "outcome": outcome_of(r), "attempts": r.attempts, "inner_seconds": r.inner_seconds,
            "comm_seconds": r.comm_seconds, "round_seconds": r.round_seconds, "bytes_sent": r.bytes_sent,
            "bytes_received": r.bytes_received, "dense_fp32_bytes": r.dense_fp32_bytes,
            "dropped": len(r.dropped_peers), "clipped": len(r.clipped_peers), "opposed": len(r.opposed_peers)}


def parse_after(query: str) -> int | None:
    """The round ``after=R`` names (-1 without it); None if the query is anything else."""
    if not query:
        return -1
    name, _, value = query.partition("=")
    if name != "after" or not value.isascii() or not value.isdigit() or len(value) > MAX_AFTER_DIGITS:
        return None
    return int(value)


class RoundsFeed:
    """The route of ROUNDS_DOCUMENT: ``records``, the node's round records as its training thread appends them.
    Each record is encoded once, the first time it is asked for (off the event loop), so an update that asks for
    the newest rounds costs what they are."""

    def __init__(self, peer_id: str, summaries: Sequence[RoundSummary], weights: Callable[[], Mapping[str, int]]):
        """``weights``: the members of the newest aggregate the node applied, and the tokens each weighed."""
        self.peer_id, self.summaries, self.weights = peer_id, summaries, weights
        self._encoded: list[bytes] = []  # records[i] as JSON, for the first len(_encoded) records
        self._encoding = threading.Lock()  # requests encode in executor threads

    async def __call__(self, query: str) -> Answer:
        after = parse_after(query)
        if after is None:
            return Answer.error(400, f"ask {ROUNDS_DOCUMENT}?after=ROUND (the newest round held) or for all rounds")
        return Answer(200, await asyncio.get_running_loop().run_in_executor(None, self.answer, after))

    def answer(self, after: int) -> bytes:
        summaries = list(self.summaries)  # one look: the training thread may append meanwhile
        with self._encoding:
            for r in summaries[len(self._encoded):]:
                self._encoded.append(json.dumps(round_entry(r), allow_nan=False).encode())
            encoded = self._encoded[:len(summaries)]
        start = next((i for i in range(len(summaries) - 1, -1, -1) if summaries[i].round <= after), -1) + 1
        chosen = encoded[start:start + MAX_ROUNDS_PER_ANSWER]
        head = {"format": DOCUMENT_FORMAT, "peer_id": self.peer_id,
                "more": start + MAX_ROUNDS_PER_ANSWER < len(summaries), "weights": dict(self.weights())}
        return json.dumps(head).encode()[:-1] + b', "rounds": [' + b", ".join(chosen) + b"]}"


def run_status(run_id: str, peer_id: str, name: str, peer_ttl: float, join_command: str,
                 config: Sequence[tuple[str, str]]) -> bytes:
    """RUN_DOCUMENT's body: the run, the serving peer, how to join, and ``config`` as (label, text) rows."""
    return json.dumps({"format": DOCUMENT_FORMAT, "run_id": run_id, "peer_id": peer_id, "name": name,
                       "peer_ttl": peer_ttl, "join_command": join_command, "config": [list(row) for row in config]},
                      allow_nan=False).encode()


def config_rows(c: Config) -> list[tuple[str, str]]:
    """The run's settings a person watching it asks about first, as (label, text) rows of RUN_DOCUMENT."""
    outer = c.outer.algorithm
    overlap = f", overlapped ({c.outer.overlap})" if c.outer.overlap is not None else ""
    m, i, d = c.model, c.inner, c.data
    return [("run", c.run_id),
            ("outer algorithm", f"{outer}, outer lr {getattr(c.outer, outer).lr}{overlap}"),
            ("model", f"{m.n_layer} layers, d_model {m.d_model}, {m.n_head} heads, vocabulary {m.vocab_size}"),
            ("inner steps", f"H = {i.steps} AdamW steps a round, lr {i.lr}"
                            + (" (fixed)" if i.fixed_steps else ", as many as the round's time allows")),
            ("batch", f"{i.batch_size} x {i.grad_accum} sequences of {d.seq_len} tokens a step"),
            ("rounds", str(c.training.rounds) if c.training.rounds else "until stopped"),
            ("pipeline stages", str(c.pipeline.stages)),
            ("local ranks a peer may count", str(c.training.max_ranks))]
