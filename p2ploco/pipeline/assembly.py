"""Pipelines in the DHT: which stage peer holds which (pipeline, stage) slot.

Nothing is negotiated: every stage peer publishes its claim in its own signed peer record (pipeline,
stage, and ``since``, the DHT time it claimed the slot), and every peer applies the same rules to the
same records. A slot belongs to its earliest claimant (ties: the smaller peer id), so a newcomer never
displaces a peer that holds a slot; a claimant that loses waits as standby and takes the slot when it
falls vacant. A pipeline trains only while all of its S slots are held; its formation (who holds which
stage) is identified by an epoch derived from the holders, so stages with different views of the pipeline
refuse each other's messages rather than mix two formations.

A peer without ``--group``/``--stage`` takes a vacant slot, preferring the one that completes a pipeline
(the fewest missing stages), then the smallest pipeline name and stage; when every known pipeline is full it
opens a new pipeline ``g<N>`` at stage 0. A peer that holds a slot of an incomplete pipeline moves to a
vacancy that would complete a pipeline ahead of its own (fewer stages missing, then a smaller name), so
holders never swap back and forth; two peers that move to the same slot are sorted out by the rule
above.

The stages of a pipeline train a round together, so they must agree on which round is next (``pipeline_round``). A
round the swarm's trainers have reached is no place to meet: its state is served only while they are in it, and a
stage that moved there catches up to wherever the swarm is by then, so two stages that each moved to the other's
round chased each other's round for good on a loaded machine. The pipeline meets in a round ahead of the swarm
instead: a stage whose mates are not in its round proposes the round ``ASSEMBLY_LEAD`` past the swarm's, standing
by there (nobody waits for it), and every stage takes the latest round any of them proposed while the swarm has not
reached it. Proposals only grow, and a new one is made only once the swarm has reached every earlier one, so the
stages cannot chase each other: they wait for the swarm to come to the same round, fetch its state there together,
and train it (``StageRole.ready``, ``Node._loop``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

Slot = tuple[str, int]  # (pipeline name, stage)
# rounds past the swarm's that a pipeline proposes to meet in: time for every stage to see the proposal, and to be
# waiting for the swarm there, before the swarm reaches it
ASSEMBLY_LEAD = 3


@dataclass(frozen=True)
class Claim:
    peer_id: str
    pipeline: str  # a record's ``group`` on the wire
    stage: int
    since: float  # DHT time at which the peer claimed the slot


def holders(claims: Iterable[Claim]) -> dict[Slot, str]:
    """Each claimed slot's holder: its earliest claimant, ties broken by peer id."""
    best: dict[Slot, Claim] = {}
    for claim in claims:
        slot = (claim.pipeline, claim.stage)
        if slot not in best or (claim.since, claim.peer_id) < (best[slot].since, best[slot].peer_id):
            best[slot] = claim
    return {slot: claim.peer_id for slot, claim in best.items()}


def formation_epoch(pipeline: str, peers: tuple[str, ...]) -> int:
    """An id of one formation of ``pipeline``: the same on every peer that sees the same holders."""
    return int.from_bytes(hashlib.sha256("|".join((pipeline, *peers)).encode()).digest()[:6], "big")


def complete_pipelines(claims: Iterable[Claim], stages: int) -> dict[str, tuple[str, ...]]:
    """Pipelines whose S slots are all held, with the holder of each stage in stage order."""
    held = holders(claims)
    names = {pipeline for pipeline, _ in held}
    return {pipeline: tuple(held[(pipeline, s)] for s in range(stages)) for pipeline in sorted(names)
            if all((pipeline, s) in held for s in range(stages))}


def choose_slot(claims: Iterable[Claim], me: str, stages: int, pipeline: str | None = None,
                stage: int | None = None) -> Slot:
    """The slot this peer should claim, given everyone's claims (its own included) and its pins."""
    claims = list(claims)
    held = holders(claims)
    mine = next(((c.pipeline, c.stage) for c in claims
                 if c.peer_id == me and held.get((c.pipeline, c.stage)) == me), None)
    if pipeline is not None and stage is not None:
        return pipeline, stage  # pinned: hold it, or wait as standby until it falls vacant
    pipelines = sorted({p for p, _ in held} | ({pipeline} if pipeline is not None else set()))
    missing = {p: [s for s in range(stages) if (p, s) not in held] for p in pipelines}
    if mine is not None and not missing[mine[0]]:
        return mine  # a slot of a complete pipeline: keep it
    vacant = sorted((len(missing[p]), p, s) for p in pipelines for s in missing[p]
                    if (pipeline is None or p == pipeline) and (stage is None or s == stage))
    if mine is not None:
        # Move only towards a pipeline that is ahead of ours (fewer missing, then a smaller name): two holders
        # of half-empty pipelines then never swap places back and forth.
        ours = (len(missing[mine[0]]), mine[0])
        completing = [(p, s) for n, p, s in vacant if n == 1 and (n, p) < ours]
        return completing[0] if completing else mine
    if vacant:
        return vacant[0][1], vacant[0][2]
    if pipeline is not None:
        return pipeline, stage if stage is not None else 0  # every slot of the pinned pipeline is held: standby
    fresh = next(f"g{n}" for n in range(len(pipelines) + 1) if f"g{n}" not in pipelines)
    return fresh, stage if stage is not None else 0


def in_step(mates: Mapping[str, tuple[int, bool]], round_index: int, applied: int, group: Collection[str]) -> bool:
    """Whether a stage at ``round_index`` is in step with its pipeline's other stages, each given by peer as (its
    round, whether it is in that round: training or averaging it): it applied the round before (``applied``, the
    last round it applied, with the members ``group``) with every one of them, and each is in that round still or
    in this one. Such a stage is in for the round at once: one that stood by until its mates' records caught up
    was not waited for by the round's coordinator, which closed a group without the pipeline, and every peer lost
    the round (``StageRole.ready``). A mate killed since, whose record still shows that round, costs the round's
    formation its wait, once."""
    return applied == round_index - 1 and all(peer in group and in_round and round_of in (applied, round_index)
                                              for peer, (round_of, in_round) in mates.items())


def pipeline_round(mates: Iterable[int], round_index: int, swarm_round: int) -> int:
    """The round a stage at ``round_index`` meets its pipeline in, given the rounds its pipeline's other stages are
    in and the furthest round a trainer of the run outside its pipeline is in (``swarm_round``; -1: none): the latest
    of the stages' rounds while the swarm has not reached it, else a new proposal ``ASSEMBLY_LEAD`` rounds past the
    swarm's. A mate's record that claims a round far ahead of everyone moves a stage ``ASSEMBLY_LEAD`` rounds a look,
    no faster."""
    latest = max(mates, default=round_index)
    if latest <= round_index and round_index > swarm_round:
        return round_index  # ahead of its mates and of the swarm: they come here
    if latest <= swarm_round:  # the swarm is in it or past it already: a stage that went there would find it moved on
        return swarm_round + ASSEMBLY_LEAD
    return min(max(latest, round_index), max(round_index, swarm_round) + ASSEMBLY_LEAD)
