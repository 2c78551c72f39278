"""DCP's ``Stateful`` objects in a state (anything with ``state_dict()`` and ``load_state_dict()``)
are saved through their state_dict and loaded back into them, as ``dcp.save``/``dcp.load`` do,
in one process without a process group."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ckptflow.storage import CheckpointError, CheckpointStore


def trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def test_modules_and_optimizers_save_and_load_whole(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "store")
    model, opt = trained(0)
    info = store.save({"model": model, "optimizer": opt, "epoch": 3}, epoch=3)
    assert info.version == 3
    state = store.load()
    assert state["epoch"] == 3
    for key, value in model.state_dict().items():
        assert torch.equal(state["model"][key], value), key
    # as dcp.save records them: the optimizer's int keys become strings
    assert torch.equal(state["optimizer"]["state"]["0"]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])

    other, other_opt = trained(1)
    assert not torch.equal(other.state_dict()["0.weight"], model.state_dict()["0.weight"])
    store.load(into={"model": other, "optimizer": other_opt})
    for key, value in model.state_dict().items():
        assert torch.equal(other.state_dict()[key], value), key
    assert torch.equal(
        other_opt.state_dict()["state"][2]["exp_avg_sq"], opt.state_dict()["state"][2]["exp_avg_sq"]
    )


def test_a_sharded_state_must_be_a_dict(tmp_path: Path) -> None:
    model, _ = trained(0)
    with pytest.raises(CheckpointError, match="must be a dict"):
        CheckpointStore(tmp_path / "store").save([model])


def test_a_plain_save_and_load_import_no_part_of_dcp(tmp_path: Path) -> None:
    """Telling a sharded state from a plain one costs a plain save nothing: DCP (0.7 s to import)
    stays unimported."""
    import subprocess
    import sys

    script = (
        "import sys, torch\n"
        "from ckptflow.storage import CheckpointStore\n"
        "store = CheckpointStore(sys.argv[1])\n"
        "store.save({'w': torch.ones(2), 'opt': {'lr': 0.1}}, epoch=1)\n"
        "store.load(into={'w': torch.zeros(2)})\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch.distributed.checkpoint')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "store")], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout
