"""What `ckptflow run` checks before Prefect starts: the spec exists and the store can be used.

A mistyped ``--spec`` or storage URL, a missing bucket, missing or refused
credentials, an unreachable endpoint and a resumed run whose identity changed
fail here, within seconds, with one line: before a temporary API server starts
or a flow run exists. Nothing here imports Prefect, and nothing imports torch
unless the spec has to be imported to be judged.

The spec is first judged from its source, without running it: the module must
be found where the training process will look (the current directory first,
as ``python -m`` puts it there), and the module's top level must bind the
class's name. A module with no way to make names at run time (a star import,
``globals()``, ``setattr``, ``exec``, a module ``__getattr__``) that does not
bind it surely lacks it. When the source cannot tell, the spec is imported: by the training process, which
imports torch anyway (:func:`ckptflow.tasks.training.trainer.spec_check`), or here.
Either way, ``ckptflow run`` waits for the training process's verdict before it
creates the flow run (:func:`wait_for_spec`).

The store is listed once with bounded connection attempts. With a credentials
block (``--storage-secret``) only the URL's scheme is checked: reading the
block needs Prefect.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import os
import sys
from typing import Any

from ckptflow.tasks.config import PipelineConfig
from ckptflow.tasks.spec import SpecError, load_spec_class


def spec_defined(path: str) -> bool:
    """Whether ``"package.module:Class"`` is surely there, judged from the module's source.

    Raises SpecError when the module cannot be found or surely lacks the name. False: only
    importing it can tell.
    """
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise SpecError(f"spec {path!r} must look like 'package.module:ClassName'")
    sys.path.insert(0, os.getcwd())  # where `python -m` (the training process, the ranks) looks first
    try:
        found = importlib.util.find_spec(module_name)
    except ModuleNotFoundError as exc:  # a parent package is missing
        raise _no_module(path, exc.name or module_name) from exc
    except Exception as exc:  # a parent package fails to import
        raise SpecError(f"cannot import the module of spec {path!r}: {type(exc).__name__}: {exc}") from exc
    finally:
        sys.path.remove(os.getcwd())
    if found is None:
        raise _no_module(path, module_name)
    if found.origin is None or not found.origin.endswith(".py"):
        return False
    try:
        with open(found.origin, encoding="utf-8") as f:
            source = f.read()
        tree = ast.parse(source)
    except (OSError, SyntaxError, ValueError):
        return False  # importing it reports what is wrong
    name = attr.split(".")[0]
    if _binds(tree, name):
        return True
    if any(word in source for word in _DYNAMIC) or _star_import(tree):
        return False
    classes = sorted(n.name for n in tree.body if isinstance(n, ast.ClassDef))
    raise SpecError(
        f"module {module_name!r} ({found.origin}) has no attribute {name!r} (spec {path!r}); "
        f"its classes: {', '.join(classes) or 'none'}"
    )


_DYNAMIC = ("globals(", "vars(", "locals(", "setattr(", "exec(", "sys.modules", "__getattr__", "__dict__")


def _no_module(path: str, name: str) -> SpecError:
    return SpecError(
        f"cannot import the module of spec {path!r}: no module named {name!r} here or on sys.path; "
        "check the spelling, and run from the directory that holds it (or install it)"
    )


def _star_import(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.ImportFrom) and any(a.name == "*" for a in n.names) for n in ast.walk(tree))


def _binds(tree: ast.Module, name: str) -> bool:
    """Whether the module's top level (outside functions and classes) binds ``name``."""
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            if node.name == name:
                return True
            continue
        if isinstance(node, ast.Lambda):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name.split(".")[0]) == name for a in node.names):
                return True
            continue
        if isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Store):
            return True
        stack.extend(ast.iter_child_nodes(node))
    return False


def check_store(config: PipelineConfig) -> None:
    """List the run's store (bounded attempts); refuse a resumed run whose identity changed."""
    from ckptflow.storage import CheckpointStore, quick_answer_options
    from ckptflow.tasks.training.run_state import check_durable_run, check_run_identity, nothing_to_resume

    if config.storage_secret is not None:
        # opening it checks the scheme; listing it needs the credentials, from Prefect
        CheckpointStore(config.storage, storage_options=config.storage_options)
        return
    options = quick_answer_options(config.storage, config.storage_options)
    store = CheckpointStore(config.storage, storage_options=options)
    if store.probe(must_exist=False):
        store.refuse_if_held()  # another live run holds the store: say so before Prefect starts
        check_run_identity(store, config, lambda message: None)  # the build logs the warning
    target = config.archive.upload_to
    if target and config.archive.upload_secret is None:  # the secret's credentials need Prefect
        from ckptflow.storage import StorageUnavailableError

        # another store's mirror is refused now; one that does not answer, by the run's uploads
        with contextlib.suppress(StorageUnavailableError):
            options = quick_answer_options(target, config.archive.upload_options)
            store.check_mirror(target, storage_options=options)
        with contextlib.suppress(StorageUnavailableError):  # a durable tier holding another run
            durable = CheckpointStore(target, storage_options=options)
            check_durable_run(store, durable, config, lambda message: None)
    if config.resume_only and store.latest() is None and not _durable_holds(config):
        raise nothing_to_resume(store.url)


def _durable_holds(config: PipelineConfig) -> bool:
    """Whether ``upload_to`` holds a committed version (False when it cannot be read now)."""
    from ckptflow.storage import quick_answer_options
    from ckptflow.tasks.reporting.mirroring import holds_versions

    target = config.archive.upload_to
    if not target or config.archive.upload_secret is not None:
        return bool(target)  # the secret's credentials need Prefect: the run finds out
    return holds_versions(target, quick_answer_options(target, config.archive.upload_options))


def may_fetch(config: PipelineConfig) -> bool:
    """Whether the run may begin by fetching its newest version from the durable tier: it has one
    (``upload_to``) and the store holds no committed version (a new machine, a wiped disk). The
    training processes then start once it has (started before, they would build twice)."""
    from ckptflow.storage import CheckpointStore

    if not config.archive.upload_to:
        return False
    try:
        return CheckpointStore(config.storage, storage_options=config.storage_options).latest() is None
    except Exception:
        return False


def import_spec(config: PipelineConfig) -> None:
    """Import the spec: the training process's verdict if one is on its way, else here."""
    from ckptflow.tasks.training.trainer import spec_check

    pending = spec_check()
    if pending is not None:
        pending.result()
    else:
        load_spec_class(config.spec)


def wait_for_spec() -> Any:
    """The training process's verdict on the spec (it raises what the process raised), if it has one."""
    from ckptflow.tasks.training.trainer import spec_check

    pending = spec_check()
    return pending.result() if pending is not None else None
