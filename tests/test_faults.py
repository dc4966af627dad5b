"""The named seams where tests put hostile behaviour in (``faults.SEAMS``): each is reached by the code it names, a
swapped one replaces the honest behaviour there, and a misspelt one is refused, so a renamed seam breaks a hostile
test instead of silently disarming it."""

import ast
from pathlib import Path

import pytest

from p2ploco import faults

PACKAGE = Path(faults.__file__).parent


def seams_reached() -> set[str]:
    """Every seam name the package passes to ``faults.seam``."""
    reached = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "seam" \
                    and node.args and isinstance(node.args[0], ast.Constant):
                reached.add(node.args[0].value)
    return reached


def test_every_seam_is_reached_by_the_code_it_names():
    assert seams_reached() == set(faults.SEAMS)


def test_a_swapped_seam_replaces_the_honest_behaviour_until_it_is_swapped_back():
    def honest(x: int) -> int:
        return x + 1

    owner = object()
    faults.swap("answer.state", lambda who, behaviour: lambda x: (who is owner, behaviour(x) * 10))
    try:
        assert faults.seam("answer.state", owner, honest)(1) == (True, 20)
        assert faults.seam("answer.dialback", owner, honest)(1) == 2  # another seam stays honest
    finally:
        faults.swap("answer.state", None)
    assert faults.seam("answer.state", owner, honest)(1) == 2


def test_a_misspelt_seam_is_refused_with_the_list_of_seams():
    with pytest.raises(ValueError, match=r"no seam 'answer\.states'; seams: sync\.forming, "):
        faults.swap("answer.states", lambda who, behaviour: behaviour)
