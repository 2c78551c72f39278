"""What a run reports to Prefect, so a long job can be watched from the UI.

Per run (keys ``ckptflow-<flow run name>-...``):

- ``-checkpoints``: a table of the committed checkpoints, one numeric column
  per metric (sortable), updated at every commit;
- ``-progress``: the epochs done, its description "epoch k/N, ETA ..." (a card
  shows one line of a description, so every description here is short);
- ``-curve``: the training curve, a chart of every metric per epoch (an SVG in
  a markdown artifact) with the committed epochs and the best one marked,
  redrawn as epochs finish;
- ``-latest``: the newest committed checkpoint, and where it is;
- ``-summary``: how the run ended, whatever the ending (Completed, Cancelled,
  Failed; Crashed ones get theirs from the next run, :mod:`.crashed`);
- ``-upload``: a link to each uploaded archive.

Per store (``ckptflow-<alias>-<hash>-latest`` and ``-checkpoints``, see
:mod:`.artifacts`): the newest checkpoint and how to restore it, and the table
of every committed version, whichever run, maintenance flow or ``ckptflow
publish`` wrote last.

One ``ckptflow.checkpoint.committed`` event per commit, sent the moment the
commit lands (an async save's completion, not the next save), in commit
order, exactly once: its id is derived from the store, version and commit
time, so the server keeps one even if it is sent twice. A run starting on a
store reports the commits its predecessor made but never reported (a SIGKILL
right after a commit): it asks the server which of the store's newest
versions have no event yet.

Reporting never stalls or breaks training: one thread of the run makes every
API call in order (epochs' updates at most every ``min_interval`` s, commits
at once), and a failed call is logged and skipped. Nothing reported contains
storage credentials: URLs are shown redacted.

Prefect's UI does not refresh an open artifact page; the run's Logs tab does. So
each commit is logged on the run too, and the flow's epoch lines end with
:meth:`RunMonitor.status` (the last commit, its age, the ETA).

In-process listeners (the CLI's progress display) get the same notifications.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import math
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any
from uuid import UUID

from ckptflow.storage import VersionInfo, redact

from .artifacts import (
    ArtifactSet,
    committed_at,
    ending_markdown,
    latest_markdown,
    one_line,
    run_key,
    safely,
    slug,
    store_alias,
    store_key,
    table_rows,
)
from .chart import curve_markdown
from .formatting import human_size, metric_value, utc_text
from .prefect_runs import events_with_ids, prefect_client, record_commit

log = logging.getLogger(__name__)

COMMITTED_EVENT = "ckptflow.checkpoint.committed"
CATCH_UP_VERSIONS = 50  # how many of a store's newest versions a starting run checks for events
CATCH_UP_WINDOW = timedelta(days=1)  # ...among those committed this recently
Listener = Callable[[str, dict[str, Any]], None]
_listeners: list[Listener] = []

__all__ = ["COMMITTED_EVENT", "RunMonitor", "add_listener", "notify", "publish_store", "slug", "store_key"]


def add_listener(listener: Listener) -> Callable[[], None]:
    """Call ``listener(kind, data)`` on every notification; returns a remover."""
    _listeners.append(listener)
    return lambda: _listeners.remove(listener)


def notify(kind: str, data: dict[str, Any]) -> None:
    """Tell the listeners (the CLI's progress display) about ``kind``; never raises."""
    for listener in list(_listeners):
        try:
            listener(kind, data)
        except Exception:
            log.exception("progress listener failed")


class _Reporter:
    """One thread that makes a run's API calls in order, so training never waits on Prefect.

    It runs in the context of the thread that made it (the flow run's: its API URL, and the
    flow run its artifacts and events belong to).
    """

    _STOP = object()

    def __init__(self, periodic: Callable[[], None], min_interval: float) -> None:
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._periodic = periodic
        self._min_interval = min_interval
        self._due = False  # the periodic job has something to publish
        self._last = -1e9
        self._lock = threading.Lock()
        context = contextvars.copy_context()
        self._thread = threading.Thread(
            target=context.run, args=(self._loop,), name="ckptflow-reporter", daemon=True
        )
        self._thread.start()

    def put(self, job: Callable[[], object]) -> None:
        self._jobs.put(job)

    def soon(self) -> None:
        """Run the periodic job within ``min_interval`` s (once, however often this is called)."""
        with self._lock:
            wake, self._due = not self._due, True
        if wake:
            self._jobs.put(None)

    def drain(self, timeout: float = 30.0) -> bool:
        """Run the periodic job now and wait until every job so far has run; False on timeout."""
        if not self._thread.is_alive():
            return False
        done = threading.Event()
        with self._lock:
            self._due = True
        self._last = -1e9
        self._jobs.put(done.set)
        return done.wait(timeout)

    def close(self) -> None:
        self._jobs.put(self._STOP)

    def _loop(self) -> None:
        while True:
            wait = None
            if self._due:
                wait = max(0.0, self._last + self._min_interval - time.monotonic())
            try:
                job = self._jobs.get(timeout=wait)
            except queue.Empty:
                job = None
            if self._due and time.monotonic() - self._last >= self._min_interval:
                with self._lock:
                    self._due = False
                self._last = time.monotonic()
                safely("progress", self._periodic)
            if job is self._STOP:
                return
            if job is not None:
                safely("report", job)


def resume_text(info: VersionInfo) -> str:
    """Where a resume continues from: ``version 7 (epoch 2, step 1,200 of 4,000)``, ``version 2
    (the end of epoch 2)``, or ``version 5`` for a version that records no epoch."""
    if info.epoch is None:
        return f"version {info.version}"
    if info.in_epoch:
        length = f" of {info.epoch_steps:,}" if info.epoch_steps else ""
        return f"version {info.version} (epoch {info.epoch}, step {info.in_epoch:,}{length})"
    return f"version {info.version} (the end of epoch {info.epoch})"


def _record_commit(run_id: str, info: VersionInfo) -> None:
    with prefect_client() as client:
        record_commit(client, UUID(run_id), info)


@dataclass
class RunMonitor:
    """Artifacts and events of one flow run."""

    run_name: str
    store_url: str
    total_epochs: int
    min_interval: float = 2.0  # seconds between epoch updates; commits are reported at once
    best_by: tuple[str, str] | None = None  # (metric, "min" or "max"): the curve marks the best checkpoint
    given: str | None = None  # the store as the run was given it (``./checkpoints/run9``), for events
    world_size: int | None = None  # the ranks that train, for the summary
    run_id: str | None = None  # the flow run's id: its commits are recorded on it as they come
    versions: dict[int, VersionInfo] = field(default_factory=dict)  # the committed ones, by version
    history: dict[int, dict[str, float]] = field(default_factory=dict)  # metrics by epoch
    notes: list[str] = field(default_factory=list)  # end-of-run lines, e.g. what the mirror lacks
    artifacts: ArtifactSet = field(default_factory=ArtifactSet)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._reported: set[int] = set()
        self._epoch_times: list[tuple[int, float]] = []  # (epoch, monotonic time it finished)
        self._ending: str | None = None  # how the run ended, once it has
        self._inside: tuple[int, int, int | None] | None = None  # (epoch, its steps trained, of how many)
        self._last_commit: tuple[VersionInfo, float] | None = None  # and the monotonic time it was seen
        self._durable: tuple[int | None, list[int]] | None = None  # the durable tier's newest, what it lacks
        self._began = time.monotonic()
        self._reporter = _Reporter(self._publish_epochs, self.min_interval)

    @property
    def key_prefix(self) -> str:
        return run_key(self.run_name)

    def start(
        self,
        existing: list[VersionInfo],
        first_epoch: int,
        resumed: VersionInfo | None = None,
        fetched: dict[str, Any] | None = None,
    ) -> None:
        """The run begins after ``existing`` commits (``resumed``: the one it resumes from;
        ``fetched``: what came from the durable tier first, see ``tasks.archiving.fetched_json``):
        show them, and report those never reported."""
        self._epoch_times = [(first_epoch - 1, time.monotonic())]
        with self._lock:
            self.versions = {v.version: v for v in existing}
            self.history = {v.epoch: dict(v.metrics) for v in existing if v.epoch is not None and v.metrics}
            self._reported = set(self.versions)
        self._reporter.put(lambda: self._report_unreported(existing))
        self._reporter.put(self._publish_tables if existing else lambda: None)
        self._reporter.soon()
        start = {"first_epoch": first_epoch, "total": self.total_epochs, "url": self.store_url}
        notify("start", {**start, "committed": len(existing), "resumed": resumed, "fetched": fetched})

    def epoch_done(self, epoch: int, metrics: dict[str, float]) -> None:
        with self._lock:
            self.history[epoch] = dict(metrics)
            self._epoch_times.append((epoch, time.monotonic()))
            self._inside = None
        self._reporter.soon()
        notify("epoch", {"epoch": epoch, "total": self.total_epochs, "metrics": metrics})

    def step_done(self, epoch: int, in_epoch: int, epoch_steps: int | None) -> None:
        """A save point inside ``epoch``, after ``in_epoch`` of its ``epoch_steps`` steps: the
        progress reads "epoch 3/10, step 1,200/4,000"."""
        with self._lock:
            self._inside = (epoch, in_epoch, epoch_steps)
        self._reporter.soon()
        notify(
            "step",
            {"epoch": epoch, "in_epoch": in_epoch, "epoch_steps": epoch_steps, "total": self.total_epochs},
        )

    def committed(self, info: VersionInfo, *, late: bool = False) -> None:
        """A version committed: report it now, once (a second call for it does nothing), and log
        it on the run (``late``: a save in flight when the run was told to stop, seen after it).

        Safe from any thread (an async save's completion calls it from the writer thread).
        """
        with self._lock:  # the queue then holds the commits in the order they were taken
            if info.version in self._reported:
                return
            self._reported.add(info.version)
            self.versions[info.version] = info
            self._last_commit = (info, time.monotonic())
            if info.epoch is not None and info.in_epoch:  # a save past the last step reported: the stop's
                seen = self._inside
                if seen is None or (seen[0], seen[1]) < (info.epoch, info.in_epoch):
                    self._inside = (info.epoch, info.in_epoch, info.epoch_steps)
            self._reporter.put(lambda: self._publish_commit(info, late=late))
        notify("committed", {"info": info})

    def catch_up(
        self, list_versions: Callable[[], list[VersionInfo]], *, in_flight: int | None = None
    ) -> None:
        """Report versions committed but not reported yet: a save that finished while the run was
        stopping, or the stop's own save. ``in_flight``: the version whose save was in flight when
        the run was told to stop (its log line says so; the stop's save says so itself)."""
        try:
            versions = list_versions()
        except Exception as exc:
            log.warning("could not list the committed versions of %s: %s", self.store_url, exc)
            return
        for info in sorted(versions, key=lambda v: v.version):
            self.committed(info, late=info.version == in_flight)

    def status(self) -> str:
        """Where the run stands beyond its epoch, for its log lines (the run page's Logs tab updates
        as they come; artifact pages do not): "last commit v3 (epoch 3) 12 s ago, ETA ... (in ...)"."""
        with self._lock:
            last, times, ended = self._last_commit, list(self._epoch_times), self._ending
        parts = []
        if last is not None:
            info, at = last
            parts.append(
                f"last commit v{info.version} ({_where(info)}) {_duration(time.monotonic() - at)} ago"
            )
        eta = _eta(times, self.total_epochs) if ended is None else None
        if eta is not None:
            parts.append(eta)
        durable = self.durable_text()
        if durable:
            parts.append(durable)
        return ", ".join(parts)

    def durable(self, newest: int | None, lacking: list[int]) -> None:
        """The durable tier's newest version and the versions committed here it lacks, as they
        change (an upload verified): the log lines, the progress artifact and listeners show them."""
        with self._lock:
            self._durable = (newest, list(lacking))
        self._reporter.soon()
        notify("durable", {"newest": newest, "lacking": list(lacking)})

    def durable_text(self) -> str:
        """ "durable v7", "durable v7 (2 behind)", "durable: none yet" ("" without a durable tier)."""
        with self._lock:
            durable = self._durable
        if durable is None:
            return ""
        newest, lacking = durable
        held = f"durable v{newest}" if newest is not None else "durable: none yet"
        return f"{held} ({len(lacking)} behind)" if lacking else held

    def flush(self, timeout: float = 30.0) -> None:
        """Publish what is pending now and wait for it (up to ``timeout`` s)."""
        if not self._reporter.drain(timeout):
            log.warning("reporting to Prefect did not finish within %gs", timeout)

    def archived(self, result: Any) -> None:
        """An archive job finished (an ``ArchiveResult``): link its upload, tell listeners."""
        notify("archived", {"tar": result.tar, "versions": result.versions, "size": result.size})
        if result.uploaded:
            self.uploaded(result.uploaded, result.size)

    def uploaded(self, url: str, size: int) -> None:
        """A link artifact to an uploaded archive (its URL without credentials, and its size), made
        by the reporter's thread like every other API call."""
        shown = redact(url)
        name = shown.rstrip("/").rsplit("/", 1)[-1] or shown
        self._reporter.put(
            lambda: self.artifacts.link(
                f"{self.key_prefix}-upload",
                shown,
                f"{name} ({human_size(size)})",
                card_text(f"{name}, {human_size(size)}"),
                each=True,
            )
        )
        notify("uploaded", {"url": shown, "size": size})

    def note(self, line: str) -> None:
        """An end-of-run line: listeners get it now, the run summary ends with it."""
        self.notes.append(line)
        notify("note", {"line": line})

    def ended(
        self,
        state: str,
        why: str,
        latest: VersionInfo | None,
        *,
        rows: list[tuple[str, str]] = (),  # type: ignore[assignment]
        removed: list[int] | tuple[int, ...] = (),
        unreadable: str | None = None,
        flush: float = 30.0,
    ) -> None:
        """Publish the run's summary (however it ended) and drop the versions retention ``removed``.

        Once per run: a second call does nothing. ``latest`` None with ``unreadable`` set: the
        store could not be read at the end (the summary says so instead of "none committed").
        """
        with self._lock:
            if self._ending is not None:
                return
            self._ending = f"{state}: {one_line(why)}"
            for version in removed:
                self.versions.pop(version, None)
        if removed:
            self._reporter.put(self._publish_tables)
        rows = [*rows, ("wall time", _duration(time.monotonic() - self._began))]
        if self.world_size is not None:
            rows.append(("world size", f"{self.world_size} rank{'s' if self.world_size != 1 else ''}"))
        text = ending_markdown(
            state=state, why=why, store_url=self.store_url, latest=latest, rows=rows, unreadable=unreadable
        )
        text = "\n\n".join([text, *(f"**{n}**" for n in self.notes)])
        self._reporter.put(self._publish_progress)
        key = f"{self.key_prefix}-summary"
        self._reporter.put(lambda: self.artifacts.markdown(key, text, f"ckptflow run summary: {state}"))
        self.flush(flush)
        self._reporter.close()

    # -- in the reporter's thread --

    def _publish_commit(self, info: VersionInfo, *, late: bool = False) -> None:
        after = "; it was in flight when the run was told to stop" if late else ""
        saved = f", saved in {info.save_seconds:.2f} s" if info.save_seconds else ""
        _run_log().info(
            "committed version %d (%s, %s%s): %s%s",
            info.version,
            _where(info),
            human_size(info.size),
            saved,
            info.url,
            after,
        )
        # every commit has its event
        safely("event", lambda: emit_committed(info, self.store_url, self.given))
        with self._lock:
            newer = any(v > info.version for v in self._reported)
        if newer:  # saves commit faster than the artifacts update: the newest's job shows them all
            return
        self._publish_tables()
        source = f"flow run `{self.run_name}`"
        count = len(self.versions)
        publish_latest(self.artifacts, self.store_url, info, count=count, source=source)
        self.artifacts.link(
            f"{self.key_prefix}-latest",
            info.url,
            f"v{info.version} (epoch {info.epoch}, {human_size(info.size)})",
            latest_card_text(info),
        )
        run_id = self.run_id
        if run_id is not None:  # the run's own record of its newest commit (a crashed run's summary)
            safely("record of the commit", lambda: _record_commit(run_id, info))

    def _publish_tables(self) -> None:
        with self._lock:
            versions = list(self.versions.values())
        rows = table_rows(versions)
        description = table_card_text(versions)
        self.artifacts.table(f"{self.key_prefix}-checkpoints", rows, description)
        self.artifacts.table(f"{store_key(self.store_url)}-checkpoints", rows, description)

    def _publish_epochs(self) -> None:
        self._publish_progress()
        with self._lock:
            history = dict(self.history)
            ends = [v for v in self.versions.values() if v.epoch is not None and not v.in_epoch]
        best = best_epoch(ends, self.best_by)
        if history:
            title = f"Training curve of {store_alias(self.store_url)}"
            self.artifacts.markdown(
                f"{self.key_prefix}-curve",
                curve_markdown(history, title=title, committed={v.epoch for v in ends if v.epoch}, best=best),
                card_text(f"epochs {min(history)}..{max(history)}" + (f", best {best}" if best else "")),
            )

    def _publish_progress(self) -> None:
        with self._lock:
            times, ended, inside = list(self._epoch_times), self._ending, self._inside
        percent, text = progress_of(times[-1][0] if times else 0, inside, self.total_epochs)
        eta = _eta(times, self.total_epochs, short=True) if ended is None else None
        if eta is not None:
            text += f", {eta}"
        durable = self.durable_text()
        if durable:
            text += f", {durable}"
        if ended is not None:
            text += f"; {ended.split(':', 1)[0]}"  # the state; the summary says why
        self.artifacts.progress(f"{self.key_prefix}-progress", percent, text)

    def _report_unreported(self, existing: list[VersionInfo]) -> None:
        """Send the committed events that the store's previous run never sent (a SIGKILL after a commit).

        Only the versions after the newest one with an event, and only those committed within
        ``CATCH_UP_WINDOW``: the server forgets events (after 7 days by default), and a store
        resumed weeks later, or written before events existed, must not fire automations again
        for old checkpoints. Events are looked up by their own ids (see :func:`event_id`).
        """
        since = datetime.now(timezone.utc) - CATCH_UP_WINDOW
        recent = [v for v in sorted(existing, key=lambda v: v.version) if committed_at(v) >= since]
        recent = recent[-CATCH_UP_VERSIONS:]
        if not recent:
            return
        seen = reported_events(self.store_url, recent)
        if seen is None:
            return  # the server cannot say: better no report than a second one
        newest_seen = max((v.version for v in recent if v.version in seen), default=0)
        for info in recent:
            if info.version > newest_seen:
                _run_log().info("reporting version %d (committed, never reported)", info.version)
                safely("event", functools.partial(emit_committed, info, self.store_url, self.given))


def best_epoch(versions: list[VersionInfo], best_by: tuple[str, str] | None) -> int | None:
    """The epoch of the best of ``versions`` by ``best_by`` (metric, "min" or "max"); None if
    none has the metric."""
    if best_by is None:
        return None
    metric, mode = best_by
    scored = [
        (v.metrics[metric], v.epoch)
        for v in versions
        if v.epoch is not None and math.isfinite(v.metrics.get(metric, math.nan))
    ]
    if not scored:
        return None
    pick = min if mode == "min" else max
    return pick(scored, key=lambda s: s[0])[1]


def progress_of(done: int, inside: tuple[int, int, int | None] | None, total: int) -> tuple[float, str]:
    """The percent of ``total`` epochs a run stands at, and "epoch 3/10" (``done`` epochs), or
    "epoch 4/10, step 1,200/4,000" with ``inside`` = (the epoch in progress, its steps, of how many)."""
    share = 0.0
    text = f"epoch {done}/{total}"
    if inside is not None:
        text = f"epoch {inside[0]}/{total}, {step_text(inside[1], inside[2])}"
        share = inside[1] / inside[2] if inside[2] else 0.0
    return min(100.0, round(100.0 * max(0.0, done + share) / max(1, total), 2)), text


def step_text(in_epoch: int, epoch_steps: int | None) -> str:
    """ "step 1,200/4,000" (or "step 1,200" when the epoch's length is unknown)."""
    return f"step {in_epoch:,}/{epoch_steps:,}" if epoch_steps else f"step {in_epoch:,}"


def _run_log() -> Any:
    """The flow run's logger (its lines show in the UI), else this module's."""
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:
        return log


def _where(info: VersionInfo) -> str:
    """ "epoch 3", or "epoch 3, step 1,200/4,000" for a save inside it."""
    if info.in_epoch:
        return f"epoch {info.epoch}, {step_text(info.in_epoch, info.epoch_steps)}"
    return f"epoch {info.epoch}"


def _eta(times: list[tuple[int, float]], total: int, *, short: bool = False) -> str | None:
    """ "ETA 2026-11-25 14:02:10 UTC (in 13 min 16 s)" from the epochs' end times (``short``:
    "ETA 2026-11-25 14:02 UTC", for a card); None when no epoch has ended in this run yet, or
    none is left."""
    if len(times) < 2 or times[-1][0] >= total:
        return None
    per_epoch = (times[-1][1] - times[0][1]) / (times[-1][0] - times[0][0])
    left = (total - times[-1][0]) * per_epoch
    finish = datetime.fromtimestamp(datetime.now(timezone.utc).timestamp() + left, timezone.utc)
    if short:
        return f"ETA {utc_text(finish, seconds=False)}"
    return f"ETA {utc_text(finish)} (in {_duration(left)})"


CARD_CHARS = 40  # what one line of a card's description holds in the Prefect UI at 1600 px


def card_text(text: str) -> str:
    """An artifact's description, which its card shows on one line, cut at ``CARD_CHARS`` with an
    ellipsis of ours (the UI's would hide the end silently); the artifact's page has it all."""
    return text if len(text) <= CARD_CHARS else text[: CARD_CHARS - 1].rstrip() + "…"


def latest_card_text(info: VersionInfo | None) -> str:
    """ "v3 (epoch 3), 1.2 MiB": the description of a latest-checkpoint card."""
    if info is None:
        return "no checkpoint committed yet"
    return card_text(f"v{info.version} ({_where(info)}), {human_size(info.size)}")


def table_card_text(versions: list[VersionInfo]) -> str:
    """ "3 committed, newest v3 (epoch 3)": the description of a checkpoint table's card."""
    newest = max(versions, key=lambda v: v.version, default=None)
    if newest is None:
        return "no checkpoint committed yet"
    return card_text(f"{len(versions)} committed, newest v{newest.version} ({_where(newest)})")


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds + 0.5), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if hours else f"{minutes} min {secs} s" if minutes else f"{secs} s"


