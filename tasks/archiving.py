"""Archive and upload, as pipeline policy and Prefect tasks.

Policy (pure): which committed versions to consolidate next, every K epochs or
once the loose checkpoints reach a size. Mechanism lives in ckptflow.storage:
``CheckpointStore.archive`` writes a tarball and its index, ``upload_file``
moves and verifies bytes, ``drop_loose`` removes loose copies.

``archive_versions`` runs in the background (submitted to the flow's task
runner while training goes on; the flow keeps at most ``max_pending`` such
jobs queued and drains them before it exits). Its order keeps every
committed version loadable at every instant: tarball and index, then the
upload verified (when configured), then the loose files removed. Re-running
it after a crash picks up where it stopped: a committed tarball is reused,
a verified remote copy is skipped.

With ``upload_to``, every committed version also goes up as it commits
(``upload_versions``, on unless set false), so the mirror holds the newest
versions and not only the archived ones. A job that fails after its retries
does not stop training: the queue records it, queues no further job in this
run (the next run picks the work up) and the flow reports it at the end, with
the versions the mirror lacks (:mod:`.mirroring`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from prefect import get_run_logger

from ckptflow.storage import CheckpointStore, VersionInfo
from ckptflow.storage.archiving import archive_location, list_archived
from ckptflow.storage.commit import MANIFEST_FILE, list_dirs, version_dir
from ckptflow.storage.errors import CheckpointError
from ckptflow.storage.location import open_location, redact
from ckptflow.storage.tarindex import TarIndex, index_name, read_index

from .config import ArchiveConfig
from .credentials import with_secret
from .mirroring import MirrorStatus, check_mirror, mirrored_versions, version_ranges
from .retrying import io_task

if TYPE_CHECKING:
    from ckptflow.storage.transfer import TransferResult


def next_groups(loose: list[VersionInfo], config: ArchiveConfig, busy: set[int]) -> list[list[int]]:
    """Groups of loose committed versions to archive now, oldest first (``busy``: already queued)."""
    free = sorted((v for v in loose if v.version not in busy), key=lambda v: v.version)
    groups: list[list[int]] = []
    group: list[VersionInfo] = []
    for info in free:
        group.append(info)
        full_count = config.every is not None and len(group) >= config.every
        full_size = config.target_bytes is not None and sum(v.size for v in group) >= config.target_bytes
        if full_count or full_size:
            groups.append([v.version for v in group])
            group = []
    return groups


@dataclass(frozen=True)
class _Job:
    future: Any  # a PrefectFuture
    versions: list[int]
    archives: bool  # an archive job (else the upload of one loose version)


@dataclass(frozen=True)
class ArchiveResult:
    tar: str  # URL of the tarball in the store
    versions: list[int]
    size: int
    uploaded: str | None  # URL of the verified remote copy
    dropped: list[int]  # versions whose loose files were removed


def upload_file(local_path: str, url: str, *, storage_options: dict[str, Any]) -> TransferResult:
    """:func:`ckptflow.storage.transfer.upload_file`, imported at the first upload: its S3 client
    (aiohttp, aiobotocore) takes 0.2 s to import, which every run would otherwise wait for."""
    from ckptflow.storage.transfer import upload_file as upload

    return upload(local_path, url, storage_options=storage_options)


def upload_target(config: ArchiveConfig) -> tuple[str, dict[str, Any]] | None:
    if not config.upload_to:
        return None
    options = with_secret(config.upload_options, config.upload_secret)
    if config.upload_to.startswith(("s3://", "s3a://")):
        from ckptflow.storage.transfer import TransferOptions, s3_storage_options

        options = s3_storage_options(options, TransferOptions())
    return config.upload_to.rstrip("/"), options


@io_task("archive_versions", backoff=2)
def archive_versions(store: CheckpointStore, versions: list[int], config: ArchiveConfig) -> ArchiveResult:
    """Consolidate ``versions`` into a tarball, upload it when configured, then drop the loose files."""
    logger = get_run_logger()
    index = _archive_once(store, versions)
    aloc = archive_location(store.loc)
    uploaded = None
    target = upload_target(config)
    if target is not None:
        uploaded = _upload_archive(store, index, *target)
        logger.info("uploaded %s (%d bytes) to %s", index.tar, index.size, uploaded)
    dropped = [] if config.keep_loose else store.drop_loose(versions)
    logger.info("archived versions %s into %s", versions, aloc.display(index.tar))
    return ArchiveResult(aloc.display(index.tar), versions, index.size, uploaded, dropped)


@io_task("upload_version", backoff=2)
def upload_version(store: CheckpointStore, version: int, config: ArchiveConfig) -> str:
    """Mirror one committed loose version: shards first, its manifest last (the remote commit)."""
    target = upload_target(config)
    if target is None:
        raise ValueError("upload_version needs archive.upload_to")
    url, options = target
    _require_local(store)
    manifest = store.manifest(version)
    vdir = version_dir(version)
    for name in [s.file for s in manifest.shards] + [MANIFEST_FILE]:
        upload_file(store.loc.path(vdir, name), f"{url}/{vdir}/{name}", storage_options=options)
    return f"{url}/{vdir}"


def _archive_once(store: CheckpointStore, versions: list[int]) -> TarIndex:
    """The tarball of ``versions``: found committed by an earlier attempt, or written now."""
    archived = list_archived(store.loc)
    if all(v in archived for v in versions) and len({archived[v].tar for v in versions}) == 1:
        return archived[versions[0]].index
    return store.archive(versions)


def _upload_archive(store: CheckpointStore, index: TarIndex, url: str, options: dict[str, Any]) -> str:
    """Upload the tarball, then its index (the remote commit): the mirror is a store of its own."""
    _require_local(store)
    aloc = archive_location(store.loc)
    remote = f"{url}/archive"
    upload_file(aloc.path(index.tar), f"{remote}/{index.tar}", storage_options=options)
    upload_file(
        aloc.path(index_name(index.tar)), f"{remote}/{index_name(index.tar)}", storage_options=options
    )
    read_index(aloc, index.tar)  # still committed here, after the upload
    return f"{remote}/{index.tar}"


def _require_local(store: CheckpointStore) -> None:
    if not store.loc.is_local or not os.path.isdir(store.loc.root):
        raise CheckpointError(
            f"uploads copy from a local store; {store.url} is not one (write archives there directly)"
        )


class ArchiveQueue:
    """Background archive (and upload) jobs of one flow run: bounded, drained at exit.

    Jobs go to the flow's task runner (threads) with ``.submit``, so they show in
    the Prefect UI as task runs with retries while training continues. At most
    ``max_pending`` are queued: a commit that would queue more waits for the
    oldest first, so archiving cannot fall ever further behind.
    """

    def __init__(
        self,
        store: CheckpointStore,
        config: ArchiveConfig,
        existing: list[VersionInfo],
        on_result: Callable[[ArchiveResult], None] | None = None,
    ) -> None:
        self.store = store
        self.config = config
        self.on_result = on_result
        # A version in a committed tarball whose loose copy is still there is done when the
        # copies are kept on purpose and nothing is uploaded; else its job was cut off: redo it
        # (the tarball is reused, a verified upload skipped).
        done = (
            set(list_archived(store.loc))
            if existing and config.keep_loose and not config.upload_to
            else set()
        )
        self.loose = [v for v in existing if not v.archived and v.version not in done]
        self.pending: list[_Job] = []
        self.busy: set[int] = set()
        self.results: list[ArchiveResult] = []
        self.uploads: dict[int, Any] = {}  # version -> its upload job, until an archive job waits for it
        self.mirrored: set[int] = set()  # versions whose upload this run verified
        self.failures: list[str] = []  # "what failed: why", one per failed job
        self.started = False

    def committed(self, info: VersionInfo) -> None:
        """Note a new commit; queue whatever the policy says is due."""
        self.loose.append(info)
        if self.config.mirrors_versions() and not self.failures:
            self._upload(info.version)
        self.catch_up()

    def catch_up(self) -> None:
        """Queue the groups the policy says are due; at start also what an interrupted run left.

        That is: groups it did not archive, and loose versions the mirror lacks (``upload_versions``).
        After a failed job nothing more is queued: the next run starts over from what is committed.
        """
        if self.failures:
            return
        if not self.started:
            self.started = True
            for version in self._not_mirrored():
                self._upload(version)
        if not self.config.enabled():
            return
        for group in next_groups(self.loose, self.config, self.busy):
            # the upload of a loose version reads its files: they may go only once it is done
            uploads = [self.uploads.pop(v) for v in group if v in self.uploads]
            start = partial(archive_versions.submit, self.store, group, self.config, wait_for=uploads)
            self._submit(start, group)

    def _upload(self, version: int) -> None:
        start = partial(upload_version.submit, self.store, version, self.config)
        future = self._submit(start, [version], archives=False)
        if self.config.enabled():
            self.uploads[version] = future

    def _not_mirrored(self) -> list[int]:
        """Loose versions without a manifest on the remote (their upload was cut off, or never ran)."""
        target = upload_target(self.config) if self.config.mirrors_versions() else None
        if target is None or not self.loose:
            return []
        try:
            mirrored = {v for v, has_manifest in list_dirs(open_location(*target)).items() if has_manifest}
        except Exception as exc:  # upload them all: a verified copy is skipped
            log = get_run_logger()
            log.warning("could not list %s (%s): checking every loose version", redact(target[0]), exc)
            mirrored = set()
        return [v.version for v in self.loose if v.version not in mirrored]

    def _submit(self, start: Callable[[], Any], versions: list[int], *, archives: bool = True) -> Any:
        """Start a job once fewer than ``max_pending`` are queued (waiting for the oldest if need be)."""
        while len(self.pending) >= self.config.max_pending:
            self._finish(self.pending.pop(0))
        if archives:
            self.busy.update(versions)
        future = start()
        self.pending.append(_Job(future, versions, archives))
        return future

    def _finish(self, job: _Job) -> None:
        """Collect a job's outcome; a failure (after its retries) is recorded, not raised."""
        try:
            result = job.future.result()
        except Exception as exc:
            what = "archive of versions" if job.archives else "upload of version"
            why = " ".join(str(exc).split()) or type(exc).__name__
            self.failures.append(f"{what} {version_ranges(job.versions)} failed: {why}")
            return  # an archive job's versions stay busy: no other job takes them in this run
        if not job.archives:
            self.mirrored.update(job.versions)
            return
        self.busy.difference_update(job.versions)
        if isinstance(result, ArchiveResult):
            self.loose = [v for v in self.loose if v.version not in result.versions]
            self.results.append(result)
            if result.uploaded:
                self.mirrored.update(result.versions)
            if self.on_result is not None:
                self.on_result(result)

    def drain(self, *, strict: bool = True) -> list[ArchiveResult]:
        """Wait for every queued job (the flow's clean shutdown); return the archive results.

        ``strict``: raise if a job failed; else the caller reports :attr:`failures`.
        """
        while self.pending:
            self._finish(self.pending.pop(0))
        if strict and self.failures:
            raise CheckpointError("; ".join(self.failures))
        return self.results

    def mirror_status(self) -> MirrorStatus | None:
        """What ``upload_to`` lacks of the store's committed versions (None without a target)."""
        if self.config.upload_to is None:
            return None
        url = self.config.upload_to.rstrip("/")

        def held() -> set[int]:  # its credential block, its endpoint: any of it may fail
            _, options = upload_target(self.config) or (url, {})
            return mirrored_versions(url, options)

        return check_mirror(
            self.store, url, held, config=self.config, confirmed=self.mirrored, failures=self.failures
        )

    def abandon(self) -> None:
        """On an interrupted run: wait for queued jobs to end, without raising their errors."""
        for job in self.pending:
            job.future.wait()  # a PrefectFuture's wait() does not raise the task's error
        self.pending.clear()
