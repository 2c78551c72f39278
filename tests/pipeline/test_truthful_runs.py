"""A training run says what its retention did, and an unreadable newest version no longer blocks it.

- Retention with archives used to keep every version silently (a tarball is removed only
  whole); the run now says what it kept, what it removed and what a shared tarball held back.
- An unreadable newest manifest made every resumed run re-train that epoch and then fail
  with ``VersionExistsError: version N is already committed``; the run now resumes from the
  newest readable version and sets the unreadable one aside, saying so in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
from prefect.logging.handlers import APILogHandler

from ckptflow.storage import CheckpointStore
from ckptflow.tasks.config import ArchiveConfig, RetentionConfig
from ckptflow.tasks.reporting.monitoring import add_listener
from tests.pipeline.helpers import make_config, poll, run_summary

pytestmark = pytest.mark.prefect


def _logs(run_id: Any, wanted: str) -> list[str]:
    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        return poll(
            lambda: [
                x.message for x in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
            ],
            lambda messages: any(wanted in m for m in messages),
        )


def test_retention_with_archives_says_what_it_kept_and_why(prefect_server, tmp_path: Path) -> None:
    storage = tmp_path / "store"
    heard: list[dict[str, Any]] = []
    remove = add_listener(lambda kind, data: heard.append(data) if kind == "retention" else None)
    try:
        summary, run_id = run_summary(
            make_config(
                storage,
                epochs=8,
                archive=ArchiveConfig(every=3),
                retention=RetentionConfig(keep_last=3),
                async_save=False,
            )
        )
    finally:
        remove()
    # tarballs: 1-3 and 4-6; 7 and 8 loose. keep_last 3 keeps 6, 7, 8: the 4-6 tarball stays whole
    store = CheckpointStore(storage)
    assert [v.version for v in store.versions()] == [4, 5, 6, 7, 8]
    assert summary["pruned"] == [1, 2, 3]
    # the policy runs before each save (a tarball whole, once its archive job has ended) and at the end
    assert sorted(v for report in heard for v in report["removed"]) == [1, 2, 3]
    assert any(
        r["text"].startswith("retention (keep_last=3): removed versions") for r in heard if r["removed"]
    )
    last = heard[-1]
    assert last["kept"] == [4, 5, 6, 7, 8]
    assert "versions 4, 5 (epochs-000004-000006.tar holds kept version 6)" in last["text"]
    assert "a tarball is removed only whole" in last["text"]
    assert any(m.startswith("retention (keep_last=3)") for m in _logs(run_id, "retention ("))


def test_an_unreadable_newest_version_is_set_aside_and_the_run_resumes(
    prefect_server, tmp_path: Path
) -> None:
    storage = tmp_path / "store"
    run_summary(make_config(storage, epochs=3))
    manifest = storage / "v000003" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes()[:100])  # a truncated manifest

    summary, run_id = run_summary(make_config(storage, epochs=4))
    assert summary["resumed_from"] == 2 and summary["last_epoch"] == 4
    store = CheckpointStore(storage)
    assert [v.version for v in store.versions()] == [1, 2, 3, 4]
    [aside] = [p for p in storage.iterdir() if p.name.startswith("v000003.unreadable-")]
    assert len((aside / "manifest.json").read_bytes()) == 100  # kept as it was, never deleted
    messages = _logs(run_id, "is unreadable")
    [line] = [m for m in messages if "is unreadable" in m]
    assert line.startswith("version 3 is unreadable (") and f"moved aside to {aside}" in line
    # and a further run goes on normally
    again, _ = run_summary(make_config(storage, epochs=5))
    assert again["resumed_from"] == 4 and again["last_epoch"] == 5


def test_frequent_saves_say_what_retention_removed_once_a_minute_not_at_every_save(
    prefect_server, tmp_path: Path
) -> None:
    """Issue 53: a run saving every few steps printed a retention line at every save (26 in a 30 s
    run). Retention still runs at every save; its line comes once a minute at most, naming every
    version removed since the last one, and at the run's end."""
    from tests.pipeline.specs import STEPPED_SPEC

    storage = tmp_path / "store"
    heard: list[dict[str, Any]] = []
    remove = add_listener(lambda kind, data: heard.append(data) if kind == "retention" else None)
    try:
        summary, _ = run_summary(
            make_config(
                storage,
                epochs=3,
                spec=STEPPED_SPEC,
                save_every_steps=2,
                retention=RetentionConfig(keep_last=2),
                async_save=False,
            )
        )
    finally:
        remove()
    store = CheckpointStore(storage)
    kept = [v.version for v in store.versions()]
    assert len(kept) == 2 and len(summary["pruned"]) >= 10, summary["pruned"]
    assert len(heard) <= 3, [r["text"] for r in heard]  # the first, maybe one a minute later, the end
    said = sorted(v for r in heard for v in r["removed"])
    assert said == sorted(summary["pruned"])  # every removal said, once
    assert heard[-1]["kept"] == kept
    from ckptflow.tasks.reporting.formatting import version_ranges

    for report in heard:  # spans, not one number per version: "removed versions 3-17"
        assert f"removed versions {version_ranges(report['removed'])}; kept " in report["text"], report