def publish_store(store_url: str, versions: list[VersionInfo], *, source: str) -> dict[str, UUID | None]:
    """Both per-store artifacts, from a listing of the store; returns their ids by key."""
    artifacts = ArtifactSet()
    key = store_key(store_url)
    rows = table_rows(versions)
    table = artifacts.table(f"{key}-checkpoints", rows, table_card_text(versions))
    latest = max(versions, key=lambda v: v.version, default=None)
    card = publish_latest(artifacts, store_url, latest, count=len(rows), source=source)
    return {f"{key}-checkpoints": table, f"{key}-latest": card}


def publish_latest(
    artifacts: ArtifactSet, store_url: str, info: VersionInfo | None, *, count: int, source: str
) -> UUID | None:
    return artifacts.markdown(
        f"{store_key(store_url)}-latest",
        latest_markdown(store_url, info, count=count, source=source),
        latest_card_text(info),
    )


# -- events --


def resource_id(store_url: str, info: VersionInfo) -> str:
    """``ckptflow.checkpoint.<store URL>/v000003 epoch 3``: Prefect's event feed (its default UI)
    shows a resource by its id, so the id carries the epoch; one version's is the same in every
    report (a version's epoch never changes), and it begins with the store's URL."""
    return f"ckptflow.checkpoint.{store_url}/v{info.version:06d} epoch {info.epoch}"


