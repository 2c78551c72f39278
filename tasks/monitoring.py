"""What a run reports to Prefect, so a long job can be watched from the UI.

Per run: a table artifact of the committed checkpoints (updated at every
commit), a progress artifact for the epochs, a markdown summary at exit, a
link artifact per uploaded archive, and one ``ckptflow.checkpoint.committed``
event per commit. These keys are derived from the flow run's name (lowercase
letters, digits and dashes, as Prefect requires) so that runs never overwrite
each other's artifacts.

Per store: ``ckptflow-store-<url tail>-<hash>-latest`` (markdown: the newest
committed checkpoint and how to restore it) and ``...-checkpoints`` (the table
of every committed version). Every run that writes to the store, the
maintenance flow and ``ckptflow publish`` update them, so the Artifacts page
has one always-current entry per store, whichever run wrote last. The short
hash of the (redacted) URL keeps two stores whose URLs slug alike apart.

Reporting must never break training: a failed API call is logged and skipped.
Nothing reported contains storage credentials: URLs are shown redacted.

In-process listeners (the CLI's progress display) get the same notifications.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from ckptflow.storage import VersionInfo
from ckptflow.storage.location import redact

from .formatting import human_size, metrics_text

log = logging.getLogger(__name__)

COMMITTED_EVENT = "ckptflow.checkpoint.committed"
Listener = Callable[[str, dict[str, Any]], None]
_listeners: list[Listener] = []


def add_listener(listener: Listener) -> Callable[[], None]:
    """Call ``listener(kind, data)`` on every notification; returns a remover."""
    _listeners.append(listener)
    return lambda: _listeners.remove(listener)


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


@dataclass
class RunMonitor:
    """Artifacts and events of one flow run."""

    run_name: str
    store_url: str
    total_epochs: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    _progress_id: UUID | None = None

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
            self._publish_table()
        _notify("start", {"first_epoch": first_epoch, "total": self.total_epochs, "url": self.store_url})

    def epoch_done(self, epoch: int, metrics: dict[str, float]) -> None:
        if self._progress_id is not None:
            pid = self._progress_id
            _safe("progress update", lambda: _artifacts().update_progress_artifact(pid, self._percent(epoch)))
        _notify("epoch", {"epoch": epoch, "total": self.total_epochs, "metrics": metrics})

    def committed(self, info: VersionInfo) -> None:
        self.rows = [r for r in self.rows if r["version"] != info.version] + [checkpoint_row(info)]
        self._publish_table()
        publish_latest(self.store_url, info, count=len(self.rows), source=f"flow run `{self.run_name}`")
        _safe("event", lambda: _emit_committed(info, self.store_url))
        _notify("committed", {"info": info})

    def uploaded(self, url: str, size: int) -> None:
        """A link artifact to an uploaded archive (its URL without credentials, its size)."""
        shown = redact(url)
        name = shown.rstrip("/").rsplit("/", 1)[-1] or shown
        _safe(
            "upload link",
            lambda: _artifacts().create_link_artifact(
                link=shown,
                link_text=f"{name} ({human_size(size)})",
                key=f"{self.key_prefix}-upload",
                description=f"Archive of {self.store_url} uploaded to {shown} ({human_size(size)})",
            ),
        )
        _notify("uploaded", {"url": shown, "size": size})

    def summary(self, markdown: str, *, removed: list[int] | tuple[int, ...] = ()) -> None:
        """Publish the run summary; drop the versions retention ``removed`` from the tables."""
        if removed:
            self.rows = [r for r in self.rows if r["version"] not in removed]
            self._publish_table()
        _safe(
            "summary artifact",
            lambda: _artifacts().create_markdown_artifact(
                markdown=markdown, key=f"{self.key_prefix}-summary", description="ckptflow run summary"
            ),
        )

    def _publish_table(self) -> None:
        rows = sorted(self.rows, key=lambda r: r["version"])
        _safe(
            "checkpoint table",
            lambda: _artifacts().create_table_artifact(
                table=rows,
                key=f"{self.key_prefix}-checkpoints",
                description=f"Committed checkpoints in {self.store_url} (newest last)",
            ),
        )
        publish_store_table(self.store_url, rows)

    def _percent(self, epochs_done: int) -> float:
        return round(100.0 * max(0, epochs_done) / max(1, self.total_epochs), 2)


def publish_store(store_url: str, versions: list[VersionInfo], *, source: str) -> dict[str, UUID | None]:
    """Both per-store artifacts from a listing of the store; returns their ids by key."""
    keys = store_key(store_url)
    rows = [checkpoint_row(v) for v in sorted(versions, key=lambda v: v.version)]
    table = publish_store_table(store_url, rows)
    latest = publish_latest(store_url, versions[-1] if versions else None, count=len(rows), source=source)
    return {f"{keys}-checkpoints": table, f"{keys}-latest": latest}


def publish_store_table(store_url: str, rows: list[dict[str, Any]]) -> UUID | None:
    return _safe(
        "store table",
        lambda: _artifacts().create_table_artifact(
            table=rows,
            key=f"{store_key(store_url)}-checkpoints",
            description=f"Committed checkpoints in {store_url} (newest last)",
        ),
    )


def publish_latest(store_url: str, info: VersionInfo | None, *, count: int, source: str) -> UUID | None:
    return _safe(
        "latest checkpoint",
        lambda: _artifacts().create_markdown_artifact(
            markdown=latest_markdown(store_url, info, count=count, source=source),
            key=f"{store_key(store_url)}-latest",
            description=f"The latest committed checkpoint in {store_url}",
        ),
    )


def latest_markdown(store_url: str, info: VersionInfo | None, *, count: int, source: str) -> str:
    """The per-store "latest checkpoint" card."""
    if info is None:
        return f"# Latest checkpoint of `{store_url}`\n\nNo committed checkpoint yet (seen by {source})."
    return "\n".join(
        [
            f"# Latest checkpoint of `{store_url}`",
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
