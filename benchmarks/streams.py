"""Streams: what opening a stream per reducer costs, against the bytes it carries, as N grows.

A peer of an N-peer round opens 2(N - 1) streams (its contribution to each other span, each result back), and the
bytes per stream fall as 1/N. This measures, between two real p2p daemons on loopback (hivemind's ``P2P``, the
project's own ``wire.call``), the time to move one peer's round traffic as K = N - 1 concurrent request/answer
streams of total/K bytes each way against one stream of all of it, so that the difference is what the streams
cost: the daemon's per-stream work (a unix-socket connection from the process to its daemon, a libp2p stream
negotiated over the open connection), not the bytes. Loopback has no latency: a real link adds one round trip
per stream, paid concurrently. At most ``--concurrency`` streams are open at once: between two daemons every stream
shares one libp2p connection, and with 256 at once some of 1023 are reset (go-yamux's accept backlog is 256: the
likely cause), where a real peer's N - 1 streams go to N - 1 peers, a connection each.

    python benchmarks/streams.py                         # 150M shapes: 7.9 MB each way, N = 2 .. 1024
    python benchmarks/streams.py --megabytes 0.05 --peers 16 64

Prints one row per N: the time with K streams, with one stream, the difference per stream, and that
difference as a share of the K-stream time.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hivemind.p2p import P2P  # noqa: E402

from p2ploco.launch import LOOPBACK  # noqa: E402
from p2ploco.metrics import format_table  # noqa: E402
from p2ploco.swarm import wire  # noqa: E402

HANDLER = "p2ploco/bench/echo"
HEADER = ("peers", "streams", "bytes per stream", "K streams s", "1 stream s", "per stream ms", "streams' share")


async def serve(_info: object, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answer a request with as many bytes as it carried (a reducer answers a contribution with a result)."""
    header, payload = await wire.read_message(reader, max_payload=1 << 30)
    await wire.write_message(writer, {"ok": True}, payload)
    await wire.hang_up(reader, writer, timeout=30)


async def exchange(p2p: P2P, server: str, streams: int, size: int, concurrency: int) -> float:
    """Seconds to send and get back ``size`` bytes on each of ``streams`` streams, ``concurrency`` at once."""
    payload = b"\0" * size
    slots = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with slots:
            await wire.call(p2p, server, HANDLER, {"n": i}, max_payload=size, payload=payload)

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(streams)))
    return time.perf_counter() - started


async def measure(peers: list[int], total: int, repeats: int, concurrency: int) -> list[tuple]:
    server = await P2P.create(host_maddrs=[LOOPBACK])
    client = await P2P.create(host_maddrs=[LOOPBACK], initial_peers=await server.get_visible_maddrs())
    try:
        await server.add_binary_stream_handler(HANDLER, serve)
        target = server.peer_id.to_base58()
        await exchange(client, target, 8, 1024, concurrency)  # warm the connection up
        rows = []
        for n in peers:
            k = n - 1
            size = max(1, total // k)
            many = statistics.median([await exchange(client, target, k, size, concurrency) for _ in range(repeats)])
            one = statistics.median([await exchange(client, target, 1, size * k, 1) for _ in range(repeats)])
            per_stream = (many - one) / k
            rows.append((n, k, size, f"{many:.3f}", f"{one:.3f}", f"{1000 * per_stream:.2f}",
                         f"{max(0.0, many - one) / many:.0%}"))
            print(f"N = {n}: {k} streams of {size} B in {many:.3f} s, one of {size * k} B in {one:.3f} s",
                  file=sys.stderr, flush=True)
        return rows
    finally:
        await client.shutdown()
        await server.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, nargs="+", default=[2, 16, 64, 256, 1024], metavar="N",
                        help="round sizes: N - 1 streams each [2 16 64 256 1024]")
    parser.add_argument("--megabytes", type=float, default=7.9,
                        help="a peer's round traffic each way, split over the streams [7.9: 150M, resparsified]")
    parser.add_argument("--repeats", type=int, default=3, help="medians over this many runs [3]")
    parser.add_argument("--concurrency", type=int, default=64,
                        help="streams open at once, at most (one connection resets some past ~256) [64]")
    args = parser.parse_args()
    if (any(not 2 <= n <= 4096 for n in args.peers) or not 0 < args.megabytes <= 1024 or args.repeats < 1
            or not 1 <= args.concurrency <= 1024):
        raise SystemExit("error: --peers must be in [2, 4096], --megabytes in (0, 1024], --repeats at least 1 and "
                         "--concurrency in [1, 1024]")
    rows = asyncio.run(measure(args.peers, int(args.megabytes * 1e6), args.repeats, args.concurrency))
    print(f"{args.megabytes:g} MB each way per round, split over N - 1 streams ({args.concurrency} at once at most), "
          f"between two p2p daemons on loopback (medians of {args.repeats})")
    print(format_table(HEADER, rows))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("streams.py: interrupted", file=sys.stderr)
        sys.exit(130)
