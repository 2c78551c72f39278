"""Archive and upload, as pipeline policy and Prefect tasks.

Policy (pure): which committed versions to consolidate next, every K epochs or
once the loose checkpoints reach a size. Mechanism lives in ckptflow.storage:
``CheckpointStore.archive`` writes a tarball and its index, ``mirror_archive``
and ``mirror_version`` upload and verify them (committed last on the mirror),
``drop_loose`` removes loose copies.

``archive_versions`` runs in the background (submitted to the flow's task
runner while training goes on). At most ``max_pending`` jobs run at once; what
is due beyond that waits its turn in the queue, never in a commit, so a slow
or silent upload target cannot hold training up. The flow drains the queue
before it exits. Its order keeps every
committed version loadable at every instant: tarball and index, then the
upload verified (when configured), then the loose files removed (on an object
store, but the newest committed version's, which the next save may reference:
the next job removes them). Re-running
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

import dataclasses
import json
import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from prefect import get_run_logger

from ckptflow.storage import (
    FAST_TIER_FILE,
    CheckpointError,
    CheckpointStore,
    Fetched,
    TarIndex,
    VersionInfo,
    redact,
    upload_storage_options,
)

from .config import ArchiveConfig, PipelineConfig
from .credentials import with_secret
from .reporting.formatting import human_size
from .reporting.mirroring import MirrorStatus, check_mirror, holds_versions, mirrored_versions, version_ranges
from .retrying import io_task
from .training.run_state import ConfigMismatchError, check_durable_run


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
    ended: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.future.add_done_callback(lambda _: self.ended.set())


@dataclass(frozen=True)
class ArchiveResult:
    tar: str  # URL of the tarball in the store
    versions: list[int]
    size: int
    uploaded: str | None  # URL of the verified remote copy
    dropped: list[int]  # versions whose loose files were removed


def _droppable(store: CheckpointStore, versions: list[int]) -> list[int]:
    """The archived versions whose loose copies go now. On an object store, all but the newest
    committed version's, which the save in flight in the training processes may reference
    (content-addressed saves reference the files of the version they continue, and those it
    references) and which no fence keeps from being swept between that save's check and its
    commit there; the next job drops it. On a local disk, all (the fence keeps them apart)."""
    if store.fences_commits:
        return versions
    newest = store.latest()
    return [v for v in versions if newest is None or v != newest.version]


def upload_target(config: ArchiveConfig) -> tuple[str, dict[str, Any]] | None:
    """``upload_to`` and its fsspec options: on S3 with timeouts and bounded attempts (those set
    in ``upload_options``' ``config_kwargs`` win), so a silent target fails a job in bounded time."""
    if not config.upload_to:
        return None
    options = with_secret(config.upload_options, config.upload_secret)
    return config.upload_to.rstrip("/"), upload_storage_options(config.upload_to, options)


@io_task("archive_versions", backoff=2)
def archive_versions(store: CheckpointStore, versions: list[int], config: ArchiveConfig) -> ArchiveResult:
    """Consolidate ``versions`` into a tarball, upload it when configured, then drop the loose files."""
    logger = get_run_logger()
    index = _archive_once(store, versions)
    uploaded = None
    target = upload_target(config)
    if target is not None:
        url, options = target
        uploaded = store.mirror_archive(index.tar, url, storage_options=options)
        logger.info("uploaded %s (%d bytes) to %s", index.tar, index.size, uploaded)
    dropped = [] if config.keep_loose else store.drop_loose(_droppable(store, versions))
    logger.info("archived versions %s into %s", versions, store.tarball_url(index.tar))
    return ArchiveResult(store.tarball_url(index.tar), versions, index.size, uploaded, dropped)


@io_task("upload_version", backoff=2)
def upload_version(store: CheckpointStore, version: int, config: ArchiveConfig) -> str:
    """Mirror one committed loose version: shards first, its manifest last (the remote commit)."""
    target = upload_target(config)
    if target is None:
        raise ValueError("upload_version needs archive.upload_to")
    url, options = target
    note_fast_tier(url, options, version)
    return store.mirror_version(version, url, storage_options=options)


def note_fast_tier(url: str, options: dict[str, Any], version: int) -> None:
    """Record on the durable tier that the fast tier committed ``version`` (before it goes up):
    a run that loses the fast tier then names the versions that were only there."""
    key = (url, json.dumps(options, sort_keys=True, default=str))
    if _noted.get(key, -1) >= version:  # this process noted it: no read of the note per upload
        return
    durable = CheckpointStore(url, storage_options=options)
    noted = durable.read_json(FAST_TIER_FILE) or {}
    if isinstance(noted, dict) and isinstance(noted.get("newest"), int) and noted["newest"] >= version:
        _noted[key] = noted["newest"]
        return
    durable.write_json(FAST_TIER_FILE, {"newest": version, "host": socket.gethostname()})
    _noted[key] = version


_noted: dict[tuple[str, str], int] = {}  # (durable tier, its options) -> the newest version noted there


def lost_versions(url: str, options: dict[str, Any], fetched: int) -> list[int]:
    """The versions newer than ``fetched`` that the lost fast tier had committed (from its note)."""
    noted = CheckpointStore(url, storage_options=options).read_json(FAST_TIER_FILE)
    newest = noted.get("newest") if isinstance(noted, dict) else None
    return list(range(fetched + 1, newest + 1)) if isinstance(newest, int) else []


def fetch_from_durable(store: CheckpointStore, config: PipelineConfig) -> Fetched | None:
    """Before a run builds anything: bring the durable tier's (``upload_to``'s) newest version into
    the store when it is newer than the store's newest (a new machine, a wiped fast tier), so the
    run resumes from it. The caller holds the store's writer lease.

    A durable tier that cannot be read is tolerated when the store holds versions of its own (the
    run resumes from those, with a warning); with an empty store it fails the run: starting over
    beside a durable tier that may hold the run's checkpoints would lose them."""
    target = upload_target(config.archive)
    if target is None:
        return None
    url, options = target
    logger = get_run_logger()
    try:
        check_durable_run(store, CheckpointStore(url, storage_options=options), config, logger.warning)
        # with versions of its own, a run waits for one attempt only: a silent tier holds it up little
        retries = 2 if store.latest() is None else 0
        fetched = _fetch.with_options(task_run_name="fetch_from_durable", retries=retries)(
            store, url, options
        )
    except ConfigMismatchError:
        raise
    except Exception as exc:
        why = " ".join(str(exc).split()) or type(exc).__name__
        if store.latest() is None:
            raise CheckpointError(
                f"cannot read the durable tier {redact(url)} ({why}); this run's fast tier {store.url} is "
                "empty, so the run would start over beside checkpoints it cannot see. Fix access to "
                "it, or give --upload-to a new URL to start a new run"
            ) from exc
        logger.warning(
            "could not read the durable tier %s (%s): resuming from %s", redact(url), why, store.url
        )
        return None
    if fetched is not None:
        lost = _quiet_lost(url, options, fetched.version)
        if lost:
            logger.warning(
                "versions %s were committed on the fast tier only, which is gone: they are trained again",
                version_ranges(lost),
            )
        fetched = dataclasses.replace(fetched, lost=tuple(lost))
        logger.info(
            "fetched version %d from the durable tier %s into %s: %d file(s), %s, %.1f s (%d kept)",
            fetched.version,
            fetched.source,
            store.url,
            fetched.files,
            human_size(fetched.bytes),
            fetched.seconds,
            fetched.kept,
        )
    return fetched


def durable_holds_versions(config: ArchiveConfig) -> bool:
    """Whether ``upload_to`` holds a committed version (False without one, or when unreadable)."""
    target = upload_target(config)
    return target is not None and holds_versions(*target)


@io_task("fetch_from_durable", retries=2, backoff=2)
def _fetch(store: CheckpointStore, url: str, options: dict[str, Any]) -> Fetched | None:
    return store.fetch_newest(url, storage_options=options)


def _quiet_lost(url: str, options: dict[str, Any], fetched: int) -> list[int]:
    try:
        return lost_versions(url, options, fetched)
    except Exception:  # a note that cannot be read names nothing; the fetch stands
        return []


def fetched_json(fetched: Fetched | None) -> dict[str, Any] | None:
    if fetched is None:
        return None
    return {
        "lost": list(fetched.lost),
        "version": fetched.version,
        "source": fetched.source,
        "files": fetched.files,
        "bytes": fetched.bytes,
        "seconds": round(fetched.seconds, 3),
    }


def _archive_once(store: CheckpointStore, versions: list[int]) -> TarIndex:
    """The tarball of ``versions``: found committed by an earlier attempt, or written now."""
    archived = store.archived()
    if all(v in archived for v in versions) and len({archived[v].tar for v in versions}) == 1:
        return archived[versions[0]].index
    return store.archive(versions)


class ArchiveQueue:
    """Background archive (and upload) jobs of one flow run: bounded, never waited for by a commit.

    Jobs go to the flow's task runner (threads) with ``.submit``, so they show in
    the Prefect UI as task runs with retries while training continues. At most
    ``max_pending`` run at once; a commit finding them all busy leaves its work
    queued (an upload waits in :attr:`waiting`, an archive group is found again by
    the policy) and returns at once. Each commit and :meth:`drain` start what waits
    as jobs end. After a failed job nothing more starts in this run: the next run,
    or ``ckptflow archive``, starts over from what is committed.
    """

    def __init__(
        self,
        store: CheckpointStore,
        config: ArchiveConfig,
        existing: list[VersionInfo],
        on_result: Callable[[ArchiveResult], None] | None = None,
        on_durable: Callable[[int | None, list[int]], None] | None = None,
    ) -> None:
        self.store = store
        self.config = config
        self.on_result = on_result
        self.on_durable = on_durable  # (the durable tier's newest version, the versions it lacks)
        # A version in a committed tarball whose loose copy is still there is done when the
        # copies are kept on purpose and nothing is uploaded; else its job was cut off: redo it
        # (the tarball is reused, a verified upload skipped).
        done = set(store.archived()) if existing and config.keep_loose and not config.upload_to else set()
        self.loose = [v for v in existing if not v.archived and v.version not in done]
        self.pending: list[_Job] = []  # started, not yet collected
        self.waiting: list[int] = []  # versions whose upload waits for a free slot, oldest first
        self.busy: set[int] = set()
        self.results: list[ArchiveResult] = []
        self.uploads: dict[int, Any] = {}  # version -> its upload job, until an archive job waits for it
        self.mirrored: set[int] = set()  # versions whose upload this run verified
        self.failures: list[str] = []  # "what failed: why", one per failed job no later one made good
        # A failed upload (the durable tier not answering, refusing) pauses the uploads for
        # upload_retry_seconds; then the newest version due goes up. Training never waits for it.
        self.outages: list[str] = []  # "upload of version N failed: why", each failed upload
        self.paused_until: float | None = None  # monotonic time before which no job starts
        self.started = False
        # The durable tier (upload_to): its newest version as last seen (None: none, or not known),
        # the versions committed here, and the cadence's state (archive.upload_every).
        self.durable_newest: int | None = None
        self.durable_known = False  # whether durable_newest was read from the tier or confirmed
        self.committed_here: list[int] = [v.version for v in existing]
        self.held: int | None = None  # the newest version the cadence has not sent yet
        self.skipped: list[int] = []  # versions the cadence let go: a newer one went up instead
        self._last_sent: float | None = None  # monotonic time the last upload started

    def committed(self, info: VersionInfo) -> None:
        """Note a new commit; start whatever the policy says is due and a slot allows. Never waits."""
        self.loose.append(info)
        self.committed_here.append(info.version)
        self._tell_durable()  # one more version behind, until its upload is verified
        if self.config.mirrors_versions():
            self._hold(info.version)
            if self._due(info):
                self._send_held()
        self.catch_up()

    def _hold(self, version: int) -> None:
        if self.held is not None:
            self.skipped.append(self.held)
        self.held = version

    def _due(self, info: VersionInfo) -> bool:
        """Whether the cadence sends ``info`` up now (else it is held until a later one is due)."""
        interval = self.config.upload_interval()
        if interval is None:
            return not info.in_epoch
        return not interval or self._last_sent is None or self._interval_passed()

    def _interval_passed(self) -> bool:
        """Whether a timed cadence's interval has passed since the last upload began."""
        interval, last = self.config.upload_interval(), self._last_sent
        return bool(interval) and last is not None and time.monotonic() - last >= (interval or 0.0)

    def _send_held(self) -> None:
        if self.held is not None:
            self.waiting.append(self.held)
            self.held = None

    def catch_up(self) -> None:
        """Collect the jobs that ended, then start what is due; at start also what an interrupted
        run left: groups it did not archive, and loose versions the mirror lacks (``upload_versions``).
        """
        self._collect_ended()
        if not self.started and not self.failures:
            self.started = True
            self.waiting[:0] = [v for v in self._not_mirrored() if v not in self.waiting]
            self._tell_durable()
        if self.held is not None and self._interval_passed():
            self._send_held()
        self._start_due()

    def _start_due(self) -> None:
        """Start waiting uploads (oldest first), then the archive groups due, while slots are free."""
        if self.failures:
            return
        if self.paused_until is not None and time.monotonic() < self.paused_until:
            return  # the durable tier failed an upload a moment ago
        while self.waiting and self._has_room():
            self._upload(self.waiting.pop(0))
        if not self.config.enabled():
            return
        for group in next_groups(self.loose, self.config, self.busy):
            if not self._has_room():
                return  # the policy finds this group again at the next commit
            # the tarball's upload mirrors these versions: their own uploads need not run
            self.waiting = [v for v in self.waiting if v not in group]
            # the upload of a loose version reads its files: they may go only once it is done
            uploads = [self.uploads.pop(v) for v in group if v in self.uploads]
            self.busy.update(group)
            future = archive_versions.submit(self.store, group, self.config, wait_for=uploads)
            self.pending.append(_Job(future, group, archives=True))

    def _has_room(self) -> bool:
        return len(self.pending) < self.config.max_pending

    def _upload(self, version: int) -> None:
        self._last_sent = time.monotonic()
        future = upload_version.submit(self.store, version, self.config)
        self.pending.append(_Job(future, [version], archives=False))
        if self.config.enabled():
            self.uploads[version] = future

    def _not_mirrored(self) -> list[int]:
        """Loose versions without a manifest on the remote (their upload was cut off, or never ran)."""
        target = upload_target(self.config) if self.config.mirrors_versions() else None
        if target is None or not self.loose:
            return []
        try:
            mirror = CheckpointStore(target[0], storage_options=target[1])
            mirrored = {v for v, has_manifest in mirror.version_dirs().items() if has_manifest}
        except Exception as exc:  # upload them all: a verified copy is skipped
            log = get_run_logger()
            log.warning("could not list %s (%s): checking every loose version", redact(target[0]), exc)
            return [v.version for v in self.loose]
        self.durable_newest, self.durable_known = max(mirrored, default=None), True
        lacking = [v.version for v in self.loose if v.version not in mirrored]
        if self.config.upload_every is not None or self.config.durable_keep_last is not None:
            # with a cadence, or a retention of its own, only the newest catches up
            lacking = lacking[-1:] if lacking and lacking[-1] > (self.durable_newest or -1) else []
        return lacking

    def _outage(self, versions: list[int], failure: str) -> None:
        """An upload failed after its retries: wait ``upload_retry_seconds``, then send the newest
        version due (the backlog is one version; the others stay for the next run's start)."""
        self.outages.append(failure)
        pause = self.config.upload_retry_seconds
        self.paused_until = time.monotonic() + pause
        due = [*versions, *self.waiting]
        self.waiting = [max(due)] if due else []
        get_run_logger().warning(
            "%s; training goes on, the durable tier is tried again in %gs", failure, pause
        )

    def unresolved(self) -> list[str]:
        """The failed jobs that no later one made good: an archive job's, and the failed uploads
        unless the durable tier caught up with the newest version since."""
        caught_up = self.durable_known and not self.not_durable()
        return [*self.failures, *([] if caught_up else self.outages)]

    def _became_durable(self, versions: list[int]) -> None:
        newest = max(versions)
        if self.durable_newest is None or newest > self.durable_newest:
            self.durable_newest = newest
        self.durable_known = True
        self._tell_durable()

    def not_durable(self) -> list[int]:
        """The versions committed here that are newer than the durable tier's newest (all of them
        when it is not known)."""
        newest = self.durable_newest if self.durable_known else None
        return sorted(v for v in set(self.committed_here) if newest is None or v > newest)

    def not_durable_from(self) -> int | None:
        """The first version retention must keep for the durable tier (None without one)."""
        if self.config.upload_to is None:
            return None
        if not self.durable_known:
            return 0
        return (self.durable_newest or -1) + 1

    def durable_retention(self) -> list[int]:
        """At the run's end, once every upload is done: apply ``durable_keep_last`` to the durable
        tier; return the versions it removed (none while an upload failed: it may lack the newest)."""
        keep = self.config.durable_keep_last
        target = upload_target(self.config)
        if keep is None or target is None or self.unresolved() or self.pending or self.waiting:
            return []
        from ckptflow.storage import RetentionPolicy

        durable = CheckpointStore(target[0], storage_options=target[1])
        plan = durable.apply_retention(RetentionPolicy(keep_last=keep))
        get_run_logger().info(
            "durable tier %s (keep_last=%d): removed versions %s; kept %s",
            redact(target[0]),
            keep,
            version_ranges(plan.remove),
            version_ranges(plan.remaining),
        )
        return list(plan.remove)

    def durable_line(self) -> str:
        """Where the durable tier stands: "durable tier URL: holds version 7", or which versions
        only the fast tier holds."""
        url = redact(self.config.upload_to or "")
        newest = self.durable_newest if self.durable_known else None
        lacking = self.not_durable()
        held = f"holds version {newest}" if newest is not None else "holds no version"
        only = "are only"
        if not self.durable_known:
            held, only = "could not be read", "may be only"
        if not lacking:
            return f"durable tier {url}: {held}"
        lacks = f"versions {version_ranges(lacking)} {only} on the fast tier {self.store.url}"
        return f"durable tier {url}: {held}; {lacks}"

    def _tell_durable(self) -> None:
        if self.on_durable is not None and self.config.upload_to is not None and self.durable_known:
            self.on_durable(self.durable_newest, self.not_durable())

    def _collect_ended(self) -> None:
        for job in [j for j in self.pending if j.ended.is_set()]:
            self.pending.remove(job)
            self._finish(job)

    def _finish(self, job: _Job) -> None:
        """Collect a job's outcome; a failure (after its retries) is recorded, not raised."""
        try:
            result = job.future.result()
        except Exception as exc:
            what = "archive of versions" if job.archives else "upload of version"
            why = " ".join(str(exc).split()) or type(exc).__name__
            failure = f"{what} {version_ranges(job.versions)} failed: {why}"
            if job.archives:
                self.failures.append(failure)
                return  # an archive job's versions stay busy: no other job takes them in this run
            self._outage(job.versions, failure)
            return
        if not job.archives:
            self.mirrored.update(job.versions)
            self._became_durable(job.versions)
            self.paused_until = None
            return
        self.busy.difference_update(job.versions)
        if isinstance(result, ArchiveResult):
            self.loose = [v for v in self.loose if v.version not in result.versions]
            self.results.append(result)
            if result.uploaded:
                self.mirrored.update(result.versions)
                self._became_durable(result.versions)
            if self.on_result is not None:
                self.on_result(result)

    def drain(self, *, strict: bool = True) -> list[ArchiveResult]:
        """Run every job due to the end (the flow's clean shutdown); return the archive results.

        Jobs waiting for a slot start as others end, unless one failed. ``strict``: raise if a
        job failed; else the caller reports :attr:`failures`.
        """
        self._send_held()  # the run's last version goes up whatever the cadence
        self.paused_until = None  # and is tried once more after an outage
        self._start_due()
        while self.pending:
            self._finish(self.pending.pop(0))
            self._collect_ended()
            self._start_due()
        if strict and self.unresolved():
            raise CheckpointError("; ".join(self.unresolved()))
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
            self.store,
            url,
            held,
            config=self.config,
            confirmed=self.mirrored,
            failures=self.unresolved(),
            skipped=self.skipped,
        )

    def idle(self) -> bool:
        """Whether no archive or upload job runs or waits and none failed (retention may remove
        versions now: none is waiting to go up)."""
        return not self.pending and not self.waiting and not self.busy and not self.failures

    def abandon(self, timeout: float | None = None) -> None:
        """On an interrupted run: wait for queued jobs to end (up to ``timeout`` s in all), without
        raising their errors."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for job in self.pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            job.future.wait(left)  # a PrefectFuture's wait() does not raise the task's error
        self._collect_ended()
        self.pending.clear()

    def drain_on_stop(self, newest: VersionInfo | None, committed: Iterable[int] = ()) -> list[int]:
        """On SIGTERM: send ``newest`` (the stop's own save) to the durable tier within
        ``stop_drain_seconds``, in a thread of this process (the flow's task runner is shutting
        down); return the versions still only on the fast tier. ``committed``: the versions the
        run saw commit (the save in flight at the stop among them)."""
        self.committed_here.extend(v for v in committed if v not in self.committed_here)
        seconds = self.config.stop_drain_seconds
        target = upload_target(self.config) if self.config.mirrors_versions() else None
        if target is None or newest is None:
            return self.not_durable() if target is not None else []
        if newest.version not in self.committed_here:
            self.committed_here.append(newest.version)
        started = time.monotonic()
        self.abandon(timeout=seconds)
        if self.durable_known and self.durable_newest is not None and self.durable_newest >= newest.version:
            return self.not_durable()
        left = seconds - (time.monotonic() - started)
        if left <= 0:
            return self.not_durable()
        outcome: list[BaseException | str] = []

        def send() -> None:
            try:  # the upload task's own body, outside the task runner
                outcome.append(upload_version.fn(self.store, newest.version, self.config))
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=send, name="ckptflow-stop-drain", daemon=True)
        thread.start()
        thread.join(left)
        logger = get_run_logger()
        if outcome and isinstance(outcome[0], str):
            self.mirrored.add(newest.version)
            self._became_durable([newest.version])
            logger.info("version %d is durable: %s", newest.version, redact(outcome[0]))
        elif outcome:
            why = " ".join(str(outcome[0]).split()) or type(outcome[0]).__name__
            logger.warning("could not make version %d durable before the stop: %s", newest.version, why)
        else:
            logger.warning(
                "version %d did not reach the durable tier within %gs (archive.stop_drain_seconds)",
                newest.version,
                seconds,
            )
        return self.not_durable()
