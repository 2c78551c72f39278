"""No import cycles among the modules of ckptflow.storage, ckptflow.tasks and ckptflow.flows.

A cycle means two modules that cannot be understood, tested or moved apart, and code
that works only in one import order. Each module goes where its concern is; a cycle is
broken by moving code there, never by hiding an import inside a function, so the check
reads every import statement with ``ast``:

- module-level imports and those inside functions and classes alike (a lazy import is still
  a dependency, and the cycle is still there at run time);
- not those under ``if TYPE_CHECKING:``, which never run;
- relative imports resolved; ``from pkg import name`` imports the module ``pkg.name`` if
  there is one, else ``pkg`` itself (its ``__init__``).

Packages: a module of the project is a node, and a package is the node of its ``__init__``.
Importing ``ckptflow.storage.store`` first runs ``storage/__init__.py``, but that implicit
import of a parent package is no edge: Python handles it (a package's submodules may be
imported while the package itself is still initialising), and counting it would join every
package to everything under it. An *explicit* import of a package is an edge like any other:
``storage/__init__.py`` imports most of the library to re-export it, so a module of
ckptflow.storage that writes ``from ckptflow.storage import X`` (or ``from .. import X``
with X no module) needs the package it is part of finished first: a real cycle, which fails
at import time in one order of imports and not in another.

Which file is which module follows pyproject's ``package-dir`` (``storage/`` installs as
ckptflow.storage, ``flows/toplevel/`` as the ``ckptflow`` package itself).
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DIRECTORIES = ("storage", "tasks", "flows")


@dataclass(frozen=True)
class Edge:
    """Module ``source`` imports module ``target``, at ``where`` ("tasks/reporting/crashed.py:123")."""

    source: str
    target: str
    where: str


@dataclass(frozen=True)
class Module:
    name: str  # dotted, as installed: a package's is its ``__init__``'s
    is_package: bool
    where: str  # path relative to the repository
    source: str


def package_dirs() -> dict[Path, str]:
    """Each directory pyproject maps to a package, with that package's name."""
    import tomllib  # Python 3.11+: imported when the test runs, not when it is collected

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {REPO / directory: package for package, directory in setuptools["package-dir"].items()}


def module_name(path: Path, mapped: dict[Path, str]) -> tuple[str, bool]:
    """The dotted name ``path`` installs as, and whether it is a package's ``__init__``."""
    for top in path.parents:
        if top in mapped:
            parts = [mapped[top], *path.relative_to(top).parent.parts]
            is_package = path.stem == "__init__"
            return ".".join(parts if is_package else [*parts, path.stem]), is_package
    raise AssertionError(f"{path} is under no package-dir of pyproject")


