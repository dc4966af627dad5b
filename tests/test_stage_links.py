"""Stage links over real hivemind streams: the same step as in process, and malformed messages refused."""

import threading

import pytest
import torch
from helpers import CPU, LOOPBACK, sampler, small_config
from hivemind.p2p import P2P, PeerID

from p2ploco.build import build_linked_stage
from p2ploco.errors import PipelineError
from p2ploco.pipeline.links import Kind, RemoteTransport, Schedule, StageLinks, StageLinkServer
from p2ploco.swarm import wire
from p2ploco.swarm.loop import EventLoopThread
from p2ploco.testing.threads import run_in_threads
from p2ploco.testing.transport import InProcessPipe


@pytest.fixture
def peers():
    """Three p2p daemons on loopback (two stages and an outsider), each serving stage links."""
    loop = EventLoopThread()
    created: list[P2P] = []
    try:
        created.append(loop.run(P2P.create(host_maddrs=LOOPBACK), 60))
        initial = loop.run(created[0].get_visible_maddrs(), 30)
        for _ in range(2):
            created.append(loop.run(P2P.create(host_maddrs=LOOPBACK, initial_peers=initial), 60))
        servers = [StageLinkServer(p2p, "run", timeout=20) for p2p in created]
        for server in servers:
            loop.run(server.start(), 30)
        yield loop, servers
    finally:
        for p2p in created:
            loop.run(p2p.shutdown(), 30)
        loop.stop()


def step_in_threads(stages) -> tuple[list[float], dict[str, torch.Tensor]]:
    losses = [0.0] * len(stages)

    def step(s: int) -> None:
        losses[s] = stages[s].inner.step(3)

    run_in_threads(len(stages), step)
    return losses, {name: p.grad.clone() for w in stages for name, p in zip(w.names, w.model.parameters())}


@pytest.mark.timeout(120)
def test_a_step_over_hivemind_streams_equals_the_in_process_pipeline(peers):
    loop, servers = peers
    config = small_config("pipeline.compression=uniform", "pipeline.rank=8", "inner.grad_accum=2")
    pipe = InProcessPipe(2, timeout=30)
    local_losses, local_grads = step_in_threads(
        [build_linked_stage(config, CPU, pipe.transport(s), sampler(config) if s == 0 else None) for s in range(2)])

    links = StageLinks("g", 0, (servers[0].me, servers[1].me))
    transports = [RemoteTransport(loop, servers[s], links, s, Schedule.of(config), timeout=30) for s in range(2)]
    remote = [build_linked_stage(config, CPU, transports[s], sampler(config) if s == 0 else None) for s in range(2)]
    remote_losses, remote_grads = step_in_threads(remote)

    assert remote_losses == pytest.approx(local_losses, rel=1e-6)
    for name, grad in local_grads.items():
        torch.testing.assert_close(remote_grads[name], grad, rtol=1e-5, atol=1e-8, msg=name)
    # 2 micro-batches of (2 x 17 uint16 ids + 2 x 16 x 8 float32 values), and the step's sum of 3 float64 addends
    # (its loss, squared gradient norm and stop vote)
    assert transports[0].bytes_sent == 2 * (2 * 17 * 2 + 2 * 16 * 8 * 4) + 3 * 8
    assert transports[1].bytes_sent == 2 * (2 * 16 * 8 * 4) + 3 * 8


def push(loop: EventLoopThread, p2p: P2P, to: StageLinkServer, header: dict, payload: bytes) -> dict:
    async def call() -> dict:
        _, reader, writer = await p2p.call_binary_stream_handler(PeerID.from_base58(to.me), to.handler_name)
        try:
            await wire.write_message(writer, header, payload)
            return (await wire.read_message(reader, 0))[0]
        finally:
            writer.close()

    return loop.run(call(), 30)


