"""How the command line shows checkpoints: sizes, metrics, epochs, steps, times and tables.

Pure functions from storage objects (``VersionInfo``, ``Manifest``) to
strings, JSON-ready dicts and rich tables; nothing here touches storage, so
the CLI's commands stay short and these are easy to test. Every URL shown
comes from the store's ``display`` form, which carries no credentials.

Every version shows its epoch and global step. A save made inside an epoch
shows how far into it it was (``3 (1,200/4,000)``) in the words of
:func:`~ckptflow.tasks.reporting.formatting.epoch_text`, which the Prefect artifacts use
too; a save at an epoch's end shows the bare epoch, as before.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rich.table import Table

from ckptflow.tasks.reporting.formatting import epoch_text, human_size, metric_value, metrics_text, utc_text

if TYPE_CHECKING:
    from ckptflow.storage import (
        Manifest,
        PrunePlan,
        RetentionPolicy,
        StateDiff,
        StoresBelow,
        VersionDirectory,
        VersionInfo,
    )


def optional(value: object) -> str:
    return "-" if value is None else str(value)


def describe(info: VersionInfo) -> str:
    """One line about a version, for the commands that print a line per version."""
    step = f", step {info.step}" if info.step is not None else ""
    return f"version {info.version} (epoch {epoch_text(info)}{step}, {human_size(info.size)}) {info.url}"


def in_epoch_text(info: VersionInfo) -> str:
    """How far into its epoch a version was saved: ``1,200 of 4,000 steps`` (``1,200 steps`` when
    the epoch's length is unknown), or ``its end``; ``-`` when it records no epoch."""
    if info.epoch is None:
        return "-"
    steps, length = info.in_epoch, info.epoch_steps
    if steps is None:
        return "its end"
    return f"{steps:,} of {length:,} steps" if length is not None else f"{steps:,} steps"


def prune_lines(
    plan: PrunePlan, infos: dict[int, VersionInfo], *, dry_run: bool, policy: RetentionPolicy | None = None
) -> list[str]:
    """What a prune removed (or would remove), kept (the best by the metric first, with the policy's
    direction) and held back: the same lines for both modes."""
    verb, keep_verb, free_verb = (
        ("would remove", "would keep", "would free") if dry_run else ("removed", "kept", "freed")
    )
    lines = []
    if policy is not None and policy.keep_best is not None:
        metric = policy.keep_best
        best = ", ".join(
            f"version {v} (epoch {optional(info.epoch)}, {metric}={metric_value(info.metrics[metric])})"
            for v in plan.best
            if (info := infos.get(v)) is not None and metric in info.metrics
        )
        lines.append(f"{keep_verb} the best by {metric} ({policy.best_mode}): {best or 'none'}")
    lines += [f"{verb} {_removed(v, infos.get(v), plan, dry_run)}" for v in plan.remove]
    held = plan.describe_held()
    if held:
        lines.append(f"{'would also keep' if dry_run else 'also kept'} {held}")
    kept = ", ".join(str(v) for v in plan.remaining) or "none"
    # The bytes it removes (a dry run: would remove now): files a kept version references stay.
    freed = human_size(
        plan.freed if plan.freed is not None else sum(infos[v].new_bytes for v in plan.remove if v in infos)
    )
    lines.append(f"{keep_verb} versions: {kept}; {free_verb} {freed}")
    return lines


def _removed(version: int, info: VersionInfo | None, plan: PrunePlan, dry_run: bool) -> str:
    """A removed version's line: what it held, and, where less, what its removal frees: the files
    it references in older versions, and its own that kept versions reference, stay."""
    if info is None:
        return f"version {version}"
    freed = plan.freed_each.get(version)
    if freed is None or freed >= info.size:
        return describe(info)
    frees = "would free" if dry_run else "freed"
    step = f", step {info.step}" if info.step is not None else ""
    return (
        f"version {info.version} (epoch {epoch_text(info)}{step}, {human_size(info.size)}; {frees} "
        f"{human_size(freed)}, the rest is read by other versions) {info.url}"
    )


def misplaced_message(where: VersionDirectory | StoresBelow | None, url: str, *, command: str) -> str | None:
    """The error for ``ckptflow COMMAND URL`` on a version's directory or a directory of stores
    (None when URL is a store): where the store is, and the command to run on it."""
    from ckptflow.storage import VersionDirectory

    if where is None:
        return None
    if isinstance(where, VersionDirectory):
        which = f"version {where.version}" if where.version is not None else "a version"
        version = where.version if command in ("show", "verify", "restore") else None
        usage = _usage(command, where.store, version)
        return f"{url} is the directory of {which} of the store {where.store}, not a store: run `{usage}`"
    usage = _usage(command, where.stores[0], None)
    return (
        f"no store at {url}; it holds the stores {', '.join(where.stores)}: give one of them, e.g. `{usage}`"
    )


def _usage(command: str, store: str, version: int | None) -> str:
    """``ckptflow COMMAND STORE [--version V]``, and `` ...`` where the command needs more options."""
    text = f"ckptflow {command} {shlex.quote(store)}"
    text += f" --version {version}" if version is not None else ""
    return text + (" ..." if command in ("restore", "prune") else "")


def version_json(info: VersionInfo) -> dict[str, Any]:
    return {
        "version": info.version,
        "epoch": info.epoch,
        "step": info.step,
        "in_epoch": info.in_epoch,  # None for a save at an epoch's end
        "epoch_steps": info.epoch_steps,
        "size": info.size,
        "new_bytes": info.new_bytes,  # its own files; the rest of size is referenced in other versions
        "nbytes": info.nbytes,
        "created": info.created,
        "metrics": info.metrics,
        "url": info.url,
        "save_seconds": info.save_seconds,
        "archived": info.archived,
    }


def versions_table(infos: list[VersionInfo], *, store: str, tiers: dict[int, str] | None = None) -> Table:
    """The versions of ``store`` (printed above the table, whole), each one's place in it
    (``v000003``, or ``archive/<tar>[v000003]``), so that the table reads at 80 columns
    (``ls --json``: full URLs). ``new`` (the bytes a version's save wrote) is there only when a
    version references others' bytes; the place is then left out while every version is loose.
    ``tiers``: which tiers hold each version (``ls --durable``), a column of its own."""
    columns: list[tuple[str, Callable[[VersionInfo], str]]] = [
        ("version", lambda i: str(i.version)),
        ("epoch", epoch_text),
        ("step", lambda i: "" if i.step is None else str(i.step)),
        ("size", lambda i: human_size(i.size)),
    ]
    prefix = store.rstrip("/") + "/"

    def where(info: VersionInfo) -> str:
        return info.url[len(prefix) :] if info.url.startswith(prefix) else info.url

    shared = any(i.new_bytes != i.size for i in infos)
    if shared:
        columns.append(("new", lambda i: human_size(i.new_bytes)))
    if tiers is not None:
        columns.append(("tiers", lambda i: tiers.get(i.version, "")))
    table = Table()
    for name, _ in columns:
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("created (UTC)", no_wrap=True)
    table.add_column("metrics", overflow="fold")
    # Every version loose: its place is its number's directory. Left out beside ``new``, for room.
    placed = tiers is None and (not shared or any(where(i) != f"v{i.version:06d}" for i in infos))
    if placed:
        table.add_column("where", overflow="fold")
    for info in infos:
        table.add_row(
            *(cell(info) for _, cell in columns),
            utc_text(info.created, seconds=False, zone=False),  # to the minute: 2026-11-29 04:07
            metrics_text(info.metrics),
            *([where(info)] if placed else []),
        )
    return table


def summary_table(manifest: Manifest, url: str) -> Table:
    """The manifest's header fields as a two-column grid."""
    from ckptflow.storage import VersionInfo

    info = VersionInfo.from_manifest(manifest, url)
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column(overflow="fold")
    saved = manifest.user.get("save_seconds")
    rows = [
        ("version", f"{manifest.version}  {url}"),
        ("epoch", optional(manifest.epoch)),
        ("in epoch", in_epoch_text(info)),
        ("step", optional(manifest.step)),
        ("metrics", metrics_text(manifest.metrics) or "-"),
        ("created", utc_text(manifest.created)),
        (
            "size",
            f"{human_size(manifest.total_size)} on storage{_shared_text(manifest)}, "
            f"{human_size(manifest.nbytes)} of tensors, "
            f"{len(manifest.tensors) + len(manifest.chunked)} tensors in {len(manifest.shards)} shards",
        ),
        ("save time", f"{saved:.2f} s" if isinstance(saved, (int, float)) else "-"),
        ("ranks", _ranks_text(manifest)),
        ("format", f"{manifest.format} v{manifest.format_version}, checksums {manifest.checksum_algorithm}"),
        ("writer", ", ".join(f"{name} {ver}" for name, ver in manifest.writer.items()) or "-"),
        ("lineage", _lineage_text(info.lineage)),
    ]
    for label, value in rows:
        grid.add_row(label, value)
    return grid


def _shared_text(manifest: Manifest) -> str:
    """`` (12 KiB new, the rest in versions 0, 3)`` for a version that references others' bytes."""
    others = sorted({s.version for s in manifest.shards if s.version is not None})
    if not others:
        return ""
    return f" ({human_size(manifest.own_size)} new, the rest in version{'s' * (len(others) > 1)} " + (
        f"{', '.join(map(str, others))})"
    )


def _lineage_text(lineage: dict[str, Any]) -> str:
    """``parent 4, run <id>, spec <spec>, config <hash>, git <commit>`` (``-``: none recorded)."""
    parts = [f"parent {lineage['parent']}"] if "parent" in lineage else []
    parts += [f"{key} {lineage[key]}" for key in ("run", "spec") if key in lineage]
    if "config_hash" in lineage:
        parts.append(f"config {lineage['config_hash']}")
    parts += [f"{kind} {value}" for kind, value in lineage.get("code", {}).items()]
    return ", ".join(parts) or "-"


def _ranks_text(manifest: Manifest) -> str:
    if manifest.world_size == 1 and not manifest.ranks:
        return "1 process"
    own = "each with its own state" if manifest.ranks else "no per-rank state"
    return f"saved by {manifest.world_size} ranks ({own})"


def shards_table(manifest: Manifest) -> Table:
    table = Table(title="shards", title_justify="left")
    table.add_column("file")
    table.add_column("rank", justify="right")
    table.add_column("size", justify="right", no_wrap=True)
    table.add_column("checksum", overflow="fold")
    for shard, (where, file) in zip(manifest.shards, manifest.shard_files(), strict=True):
        name = file if shard.version is None else f"{where}/{file}"  # another version's file
        table.add_row(name, str(shard.rank), human_size(shard.size), shard.checksum)
    return table


def tensors_table(manifest: Manifest) -> Table:
    table = Table(title="tensors", title_justify="left")
    table.add_column("key path", overflow="fold")
    table.add_column("dtype")
    table.add_column("shape")
    table.add_column("size", justify="right", no_wrap=True)
    for tensor in manifest.tensors:
        size = tensor.nbytes
        shown = "?" if size is None else human_size(size)
        table.add_row(tensor.path, tensor.dtype, str(tuple(tensor.shape)), shown)
    for chunked in manifest.chunked:  # a sharded save: each stored as the chunks its ranks held
        chunks = len(chunked.chunks)
        shape = f"{tuple(chunked.shape)} in {chunks} chunk{'s' if chunks != 1 else ''}"
        table.add_row(chunked.path, chunked.dtype, shape, human_size(chunked.nbytes))
    return table


def _facts_text(facts: Any) -> str:
    return f"{facts.dtype} {tuple(facts.shape)}"


def _change_text(change: Any) -> str:
    """A changed tensor's dtype and shape: both sides' where they differ."""
    if change.before is None or change.after is None:
        return _facts_text(change.before or change.after)
    if change.kind == "values":
        return _facts_text(change.after)
    return f"{_facts_text(change.before)} -> {_facts_text(change.after)}"


def _value_text(change: Any) -> str:
    if change.kind == "added":
        return repr(change.after)
    if change.kind == "removed":
        return repr(change.before)
    return f"{change.before!r} -> {change.after!r}"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def diff_summary(result: StateDiff) -> str:
    """One line: how many tensors changed in which way, and their bytes."""
    counts = [
        f"{result.count(kind)} {kind if kind in ('added', 'removed') else 'changed in ' + kind}"
        for kind in ("added", "removed", "dtype", "shape", "values")
        if result.count(kind)
    ]
    changed = ", ".join(counts) if counts else "no tensor changed"
    others = f"; {len(result.values)} other value(s) changed" if result.values else ""
    return (
        f"{changed} ({human_size(result.changed_bytes)} new or changed); "
        f"{result.unchanged} unchanged ({human_size(result.unchanged_bytes)}){others}"
    )


def diff_table(result: StateDiff) -> Table:
    """The tensors that changed, then the other values; with values compared, how much."""
    table = Table()
    table.add_column("key path", overflow="fold")
    table.add_column("change")
    table.add_column("dtype, shape / value", overflow="fold")
    table.add_column("size", justify="right", no_wrap=True)
    if result.compared_values:
        table.add_column("bytes differing", justify="right")
        table.add_column("max |diff|", justify="right")
        table.add_column("rel. norm", justify="right")
    for change in result.changes:
        row = [change.path, change.kind, _change_text(change), human_size(change.nbytes)]
        if result.compared_values:
            differing = change.differing_bytes
            row += ["-" if differing is None else f"{differing:,}", _number(change.max_abs)]
            row.append(_number(change.rel_norm))
        table.add_row(*row)
    for value in result.values:
        row = [value.path, f"value {value.kind}", _value_text(value), ""]
        table.add_row(*(row + (["", "", ""] if result.compared_values else [])))
    return table


def lineage_notes(infos: list[VersionInfo]) -> dict[int, str]:
    """What the chain of versions says at each one, oldest first: where it starts anew, forks
    from an older version (a run resumed from it), or changes its config or run."""
    by_version = {i.version: i for i in infos}
    notes: dict[int, str] = {}
    previous: VersionInfo | None = None
    for info in infos:
        parent = info.parent
        said: list[str] = []
        if parent is None:
            if previous is not None:
                said.append("a new start (no parent)")
        elif parent not in by_version:
            said.append(f"from version {parent}, which is no longer in the store")
        elif previous is not None and parent != previous.version:
            skipped = [v for v in by_version if parent < v < info.version]
            said.append(
                f"fork: from version {parent}" + (f", not {_versions_text(skipped)}" if skipped else "")
            )
        source = by_version.get(parent) if parent is not None else None
        if source is not None:
            mine, theirs = info.lineage.get("config_hash"), source.lineage.get("config_hash")
            if mine and theirs and mine != theirs:
                said.append("config changed")
            if info.lineage.get("run") and source.lineage.get("run") not in (None, info.lineage.get("run")):
                said.append("a new run")
        if said:
            notes[info.version] = "; ".join(said)
        previous = info
    return notes


def _versions_text(versions: list[int]) -> str:
    shown = ", ".join(str(v) for v in versions[:5])
    return f"{shown}{', ...' if len(versions) > 5 else ''}"


def log_table(infos: list[VersionInfo]) -> Table:
    """Each version with its parent, run, code and what the chain says at it."""
    notes = lineage_notes(infos)
    table = Table()
    table.add_column("version", justify="right")
    table.add_column("epoch", justify="right")
    table.add_column("step", justify="right")
    table.add_column("parent", justify="right")
    table.add_column("run")
    table.add_column("code")
    table.add_column("note", overflow="fold")
    for info in infos:
        run = info.lineage.get("run")
        code = info.lineage.get("code", {}).get("git")
        table.add_row(
            str(info.version),
            epoch_text(info),
            optional(info.step),
            optional(info.parent),
            run[:8] if run else "-",
            code[:10] if code else "-",
            notes.get(info.version, ""),
        )
    return table
