"""What users hand the command line as documents, read one bounded way: config files and JSON options.

``ckptflow run --config FILE`` (JSON, TOML or YAML), ``--spec-config JSON``,
``--storage-options JSON`` or ``@FILE``: each is read here, before anything is
started or written, and a bad one is a usage error (exit 2) in one line that
names the file or the option and what is wrong:

- a file is read only if it is a regular file (a FIFO or a device would block or
  never end), of at most :data:`MAX_BYTES`;
- a document nests at most :data:`~ckptflow.storage.format.manifest_checks.MAX_DOCUMENT_DEPTH`
  levels, and its numbers are finite (no ``NaN``, no ``Infinity``, no 5,000-digit integer);
- YAML's anchors and aliases may share a node, but the document they expand to has at
  most :data:`MAX_YAML_NODES` nodes (a "billion laughs" document is refused before it
  is built, not after it has taken the machine's memory).

The values are then the config's to check (ranges, types: :mod:`ckptflow.tasks.config`).
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

import typer

from ckptflow.tasks.config import value_problem

MAX_BYTES = 1 << 20  # a config or options file larger than this is no config
MAX_YAML_NODES = 100_000  # nodes of a YAML document once its aliases are expanded


class DocumentError(ValueError):
    """A document that is refused: the message says why, without the document's value."""


def read_file_text(path: str, *, option: str) -> str:
    """The text of the regular file ``path`` (at most MAX_BYTES); a usage error naming ``option``."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise typer.BadParameter(f"cannot read {path}: {exc.strerror or exc}", param_hint=option) from None
    if not stat.S_ISREG(info.st_mode):
        what = "a directory" if stat.S_ISDIR(info.st_mode) else "not a regular file (a pipe or a device?)"
        raise typer.BadParameter(f"{path} is {what}: give a file", param_hint=option)
    if info.st_size > MAX_BYTES:
        raise typer.BadParameter(
            f"{path} is {info.st_size:,} bytes, more than the {MAX_BYTES:,} a config may have",
            param_hint=option,
        )
    try:
        fd = os.open(
            path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)
        )  # replaced by a FIFO meanwhile: no wait
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_BYTES + 1)
        return data.decode()
    except UnicodeDecodeError:
        raise typer.BadParameter(f"{path} is not UTF-8 text", param_hint=option) from None
    except OSError as exc:
        raise typer.BadParameter(f"cannot read {path}: {exc.strerror or exc}", param_hint=option) from None


def parse_document(text: str, kind: str) -> Any:
    """``text`` parsed as ``kind`` (``json``, ``toml`` or ``yaml``) and checked (depth, numbers);
    DocumentError saying why it is refused, ImportError for a parser that is not installed."""
    try:
        if kind == "json":
            value = json.loads(text, parse_constant=_no_constant)
        elif kind == "toml":
            import sys

            if sys.version_info >= (3, 11):
                import tomllib
            else:  # pragma: no cover - Python 3.10
                import tomli as tomllib
            value = tomllib.loads(text)
        elif kind == "yaml":
            value = _yaml(text)
        else:
            raise DocumentError(f"unknown document kind {kind!r}")
    except DocumentError:
        raise
    except ImportError:
        raise
    except RecursionError:
        raise DocumentError("it is nested too deeply to be a config") from None
    except ValueError as exc:  # JSON's and TOML's own errors, and Python's limit on an integer's digits
        if "integer string conversion" in str(exc):
            raise DocumentError(
                "it holds an integer of thousands of digits: ckptflow takes 64-bit integers"
            ) from None
        raise DocumentError(_first_line(exc)) from None
    except Exception as exc:  # YAML's parser errors: where in the document, and why
        raise DocumentError(_first_line(exc)) from None
    problem = value_problem(value)  # the config's own check of any JSON value it holds
    if problem:
        raise DocumentError(problem)
    return value


def _no_constant(name: str) -> None:
    raise DocumentError(f"it holds {name}, which is no JSON number and no config value")


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:300]


def _yaml(text: str) -> Any:
    """YAML, its aliases bounded: the document is composed (a node graph, aliases shared), its size
    once expanded counted, and only then built."""
    import yaml

    node = yaml.compose(text, Loader=yaml.SafeLoader)
    if node is None:
        return None
    _check_expanded(node)
    loader = yaml.SafeLoader("")
    try:
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _check_expanded(root: Any) -> None:
    """Refuse a YAML node graph whose expansion (each alias a copy) exceeds MAX_YAML_NODES nodes, or
    that refers to itself. A post-order walk without recursion, each shared node sized once."""
    import yaml

    def children(node: Any) -> list[Any]:
        if isinstance(node, yaml.SequenceNode):
            return list(node.value)
        if isinstance(node, yaml.MappingNode):
            return [part for pair in node.value for part in pair]
        return []

    sizes: dict[int, int] = {}
    open_: set[int] = set()  # on the current path: met again, the document refers to itself
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            open_.discard(key)
            size = 1 + sum(sizes[id(child)] for child in children(node))
            if size > MAX_YAML_NODES:
                raise DocumentError(
                    f"its aliases expand to more than {MAX_YAML_NODES:,} values (a YAML bomb?): write "
                    "the config out without them"
                )
            sizes[key] = size
            continue
        if key in sizes:
            continue
        if key in open_:
            raise DocumentError("an alias refers to a node that holds it: a config is no recursive structure")
        open_.add(key)
        stack.append((node, True))
        stack += [(child, False) for child in children(node) if id(child) not in sizes]


def read_document_file(path: str, *, option: str) -> Any:
    """The document in the file ``path``, by its suffix (``.json``, ``.toml``, ``.yaml``, ``.yml``);
    a usage error naming the file and ``option``."""
    suffix = os.path.splitext(path)[1].lower()
    kind = {".json": "json", ".toml": "toml", ".yaml": "yaml", ".yml": "yaml"}.get(suffix)
    if kind is None:
        raise typer.BadParameter(f"{path}: give a .json, .toml, .yaml or .yml file", param_hint=option)
    text = read_file_text(path, option=option)
    try:
        return parse_document(text, kind)
    except ImportError as exc:  # tomllib before Python 3.11, without tomli; yaml without PyYAML
        raise typer.BadParameter(
            f"reading {path} needs {exc.name}: pip install {'tomli' if kind == 'toml' else 'pyyaml'}, "
            "or give the config as JSON",
            param_hint=option,
        ) from None
    except DocumentError as exc:
        raise typer.BadParameter(f"{path} is not valid {kind.upper()}: {exc}", param_hint=option) from None


def parse_json_option(text: str, *, option: str) -> Any:
    """A JSON option's value (``--spec-config``), checked as a document; a usage error naming it."""
    try:
        return parse_document(text, "json")
    except DocumentError as exc:
        raise typer.BadParameter(f"{option} is not valid JSON: {exc}") from None
