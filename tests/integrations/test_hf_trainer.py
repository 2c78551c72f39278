"""The Hugging Face Trainer through CkptflowCallback: a tiny GPT-2 from its config, real SIGKILLs.

- a run SIGKILLed mid-training, whose output directory is then lost (a new machine), resumes
  from the store and ends with the same weights, bit for bit, as an uninterrupted run;
- what the store holds is no pickle: the Trainer's ``training_args.bin`` is left out, and
  every other file comes back;
- a crafted version whose file names leave the checkpoint directory is refused.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckptflow.storage import CheckpointStore, VersionNotFoundError
from ckptflow.storage.integrations.hf import KEY, restore_trainer_checkpoint
from tests.children import CHILDREN

CHILD = CHILDREN / "hf_child.py"


def run(store: Path, output_dir: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CKPTFLOW_STORAGE_OPTIONS": "{}", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, str(CHILD), str(store), str(output_dir), str(out), *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=output_dir.parent)


def resumed_from(proc: subprocess.CompletedProcess) -> str:
    return next(x for x in proc.stdout.splitlines() if x.startswith("resuming from")).split(" ", 2)[2]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run with sync saves, never stopped: its store, output directory and final weights."""
    tmp = tmp_path_factory.mktemp("hf-ref")
    proc = run(tmp / "store", tmp / "out", tmp / "ref.pt", "--sync")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp


@pytest.mark.crash
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_killed_run_resumes_from_the_store_on_a_new_disk_as_if_never_stopped(
    tmp_path: Path, mode: str, uninterrupted: Path
) -> None:
    store = tmp_path / "store"
    flags = ["--sync"] if mode == "sync" else []
    killed = run(store, tmp_path / "out", tmp_path / "k.pt", "--kill-at-step", "10", *flags)
    assert killed.returncode == -9, killed.stderr[-3000:]
    steps = [v.step for v in CheckpointStore(store).versions()]
    assert steps == [4, 8] if mode == "sync" else steps in ([4], [4, 8])

    resumed = run(store, tmp_path / "new-disk", tmp_path / "r.pt", "--resume", *flags)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed_from(resumed) == str(tmp_path / "new-disk" / f"checkpoint-{steps[-1]}")
    got = torch.load(tmp_path / "r.pt", weights_only=True)
    want = torch.load(uninterrupted / "ref.pt", weights_only=True)
    assert got.keys() == want.keys()
    for k in got:
        assert torch.equal(got[k], want[k]), f"{k} differs from the uninterrupted run"
    assert [v.step for v in CheckpointStore(store).versions()][-1] == 12


def test_the_store_holds_every_file_but_the_pickled_arguments_and_no_pickle(
    tmp_path: Path, uninterrupted: Path
) -> None:
    written = uninterrupted / "out" / "checkpoint-12"
    restored = Path(restore_trainer_checkpoint(str(uninterrupted / "store"), tmp_path / "again"))
    assert restored.name == "checkpoint-12"
    names = sorted(p.name for p in written.iterdir())
    assert sorted(p.name for p in restored.iterdir()) == [n for n in names if n != "training_args.bin"]
    for name in ("trainer_state.json", "config.json"):
        assert (restored / name).read_bytes() == (written / name).read_bytes()
    want = torch.load(written / "optimizer.pt", weights_only=True)
    got = torch.load(restored / "optimizer.pt", weights_only=True)
    for k, v in want["state"][0].items():
        assert torch.equal(got["state"][0][k], v)
    for f in (uninterrupted / "store").rglob("*"):
        if f.is_file():
            data = f.read_bytes()
            assert not data.startswith(b"\x80") and b"PK\x03\x04" not in data, f"{f} holds a pickle"
    info = CheckpointStore(uninterrupted / "store").info()
    assert info.step == 12 and "loss" in info.metrics and info.user[KEY] == "checkpoint-12"


def test_a_version_naming_files_outside_its_directory_is_refused(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "store")
    evil = {"path": "../escaped.json", "kind": "bytes", "value": torch.tensor(list(b"{}"), dtype=torch.uint8)}
    store.save({KEY: {"name": "checkpoint-1", "files": [evil]}}, step=1)
    with pytest.raises(ValueError, match="outside the checkpoint directory"):
        restore_trainer_checkpoint(str(tmp_path / "store"), tmp_path / "out")
    assert not (tmp_path / "out" / "escaped.json").exists() and not (tmp_path / "escaped.json").exists()
    assert not (tmp_path / "out" / "checkpoint-1").exists()


@pytest.mark.parametrize("name", ["..", "../escaped", "/tmp/escaped"])
def test_a_version_whose_checkpoint_name_leaves_the_output_directory_is_refused(
    tmp_path: Path, name: str
) -> None:
    """Bug fix: the checkpoint's directory name came from the manifest unchecked, so a crafted
    version named ``..`` made the restore replace the output directory's parent."""
    store = CheckpointStore(tmp_path / "store")
    store.save({KEY: {"name": name, "files": []}}, step=1)
    (tmp_path / "out").mkdir()
    with pytest.raises(ValueError, match="not a plain directory name"):
        restore_trainer_checkpoint(str(tmp_path / "store"), tmp_path / "out")
    assert (tmp_path / "store").is_dir() and (tmp_path / "out").is_dir()


def test_an_empty_store_means_a_new_run_said_aloud_or_refused(tmp_path: Path, caplog) -> None:
    """Bug fixed: a URL with nothing there (a typo) returned None in silence, and training started
    from scratch; now a warning names the URL, and ``resume_only=True`` raises."""
    with caplog.at_level("WARNING", logger="ckptflow.storage.integrations.hf"):
        assert restore_trainer_checkpoint(str(tmp_path / "store"), tmp_path / "out") is None
    assert f"no checkpoint in {tmp_path / 'store'}: starting a new run" in caplog.text
    assert not (tmp_path / "out").exists()
    with pytest.raises(VersionNotFoundError, match=r"no committed checkpoint in .*stroe"):
        restore_trainer_checkpoint(str(tmp_path / "stroe"), tmp_path / "out", resume_only=True)
    assert not (tmp_path / "out").exists() and not (tmp_path / "stroe").exists()
