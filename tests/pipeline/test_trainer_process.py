"""Training in a child process (``train_process``, the CLI's default) behaves as training in the flow's.

- The same run ends bitwise where an in-process run ends; SIGKILLing the flow's
  process while epoch 4 trains takes the training process with it (nothing of
  the dead run keeps writing), and the resumed run ends where a straight one does.
- A failed epoch is retried in the training process from its start state.
- Ctrl-C of ``ckptflow run`` stops the training process after the save in
  flight commits; nothing outlives the CLI.
- Errors of the training process reach the flow: a bad spec as SpecError (not
  retried), a training process that dies as a failed run naming the signal,
  with what it committed before intact.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptflow.storage import CheckpointStore
from ckptflow.tasks.spec import SpecError
from ckptflow.tasks.training.run_state import ConfigMismatchError
from tests.pipeline.helpers import (
    REPO,
    assert_only_committed,
    assert_same_checkpoint,
    assert_same_metrics,
    children,
    descendants,
    gone,
    make_config,
    run_counts,
    run_flow,
    run_summary,
    start_slowed,
    wait_until,
)
from tests.pipeline.specs import (
    FAULTS_ENV,
    FAULTY_SPEC,
    MARKED_SPEC,
    MARKERS_ENV,
    SLOW_FROM_ENV,
    SLOW_SECONDS_ENV,
    SPEC_CONFIG,
    EpochFailure,
    marker,
)

pytestmark = pytest.mark.prefect
CKPTFLOW = str(Path(sys.executable).parent / "ckptflow")

EPOCHS = 6
KILLED_IN = 4


def default_sigint() -> None:
    """In a child before exec: SIGINT as a terminal's foreground job has it.

    Bug fix (of the test): a test run started in the background by a shell without job control
    inherits SIGINT ignored, and so did the CLI, which then never saw the test's Ctrl-C.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def assert_same_run(got: CheckpointStore, want: CheckpointStore, epochs: int) -> None:
    assert [v.version for v in got.versions()] == list(range(1, epochs + 1))
    for version in range(1, epochs + 1):
        assert_same_checkpoint(got, want, version)
    assert_same_metrics(got, want)


@pytest.mark.crash
@pytest.mark.parametrize("async_save", [True, False], ids=["async-save", "sync-save"])
def test_killed_flow_takes_its_training_process_along_and_the_resume_is_exact(
    prefect_server, tmp_path, async_save
):
    straight = make_config(tmp_path / "A", epochs=EPOCHS, async_save=async_save)
    b = make_config(tmp_path / "B", epochs=EPOCHS, async_save=async_save, train_process=True)
    assert straight.identity() == b.identity()
    run_summary(straight)  # in the flow's process: the reference

    child, markers = start_slowed(prefect_server, b, tmp_path, KILLED_IN, 120)
    try:
        assert len(children(child.proc.pid)) == 1, "the flow's process has one child: the launcher"
        trainers = descendants(child.proc.pid)
        assert len(trainers) == 2, f"the launcher and its rank: {trainers}"
        os.kill(child.proc.pid, signal.SIGKILL)  # the flow's process only, not its session
        child.proc.wait(30)
        wait_until(lambda: all(gone(pid) for pid in trainers), 10, "end of the trainers")
    finally:
        child.kill()
    assert not marker(markers, KILLED_IN + 1).exists()

    committed = assert_only_committed(b.storage, garbage_allowed=async_save)
    expected = list(range(1, KILLED_IN))
    assert committed in ([expected, expected[:-1]] if async_save else [expected]), committed

    resumed, _ = run_summary(b)
    assert resumed["resumed_from"] == committed[-1] and resumed["last_epoch"] == EPOCHS
    assert assert_only_committed(b.storage) == list(range(1, EPOCHS + 1))
    assert_same_run(CheckpointStore(b.storage), CheckpointStore(straight.storage), EPOCHS)


def test_failed_epoch_is_retried_in_the_training_process_from_its_start_state(
    prefect_server, tmp_path, monkeypatch
):
    clean = make_config(tmp_path / "clean", epochs=3)
    run_summary(clean)

    markers = tmp_path / "markers"
    markers.mkdir()
    monkeypatch.setenv(MARKERS_ENV, str(markers))
    monkeypatch.setenv(FAULTS_ENV, "2:2")
    config = make_config(tmp_path / "s", spec=FAULTY_SPEC, epochs=3, epoch_retries=2, train_process=True)
    summary, run_id = run_summary(config)

    attempts = [line.split() for line in (markers / "attempts").read_text().splitlines()]
    assert [int(epoch) for epoch, _, _ in attempts] == [1, 2, 2, 2, 3]
    pids = {int(pid) for _, pid, _ in attempts}
    assert len(pids) == 1 and os.getpid() not in pids, "every attempt in one training process"
    assert summary["last_epoch"] == 3
    assert sorted(run_counts(run_id, "train_epoch", 3)) == [1, 1, 3]
    assert_same_run(CheckpointStore(config.storage), CheckpointStore(clean.storage), 3)


