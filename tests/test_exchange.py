import math

import pytest
import torch

from p2ploco.collective.dense import DenseMean, tensor_to_bytes
from p2ploco.collective.exchange import partition, reduce_span
from p2ploco.collective.sliced import SlicedExchange, reduce_alone
from p2ploco.errors import PayloadError
from p2ploco.testing.communicator import InProcessGroup
from p2ploco.testing.threads import run_in_threads


def test_partition_covers_all_units_in_order():
    for units, parts in [(10, 3), (3, 5), (1000, 7), (0, 2)]:
        spans = partition(units, parts)
        assert len(spans) == parts
        assert [u for s in spans for u in s] == list(range(units))
        assert max(map(len, spans)) - min(map(len, spans)) <= 1


def test_dense_parse_rejects_malformed_payloads():
    exchange = DenseMean([torch.ones(10)])
    span = range(2, 6)
    good = exchange.encode(span)
    assert torch.equal(exchange.parse(span, good).values, torch.ones(4))
    for bad, why in [(good[:-1], "expected 16"), (good + b"\0" * 4, "expected 16"), (b"", "expected 16"),
                     (tensor_to_bytes(torch.tensor([1.0, math.nan, 1.0, 1.0])), "NaN or Inf"),
                     (tensor_to_bytes(torch.tensor([1.0, 1.0, math.inf, 1.0])), "NaN or Inf")]:
        with pytest.raises(PayloadError, match=why):
            exchange.parse(span, bad)


def test_reducer_drops_bad_senders_and_averages_the_rest_in_order():
    exchange = DenseMean([torch.full((4,), 1.0)])  # a's
    span = range(4)
    contributions = [("a", tensor_to_bytes(torch.full((4,), 1.0))), ("b", b"garbage"),
                     ("c", tensor_to_bytes(torch.full((4,), 3.0)))]
    reduction = reduce_span(exchange, span, contributions)
    assert reduction.included == ["a", "c"] and list(reduction.rejected) == ["b"]
    exchange.receive(span, reduction.result_for(exchange, "a"), reduction.receipt_for("a"))
    assert torch.equal(exchange.mean()[0], torch.full((4,), 2.0))
    with pytest.raises(PayloadError, match="no valid contribution"):
        reduce_span(exchange, span, [("b", b"garbage")])


def test_alone_means_own_values_and_missing_spans_are_caught():
    tensors = [torch.randn(3, 5), torch.randn(7)]
    exchange = DenseMean(tensors)
    with pytest.raises(RuntimeError, match="spans missing"):
        exchange.mean()
    reduce_alone(exchange)
    assert all(torch.equal(a, b) for a, b in zip(exchange.mean(), tensors))


def sliced(a: torch.Tensor, b: torch.Tensor) -> SlicedExchange:
    return SlicedExchange({"stage0": DenseMean([a]), "stage1": DenseMean([b])})


def test_in_process_each_slice_is_averaged_among_its_holders_only():
    # a full replica holds both slices, one stage peer holds stage0, another stage1
    plans = [sliced(torch.full((4,), 1.0), torch.full((6,), 10.0)),
             SlicedExchange({"stage0": DenseMean([torch.full((4,), 3.0)])}),
             SlicedExchange({"stage1": DenseMean([torch.full((6,), 30.0)])})]
    group = InProcessGroup(3, timeout=30)
    stats = [None] * 3

    def member(rank: int) -> None:
        stats[rank] = group.communicator(rank).all_reduce(plans[rank], 0, "params")

    run_in_threads(3, member)
    assert torch.equal(plans[0].parts["stage0"].mean()[0], torch.full((4,), 2.0))
    assert torch.equal(plans[1].parts["stage0"].mean()[0], torch.full((4,), 2.0))
    assert torch.equal(plans[0].parts["stage1"].mean()[0], torch.full((6,), 20.0))
    assert torch.equal(plans[2].parts["stage1"].mean()[0], torch.full((6,), 20.0))
    assert stats[1].peers == ["replica-0", "replica-1"]
    assert stats[0].traffic.params == 10 and stats[2].traffic.params == 6
