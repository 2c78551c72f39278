"""``ckptflow import``: checkpoints of other tools committed as versions, loaded back bitwise, and
nothing unpickled that the user did not opt into."""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from ckptflow.flows.cli import app
from ckptflow.storage import CheckpointError, CheckpointStore, import_checkpoint
from tests.conftest import assert_same_state


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    return model, opt


class Planted:
    """Unpickling one creates the file it names: the proof that something was unpickled."""

    def __init__(self, proof: str) -> None:
        self.proof = proof

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (Path(self.proof),))


def test_a_torch_save_file_is_a_version_with_its_epoch_and_step(tmp_path: Path) -> None:
    model, opt = trained()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3, "global_step": 120}
    torch.save(state, tmp_path / "ckpt.pt")
    store = CheckpointStore(tmp_path / "s")
    info = import_checkpoint(store, tmp_path / "ckpt.pt")
    assert (info.epoch, info.step, info.user["import_kind"]) == (3, 120, "torch")
    assert_same_state(store.load(info.version), state)
    assert import_checkpoint(store, tmp_path / "ckpt.pt", epoch=9).epoch == 9


def test_a_file_that_needs_pickle_is_refused_and_nothing_runs(tmp_path: Path) -> None:
    """Nothing is unpickled: a file that holds a pickled object is refused, and its code never runs.
    A Lightning checkpoint's namespaces and paths load as weights_only allows them to."""
    proof = tmp_path / "unpickled"
    torch.save({"w": torch.ones(2), "evil": Planted(str(proof))}, tmp_path / "evil.pt")
    store = CheckpointStore(tmp_path / "s")
    with pytest.raises(CheckpointError, match=r"ckptflow never unpickles"):
        import_checkpoint(store, tmp_path / "evil.pt")
    assert not proof.exists() and not (tmp_path / "s").exists()

    hparams = {"args": argparse.Namespace(lr=0.1), "root": Path("/data")}
    lightning = {"state_dict": {"w": torch.ones(2)}, "hyper_parameters": hparams, "epoch": 4}
    torch.save(lightning, tmp_path / "lightning.ckpt")
    info = import_checkpoint(store, tmp_path / "lightning.ckpt")
    assert info.epoch == 4
    from ckptflow.storage.integrations.lightning import CkptflowCheckpointIO

    (tmp_path / "s" / "last.ckpt").write_text(
        json.dumps({"ckptflow_pointer": 1, "store": ".", "version": info.version})
    )
    loaded = CkptflowCheckpointIO().load_checkpoint(tmp_path / "s" / "last.ckpt")
    assert loaded["hyper_parameters"] == hparams


def test_safetensors_and_a_hugging_face_directory(tmp_path: Path) -> None:
    from safetensors.torch import save_file
    from transformers import GPT2Config, GPT2LMHeadModel

    tensors = {"a.weight": torch.randn(3, 4), "b": torch.arange(5)}
    save_file(tensors, tmp_path / "m.safetensors")
    store = CheckpointStore(tmp_path / "s")
    info = import_checkpoint(store, tmp_path / "m.safetensors")
    loaded = store.load(info.version)
    assert sorted(loaded) == sorted(tensors) and all(torch.equal(loaded[k], t) for k, t in tensors.items())

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16))
    model.save_pretrained(tmp_path / "pretrained")
    info = import_checkpoint(store, tmp_path / "pretrained")
    assert info.user["import_kind"] == "hf"
    out = tmp_path / "exported"
    done = CliRunner().invoke(app, ["restore", str(tmp_path / "s"), "--format", "hf", "--out", str(out)])
    assert done.exit_code == 0, done.output
    again = GPT2LMHeadModel.from_pretrained(out)
    for name, tensor in model.state_dict().items():
        assert torch.equal(again.state_dict()[name], tensor), name


def test_a_dcp_directory_is_refused_naming_dcp_s_own_converter(tmp_path: Path) -> None:
    """DCP's .metadata is a pickle, which ckptflow never reads: the message names DCP's converter,
    whose torch.save file then imports."""
    import subprocess
    import sys

    import torch.distributed.checkpoint as dcp

    model, _ = trained()
    state = {"model": model.state_dict(), "step": 7}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    store = CheckpointStore(tmp_path / "s")
    with pytest.raises(CheckpointError, match=r"\.metadata is a pickle.*format_utils dcp_to_torch") as err:
        import_checkpoint(store, tmp_path / "dcp")
    command = str(err.value).split("python -m ", 1)[1].split(";")[0].split()
    subprocess.run([sys.executable, "-m", *command], check=True, cwd=tmp_path, capture_output=True)
    info = import_checkpoint(store, tmp_path / "state.pt")
    assert_same_state(store.load(info.version), state)


def test_a_version_reaches_dcp_s_tools_through_restore_and_dcp_s_converter(tmp_path: Path) -> None:
    """The way out to DCP the README gives: `ckptflow restore --out model.pt`, then DCP's own
    torch_to_dcp; dcp.load(checkpoint_id=...) reads the directory it writes."""
    import subprocess
    import sys

    import torch.distributed.checkpoint as dcp

    model, _ = trained()
    store = CheckpointStore(tmp_path / "s")
    store.save({"model": model.state_dict(), "step": 7}, epoch=1)
    restored = CliRunner().invoke(app, ["restore", str(tmp_path / "s"), "--out", str(tmp_path / "model.pt")])
    assert restored.exit_code == 0, restored.output
    convert = [sys.executable, "-m", "torch.distributed.checkpoint.format_utils", "torch_to_dcp"]
    subprocess.run([*convert, "model.pt", "dcp"], check=True, cwd=tmp_path, capture_output=True)
    target = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}, "step": 0}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(target, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert_same_state(target, {"model": model.state_dict(), "step": 7})


def test_the_cli_imports_and_refuses_what_it_cannot_read(tmp_path: Path) -> None:
    model, _ = trained()
    torch.save(model.state_dict(), tmp_path / "w.pth")
    done = CliRunner().invoke(
        app, ["import", str(tmp_path / "w.pth"), str(tmp_path / "s"), "--epoch", "2", "--json"]
    )
    assert done.exit_code == 0, done.output
    doc = json.loads(done.stdout)
    assert (doc["version"], doc["epoch"], doc["kind"]) == (2, 2, "torch")
    assert_same_state(CheckpointStore(tmp_path / "s").load(2), model.state_dict())
    (tmp_path / "notes.txt").write_text("x")
    refused = CliRunner().invoke(app, ["import", str(tmp_path / "notes.txt"), str(tmp_path / "s")])
    assert refused.exit_code == 1 and "import reads *.safetensors" in refused.output
    (tmp_path / "last.ckpt").write_text(json.dumps({"ckptflow_pointer": 1, "store": ".", "version": 2}))
    pointer = CliRunner().invoke(app, ["import", str(tmp_path / "last.ckpt"), str(tmp_path / "s")])
    assert pointer.exit_code == 1 and "is a pointer of ckptflow's Lightning plugin" in pointer.output
    missing = CliRunner().invoke(app, ["import", str(tmp_path / "nope.pt"), str(tmp_path / "s")])
    assert missing.exit_code == 1 and "does not exist" in missing.output
