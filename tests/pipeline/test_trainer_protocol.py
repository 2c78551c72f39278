"""The trainer protocol's boundary: what crosses it is typed, errors included.

Bug fixed: only a few error types survived the process boundary between the
training ranks and the flow (a spec error, a changed config, nothing to resume,
a state mismatch and two lease refusals); any other ``CheckpointError`` raised
in a trainer (a version another writer took, a corrupt shard, a manifest that
does not validate) reached the flow as a generic ``TrainerError`` whose message
began with the type's name, so the flow could not tell it from a bug in the
spec. Now every ``CheckpointError`` of ckptflow crosses as its own class, with
its own message and attributes (and its cause).

The job the flow gives its trainers is a typed model, validated where it
enters: a malformed job is refused, naming its wrong fields, before any rank is
started; it was a hand-built dict that a rank read field by field.
"""

from __future__ import annotations

import json
import os

import pytest

from ckptflow.flows.demo import DigitsSpec
from ckptflow.storage import (
    CheckpointError,
    CorruptShardError,
    ManifestError,
    SaveFailedError,
    StorageUnavailableError,
    StoreLockedError,
    UnreadableVersionError,
    VersionNotFoundError,
    VersionTakenError,
)
from ckptflow.tasks.spec import Trainable
from tests.pipeline.helpers import assert_only_committed, make_config, run_flow

RAISING_SPEC = "tests.pipeline.test_trainer_protocol:RaisingSpec"
RAISE_ENV = "CKPTFLOW_TEST_RAISE"  # "<epoch>:<what>", what: a key of ERRORS

CORRUPT_FILE = "v000002/shard-r0-00.h5"
ERRORS = {
    "version-taken": lambda: VersionTakenError("version 2 of the store was claimed by another writer"),
    "corrupt-shard": lambda: CorruptShardError(CORRUPT_FILE, expected="ab12", actual="cd34"),
    "manifest": lambda: ManifestError("manifest.json of version 1 does not validate: no 'shards'"),
}


class RaisingSpec(DigitsSpec):
    """DigitsSpec whose epoch ``CKPTFLOW_TEST_RAISE`` names raises the error it names, at every attempt."""

    def train_epoch(self, trainable: Trainable, epoch: int) -> dict[str, float]:
        when, _, what = os.environ.get(RAISE_ENV, "").partition(":")
        if when and int(when) == epoch:
            raise ERRORS[what]()
        return super().train_epoch(trainable, epoch)


@pytest.mark.prefect
@pytest.mark.parametrize("what", sorted(ERRORS))
def test_a_checkpoint_error_raised_in_a_trainer_reaches_the_flow_as_itself(
    prefect_server, tmp_path, monkeypatch, what
):
    """Fails on the code before the trainer protocol: it arrived as a TrainerError
    ("VersionTakenError: version 2 ..."), neither the class nor the message the rank raised."""
    monkeypatch.setenv(RAISE_ENV, f"2:{what}")
    config = make_config(tmp_path / "store", epochs=3, spec=RAISING_SPEC, train_process=True, epoch_retries=0)
    state, _ = run_flow(config)

    assert state.is_failed(), state
    error = state.result(raise_on_failure=False)
    expected = ERRORS[what]()
    assert type(error) is type(expected), repr(error)
    assert str(error) == str(expected)
    assert vars(expected).items() <= vars(error).items()  # its attributes too (file, expected, actual)
    assert assert_only_committed(config.storage, garbage_allowed=True) == [1]


