"""The Prefect artifacts a run shows, and their keys: what they say, not when they are sent.

Keys are short and stable. A store's: ``ckptflow-<alias>-<hash>``, where the
alias is the last part of its URL (``.../checkpoints/run1`` -> ``run1``) and
the hash 8 hex digits of the (redacted) URL, so two stores named alike stay
apart; the full URL goes into each description. A run's: ``ckptflow-`` plus
the flow run's name. Prefect wants lowercase letters, digits and dashes.

Creating an artifact with a key makes a new version of that key; a run
creates each of its keyed artifacts once and then updates it in place, so its
Artifacts tab shows one card per key however many commits it makes. The calls
to the Prefect API are :mod:`.prefect_runs`'s; a failed one is logged and skipped
(:func:`safely`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlsplit
from uuid import UUID

from ckptflow.storage import VersionInfo

from .formatting import epoch_text, human_size, metric_value, metrics_text, utc_text
from .prefect_runs import create_artifact, current_run_ids, update_artifact

log = logging.getLogger(__name__)


def slug(text: str, *, limit: int = 60) -> str:
    """A Prefect artifact key part: lowercase letters, digits and single dashes."""
    out = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return out[:limit].rstrip("-") or "run"


def run_key(run_name: str) -> str:
    """The artifact key of a flow run: ``ckptflow-<its name>``."""
    return f"ckptflow-{slug(run_name)}"


def store_alias(store_url: str) -> str:
    """The last part of a store's URL, as a key part: ``s3://b/exp/run1`` -> ``run1``."""
    parts = [p for p in re.split(r"[/\\]", store_url.split("://", 1)[-1]) if p]
    return slug(parts[-1] if parts else store_url, limit=24).strip("-") or "store"


def store_key(store_url: str) -> str:
    """The artifact key of a store: ``ckptflow-<alias>-<8 hex digits of the URL's hash>``."""
    digest = hashlib.sha256(store_url.encode()).hexdigest()[:8]
    return f"ckptflow-{store_alias(store_url)}-{digest}"


def one_line(text: object) -> str:
    """``text`` with its whitespace (newlines of a traceback, say) collapsed to single spaces."""
    return " ".join(str(text).split())


def link_or_text(url: str, text: str | None = None) -> str:
    """Markdown for a place: a link where a browser opens it (http, https); anywhere else (a local
    path, file://, s3://, ...) the URL as code to copy. The Prefect UI resolves a link to a path
    against its own address, which answers "Page not found", and browsers open no file:// link
    from an http page."""
    if urlsplit(url).scheme in ("http", "https"):
        return f"[{text or url}]({url})"
    code = f"`{url.replace('`', '')}`"
    return f"{text}: {code}" if text and text != url else code


def cell(text: object) -> str:
    """``text`` for one cell of a markdown table: one line, its ``|`` escaped."""
    return one_line(text).replace("|", "\\|")


def committed_at(info: VersionInfo) -> datetime:
    """When ``info`` was committed (its manifest's ``created``), in UTC; the earliest time if unreadable."""
    try:
        when = datetime.fromisoformat(info.created)
    except (TypeError, ValueError):
        return datetime.min.replace(tzinfo=timezone.utc)
    return when if when.tzinfo is not None else when.replace(tzinfo=timezone.utc)


def checkpoint_row(info: VersionInfo) -> dict[str, Any]:
    """One row of a checkpoint table: each metric a numeric column of its own (sortable); the epoch
    as ``ckptflow ls`` shows it (a number for a save at an epoch's end, ``3 (1,200/4,000)`` inside one)."""
    seconds = info.save_seconds
    epoch = info.epoch if info.in_epoch is None else epoch_text(info)
    row: dict[str, Any] = {"epoch": epoch, "version": info.version}
    row.update({name: _number(value) for name, value in info.metrics.items()})
    row.update(
        {
            "size": human_size(info.size),
            "save seconds": round(seconds, 3) if seconds is not None else None,
            # what the save wrote: a version that references older versions' bytes wrote only its own
            "throughput": f"{info.new_bytes / seconds / 1e6:.0f} MB/s" if seconds else "",
            "committed": utc_text(info.created),
            "url": info.url,
        }
    )
    return row


def table_rows(versions: list[VersionInfo]) -> list[dict[str, Any]]:
    """The rows of ``versions``, oldest first, every row with every metric column (None if absent).

    Prefect's table shows the columns of the rows' keys; a metric a later epoch adds gets a
    column in every row, so that the columns line up.
    """
    rows = [checkpoint_row(v) for v in sorted(versions, key=lambda v: v.version)]
    names = list(dict.fromkeys(name for v in versions for name in v.metrics))
    return [_with_columns(row, names) for row in rows]


def _with_columns(row: dict[str, Any], names: list[str]) -> dict[str, Any]:
    head = {"epoch": row["epoch"], "version": row["version"]}
    rest = {k: v for k, v in row.items() if k not in head and k not in names}
    return {**head, **{n: row.get(n) for n in names}, **rest}


