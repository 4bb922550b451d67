"""The package layering of docs/architecture.md, read from the imports: no arrow points up,
and the root holds only the public face."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import paramserver

PACKAGE = Path(paramserver.__file__).parent
ROOT_MODULES = {"__init__", "__main__", "api", "config", "settings", "errors"}

# Lowest first; a module may import its own layer's packages and those below it. The root's
# modules split: errors, settings and config are the floor, api (``serve``) sits on the server,
# and __init__ and __main__ are the roof.
LAYERS: list[set[str]] = [
    {"errors", "settings", "_proto"},
    {"codec", "policy"},
    {"config"},
    {"sparse"},
    {"models", "transport"},
    {"server", "worker"},
    {"api", "serving"},
    {"training"},
    {"cluster"},
    {"bench", "launchers"},
    {"cli"},
    {"__init__", "__main__"},
]
RANK = {unit: i for i, layer in enumerate(LAYERS) for unit in layer}
# Two packages of one layer never import each other.
APART = [("server", "worker"), ("models", "transport")]


def unit_of(dotted: str) -> str:
    """``paramserver.server.app`` -> ``server``; ``paramserver`` -> ``__init__``."""
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    name = ".".join(rel.parts)
    return name.removesuffix(".__init__")


def imports(path: Path) -> set[str]:
    """Every ``paramserver`` module ``path`` imports, at any depth (TYPE_CHECKING too)."""
    tree = ast.parse(path.read_text())
    here = module_name(path)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                if path.name != "__init__.py":
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "paramserver":
                found.update(f"paramserver.{alias.name}" for alias in node.names)
            elif target.startswith("paramserver."):
                found.add(target)
                found.update(f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("paramserver"))
    return found


def sources() -> list[Path]:
    return [p for p in PACKAGE.rglob("*.py") if "_proto" not in p.parts]


def test_the_root_holds_only_the_public_face() -> None:
    loose = {p.stem for p in PACKAGE.glob("*.py")}
    assert loose <= ROOT_MODULES, (
        f"modules at the root beyond the public face: {loose - ROOT_MODULES}"
    )
    assert len(loose) <= 6


def test_every_package_is_in_a_layer_and_says_what_it_may_import() -> None:
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert packages - set(RANK) == set(), "a package the layering does not name"
    for name in packages - {"_proto"}:
        doc = ast.get_docstring(ast.parse((PACKAGE / name / "__init__.py").read_text()))
        assert doc, f"paramserver/{name}/__init__.py has no docstring"
        assert re.search(r"\bmay import\b", doc, re.IGNORECASE), (name, doc)


def test_no_import_points_up_the_layers() -> None:
    upward = []
    for path in sources():
        here = unit_of(module_name(path))
        for target in imports(path):
            there = unit_of(target)
            if there == here:
                continue
            if RANK[there] > RANK[here] or (here, there) in APART or (there, here) in APART:
                upward.append(f"{module_name(path)} -> {target}")
    assert upward == [], "imports that point up (or across) the layering:\n" + "\n".join(upward)


def test_the_checker_sees_an_upward_arrow(tmp_path: Path) -> None:
    """The check above can fail: an import of the server from the codec is caught."""
    fake = PACKAGE / "codec" / "layout.py"
    found = imports(fake) | {"paramserver.server.app"}
    assert any(RANK[unit_of(t)] > RANK["codec"] for t in found)


def test_old_module_paths_still_import() -> None:
    """The flat layout's module paths give the modules in their new homes."""
    import importlib

    for old, new in paramserver.MOVED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
    assert paramserver.data is importlib.import_module("paramserver.training.data")
    assert paramserver.checkpoint.load is paramserver.load_checkpoint
    assert paramserver.store is importlib.import_module("paramserver.server.bookkeeping.store")
    assert paramserver.launch is importlib.import_module("paramserver.cluster.launch")


def _cycles() -> list[list[str]]:
    """Every circle of imports between modules (strongly connected groups of two or more)."""
    known = {module_name(p) for p in sources()}
    graph: dict[str, set[str]] = {}
    for path in sources():
        here = module_name(path)
        graph[here] = set()
        for target in imports(path):
            # ``from paramserver.codec import rows`` names the module codec.rows
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if (
                target in known
                and target != here
                and not (PACKAGE / "/".join(target.split(".")[1:]) / "__init__.py").exists()
            ):
                graph[here].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_modules_import_each_other_in_a_circle() -> None:
    assert _cycles() == []


def test_the_architecture_page_shows_this_layering_and_every_package() -> None:
    """docs/architecture.md's layering block, top to bottom, is LAYERS reversed, and its
    layout names every package."""
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    block = page.split("## Layering", 1)[1].split("```")[1]
    shown = []
    for line in block.strip().splitlines():
        names = re.split(r"\s{2,}", line.strip())[0]
        shown.append({n.strip() for n in re.split(r"[|,]", names)})
    assert shown == list(reversed(LAYERS))
    for package in {p.parent.name for p in PACKAGE.glob("*/__init__.py")}:
        if package != "_proto":
            assert f"paramserver/{package}/" in page or f"  {package}/" in page, package