class TestErrorsCrossAsThemselves:
    """Pure checks of the error envelope: JSON out of one process, the same error in the other."""

    def crossed(self, exc: BaseException) -> BaseException:
        from ckptflow.tasks.training.protocol import RemoteError

        try:
            raise exc
        except BaseException as raised:  # with a traceback, as a rank's error has one
            sent = RemoteError.of(raised).model_dump_json()
        return RemoteError.model_validate_json(sent).exception()

    @pytest.mark.parametrize(
        "exc",
        [
            VersionTakenError("version 3 was taken"),
            CorruptShardError("v000001/shard-r0-00.h5", expected="aa", actual="bb", what="size"),
            VersionNotFoundError(4, "file:///tmp/store", [1, 2, 3]),
            StorageUnavailableError("no space left on device: /tmp/store"),
            StoreLockedError("in use by another writer: ckptflow run (host h, pid 7)", holder=None),
        ],
        ids=lambda exc: type(exc).__name__,
    )
    def test_the_same_class_message_and_attributes(self, exc):
        got = self.crossed(exc)
        assert type(got) is type(exc)
        assert str(got) == str(exc)
        assert vars(exc).items() <= vars(got).items()

    def test_what_json_cannot_carry_arrives_as_none(self):
        reason = ManifestError("bad checksum")
        got = self.crossed(UnreadableVersionError(5, "file:///s", reason, 4))
        assert type(got) is UnreadableVersionError
        assert got.version == 5 and got.reason is None
        assert "version 5, the newest in file:///s, is unreadable: bad checksum" in str(got)

    def test_the_cause_crosses_too(self):
        """An async save's failure carries the lease refusal as its cause: a save task's retry
        condition looks for it there, and must find it for a save made in a trainer too."""
        failed = SaveFailedError("the background save of version 2 failed")
        failed.__cause__ = StoreLockedError("in use by another writer")
        got = self.crossed(failed)
        assert type(got) is SaveFailedError and type(got.__cause__) is StoreLockedError
        assert str(got.__cause__) == "in use by another writer"

    def test_an_unknown_checkpoint_error_arrives_as_its_nearest_known_base_naming_its_type(self):
        class SpecsOwnError(CheckpointError):
            pass

        class SpecsManifestError(ManifestError):
            pass

        got = self.crossed(SpecsOwnError("a spec's own"))
        assert type(got) is CheckpointError and str(got) == "SpecsOwnError: a spec's own"
        got = self.crossed(SpecsManifestError("no shards"))
        assert type(got) is ManifestError and str(got) == "SpecsManifestError: no shards"

    def test_any_other_error_is_a_trainer_error_naming_its_type_and_line(self):
        from ckptflow.tasks.retrying import failure_key
        from ckptflow.tasks.training.protocol import TrainerError

        got = self.crossed(ValueError("Tried to step 97 times"))
        assert type(got) is TrainerError
        assert str(got) == "ValueError: Tried to step 97 times" and got.kind == "ValueError"
        assert got.place.startswith(__file__)
        assert failure_key(got) == ("ValueError", str(got), got.place)


