"""PyTorch Lightning through CkptflowCheckpointIO: real fits, a real SIGKILL, the real library.

- a fit SIGKILLed mid-fit and resumed with ``ckpt_path="last"`` ends with the same weights,
  bit for bit, as an uninterrupted fit: async saves on a local disk, sync saves on S3;
- every checkpoint path Lightning keeps is a pointer to a committed version, and the versions
  of the paths it removed (top-k) or overwrote (``last.ckpt``) are gone;
- hyper-parameters: a Namespace and a Path come back as such; any other object is refused,
  naming its key, unless pickling is opted into, and a pickled value is not read without it;
- nothing in a store written without the opt-in is a pickle.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import pickle
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptflow.storage import CheckpointStore, UnsupportedValueError
from ckptflow.storage.integrations.lightning import CkptflowCheckpointIO
from ckptflow.storage.integrations.pyvalues import TAG
from tests.children import CHILDREN

CHILD = CHILDREN / "lightning_child.py"
EPOCHS = 6
KILL_AT = 3  # epoch 3 starts after epochs 0-2 saved their checkpoints


def fit(
    dirpath: str, out: Path, *extra: str, options: dict[str, Any] | None = None
) -> subprocess.CompletedProcess:
    env = {**os.environ, "CKPTFLOW_STORAGE_OPTIONS": json.dumps(options or {}), "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, str(CHILD), dirpath, str(out), "--epochs", str(EPOCHS), *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def started_at(proc: subprocess.CompletedProcess) -> int:
    line = next(x for x in proc.stdout.splitlines() if x.startswith("started at epoch"))
    return int(line.split()[-1])


def pointers(dirpath: Path) -> dict[str, int]:
    return {p.name: json.loads(p.read_text())["version"] for p in sorted(dirpath.glob("*.ckpt"))}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    tmp = tmp_path_factory.mktemp("lightning-ref")
    proc = fit(str(tmp / "ckpt"), tmp / "ref.pt")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(tmp / "ref.pt", weights_only=True)


def assert_bitwise_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs from the uninterrupted fit"


@pytest.mark.crash
def test_a_killed_fit_resumes_from_last_and_ends_as_an_uninterrupted_one(
    tmp_path: Path, uninterrupted: dict[str, torch.Tensor]
) -> None:
    """Async saves on a local disk (the S3 test below saves synchronously)."""
    dirpath = tmp_path / "ckpt"
    flags = ["--async-save"]
    killed = fit(str(dirpath), tmp_path / "killed.pt", "--kill-at-epoch", str(KILL_AT), *flags)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert not (tmp_path / "killed.pt").exists()

    kept = pointers(dirpath)
    assert "last.ckpt" in kept
    store = CheckpointStore(dirpath)
    committed = [v.version for v in store.versions()]
    named = sorted(kept.values())
    assert set(named) <= set(committed), "every pointer names a committed version"
    # the versions of overwritten and removed paths are gone; one commit may have landed just
    # before the kill without its pointer (async): then it is the newest
    unnamed = [v for v in committed if v not in named]
    assert unnamed == [] or (len(unnamed) == 1 and unnamed[0] > named[-1]), committed
    assert store.info(kept["last.ckpt"]).epoch in (KILL_AT - 2, KILL_AT - 1)  # async: the last may be lost

    resumed = fit(str(dirpath), tmp_path / "resumed.pt", "--resume", *flags)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert started_at(resumed) >= KILL_AT - 1
    assert_bitwise_equal(torch.load(tmp_path / "resumed.pt", weights_only=True), uninterrupted)
    assert set(pointers(dirpath).values()) <= {v.version for v in CheckpointStore(dirpath).versions()}


@pytest.mark.s3
@pytest.mark.crash
def test_a_killed_fit_resumes_from_a_store_on_s3(
    tmp_path: Path, s3_bucket: tuple[str, dict[str, Any]], uninterrupted: dict[str, torch.Tensor]
) -> None:
    """Sync saves, pointers and versions on SeaweedFS: Lightning lists the S3 prefix to find last.ckpt."""
    bucket, options = s3_bucket
    dirpath = f"{bucket}/lightning"
    killed = fit(dirpath, tmp_path / "k.pt", "--kill-at-epoch", str(KILL_AT), options=options)
    assert killed.returncode == -9, killed.stderr[-3000:]
    store = CheckpointStore(dirpath, storage_options=options)
    assert store.latest().epoch == KILL_AT - 1  # sync: every epoch before the kill is committed
    resumed = fit(dirpath, tmp_path / "r.pt", "--resume", options=options)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert started_at(resumed) >= KILL_AT - 1
    assert_bitwise_equal(torch.load(tmp_path / "r.pt", weights_only=True), uninterrupted)


# -- the plugin called directly ---------------------------------------------------------


def checkpoint(**extra: Any) -> dict[str, Any]:
    return {
        "epoch": 2,
        "global_step": 30,
        "state_dict": {"net.weight": torch.randn(4, 3)},
        "hyper_parameters": {"args": argparse.Namespace(lr=0.1, dims=(3, 4)), "root": pathlib.Path("/d")},
        **extra,
    }


def test_hyperparameters_come_back_as_namespaces_and_paths(tmp_path: Path) -> None:
    io = CkptflowCheckpointIO()
    ckpt = checkpoint(tags={"a", "b"})
    io.save_checkpoint(ckpt, tmp_path / "c.ckpt")
    got = io.load_checkpoint(tmp_path / "c.ckpt")
    assert got["hyper_parameters"] == ckpt["hyper_parameters"]
    assert isinstance(got["hyper_parameters"]["root"], pathlib.PosixPath)
    assert got["tags"] == {"a", "b"}
    assert torch.equal(got["state_dict"]["net.weight"], ckpt["state_dict"]["net.weight"])
    assert CheckpointStore(tmp_path).info().epoch == 2


class Opaque:
    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque)


def test_an_object_json_cannot_hold_is_refused_by_its_key_before_anything_is_written(tmp_path: Path) -> None:
    io = CkptflowCheckpointIO()
    with pytest.raises(UnsupportedValueError) as err:
        io.save_checkpoint(checkpoint(hyper_parameters={"loss_fn": Opaque()}), tmp_path / "c.ckpt")
    assert "hyper_parameters/loss_fn" in str(err.value)
    assert "store it as a dict, string or number instead" in str(err.value)
    assert list(tmp_path.iterdir()) == []


class Planted:
    """Unpickling one creates the file it names: the proof that something was unpickled."""

    def __init__(self, proof: str) -> None:
        self.proof = proof

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.Path.touch, (pathlib.Path(self.proof),))


def test_nothing_is_pickled_and_a_pickle_an_earlier_version_stored_is_refused(tmp_path: Path) -> None:
    """Bug fix: allow_pickle=True made load_checkpoint unpickle what the store held (a pickle runs
    code when it is read). The option is gone, and a pickled value an earlier ckptflow stored is
    refused on load, naming its key path, without being unpickled."""
    with pytest.raises(TypeError, match="allow_pickle"):
        CkptflowCheckpointIO(allow_pickle=True)  # type: ignore[call-arg]
    proof = tmp_path / "unpickled"
    planted = {TAG: "pickle", "type": "tests.Planted", "value": pickle.dumps(Planted(str(proof)))}
    io = CkptflowCheckpointIO()
    io.save_checkpoint(checkpoint(hyper_parameters={"loss_fn": planted}), tmp_path / "c.ckpt")
    with pytest.raises(UnsupportedValueError, match=r"hyper_parameters/loss_fn.*pickled tests.Planted"):
        io.load_checkpoint(tmp_path / "c.ckpt")
    assert not proof.exists()


def test_no_file_of_the_store_is_a_pickle(tmp_path: Path) -> None:
    CkptflowCheckpointIO().save_checkpoint(checkpoint(), tmp_path / "c.ckpt")
    for f in tmp_path.rglob("*"):
        if f.is_file():
            data = f.read_bytes()
            assert not data.startswith(b"\x80"), f"{f} is a pickle"
            assert b"data.pkl" not in data and b"PK\x03\x04" not in data, f"{f} is a torch.save archive"


def test_overwriting_last_deletes_the_version_it_named_and_removing_deletes_its_version(
    tmp_path: Path,
) -> None:
    io = CkptflowCheckpointIO()
    io.save_checkpoint(checkpoint(), tmp_path / "last.ckpt")
    first = pointers(tmp_path)["last.ckpt"]
    io.save_checkpoint(checkpoint(), tmp_path / "epoch=2.ckpt")
    io.save_checkpoint(checkpoint(epoch=3), tmp_path / "last.ckpt")
    kept = pointers(tmp_path)
    assert first not in kept.values() and len(set(kept.values())) == 2
    assert [v.version for v in CheckpointStore(tmp_path).versions()] == sorted(kept.values())
    io.remove_checkpoint(tmp_path / "epoch=2.ckpt")
    assert pointers(tmp_path) == {"last.ckpt": kept["last.ckpt"]}
    assert [v.version for v in CheckpointStore(tmp_path).versions()] == [kept["last.ckpt"]]


def test_one_store_for_every_path_when_given_a_url(tmp_path: Path) -> None:
    io = CkptflowCheckpointIO(str(tmp_path / "store"), async_save=True)
    io.save_checkpoint(checkpoint(), tmp_path / "a" / "last.ckpt")
    io.teardown()  # waits for the background commit and its pointer
    pointer = json.loads((tmp_path / "a" / "last.ckpt").read_text())
    assert pointer["store"] == str(tmp_path / "store")
    assert [v.version for v in CheckpointStore(tmp_path / "store").versions()] == [pointer["version"]]
    assert io.load_checkpoint(tmp_path / "a" / "last.ckpt")["epoch"] == 2


def test_a_file_that_is_not_a_pointer_is_named(tmp_path: Path) -> None:
    torch.save({"state_dict": {}}, tmp_path / "old.ckpt")
    with pytest.raises(Exception, match=r"old.ckpt is not a ckptflow checkpoint pointer"):
        CkptflowCheckpointIO().load_checkpoint(tmp_path / "old.ckpt")


def test_an_async_save_is_loadable_at_once_even_when_its_pointer_is_slow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bug fix: a future's waiters wake before its done-callbacks run, so waiting for the save
    alone let the next call read the path before its pointer was written (FileNotFoundError)."""
    import ckptflow.storage.integrations.lightning as plugin

    write = plugin.write_json

    def slow_write(*args: Any) -> None:
        time.sleep(0.5)
        write(*args)

    monkeypatch.setattr(plugin, "write_json", slow_write)
    io = CkptflowCheckpointIO(async_save=True)
    io.save_checkpoint(checkpoint(), tmp_path / "last.ckpt")
    assert io.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 30


