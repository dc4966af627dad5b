"""A real p2ploco node with one hostile behaviour patched in, for tests of what the others withstand.

    python tests/hostile.py BEHAVIOUR -- node start --config ... (the usual p2ploco arguments)

Behaviours (each starts at round FROM and lasts until the node exits):

- ``scale:FACTOR@FROM``   every contribution is the honest one with all values multiplied by FACTOR
                          (well-formed: it passes every format check)
- ``lie-round:ROUND@FROM`` the node's DHT record claims it works on ROUND (it otherwise trains honestly
                          and serves only the states it really has)
- ``bad-header@FROM``     every contribution to another reducer starts with a msgpack list, not a map

Everything else is the real node: the same processes, daemons and protocol as ``p2ploco node start``.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import msgpack
import numpy as np


def scale_contributions(factor: float, start: int) -> None:
    from p2ploco.compression.topk import CompressedTensor
    from p2ploco.swarm.communicator import SwarmCommunicator

    # The coroutine behind both all_reduce and start_all_reduce (outer rounds call the latter): patching a public
    # entry point alone leaves the other path honest, and the attack silently never happens.
    honest = SwarmCommunicator._all_reduce

    async def _all_reduce(self: SwarmCommunicator, exchange: Any, round_index: int, name: str, *args: Any) -> Any:
        if round_index >= start:
            for part in exchange.parts.values():  # every slice's sparse exchange
                part.compressed = [CompressedTensor(c.grid, c.indices, c.codes, np.float32(c.shift * factor),
                                                    (c.table * np.float32(factor)).astype(np.float32))
                                   for c in part.compressed]
                part._encoded.clear()
        return await honest(self, exchange, round_index, name, *args)

    SwarmCommunicator._all_reduce = _all_reduce


def lie_about_the_round(claimed: int, start: int) -> None:
    from p2ploco.swarm.records import PeerRecord

    honest = PeerRecord.to_value

    def to_value(self: PeerRecord) -> dict[str, Any]:
        value = honest(self)
        if self.round >= start:
            value["round"] = claimed
        return value

    PeerRecord.to_value = to_value


def send_bad_headers(start: int) -> None:
    from p2ploco.collective.exchange import Failure
    from p2ploco.errors import PayloadError, TransportError
    from p2ploco.swarm import wire
    from p2ploco.swarm.allreduce import ButterflyAllReduce, DroppedFromRound

    honest = ButterflyAllReduce._contribute

    async def contribute(self: ButterflyAllReduce, ours: list[Any], peer: str, *args: Any) -> None:
        session = ours[0]  # our pieces of the slice: they all name the same group
        if session.group.round_index < start:
            return await honest(self, ours, peer, *args)
        reader, writer = await wire.open_stream(self.p2p, peer, self.handler_name)
        try:
            head = msgpack.packb([session.group.group_id, session.group.round_index, "not a map"])
            writer.write(wire.PREFIX.pack(len(head), 0) + head)
            await writer.drain()
            await asyncio.wait_for(wire.read_message(reader, 0), self.timeout)
        except (PayloadError, TransportError, TimeoutError):
            pass
        finally:
            writer.close()
        raise DroppedFromRound(f"sent reducer {peer[-8:]} a malformed header, on purpose", Failure.REJECTED)

    ButterflyAllReduce._contribute = contribute


def main() -> None:
    behaviour, separator, *arguments = sys.argv[1:]
    assert separator == "--", __doc__
    what, _, start = behaviour.partition("@")
    kind, _, value = what.partition(":")
    if kind == "scale":
        scale_contributions(float(value), int(start))
    elif kind == "lie-round":
        lie_about_the_round(int(value), int(start))
    elif kind == "bad-header":
        send_bad_headers(int(start))
    else:
        raise SystemExit(f"unknown behaviour {behaviour!r}\n{__doc__}")
    from p2ploco.cli import main as cli

    cli(arguments, prog_name="p2ploco")


if __name__ == "__main__":
    main()
