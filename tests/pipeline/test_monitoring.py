"""What a run reports to Prefect, read back through the API of a real server.

One 3-epoch run (module fixture) on a local store whose credentials come from
a Prefect Secret block (``storage_secret``); then: the checkpoint table artifact
(its latest version: one row per committed epoch, each metric a numeric
column, sizes, commit times and URLs), the progress at 100 with "epoch 3/3",
the training curve (one line per metric, and the store's values below it),
the link to the newest checkpoint, the markdown summary, one
``ckptflow.checkpoint.committed`` event per commit (epoch and metrics in its
resource's labels, its id derived from the commit), and the secret nowhere in
the run's parameters, artifacts, logs or events.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactCollectionFilter,
    ArtifactCollectionFilterKey,
    FlowRunFilter,
    FlowRunFilterId,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.events.filters import EventFilter, EventNameFilter, EventRelatedFilter

from ckptflow.storage import CheckpointStore
from ckptflow.tasks.reporting.formatting import human_size, metric_value
from ckptflow.tasks.reporting.monitoring import COMMITTED_EVENT, event_id, slug, store_key
from tests.pipeline.helpers import make_config, poll, run_summary

pytestmark = pytest.mark.prefect

EPOCHS = 3
SECRET = "s3cr3t-value"


@dataclass
class Run:
    run_id: UUID
    name: str
    store: CheckpointStore
    summary: dict[str, Any]

    @property
    def key_prefix(self) -> str:
        return f"ckptflow-{slug(self.name)}"


@pytest.fixture(scope="module")
def run(prefect_server, tmp_path_factory) -> Run:
    from prefect.blocks.system import Secret

    # LocalFileSystem keeps unknown options (like a credential) without using them.
    options = {"secret": SECRET, "auto_mkdir": True}
    Secret(value=json.dumps({"secret": SECRET})).save("ckptflow-test-store", overwrite=True)
    config = make_config(
        tmp_path_factory.mktemp("monitoring") / "store",
        epochs=EPOCHS,
        storage_options={"auto_mkdir": True},
        storage_secret="ckptflow-test-store",
    )
    summary, run_id = run_summary(config)
    with get_client(sync_client=True) as client:
        name = client.read_flow_run(run_id).name
    return Run(run_id, name, CheckpointStore(config.storage, storage_options=options), summary)


def latest_artifact(key: str) -> Any:
    with get_client(sync_client=True) as client:
        found = client.read_latest_artifacts(
            artifact_filter=ArtifactCollectionFilter(key=ArtifactCollectionFilterKey(any_=[key]))
        )
    assert len(found) == 1, f"artifact {key!r}: {found}"
    return found[0]


def run_artifacts(run_id: UUID) -> list[Any]:
    with get_client(sync_client=True) as client:
        return client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))


def committed_events(run_id: UUID) -> list[Any]:
    query = EventFilter(
        event=EventNameFilter(name=[COMMITTED_EVENT]),
        related=EventRelatedFilter(id=[f"prefect.flow-run.{run_id}"]),
    )
    with get_client(sync_client=True) as client:
        return client.read_events(query, limit=50).events


def run_logs(run_id: UUID) -> list[str]:
    with get_client(sync_client=True) as client:
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
    return [log.message for log in logs]


class TestArtifacts:
    def test_checkpoint_table_has_one_row_per_committed_epoch(self, run):
        table = latest_artifact(f"{run.key_prefix}-checkpoints")
        assert table.type == "table"
        rows = json.loads(table.data) if isinstance(table.data, str) else table.data
        versions = run.store.versions()
        assert [r["epoch"] for r in rows] == [1, 2, 3]
        assert [r["version"] for r in rows] == [v.version for v in versions]
        assert [r["size"] for r in rows] == [human_size(v.size) for v in versions]
        assert [r["url"] for r in rows] == [v.url for v in versions]
        assert all(r["url"].endswith(f"/v{v.version:06d}") for r, v in zip(rows, versions, strict=True))
        # each metric is a numeric column of its own (sortable in the UI), in four significant digits
        for row, info in zip(rows, versions, strict=True):
            assert set(info.metrics) == {"loss", "val_loss", "val_acc"}
            for name, value in info.metrics.items():
                assert isinstance(row[name], float)
                assert row[name] == float(metric_value(value))
            assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", row["committed"])
            assert list(row)[:5] == ["epoch", "version", "loss", "val_loss", "val_acc"]
        # Every commit updated the run's table in place: one artifact (one card in the UI) per run.
        tables = [a for a in run_artifacts(run.run_id) if a.key == f"{run.key_prefix}-checkpoints"]
        assert [t.id for t in tables] == [table.latest_id]

    def test_progress_reaches_100(self, run):
        progress = latest_artifact(f"{run.key_prefix}-progress")
        assert progress.type == "progress"
        assert float(progress.data) == 100.0
        assert progress.description == f"epoch {EPOCHS}/{EPOCHS}; Completed"  # short: a card shows one line

    def test_training_curve_shows_every_epoch_of_every_metric(self, run):
        curve = latest_artifact(f"{run.key_prefix}-curve")
        assert curve.type == "markdown"
        found = re.search(r"!\[training curve\]\(data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)\)", curve.data)
        assert found, curve.data[:300]
        svg = base64.b64decode(found.group(1)).decode()
        versions = run.store.versions()
        names = list(versions[0].metrics)
        lines = re.findall(r'<polyline points="([^"]+)"', svg)
        assert len(lines) == len(names)  # one panel, one line per metric
        assert all(len(points.split()) == EPOCHS for points in lines)
        for name in names:
            assert f">{name}</text>" in svg
        # the table under the chart: the store's metrics, epoch by epoch
        for info in versions:
            cells = " | ".join(metric_value(info.metrics[n]) for n in names)
            assert f"| {info.epoch} | {cells} |" in curve.data

    def test_latest_link_names_the_newest_checkpoint(self, run):
        link = latest_artifact(f"{run.key_prefix}-latest")
        newest = run.store.versions()[-1]
        text = f"v{newest.version} (epoch {newest.epoch}, {human_size(newest.size)})"
        assert link.data == f"{text}: `{newest.url}`"  # a local path: text to copy, no dead link

    def test_markdown_summary(self, run):
        summary = latest_artifact(f"{run.key_prefix}-summary")
        assert summary.type == "markdown"
        assert "# ckptflow run summary: Completed" in summary.data
        assert f"| epochs | 1..{EPOCHS} (a new run) |" in summary.data
        assert f"| ended | Completed: reached epoch {EPOCHS} |" in summary.data
        assert run.summary["latest_url"] in summary.data

    def test_artifacts_belong_to_the_flow_run(self, run):
        keys = sorted(a.key for a in run_artifacts(run.run_id))
        store = store_key(run.store.url)
        parts = ("checkpoints", "progress", "summary", "curve", "latest")
        run_keys = [f"{run.key_prefix}-{part}" for part in parts]
        assert keys == sorted([*run_keys, f"{store}-checkpoints", f"{store}-latest"])


class TestEvents:
    def test_one_committed_event_per_commit(self, run):
        events = poll(lambda: committed_events(run.run_id), lambda evs: len(evs) >= EPOCHS, timeout=30)
        payloads = sorted((e.payload for e in events), key=lambda p: p["version"])
        assert [(p["version"], p["epoch"]) for p in payloads] == [(1, 1), (2, 2), (3, 3)]
        infos = run.store.versions()
        assert [p["size"] for p in payloads] == [v.size for v in infos]
        assert [p["url"] for p in payloads] == [v.url for v in infos]
        assert [p["metrics"] for p in payloads] == [v.metrics for v in infos]
        assert sorted(e.resource.id for e in events) == [  # the id, which the default UI's feed shows
            f"ckptflow.checkpoint.{run.store.url}/v{v:06d} epoch {v}" for v in (1, 2, 3)
        ]
        # the feed shows epoch and metrics: they are labels of the resource
        for event, info in zip(sorted(events, key=lambda e: e.payload["version"]), infos, strict=True):
            assert event.id == event_id(run.store.url, info)  # one id per commit: sent twice, kept once
            assert event.resource["ckptflow.epoch"] == str(info.epoch)
            assert event.resource["ckptflow.metric.loss"] == metric_value(info.metrics["loss"])
            assert event.resource.name.startswith(f"store v{info.version} epoch {info.epoch} loss=")


class TestSecrets:
    def test_storage_options_secret_is_never_reported(self, run):
        from prefect.logging.handlers import APILogHandler

        APILogHandler().flush()
        logs = poll(lambda: run_logs(run.run_id), lambda ms: any(m.startswith("stopped:") for m in ms))
        assert any(m.startswith("stopped:") for m in logs), logs  # the run's logs did arrive
        assert not [m for m in logs if SECRET in m]

        artifacts = run_artifacts(run.run_id)
        assert len(artifacts) >= 3
        for artifact in artifacts:
            assert SECRET not in json.dumps(artifact.data), artifact.key
            assert SECRET not in (artifact.description or ""), artifact.key

        events = poll(lambda: committed_events(run.run_id), lambda evs: len(evs) >= EPOCHS, timeout=30)
        assert events
        for event in events:
            assert SECRET not in event.model_dump_json()

        assert SECRET not in json.dumps(run.summary)
        with get_client(sync_client=True) as client:
            assert SECRET not in json.dumps(client.read_flow_run(run.run_id).parameters)

    def test_credentials_are_refused_as_parameters(self, tmp_path):
        """Prefect stores parameters in clear: a credential there would show in the UI."""
        with pytest.raises(ValueError, match=r"must not hold credentials \(secret, client_kwargs.token\)"):
            make_config(
                tmp_path / "s", epochs=1, storage_options={"secret": SECRET, "client_kwargs": {"token": "x"}}
            )
        assert not (tmp_path / "s").exists()


def test_a_place_is_a_link_only_where_a_browser_opens_it():
    """Bug: every checkpoint URL was a markdown link; the UI resolved a local path against its own
    address ("Page not found"), and s3:// or file:// open nothing from its page."""
    from ckptflow.tasks.reporting.artifacts import link_or_text

    assert link_or_text("https://console.example/run1", "run1") == "[run1](https://console.example/run1)"
    assert link_or_text("/data/run1/v000003") == "`/data/run1/v000003`"
    assert link_or_text("file:///data/run1/v000003", "v3") == "v3: `file:///data/run1/v000003`"
    assert (
        link_or_text("s3://b/run1/archive/e.tar", "e.tar (5 MiB)")
        == "e.tar (5 MiB): `s3://b/run1/archive/e.tar`"
    )
    assert link_or_text("/odd`dir/v1") == "`/odddir/v1`"  # a backtick would end the code span
