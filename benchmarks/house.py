"""How the package reads to a newcomer, counted: module sizes, long functions, import arrows, test doubles.

    python benchmarks/house.py                 # the working tree's p2ploco/
    python benchmarks/house.py --root ../old   # another checkout, to compare before and after
    python benchmarks/house.py --json

Rooms are the package's top-level modules and sub-packages (``p2ploco/model.py``, ``p2ploco/swarm/``); an arrow
is one room importing another (imports inside functions count: they are dependencies all the same). Rooms stand
on floors: a room's floor is one above the highest room it imports. An arrow runs back up where two rooms import
each other, directly or round a cycle: of the arrows on such a cycle, the one carried by the fewest module imports
is counted as the one running back up (the lower room reaching for something above it), and dropped before floors
are counted. A test double is an ``InProcess*`` class outside ``p2ploco/testing/``, where in-process stand-ins
for hivemind and other processes belong. Every ``except Exception`` or ``except BaseException`` is listed with
the comment that gives its reason (on its line or the line above), or "no reason given".
"""
from __future__ import annotations

import argparse
import ast
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "p2ploco"
LONG = 50  # lines: a function longer than this is counted
DOUBLES_HOME = "testing"


@dataclass
class House:
    lines: dict[str, int] = field(default_factory=dict)  # module path -> lines
    long_functions: list[tuple[str, int]] = field(default_factory=list)  # "path:qualname", lines
    functions: int = 0
    arrows: Counter = field(default_factory=Counter)  # (room, room) -> module imports carrying it
    doubles: list[str] = field(default_factory=list)
    broad_catches: list[tuple[str, str]] = field(default_factory=list)  # "path:line", reason


def room_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else parts[0]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level == 0:
            base = node.module or ""
        else:
            anchor = module.split(".") if is_package else module.split(".")[:-1]
            anchor = anchor[:len(anchor) - node.level + 1]
            base = ".".join(anchor + ([node.module] if node.module else []))
        return [base] + [f"{base}.{alias.name}" for alias in node.names]
    return []


def walk_functions(tree: ast.AST, prefix: str = ""):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}{node.name}"
            yield name, node
            yield from walk_functions(node, f"{name}.")
        elif isinstance(node, ast.ClassDef):
            yield from walk_functions(node, f"{prefix}{node.name}.")


def count(root: Path) -> House:
    house = House()
    sources = sorted((root / PACKAGE).rglob("*.py"))
    modules = {module_name(path, root) for path in sources}
    for path in sources:
        relative = str(path.relative_to(root))
        text = path.read_text()
        lines = text.splitlines()
        house.lines[relative] = len(lines)
        tree = ast.parse(text)
        module = module_name(path, root)
        for name, node in walk_functions(tree):
            house.functions += 1
            length = node.end_lineno - node.lineno + 1
            if length > LONG:
                house.long_functions.append((f"{relative}:{name}", length))
        in_home = module.split(".")[1:2] == [DOUBLES_HOME]
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name.startswith("InProcess") and not in_home:
                house.doubles.append(f"{relative}:{node.name}")
            if isinstance(node, ast.ExceptHandler) and isinstance(node.type, ast.Name) \
                    and node.type.id in ("Exception", "BaseException"):
                house.broad_catches.append((f"{relative}:{node.lineno}", reason_at(lines, node.lineno)))
            targets = {name for name in imported(node, module, path.name == "__init__.py") if name in modules}
            for target in {room_of(name) for name in targets} - {room_of(module)}:
                house.arrows[room_of(module), target] += 1
    return house


def reason_at(lines: list[str], lineno: int) -> str:
    for text in (lines[lineno - 1], lines[lineno - 2] if lineno > 1 else ""):
        if "#" in text:
            return text.split("#", 1)[1].strip()
    return "no reason given"


def back_arrows(arrows: Counter) -> list[tuple[str, str]]:
    """The arrows that close cycles among rooms, weakest first, until none is left."""
    remaining = dict(arrows)
    dropped = []
    while cycle := find_cycle(remaining):
        weakest = min(cycle, key=lambda arrow: (remaining[arrow], arrow))
        dropped.append(weakest)
        del remaining[weakest]
    return dropped


def find_cycle(arrows: dict[tuple[str, str], int]) -> list[tuple[str, str]] | None:
    out: dict[str, list[str]] = {}
    for source, target in arrows:
        out.setdefault(source, []).append(target)
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(room: str) -> list[tuple[str, str]] | None:
        state[room] = 1
        path.append(room)
        for target in sorted(out.get(room, ())):
            if state.get(target) == 1:
                rooms = path[path.index(target):] + [target]
                return list(zip(rooms, rooms[1:]))
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[room] = 2
        return None

    for room in sorted(out):
        if room not in state and (found := visit(room)):
            return found
    return None


def floors(arrows: Counter, dropped: list[tuple[str, str]]) -> dict[str, int]:
    kept = [arrow for arrow in arrows if arrow not in dropped]
    rooms = {room for arrow in arrows for room in arrow}
    floor = {room: 0 for room in rooms}
    for _ in rooms:  # longest path in a DAG: at most one pass per room
        for source, target in kept:
            floor[source] = max(floor[source], floor[target] + 1)
    return floor


def summary(house: House) -> dict:
    dropped = back_arrows(house.arrows)
    floor = floors(house.arrows, dropped)
    largest = max(house.lines, key=house.lines.get)
    return {"lines": sum(house.lines.values()), "modules": len(house.lines),
            "largest_module": largest, "largest_module_lines": house.lines[largest],
            "functions": house.functions, "functions_over_50_lines": len(house.long_functions),
            "rooms": len(floor), "floors": max(floor.values()) + 1, "arrows": len(house.arrows),
            "arrows_back_up": [f"{source} -> {target}" for source, target in dropped],
            "test_doubles_in_package": house.doubles,
            "except_exception": [f"{site}: {reason}" for site, reason in house.broad_catches]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="a checkout holding p2ploco/ (default: this one)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    args = parser.parse_args()
    house = count(args.root)
    figures = summary(house)
    if args.json:
        print(json.dumps(figures, indent=1))
        return
    print(f"{figures['lines']} lines in {figures['modules']} modules; {figures['rooms']} rooms on "
          f"{figures['floors']} floors, {figures['arrows']} arrows between them")
    print(f"largest module: {figures['largest_module']} ({figures['largest_module_lines']} lines)")
    print(f"functions over {LONG} lines: {figures['functions_over_50_lines']} of {figures['functions']}")
    for name, length in sorted(house.long_functions, key=lambda item: -item[1]):
        print(f"  {length:4d}  {name}")
    print(f"arrows back up: {len(figures['arrows_back_up'])}")
    for arrow in figures["arrows_back_up"]:
        print(f"  {arrow}")
    print(f"test doubles in the package (outside {PACKAGE}/{DOUBLES_HOME}/): {len(house.doubles)}")
    for double in house.doubles:
        print(f"  {double}")
    print(f"except Exception sites: {len(house.broad_catches)}")
    for site, reason in house.broad_catches:
        print(f"  {site}: {reason}")


if __name__ == "__main__":
    main()
