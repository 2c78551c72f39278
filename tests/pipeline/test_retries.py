"""Retries: a failed epoch or a failed save is redone, and the run ends exactly as a run without failures.

- An epoch that fails after training all the way through (model, optimizer,
  scheduler and RNGs moved on) is retried from its start state; the final
  state is bitwise equal to a clean run's, which a retry that continued from
  the half-updated state could not be.
- A shard write that dies after writing part of its bytes is retried by the
  save (sync) or the commit (async) task; the store ends with one committed
  version per epoch, no leftovers, and the same bytes as a clean run.

- An epoch that fails the same way twice (the same exception, message and
  line) is not retried again: a retry replays the epoch from the same state,
  so it can only fail again.

Attempts are counted both by the fault injector and by Prefect's API (the task
run's ``run_count``).
"""

from __future__ import annotations

import errno
import threading
from pathlib import Path

import pytest

from ckptflow.storage import CheckpointStore
from ckptflow.storage.save import writer
from tests.pipeline.helpers import (
    assert_only_committed,
    assert_same_checkpoint,
    assert_same_metrics,
    make_config,
    poll,
    run_counts,
    run_flow,
    run_logs,
    run_summary,
)
from tests.pipeline.specs import (
    FAIL_EPOCH_ENV,
    FLAKY_SPEC,
    MARKERS_ENV,
    REPEATING_SPEC,
    EpochFailure,
    FlakyDigitsSpec,
)

pytestmark = pytest.mark.prefect

EPOCHS = 3


@pytest.fixture
def flaky():
    """FlakyDigitsSpec's class-level counters, reset around each test."""
    FlakyDigitsSpec.failures, FlakyDigitsSpec.attempts = {}, {}
    yield FlakyDigitsSpec
    FlakyDigitsSpec.failures, FlakyDigitsSpec.attempts = {}, {}


def assert_same_run(got: CheckpointStore, want: CheckpointStore) -> None:
    assert [v.version for v in got.versions()] == list(range(1, EPOCHS + 1))
    for v in range(1, EPOCHS + 1):
        assert_same_checkpoint(got, want, v)
    assert_same_metrics(got, want)


class TestEpochRetry:
    def test_failed_epoch_is_retried_from_its_start_state(self, prefect_server, tmp_path, flaky):
        """Bug fix: a second retry started from a corrupted snapshot.

        ``Optimizer.load_state_dict`` adopts the tensors it is given, so after the first restore
        the optimizer's state *was* the snapshot's, and the retried attempt's in-place updates
        changed the snapshot. Two failures of one epoch are needed to see it.
        """
        clean = make_config(tmp_path / "clean", spec=FLAKY_SPEC, epochs=EPOCHS)
        run_summary(clean)
        assert flaky.attempts == {1: 1, 2: 1, 3: 1}

        flaky.failures, flaky.attempts = {2: 2}, {}
        retried = make_config(tmp_path / "retried", spec=FLAKY_SPEC, epochs=EPOCHS, epoch_retries=2)
        summary, run_id = run_summary(retried)

        assert flaky.attempts == {1: 1, 2: 3, 3: 1}
        assert summary["last_epoch"] == EPOCHS
        assert_same_run(CheckpointStore(retried.storage), CheckpointStore(clean.storage))
        assert run_counts(run_id, "train_epoch", EPOCHS) == [1, 1, 3]

    def test_epoch_failing_more_often_than_its_retries_fails_the_run(self, prefect_server, tmp_path, flaky):
        flaky.failures = {2: 2}
        config = make_config(tmp_path / "s", spec=FLAKY_SPEC, epochs=EPOCHS, epoch_retries=1)
        state, _ = run_flow(config)

        assert state.is_failed()
        with pytest.raises(EpochFailure):
            state.result()
        assert flaky.attempts == {1: 1, 2: 2}
        assert assert_only_committed(config.storage) == [1]


