"""``store.diff`` and ``ckptflow diff``: what changed between two checkpoints, told by checksums.

Real stores in temporary directories, real torch and safetensors files; the tensors that changed
are computed here from the states themselves, and a diff that reads nothing is checked by making
every read fail.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from typer.testing import CliRunner

from ckptflow.flows.cli import app
from ckptflow.storage import CheckpointError, CheckpointStore

WIDE = {"COLUMNS": "250"}


class Custom:
    """An object a torch file can hold only by pickling it."""


def fine_tune(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A frozen base and a trainable head with AdamW: what a fine-tune saves."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    for p in model[0].parameters():
        p.requires_grad_(False)
    return model, torch.optim.AdamW(model[2].parameters(), lr=1e-3)


def train_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(8, 16)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def state_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


@pytest.fixture
def two_versions(tmp_path: Path) -> tuple[CheckpointStore, dict[str, Any], dict[str, Any]]:
    model, opt = fine_tune()
    train_step(model, opt)
    store = CheckpointStore(tmp_path / "store")
    first = {k: _copy(v) for k, v in state_of(model, opt).items()}
    store.save(first, epoch=1)
    train_step(model, opt)
    opt.param_groups[0]["lr"] = 5e-4
    second = state_of(model, opt)
    store.save(second, epoch=2)
    return store, first, second


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def _no_reads(store: CheckpointStore, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the diff read tensors it could tell apart by their checksums")

    monkeypatch.setattr(store._reads, "load", refuse)


class TestVersionsOfOneStore:
    def test_a_fine_tune_changes_only_its_head_and_optimizer_and_nothing_is_read(
        self, two_versions: Any, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        store, first, _ = two_versions
        _no_reads(store, monkeypatch)
        result = store.diff(1, 2)
        changed = {c.path: c.kind for c in result.changes}
        assert changed == {
            "model/2.weight": "values",
            "model/2.bias": "values",
            "optimizer/state/0/step": "values",
            "optimizer/state/0/exp_avg": "values",
            "optimizer/state/0/exp_avg_sq": "values",
            "optimizer/state/1/step": "values",
            "optimizer/state/1/exp_avg": "values",
            "optimizer/state/1/exp_avg_sq": "values",
        }
        assert result.unchanged == 2  # the frozen base
        assert result.unchanged_bytes == sum(t.nbytes for t in first["model"].values()) - (16 * 4 + 4) * 4
        assert result.changed_bytes == sum(c.after.nbytes for c in result.changes)
        assert [(v.path, v.kind, v.before, v.after) for v in result.values] == [
            ("optimizer/param_groups/0/lr", "changed", 1e-3, 5e-4)
        ]

    def test_values_measure_the_difference(self, two_versions: Any) -> None:
        store, first, second = two_versions
        result = store.diff(1, 2, values=True)
        weight = next(c for c in result.changes if c.path == "model/2.weight")
        old, new = first["model"]["2.weight"], second["model"]["2.weight"]
        differing = int((old.view(torch.uint8) != new.view(torch.uint8)).sum())
        assert weight.differing_bytes == differing > 0
        assert weight.max_abs == pytest.approx(float((new.double() - old.double()).abs().max()))
        expected = float(
            torch.linalg.vector_norm(new.double() - old.double()) / torch.linalg.vector_norm(old.double())
        )
        assert weight.rel_norm == pytest.approx(expected)

    def test_the_same_version_has_no_changes(self, two_versions: Any) -> None:
        store, _, _ = two_versions
        result = store.diff(2, 2)
        assert result.is_empty() and result.unchanged == 10

    def test_added_removed_retyped_and_reshaped(self, tmp_path: Path) -> None:
        store = CheckpointStore(tmp_path / "store")
        store.save({"a": torch.ones(3), "b": torch.ones(2, 2), "c": torch.ones(4), "gone": torch.ones(1)})
        store.save(
            {
                "a": torch.ones(3),
                "b": torch.ones(4),
                "c": torch.ones(4, dtype=torch.float64),
                "new": torch.ones(5),
            }
        )
        result = store.diff(0, 1)
        assert [(c.path, c.kind) for c in result.changes] == [
            ("b", "shape"),
            ("c", "dtype"),
            ("gone", "removed"),
            ("new", "added"),
        ]
        assert result.unchanged == 1
        shape = result.changes[0]
        assert (shape.before.shape, shape.after.shape) == ([2, 2], [4])

    def test_views_of_one_storage_are_compared_by_reading_them(self, tmp_path: Path) -> None:
        """Tensors stored as views of a shared blob have no checksum of their own: both are read."""
        store = CheckpointStore(tmp_path / "store")
        base = torch.arange(12.0)
        store.save({"head": base[:4], "tail": base[4:]})
        base2 = base.clone()
        base2[10] = -1.0  # the tail changes, the head does not
        store.save({"head": base2[:4], "tail": base2[4:]})
        assert store.manifest(0).tensors[0].stride is not None, "stored as views of one blob"
        result = store.diff(0, 1)
        differing = int((base[4:].view(torch.uint8) != base2[4:].view(torch.uint8)).sum())
        assert [(c.path, c.kind, c.differing_bytes) for c in result.changes] == [
            ("tail", "values", differing)
        ]
        assert result.unchanged == 1


class TestOtherSides:
    def test_against_a_torch_file_and_a_safetensors_file(self, two_versions: Any, tmp_path: Path) -> None:
        store, _, second = two_versions
        torch.save(second, tmp_path / "state.pt")
        same = store.diff(2, tmp_path / "state.pt")
        assert same.changes == [] and same.values == [] and same.unchanged == 10
        flat = {f"model/{k}": v.clone() for k, v in second["model"].items()}
        flat["model/0.bias"][0] += 1
        save_file(flat, str(tmp_path / "model.safetensors"))
        result = store.diff(2, tmp_path / "model.safetensors")
        assert [(c.path, c.kind) for c in result.changes if c.kind != "removed"] == [
            ("model/0.bias", "values")
        ]
        assert {c.path for c in result.changes if c.kind == "removed"} == {
            p for p in (t.path for t in store.manifest(2).tensors) if p.startswith("optimizer/")
        }

    def test_against_another_store(self, two_versions: Any, tmp_path: Path) -> None:
        store, first, _ = two_versions
        other = CheckpointStore(tmp_path / "other")
        other.save(first, epoch=1)
        assert store.diff(1, other).is_empty()
        assert store.diff(1, f"{other.url}@1").is_empty()
        assert not store.diff(2, other).is_empty()

    def test_a_file_that_needs_unpickling_is_refused(self, two_versions: Any, tmp_path: Path) -> None:
        store, _, _ = two_versions
        torch.save({"obj": Custom()}, tmp_path / "pickled.pt")
        with pytest.raises(
            CheckpointError, match=r"pickled\.pt holds more than tensors .*Unsupported global"
        ):
            store.diff(1, tmp_path / "pickled.pt")  # as import says it (issue 59: one reader for both)

    def test_what_is_neither_version_file_nor_store_is_named(self, two_versions: Any, tmp_path: Path) -> None:
        store, _, _ = two_versions
        with pytest.raises(CheckpointError, match="no version number, no torch or safetensors file"):
            store.diff(1, str(tmp_path / "nothing-here"))


class TestCommand:
    def test_table_and_summary(self, two_versions: Any) -> None:
        store, _, _ = two_versions
        result = CliRunner().invoke(app, ["diff", store.url, "1", "2"], env=WIDE)
        assert result.exit_code == 0, result.output
        assert "model/2.weight" in result.output and "model/0.weight" not in result.output
        assert "0.001 -> 0.0005" in result.output
        assert "8 changed in values" in result.output and "2 unchanged" in result.output

    def test_json_with_values(self, two_versions: Any) -> None:
        store, _, _ = two_versions
        result = CliRunner().invoke(app, ["diff", store.url, "1", "--values", "--json"])
        assert result.exit_code == 0, result.output
        document = json.loads(result.output)
        assert document["compared_values"] is True and document["unchanged"] == 2
        weight = next(c for c in document["changes"] if c["path"] == "model/2.weight")
        assert weight["kind"] == "values" and weight["differing_bytes"] > 0 and weight["max_abs"] > 0

    def test_bad_arguments(self, two_versions: Any) -> None:
        store, _, _ = two_versions
        usage = CliRunner().invoke(app, ["diff", store.url, "first"])
        assert usage.exit_code == 2 and "is no version number" in usage.output
        missing = CliRunner().invoke(app, ["diff", store.url, "7"])
        assert missing.exit_code == 1 and "version 7" in missing.output


def test_a_diff_that_reads_leaves_the_next_saves_parent_alone(tmp_path: Path) -> None:
    """Reading tensors for a diff is no load of a state to train on: the store's next save still
    names its previous save as its parent."""
    store = CheckpointStore(tmp_path / "store")
    base = torch.arange(8.0)
    store.save({"v": base[:4], "u": base[4:]})  # views: a diff reads them
    store.save({"v": base[:4] + 1, "u": base[4:]})
    assert store.diff(0, 1, values=True).changes
    assert store.save({"w": torch.ones(1)}).parent == 1


class TestBoundedMemory:
    """Issue 59: ``diff --values`` of two versions of one 512 MiB tensor peaked at 6.9 GB (and of a
    1 GiB tensor at 13.4 GB) though the README said 256 MiB per side at a time. A large tensor is
    now compared a window at a time (a stored chunk, or a range of its blob verified as it streams)."""

    # VmHWM, the peak of this process's own memory (ru_maxrss keeps the parent's from before exec)
    CHILD = (
        "import sys\n"
        "from ckptflow.storage import CheckpointStore\n"
        "d = CheckpointStore(sys.argv[1]).diff(0, 1, values=True)\n"
        "[c] = d.changes\n"
        "peak = open('/proc/self/status').read().split('VmHWM:')[1].split()[0]\n"
        "print(peak, c.differing_bytes, c.max_abs, c.rel_norm)\n"
    )

    @pytest.mark.parametrize("dedup", [True, False], ids=["chunks", "one-blob"])
    def test_two_versions_of_a_512_mib_tensor_diff_under_1_2_gb(self, tmp_path: Path, dedup: bool) -> None:
        import subprocess
        import sys

        from ckptflow.storage import CheckpointStore, StoreOptions

        store = CheckpointStore(tmp_path / "s", options=StoreOptions(dedup=dedup))
        elements = 128 << 20  # 512 MiB of float32
        w = torch.zeros(elements)
        store.save({"w": w}, version=0)
        w[::1000] = 1.0  # every thousandth element changes by 1
        w[-1] = 3.0
        store.save({"w": w}, version=1)
        del w
        done = subprocess.run(
            [sys.executable, "-c", self.CHILD, str(tmp_path / "s")],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        peak_kib, differing, max_abs, rel_norm = done.stdout.split()
        assert int(peak_kib) < 1_200_000, f"peak {int(peak_kib) / 1024:.0f} MiB"
        changed = len(range(0, elements, 1000)) + 1
        assert 0 < int(differing) <= 4 * changed  # the changed elements' bytes (a float's 1.0 differs in 2)
        assert float(max_abs) == 3.0
        assert rel_norm == "None"  # the older tensor is all zeros: no relative norm

    def test_windowed_figures_equal_the_whole_tensor_s(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The same bytes, largest difference and relative norm, window by window as whole,
        NaN and infinities included, with windows of unequal lengths on the two sides."""
        from ckptflow.storage import diff

        gen = torch.Generator().manual_seed(3)
        a = torch.randn(10_000, generator=gen)
        b = a.clone()
        b[::7] += torch.randn(len(range(0, 10_000, 7)), generator=gen)
        a[5], b[9], b[11] = float("nan"), float("inf"), float("-inf")
        whole = diff._measure(a, b, True)
        monkeypatch.setattr(diff, "WINDOW", 4 * 1000)
        windowed = diff._measure_windows(
            diff._flat_windows(a), iter([b[:3333], b[3333:8000], b[8000:]]), True
        )
        assert whole is not None and windowed is not None
        assert windowed[0] == whole[0] and windowed[1] == whole[1]
        assert windowed[2] == pytest.approx(whole[2], rel=1e-12)
