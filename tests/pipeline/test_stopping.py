"""Stop conditions and save cadence: which epochs are trained and which are committed.

The flow's runs (marked ``prefect``) check what reaches storage: an early stop
commits the epoch it stopped at even when ``save_every`` would skip it, and
the end of the epoch budget is always committed. :class:`StopTracker` itself
is a pure state machine, tested without Prefect at the end.
"""

from __future__ import annotations

import pytest

from ckptflow.tasks.config import StopConfig
from ckptflow.tasks.stopping import StopTracker
from tests.pipeline.helpers import assert_only_committed, make_config, run_summary
from tests.pipeline.specs import MARKERS_ENV, SLOW_FROM_ENV, SLOW_SECONDS_ENV

# The reference spec's validation accuracy by epoch: 0.178, 0.237, 0.373, 0.596, 0.674, ...
# and its validation loss falls every epoch (2.274, 2.215, 2.149, ...).
TARGET_EPOCH = 4


@pytest.mark.prefect
class TestStopConditions:
    def test_target_stops_early_and_commits_the_last_epoch(self, prefect_server, tmp_path):
        stop = {"metric": "val_acc", "mode": "max", "target": 0.5}
        config = make_config(tmp_path / "s", epochs=10, save_every=3, stop=stop)
        summary, _ = run_summary(config)

        assert summary["last_epoch"] == TARGET_EPOCH
        assert (
            summary["stop_reason"].startswith("val_acc=")
            and "reached the target 0.5" in summary["stop_reason"]
        )
        # 3 by the cadence, 4 because training stopped there (the cadence alone would skip it).
        assert assert_only_committed(config.storage) == [3, TARGET_EPOCH]
        assert summary["latest_version"] == TARGET_EPOCH
        assert summary["latest_metrics"]["val_acc"] >= 0.5

    def test_patience_stops_after_epochs_without_improvement(self, prefect_server, tmp_path):
        # val_loss only falls, so with mode=max epoch 1 stays the best: no improvement in 2 and 3.
        stop = {"metric": "val_loss", "mode": "max", "patience": 2}
        config = make_config(tmp_path / "s", epochs=10, save_every=2, stop=stop)
        summary, _ = run_summary(config)

        assert summary["last_epoch"] == 3
        assert summary["stop_reason"].startswith("no improvement of val_loss for 2 epochs")
        assert assert_only_committed(config.storage) == [2, 3]

    def test_wall_clock_budget(self, prefect_server, tmp_path, monkeypatch):
        markers = tmp_path / "markers"
        markers.mkdir()
        for name, value in ((MARKERS_ENV, str(markers)), (SLOW_FROM_ENV, "1"), (SLOW_SECONDS_ENV, "0.6")):
            monkeypatch.setenv(name, value)
        config = make_config(tmp_path / "s", epochs=50, save_every=10, stop={"max_seconds": 1.0})
        summary, _ = run_summary(config)

        last = summary["last_epoch"]
        assert 1 <= last < 50
        assert summary["stop_reason"] == "the wall-clock budget of 1s is spent"
        started = sorted(int(p.name.split("-")[1]) for p in markers.iterdir())
        assert started == list(range(1, last + 1))  # no epoch began after the budget was spent
        assert assert_only_committed(config.storage) == [last]

    def test_save_every_commits_the_cadence_and_the_end(self, prefect_server, tmp_path):
        config = make_config(tmp_path / "s", epochs=5, save_every=2)
        summary, _ = run_summary(config)

        assert summary["last_epoch"] == 5
        assert summary["stop_reason"] == "reached epoch 5"
        assert assert_only_committed(config.storage) == [2, 4, 5]

    def test_resumed_run_counts_patience_from_the_committed_history(self, prefect_server, tmp_path):
        """Patience is replayed from the metrics of the committed epochs, not restarted on resume."""
        first = make_config(tmp_path / "s", epochs=2)
        run_summary(first)
        stop = {"metric": "val_loss", "mode": "max", "patience": 2}
        summary, _ = run_summary(make_config(tmp_path / "s", epochs=10, stop=stop))

        assert summary["resumed_from"] == 2
        assert summary["last_epoch"] == 3  # best was epoch 1: epochs 2 and 3 did not improve
        assert assert_only_committed(first.storage) == [1, 2, 3]


def tracker(max_epochs: int = 100, **stop) -> StopTracker:
    return StopTracker(StopConfig(**stop), max_epochs)


class TestStopTracker:
    def test_epoch_budget(self):
        t = tracker(max_epochs=3)
        assert [t.update(e, {}) for e in (1, 2)] == [None, None]
        assert t.update(3, {}) == "reached epoch 3"

    @pytest.mark.parametrize(
        ("mode", "target", "values", "stops_at"),
        [
            ("max", 0.5, [0.1, 0.49, 0.5, 0.9], 3),  # reaching the target exactly is enough
            ("min", 0.2, [0.9, 0.5, 0.21, 0.19], 4),
            ("max", 0.95, [0.1, 0.5, 0.9], None),
        ],
    )
    def test_target(self, mode, target, values, stops_at):
        t = tracker(metric="acc", mode=mode, target=target)
        reasons = [t.update(e, {"acc": v}) for e, v in enumerate(values, start=1)]
        first = next((e for e, r in enumerate(reasons, start=1) if r), None)
        assert first == stops_at
        if stops_at:
            assert reasons[stops_at - 1] == f"acc={values[stops_at - 1]:.6g} reached the target {target:g}"

    def test_patience_counts_epochs_since_the_best(self):
        t = tracker(metric="loss", mode="min", patience=2)
        assert t.update(1, {"loss": 1.0}) is None
        assert t.update(2, {"loss": 0.8}) is None  # improved: best is epoch 2
        assert t.update(3, {"loss": 0.9}) is None
        assert (
            t.update(4, {"loss": 0.8}) == "no improvement of loss for 2 epochs (best 0.8)"
        )  # equal is not better
        assert (t.best, t.best_epoch) == (0.8, 2)

    def test_missing_metric_is_ignored(self):
        t = tracker(metric="val_loss", patience=1, target=0.1)
        assert t.update(1, {"loss": 0.0}) is None
        assert t.best is None
        assert t.update(2, {"val_loss": 0.5}) is None
        assert t.update(3, {"loss": 0.0}) == "no improvement of val_loss for 1 epochs (best 0.5)"

    def test_seed_replays_the_history_of_a_resumed_run(self):
        t = tracker(metric="acc", mode="max", patience=3)
        t.seed({2: {"acc": 0.7}, 1: {"acc": 0.5}, 3: {"acc": 0.6}})
        assert (t.best, t.best_epoch) == (0.7, 2)
        assert t.update(4, {"acc": 0.65}) is None
        assert t.update(5, {"acc": 0.69}) == "no improvement of acc for 3 epochs (best 0.7)"

    def test_wall_clock_budget(self):
        t = tracker(max_seconds=10)
        assert t.update(1, {}) is None
        t.started -= 10  # as if ten seconds had passed
        assert t.update(2, {}) == "the wall-clock budget of 10s is spent"

    def test_target_wins_over_the_epoch_budget(self):
        t = tracker(max_epochs=2, metric="acc", mode="max", target=0.5)
        assert t.update(1, {"acc": 0.1}) is None
        assert t.update(2, {"acc": 0.6}).endswith("reached the target 0.5")

    def test_config_needs_a_metric_for_target_and_patience(self):
        with pytest.raises(ValueError, match=r"need stop\.metric"):
            StopConfig(target=0.5)
        with pytest.raises(ValueError, match=r"need stop\.metric"):
            StopConfig(patience=2)