def _number(value: float) -> float | str:
    """A metric for a numeric column: four significant digits (JSON has no NaN or infinity)."""
    text = metric_value(value)
    return float(text) if text not in ("nan", "inf", "-inf") else text


class ArtifactSet:
    """The keyed artifacts of one flow run: each is created once, then updated in place.

    One card per key in the run's Artifacts tab however many commits it makes;
    on a key's page in the UI, one version per run. ``flow_run_id`` makes the
    artifacts another run's (a crashed run's summary, written by the next run).
    """

    def __init__(self, flow_run_id: UUID | None = None) -> None:
        self.ids: dict[str, UUID] = {}
        self.flow_run_id = flow_run_id

    def table(self, key: str, rows: list[dict[str, Any]], description: str) -> UUID | None:
        return self.put(key, "table", json.dumps(rows), description)

    def markdown(self, key: str, text: str, description: str) -> UUID | None:
        return self.put(key, "markdown", text, description)

    def link(self, key: str, link: str, text: str, description: str, *, each: bool = False) -> UUID | None:
        """A link (:func:`link_or_text`); with ``each``, a new one every time (one per uploaded
        archive), not an update."""
        if each:
            self.ids.pop(key, None)
        return self.put(key, "markdown", link_or_text(link, text), description)

    def progress(self, key: str, percent: float, description: str) -> UUID | None:
        return self.put(key, "progress", percent, description)

    def put(self, key: str, kind: str, data: Any, description: str) -> UUID | None:
        """Create the artifact ``key`` (the first time) or update it; None if the API failed."""
        known = self.ids.get(key)
        if known is not None:
            return safely(f"artifact {key}", lambda: update_artifact(known, data, description))
        created = safely(f"artifact {key}", lambda: self._create(key, kind, data, description))
        if created is not None:
            self.ids[key] = created
        return created

    def _create(self, key: str, kind: str, data: Any, description: str) -> UUID:
        flow_run_id, task_run_id = self.flow_run_id, None
        if flow_run_id is None:
            flow_run_id, task_run_id = current_run_ids()
        return create_artifact(
            key=key,
            kind=kind,
            data=data,
            description=description,
            flow_run_id=flow_run_id,
            task_run_id=task_run_id,
        )


def safely(what: str, call: Callable[[], Any]) -> Any:
    """Reporting never breaks training: a failed API call is logged and skipped (None)."""
    try:
        return call()
    except Exception as exc:
        log.warning("could not publish the %s: %s", what, exc)
        return None


def latest_markdown(store_url: str, info: VersionInfo | None, *, count: int, source: str) -> str:
    """The per-store "latest checkpoint" card."""
    title = f"# Latest checkpoint of `{store_url}`"
    if info is None:
        return f"{title}\n\nNo committed checkpoint yet (seen by {source})."
    return "\n".join(
        [
            title,
            "",
            "| field | value |",
            "|---|---|",
            f"| version | {info.version} (epoch {info.epoch}) |",
            f"| size | {human_size(info.size)} |",
            f"| committed | {utc_text(info.created)} |",
            f"| metrics | {cell(metrics_text(info.metrics)) or 'none'} |",
            f"| URL | {cell(link_or_text(info.url))} |",
            f"| committed checkpoints in the store | {count} |",
            f"| reported by | {source} |",
            "",
            f"Restore it: `ckptflow restore {store_url} --out model.pt`",
        ]
    )


def ending_markdown(
    *,
    state: str,
    why: str,
    store_url: str,
    latest: VersionInfo | None,
    rows: list[tuple[str, str]] = (),  # type: ignore[assignment]
    unreadable: str | None = None,
) -> str:
    """A run's summary, however it ended (Completed, Cancelled, Failed, Crashed): where it stands
    and how to go on. ``unreadable``: why the store could not be read (``latest`` is then the
    newest commit the run knew of, if any)."""
    if latest is None and unreadable is not None:
        where = f"unknown: the store could not be read ({unreadable})"
        resume = f"A new run on `{store_url}` resumes from its newest committed checkpoint."
    elif latest is None:
        where = "none committed"
        resume = f"Nothing to resume from: a new run on `{store_url}` starts at epoch 1."
    else:
        where = f"version {latest.version}, epoch {latest.epoch}: `{latest.url}` ({human_size(latest.size)})"
        resume = (  # a summary written late (a crashed run's) must not promise where a resume goes on
            f"Resume: run the same flow (or `ckptflow run`) on `{store_url}` again; it continues "
            f"from the store's newest committed checkpoint (this run's last: epoch {latest.epoch}). "
            f"Restore this one: `ckptflow restore {store_url} --version {latest.version} --out model.pt`"
        )
    lines = [
        f"# ckptflow run summary: {state}",
        "",
        "| field | value |",
        "|---|---|",
        f"| ended | {cell(state)}: {cell(why)} |",
        f"| storage | `{store_url}` |",
        *(f"| {cell(name)} | {cell(value)} |" for name, value in rows),
        f"| last committed checkpoint | {cell(where)} |",
        f"| its metrics | {metrics_text(latest.metrics) if latest else 'none'} |",
        "",
        resume,
    ]
    return "\n".join(lines)
