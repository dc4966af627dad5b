"""A round's update (``swarm/updates.py``): kept within its bound, applied bit-identically whatever the outer
algorithm, and refused when it is not an update of the slice. (Served, fetched and checked among real peers:
``test_catchup.py``.)"""

import numpy as np
import pytest
import torch
from helpers import sparsely_moved
from safetensors.torch import save as save_tensors

from p2ploco.config import load_config
from p2ploco.errors import PayloadError
from p2ploco.launch import TINY_CONFIG
from p2ploco.metrics import state_digest
from p2ploco.swarm.state import Snapshot
from p2ploco.swarm.updates import KEEP_SHARE, Update, UpdateKeeper, applied, changes_of, named_tensors
from p2ploco.testing.swarm import build_swarm

S = "stage0"


def state_bytes(snapshot: Snapshot) -> int:
    return sum(t.numel() * t.element_size() for t in named_tensors(snapshot).values())


def bits(snapshot: Snapshot) -> dict[str, torch.Tensor]:
    return {name: t.view(torch.int32).clone() for name, t in named_tensors(snapshot).items()}


def states(count: int, share: float, size: int = 10_000) -> list[Snapshot]:
    first = {"w": torch.randn(size, generator=torch.Generator().manual_seed(1)), "b": torch.zeros(3)}
    chain = [Snapshot(0, S, first, {}, state_digest(first, {}))]
    for r in range(1, count):
        chain.append(sparsely_moved(chain[-1], r, r, share, scale=1.0))
    return chain


@pytest.mark.timeout(120)
@pytest.mark.parametrize("algorithm", ["sparseloco", "diloco", "loco", "streaming"])
def test_updates_applied_in_turn_are_bit_identical_to_the_state_they_lead_to_for_every_outer_algorithm(algorithm):
    """Real rounds of two replicas (this algorithm's outer steps, momentum and fragments included): each state's
    update applied to the one before, and three applied in a row to the first, give the later state bit for bit;
    the state they are applied to is not written. SparseLoCo's fit the keeper's bound; a dense algorithm's are
    larger than the state (its peers fetch the state)."""
    config = load_config(TINY_CONFIG, [f"outer.algorithm={algorithm}"])
    tokens = np.arange(50_000, dtype=np.uint16) % config.model.vocab_size
    swarm = build_swarm(config, ["full", "full"], tokens)
    worker = swarm.workers[0]
    served = [worker.snapshots(0)]
    swarm.train(3, after_round=lambda r: served.append(worker.snapshots(r + 1)))
    for slice_states in zip(*served):  # one slice's states, round after round
        first = slice_states[0]
        before = bits(first)
        shapes = {name: t.shape for name, t in named_tensors(first).items()}
        unbounded = 3 * state_bytes(first)
        chain = [changes_of(Update.between(a, b, unbounded).blob.data, shapes)
                 for a, b in zip(slice_states, slice_states[1:])]
        for count, later in enumerate(slice_states[1:], 1):
            result = applied(first, chain[:count], later.round)
            assert result.state_digest == later.state_digest
            assert all(torch.equal(bits(result)[k], bits(later)[k]) for k in bits(later))
        assert all(torch.equal(before[k], bits(first)[k]) for k in before)  # the published state stays whole
        fits = Update.between(slice_states[0], slice_states[1], state_bytes(first) // KEEP_SHARE)
        if algorithm == "sparseloco":
            assert fits is not None and fits.blob.total < state_bytes(first) // 10
        else:
            assert fits is None
            assert Update.between(slice_states[0], slice_states[1], state_bytes(first)) is None


def test_the_keeper_keeps_the_newest_updates_within_a_quarter_of_the_state_and_none_of_a_dense_step():
    """Updates of 1% of 10,000 values take about 1 kB each (8 bytes a value, and the header): a quarter of the 40 kB
    state holds the newest ten or so; a step that changes everything is not kept (the older ones still are, for
    peers further behind)."""
    chain = states(20, 0.01)
    keeper = UpdateKeeper()
    keeper.keep([chain[0]])
    keeper.keep([chain[0]])  # the same state served again (a round sat out): nothing to keep
    assert keeper.find(S, chain[0].state_digest) is None
    for snapshot in chain[1:]:
        keeper.keep([snapshot])
    kept = [r for r, snapshot in enumerate(chain[:-1]) if keeper.find(S, snapshot.state_digest) is not None]
    sizes = [keeper.find(S, chain[r].state_digest).blob.total for r in kept]
    bound = state_bytes(chain[0]) // KEEP_SHARE
    assert kept == list(range(kept[0], 19)) and sum(sizes) <= bound < sum(sizes) + sizes[0]
    update = keeper.find(S, chain[18].state_digest)
    assert (update.round, update.base, update.state_digest) == (18, chain[18].state_digest, chain[19].state_digest)
    dense = sparsely_moved(chain[-1], 20, 99, 1.0, scale=1.0)
    keeper.keep([dense])
    assert keeper.find(S, chain[-1].state_digest) is None and keeper.find(S, chain[18].state_digest) is not None


def test_a_blob_that_is_not_an_update_of_this_slice_is_refused():
    """Whatever a donor serves, ``changes_of`` accepts only increasing positions within the slice's tensors and as
    many finite float32 values; anything else is a PayloadError (its donors are then blamed)."""
    shapes = {"param/w": torch.Size([10]), "param/b": torch.Size([3])}
    honest = {"at/param/w": torch.tensor([1, 4, 9], dtype=torch.int32), "to/param/w": torch.ones(3)}
    assert set(changes_of(save_tensors(honest), shapes)) == {"param/w"}
    forged = [
        {**honest, "at/param/w": torch.tensor([1, 4, 10], dtype=torch.int32)},  # past the tensor's end
        {**honest, "at/param/w": torch.tensor([-1, 4, 9], dtype=torch.int32)},
        {**honest, "at/param/w": torch.tensor([4, 1, 9], dtype=torch.int32)},  # not increasing
        {**honest, "at/param/w": torch.tensor([1, 1, 9], dtype=torch.int32)},  # a position twice
        {**honest, "at/param/w": torch.tensor([1.0, 4.0, 9.0])},
        {**honest, "to/param/w": torch.tensor([1.0, float("nan"), 1.0])},
        {**honest, "to/param/w": torch.ones(2)},
        {**honest, "to/param/w": torch.ones(3, dtype=torch.float64)},
        {"at/param/w": honest["at/param/w"]},  # positions without values
        {"to/param/w": honest["to/param/w"]},
        {**honest, "at/param/x": torch.tensor([0], dtype=torch.int32), "to/param/x": torch.ones(1)},  # no such tensor
        {"at/param/w": torch.zeros(0, dtype=torch.int32), "to/param/w": torch.zeros(0)},
    ]
    for tensors in forged:
        with pytest.raises(PayloadError):
            changes_of(save_tensors(tensors), shapes)
    with pytest.raises(PayloadError):
        changes_of(b"\x00" * 64, shapes)
