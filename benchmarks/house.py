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

A glossary word has more than one meaning where a name defined in the package (a module, class, function,
parameter, attribute or variable) uses it in a meaning other than docs/design.md's glossary gives it: ``WORDS``
lists, for each word, the names that do, and ``EXEMPT`` the names that stay, with the reason (another library's
API, a name on the wire or in a file format that live swarms read). A concept has more than one name where a name
calls it by another word than the glossary's (``SYNONYMS``).
"""
from __future__ import annotations

import argparse
import ast
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "p2ploco"
LONG = 50  # lines: a function longer than this is counted
DOUBLES_HOME = "testing"
SHOWN = 4  # sites listed for each word or concept


@dataclass(frozen=True)
class Usage:
    """Names defined in ``path`` (a regular expression over the module's path) that match ``name``."""

    path: str
    name: str
    meaning: str  # what the word means there

    def matches(self, path: str, name: str) -> bool:
        return bool(re.search(self.path, path) and re.search(self.name, name))


# glossary word -> (its meaning in the glossary, the names that use it in another meaning)
WORDS: dict[str, tuple[str, tuple[Usage, ...]]] = {
    "group": ("the peers of one sync", (
        Usage(r"", r"(?i)pipeline_groups?", "a pipeline"),
        Usage(r"pipeline/|roles\.py|metrics\.py|demo\.py|cli/",
              r"(?i)^_?groups?$|group_round|round_of_group|complete_groups|group_sizes", "a pipeline"),
        Usage(r"compression/topk\.py", r"(?i)group", "a cell of a chunk's lower bound"),
        Usage(r"compression/|collective/(fp4|lowbit|blocked)", r"(?i)group(?!_size$)", "a quantization block"),
        Usage(r"ranks/", r"^group$", "a node's local ranks' torch process group"),
        Usage(r"inner\.py|ranks/sharded\.py", r"^group$", "a torch optimizer's parameter group"),
        Usage(r"checkpoint\.py", r"^group$", "a section of a checkpoint's tensors"),
    )),
    "record": ("what a peer keeps, signed, in the DHT", (
        Usage(r"", r"RoundRecord|round_record", "what one round did, in the run directory"),
        Usage(r"metrics\.py|rundir\.py|standing\.py|node\.py|presence\.py|progress\.py|dashboard/|demo\.py|launch\.py",
              r"(?i)^(_?records?|read_records|node_records|hub_records)$", "what one round did, in the run directory"),
    )),
    "follow": ("a peer follows the group it applied its last round with", (
        Usage(r"", r"(?i)follower", "a node's other local ranks"),
        Usage(r"rank_process\.py|ranks/", r"^follow$", "a local rank repeating rank 0's steps"),
        Usage(r"outer/|schedules/", r"^follow$", "tensors moved by the same outer step"),
        Usage(r"peer\.py", r"^followed$", "a state to fetch"),
    )),
    "settle": ("a round settles for a peer that ended it as the others did", (
        Usage(r"node\.py|config_choice\.py", r"^_?settle$", "agreeing on the run's config"),
        Usage(r"schedules/", r"^settle$", "waiting for a sync in flight to land"),
        Usage(r"sync/", r"^settled?$", "a sender's stream ending"),
    )),
    "standing": ("what a node's loop carries from round to round (standing.py)", (
        Usage(r"swarm/consensus\.py|sync/", r"standing", "a voter whose last round settled"),
    )),
    "document": ("a JSON document a peer serves: its run document, its status port's answers", (
        Usage(r"data/", r"(?i)document", "a text of the corpus"),
        Usage(r"dashboard/", r"^(run_document|RUN_DOCUMENT)$", "the status port's answer about the run"),
    )),
    "piece": ("a part of a span, the unit that travels", (
        Usage(r"data/", r"(?i)piece", "a stretch of text read at a time"),
    )),
}

# glossary concept -> the names that call it by another word
SYNONYMS: dict[str, tuple[Usage, ...]] = {
    "coordinator": (Usage(r"", r"(?i)judge", "judge"),),
    "span": (Usage(r"sync/", r"(?i)session", "session"),),
    "phase": (Usage(r"", r"PeerState|peer_state", "state"),),
    "sync": (Usage(r"outer/", r"Round$", "round"),),
}

# names that keep a word in another meaning, and why
EXEMPT: tuple[tuple[str, str, str], ...] = (
    (r"", r"param_groups?$|new_group|ProcessGroup", "torch's API"),
    (r"", r"^group_size$", "the config key outer.loco.group_size (a sync group's size elsewhere)"),
    (r"swarm/records\.py", r"^group$", "a record's pipeline, on the wire as `group`"),
    (r"pipeline/links\.py", r"^group$", "a stage message's pipeline, on the wire as `group`"),
    (r"data/(prepared|split)\.py", r"^(documents|held_out_documents)$",
     "the prepared corpus's split (entries), whose keys its digest covers and the run document carries"),
    (r"swarm/reachability\.py", r"^judge", "a helper judges reachability: the word's English sense"),
    (r"metrics\.py", r"^group$", "a round summary's pipeline, a key of metrics.jsonl that run directories hold"),
)


@dataclass
class House:
    lines: dict[str, int] = field(default_factory=dict)  # module path -> lines
    long_functions: list[tuple[str, int]] = field(default_factory=list)  # "path:qualname", lines
    functions: int = 0
    arrows: Counter = field(default_factory=Counter)  # (room, room) -> module imports carrying it
    doubles: list[str] = field(default_factory=list)
    broad_catches: list[tuple[str, str]] = field(default_factory=list)  # "path:line", reason
    meanings: dict[str, list[str]] = field(default_factory=dict)  # word -> "path:line name (meaning)"
    names: dict[str, list[str]] = field(default_factory=dict)  # concept -> "path:line name"


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
        read_words(house, relative, tree)
    return house


def defined_names(tree: ast.AST):
    """(line, name) of every name the module defines: classes, functions, parameters, attributes, variables."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.lineno, node.name
        elif isinstance(node, ast.arg):
            yield node.lineno, node.arg
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            yield node.lineno, node.attr
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            yield node.lineno, node.id


def read_words(house: House, path: str, tree: ast.AST) -> None:
    stem = path.removesuffix(".py").rsplit("/", 1)[-1]
    seen = set()
    for line, name in [(1, stem), *defined_names(tree)]:
        if (name, path) in seen or any(re.search(p, path) and re.search(n, name) for p, n, _ in EXEMPT):
            continue
        seen.add((name, path))
        for word, (_, usages) in WORDS.items():
            if meaning := next((u.meaning for u in usages if u.matches(path, name)), None):
                house.meanings.setdefault(word, []).append(f"{path}:{line} {name} ({meaning})")
        for concept, usages in SYNONYMS.items():
            if any(u.matches(path, name) for u in usages):
                house.names.setdefault(concept, []).append(f"{path}:{line} {name}")


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
            "except_exception": [f"{site}: {reason}" for site, reason in house.broad_catches],
            "words_with_more_than_one_meaning": house.meanings,
            "concepts_with_more_than_one_name": house.names}


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
    print(f"glossary words with more than one meaning: {len(house.meanings)}")
    for word, sites in house.meanings.items():
        print(f"  {word} ({WORDS[word][0]}; {len(sites)} names mean otherwise):")
        for site in sites[:SHOWN]:
            print(f"    {site}")
    print(f"concepts with more than one name: {len(house.names)}")
    for concept, sites in house.names.items():
        print(f"  {concept} ({len(sites)} names call it otherwise):")
        for site in sites[:SHOWN]:
            print(f"    {site}")


if __name__ == "__main__":
    main()
