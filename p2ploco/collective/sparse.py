"""Sparse all-reduce of SparseLoCo contributions.

Units are whole chunks, so a reducer owns every value of the chunks in its span. It checks each
sender's contribution and answers each recipient with whichever result encoding is smaller: the
included contributions relayed (without the recipient's own, which it re-inserts) or their union
with the aggregated float32 values. Both are exact and both end in the same bits: the aggregate is
computed by the same function, over the same contributions, in the same order. Before they are
combined, contributions are weighed and bounded as ``policy`` says (``collective/robust.py``); a recipient of a
relayed result weighs them exactly as the reducer did, from the norms its receipt names (each of which it checks).

Every contribution is decoded once per peer, and a peer's own never: it reads its own values from its
compressed tensors, and the reducer takes its own span's aggregate as it combined it. The union is
encoded only when some recipient's relay could be larger (a relay's size is known without building it;
the union's has a lower bound). The aggregate stays sparse (positions and values per span): its digest
hashes that, and the outer step applies it at the coordinates it holds.

Both exact results grow with the group: a span's union holds up to n contributions' positions, so every
peer downloads (and every reducer uploads) about n contributions' worth per round. With ``resparsified``
results (``outer.sparseloco.result``, the default) the reducer compresses its span's mean as a sender
compresses its pseudo-gradient: Top-k of every chunk in 2 bits, k = min(``result_topk``, n x the contributions'
k) for the n contributions it combined (``ResultLayouts``), so a small group's result holds every value its
contributions selected and a large group's has a fixed size whatever n: per-peer traffic is about one
contribution and one result each way. A group of n holders whose n x k values would not fit sends
``result_topk`` // n values per chunk each instead (``fit_group``, once a group is formed): what a result's Top-k
dropped would be lost to the senders, whose error feedback counts it as sent, while what a sender does not select
stays in its own buffer. Every member (the reducer too) decodes the same bytes, so all stay bit-identical. What a
result leaves out (the 2-bit rounding of every value, nothing else while the selections fit) is dropped: the reducer
keeps no buffer, so a result is a function of the contributions alone, which anyone holding them can check
(``sync/audit.py``). A buffer that kept it at decay 0.5 measured the same (docs/design.md, "Hundreds of peers").
A span of one contribution is its own result (relabelled): a lone peer's round costs one Top-k, its own.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from p2ploco import faults
from p2ploco.collective import robust
from p2ploco.collective.exchange import Exchange, Receipt, Span, contribution_digest, supersede
from p2ploco.compression import sparse_format as fmt
from p2ploco.compression.sparse_format import SparseLayout, SparseValues
from p2ploco.compression.topk import CompressedTensor, choose
from p2ploco.errors import PayloadError

CPU = torch.device("cpu")
# The fewest values per chunk a contribution fitted to its group sends. At 2 (a group of more than 85 holders under
# the default cap of 256) honest members' results pointed against their own contributions (cosine -0.09: every
# round redone, none applied, benchmarks/simulate.py at 96 and 128 peers); 3 (80 holders) and 4 committed (issue 63).
MIN_FITTED_K = 4
SPAN_HEADER = struct.Struct("<3q")  # span start, span stop, positions: hashed before each span's aggregate


@dataclass
class _Parsed:
    payload: bytes
    values: SparseValues
    norm: float  # of the values: what clipping compares

    @property
    def vector(self) -> robust.Vector:
        return robust.Vector(self.values.values, self.values.positions)


class ResultLayouts:
    """How a resparsified result of n contributions is chunked: the contributions' chunks, each keeping
    min(the cap's k, n x the contributions' k) values. Up to the cap a result can hold every value the n
    contributions selected (Top-k then drops nothing, only the 2-bit values round), so a small group loses nothing
    to resparsifying; from n = cap / k on, every result has the cap's fixed size, whatever the group's. Every member
    knows n from the reducer's receipt, so all decode the same layout.

    A group too large for its contributions to fit the cap sends fewer values each (``shared``): what Top-k would
    drop from a result is lost to the senders, whose error feedback counts it as sent, while what a sender does not
    select stays in its buffer for a later round."""

    def __init__(self, contributions: SparseLayout, cap: SparseLayout):
        if cap.num_chunks != contributions.num_chunks:
            raise ValueError("a result layout must chunk the tensors as the contributions' layout does")
        self.contributions, self.cap = contributions, cap
        # from this many contributions on every chunk keeps the cap's k: at most this many layouts, whatever count a
        # receipt names
        self.saturated = max((-(-most.k // grid.k) for grid, most in zip(contributions.grids, cap.grids)), default=1)
        self._by_count: dict[int, SparseLayout] = {}

    def for_contributions(self, n: int) -> SparseLayout:
        n = min(max(1, n), self.saturated)
        if n not in self._by_count:
            self._by_count[n] = SparseLayout([replace(grid, k=min(most.k, n * grid.k))
                                              for grid, most in zip(self.contributions.grids, self.cap.grids)])
        return self._by_count[n]

    def shared(self, holders: int) -> ResultLayouts:
        """The layouts of a group of ``holders`` contributors: where their selections may not fit a result's chunk
        (holders x k values, or the whole chunk if fewer: a vector's chunks are sent whole), each sends the cap's
        k // holders values per chunk instead, at least ``MIN_FITTED_K``, so that their union fits (beyond
        cap k / MIN_FITTED_K holders it does not, and the reducer's result drops what the cap has no room for)."""
        grids = [grid if min(holders * grid.k, grid.chunk_numel) <= most.k else
                 replace(grid, k=min(grid.k, max(MIN_FITTED_K, most.k // holders)))
                 for grid, most in zip(self.contributions.grids, self.cap.grids)]
        return self if all(g.k == grid.k for g, grid in zip(grids, self.contributions.grids)) else (
            ResultLayouts(SparseLayout(grids), self.cap))

    @property
    def digest(self) -> bytes:
        return self.cap.digest


@dataclass
class _Resparsified:
    """A span's mean compressed by its reducer: the one result every member receives."""

    result: bytes
    values: SparseValues  # what every member decodes from ``result``


class _Aggregate:
    """A span's combined contributions, and what its results are made of."""

    def __init__(self, layout: SparseLayout, span: Span, payloads: list[bytes], values: SparseValues):
        self.layout, self.span = layout, span
        self.payloads = payloads  # the included contributions, canonical order
        self.values = values  # the aggregate, positions from the span's first element
        # Could the union be smaller than some recipient's relay? The largest relay (all payloads) against a
        # lower bound of the union's size: if so, it is built now (a reducer combines off the event loop).
        self.union_may_win = self.relay_bytes(None) > fmt.union_bytes_at_least(layout, span, len(values.positions))
        self._union = fmt.encode_union(layout, span, values) if self.union_may_win else None

    @property
    def union(self) -> bytes:
        """The aggregate union-encoded (built on first use where no relay could be larger)."""
        if self._union is None:
            self._union = fmt.encode_union(self.layout, self.span, self.values)
        return self._union

    def relay_bytes(self, omit: int | None) -> int:
        """Size of the relay result for the recipient at ``omit``, without building it."""
        relayed = [len(p) for i, p in enumerate(self.payloads) if i != omit]
        return fmt.HEADER.size + fmt.U16.size + fmt.U32.size * len(relayed) + sum(relayed)


class SparseExchange(Exchange):
    auditable = True

    def __init__(self, layout: SparseLayout, compressed: Sequence[CompressedTensor], mode: str,
                 policy: robust.Policy = robust.UNBOUNDED, results: ResultLayouts | None = None,
                 resend: Callable[[SparseLayout], list[CompressedTensor]] | None = None, selecting: torch.device = CPU):
        """``policy``: how reducers weigh and bound contributions (``collective/robust.py``). ``results``:
        resparsified results, chunked as these layouts say for the contributions combined; None: exact results.
        ``resend``: this replica's contribution compressed again at a layout's (lower) density, what ``compressed``
        took from the sender's buffers given back (required with ``results``: a large group sends fewer values).
        ``selecting``: the device a reducer's Top-k runs on (the training device: on a GPU many times the CPU's
        speed; the result stays on the CPU, and since every member decodes the reducer's bytes, where it selected
        does not matter to their bits)."""
        self.layout, self.compressed, self.mode, self.policy = layout, compressed, mode, policy
        self.selecting = selecting
        self.results = results
        # configured: the layouts before the group was known
        self.resend, self.configured, self.configured_results = resend, layout, results
        self.num_units = layout.num_chunks
        self._combined: dict[Span, _Aggregate | _Resparsified] = {}  # spans this replica reduced
        self._received: dict[Span, tuple[SparseValues, bytes]] = {}  # every span's aggregate taken, and its digest
        self._taking = threading.Lock()  # spans are received in parallel (executor threads)

    @property
    def compressed(self) -> list[CompressedTensor]:
        return self._compressed

    @compressed.setter
    def compressed(self, compressed: Sequence[CompressedTensor]) -> None:
        """What this replica contributes, replaced: the bytes encoded of what it held before are not sent."""
        self._compressed = list(compressed)
        self._encoded: dict[Span, bytes] = {}

    @property
    def resparsified(self) -> bool:
        return self.results is not None

    def unit_at(self, element: int) -> int:
        return int(np.searchsorted(self.layout.chunk_element_ends, element, side="right"))

    def fingerprint(self) -> str:
        result = f"resparsified{self.results.digest.hex()}/grown/shared" if self.resparsified else "exact"
        return f"sparse/{self.configured.digest.hex()}/{self.mode}/{self.policy.fingerprint()}/digest3/{result}"

    def fit_group(self, holders: int) -> None:
        """With resparsified results, a group of more holders than the cap's k / the contributions' k sends fewer
        values each (``ResultLayouts.shared``): the contribution is compressed again for the group's holders. Every
        member of a group fits to it alike, whatever group it fitted to before: after a dead group, the next
        coordinator's group joins peers that fitted to groups of other sizes, or to none (they once kept the first
        group's layout, and their reducers refused each other's contributions as malformed)."""
        if self.results is None:
            return
        shared = self.configured_results.shared(holders)
        if shared.contributions.digest == self.layout.digest:
            return
        if self.resend is None:
            raise RuntimeError("a SparseExchange with resparsified results needs a resend function")
        self.compressed = self.resend(shared.contributions)
        self.layout, self.results = shared.contributions, shared
        self._combined.clear()

    def numel(self, span: Span) -> int:
        return self.layout.numel(span)

    def max_payload_bytes(self, span: Span) -> int:
        return self.layout.max_contribution_bytes(span)

    def max_result_bytes(self, span: Span, group_size: int) -> int:
        if self.resparsified:  # k grows with the contributions: the most a group of this size can combine
            return self.results.for_contributions(group_size).max_contribution_bytes(span)
        relay = fmt.HEADER.size + fmt.U16.size + (group_size - 1) * (fmt.U32.size + self.max_payload_bytes(span))
        return max(relay, self.layout.max_union_bytes(span))

    def encode(self, span: Span) -> bytes:
        if span not in self._encoded:
            self._encoded[span] = fmt.encode_contribution(self.layout, span, self.compressed)
        return self._encoded[span]

    def parse(self, span: Span, payload: bytes) -> _Parsed:
        if payload == self._encoded.get(span):  # our own: its values are at hand
            values = fmt.contribution_values(self.layout, span, self.compressed)
        else:
            values = fmt.decode_contribution(self.layout, span, payload)
        return _Parsed(payload, values, robust.norm(values.values))

    def combine(self, span: Span, contributions: Sequence[_Parsed], factors: Sequence[float]
                ) -> _Aggregate | _Resparsified:
        # A span of one contribution (a lone peer's every span: ``reduce_alone``): its mean is that contribution,
        # whose k values per chunk on their 2-bit grid a result of one keeps (unless the cap keeps fewer), so the
        # result is the contribution itself. A Top-k again would only round its values twice.
        if self.resparsified and self._relabels(contributions, factors):
            combined = _Resparsified(fmt.as_resparsified(contributions[0].payload), contributions[0].values)
        else:
            values = self._aggregate(span, [c.values for c in contributions], factors)
            resparsify = faults.seam("reduce.result", self, self.resparsify)  # its own span's result: answered
            combined = (resparsify(span, values, len(contributions),
                                   self.limit(factors, [c.norm for c in contributions]))
                        if self.resparsified else _Aggregate(self.layout, span, [c.payload for c in contributions],
                                                             values))
        self._combined[span] = combined
        return combined

    def expected(self, span: Span, contributions: Sequence[_Parsed], factors: Sequence[float]
                 ) -> tuple[robust.Vector, robust.Vector]:
        mean = self._aggregate(span, [c.values for c in contributions], factors)
        result = mean
        if self.resparsified:
            result = (contributions[0].values if self._relabels(contributions, factors) else
                      self.resparsify(span, mean, len(contributions),
                                       self.limit(factors, [c.norm for c in contributions])).values)
        return robust.Vector(mean.values, mean.positions), robust.Vector(result.values, result.positions)

    def taken(self, span: Span) -> robust.Vector:
        values, _ = self._received[span]
        return robust.Vector(values.values, values.positions)

    def _relabels(self, contributions: Sequence[_Parsed], factors: Sequence[float]) -> bool:
        """Whether a resparsified result of these is the one contribution itself (``combine``)."""
        return (len(contributions) == 1 and factors[0] == 1.0
                and self.results.for_contributions(1).digest == self.layout.digest)

    def limit(self, factors: Sequence[float], norms: Sequence[float]) -> float:
        """A per-coordinate mean over the selectors (``mean``) is bounded as such; ``sum`` divides by all."""
        return robust.selector_limit(factors, norms) if self.mode == "mean" else robust.mean_limit(factors, norms)

    def resparsify(self, span: Span, mean: SparseValues, contributions: int, limit: float) -> _Resparsified:
        """The reducer's result for ``span`` of ``contributions`` combined: Top-k of every chunk of the span's mean
        (``ResultLayouts``) in 2 bits, exactly as a sender compresses (``compression/topk.py``), scaled down if the
        2-bit rounding made it longer than ``limit``, what the contributions allow (``robust.within``)."""
        layout = self.results.for_contributions(contributions)
        choices = []
        for s in layout.slices(span):  # one tensor's dense rows at a time: what Top-k chose is all that is kept
            rows = torch.zeros(s.chunks, s.grid.chunk_numel)
            lo, hi = np.searchsorted(mean.positions, [s.offset, s.offset + s.chunks * s.grid.chunk_numel])
            rows.view(-1)[torch.from_numpy(mean.positions[lo:hi] - s.offset)] = torch.from_numpy(mean.values[lo:hi])
            choices.append(choose(rows.to(self.selecting), s.grid).to(CPU))
            del rows

        def quantize(scale: float) -> tuple[np.ndarray, float]:
            decoded = [choice.scaled(scale).decode().reshape(-1).numpy() for choice in choices]
            return np.concatenate(decoded) if decoded else np.zeros(0, np.float32), scale

        scale = robust.within(limit, quantize)
        parts = [choice.sent(scale) for choice in choices]
        return _Resparsified(fmt.encode_resparsified(layout, span, parts), fmt.resparsified_values(layout, span, parts))

    def _aggregate(self, span: Span, contributions: Sequence[SparseValues], factors: Sequence[float]
                   ) -> SparseValues:
        """The span's aggregate of contributions, each times its factor: one function for the reducer and every
        recipient."""
        bounded = [SparseValues(c.positions, robust.scaled(c.values, f))
                   for c, f in zip(contributions, factors, strict=True)]
        return fmt.aggregate(self.numel(span), bounded, self.mode)

    def result_for(self, aggregate: _Aggregate | _Resparsified, omit: int | None) -> bytes:
        if isinstance(aggregate, _Resparsified):  # one result for everyone: nobody's own is left out
            return aggregate.result
        if aggregate.union_may_win and len(aggregate.union) < aggregate.relay_bytes(omit):
            return aggregate.union
        return fmt.encode_relay(self.layout, [p for i, p in enumerate(aggregate.payloads) if i != omit])

    def receive(self, span: Span, result: bytes, receipt: Receipt) -> bytes:
        combined = self._combined.get(span)
        ours = combined is not None and result == self.result_for(combined, receipt.own)
        if ours:  # the aggregate we made
            values = combined.values
        else:
            if self.resparsified:
                values = fmt.decode_resparsified(self.results.for_contributions(len(receipt.norms)), span, result)
            elif fmt.read_kind(self.layout, result) == fmt.RELAY:
                values = self._recombine(span, result, receipt)
            else:
                values = fmt.decode_union(self.layout, span, result)
            self.check(span, robust.Vector(values.values, values.positions), receipt)
        digest = self._span_digest(span, values, receipt)
        if len(span):  # an empty span holds nothing (a group larger than the units makes some)
            with self._taking:
                supersede(self._received, span)
                self._received[span] = values, digest
        return digest

    def _recombine(self, span: Span, result: bytes, receipt: Receipt) -> SparseValues:
        """A relayed result's aggregate, combined here as its reducer did: the relayed contributions (and this
        replica's own) must have the norms the receipt names, and are weighed from them."""
        payloads = fmt.decode_relay(self.layout, result, self.max_payload_bytes(span))
        named = [d for i, d in enumerate(receipt.contributions[:len(receipt.norms)]) if i != receipt.own]
        if [contribution_digest(p) for p in payloads] != named:
            raise PayloadError("a relayed result whose contributions are not those its receipt names")
        contributions = [fmt.decode_contribution(self.layout, span, p) for p in payloads]
        if receipt.own is not None:
            contributions.insert(receipt.own, fmt.contribution_values(self.layout, span, self.compressed))
        norms = tuple(robust.norm(c.values) for c in contributions)
        if norms != receipt.norms:
            raise PayloadError(f"a relayed result of {len(contributions)} contributions whose norms are not the "
                               f"{len(receipt.norms)} its receipt names")
        factors, _ = robust.mean_factors(receipt.norms, receipt.tokens, self.policy.clip_factor)
        return self._aggregate(span, contributions, factors)

    def _span_digest(self, span: Span, values: SparseValues, receipt: Receipt) -> bytes:
        """sha256 of one span's sparse aggregate and receipt: bounds, count, the receipt, positions (u32 where they
        fit), float32 values. Computed as each span arrives (spans arrive in parallel), not over the whole aggregate
        at the end."""
        digest = hashlib.sha256(SPAN_HEADER.pack(span.start, span.stop, len(values.positions)) + receipt.digest())
        digest.update(values.positions.astype("<u8" if self.numel(span) >= 1 << 32 else "<u4"))
        digest.update(values.values.astype("<f4", copy=False))
        return digest.digest()

    def piece_digests(self) -> dict[Span, bytes]:
        return {span: digest for span, (_, digest) in self._received.items()}

    def _spans(self) -> list[Span]:
        return sorted(self._received, key=lambda span: span.start)

    @property
    def output(self) -> np.ndarray:
        """The received aggregate as one dense float32 vector in chunk order; NaN where no span was received."""
        out = np.full(self.layout.total_numel, np.nan, dtype=np.float32)
        for span, (values, _) in self._received.items():
            start, stop = self.layout.element_range(span)
            part = out[start:stop]
            part[:] = 0.0
            part[values.positions] = values.values
        return out

    def aggregate(self) -> list[torch.Tensor]:
        """The aggregate, one dense float32 CPU tensor per input tensor."""
        self._check_complete()
        out = torch.from_numpy(self.output)
        return [grid.from_chunks(out[int(start) : int(start) + grid.numel].view(grid.chunks, grid.chunk_numel))
                for grid, start in zip(self.layout.grids, self.layout.element_starts)]

    def updates(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The aggregate, sparse: per input tensor, the row-major offsets of the elements it holds (int64) and
        their float32 values. Every other element of the aggregate is zero."""
        self._check_complete()
        pieces: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in self.layout.grids]
        for span in self._spans():
            values, _ = self._received[span]
            for s in self.layout.slices(span):
                n = s.grid.chunk_numel
                lo, hi = np.searchsorted(values.positions, [s.offset, s.offset + s.chunks * n])
                chunk_order = values.positions[lo:hi] - (s.offset - s.first * n)  # from the tensor's first element
                pieces[s.tensor].append((s.grid.flat_index(chunk_order), values.values[lo:hi]))
        return [(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])) if len(parts) > 1
                else parts[0] for parts in pieces]

    def _check_complete(self) -> None:
        if sum(len(span) for span in self._received) != self.num_units:
            raise RuntimeError("all-reduce finished with spans missing")  # a communicator bug, not bad input