# The rooms inside a package, lowest first: a module may import its own room and those
# below it, never one above, and two rooms of one level never import each other. ``""``
# is the package's own top-level modules.
ROOMS: dict[str, list[set[str]]] = {
    "server": [{"optim"}, {"bookkeeping"}, {"engine"}, {"disk", "doors"}, {""}],
    "bench": [{"report"}, {""}, {"criteo"}, {"tables"}, {"throughput"}, {"wire"}],
}
# Rooms of different levels that never import each other all the same.
ROOMS_APART = {
    "bench": [({"criteo", "tables"}, {"throughput", "wire"})],
}
MAX_MODULES_A_FOLDER = 15


def room_of(dotted: str, package: str) -> str | None:
    """``paramserver.server.engine.pulls`` -> ``engine``; ``paramserver.server.app`` -> ``""``;
    None outside ``package``."""
    parts = dotted.split(".")
    if parts[:2] != ["paramserver", package]:
        return None
    rooms = {room for level in ROOMS[package] for room in level}
    if len(parts) > 2 and parts[2] in rooms:
        return parts[2]
    return ""


def test_every_room_is_ranked_and_says_what_it_may_import() -> None:
    for package, levels in ROOMS.items():
        ranked = {room for level in levels for room in level} - {""}
        found = {p.parent.name for p in (PACKAGE / package).glob("*/__init__.py")}
        assert found == ranked, (package, found ^ ranked)
        for room in found:
            doc = ast.get_docstring(
                ast.parse((PACKAGE / package / room / "__init__.py").read_text())
            )
            assert doc and re.search(r"\bmay import\b", doc, re.IGNORECASE), (package, room)


def arrow_is_wrong(package: str, here: str, target: str, in_init: bool = False) -> bool:
    """Whether module ``here`` of ``package`` may not import ``target``: ``target`` is in a
    room above ``here``'s, or in another room of the same level. The package's own
    ``__init__`` (its docstring and nothing else) may name any room."""
    rank = {room: i for i, level in enumerate(ROOMS[package]) for room in level}
    mine, there = room_of(here, package), room_of(target, package)
    if mine is None or there is None or there == mine:
        return False
    if target == f"paramserver.{package}":
        return False  # ``from paramserver.server import x``: x is checked on its own
    if mine == "" and in_init:
        return False
    for one, other in ROOMS_APART.get(package, []):
        if (mine in one and there in other) or (mine in other and there in one):
            return True
    return rank[there] >= rank[mine]


def test_no_import_points_up_the_rooms() -> None:
    wrong = []
    for package in ROOMS:
        for path in (PACKAGE / package).rglob("*.py"):
            here = module_name(path)
            in_init = path.name == "__init__.py" and path.parent == PACKAGE / package
            wrong += [
                f"{here} -> {t}" for t in imports(path) if arrow_is_wrong(package, here, t, in_init)
            ]
    assert wrong == [], "imports that point up (or across) the rooms:\n" + "\n".join(wrong)


def test_the_room_checker_sees_an_upward_arrow() -> None:
    """The rule above can fail: up a level, across a level, and to the process modules."""
    server = "paramserver.server"
    assert arrow_is_wrong("server", f"{server}.engine.coordinator", f"{server}.doors.steps")
    assert arrow_is_wrong("server", f"{server}.bookkeeping.store", f"{server}.engine.members")
    assert arrow_is_wrong("server", f"{server}.disk.export", f"{server}.doors.payloads")
    assert arrow_is_wrong("server", f"{server}.doors.steps", f"{server}.build")
    assert arrow_is_wrong(
        "bench", "paramserver.bench.criteo.ranks", "paramserver.bench.tables.ranks"
    )
    assert not arrow_is_wrong("server", f"{server}.app", f"{server}.disk.checkpoint_writer")
    assert not arrow_is_wrong("server", f"{server}.doors.steps", f"{server}.engine.coordinator")
    assert not arrow_is_wrong("server", f"{server}.engine.pulls", "paramserver.codec.wire")


def test_no_folder_holds_more_than_about_fifteen_modules() -> None:
    crowded = {}
    for folder in {p.parent for p in PACKAGE.rglob("*.py")} - {PACKAGE / "_proto"}:
        count = len([p for p in folder.glob("*.py") if p.name != "__init__.py"])
        if count > MAX_MODULES_A_FOLDER:
            crowded[str(folder.relative_to(PACKAGE.parent))] = count
    assert crowded == {}


def test_no_module_is_longer_than_400_lines() -> None:
    long = {
        str(p.relative_to(PACKAGE.parent)): n
        for p in sources()
        if (n := len(p.read_text().splitlines())) > 400
    }
    assert long == {}


def test_the_server_folder_s_old_module_paths_give_the_new_modules() -> None:
    """``paramserver.server.checkpoint`` (and every module the flat server folder had)
    imports, and is the module in its room."""
    import importlib

    old = importlib.import_module("paramserver.server.checkpointer")
    assert old is importlib.import_module("paramserver.server.disk.checkpoint_writer")
    from paramserver.server import membership  # type: ignore[attr-defined]

    assert membership is importlib.import_module("paramserver.server.bookkeeping.leases")
