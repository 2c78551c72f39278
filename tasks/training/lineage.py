"""What a pipeline save records of where it came from: the run, the spec, its config and code.

The store itself records the parent (the version the run resumed from, then each save's
predecessor); this adds what only the pipeline knows. Nothing here imports Prefect: the flow
run's id reaches the trainers through their environment.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from pathlib import Path

from ckptflow.storage import Lineage

from ..config import PipelineConfig
from .childenv import FLOW_RUN_ENV


def run_lineage(config: PipelineConfig) -> Lineage:
    """The lineage of a save of this run (all but the parent, which the store fills in)."""
    commit = code_commit(config.spec.partition(":")[0])
    return Lineage(
        spec=config.spec,
        config_hash=config_hash(config),
        run=os.environ.get(FLOW_RUN_ENV)
        or None,  # the flow's run: set by the rank worker and the in-process trainer
        code={"git": commit} if commit else {},
    )


def config_hash(config: PipelineConfig) -> str:
    """The xxh3 of the run's identity (spec, its config, seed) as canonical JSON: equal for runs
    that may resume each other's checkpoints."""
    import xxhash

    text = json.dumps(config.identity(), sort_keys=True, separators=(",", ":"), default=str)
    return xxhash.xxh3_64_hexdigest(text.encode())


@functools.cache
def code_commit(module: str) -> str | None:
    """The git commit checked out where ``module``'s source lives, read from the repository's own
    files (no git needed); None outside a repository, or for a module that cannot be found."""
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if found is None or not found.origin or not os.path.isfile(found.origin):
        return None
    for directory in Path(found.origin).resolve().parents:
        dot_git = directory / ".git"
        if dot_git.exists():
            return _head_commit(dot_git)
    return None


def _head_commit(dot_git: Path) -> str | None:
    try:
        if dot_git.is_file():  # a worktree or submodule: "gitdir: <path>"
            text = dot_git.read_text().strip()
            if not text.startswith("gitdir:"):
                return None
            dot_git = (dot_git.parent / text.partition(":")[2].strip()).resolve()
        head = (dot_git / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head if _is_commit(head) else None  # a detached HEAD
        ref = head.partition(":")[2].strip()
        for base in (dot_git, _common_dir(dot_git)):
            loose = base / ref
            if loose.is_file():
                commit = loose.read_text().strip()
                return commit if _is_commit(commit) else None
            packed = base / "packed-refs"
            if packed.is_file():
                for line in packed.read_text().splitlines():
                    commit, _, name = line.partition(" ")
                    if name == ref and _is_commit(commit):
                        return commit
    except OSError:
        return None
    return None


def _common_dir(dot_git: Path) -> Path:
    common = dot_git / "commondir"
    if common.is_file():
        return (dot_git / common.read_text().strip()).resolve()
    return dot_git


def _is_commit(text: str) -> bool:
    return len(text) in (40, 64) and all(c in "0123456789abcdef" for c in text)