def test_epoch_failing_more_often_than_its_retries_fails_the_run(prefect_server, tmp_path, monkeypatch):
    monkeypatch.setenv(FAULTS_ENV, "2:2")
    config = make_config(tmp_path / "s", spec=FAULTY_SPEC, epochs=3, epoch_retries=1, train_process=True)
    state, _ = run_flow(config)

    assert state.is_failed()
    with pytest.raises(RuntimeError, match=f"{EpochFailure.__name__}: planned failure of epoch 2") as err:
        state.result()
    assert "in the training process" in "".join(getattr(err.value, "__notes__", []))
    assert assert_only_committed(config.storage) == [1]


def test_a_bad_spec_fails_init_once_with_its_name(prefect_server, tmp_path):
    config = make_config(tmp_path / "s", spec="tests.pipeline.specs:NoSuchSpec", train_process=True)
    state, run_id = run_flow(config)

    assert state.is_failed()
    with pytest.raises(SpecError, match="NoSuchSpec"):
        state.result()
    assert run_counts(run_id, "init_model", 1) == [1]  # a user's mistake is not retried


def leftovers(temp: Path) -> list[str]:
    """What is in the trainers' temporary directory besides torch's compile cache (shared by every
    torch process of the user, not a run's)."""
    return sorted(n for n in os.listdir(temp) if not n.startswith("torchinductor_"))


def test_a_dead_training_process_is_replaced_by_the_retry_and_the_run_completes(
    prefect_server, tmp_path, monkeypatch
):
    """SIGKILL at the start of epoch 3: the task fails, its retry starts new trainers from commit 2."""
    markers = tmp_path / "markers"
    markers.mkdir()
    monkeypatch.setenv(FAULTS_ENV, "3:killonce")
    monkeypatch.setenv(MARKERS_ENV, str(markers))
    temp = tmp_path / "tmp"  # the trainers' temporary directory
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    config = make_config(tmp_path / "s", spec=FAULTY_SPEC, epochs=4, async_save=False, train_process=True)
    summary, run_id = run_summary(config)

    assert summary["last_epoch"] == 4
    assert run_counts(run_id, "train_epoch", 4) == [1, 1, 1, 2]  # epoch 3: one failed attempt, one retry
    assert run_counts(run_id, "init_model", 1) == [1]
    assert assert_only_committed(config.storage) == [1, 2, 3, 4]
    pids = [line.split() for line in (markers / "attempts").read_text().splitlines()]
    assert [int(e) for e, _, _ in pids] == [1, 2, 3, 3, 4]
    assert pids[2][1] != pids[3][1], "the retry trained in a new process"
    assert leftovers(temp) == [], "the trainers left files behind"


def test_a_dead_training_process_fails_the_run_and_keeps_what_it_committed(
    prefect_server, tmp_path, monkeypatch
):
    monkeypatch.setenv(FAULTS_ENV, "3:kill")
    temp = tmp_path / "tmp"  # the trainers' temporary directory
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))
    config = make_config(tmp_path / "s", spec=FAULTY_SPEC, epochs=4, async_save=False, train_process=True)
    state, run_id = run_flow(config)

    assert state.is_failed()
    with pytest.raises(RuntimeError, match=r"training ranks ended: rank 0 was killed by SIGKILL"):
        state.result()
    assert leftovers(temp) == [], "the failed trainers left files behind"
    assert run_counts(run_id, "train_epoch", 3) == [1, 1, 2]  # the retry's new trainers died too
    assert assert_only_committed(config.storage) == [1, 2]

    monkeypatch.delenv(FAULTS_ENV)
    summary, _ = run_summary(config)
    assert summary["resumed_from"] == 2 and summary["last_epoch"] == 4


