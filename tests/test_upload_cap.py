"""The upload cap (``swarm/upload_cap.py``): paced on a clock the test drives, and through ``wire.write_message`` on
real sockets of one event loop."""

import asyncio

import pytest

from p2ploco.config import load_config
from p2ploco.errors import ConfigError
from p2ploco.swarm import wire
from p2ploco.swarm.upload_cap import BURST_SECONDS, CHUNK_BYTES, UploadCap, cap_uploads, upload_cap


class Clock:
    """Time that passes only when the paced code sleeps."""

    def __init__(self):
        self.now, self.slept = 100.0, []

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_bytes_leave_at_the_caps_rate_after_a_short_burst():
    clock = Clock()
    cap = UploadCap(8.0, clock=lambda: clock.now, sleep=clock.sleep)  # 1 MB/s

    async def send(chunks: int) -> None:
        for _ in range(chunks):
            await cap.take(100_000)

    asyncio.run(send(10))
    assert clock.now - 100.0 == pytest.approx(1.0 - BURST_SECONDS)  # 1 MB: a second, less the burst sent at once
    assert clock.slept[0] == pytest.approx(0.1 - BURST_SECONDS)  # the first chunk waits for its own bytes only


def test_concurrent_streams_share_the_cap_rather_than_each_taking_it_all():
    clock = Clock()
    cap = UploadCap(8.0, clock=lambda: clock.now, sleep=clock.sleep)

    done = []

    async def send() -> None:
        await cap.take(500_000)
        done.append(clock.now)

    async def both() -> None:
        await asyncio.gather(send(), send())

    asyncio.run(both())
    # the second booking starts where the first ends: its bytes are gone once 1 MB is, not its own 0.5 MB
    assert done == pytest.approx([100.5 - BURST_SECONDS, 101.0 - BURST_SECONDS])


@pytest.mark.timeout(30)
def test_a_capped_message_arrives_whole_in_paced_chunks_and_only_its_loop_is_capped(monkeypatch):
    booked = []
    original = UploadCap.take

    async def recording(self, size: int) -> None:
        booked.append(size)
        await original(self, size)

    monkeypatch.setattr(UploadCap, "take", recording)
    payload = bytes(range(256)) * 1000  # 256 kB

    async def exchange() -> tuple[dict, bytes, UploadCap | None]:
        received = asyncio.get_running_loop().create_future()

        async def serve(reader, writer):
            received.set_result(await wire.read_message(reader, len(payload)))
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        reader, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
        cap_uploads(1000.0)
        await wire.write_message(writer, {"kind": "test"}, payload)
        header, body = await received
        writer.close()
        server.close()
        return header, body, upload_cap()

    header, body, cap = asyncio.run(exchange())
    assert header["kind"] == "test" and body == payload
    assert cap is not None and cap.bytes_per_second == 1000.0 * 1e6 / 8
    assert max(booked) == CHUNK_BYTES and len(booked) == -(-sum(booked) // CHUNK_BYTES)  # paced chunk by chunk
    assert sum(booked) > len(payload)  # the header's bytes count too

    async def uncapped() -> UploadCap | None:
        return upload_cap()

    assert asyncio.run(uncapped()) is None  # a fresh loop has no cap: another node's loop is not slowed


def test_an_upload_cap_below_the_slowest_link_deadlines_allow_for_is_refused_in_one_line():
    with pytest.raises(ConfigError) as refused:
        load_config(None, ["swarm.max_upload_mbit=5"])
    assert str(refused.value).splitlines() == [refused.value.args[0]]
    assert "swarm.max_upload_mbit (5.0) must be 0 (no cap) or in [swarm.min_bandwidth_mbit=10.0" in str(refused.value)
    capped = load_config(None, ["swarm.max_upload_mbit=20", "swarm.bandwidth_mbit=100"]).swarm
    assert capped.published_mbit == 20.0  # the record states the cap: others' deadlines allow for it
    assert load_config(None, ["swarm.bandwidth_mbit=100"]).swarm.published_mbit == 100.0
    assert load_config(None, []).swarm.published_mbit == 0.0
