"""A survey of a run from the DHT: what ``p2ploco peers`` and ``status`` read, and what a node's status endpoint
serves (``swarm/status.py``)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from hivemind.dht.node import DHTNode
from hivemind.utils import get_dht_time

from p2ploco.errors import SwarmError, shown
from p2ploco.swarm.records import (
    BOOTSTRAP_KEY,
    RUNS_KEY,
    PeerRecord,
    PeerRole,
    merged_entries,
    parse_records,
    run_records,
)
from p2ploco.swarm.schema import RecordSchema
from p2ploco.swarm.status_document import Survey

T = TypeVar("T")
LOOKUP_PATIENCE = 3.0  # a client that just joined may need a few lookups before the DHT answers in full


async def _patiently(look: Callable[[], Awaitable[T]], enough: Callable[[T], bool]) -> T:
    """``look`` again every 0.3 s until its answer is ``enough`` or LOOKUP_PATIENCE has passed; the last answer."""
    deadline = time.monotonic() + LOOKUP_PATIENCE
    while not enough(answer := await look()) and time.monotonic() < deadline:
        await asyncio.sleep(0.3)
    return answer


async def runs_trained(node: DHTNode) -> list[str]:
    """The run ids the DHT lists as trained now (a short look: ``find_run`` looks patiently)."""
    found = await node.get(RUNS_KEY, latest=True)
    value = getattr(found, "value", None)
    return sorted(k for k in value if isinstance(k, str)) if isinstance(value, dict) else []


async def find_run(node: DHTNode, run_id: str | None) -> str:
    """The run to look at: ``run_id`` if someone trains it, or the only run being trained. Its records are
    schema-checked by ``node`` from here on."""
    runs = await _patiently(lambda: runs_trained(node), lambda runs: bool(runs) and (run_id is None or run_id in runs))
    if run_id is not None and run_id not in runs:
        if runs:
            raise SwarmError(f"no run '{shown(run_id)}' in this swarm; runs training now: "
                             f"{', '.join(map(shown, runs))}")
        raise SwarmError(f"no peers yet: nothing is training in this swarm (looked for run '{shown(run_id)}')")
    if run_id is None:
        if not runs:
            raise SwarmError("no peers yet: nothing is training in this swarm; is this the bootstrap address "
                             "your nodes use?")
        if len(runs) > 1:
            raise SwarmError(f"several runs train in this swarm ({', '.join(map(shown, runs))}): pass --run-id")
        run_id = runs[0]
    node.protocol.record_validator.extend([RecordSchema([run_records(run_id)])])
    return run_id


def _parsed(values: list[object], now: float) -> dict[str, tuple[PeerRecord, float]]:
    records = {}
    for value in values:
        records.update(parse_records(value, now))
    return records


async def survey(node: DHTNode, run_id: str) -> Survey:
    """The live records of ``run_id`` and of the bootstrap peers, as the DHT holds them now. They are parsed in a
    thread: a lookup holds up to about 2,000 records, and a node's event loop runs its rounds meanwhile."""
    async def look() -> tuple[dict[str, tuple[PeerRecord, float]], float]:
        now = get_dht_time()
        record_keys = run_records(run_id).keys
        found = await node.get_many(record_keys + (BOOTSTRAP_KEY,), sufficient_expiration_time=math.inf)
        values = [merged_entries(found, record_keys), getattr(found.get(BOOTSTRAP_KEY), "value", None)]
        return await asyncio.get_running_loop().run_in_executor(None, _parsed, values, now), now

    records, now = await _patiently(look, lambda answer: any(r.role != PeerRole.BOOTSTRAP
                                                              for r, _ in answer[0].values()))
    peers = sorted((r for r, _ in records.values()), key=lambda r: (r.role != PeerRole.BOOTSTRAP, r.name, r.peer_id))
    return Survey(run_id, peers, {p: round(e - now, 1) for p, (_, e) in records.items()})