class TestTheJobIsValidated:
    def job(self, tmp_path, **changes):
        from ckptflow.tasks.training.protocol import TrainerJob

        job = json.loads(TrainerJob.for_run(make_config(tmp_path / "s"), {}, writers=[1]).model_dump_json())
        for dotted, value in changes.items():
            *path, last = dotted.split("__")
            at = job
            for part in path:
                at = at[part]
            at[last] = value
        return json.dumps(job)

    def test_a_valid_job_round_trips(self, tmp_path):
        from ckptflow.tasks.training.protocol import TrainerJob

        job = TrainerJob.parse(self.job(tmp_path))
        assert job.config == make_config(tmp_path / "s") and job.writers == [1] and job.storage_options == {}

    @pytest.mark.parametrize(
        ("changes", "named"),
        [
            ({"config__nproc": 0}, "config.nproc: Input should be greater than or equal to 1"),
            ({"config__dist_backend": "mpi"}, "config.dist_backend: Input should be 'auto', 'gloo'"),
            ({"writers": "flow"}, "writers: Input should be a valid array"),
            ({"config__epochs": "many"}, "config.epochs: Input should be a valid integer"),
            ({"storage_options": None}, "storage_options: Input should be an object"),
            ({"nprocs": 2}, "nprocs: Extra inputs are not permitted"),
        ],
        ids=["nproc", "backend", "writers", "epochs", "storage-options", "extra"],
    )
    def test_a_malformed_job_is_refused_naming_the_field(self, tmp_path, changes, named):
        from ckptflow.tasks.training.protocol import JobError, TrainerJob

        with pytest.raises(JobError) as refused:
            TrainerJob.parse(self.job(tmp_path, **changes))
        message = str(refused.value)
        assert message.startswith("the trainers' job is malformed (") and named in message, message
        assert message.endswith("nothing was built")

    def test_a_job_that_is_not_json_is_refused(self):
        from ckptflow.tasks.training.protocol import JobError, TrainerJob

        with pytest.raises(JobError, match="the trainers' job is malformed"):
            TrainerJob.parse(b"{'config': None}")

    def test_the_launcher_refuses_a_malformed_job_and_the_flow_is_told_why(self, tmp_path):
        """Through the real launcher: the build fails with the refusal as the launcher's record,
        and no rank is started (nothing is written in the store)."""
        from ckptflow.tasks.training.trainer import TrainerDiedError, TrainerProcess

        process = TrainerProcess()
        try:
            assert process.process.stdin is not None
            process.process.stdin.write(self.job(tmp_path, config__nproc=0).encode())
            process.process.stdin.close()
            with pytest.raises(TrainerDiedError) as died:
                process.built().result(timeout=120)
        finally:
            process.close(interrupted=True)
        refusal = "the trainers' job is malformed (config.nproc: Input should be greater than or equal to 1)"
        assert refusal in str(died.value)
        assert process.process.returncode == 1
        assert not (tmp_path / "s").exists()


class TestTheChannel:
    def test_a_frame_cut_short_ends_the_reading(self):
        """A rank killed while it wrote leaves half a frame: the flow reads what came before it."""
        from multiprocessing.connection import Pipe

        from ckptflow.tasks.training.protocol import Note
        from ckptflow.tasks.training.trainer import _received

        flow, rank = Pipe()
        rank.send_bytes(Note(id=1, level="info", message="resuming").model_dump_json().encode())
        rank.send_bytes(b'{"frame": "answer", "id": 2, "rep')
        assert list(_received(flow)) == [Note(id=1, level="info", message="resuming")]

    def test_a_frame_of_another_protocol_is_refused_naming_what_is_wrong(self):
        """Not taken for the end of the channel (the flow then waited for trainers that went on)."""
        from multiprocessing.connection import Pipe

        from pydantic import ValidationError

        from ckptflow.tasks.training.protocol import problems
        from ckptflow.tasks.training.trainer import _received

        flow, rank = Pipe()
        rank.send_bytes(json.dumps({"frame": "answer", "id": 2, "ok": {"step": 3}}).encode())
        with pytest.raises(ValidationError) as refused:
            list(_received(flow))
        assert "answer.ok: Extra inputs are not permitted" in problems(refused.value)


class TestSavesWaitedForLate:
    """A save's outcome stays with the trainers until the run stops: the flow may wait for version V
    (a commit task retried late) after the save of V+1 started, in either save mode."""

    @pytest.mark.parametrize("async_save", [True, False])
    def test_an_ended_save_is_still_answered_after_the_next_one_started(self, tmp_path, async_save):
        from ckptflow.tasks.training.in_process import InProcessTrainer

        trainer = InProcessTrainer(make_config(tmp_path / "s", epochs=3, async_save=async_save))
        log = lambda level, message: None  # noqa: E731
        trainer.build(flow_run=None, log=log)
        try:
            for epoch in (1, 2):
                trainer.train(epoch, keep_snapshot=False, log=log)
                trainer.save(epoch, log=log).wait(60)
            found = trainer.wait(1, timeout=60)
            assert found is not None and found.version == 1 and found.epoch == 1
            assert trainer.wait(2, timeout=60).version == 2
        finally:
            trainer.stop()
