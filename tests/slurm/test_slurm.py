"""``ckptflow run`` as a SLURM job, as the README's batch script runs it, on a real SLURM cluster
of one node (tests/slurm/conftest.py): a job trains and commits; ``scancel --signal=TERM`` (what
``--signal=TERM@120`` sends before a time limit, and a preemption) makes it commit where it
stands and end with 143; a job requeued (``scontrol requeue``, a preemption's REQUEUE) comes back
and resumes from its newest version, ending bit for bit where a job that never stopped ends.

No Prefect API is configured in these jobs: each ``ckptflow run`` starts its temporary server,
which SLURM's signal to every process of the step must not take down (flows/api_server.py).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from ckptflow.storage import CheckpointStore
from tests.pipeline.helpers import REPO
from tests.pipeline.specs import SLOW_FROM_ENV, SPEC_CONFIG, STEP_SECONDS_ENV, STEPPED_SPEC
from tests.pipeline.test_step_checkpoints import EPOCHS, EVERY, assert_same_run, expected_positions, positions
from tests.prefect_server import prefect_env
from tests.slurm.conftest import Slurm
from tests.storage.test_dedup import verify_all

pytestmark = [pytest.mark.slurm, pytest.mark.crash, pytest.mark.xdist_group("slurm")]  # one cluster


def batch_script(where: Path) -> Path:
    """The README's batch script, with this machine's ckptflow and the tests' stepped spec."""
    ckptflow = Path(sys.executable).parent / "ckptflow"
    script = where / "train.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH --job-name=train --nodes=1 --ntasks=1\n"
        "#SBATCH --requeue --signal=TERM@120 --open-mode=append --output=train-%j.out\n"
        f"srun {ckptflow} run --storage ./checkpoints/run1 --epochs {EPOCHS} "
        f"--spec {STEPPED_SPEC} --spec-config '{json.dumps(SPEC_CONFIG)}' --save-every-steps {EVERY}\n"
    )
    return script


def job_env(where: Path, slow: bool) -> dict[str, str]:
    env = {**prefect_env(where / "prefect-home"), "PYTHONPATH": str(REPO)}
    env.pop("PREFECT_API_URL", None)
    if slow:
        env.update({SLOW_FROM_ENV: "2", STEP_SECONDS_ENV: "0.5"})
    return env


def store_of(where: Path) -> CheckpointStore:
    return CheckpointStore(where / "checkpoints" / "run1")


def job_output(where: Path, job_id: int) -> str:
    path = where / f"train-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def wait_for_step(where: Path, step: int, timeout: float, slurm: Slurm, job_id: int) -> None:
    deadline = time.monotonic() + timeout
    while not any((v.step or 0) >= step for v in _versions(where)):
        fields = slurm.job(job_id)
        assert fields["JobState"] in ("PENDING", "RUNNING"), (fields, job_output(where, job_id)[-3000:])
        assert time.monotonic() < deadline, job_output(where, job_id)[-3000:]
        time.sleep(0.3)


def _versions(where: Path) -> list:
    try:
        return store_of(where).versions()
    except Exception:
        return []


@pytest.fixture(scope="module")
def straight(slurm: Slurm, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A job that runs to its end: trains, commits every save point, exits 0 (COMPLETED)."""
    where = Path(tmp_path_factory.mktemp("straight"))
    job_id = slurm.sbatch(batch_script(where), job_env(where, slow=False), where)
    fields = slurm.wait_for(job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, 300)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", (
        fields,
        job_output(where, job_id),
    )
    return where


def test_a_job_trains_and_commits_every_save_point(straight: Path) -> None:
    store = store_of(straight)
    assert positions(store) == expected_positions()
    assert all(error is None for error in verify_all(store).values())


def test_scancel_signal_term_commits_where_the_job_stands_and_it_ends_with_143(
    slurm: Slurm, straight: Path, tmp_path: Path
) -> None:
    job_id = slurm.sbatch(batch_script(tmp_path), job_env(tmp_path, slow=True), tmp_path)
    wait_for_step(tmp_path, 15, 240, slurm, job_id)
    before = {v.version for v in store_of(tmp_path).versions()}
    signalled = time.monotonic()
    slurm.run("scancel", "--signal=TERM", str(job_id))
    fields = slurm.wait_for(job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, 120)
    took = time.monotonic() - signalled
    out = job_output(tmp_path, job_id)
    assert fields["JobState"] == "FAILED" and fields["ExitCode"] == "143:0", (fields, out[-3000:])
    assert took < 60, (took, out[-3000:])  # no wait on a Prefect API the signal took down
    saved = store_of(tmp_path).latest()
    assert saved is not None and saved.version not in before and saved.in_epoch, positions(store_of(tmp_path))
    assert "cancelled: the process got SIGTERM" in " ".join(out.split()), out[-3000:]


def test_a_requeued_job_resumes_from_its_newest_version_bitwise(
    slurm: Slurm, straight: Path, tmp_path: Path
) -> None:
    job_id = slurm.sbatch(batch_script(tmp_path), job_env(tmp_path, slow=True), tmp_path)
    wait_for_step(tmp_path, 15, 240, slurm, job_id)
    slurm.run("scontrol", "requeue", str(job_id))
    fields = slurm.wait_for(job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, 400)
    out = job_output(tmp_path, job_id)
    assert fields["JobState"] == "COMPLETED" and int(fields["Restarts"]) == 1, (fields, out[-3000:])
    assert "resuming from version" in out, out[-3000:]
    store = store_of(tmp_path)
    assert positions(store)[-1] == expected_positions()[-1], positions(store)
    after = [s for _, _, s in expected_positions() if s > 15]
    assert_same_run(store, store_of(straight), after)
    print(json.dumps({"restarts": fields["Restarts"], "versions": len(store.versions())}))