def project_modules() -> list[Module]:
    mapped = package_dirs()
    modules = []
    for directory in DIRECTORIES:
        for path in sorted((REPO / directory).rglob("*.py")):
            name, is_package = module_name(path, mapped)
            where = path.relative_to(REPO).as_posix()
            modules.append(Module(name, is_package, where, path.read_text()))
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(nodes: Iterable[ast.AST], *, typing: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in ``nodes``, at any depth, except under ``if TYPE_CHECKING:``
    (``typing``: those too)."""
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test) and not typing:
            yield from _import_nodes(node.orelse)
        else:
            yield from _import_nodes(ast.iter_child_nodes(node), typing=typing)


def _resolve(module: Module, node: ast.ImportFrom) -> str:
    """The absolute name of the module ``node`` imports from."""
    if not node.level:
        return node.module or ""
    package = module.name.split(".")
    if not module.is_package:
        package = package[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports_of(module: Module, known: set[str], *, typing: bool = False) -> Iterator[Edge]:
    """The edges from ``module`` to the ``known`` modules it imports (``typing``: counting those
    under ``if TYPE_CHECKING:``)."""
    for node in _import_nodes([ast.parse(module.source)], typing=typing):
        where = f"{module.where}:{node.lineno}"
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = _resolve(module, node)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for target in targets:
            if target in known and target != module.name:
                yield Edge(module.name, target, where)


def import_graph(modules: Iterable[Module], *, typing: bool = False) -> list[Edge]:
    modules = list(modules)
    known = {m.name for m in modules}
    return [edge for m in modules for edge in imports_of(m, known, typing=typing)]


def part_of(module: str, top: str) -> str | None:
    """The part of package ``top`` that ``module`` belongs to: its sub-package, or the module
    itself for one directly under ``top`` (the package's ``__init__`` is no part)."""
    if not module.startswith(top + "."):
        return None
    return module[len(top) + 1 :].split(".")[0]


def part_edges(edges: Iterable[Edge], top: str) -> list[Edge]:
    """The imports between different parts of ``top``, as edges between the parts."""
    joined = []
    for edge in edges:
        source, target = part_of(edge.source, top), part_of(edge.target, top)
        if source is not None and target is not None and source != target:
            joined.append(Edge(source, target, edge.where))
    return joined


def strongly_connected(edges: list[Edge]) -> list[list[str]]:
    """The components of more than one module (Tarjan's algorithm), each sorted, in name order."""
    successors: dict[str, set[str]] = {}
    for edge in edges:
        successors.setdefault(edge.source, set()).add(edge.target)
        successors.setdefault(edge.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(successors[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(successors):
        if node not in index:
            visit(node)
    return sorted(found)


def describe(component: list[str], edges: list[Edge]) -> str:
    """A component and the imports that hold it together."""
    members = set(component)
    inside = sorted(
        {e for e in edges if e.source in members and e.target in members},
        key=lambda e: (e.source, e.target, e.where),
    )
    lines = [f"cycle among {', '.join(component)}:"]
    lines += [f"    {e.where}: {e.source} imports {e.target}" for e in inside]
    return "\n".join(lines)


def test_no_import_cycles() -> None:
    edges = import_graph(project_modules())
    cycles = strongly_connected(edges)
    assert not cycles, "import cycles (move the code to the module whose concern it is):\n" + "\n".join(
        describe(c, edges) for c in cycles
    )


def test_the_parts_of_storage_import_each_other_one_way() -> None:
    """storage's sub-packages (format, files, save, load, ...) and top-level modules (store, info,
    diff, ...) form layers: no two of them import each other, counting every import, in functions
    and under ``if TYPE_CHECKING:`` too (a type that one side needs belongs below both)."""
    edges = part_edges(import_graph(project_modules(), typing=True), "ckptflow.storage")
    ties = strongly_connected(edges)
    assert not ties, "storage's parts import each other (move the shared code below both):\n" + "\n".join(
        describe(c, edges) for c in ties
    )


class TestTheCheckItself:
    """The check sees every kind of import and finds a cycle where there is one; else the test above
    could never fail."""

    @staticmethod
    def modules(**sources: str) -> list[Module]:
        """Modules of a package ``pkg`` from their sources; ``__init__`` is the package's."""
        made = []
        for stem, source in sources.items():
            is_package = stem == "__init__"
            name = "pkg" if is_package else f"pkg.{stem.replace('__', '.')}"
            made.append(Module(name, is_package, f"pkg/{stem}.py", source))
        return made

    def test_function_level_imports_count_and_type_checking_ones_do_not(self) -> None:
        edges = import_graph(
            self.modules(
                a="from . import b\n",
                b="def f():\n    from .a import x\n",
                c="from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n",
                d="from . import c\n",
                __init__="",
            )
        )
        assert {(e.source, e.target) for e in edges} == {
            ("pkg.a", "pkg.b"),
            ("pkg.b", "pkg.a"),
            ("pkg.d", "pkg.c"),
        }
        assert strongly_connected(edges) == [["pkg.a", "pkg.b"]]

    def test_a_name_from_a_package_is_an_edge_to_its_init(self) -> None:
        """``from pkg import X``, X re-exported by the package that imports this module: a cycle."""
        edges = import_graph(
            self.modules(__init__="from .store import Store\n", store="from pkg import Helper\n")
        )
        assert strongly_connected(edges) == [["pkg", "pkg.store"]]

    def test_relative_imports_resolve_from_packages_and_modules(self) -> None:
        edges = import_graph(
            self.modules(
                __init__="from .sub.x import y\n",
                sub__x="from ..z import w\nfrom . import y\n",
                sub__y="import pkg.z\n",
                z="",
            )
        )
        assert {(e.source, e.target) for e in edges} == {
            ("pkg", "pkg.sub.x"),
            ("pkg.sub.x", "pkg.z"),
            ("pkg.sub.x", "pkg.sub.y"),
            ("pkg.sub.y", "pkg.z"),
        }
        assert strongly_connected(edges) == []

    def test_parts_tie_through_typing_and_function_imports(self) -> None:
        edges = import_graph(
            self.modules(
                __init__="",
                a__x="from ..b.y import T\n",
                b__y="from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import x\n",
                c="def f():\n    from .b import y\n",
            ),
            typing=True,
        )
        parts = part_edges(edges, "pkg")
        assert {(e.source, e.target) for e in parts} == {("a", "b"), ("b", "a"), ("c", "b")}
        assert strongly_connected(parts) == [["a", "b"]]

    def test_files_are_named_as_installed(self) -> None:
        mapped = package_dirs()
        assert module_name(REPO / "storage/remote/s3.py", mapped) == ("ckptflow.storage.remote.s3", False)
        assert module_name(REPO / "storage/__init__.py", mapped) == ("ckptflow.storage", True)
        assert module_name(REPO / "flows/toplevel/__main__.py", mapped) == ("ckptflow.__main__", False)
        names = {m.name for m in project_modules()}
        assert {"ckptflow.storage.store", "ckptflow.tasks.reporting.crashed", "ckptflow.flows.cli"} <= names