def test_ctrl_c_of_the_cli_commits_the_save_in_flight_and_ends_the_training_process(prefect_server, tmp_path):
    """A terminal's Ctrl-C goes to the whole process group: the training process ignores it, and
    the CLI's flow stops it (SIGTERM) after which the async save of epoch 2 is committed, not cut off."""
    markers = tmp_path / "markers"
    markers.mkdir()
    store = tmp_path / "store"
    env = {
        **prefect_server.env(),
        "PYTHONPATH": str(REPO),
        MARKERS_ENV: str(markers),
        SLOW_FROM_ENV: "3",
        SLOW_SECONDS_ENV: "120",
    }
    spec = ["--spec", MARKED_SPEC, "--spec-config", json.dumps(SPEC_CONFIG), "--shards", "2"]
    args = [CKPTFLOW, "run", "--storage", str(store), "--epochs", "4", *spec]
    with open(tmp_path / "run.log", "wb") as log:
        proc = subprocess.Popen(
            args,
            env=env,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=default_sigint,
        )
    try:
        wait_until(lambda: marker(markers, 3).exists() or proc.poll() is not None, 120, "epoch 3")
        assert proc.poll() is None, (tmp_path / "run.log").read_text(errors="replace")[-3000:]
        trainers = descendants(proc.pid)
        assert len(trainers) == 2, trainers  # the launcher and its rank
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    output = (tmp_path / "run.log").read_text(errors="replace")
    assert code == 130, output[-3000:]  # 128 + SIGINT, after saving (issue 53: it was 1, a failure's)
    assert all(gone(pid) for pid in trainers), "the trainers outlived the CLI"
    assert assert_only_committed(store) == [1, 2], output[-3000:]

    env[SLOW_FROM_ENV] = "99"
    resumed = subprocess.run([*args, "-v"], env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "started before Prefect" in resumed.stderr, "the CLI's trainers were not adopted"
    assert "resuming from" in resumed.stderr, "the training process's notes did not reach the run's log"
    assert f"resuming from version 2 (the end of epoch 2) in {store}" in " ".join(resumed.stderr.split())
    assert assert_only_committed(store) == [1, 2, 3, 4]


def test_sigterm_to_the_cli_commits_where_it_stands_and_exits_143(prefect_server, tmp_path):
    """Issue 53: ``ckptflow run`` stopped by SIGTERM (SLURM's preemption, Kubernetes, a spot notice)
    committed where it stood and then exited 1, a failure's code, which a scheduler reads as "give
    up". It exits 128 + 15, after the save, and says what it committed."""
    from tests.pipeline.specs import STEP_SECONDS_ENV, STEPPED_SPEC

    store = tmp_path / "store"
    env = {**prefect_server.env(), "PYTHONPATH": str(REPO), SLOW_FROM_ENV: "2", STEP_SECONDS_ENV: "0.5"}
    args = [CKPTFLOW, "run", "--storage", str(store), "--epochs", "3", "--spec", STEPPED_SPEC]
    with open(tmp_path / "run.log", "wb") as log:
        proc = subprocess.Popen(
            [*args, "--save-every-steps", "5"], env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT
        )
    reader = CheckpointStore(str(store))
    try:
        wait_until(
            lambda: any(v.epoch == 2 and v.in_epoch for v in reader.versions()) or proc.poll() is not None,
            180,
            "a save inside epoch 2",
        )
        assert proc.poll() is None, (tmp_path / "run.log").read_text(errors="replace")[-3000:]
        before = reader.latest()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    output = (tmp_path / "run.log").read_text(errors="replace")
    assert code == 143, output[-3000:]
    saved = reader.latest()
    assert before is not None and saved is not None and saved.version > before.version, output[-3000:]
    assert saved.epoch == 2 and saved.in_epoch, (saved.epoch, saved.in_epoch)
    assert "cancelled" in output and "Traceback" not in output, output[-3000:]
    assert "death signal" not in output and "closing signal" not in output, output[-3000:]  # torch's agent
    # the next run says where it resumes: the version, its epoch and the step inside it
    env[SLOW_FROM_ENV] = "99"
    again = subprocess.run(args, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    where = f"resuming from version {saved.version} (epoch 2, step {saved.in_epoch} of "
    assert where in " ".join(again.stderr.split()), again.stderr[-3000:]


@pytest.mark.parametrize("in_process", [False, True], ids=["child", "in-process"])
def test_the_cli_trains_in_a_child_unless_told_in_process(prefect_server, tmp_path, in_process):
    markers = tmp_path / "markers"
    markers.mkdir()
    env = {**prefect_server.env(), "PYTHONPATH": str(REPO), MARKERS_ENV: str(markers)}
    spec = ["--spec", FAULTY_SPEC, "--spec-config", json.dumps(SPEC_CONFIG), "--shards", "2"]
    args = [CKPTFLOW, "run", "--storage", str(tmp_path / "s"), "--epochs", "2", *spec]
    proc = subprocess.Popen(
        [*args, "--in-process"] if in_process else args,
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    pids = {int(line.split()[1]) for line in (markers / "attempts").read_text().splitlines()}
    assert len(pids) == 1
    assert (pids == {proc.pid}) is in_process, f"epochs ran in {pids}, the CLI is {proc.pid}"
    assert assert_only_committed(tmp_path / "s") == [1, 2]


def test_a_changed_seed_is_refused_by_the_training_process_as_in_process(prefect_server, tmp_path):
    run_summary(make_config(tmp_path / "s", epochs=1, train_process=True))
    state, run_id = run_flow(make_config(tmp_path / "s", epochs=2, seed=1, train_process=True))

    assert state.is_failed()
    with pytest.raises(ConfigMismatchError, match=r"seed \(0 -> 1\)"):
        state.result()
    assert run_counts(run_id, "init_model", 1) == [1]
    assert assert_only_committed(tmp_path / "s") == [1]


def processes_with(token: str) -> list[int]:
    """The live processes whose environment holds ``token`` (children inherit it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if token.encode() in (entry / "environ").read_bytes() and not gone(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:
                pass  # exited, or not ours
    return found


@pytest.mark.parametrize(
    "args",
    [["--epochs", "0"], ["--spec-config", "[1]"], ["--no-such-option"]],
    ids=["bad-value", "bad-json", "usage"],
)
def test_a_refused_command_line_leaves_no_training_process(tmp_path, args):
    """``ckptflow run`` starts its training process before it parses its options; when they are
    refused, the process goes with the CLI, and all the user sees is the one-line error."""
    token = f"CKPTFLOW_TEST_TOKEN={os.getpid()}-{time.monotonic_ns()}"
    env = {**os.environ, "CKPTFLOW_TEST_TOKEN": token.split("=", 1)[1]}
    with open(tmp_path / "err", "wb") as err:  # a file, not a pipe: waiting for EOF would wait for the child
        code = subprocess.call(
            [CKPTFLOW, "run", "--storage", str(tmp_path / "s"), *args], env=env, stderr=err, timeout=120
        )
    stderr = (tmp_path / "err").read_text()
    assert code == 2, stderr
    assert "Traceback" not in stderr, stderr
    # within a second: the process still imports torch then; it does not get to finish
    wait_until(lambda: not processes_with(token), 1, "end of the training process started early")
    assert not (tmp_path / "s").exists()


def test_a_process_started_early_that_gets_no_job_ends_without_a_word(tmp_path):
    """A config that trains in the flow's process: the launcher started on the guess is discarded."""
    code = (
        "import sys\n"
        "from ckptflow.tasks.training import trainer\n"
        "from ckptflow.tasks.config import PipelineConfig\n"
        "trainer.spawn_early()\n"
        "spare = trainer._spare\n"
        f"trainer.prestart(PipelineConfig(storage={str(tmp_path / 's')!r}, train_process=False))\n"
        "assert trainer._spare is None and trainer._prestarted is None\n"
        "print('EXIT', spare.process.poll())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "", proc.stderr
    code_of_spare = int(proc.stdout.split("EXIT")[1])
    assert code_of_spare in (0, -signal.SIGTERM), code_of_spare


def test_the_training_process_is_deaf_to_ctrl_c_from_its_start():
    """A terminal's Ctrl-C reaches the training process too, and the flow decides. One that comes
    before the process's main ignores SIGINT (while Python starts, or imports) ends nothing either:
    the process starts with SIGINT blocked, and drops it when it ignores it."""
    from ckptflow.tasks.training.trainer import TrainerProcess

    trainer = TrainerProcess()
    deadline = time.monotonic() + 3  # from its fork to well into its imports
    while time.monotonic() < deadline and trainer.process.poll() is None:
        os.kill(trainer.pid, signal.SIGINT)
        time.sleep(0.001)
    assert trainer.process.poll() is None, f"SIGINT ended the training process: {trainer.process.returncode}"
    assert trainer.process.stdin is not None
    trainer.process.stdin.close()  # no job: it exits, as a discarded process does
    assert trainer.process.wait(120) == 0
    trainer.close()


FLOW_SIDE = r"""
import json, sys
from ckptflow.flows.train import train_pipeline
from ckptflow.tasks.config import PipelineConfig
state = train_pipeline(PipelineConfig.model_validate_json(sys.argv[1]), return_state=True)
assert state.is_completed(), state
print("SUMMARY", json.dumps(state.result()))
print("TORCH", "torch" in sys.modules)
"""


def test_the_flows_process_never_imports_torch_when_a_training_process_trains(prefect_server, tmp_path):
    """Its start is the Prefect side of the run's start-up, and its memory stays Prefect's own:
    train, save (sync and async), archive, retention and the summary all go without torch."""
    config = make_config(
        tmp_path / "s",
        epochs=4,
        train_process=True,
        async_save=False,
        archive={"every": 2},
        retention={"keep_last": 2},
    )
    env = {**prefect_server.env(), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", FLOW_SIDE, config.model_dump_json()],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.split("SUMMARY", 1)[1].splitlines()[0])
    assert summary["last_epoch"] == 4
    assert "TORCH False" in proc.stdout
    store = CheckpointStore(config.storage)
    assert [(v.version, v.archived) for v in store.versions()] == [(3, True), (4, True)]
    store.verify(4)
