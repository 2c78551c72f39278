"""The dependency arrow points one way, flows -> tasks -> storage, and storage is used by its public API.

- storage/ imports nothing from ckptflow.tasks or ckptflow.flows, and nothing of Prefect;
- tasks/ imports nothing from ckptflow.flows;
- flows/ and tasks/ import from ckptflow.storage only the names it exports (``__all__``),
  never from one of its modules: those are storage's internals, free to change.

Every import statement of every module is read with ``ast``, those inside functions and
``TYPE_CHECKING`` blocks included, so a lazy import cannot slip past the check.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import ckptflow.storage

REPO = Path(__file__).resolve().parent.parent
PACKAGES = {"storage": "ckptflow.storage", "tasks": "ckptflow.tasks", "flows": "ckptflow.flows"}

# Modules of ckptflow.storage that flows/ and tasks/ may import from, besides the package itself.
# None: everything they need is exported by storage/__init__.py. A module joins this list only
# if it is public as a whole (documented in the README), never to reach one internal name.
PUBLIC_STORAGE_MODULES: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Import:
    """One imported module (``name`` None) or one name imported from a module, where it is written."""

    where: str  # "tasks/archiving.py:37"
    module: str  # absolute: relative imports resolved
    name: str | None = None

    def __str__(self) -> str:
        what = self.module if self.name is None else f"{self.name} from {self.module}"
        return f"{self.where} imports {what}"


def imports_of(source: str, module: str, where: str) -> Iterator[Import]:
    """Every import in ``source``, the code of module ``module`` (dotted; a package's is its ``__init__``)."""
    is_package = where.endswith("__init__.py")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(f"{where}:{node.lineno}", alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                keep = len(parts) - node.level + (1 if is_package else 0)
                base = ".".join(parts[:keep] + ([base] if base else []))
            for alias in node.names:
                yield Import(f"{where}:{node.lineno}", base, alias.name)


def package_imports(directory: str) -> list[Import]:
    """Every import of every module of ``directory``, its subpackages' included."""
    found = []
    for path in sorted((REPO / directory).rglob("*.py")):
        relative = path.relative_to(REPO / directory)
        parts = [*relative.parent.parts, *([] if path.stem == "__init__" else [path.stem])]
        module = ".".join([PACKAGES[directory], *parts])
        found.extend(imports_of(path.read_text(), module, f"{directory}/{relative.as_posix()}"))
    return found


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def reaches_past_storage_api(imp: Import) -> bool:
    """Whether ``imp`` takes something from ckptflow.storage that its public API does not offer."""
    if not within(imp.module, "ckptflow.storage"):
        return False
    if imp.module == "ckptflow.storage":
        if imp.name is None or imp.name in ckptflow.storage.__all__:
            return False
        return imp.name not in PUBLIC_STORAGE_MODULES  # ``from ckptflow.storage import commit``
    return imp.module.removeprefix("ckptflow.storage.").split(".")[0] not in PUBLIC_STORAGE_MODULES


@pytest.mark.parametrize("directory", ["flows", "tasks"])
def test_flows_and_tasks_use_only_the_public_api_of_storage(directory: str) -> None:
    offending = [str(i) for i in package_imports(directory) if reaches_past_storage_api(i)]
    assert not offending, "import these from ckptflow.storage (export them if missing):\n" + "\n".join(
        offending
    )


def test_storage_imports_neither_tasks_nor_flows_nor_prefect() -> None:
    forbidden = ("ckptflow.tasks", "ckptflow.flows", "prefect")
    offending = [str(i) for i in package_imports("storage") if any(within(i.module, p) for p in forbidden)]
    assert not offending, "\n".join(offending)


def test_tasks_import_nothing_from_flows() -> None:
    offending = [str(i) for i in package_imports("tasks") if within(i.module, "ckptflow.flows")]
    assert not offending, "\n".join(offending)


def test_the_training_processes_import_no_prefect_and_no_reporting() -> None:
    """tasks/training runs where the model lives (the ranks, the launcher, the in-process rank):
    Prefect never loads there (its import costs seconds and its threads draw from Python's RNG),
    and neither does what a run shows in Prefect. It may use the shared config, cadence and spec contract."""
    allowed = {
        "ckptflow.tasks.cadence",
        "ckptflow.tasks.config",
        "ckptflow.tasks.spec",
        "ckptflow.tasks.credentials",
    }
    offending = [
        str(i)
        for i in package_imports("tasks")
        if i.where.startswith("tasks/training/")
        and (
            within(i.module, "prefect")
            or (
                within(i.module, "ckptflow.tasks")
                and not within(i.module, "ckptflow.tasks.training")
                and i.module not in allowed
                and f"{i.module}.{i.name}" not in allowed
            )
        )
    ]
    assert not offending, "\n".join(offending)


def test_reporting_imports_nothing_of_the_training_processes() -> None:
    offending = [
        str(i)
        for i in package_imports("tasks")
        if i.where.startswith("tasks/reporting/") and within(i.module, "ckptflow.tasks.training")
    ]
    assert not offending, "\n".join(offending)


def test_every_name_storage_exports_exists() -> None:
    missing = [name for name in ckptflow.storage.__all__ if not hasattr(ckptflow.storage, name)]
    assert missing == []


class TestTheCheckItself:
    """The check sees every kind of import; else the tests above could never fail."""

    SOURCE = (
        "import os\n"
        "from ckptflow.storage import CheckpointStore\n"
        "from . import config\n"
        "from ..storage.commit import list_dirs\n"
        "def f():\n"
        "    from ckptflow.storage.location import probe\n"
        "if TYPE_CHECKING:\n"
        "    import ckptflow.flows.cli\n"
    )

    def test_imports_are_found_and_resolved_in_functions_and_blocks(self) -> None:
        found = [(i.module, i.name) for i in imports_of(self.SOURCE, "ckptflow.tasks.mod", "tasks/mod.py")]
        assert sorted(found, key=str) == sorted(
            [
                ("os", None),
                ("ckptflow.storage", "CheckpointStore"),
                ("ckptflow.tasks", "config"),
                ("ckptflow.storage.commit", "list_dirs"),
                ("ckptflow.storage.location", "probe"),
                ("ckptflow.flows.cli", None),
            ],
            key=str,
        )

    def test_a_package_resolves_relative_imports_from_itself(self) -> None:
        [imp] = imports_of("from .store import X\n", "ckptflow.storage", "storage/__init__.py")
        assert (imp.module, imp.name) == ("ckptflow.storage.store", "X")

    def test_internals_are_refused_and_the_public_api_allowed(self) -> None:
        found = list(imports_of(self.SOURCE, "ckptflow.tasks.mod", "tasks/mod.py"))
        refused = [(i.module, i.name) for i in found if reaches_past_storage_api(i)]
        assert refused == [("ckptflow.storage.commit", "list_dirs"), ("ckptflow.storage.location", "probe")]
        assert reaches_past_storage_api(Import("x.py:1", "ckptflow.storage", "commit"))
        assert not reaches_past_storage_api(Import("x.py:1", "ckptflow.storage"))


def test_every_package_directory_is_listed_for_the_wheel() -> None:
    """Bug fix: storage/sharded was left out of pyproject's package list, so a wheel (any install
    but an editable one) had no ckptflow.storage.sharded and every DTensor save failed."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    mapped = {root / directory: package for package, directory in setuptools["package-dir"].items()}

    def package_of(directory: Path) -> str:
        """The package a directory installs as: its nearest mapped ancestor's name plus the rest."""
        for top in [directory, *directory.parents]:
            if top in mapped:
                return ".".join([mapped[top], *directory.relative_to(top).parts])
        raise AssertionError(f"{directory} is under no package-dir of pyproject")

    found = {
        package_of(directory)
        for top in ("storage", "tasks", "flows", "deployments")
        for directory in [root / top, *(root / top).rglob("*")]
        if directory.is_dir() and directory.name != "__pycache__" and any(directory.glob("*.py"))
    }
    assert found == listed
    # ckptflow itself is a namespace package (its directory holds only __main__.py)
    missing_init = [
        p for p in found - {"ckptflow"} if not (root / Path(*p.split(".")[1:]) / "__init__.py").exists()
    ]
    assert missing_init == []