class TestFailuresARetryCannotFix:
    @pytest.mark.parametrize("trainers", [False, True], ids=["in-process", "trainers"])
    def test_the_same_failure_twice_ends_the_run(self, prefect_server, tmp_path, monkeypatch, trainers):
        """Bug fix: an epoch failing on a bug (OneCycleLR stepped past its end: ``ValueError: Tried
        to step 97 times``) spent every epoch retry, each replaying the epoch from the same state
        only to fail the same way. The second identical failure now ends the run."""
        markers = tmp_path / "markers"
        markers.mkdir()
        monkeypatch.setenv(MARKERS_ENV, str(markers))
        monkeypatch.setenv(FAIL_EPOCH_ENV, "2")
        config = make_config(
            tmp_path / "s", spec=REPEATING_SPEC, epochs=EPOCHS, epoch_retries=3, train_process=trainers
        )
        state, run_id = run_flow(config)

        assert state.is_failed()
        assert "Tried to step 97 times" in str(state.result(raise_on_failure=False))
        assert (markers / "attempts").read_text().split() == ["1", "2", "2"]  # not 4 attempts of epoch 2
        assert run_counts(run_id, "train_epoch", 2) == [1, 2]
        assert assert_only_committed(config.storage, garbage_allowed=True) == [1]
        said = poll(lambda: run_logs(run_id), lambda logs: any("not retried" in x for x in logs))
        line = next(x for x in said if "not retried" in x)
        assert "epoch 2 failed as its previous attempt did" in line and "ValueError" in line, line