@pytest.mark.timeout(120)
def test_malformed_stage_messages_are_refused_and_a_bad_neighbour_fails_only_its_step(peers):
    loop, servers = peers
    config = small_config("pipeline.rank=8")
    schedule = Schedule.of(config)
    links = StageLinks("g", 0, (servers[0].me, servers[1].me))
    receiver = RemoteTransport(loop, servers[1], links, 1, schedule, timeout=20)
    ids, values = torch.zeros(2, 17, dtype=torch.uint16), torch.zeros(2, 16, 8, dtype=torch.float32)

    def header(**changes):
        good = {"kind": Kind.ACTIVATIONS.value, "group": "g", "epoch": 0, "step": 5, "micro": 0,
                "shapes": [[2, 17], [2, 16, 8]], "dtypes": ["uint16", "float32"]}
        return {**good, **changes}

    payload = ids.numpy().tobytes() + values.numpy().tobytes()
    neighbour, outsider = servers[0].p2p, servers[2].p2p
    # from a peer that is not stage 0 of this formation: refused before its payload is read, no effect
    assert push(loop, outsider, servers[1], header(), payload)["status"] == "rejected"
    assert push(loop, neighbour, servers[1], header(epoch=1), payload)["reason"].startswith("message for a pipeline")
    # well-formed from the neighbour: accepted
    assert push(loop, neighbour, servers[1], header(), payload)["status"] == "ok"
    assert receiver.recv_activations((5, 0)).values.shape == (2, 16, 8)
    nan = values.clone()
    nan[0, 0, 0] = float("nan")
    bad = [(header(kind="weights"), payload, "StageHeader: kind: Value error, not one of activations"),
           (header(shapes=[[2, 17], [2, 16, 9]]), payload, "of shape"),
           (header(shapes=[[3, 17], [3, 16, 8]]), payload, "of shape"),
           (header(dtypes=["uint16", "float64"]), payload, "must carry tensors of types"),
           (header(micro=7), payload, "micro-batch 7 outside"),
           (header(), payload[:-4], "payload of"),
           (header(), ids.numpy().tobytes() + nan.numpy().tobytes(), "NaN or Inf"),
           (header(), (ids.numpy() + 300).tobytes() + values.numpy().tobytes(), "token ids outside"),
           # finite, yet it would overflow the forward pass (this neighbour's TrainingError used to end the process)
           (header(), ids.numpy().tobytes() + torch.full_like(values, 3e37).numpy().tobytes(), "magnitude 3e+37"),
           (header(kind=Kind.GRADIENTS.value, shapes=[[2, 16, 8]], dtypes=["float32"]), values.numpy().tobytes(),
            "does not hold the stage that sends gradients")]
    for step, (head, body, why) in enumerate(bad, start=10):
        head["step"] = step
        answer = push(loop, neighbour, servers[1], head, body)
        assert answer["status"] == "rejected" and why in answer["reason"], (why, answer)
    # a bad message from the neighbour fails the step it belongs to at once, and only that step
    with pytest.raises(PipelineError, match="NaN or Inf"):
        receiver.recv_activations((16, 0))
    assert push(loop, neighbour, servers[1], header(step=20), payload)["status"] == "ok"
    assert receiver.recv_activations((20, 0)).ids.dtype == torch.uint16


@pytest.mark.timeout(120)
def test_a_stage_that_gives_up_a_step_releases_the_others_at_once(peers):
    loop, servers = peers
    config = small_config("pipeline.rank=8")
    links = StageLinks("g", 0, (servers[0].me, servers[1].me))
    first, last = (RemoteTransport(loop, servers[s], links, s, Schedule.of(config), timeout=60) for s in range(2))
    failure: list[PipelineError] = []

    def wait_for_activations() -> None:
        try:
            last.recv_activations((4, 0))
        except PipelineError as e:
            failure.append(e)

    waiting = threading.Thread(target=wait_for_activations)
    waiting.start()
    first.abort(4, "its sampler broke")
    waiting.join(30)  # far less than the 60 s the wait would otherwise take
    assert not waiting.is_alive() and "stage 0 gave up: its sampler broke" in str(failure[0])


@pytest.mark.timeout(120)
def test_a_stage_that_sends_odd_sums_or_floods_its_neighbour_fails_the_step_not_the_process(peers):
    """A sum of three addends where the pipeline sums two (torch.stack used to raise out of the step), a negative
    squared norm (math.sqrt raised), and messages for steps far ahead (a mailbox held them without bound): each
    fails the step with a PipelineError, which the node handles by sitting the round out."""
    loop, servers = peers
    schedule = Schedule.of(small_config("pipeline.rank=8"))
    links = StageLinks("g", 0, (servers[0].me, servers[1].me))
    RemoteTransport(loop, servers[0], links, 0, schedule, timeout=20)  # takes the receiver's own addends
    receiver = RemoteTransport(loop, servers[1], links, 1, schedule, timeout=20)
    neighbour = servers[0].p2p

    def addends(step: int, values: list[float]) -> dict:
        header = {"kind": Kind.SUM.value, "group": "g", "epoch": 0, "step": step, "micro": 0, "from_stage": 0,
                  "shapes": [[len(values)]], "dtypes": ["float64"]}
        return push(loop, neighbour, servers[1], header, torch.tensor(values, dtype=torch.float64).numpy().tobytes())

    assert addends(3, [1.0, 2.0, 3.0])["status"] == "ok"  # well-formed on its own: the count is checked at the sum
    with pytest.raises(PipelineError, match="stage 0 sent 3 addends for step 3, where the pipeline sums 2"):
        receiver.all_sum(3, [0.5, 4.0])
    negative = addends(4, [1.0, -4.0])
    assert negative["status"] == "rejected" and "none is negative" in negative["reason"]
    with pytest.raises(PipelineError, match="none is negative"):
        receiver.all_sum(4, [0.5, 4.0])
    assert addends(5, [1.0, 4.0])["status"] == "ok"
    assert receiver.all_sum(5, [0.5, 4.0]) == [1.5, 8.0]
    # a flood of messages for steps ahead: the mailbox holds a few steps' worth, the rest fails the step
    capacity = servers[1].sums.capacity
    answers = [addends(step, [1.0, 1.0])["status"] for step in range(100, 100 + capacity + 1)]
    assert answers == ["ok"] * capacity + ["rejected"]