def test_a_bare_file_name_is_a_pointer_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    io = CkptflowCheckpointIO()
    io.save_checkpoint(checkpoint(), "last.ckpt")
    assert io.load_checkpoint("last.ckpt")["epoch"] == 2
    assert [v.version for v in CheckpointStore(tmp_path).versions()] == [pointers(tmp_path)["last.ckpt"]]


def test_a_crafted_pointer_cannot_make_a_removal_delete_another_version(tmp_path: Path) -> None:
    """Bug fix: removing or overwriting a path deleted whatever version its pointer named, so a
    pointer written by someone else could delete any version of any store the plugin can reach."""
    other = CheckpointStore(tmp_path / "other")
    victim = other.save({"w": torch.ones(3)}, epoch=1).version
    (tmp_path / "ckpt").mkdir()
    crafted = {"ckptflow_pointer": 1, "store": str(tmp_path / "other"), "version": victim}
    (tmp_path / "ckpt" / "epoch=1.ckpt").write_text(json.dumps(crafted))
    (tmp_path / "ckpt" / "last.ckpt").write_text(json.dumps(crafted))
    io = CkptflowCheckpointIO()
    io.remove_checkpoint(tmp_path / "ckpt" / "epoch=1.ckpt")
    io.save_checkpoint(checkpoint(), tmp_path / "ckpt" / "last.ckpt")  # overwrites the crafted pointer
    assert not (tmp_path / "ckpt" / "epoch=1.ckpt").exists()
    assert [v.version for v in CheckpointStore(tmp_path / "other").versions()] == [victim]