def event_id(store_url: str, info: VersionInfo) -> UUID:
    """The same for every report of one commit, so the server keeps one event per commit."""
    return uuid.uuid5(uuid.NAMESPACE_URL, f"ckptflow:{store_url}:v{info.version}:{info.created}")


def emit_committed(info: VersionInfo, store_url: str, given: str | None = None) -> None:
    """The ``ckptflow.checkpoint.committed`` event of ``info``: its resource is named by the
    alias, version, epoch and headline metrics (the V2 UI's feed shows the name, the default one
    the id), labelled with the store as resolved and as the run was ``given`` it (what an
    automation matches), everything else in the payload."""
    from prefect.events import emit_event

    headline = ", ".join(f"{k}={metric_value(v)}" for k, v in list(info.metrics.items())[:3])
    name = f"{store_alias(store_url)} v{info.version} epoch {info.epoch} {headline}".rstrip()
    resource = {
        "prefect.resource.id": resource_id(store_url, info),
        "prefect.resource.name": name,
        "ckptflow.store": store_url,
        "ckptflow.storage": given or store_url,
        "ckptflow.version": str(info.version),
        "ckptflow.epoch": str(info.epoch),
        "ckptflow.size": human_size(info.size),
        **{f"ckptflow.metric.{k}": metric_value(v) for k, v in info.metrics.items()},
    }
    emit_event(
        event=COMMITTED_EVENT,
        resource=resource,
        id=event_id(store_url, info),
        payload={
            "version": info.version,
            "epoch": info.epoch,
            "step": info.step,
            "size": info.size,
            "new_bytes": info.new_bytes,  # what its save wrote; the rest of size is older versions'
            "save_seconds": info.save_seconds,
            "metrics": info.metrics,
            "created": info.created,
            "url": info.url,
            "parent": info.parent,
            "lineage": info.lineage,
        },
    )


def reported_events(store_url: str, versions: list[VersionInfo]) -> set[int] | None:
    """Which of ``versions`` have their committed event on the server (looked up by the event's
    id); None if the server cannot say."""
    ids = {event_id(store_url, v): v.version for v in versions}
    now = datetime.now(timezone.utc)
    oldest = min((committed_at(v) for v in versions), default=now)
    try:  # "until" well ahead: another host's clock may run ahead of this one's
        found = events_with_ids(ids, since=oldest - timedelta(days=1), until=now + timedelta(days=1))
    except Exception as exc:
        log.warning("could not ask which versions of %s were reported: %s", store_url, exc)
        return None
    return {ids[found_id] for found_id in found}
