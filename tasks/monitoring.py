"""What a run reports to Prefect, so a long job can be watched from the UI.

Per run: a table artifact of the committed checkpoints (updated at every
commit), a progress artifact for the epochs, a markdown summary at exit, and
one ``ckptflow.checkpoint.committed`` event per commit. Artifact keys are
derived from the flow run's name (lowercase letters, digits and dashes, as
Prefect requires) so that runs never overwrite each other's artifacts.

Reporting must never break training: a failed API call is logged and skipped.
Nothing reported contains storage credentials: URLs are shown redacted.

In-process listeners (the CLI's progress display) get the same notifications.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from ckptflow.storage import VersionInfo

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
        _safe("event", lambda: _emit_committed(info, self.store_url))
        _notify("committed", {"info": info})

    def summary(self, markdown: str) -> None:
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

    def _percent(self, epochs_done: int) -> float:
        return round(100.0 * max(0, epochs_done) / max(1, self.total_epochs), 2)


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
