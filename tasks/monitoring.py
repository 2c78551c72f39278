"""What a run reports to Prefect, so a long job can be watched from the UI.

Per run: a table artifact of the committed checkpoints (updated at every
commit), a progress artifact for the epochs, a markdown summary at exit, a
link artifact per uploaded archive, and one ``ckptflow.checkpoint.committed``
event per commit. These keys are derived from the flow run's name (lowercase
letters, digits and dashes, as Prefect requires) so that runs never overwrite
each other's artifacts. A run creates each keyed artifact once and then
updates it in place, so its Artifacts tab shows one card per key, not one
per commit.

Per store: ``ckptflow-store-<url tail>-<hash>-latest`` (markdown: the newest
committed checkpoint and how to restore it) and ``...-checkpoints`` (the table
of every committed version). Every run that writes to the store, the
maintenance flow and ``ckptflow publish`` update them, so the Artifacts page
has one always-current entry per store, whichever run wrote last, and every
run of a deployment links to it from its Artifacts tab. The short hash of the
(redacted) URL keeps two stores whose URLs slug alike apart.

Reporting must never break training: a failed API call is logged and skipped.
Nothing reported contains storage credentials: URLs are shown redacted.

In-process listeners (the CLI's progress display) get the same notifications.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from ckptflow.storage import VersionInfo, redact

from .formatting import human_size, metrics_text

log = logging.getLogger(__name__)

COMMITTED_EVENT = "ckptflow.checkpoint.committed"
Listener = Callable[[str, dict[str, Any]], None]
_listeners: list[Listener] = []


def add_listener(listener: Listener) -> Callable[[], None]:
    """Call ``listener(kind, data)`` on every notification; returns a remover."""
    _listeners.append(listener)
    return lambda: _listeners.remove(listener)


def notify(kind: str, data: dict[str, Any]) -> None:
    """Tell the listeners (the CLI's progress display) about ``kind``; never raises."""
    _notify(kind, data)


def _notify(kind: str, data: dict[str, Any]) -> None:
    for listener in list(_listeners):
        try:
            listener(kind, data)
        except Exception:
            log.exception("progress listener failed")


def slug(text: str, *, limit: int = 60) -> str:
    """A Prefect artifact key part: lowercase letters, digits and single dashes."""
    out = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return out[:limit].rstrip("-") or "run"


def store_key(store_url: str) -> str:
    """The artifact key of a store: ``ckptflow-store-`` + the tail of its URL + 8 hex digits of its hash."""
    digest = hashlib.sha256(store_url.encode()).hexdigest()[:8]
    tail = slug(store_url, limit=len(store_url) + 1)[-40:].strip("-") or "store"
    return f"ckptflow-store-{tail}-{digest}"


def checkpoint_row(info: VersionInfo) -> dict[str, Any]:
    seconds = info.save_seconds
    throughput = f"{info.size / seconds / 1e6:.0f} MB/s" if seconds else ""
    return {
        "epoch": info.epoch,
        "version": info.version,
        "size": human_size(info.size),
        "save seconds": round(seconds, 3) if seconds is not None else None,
        "throughput": throughput,
        "metrics": metrics_text(info.metrics),
        "created": info.created,
        "url": info.url,
    }


class ArtifactSet:
    """The keyed artifacts of one flow run: each is created once, then updated in place.

    One card per key in the run's Artifacts tab however many commits it makes;
    on a key's page in the UI, one version per run.
    """

    def __init__(self) -> None:
        self.ids: dict[str, UUID] = {}

    def table(self, key: str, rows: list[dict[str, Any]], description: str) -> UUID | None:
        return self._put(
            key,
            description,
            json.dumps(rows),
            lambda: _artifacts().create_table_artifact(table=rows, key=key, description=description),
        )

    def markdown(self, key: str, text: str, description: str) -> UUID | None:
        return self._put(
            key,
            description,
            text,
            lambda: _artifacts().create_markdown_artifact(markdown=text, key=key, description=description),
        )

    def _put(self, key: str, description: str, data: str, create: Callable[[], UUID]) -> UUID | None:
        known = self.ids.get(key)
        if known is None:
            created = _safe(f"artifact {key}", create)
            if created is not None:
                self.ids[key] = created
            return created
        return known if _safe(f"artifact {key}", lambda: _update(known, data, description)) else None


@dataclass
class RunMonitor:
    """Artifacts and events of one flow run."""

    run_name: str
    store_url: str
    total_epochs: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    artifacts: ArtifactSet = field(default_factory=ArtifactSet)
    min_interval: float = 2.0  # seconds between artifact updates; events and listeners are never delayed
    _progress_id: UUID | None = None
    _last_publish: float = -1e9
    _unpublished: VersionInfo | None = None  # newest commit whose tables are not published yet
    _unpublished_epoch: int | None = None  # newest epoch whose progress is not published yet
    notes: list[str] = field(default_factory=list)  # end-of-run lines, e.g. what the mirror lacks

    @property
    def key_prefix(self) -> str:
        return f"ckptflow-{slug(self.run_name)}"

    def start(self, existing: list[VersionInfo], first_epoch: int) -> None:
        self.rows = [checkpoint_row(v) for v in existing]
        done = first_epoch - 1
        self._progress_id = _safe(
            "progress artifact",
            lambda: _artifacts().create_progress_artifact(
                progress=self._percent(done),
                key=f"{self.key_prefix}-progress",
                description=f"Epochs of {self.store_url}",
            ),
        )
        if self.rows:
            self._publish_tables()
        _notify("start", {"first_epoch": first_epoch, "total": self.total_epochs, "url": self.store_url})

    def epoch_done(self, epoch: int, metrics: dict[str, float]) -> None:
        self._unpublished_epoch = epoch
        self._maybe_publish()
        _notify("epoch", {"epoch": epoch, "total": self.total_epochs, "metrics": metrics})

    def committed(self, info: VersionInfo) -> None:
        self.rows = [r for r in self.rows if r["version"] != info.version] + [checkpoint_row(info)]
        self._unpublished = info
        self._maybe_publish()
        _safe("event", lambda: _emit_committed(info, self.store_url))
        _notify("committed", {"info": info})

    def _maybe_publish(self) -> None:
        """Artifact updates at most every ``min_interval`` s: a fast loop must not wait on the API."""
        if time.monotonic() - self._last_publish >= self.min_interval:
            self.flush()

    def flush(self) -> None:
        """Publish what is pending now (the progress, the tables and the latest checkpoint card)."""
        self._last_publish = time.monotonic()
        epoch, self._unpublished_epoch = self._unpublished_epoch, None
        if epoch is not None and self._progress_id is not None:
            pid = self._progress_id
            _safe("progress update", lambda: _artifacts().update_progress_artifact(pid, self._percent(epoch)))
        info, self._unpublished = self._unpublished, None
        if info is not None:
            self._publish_tables()
            source = f"flow run `{self.run_name}`"
            publish_latest(self.artifacts, self.store_url, info, count=len(self.rows), source=source)

    def catch_up(self, list_versions: Callable[[], list[VersionInfo]]) -> None:
        """Report versions committed but not reported yet: a save that finished while the run was stopping."""
        try:
            versions = list_versions()
        except Exception as exc:
            log.warning("could not list the committed versions of %s: %s", self.store_url, exc)
            return
        known = {r["version"] for r in self.rows}
        for info in sorted(versions, key=lambda v: v.version):
            if info.version not in known:
                self.committed(info)

    def archived(self, result: Any) -> None:
        """An archive job finished (an ``ArchiveResult``): link its upload, tell listeners."""
        _notify("archived", {"tar": result.tar, "versions": result.versions, "size": result.size})
        if result.uploaded:
            self.uploaded(result.uploaded, result.size)

    def uploaded(self, url: str, size: int) -> UUID | None:
        """A link artifact to an uploaded archive (its URL without credentials, and its size)."""
        shown = redact(url)
        name = shown.rstrip("/").rsplit("/", 1)[-1] or shown
        link = _safe(
            "upload link",
            lambda: _artifacts().create_link_artifact(
                link=shown,
                link_text=f"{name} ({human_size(size)})",
                key=f"{self.key_prefix}-upload",
                description=f"Archive of {self.store_url} uploaded to {shown} ({human_size(size)})",
            ),
        )
        _notify("uploaded", {"url": shown, "size": size})
        return link

    def note(self, line: str) -> None:
        """An end-of-run line: listeners get it now, the run summary ends with it."""
        self.notes.append(line)
        _notify("note", {"line": line})

    def summary(self, markdown: str, *, removed: list[int] | tuple[int, ...] = ()) -> None:
        """Publish the run summary and notes; drop the versions retention ``removed`` from the tables."""
        self.flush()
        if removed:
            self.rows = [r for r in self.rows if r["version"] not in removed]
            self._publish_tables()
        text = "\n\n".join([markdown, *(f"**{n}**" for n in self.notes)])
        self.artifacts.markdown(f"{self.key_prefix}-summary", text, "ckptflow run summary")

    def _publish_tables(self) -> None:
        rows = sorted(self.rows, key=lambda r: r["version"])
        description = f"Committed checkpoints in {self.store_url} (newest last)"
        self.artifacts.table(f"{self.key_prefix}-checkpoints", rows, description)
        self.artifacts.table(f"{store_key(self.store_url)}-checkpoints", rows, description)

    def _percent(self, epochs_done: int) -> float:
        return round(100.0 * max(0, epochs_done) / max(1, self.total_epochs), 2)


def publish_store(store_url: str, versions: list[VersionInfo], *, source: str) -> dict[str, UUID | None]:
    """Both per-store artifacts, from a listing of the store; returns their ids by key."""
    artifacts = ArtifactSet()
    rows = [checkpoint_row(v) for v in sorted(versions, key=lambda v: v.version)]
    key = store_key(store_url)
    table = artifacts.table(f"{key}-checkpoints", rows, f"Committed checkpoints in {store_url} (newest last)")
    latest = max(versions, key=lambda v: v.version, default=None)
    card = publish_latest(artifacts, store_url, latest, count=len(rows), source=source)
    return {f"{key}-checkpoints": table, f"{key}-latest": card}


def publish_latest(
    artifacts: ArtifactSet, store_url: str, info: VersionInfo | None, *, count: int, source: str
) -> UUID | None:
    return artifacts.markdown(
        f"{store_key(store_url)}-latest",
        latest_markdown(store_url, info, count=count, source=source),
        f"The latest committed checkpoint in {store_url}",
    )


def latest_markdown(store_url: str, info: VersionInfo | None, *, count: int, source: str) -> str:
    """The per-store "latest checkpoint" card."""
    title = f"# Latest checkpoint of `{store_url}`"
    if info is None:
        return f"{title}\n\nNo committed checkpoint yet (seen by {source})."
    return "\n".join(
        [
            title,
            "",
            "| | |",
            "|---|---|",
            f"| version | {info.version} (epoch {info.epoch}) |",
            f"| size | {human_size(info.size)} |",
            f"| created | {info.created} |",
            f"| metrics | {metrics_text(info.metrics) or 'none'} |",
            f"| URL | `{info.url}` |",
            f"| committed checkpoints in the store | {count} |",
            f"| reported by | {source} |",
            "",
            f"Restore it: `ckptflow restore {store_url} --out model.pt`",
        ]
    )


def _artifacts() -> Any:
    import prefect.artifacts

    return prefect.artifacts


def _update(artifact_id: UUID, data: str, description: str) -> bool:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import ArtifactUpdate

    with get_client(sync_client=True) as client:
        client.update_artifact(artifact_id, ArtifactUpdate(data=data, description=description))
    return True


def _emit_committed(info: VersionInfo, store_url: str) -> None:
    from prefect.events import emit_event

    emit_event(
        event=COMMITTED_EVENT,
        resource={
            "prefect.resource.id": f"ckptflow.checkpoint.{store_url}/v{info.version:06d}",
            "prefect.resource.name": f"{store_url} v{info.version:06d}",
            "ckptflow.store": store_url,
        },
        payload={
            "version": info.version,
            "epoch": info.epoch,
            "step": info.step,
            "size": info.size,
            "save_seconds": info.save_seconds,
            "metrics": info.metrics,
            "url": info.url,
        },
    )


def _safe(what: str, call: Callable[[], Any]) -> Any:
    try:
        return call()
    except Exception as exc:
        log.warning("could not publish the %s: %s", what, exc)
        return None
