"""Audits of reducers' results (``collective/exchange.audit``): anyone holding a piece's contributions can tell a
result that adds a direction nobody sent, and an honest result always passes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from p2ploco.collective import robust
from p2ploco.collective.dense import DenseMean
from p2ploco.collective.exchange import ERROR_EXCESS, audit, reduce_span
from p2ploco.collective.robust import Policy
from p2ploco.config import SparseLoCoConfig
from p2ploco.outer.sparseloco import SparseLoCo
from p2ploco.testing.attacks import Steering

SHAPES = [(128, 192), (257, 64), (192,), (96, 100)]
DEFENDED = Policy(clip_factor=2.0, drop_opposed=True)
NAMES = ["a", "b", "c", "d"]


def sparse_parts(count: int, result: str = "resparsified", seed: int = 0) -> list:
    """``count`` replicas' sparse exchanges of one round, their pseudo-gradients sharing a direction, each fitted to a
    group of ``count``."""
    generator = torch.Generator().manual_seed(seed)
    params = [torch.randn(s, generator=generator) for s in SHAPES]
    drift = [0.05 * torch.randn(s, generator=generator) for s in SHAPES]
    parts = []
    for _ in range(count):
        local = [p + d + 0.03 * torch.randn(p.shape, generator=generator) for p, d in zip(params, drift)]
        outer = SparseLoCo(params, SparseLoCoConfig(result=result), torch.device("cpu"), policy=DEFENDED)
        part = outer.contribute(local, 0).exchange.parts["stage0"]
        part.fit_group(count)
        parts.append(part)
    return parts


def reduced(parts: list, reducer: int = 1):
    """Replica ``reducer`` reduces the whole slice as one span; replica 0 takes the result. Returns the span, the
    reduction and what replica 0 shows an auditor: the weighed contributions with their senders."""
    span = range(parts[0].num_units)
    reduction = reduce_span(parts[reducer], span, [(n, p.encode(span)) for n, p in zip(NAMES, parts)],
                            dict.fromkeys(NAMES, 100))
    return span, reduction, reduction.weighed


@pytest.mark.parametrize("result", ["resparsified", "exact"])
def test_an_honest_result_passes_its_audit(result):
    parts = sparse_parts(4, result)
    span, reduction, weighed = reduced(parts)
    receipt = reduction.receipt_for("a")
    parts[0].receive(span, reduction.result_for(parts[1], "a"), receipt)
    assert audit(parts[0], span, weighed, dict.fromkeys(NAMES, 100), receipt, parts[0].taken(span)) is None


def test_a_lone_contribution_relabelled_as_its_result_passes_its_audit():
    parts = sparse_parts(1)
    span = range(parts[0].num_units)
    reduction = reduce_span(parts[0], span, [("a", parts[0].encode(span))], {"a": 100})
    receipt = reduction.receipt_for("a")
    parts[0].receive(span, reduction.result_for(parts[0], "a"), receipt)
    assert audit(parts[0], span, reduction.weighed, {"a": 100}, receipt, parts[0].taken(span)) is None


def steered_result(part, span, reduction, push: float) -> bytes:
    return Steering(push).results(part, span, reduction, ["a"])["a"]


def test_a_result_that_adds_a_direction_nobody_sent_fails_its_audit_though_every_members_checks_pass():
    """A reducer that adds a push to its span's mean, at positions no contributor selected, compresses it as an honest
    one does: no longer than its contributions allow and not against any member's own contribution, so every member
    takes it. An audit of the piece tells; a push small enough to pass moves the result a few percent of the mean's
    length at most (the threat model's bound)."""
    parts = sparse_parts(4)
    span, reduction, weighed = reduced(parts)
    result = steered_result(parts[1], span, reduction, 0.5)
    for rank, name in enumerate(NAMES):
        if rank != 1:
            parts[rank].receive(span, result, reduction.receipt_for(name))  # PayloadError if a member's checks fail
    why = audit(parts[0], span, weighed, dict.fromkeys(NAMES, 100), reduction.receipt_for("a"), parts[0].taken(span))
    assert why == "its result is farther from the mean of the contributions it names than a result of them can be"

    mean, own = parts[2].expected(span, [parts[2].parse(span, p) for _, p in weighed], [1.0] * 4)
    passed = []
    for push in np.linspace(0.01, 0.5, 25):
        part = sparse_parts(4)[0]
        part.receive(span, steered_result(parts[1], span, reduction, push), reduction.receipt_for("a"))
        taken = part.taken(span)
        if audit(part, span, weighed, dict.fromkeys(NAMES, 100), reduction.receipt_for("a"), taken) is None:
            passed.append(robust.distance2(taken, own) ** 0.5)
    assert passed and max(passed) <= (1 + (1 + ERROR_EXCESS) ** 0.5) * robust.distance2(own, mean) ** 0.5


def test_an_auditor_shown_other_contributions_than_the_receipt_names_or_a_receipt_they_do_not_make_says_so():
    parts = sparse_parts(4)
    span, reduction, weighed = reduced(parts)
    receipt = reduction.receipt_for("a")
    parts[0].receive(span, reduction.result_for(parts[1], "a"), receipt)
    others = sparse_parts(4, seed=1)
    swapped = [weighed[0], ("b", others[1].encode(span)), *weighed[2:]]
    assert audit(parts[0], span, swapped, dict.fromkeys(NAMES, 100), receipt, parts[0].taken(span)) == (
        "the contributions it shows are not those its receipt names")
    assert audit(parts[0], span, weighed, {**dict.fromkeys(NAMES, 100), "d": 1}, receipt, parts[0].taken(span)) == (
        "its receipt is not what the contributions it names make of the span")


def test_a_dense_mean_is_audited_to_the_bit_of_its_wire_dtype():
    generator = torch.Generator().manual_seed(0)
    common = torch.randn(3000, generator=generator)
    parts = [DenseMean([common + 0.3 * torch.randn(3000, generator=generator)], "bfloat16", DEFENDED)
             for _ in range(4)]
    span = range(3000)
    reduction = reduce_span(parts[1], span, [(n, p.encode(span)) for n, p in zip(NAMES, parts)])
    receipt = reduction.receipt_for("a")
    honest = reduction.result_for(parts[1], "a")
    parts[0].receive(span, honest, receipt)
    assert audit(parts[0], span, reduction.weighed, dict.fromkeys(NAMES, 1), receipt, parts[0].taken(span)) is None
    mean = torch.frombuffer(bytearray(honest), dtype=torch.bfloat16).float()
    pushed = (mean + 0.05 * mean.norm() / 3000**0.5 * torch.randn(3000, generator=generator)).to(torch.bfloat16)
    parts[2].receive(span, pushed.view(torch.uint8).numpy().tobytes(), reduction.receipt_for("c"))
    assert audit(parts[2], span, reduction.weighed, dict.fromkeys(NAMES, 1), reduction.receipt_for("c"),
                 parts[2].taken(span)) == (
        "its result is farther from the mean of the contributions it names than a result of them can be")
