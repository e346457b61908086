"""Imports point down, room by room: cli -> remote -> debug -> watch/checks -> launch/snapshot -> job/trainer/data
-> spec/slurm/common. Code that runs on compute nodes (job, trainer, data) and the rooms under it never import
the launcher or the CLI, not even inside a function: a compute node may have only what the ranks need, and the
launcher's code is not theirs. No import circle, between files or between rooms, and no room holds more than
a fifth of the library's lines.

Every import statement counts, at module level or inside a function: a function-local import is still an
arrow, and a circle hidden in one is still a circle. An import names the module it imports (`from a.b import
c` is a.b.c where c is a module, else a.b); the package `__init__` files Python runs on the way are not counted
as arrows, or every module would be in a circle with the package that holds it."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hpc_ddp"

# Top to bottom. A room may import the rooms of its own level and those below it, never one above. The top
# level holds the entry points: the hpc-ddp command, `python -m hpc_ddp` and `hpc_ddp.demo`, and
# `hpc_ddp.notebook`. "hpc_ddp" is the package's own __init__ (the public names, and __version__ the launcher
# stamps into scripts); it loads the Session API lazily, by name, which no import statement shows.
LEVELS = (
    ("cli", "__main__", "demo", "notebook"),
    ("remote",),
    ("debug",),
    ("watch", "checks"),
    ("launch", "snapshot"),
    ("hpc_ddp",),
    ("job", "trainer", "data"),
    ("spec", "slurm", "common"),
)
MAX_SHARE = 0.20  # of the library's lines, for any one room


# Known, and left for its own change: building a spec asks whether the ranks' Python has debugpy
# (--debug-rank), through the job side's probe; the probe belongs at the CLI's edge.
KNOWN = {"spec/jobspec.py imports hpc_ddp.job.debugger"}


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package (a package is its __init__.py)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _imports(path: Path):
    """(line, module of the package) for every import in the file, wherever it is (`from a import b`: a.b
    where b is a module, else a)."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the file's own package
                base = module.split(".")[: len(module.split(".")) - node.level + (path.name == "__init__.py")]
                written = ".".join(base + ([node.module] if node.module else []))
            else:
                written = node.module or ""
            names = [f"{written}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            written, names = "", [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            owner = name if name in MODULES else written if written in MODULES else name
            while owner and owner not in MODULES:
                owner = owner.rpartition(".")[0]
            if owner:
                yield node.lineno, owner


def _room(module: str) -> str:
    """hpc_ddp.launch.executors.srun -> launch; hpc_ddp.notebook -> notebook; hpc_ddp -> hpc_ddp."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _graph() -> dict[str, dict[str, list[str]]]:
    """module -> {module it imports: ["file:line", ...]}, KNOWN arrows left out."""
    graph: dict[str, dict[str, list[str]]] = {m: {} for m in MODULES}
    for module, path in MODULES.items():
        rel = path.relative_to(PACKAGE)
        for line, target in set(_imports(path)):
            if target != module and f"{rel} imports {target}" not in KNOWN:
                graph[module].setdefault(target, []).append(f"{rel}:{line}")
    return graph


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One circle in `edges` (as the path that closes it), or None."""
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done, no circle through it
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_every_room_has_a_level():
    rooms = {_room(m) for m in MODULES}
    assert rooms - {room for level in LEVELS for room in level} == set(), "a new room: give it its level in LEVELS"


def test_imports_point_down():
    level = {room: i for i, rooms in enumerate(LEVELS) for room in rooms}
    offenders = [f"{where} imports {target}"
                 for module, targets in _graph().items() for target, places in targets.items()
                 for where in places if level[_room(target)] < level[_room(module)]]
    assert sorted(offenders) == []


def test_no_import_circle_between_files():
    circle = _cycle({module: set(targets) for module, targets in _graph().items()})
    assert circle is None, " -> ".join(circle)


def test_no_import_circle_between_rooms():
    rooms: dict[str, set[str]] = {}
    why: dict[tuple[str, str], str] = {}
    for module, targets in _graph().items():
        for target, where in targets.items():
            a, b = _room(module), _room(target)
            if a != b:
                rooms.setdefault(a, set()).add(b)
                why.setdefault((a, b), where[0])
    circle = _cycle(rooms)
    assert circle is None, [f"{a} -> {b} ({why[a, b]})" for a, b in zip(circle, circle[1:])]


def test_the_checks_see_the_arrows_that_exist():
    """The graph is not empty by mistake: known arrows, one of them inside a function, are in it."""
    graph = _graph()
    assert "hpc_ddp.launch.executors.base" in graph["hpc_ddp.watch.status"]
    assert "hpc_ddp.checks.finding" in graph["hpc_ddp.checks.hostcheck"]
    assert "hpc_ddp.job.attempts" in graph["hpc_ddp.launch.executors.foreground"]  # imported in a function
    assert "hpc_ddp.snapshot.listing" in graph["hpc_ddp.snapshot.shipped"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_room_holds_more_than_a_fifth_of_the_lines():
    lines = {path: len(path.read_text().splitlines()) for path in MODULES.values()}
    total = sum(lines.values())
    by_room: dict[str, int] = {}
    for module, path in MODULES.items():
        by_room[_room(module)] = by_room.get(_room(module), 0) + lines[path]
    over = {room: f"{n / total:.0%}" for room, n in by_room.items() if n > MAX_SHARE * total}
    assert over == {}, f"of {total} lines"
