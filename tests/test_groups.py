"""Slot claims of pipeline groups: deterministic holders, vacancies filled, groups completed first."""

from p2ploco.pipeline.groups import Claim, choose_slot, complete_groups, formation_epoch, group_round, holders


def test_the_earliest_claim_holds_a_slot_whoever_looks():
    claims = [Claim("b", "g0", 0, since=5.0), Claim("a", "g0", 0, since=7.0), Claim("c", "g0", 1, since=9.0)]
    assert holders(claims) == {("g0", 0): "b", ("g0", 1): "c"}
    assert holders(reversed(claims)) == holders(claims)
    assert holders([Claim("b", "g0", 0, 5.0), Claim("a", "g0", 0, 5.0)]) == {("g0", 0): "a"}  # tie: smaller id
    assert complete_groups(claims, 2) == {"g0": ("b", "c")}
    assert complete_groups(claims, 3) == {}  # stage 2 vacant: the group does not train
    assert formation_epoch("g0", ("b", "c")) == formation_epoch("g0", ("b", "c")) != formation_epoch("g0", ("a", "c"))


def test_newcomers_fill_vacancies_completing_groups_first_then_open_a_group():
    claims = [Claim("p1", "g0", 0, 1.0), Claim("p2", "g0", 1, 1.0), Claim("p3", "g1", 0, 2.0)]
    assert choose_slot(claims, "new", stages=2) == ("g1", 1)  # completes g1
    full = claims + [Claim("p4", "g1", 1, 3.0)]
    assert choose_slot(full, "new", stages=2) == ("g2", 0)  # every group full: a new one
    assert choose_slot([], "first", stages=2) == ("g0", 0)
    three = [Claim("p1", "g0", 0, 1.0), Claim("p2", "g1", 0, 1.0), Claim("p3", "g1", 1, 1.0)]
    assert choose_slot(three, "new", stages=3) == ("g1", 2)  # g1 misses one stage, g0 two


def test_a_holder_keeps_its_slot_and_moves_only_to_complete_another_group():
    claims = [Claim("p1", "g0", 0, 1.0), Claim("p2", "g0", 1, 1.0), Claim("p3", "g1", 0, 2.0),
              Claim("p4", "g2", 1, 2.0)]
    assert choose_slot(claims, "p1", stages=2) == ("g0", 0)  # complete group: stays
    # g1 and g2 each lack one stage: the holder in g2 completes g1 (the smaller name), never both moving
    assert choose_slot(claims, "p3", stages=2) == ("g1", 0)
    assert choose_slot(claims, "p4", stages=2) == ("g1", 1)
    lonely = [Claim("p1", "g0", 0, 1.0), Claim("p5", "g3", 0, 1.0), Claim("p6", "g3", 1, 1.0)]
    assert choose_slot(lonely, "p1", stages=3) == ("g3", 2)  # g0 lacks two stages, g3 one: p1 moves there
    # a loser of a conflict waits as standby on a pinned slot, or takes another one
    conflict = [Claim("old", "g0", 0, 1.0), Claim("late", "g0", 0, 4.0), Claim("p2", "g0", 1, 1.0)]
    assert choose_slot(conflict, "late", stages=2, group="g0", stage=0) == ("g0", 0)
    assert choose_slot(conflict, "late", stages=2) == ("g1", 0)


def test_pins_restrict_the_choice():
    claims = [Claim("p1", "g0", 0, 1.0), Claim("p2", "gx", 1, 1.0)]
    assert choose_slot(claims, "new", stages=2, group="gx") == ("gx", 0)
    assert choose_slot(claims, "new", stages=2, stage=1) == ("g0", 1)
    assert choose_slot(claims, "new", stages=2, group="fresh") == ("fresh", 0)


def test_the_stages_of_a_group_agree_on_the_latest_round_any_of_them_is_in():
    # A stage whose mate moved on after a round the group could not finish (one stage's step failed) moves to the
    # mate's round, and the mate, ahead, stays: neither waits for the other to come to its round.
    assert group_round([8], 7, swarm_round=-1) == 8 and group_round([7], 8, swarm_round=-1) == 8
    # A newcomer stage that caught up from the run's replica to round 12, beside a mate at 10: the mate moves up to
    # the newcomer's round; the newcomer stays.
    assert group_round([12], 10, swarm_round=14) == 12 and group_round([10], 12, swarm_round=14) == 12
    assert group_round([], 5, swarm_round=9) == 5 and group_round([5, 5], 5, swarm_round=9) == 5
    # A mate's record that claims a round far ahead of everyone moves a stage one round a look, no faster.
    assert group_round([10**6], 7, swarm_round=7) == 8 and group_round([10**6], 7, swarm_round=-1) == 8
