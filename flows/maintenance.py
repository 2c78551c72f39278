"""Flows that look after checkpoint stores between training runs.

``maintain_stores`` (deployment entrypoint ``flows/maintenance.py:maintain_stores``,
on a cron schedule in ``deployments/prefect.yaml``) runs the same sequence of
tasks on every store of its config:

    archive + upload ─► retention ─► gc (leftovers of interrupted saves) ─► publish (table + latest)

Archiving follows the same policy as in a training run (``archive.every`` /
``archive.target_bytes``, ``upload_to``, ``upload_versions``), over the loose
versions a store holds: stores written by runs that did not archive, or whose
archive jobs were cut off, are consolidated and mirrored here. A store that a
training run (or any writer holding the store's lease) is writing to is only
published. The steps that write or remove store files (tarballs, dropping loose
copies, retention, gc) run under the store's writer lease, each only for its own
span; uploads hold no lease, so a training run starting meanwhile is not refused:
then the steps after the upload are skipped and the store reported busy.
A URL where nothing is stored fails the run (a mistyped URL), unless the config
says ``skip_missing``, as the scheduled deployments do: their default store
appears only with the first training run there, and a user who trains
elsewhere would otherwise see a Failed run every night. Such a store is
skipped with a warning in the run's log, and the run completes.

``publish_store_checkpoints`` publishes one store's table, for
``ckptflow publish URL``: it is how to see a store's checkpoints in the UI
without a training run.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from ckptflow.tasks.archiving import ArchiveQueue, next_groups
from ckptflow.tasks.config import ArchiveConfig
from ckptflow.tasks.maintenance import (
    MaintenanceConfig,
    active_training_runs,
    apply_retention,
    collect_garbage,
    holding_store,
    maintained_store,
    open_maintained_store,
    publish_checkpoints,
)
from ckptflow.tasks.reporting.crashed import summarize_crashed_runs

NOT_THERE = "nothing is stored there yet"


@flow(name="ckptflow-maintenance", validate_parameters=True)
def maintain_stores(config: MaintenanceConfig) -> list[dict[str, Any]]:
    """Archive and upload what is due, apply retention, remove leftovers and publish each store's table."""
    logger = get_run_logger()
    source = f"maintenance run `{flow_run.get_name() or 'local'}`"
    owner = f"ckptflow maintenance (flow run {flow_run.get_name() or 'local'})"
    report = []
    for url in config.storages:
        store = maintained_store(config, url)
        if not store.probe(must_exist=not config.skip_missing):
            logger.warning(
                "%s: skipped, %s (a store appears with its first training run)", store.url, NOT_THERE
            )
            report.append(_skipped(store.url, NOT_THERE))
            continue
        busy = active_training_runs(store)
        if busy:
            logger.warning("%s is being written by %s: retention and gc skipped", store.url, ", ".join(busy))
            archives: list[Any] = []
            pruned: list[int] = []
            removed: list[int] = []
        else:
            holder, archives, pruned, removed = _upkeep(store, config, owner=owner)
            if holder is not None:
                logger.warning("%s is held by the writer %s: retention and gc skipped", store.url, holder)
                busy = [holder]
        artifacts = publish_checkpoints(store, source=source) if config.publish else {}
        summarized = _summarize_crashed(store) if config.publish else []
        if summarized:
            logger.info("%s: wrote the summaries of crashed runs %s", store.url, ", ".join(summarized))
        report.append(
            {
                "storage": store.url,
                "skipped": None,
                "busy": busy,
                "archived": [a.versions for a in archives],
                "uploaded": [a.uploaded for a in archives if a.uploaded],
                "pruned": pruned,
                "gc": removed,
                "versions": [v.version for v in store.versions()],
                "artifacts": sorted(artifacts),
                "crashed_runs_summarized": summarized,
            }
        )
        logger.info("%s: pruned %s, removed leftovers %s", store.url, pruned or "none", removed or "none")
    return report


def _skipped(url: str, why: str) -> dict[str, Any]:
    """The report of a store the run did not maintain, with the keys of one it did."""
    lists = (
        "busy",
        "archived",
        "uploaded",
        "pruned",
        "gc",
        "versions",
        "artifacts",
        "crashed_runs_summarized",
    )
    return {"storage": url, "skipped": why, **{key: [] for key in lists}}


def _summarize_crashed(store: Any) -> list[str]:
    """The summaries of the store's crashed runs; an API or store error leaves them to the next run."""
    try:
        return summarize_crashed_runs(store)
    except Exception as exc:
        get_run_logger().warning("%s: could not write the summaries of crashed runs: %s", store.url, exc)
        return []


def _upkeep(
    store: Any, config: MaintenanceConfig, *, owner: str
) -> tuple[str | None, list[Any], list[int], list[int]]:
    """Archive, upload, prune and collect: (holder, archive results, pruned, removed).

    The steps that write or remove store files hold the store's writer lease, each only for
    its own span; uploads, which may take long, hold nothing, so a training run may start
    meanwhile. Once another live writer holds the store, the rest is skipped and it is
    returned as the holder (what is left is the next maintenance run's).
    """
    archive = config.archive
    with holding_store(store, owner=owner) as holder:
        if holder is not None:
            return holder, [], [], []
        if not archive.upload_to:  # no upload: archiving only writes and removes store files
            return None, _drained(store, archive), *_remove(store, config)
        _write_tarballs(store, archive)
    archives = _drained(store, archive.model_copy(update={"keep_loose": True}))  # uploads, no lease
    with holding_store(store, owner=owner) as holder:
        if holder is not None:
            return holder, archives, [], []
        if not archive.keep_loose:  # their uploads are verified: the loose copies may go
            store.drop_loose(sorted({v for a in archives for v in a.versions}))
        return None, archives, *_remove(store, config)


def _remove(store: Any, config: MaintenanceConfig) -> tuple[list[int], list[int]]:
    """Retention and gc (the caller holds the store's lease): (pruned, removed)."""
    pruned = apply_retention(store, config.retention) if config.retention.enabled() else []
    removed = collect_garbage(store) if config.gc else []
    return pruned, removed


def _write_tarballs(store: Any, config: ArchiveConfig) -> None:
    """Write the tarball (and index) of each group the policy says is due, unless an earlier
    attempt committed it; their uploads and the loose copies' removal come later."""
    if not config.enabled():
        return
    archived = store.archived()
    loose = [v for v in store.versions() if not v.archived]
    for group in next_groups(loose, config, set()):
        tars = {archived[v].tar if v in archived else None for v in group}
        if len(tars) != 1 or None in tars:  # not yet one committed tarball
            store.archive(group)


def _drained(store: Any, config: ArchiveConfig) -> list[Any]:
    """The archive (and upload) jobs the policy says are due, run to the end."""
    if not (config.enabled() or config.mirrors_versions()):
        return []
    queue = ArchiveQueue(store, config, store.versions())
    queue.catch_up()
    return queue.drain()


@flow(name="ckptflow-publish", validate_parameters=True)
def publish_store_checkpoints(
    storage: str, storage_options: dict[str, Any] | None = None, storage_secret: str | None = None
) -> dict[str, Any]:
    """Publish one store's checkpoint table and latest checkpoint as artifacts (keys per store)."""
    config = MaintenanceConfig(
        storages=[storage], storage_options=storage_options or {}, storage_secret=storage_secret
    )
    store = open_maintained_store(config, storage)
    ids = publish_checkpoints(store, source=f"`ckptflow publish` (flow run `{flow_run.get_name()}`)")
    return {"storage": store.url, "versions": [v.version for v in store.versions()], "artifacts": ids}