class FailOnceSink:
    """Wraps a shard's sink: writes half of one chunk of the target version, then raises EIO, once."""

    lock = threading.Lock()

    def __init__(self, inner, path: str, injector: Injector) -> None:
        self.inner, self.path, self.injector = inner, path, injector

    def write(self, data) -> None:
        with self.lock:
            fire = (
                not self.injector.fired
                and f"/v{self.injector.version:06d}/" in self.path
                and len(data) > 1024
            )
            if fire:
                self.injector.fired = True
        if not fire:
            self.inner.write(data)
            return
        half = memoryview(data)[: len(data) // 2]
        self.inner.write(half)
        self.injector.partial_file = Path(self.path)
        self.injector.partial_size = Path(self.path).stat().st_size
        raise OSError(errno.EIO, "injected write failure", self.path)

    def commit(self) -> None:
        self.inner.commit()

    def abort(self) -> None:
        self.inner.abort()


class Injector:
    def __init__(self, version: int) -> None:
        self.version = version
        self.fired = False
        self.partial_file: Path | None = None
        self.partial_size = 0
        self.sinks = 0


def fail_save_once(monkeypatch: pytest.MonkeyPatch, version: int) -> Injector:
    """Make the first shard write of ``version`` die half-way through a chunk."""
    injector = Injector(version)
    real_open = writer.open_sink

    def open_sink(fs, path, *, local):
        injector.sinks += 1
        return FailOnceSink(real_open(fs, path, local=local), path, injector)

    monkeypatch.setattr(writer, "open_sink", open_sink)
    return injector


class TestSaveRetry:
    @pytest.mark.parametrize("async_save", [False, True], ids=["sync-save", "async-save"])
    def test_save_killed_mid_write_is_retried(self, prefect_server, tmp_path, monkeypatch, async_save):
        """An async save's failure surfaces in the next save task, which writes it again first."""
        clean = make_config(tmp_path / "clean", epochs=EPOCHS, async_save=async_save)
        run_summary(clean)

        injector = fail_save_once(monkeypatch, version=2)
        failing = make_config(tmp_path / "failing", epochs=EPOCHS, async_save=async_save)
        summary, run_id = run_summary(failing)

        assert injector.fired, "the injected failure never happened"
        assert injector.partial_file is not None and injector.partial_file.parent.name == "v000002"
        assert injector.partial_size > 0  # bytes of the failed attempt did reach the disk
        assert summary["last_epoch"] == EPOCHS and summary["latest_version"] == EPOCHS

        # One committed version per epoch, nothing else on disk, the same bytes as a clean run.
        assert assert_only_committed(failing.storage) == [1, 2, 3]
        store = CheckpointStore(failing.storage)
        assert [v.epoch for v in store.versions()] == [1, 2, 3]
        assert_same_run(store, CheckpointStore(clean.storage))

        # sync: the save of epoch 2 is retried; async: the save task of epoch 3, which commits 2 first
        assert run_counts(run_id, "save_checkpoint", EPOCHS) == [1, 1, 2]

    def test_save_retries_setting_is_obeyed(self, prefect_server, tmp_path, monkeypatch):
        """Bug fix: ``save_retries`` was ignored (the save and commit tasks always retried 3 times).

        With ``save_retries=0`` a failed save fails the run; the store keeps the committed
        epoch before it and nothing of the failed one is listed.
        """
        injector = fail_save_once(monkeypatch, version=2)
        config = make_config(tmp_path / "s", epochs=EPOCHS, async_save=False, save_retries=0)
        state, run_id = run_flow(config)

        assert injector.fired
        assert state.is_failed()
        with pytest.raises(OSError, match="injected write failure"):
            state.result()
        assert assert_only_committed(config.storage, garbage_allowed=True) == [1]
        assert run_counts(run_id, "save_checkpoint", 2) == [1, 1]


class TestSaveTimeout:
    @pytest.mark.parametrize("async_save", [False, True], ids=["sync-save", "async-save"])
    def test_a_slow_save_times_out_and_the_retry_waits_for_the_same_write(
        self, prefect_server, tmp_path, monkeypatch, async_save
    ):
        """``save_timeout_seconds`` fails the waiting task; its retry waits for the write in progress
        instead of starting a second one: each version is written once and committed once."""
        real = writer.write_shards
        writes: dict[str, int] = {}

        def slow_write(loc, version_dir, *args, **kwargs):
            writes[version_dir] = writes.get(version_dir, 0) + 1
            if version_dir == "v000002":
                threading.Event().wait(3.0)  # longer than the timeout, shorter than timeout x attempts
            return real(loc, version_dir, *args, **kwargs)

        monkeypatch.setattr(writer, "write_shards", slow_write)
        config = make_config(
            tmp_path / "s", epochs=EPOCHS, async_save=async_save, save_timeout_seconds=1.0, save_retries=3
        )
        summary, run_id = run_summary(config)
        assert summary["last_epoch"] == EPOCHS
        assert writes == {"v000001": 1, "v000002": 1, "v000003": 1}, "a version was written twice"
        assert assert_only_committed(config.storage) == [1, 2, 3]
        # sync: the save of epoch 2 waited past its timeout; async: the save of 3, committing 2 first
        counts = run_counts(run_id, "save_checkpoint", EPOCHS)
        assert counts[:2] == [1, 1] and counts[2] >= 2, counts


class TestWhatIsNotRetried:
    """Which failures a retry is spent on; pure checks of the conditions the tasks use."""

    def test_a_repeated_io_error_of_the_data_is_still_retried(self):
        """Bug fixed: a transient error of the epoch's data (a reset connection, a read timeout at the
        same line) repeated once ended the epoch's retries as if it were a bug in the spec."""
        from ckptflow.tasks.retrying import is_transient
        from ckptflow.tasks.training.trainer import TrainerError

        assert is_transient(ConnectionResetError(104, "reset"))
        assert is_transient(TimeoutError("read timed out"))
        assert is_transient(TrainerError("reset", kind="ConnectionResetError"))
        assert not is_transient(ValueError("Tried to step 97 times"))
        assert not is_transient(TrainerError("Tried to step", kind="ValueError"))
        assert not is_transient(TrainerError("custom", kind="MyOwnError"))

    def test_a_save_another_writer_refuses_is_not_retried_however_it_is_wrapped(self):
        """Bug fixed: a lease refusal wrapped by an async save (SaveFailedError from it) or sent by a
        training process (TrainerError) was retried, rewriting every shard to be refused again."""
        from ckptflow.storage import LeaseLostError, SaveFailedError, StoreLockedError
        from ckptflow.tasks.steps import _save_may_pass
        from ckptflow.tasks.training.trainer import _remote_error

        class State:
            def __init__(self, error: BaseException) -> None:
                self.error = error

            def result(self, raise_on_failure: bool) -> BaseException:
                return self.error

        wrapped = SaveFailedError("the async save failed")
        wrapped.__cause__ = LeaseLostError("taken over")
        sent = _remote_error({"type": "StoreLockedError", "message": "in use", "traceback": ""})
        assert isinstance(sent, StoreLockedError)
        assert not _save_may_pass(None, None, State(wrapped))
        assert not _save_may_pass(None, None, State(sent))
        assert _save_may_pass(None, None, State(SaveFailedError("the disk failed")))
