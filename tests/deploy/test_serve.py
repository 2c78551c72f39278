"""The single-machine case: `python deployments/serve.py` serves both flows, with schedules, no worker.

The serve process registers ``ckptflow-train/train-served`` (its default
parameters come from the options, validated up front) and
``ckptflow-maintenance/maintenance-served`` (on its cron schedule); a run of
the served training deployment started with its default parameters trains
into the store the options named; Ctrl-C (SIGINT) stops serving and pauses both.
Invalid options are refused before anything is registered.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from uuid import UUID

import pytest
from prefect.client.orchestration import get_client

from tests.deploy.helpers import REPO, checked, poll_until, wait_for_state
from tests.pipeline.helpers import assert_only_committed

pytestmark = pytest.mark.deploy

SERVE = REPO / "deployments" / "serve.py"


def read_deployment(name: str):
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            return client.read_deployment_by_name(name)
        except ObjectNotFound:
            return None


def default_sigint() -> None:
    """Bug fix (of the test): started by a background shell without job control, pytest and so the
    served process inherited SIGINT ignored, and the Ctrl-C below did nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_serve_runs_the_served_deployment(stack, tmp_path):
    """A relative storage path resolves in the directory serve.py was started in (as for a copy
    that `ckptflow deployments init` wrote there), not in the checkout."""
    args = [sys.executable, str(SERVE), "--storage", "./served", "--epochs", "2"]
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            args,
            cwd=tmp_path,
            env=stack.env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=default_sigint,  # as a terminal's foreground job: the test's Ctrl-C must reach it
        )
    try:
        train = poll_until(lambda: read_deployment("ckptflow-train/train-served"), bool, timeout=90)
        maintenance = poll_until(lambda: read_deployment("ckptflow-maintenance/maintenance-served"), bool)
        assert train is not None and maintenance is not None, log.read_text()[-3000:]
        assert train.parameters == {"config": {"storage": "./served", "epochs": 2}}
        assert train.schedules == []
        assert [s.schedule.cron for s in maintenance.schedules] == ["0 3 * * *"]
        assert maintenance.parameters["config"]["retention"]["keep_last"] == 5

        started = checked(stack, "prefect", "deployment", "run", "ckptflow-train/train-served")
        run_id = UUID(started.split("UUID: ", 1)[1].split()[0])
        run = wait_for_state(run_id, "COMPLETED", "FAILED", "CRASHED", timeout=120)
        assert run.state.type.value == "COMPLETED", f"{run.state}\n{log.read_text()[-4000:]}"
        assert assert_only_committed(tmp_path / "served") == [1, 2]
        assert not (REPO / "served").exists()
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C (Prefect's SIGTERM path may exit before pausing)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
    paused = read_deployment("ckptflow-train/train-served")
    assert paused is not None and paused.paused, log.read_text()[-2000:]


def test_serve_refuses_invalid_options(stack, tmp_path):
    done = subprocess.run(
        [sys.executable, str(SERVE), "--storage", str(tmp_path / "s"), "--epochs", "0"],
        env=stack.env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "invalid parameters" in done.stderr and "epochs" in done.stderr
    served = read_deployment("ckptflow-train/train-served")  # absent, or as the previous test left it
    assert served is None or served.parameters["config"]["epochs"] != 0


def test_serve_stops_cleanly_on_sigterm(stack, tmp_path):
    """SIGTERM (systemd, `docker stop`, Kubernetes) stops serving as Ctrl-C does: exit 0, both
    deployments paused, and no warning on the way out (Prefect's runner left its ``astop``
    coroutine unawaited: "coroutine 'Runner.astop' was never awaited")."""
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, str(SERVE), "--storage", "./served", "--epochs", "2"],
            cwd=tmp_path,
            env=stack.env(PYTHONWARNINGS="default"),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:

        def serving() -> bool:  # registered and not paused (as a stop before this test left them)
            found = [read_deployment(f"ckptflow-{n}/{n}-served") for n in ("train", "maintenance")]
            return all(d is not None and not d.paused for d in found)

        assert poll_until(serving, bool, timeout=90), log.read_text()[-3000:]
        proc.send_signal(
            signal.SIGTERM
        )  # at once: the runner may not have started (CI once stopped it there)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    output = log.read_text()
    assert code == 0, output[-3000:]
    assert "never awaited" not in output and "Traceback" not in output, output[-3000:]
    for name in ("ckptflow-train/train-served", "ckptflow-maintenance/maintenance-served"):
        deployment = read_deployment(name)
        assert deployment is not None and deployment.paused, (name, output[-2000:])


def test_sigterm_stops_a_served_run_with_a_save_and_ends_it_cancelled(stack, tmp_path):
    """Issue 53: SIGTERM on serve.py while one of its runs trains SIGKILLed the run (no stop-save,
    no summary, its task Running until the heartbeat automation marked it Crashed) and serve.py
    said "stopped: the deployments are paused". Now the run stops as a worker's cancellation stops
    it: it commits the step it stands at and ends Cancelled, cleanly; then serve.py pauses its
    deployments and exits 0."""
    from ckptflow.storage import CheckpointStore
    from tests.deploy.test_cancel_deploy import assert_ended_cleanly
    from tests.pipeline.helpers import wait_until
    from tests.pipeline.specs import SLOW_FROM_ENV, STEP_SECONDS_ENV, STEPPED_SPEC

    log = tmp_path / "serve.log"
    env = stack.env(PYTHONPATH=str(REPO), **{SLOW_FROM_ENV: "2", STEP_SECONDS_ENV: "0.5"})
    args = [sys.executable, str(SERVE), "--storage", "./served", "--epochs", "3", "--spec", STEPPED_SPEC]
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT)
    store = CheckpointStore(tmp_path / "served")
    try:
        assert poll_until(lambda: read_deployment("ckptflow-train/train-served"), bool, timeout=90)
        config = {"storage": "./served", "epochs": 3, "spec": STEPPED_SPEC, "save_every_steps": 5}
        started = checked(
            stack,
            "prefect",
            "deployment",
            "run",
            "ckptflow-train/train-served",
            "--param",
            f"config={json.dumps(config)}",
        )
        run_id = UUID(started.split("UUID: ", 1)[1].split()[0])
        wait_until(
            lambda: any(v.epoch == 2 and v.in_epoch for v in store.versions()), 180, "a save in epoch 2"
        )
        before = store.latest()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    output = log.read_text()
    assert code == 0, output[-4000:]
    run = wait_for_state(run_id, "CANCELLED", "COMPLETED", "FAILED", "CRASHED", timeout=60)
    assert run.state.type.value == "CANCELLED", f"{run.state}\n{output[-4000:]}"
    last = CheckpointStore(tmp_path / "served").latest()
    assert before is not None and last is not None and last.version > before.version, output[-3000:]
    assert last.epoch == 2 and last.in_epoch, (last.epoch, last.in_epoch)  # the stop-save, mid-epoch
    assert_ended_cleanly(run_id, f"committed version {last.version} (epoch 2, step {last.in_epoch:,}/")
    assert _tracebacks(output) == [], output[-4000:]
    for name in ("ckptflow-train/train-served", "ckptflow-maintenance/maintenance-served"):
        deployment = read_deployment(name)
        assert deployment is not None and deployment.paused, (name, output[-2000:])


def _tracebacks(output: str) -> list[str]:
    """The tracebacks in serve.py's output, but Prefect 3.8's own: its engine ends the process of a
    run that returns its Cancelled state with "Execution of flow run ... exited with unexpected
    exception" and the CancelledRun's traceback (3.9 exits 0; the README says so)."""
    import prefect

    old = tuple(int(p) for p in prefect.__version__.split(".")[:2]) < (3, 9)
    lines = output.splitlines()
    found = []
    for i, line in enumerate(lines):
        if line.startswith("Traceback"):
            before = lines[i - 1] if i else ""
            if not (
                old
                and "prefect.engine - Execution of flow run" in before
                and "unexpected exception" in before
            ):
                found.append("\n".join(lines[max(0, i - 1) : i + 3]))
    return found
