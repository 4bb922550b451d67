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
    {"bench"},
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
    assert paramserver.store is importlib.import_module("paramserver.server.store")
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
