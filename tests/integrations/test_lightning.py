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

from ckptflow.storage import CheckpointError, CheckpointStore, UnsupportedValueError
from ckptflow.storage.format.pyvalues import TAG
from ckptflow.storage.integrations.lightning import CkptflowCheckpointIO
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
    """Outside the hyper-parameters (a callback's state), an object is refused, naming its key; so
    is a dataclass, which only the hyper-parameters store as its fields."""
    import dataclasses

    @dataclasses.dataclass
    class Position:
        seen: int

    io = CkptflowCheckpointIO()
    with pytest.raises(UnsupportedValueError, match="callbacks/Tracker/where"):
        io.save_checkpoint(checkpoint(callbacks={"Tracker": {"where": Position(3)}}), tmp_path / "c.ckpt")
    with pytest.raises(UnsupportedValueError) as err:
        io.save_checkpoint(checkpoint(callbacks={"Tracker": {"fn": Opaque()}}), tmp_path / "c.ckpt")
    assert "callbacks/Tracker/fn" in str(err.value)
    assert "store it as a dict, string or number instead" in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_a_fit_whose_hyperparameters_hold_a_dataclass_an_enum_and_a_module_checkpoints(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Bug: ``save_hyperparameters()`` with a dataclass, an enum or a loss module crashed the fit at
    its first checkpoint, after an epoch of training. A dataclass is stored as its fields (it comes
    back as a namespace of them); a module or an enum is left out with one warning per key, and
    ``load_from_checkpoint`` takes it as a keyword argument, as Lightning's does."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from ckptflow.storage.integrations.lightning import load_from_checkpoint
    from tests.children.lightning_child import Configured, Optim, Width, data

    pl.seed_everything(0, verbose=False)
    model = Configured(Width(hidden=16, depth=1), Optim.ADAM, torch.nn.MSELoss())
    trainer = pl.Trainer(
        max_epochs=2,
        accelerator="cpu",
        devices=1,
        plugins=[CkptflowCheckpointIO()],
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with caplog.at_level("WARNING", logger="ckptflow"):
        trainer.fit(model, DataLoader(data(), batch_size=16))
    left_out = [r.getMessage() for r in caplog.records if "is not stored" in r.getMessage()]
    assert len(left_out) == 2, left_out  # once per key, not at every checkpoint
    assert any("hyper_parameters/loss_fn: a torch.nn.modules.loss.MSELoss" in m for m in left_out)
    assert any("hyper_parameters/optim" in m and "loss_fn=..." not in m for m in left_out)

    raw = CkptflowCheckpointIO().load_checkpoint(tmp_path / "ckpt" / "last.ckpt")
    assert raw["hyper_parameters"]["width"] == argparse.Namespace(hidden=16, depth=1)
    assert "loss_fn" not in raw["hyper_parameters"] and "optim" not in raw["hyper_parameters"]
    loaded = load_from_checkpoint(
        Configured, tmp_path / "ckpt" / "last.ckpt", optim=Optim.SGD, loss_fn=torch.nn.L1Loss()
    )
    assert loaded.hparams.width.hidden == 16 and loaded.hparams.optim is Optim.SGD
    assert_bitwise_equal(loaded.state_dict(), model.state_dict())


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


# -- pointers copied between runs, or crafted ---------------------------------------------


def fit_here(dirpath: Path, io: CkptflowCheckpointIO, *, epochs: int, ckpt_path: str | None = None) -> Any:
    """A real Lightning fit in this process (top-1 and last.ckpt in ``dirpath``); its model. No version
    counter: a ``last.ckpt`` found in ``dirpath`` is overwritten, not kept beside ``last-v1.ckpt``."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from tests.children.lightning_child import Regressor, data

    pl.seed_everything(0, verbose=False)
    model = Regressor(argparse.Namespace(width=32), pathlib.Path("/data"))
    trainer = pl.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        plugins=[io],
        callbacks=[
            pl.callbacks.ModelCheckpoint(
                dirpath=dirpath,
                save_last=True,
                save_top_k=1,
                monitor="val_loss",
                enable_version_counter=False,
            )
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loaders = DataLoader(data(), batch_size=16), DataLoader(data(1), batch_size=32)
    trainer.fit(model, *loaders, ckpt_path=ckpt_path)
    return model


def committed(url: Path) -> list[int]:
    return [v.version for v in CheckpointStore(url).versions()]


@pytest.mark.parametrize("shared", [False, True], ids=["another-store", "the-same-store"])
def test_a_last_ckpt_copied_into_another_run_deletes_nothing_of_the_run_it_came_from(
    tmp_path: Path, shared: bool
) -> None:
    """Bug fix: a ``last.ckpt`` copied from one run's directory into another's (one-URL stores)
    made the second run's next save of ``last.ckpt`` delete the first run's version: the plugin
    checked only the file's base name against the version's record."""
    store_a, run_a, run_b = tmp_path / "store-a", tmp_path / "run-a", tmp_path / "run-b"
    fit_here(run_a, CkptflowCheckpointIO(str(store_a)), epochs=2)
    kept_a = pointers(run_a)
    versions_a = committed(store_a)
    run_b.mkdir()
    (run_b / "last.ckpt").write_bytes((run_a / "last.ckpt").read_bytes())

    store_b = store_a if shared else tmp_path / "store-b"
    fit_here(run_b, CkptflowCheckpointIO(str(store_b)), epochs=4, ckpt_path=str(run_b / "last.ckpt"))

    assert set(versions_a) <= set(committed(store_a)), "a version of the first run was deleted"
    assert pointers(run_a) == kept_a
    reader = CkptflowCheckpointIO()
    assert reader.load_checkpoint(run_a / "last.ckpt")["epoch"] == 1
    resumed = json.loads((run_b / "last.ckpt").read_text())
    assert resumed["store"] == str(store_b) and not (shared and resumed["version"] in versions_a)
    assert reader.load_checkpoint(run_b / "last.ckpt")["epoch"] > 1  # run b went on from run a's epoch 1


def test_a_crafted_pointer_naming_another_stores_last_ckpt_deletes_nothing(tmp_path: Path, caplog) -> None:
    """Bug fix: a pointer naming a version another store saved for a path of the same name
    (``last.ckpt``) made ``remove_checkpoint`` and the next save of that path delete it."""
    other, mine = tmp_path / "other", tmp_path / "mine"
    CkptflowCheckpointIO().save_checkpoint(checkpoint(), other / "last.ckpt")
    victim = json.loads((other / "last.ckpt").read_text())
    crafted = json.dumps({**victim, "store": str(other)})  # its token and path, another store
    mine.mkdir()
    (mine / "last.ckpt").write_text(crafted)
    (mine / "epoch=1.ckpt").write_text(crafted.replace('"last.ckpt"', '"epoch=1.ckpt"'))
    io = CkptflowCheckpointIO()
    with caplog.at_level("WARNING", logger="ckptflow.storage.integrations.lightning"):
        io.remove_checkpoint(mine / "epoch=1.ckpt")
        io.save_checkpoint(checkpoint(), mine / "last.ckpt")  # overwrites the crafted pointer
        (mine / "odd.ckpt").write_text(json.dumps({**victim, "store": "nosuch://bucket/x"}))
        io.remove_checkpoint(mine / "odd.ckpt")  # a store no filesystem opens: kept, said, no error
    assert not (mine / "epoch=1.ckpt").exists() and not (mine / "odd.ckpt").exists()
    assert committed(other) == [victim["version"]]
    assert "odd.ckpt named version 2 of nosuch://bucket/x, which is kept" in caplog.text
    assert f"{mine / 'last.ckpt'} named version {victim['version']} of {other}, which is kept" in caplog.text
    assert io.load_checkpoint(other / "last.ckpt")["epoch"] == 2


def test_a_pointer_copied_away_from_its_store_is_refused_not_read_from_the_wrong_one(tmp_path: Path) -> None:
    """Bug fix: a pointer naming its own directory's store, copied into another run's directory,
    loaded that directory's version of the same number, another checkpoint, without a word."""
    CkptflowCheckpointIO().save_checkpoint(checkpoint(), tmp_path / "a" / "last.ckpt")
    CkptflowCheckpointIO().save_checkpoint(checkpoint(global_step=99), tmp_path / "b" / "last.ckpt")
    (tmp_path / "b" / "from-a.ckpt").write_bytes((tmp_path / "a" / "last.ckpt").read_bytes())
    io = CkptflowCheckpointIO()
    with pytest.raises(
        CheckpointError, match=r"from-a.ckpt names version 2 of .*b, which was not saved for it"
    ):
        io.load_checkpoint(tmp_path / "b" / "from-a.ckpt")
    io.remove_checkpoint(tmp_path / "b" / "from-a.ckpt")
    assert committed(tmp_path / "b") == [2]
    assert io.load_checkpoint(tmp_path / "b" / "last.ckpt")["global_step"] == 99


def test_trainer_ckpt_path_reads_a_pointer_to_a_store_of_another_plugin(tmp_path: Path) -> None:
    """Lightning's habit kept: ``trainer.validate(model, ckpt_path=...)`` with a plugin given no URL
    (or another one) reads a pointer a one-URL run wrote, from that run's store."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from tests.children.lightning_child import Regressor, data

    trained = fit_here(tmp_path / "run", CkptflowCheckpointIO(str(tmp_path / "store")), epochs=2)
    model = Regressor(argparse.Namespace(width=32), pathlib.Path("/data"))
    for io in (CkptflowCheckpointIO(), CkptflowCheckpointIO(str(tmp_path / "elsewhere"))):
        trainer = pl.Trainer(accelerator="cpu", plugins=[io], logger=False, enable_progress_bar=False)
        trainer.validate(
            model, DataLoader(data(1), batch_size=32), ckpt_path=str(tmp_path / "run" / "last.ckpt")
        )
        assert_bitwise_equal(model.state_dict(), trained.state_dict())
    assert not (tmp_path / "elsewhere").exists()


def test_load_from_checkpoint_builds_the_module_from_a_pointer(tmp_path: Path) -> None:
    """Every Lightning tutorial loads a module with ``Model.load_from_checkpoint(path)``, which reads
    the path with torch.load: on a pointer it fails with an UnpicklingError. The plugin's module
    gives the same call for its pointers: hyper-parameters as saved (a Namespace, a Path), keyword
    arguments overriding them, the weights of the checkpoint."""
    import pickle as std_pickle

    from ckptflow.storage.integrations.lightning import load_from_checkpoint
    from tests.children.lightning_child import Regressor

    fitted = fit_here(tmp_path / "ckpt", CkptflowCheckpointIO(), epochs=2)
    path = tmp_path / "ckpt" / "last.ckpt"
    with pytest.raises(std_pickle.UnpicklingError):  # Lightning's own, documented as not reading a pointer
        Regressor.load_from_checkpoint(path)
    model = load_from_checkpoint(Regressor, path)
    assert isinstance(model, Regressor)
    assert isinstance(model.hparams.hparams_ns, argparse.Namespace) and model.hparams.hparams_ns.width == 32
    assert model.hparams.data_dir == pathlib.Path("/data") and model.hparams.lr == 0.01
    assert_bitwise_equal(model.state_dict(), fitted.state_dict())
    assert load_from_checkpoint(Regressor, str(path), lr=0.5).hparams.lr == 0.5


def test_the_cli_takes_a_lightning_checkpoint_where_it_takes_a_store(tmp_path: Path) -> None:
    """``ckptflow show/verify/restore run/last.ckpt`` read the version the pointer names, in its store;
    ``ls`` lists its store; a pointer copied away from its store is refused, naming it."""
    from typer.testing import CliRunner

    from ckptflow.flows.cli import app

    fitted = fit_here(tmp_path / "ckpt", CkptflowCheckpointIO(), epochs=2)
    last = tmp_path / "ckpt" / "last.ckpt"
    version = json.loads(last.read_text())["version"]
    first = min(pointers(tmp_path / "ckpt").values())
    runner = CliRunner()

    shown = runner.invoke(app, ["show", str(last), "--json"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.stdout)["version"] == version
    assert f"version {version} of {tmp_path / 'ckpt'}" in shown.stderr
    listed = runner.invoke(app, ["ls", str(last), "--json"])
    assert listed.exit_code == 0 and version in [v["version"] for v in json.loads(listed.stdout)["versions"]]
    assert runner.invoke(app, ["verify", str(last)]).stdout.startswith(f"ok version {version} ")
    assert runner.invoke(app, ["show", str(last), "--version", str(first), "--json"]).exit_code == 0

    out = tmp_path / "weights.pt"
    restored = runner.invoke(app, ["restore", str(last), "--out", str(out), "--keys", "state_dict"])
    assert restored.exit_code == 0, restored.output
    assert_bitwise_equal(torch.load(out, weights_only=True), fitted.state_dict())

    (tmp_path / "elsewhere").mkdir()
    CheckpointStore(tmp_path / "elsewhere").save({"x": torch.zeros(1)}, version=version)
    copied = tmp_path / "elsewhere" / "last.ckpt"
    copied.write_text(last.read_text())
    refused = runner.invoke(app, ["show", str(copied)])
    assert refused.exit_code == 1 and "copied away from its store" in refused.output
