"""Slot claims of pipelines: deterministic holders, vacancies filled, pipelines completed first."""

from collections.abc import Callable

from p2ploco.pipeline.assembly import (
    ASSEMBLY_LEAD,
    Claim,
    choose_slot,
    complete_pipelines,
    formation_epoch,
    holders,
    in_step,
    pipeline_round,
)


def test_the_earliest_claim_holds_a_slot_whoever_looks():
    claims = [Claim("b", "g0", 0, since=5.0), Claim("a", "g0", 0, since=7.0), Claim("c", "g0", 1, since=9.0)]
    assert holders(claims) == {("g0", 0): "b", ("g0", 1): "c"}
    assert holders(reversed(claims)) == holders(claims)
    assert holders([Claim("b", "g0", 0, 5.0), Claim("a", "g0", 0, 5.0)]) == {("g0", 0): "a"}  # tie: smaller id
    assert complete_pipelines(claims, 2) == {"g0": ("b", "c")}
    assert complete_pipelines(claims, 3) == {}  # stage 2 vacant: the pipeline does not train
    assert formation_epoch("g0", ("b", "c")) == formation_epoch("g0", ("b", "c")) != formation_epoch("g0", ("a", "c"))


def test_newcomers_fill_vacancies_completing_pipelines_first_then_open_a_pipeline():
    claims = [Claim("p1", "g0", 0, 1.0), Claim("p2", "g0", 1, 1.0), Claim("p3", "g1", 0, 2.0)]
    assert choose_slot(claims, "new", stages=2) == ("g1", 1)  # completes g1
    full = claims + [Claim("p4", "g1", 1, 3.0)]
    assert choose_slot(full, "new", stages=2) == ("g2", 0)  # every pipeline full: a new one
    assert choose_slot([], "first", stages=2) == ("g0", 0)
    three = [Claim("p1", "g0", 0, 1.0), Claim("p2", "g1", 0, 1.0), Claim("p3", "g1", 1, 1.0)]
    assert choose_slot(three, "new", stages=3) == ("g1", 2)  # g1 misses one stage, g0 two


def test_a_holder_keeps_its_slot_and_moves_only_to_complete_another_pipeline():
    claims = [Claim("p1", "g0", 0, 1.0), Claim("p2", "g0", 1, 1.0), Claim("p3", "g1", 0, 2.0),
              Claim("p4", "g2", 1, 2.0)]
    assert choose_slot(claims, "p1", stages=2) == ("g0", 0)  # complete pipeline: stays
    # g1 and g2 each lack one stage: the holder in g2 completes g1 (the smaller name), never both moving
    assert choose_slot(claims, "p3", stages=2) == ("g1", 0)
    assert choose_slot(claims, "p4", stages=2) == ("g1", 1)
    lonely = [Claim("p1", "g0", 0, 1.0), Claim("p5", "g3", 0, 1.0), Claim("p6", "g3", 1, 1.0)]
    assert choose_slot(lonely, "p1", stages=3) == ("g3", 2)  # g0 lacks two stages, g3 one: p1 moves there
    # a loser of a conflict waits as standby on a pinned slot, or takes another one
    conflict = [Claim("old", "g0", 0, 1.0), Claim("late", "g0", 0, 4.0), Claim("p2", "g0", 1, 1.0)]
    assert choose_slot(conflict, "late", stages=2, pipeline="g0", stage=0) == ("g0", 0)
    assert choose_slot(conflict, "late", stages=2) == ("g1", 0)


def test_pins_restrict_the_choice():
    claims = [Claim("p1", "g0", 0, 1.0), Claim("p2", "gx", 1, 1.0)]
    assert choose_slot(claims, "new", stages=2, pipeline="gx") == ("gx", 0)
    assert choose_slot(claims, "new", stages=2, stage=1) == ("g0", 1)
    assert choose_slot(claims, "new", stages=2, pipeline="fresh") == ("fresh", 0)


def test_the_stages_of_a_pipeline_meet_in_the_latest_round_any_of_them_proposed_ahead_of_the_swarm():
    # Without other trainers (swarm_round -1) a stage behind a mate moves to the mate's round, and the mate stays.
    assert pipeline_round([8], 7, swarm_round=-1) == 8 and pipeline_round([7], 8, swarm_round=-1) == 8
    # A proposal the swarm has not reached is taken by the stages behind it, and kept by its proposer.
    assert pipeline_round([17], 12, swarm_round=14) == 17 and pipeline_round([12], 17, swarm_round=14) == 17
    # The latest round any stage is in is one the swarm has reached: a new proposal, ASSEMBLY_LEAD past the swarm.
    assert pipeline_round([12], 10, swarm_round=14) == 14 + ASSEMBLY_LEAD == pipeline_round([10], 12, swarm_round=14)
    assert pipeline_round([14], 14, swarm_round=14) == 14 + ASSEMBLY_LEAD
    # A mate's record that claims a round far ahead of everyone moves a stage ASSEMBLY_LEAD rounds a look, no faster.
    assert pipeline_round([10**6], 7, swarm_round=7) == 7 + ASSEMBLY_LEAD == pipeline_round([10**6], 7, swarm_round=-1)


def looks_until_met(rule: Callable[[list[int], int, int], int], looks: int = 40) -> int | None:
    """Two stages of a pipeline look in turn at each other's round (a loaded machine: the swarm trains a round between
    two looks), each moving where ``rule`` says; a stage that moves to a round the swarm has reached finds it moved on,
    and catches up to the swarm's round. The look at which both stand in the same round ahead of the swarm, or None."""
    swarm, rounds = 48, {"a": 47, "b": 48}  # issue 60: stage 0 in odd rounds, stage 1 in even ones, for good
    for look in range(looks):
        me, mate = ("a", "b") if look % 2 == 0 else ("b", "a")
        swarm += 1
        target = rule([rounds[mate]], rounds[me], swarm)
        rounds[me] = target if target > swarm else swarm
        if rounds[me] == rounds[mate] >= swarm:
            return look
    return None


def test_two_stages_that_look_in_turn_while_the_swarm_moves_on_do_not_chase_each_other():
    assert looks_until_met(pipeline_round) == 1


def test_a_stage_is_in_step_with_the_mates_it_applied_the_round_before_with_while_each_is_in_it_or_this_one():
    group = ("a", "b", "c", "replica")
    assert in_step({"b": (20, True)}, 21, applied=20, group=group)  # b finishes round 20 still
    assert in_step({"b": (21, True), "c": (20, True)}, 21, applied=20, group=group)
    assert not in_step({"b": (20, True)}, 21, applied=19, group=group)  # this stage did not apply round 20
    assert not in_step({"d": (20, True)}, 21, applied=20, group=group)  # d was not in the group that applied it
    assert not in_step({"b": (20, False)}, 21, applied=20, group=group)  # b stands by, or catches up
    assert not in_step({"b": (21, False)}, 21, applied=20, group=group)  # b stands by in this round: it may not come
    assert not in_step({"b": (19, True)}, 21, applied=20, group=group)
    assert not in_step({"b": (22, True)}, 21, applied=20, group=group)
    assert not in_step({"b": (21, True), "c": (19, True)}, 21, applied=20, group=group)  # every mate, not one
