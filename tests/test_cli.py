"""The ``ckptflow`` command line against real stores in temporary directories.

Exit codes and start-up imports are checked through real processes
(``python -m ckptflow.flows.cli``); the rest goes through typer's CliRunner,
which runs the same app in this process. Every assertion is on real output or
on the store's files: the versions listed, the bytes restored, the
directories left after prune and gc.
"""

from __future__ import annotations

import json
import os
import resource
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from typer.testing import CliRunner

from ckptflow.flows.cli import app
from ckptflow.flows.launch import trains_in_a_child
from ckptflow.storage import CheckpointStore, StoreOptions
from tests.conftest import S3_SECRET, assert_same_state, tensor_bits

WIDE = {"COLUMNS": "250"}  # rich tables wrap cells to the terminal's width


def make_state(seed: int) -> dict[str, Any]:
    """A small but complete training state: model, Adam state, numpy, odd dtypes, tied tensors."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    shared = torch.randn(3, 5)
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "extra": {
            "np": np.arange(6, dtype=np.float32).reshape(2, 3) + seed,
            "bf16": torch.randn(7).to(torch.bfloat16),
            "mask": torch.tensor([True, False, True]),
            "view": shared[1],  # a view into a larger tensor
            "name": f"run-{seed}",
            "betas": (0.9, 0.999),
        },
        "tied": [shared, shared],
    }


def as_torch(node: Any) -> Any:
    """What ``restore --format torch`` promises: the state as saved, numpy arrays as tensors."""
    if isinstance(node, np.ndarray):
        return torch.from_numpy(node)
    if isinstance(node, dict):
        return {k: as_torch(v) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(as_torch(v) for v in node)
    return node


@pytest.fixture
def store(tmp_path: Path) -> tuple[str, list[dict[str, Any]]]:
    """A store with versions 0, 1, 2 (epochs 0-2, falling loss); yields (url, the states saved)."""
    url = str(tmp_path / "store")
    states = []
    with CheckpointStore(url, options=StoreOptions(shards=2, threads=2)) as s:
        for epoch in range(3):
            states.append(make_state(epoch))
            s.save(states[-1], epoch=epoch, step=10 * epoch, metrics={"loss": 1.5 - 0.5 * epoch, "acc": 0.9})
    return url, states


def many_versions(url: str, count: int, losses: list[float] | None = None) -> None:
    with CheckpointStore(url, options=StoreOptions(shards=1, threads=1)) as s:
        for epoch in range(count):
            loss = losses[epoch] if losses else float(count - epoch)
            s.save({"w": torch.full((4,), float(epoch))}, epoch=epoch, metrics={"loss": loss})


def invoke(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(app, list(args), env=env)


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ckptflow.flows.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def committed(url: str) -> list[int]:
    return [v.version for v in CheckpointStore(url).versions()]


class TestProcess:
    """Exit codes as a shell sees them: 0 success, 1 failure with one line on stderr, 2 usage."""

    def test_ls_exits_0_and_lists_the_versions(self, store):
        url, _ = store
        proc = run_cli("ls", url, "--json")
        assert proc.returncode == 0, proc.stderr
        assert [v["version"] for v in json.loads(proc.stdout)["versions"]] == [0, 1, 2]

    def test_verify_exits_1_naming_the_corrupt_file(self, store):
        url, _ = store
        assert run_cli("verify", url, "--all").returncode == 0
        shard = sorted((Path(url) / "v000001").glob("shard-*.h5"))[0]
        flip_byte(shard)
        proc = run_cli("verify", url, "--version", "1")
        assert proc.returncode == 1
        lines = proc.stderr.splitlines()
        assert len(lines) == 1, proc.stderr
        assert lines[0].startswith("error: corrupt checkpoint file ")
        assert f"v000001/{shard.name}" in lines[0]
        assert "Traceback" not in proc.stderr

    def test_unknown_scheme_exits_1_with_one_line(self, tmp_path):
        proc = run_cli("ls", "gopher://host/ckpt")
        assert proc.returncode == 1
        assert proc.stdout == ""
        lines = proc.stderr.splitlines()
        assert len(lines) == 1, proc.stderr
        assert lines[0].startswith("error: no filesystem handles gopher://")

    @pytest.mark.parametrize(
        "args",
        [
            ["ls"],  # missing URL
            ["frobnicate", "x"],  # unknown command
            ["prune", "{url}", "--keep-last", "0"],
            ["prune", "{url}"],  # no policy
            ["verify", "{url}", "--all", "--version", "1"],
            ["restore", "{url}"],  # missing --out
            ["restore", "{url}", "--out", "x.pt", "--format", "pickle"],
            ["ls", "{url}", "--storage-options", "{not json"],
        ],
    )
    def test_usage_errors_exit_2(self, store, args):
        url, _ = store
        proc = run_cli(*[a.replace("{url}", url) for a in args])
        assert proc.returncode == 2, (proc.stdout, proc.stderr)
        assert "Traceback" not in proc.stderr
        assert committed(url) == [0, 1, 2]

    def test_help_imports_neither_prefect_nor_torch(self):
        code = (
            "import sys\n"
            "sys.argv = ['ckptflow', 'ls', '--help']\n"
            "from ckptflow.flows.cli import main\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('prefect', 'torch'))\n"
            "print('HEAVY', heavy, file=sys.stderr)\n"
        )
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert "HEAVY []" in proc.stderr
        assert "ckptflow ls" in proc.stdout and "--json" in proc.stdout

    @pytest.mark.parametrize(
        "args",
        [
            ["ls", "{url}"],
            ["show", "{url}"],
            ["verify", "{url}", "--all"],
            ["gc", "{url}"],
            ["prune", "{url}", "--keep-last", "5"],
        ],
        ids=["ls", "show", "verify", "gc", "prune"],
    )
    def test_commands_on_manifests_and_files_do_not_import_torch(self, store, args):
        """Importing torch takes seconds; these commands only read manifests and hash files."""
        url, _ = store
        code = (
            "import sys\n"
            f"sys.argv = ['ckptflow', *{[a.replace('{url}', url) for a in args]!r}]\n"
            "from ckptflow.flows.cli import main\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert e.code in (0, None), e.code\n"
            "print('TORCH', 'torch' in sys.modules, file=sys.stderr)\n"
        )
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert "TORCH False" in proc.stderr, proc.stderr[-2000:]
        assert committed(url) == [0, 1, 2]


class TestLs:
    def test_json_lists_exactly_the_committed_versions(self, store):
        url, _ = store
        result = invoke("ls", url, "--json")
        assert result.exit_code == 0, result.output
        doc = json.loads(result.stdout)
        infos = CheckpointStore(url).versions()
        assert [v["version"] for v in doc["versions"]] == [0, 1, 2]
        for got, info in zip(doc["versions"], infos, strict=True):
            assert got["epoch"] == info.epoch and got["step"] == info.step
            assert got["size"] == info.size > 0
            assert got["metrics"] == {"loss": 1.5 - 0.5 * info.version, "acc": 0.9}
            assert got["url"].endswith(f"/v{info.version:06d}")
        assert doc["uncommitted"] == [] and doc["unreadable"] == []

    def test_table_shows_each_version(self, store):
        url, _ = store
        result = invoke("ls", url, env=WIDE)
        assert result.exit_code == 0, result.output
        assert result.stdout.startswith(CheckpointStore(url).url)  # the title; each row says where in it
        for info in CheckpointStore(url).versions():
            assert f" v{info.version:06d} " in result.stdout
        assert "loss=0.5 acc=0.9" in result.stdout
        assert " KiB " in result.stdout
        assert "note:" not in result.stdout

    def test_the_table_reads_at_80_columns(self, store):
        """No cell of a row is cut into pieces by the terminal's width (as the URLs were)."""
        url, _ = store
        result = invoke("ls", url, env={"COLUMNS": "80"})
        assert result.exit_code == 0, result.output
        rows = [line for line in result.stdout.splitlines() if line.startswith("│")]
        assert all(len(line) <= 80 for line in result.stdout.splitlines())
        first_lines = [row for row in rows if row.split("│")[1].strip()]  # a version's first line
        assert [row.split("│")[1].strip() for row in first_lines] == ["0", "1", "2"]
        assert [row.split("│")[-2].strip() for row in first_lines] == ["v000000", "v000001", "v000002"]

    def test_leftovers_are_not_listed_and_get_a_note(self, store):
        url, _ = store
        leftover = Path(url) / "v000003"
        leftover.mkdir()
        (leftover / "shard-r0-00.h5").write_bytes(b"half a shard")
        result = invoke("ls", url, env=WIDE)
        assert "v000003" not in result.stdout
        assert "note: uncommitted leftovers" in result.stdout and "version 3" in result.stdout
        assert "ckptflow gc" in result.stdout
        doc = json.loads(invoke("ls", url, "--json").stdout)
        assert [v["version"] for v in doc["versions"]] == [0, 1, 2]
        assert doc["uncommitted"] == [3]

    def test_unreadable_version_gets_a_note(self, store):
        url, _ = store
        (Path(url) / "v000001" / "manifest.json").write_text('{"format": "ckptflow-checkpoint"')
        result = invoke("ls", url, env=WIDE)
        assert result.exit_code == 0
        assert "note: version 1 is unreadable: manifest" in result.stdout
        doc = json.loads(invoke("ls", url, "--json").stdout)
        assert [v["version"] for v in doc["versions"]] == [0, 2]
        assert [u["version"] for u in doc["unreadable"]] == [1]

    def test_empty_store(self, tmp_path):
        (tmp_path / "nothing").mkdir()  # where nothing is at all, ls fails (tests/test_cli_errors.py)
        result = invoke("ls", str(tmp_path / "nothing"))
        assert result.exit_code == 0
        assert "no committed versions" in result.stdout


class TestShow:
    def test_summary_shards_and_tensors(self, store):
        url, _ = store
        manifest = CheckpointStore(url).manifest(1)
        result = invoke("show", url, "--version", "1", env=WIDE)
        assert result.exit_code == 0, result.output
        out = result.stdout
        assert "loss=1 acc=0.9" in out
        assert f"{url}/v000001" in out
        for shard in manifest.shards:
            assert shard.file in out and shard.checksum in out
        for tensor in manifest.tensors:
            assert tensor.path in out
        assert "model/0.weight" in out and "(8, 4)" in out and "128 B" in out  # 8*4 float32
        assert "bfloat16" in out and "torch" in out  # a dtype and the writer versions

    def test_json_is_the_manifest(self, store):
        url, _ = store
        result = invoke("show", url, "--json")  # the newest by default
        assert result.exit_code == 0
        assert json.loads(result.stdout) == json.loads(CheckpointStore(url).manifest(2).to_json())

    def test_missing_version_fails(self, store):
        url, _ = store
        result = invoke("show", url, "--version", "7")
        assert result.exit_code == 1
        assert result.stderr.strip() == (
            f"error: version 7 is not committed in {url} (committed versions: 0, 1, 2)"
        )


class TestVerify:
    def test_all_match(self, store):
        url, _ = store
        result = invoke("verify", url, "--all")
        assert result.exit_code == 0, result.output
        lines = result.stdout.splitlines()
        assert [line.split()[:3] for line in lines] == [["ok", "version", str(v)] for v in (0, 1, 2)]
        latest = invoke("verify", url)
        assert latest.exit_code == 0 and latest.stdout.startswith("ok version 2 ")

    def test_all_reports_each_bad_version_and_checks_the_rest(self, store):
        url, _ = store
        shard = sorted((Path(url) / "v000000").glob("shard-*.h5"))[-1]
        flip_byte(shard)
        (Path(url) / "v000001" / "manifest.json").write_text("{}")
        result = invoke("verify", url, "--all")
        assert result.exit_code == 1
        assert [line.split()[2] for line in result.stdout.splitlines()] == ["2"]
        errors = result.stderr.splitlines()
        assert len(errors) == 2
        assert errors[0].startswith("error: version 0: corrupt checkpoint file ")
        assert f"v000000/{shard.name}" in errors[0]
        assert errors[1].startswith("error: version 1 is unreadable")
        assert invoke("verify", url).exit_code == 0  # the newest is intact

    def test_json_reports_each_version_with_the_same_exit_code(self, store):
        url, _ = store
        one = invoke("verify", url, "--version", "1", "--json")
        assert one.exit_code == 0, one.output
        assert [(v["version"], v["ok"]) for v in json.loads(one.stdout)["versions"]] == [(1, True)]
        shard = sorted((Path(url) / "v000000").glob("shard-*.h5"))[-1]
        flip_byte(shard)
        every = invoke("verify", url, "--all", "--json")
        assert every.exit_code == 1
        document = json.loads(every.stdout)
        assert document["ok"] is False
        assert [(v["version"], v["ok"]) for v in document["versions"]] == [(0, False), (1, True), (2, True)]
        assert f"v000000/{shard.name}" in document["versions"][0]["error"]
        bad = invoke("verify", url, "--version", "0", "--json")
        assert bad.exit_code == 1 and json.loads(bad.stdout)["versions"][0]["ok"] is False

    def test_missing_shard(self, store):
        url, _ = store
        shard = sorted((Path(url) / "v000002").glob("shard-*.h5"))[0]
        shard.unlink()
        result = invoke("verify", url)
        assert result.exit_code == 1
        assert f"v000002/{shard.name}" in result.stderr and "no file" in result.stderr

    def test_truncated_shard(self, store):
        url, _ = store
        shard = sorted((Path(url) / "v000002").glob("shard-*.h5"))[0]
        shard.write_bytes(shard.read_bytes()[:-10])
        result = invoke("verify", url, "--version", "2")
        assert result.exit_code == 1
        assert f"v000002/{shard.name}" in result.stderr and "size" in result.stderr


class TestRestore:
    def test_torch_file_opens_with_weights_only(self, store, tmp_path):
        url, states = store
        out = tmp_path / "ckpt.pt"
        result = invoke("restore", url, "--version", "1", "--out", str(out))
        assert result.exit_code == 0, result.output
        assert f"restored version 1 (epoch 1) to {out}" in result.stdout
        got = torch.load(out, weights_only=True)
        assert_same_state(got, as_torch(states[1]))
        assert isinstance(got["extra"]["np"], torch.Tensor)

    def test_torch_one_selected_subtree_loses_its_prefix(self, store, tmp_path):
        url, states = store
        out = tmp_path / "model.pt"
        assert invoke("restore", url, "-o", str(out), "--keys", "model").exit_code == 0
        got = torch.load(out, weights_only=True)
        assert_same_state(got, states[2]["model"])  # a state_dict as model.load_state_dict takes it
        both = tmp_path / "both.pt"
        assert invoke("restore", url, "-o", str(both), "--keys", "model,extra").exit_code == 0
        assert set(torch.load(both, weights_only=True)) == {"model", "extra"}  # several keep their names

    def test_a_selected_model_loads_into_the_module_from_safetensors(self, tmp_path):
        from safetensors.torch import load_file

        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        url = str(tmp_path / "store")
        CheckpointStore(url).save({"model": model.state_dict(), "step": 3}, epoch=1)
        out = tmp_path / "model.safetensors"
        result = invoke("restore", url, "-o", str(out), "--format", "safetensors", "--keys", "model")
        assert result.exit_code == 0, result.output
        fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        fresh.load_state_dict(load_file(out))  # strict: every key, no prefix
        assert_same_state(fresh.state_dict(), model.state_dict())

    def test_one_subtree_under_an_int_key_loses_its_prefix(self, tmp_path):
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.Adam(model.parameters())
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        url = str(tmp_path / "store")
        CheckpointStore(url).save({"optimizer": opt.state_dict()}, epoch=1)
        out = tmp_path / "state0.pt"
        result = invoke("restore", url, "-o", str(out), "--keys", "optimizer/state/0")
        assert result.exit_code == 0, result.output
        assert_same_state(torch.load(out, weights_only=True), opt.state_dict()["state"][0])

    def test_hugging_face_sharded_layout(self, tmp_path):
        from huggingface_hub import load_torch_model

        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
        url = str(tmp_path / "store")
        CheckpointStore(url).save({"model": model.state_dict()}, epoch=1, version=1)
        out = tmp_path / "hf"
        args = ["restore", url, "-o", str(out), "--format", "safetensors", "--keys", "model"]
        result = invoke(*args, "--max-shard-size", "20KB")
        assert result.exit_code == 0, result.output
        shards = sorted(p.name for p in out.glob("*.safetensors"))
        # 16 KiB weights, at most 20 KB a shard: the first weight alone, then the rest
        assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"], shards
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(model.state_dict())
        assert index["weight_map"]["0.weight"] == shards[0] and index["weight_map"]["2.weight"] == shards[1]
        assert "2 shards" in result.stdout
        fresh = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
        load_torch_model(fresh, out)  # Hugging Face's own loader reads the index and the shards
        assert_same_state(fresh.state_dict(), model.state_dict())
        # an existing directory is replaced whole only with --force
        again = invoke(*args, "--max-shard-size", "1MB")
        assert again.exit_code == 1 and "pass --force" in again.output
        assert invoke(*args, "--max-shard-size", "1MB", "--force").exit_code == 0
        assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]  # one shard: one file
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf.")]  # no leftovers

    def test_max_shard_size_needs_safetensors(self, store, tmp_path):
        url, _ = store
        result = invoke("restore", url, "-o", str(tmp_path / "d"), "--max-shard-size", "1GB")
        assert result.exit_code == 1 and "add --format safetensors" in result.output
        into_dir = invoke("restore", url, "-o", str(tmp_path), "--force")  # a directory for one file
        assert into_dir.exit_code == 1 and "is a directory; give a file name" in into_dir.output

    def test_safetensors_flat_by_key_path(self, store, tmp_path):
        url, states = store
        out = tmp_path / "ckpt.safetensors"
        result = invoke("restore", url, "--out", str(out), "--format", "safetensors")
        assert result.exit_code == 0, result.output
        got = load_file(out)
        want = states[2]
        expected = {
            **{f"model/{k}": v for k, v in want["model"].items()},
            **{
                f"optimizer/state/{i}/{k}": v
                for i, entry in want["optimizer"]["state"].items()
                for k, v in entry.items()
            },
            "extra/np": torch.from_numpy(want["extra"]["np"]),
            "extra/bf16": want["extra"]["bf16"],
            "extra/mask": want["extra"]["mask"],
            "extra/view": want["extra"]["view"],
            "tied/0": want["tied"][0],
            "tied/1": want["tied"][1],
        }
        assert sorted(got) == sorted(expected)
        for key, tensor in expected.items():
            assert got[key].dtype == tensor.dtype, key
            assert got[key].shape == tensor.shape, key
            assert tensor_bits(got[key]) == tensor_bits(tensor), key
        with safe_open(out, "pt") as f:
            assert f.metadata()["ckptflow.version"] == "2"

    def test_refuses_to_overwrite_without_force(self, store, tmp_path):
        url, states = store
        out = tmp_path / "ckpt.pt"
        out.write_bytes(b"precious")
        result = invoke("restore", url, "--out", str(out))
        assert result.exit_code == 1
        assert "exists; pass --force" in result.stderr
        assert out.read_bytes() == b"precious"
        assert invoke("restore", url, "--out", str(out), "--force").exit_code == 0
        assert_same_state(torch.load(out, weights_only=True), as_torch(states[2]))

    @pytest.mark.parametrize("fmt", ["torch", "safetensors"])
    def test_write_failing_midway_leaves_no_half_file(self, tmp_path, fmt):
        """A write that fails halfway (a file size limit, as on a full disk) leaves FILE as it was."""
        url = str(tmp_path / "store")
        CheckpointStore(url).save({"a": torch.randn(256, 256), "b": torch.randn(256, 256)}, epoch=0)
        outdir = tmp_path / "out"
        outdir.mkdir()
        (outdir / "old.bin").write_bytes(b"old")

        def limit_file_size() -> None:  # in the child: writes past 100 kB fail with EFBIG
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

        for name, force in (("new.bin", []), ("old.bin", ["--force"])):
            args = ["restore", url, "-o", str(outdir / name), "--format", fmt, *force]
            proc = subprocess.run(
                [sys.executable, "-m", "ckptflow.flows.cli", *args],
                capture_output=True,
                text=True,
                timeout=120,
                preexec_fn=limit_file_size,
            )
            assert proc.returncode == 1, proc.stderr
            assert len(proc.stderr.splitlines()) == 1, proc.stderr
            assert proc.stderr.startswith(f"error: writing {outdir / name} failed")
        assert sorted(p.name for p in outdir.iterdir()) == ["old.bin"]
        assert (outdir / "old.bin").read_bytes() == b"old"

    @pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
    def test_state_safetensors_cannot_hold(self, tmp_path):
        """safetensors has no complex32: the message says to use --format torch, and no file is left."""
        url = str(tmp_path / "store")
        CheckpointStore(url).save({"z": torch.zeros(3, dtype=torch.complex32), "w": torch.ones(2)}, epoch=0)
        outdir = tmp_path / "out"
        outdir.mkdir()
        (outdir / "old.safetensors").write_bytes(b"old")
        for name in ("new.safetensors", "old.safetensors"):
            result = invoke("restore", url, "-o", str(outdir / name), "--format", "safetensors", "--force")
            assert result.exit_code == 1
            assert result.stderr.startswith("error: the safetensors format cannot hold this state")
            assert "--format torch" in result.stderr
        assert sorted(p.name for p in outdir.iterdir()) == ["old.safetensors"]
        assert (outdir / "old.safetensors").read_bytes() == b"old"

    def test_missing_parent_directories_are_created(self, store, tmp_path):
        """Bug fix (issue 34): ``restore --out dir/file`` failed when ``dir`` did not exist."""
        url, states = store
        out = tmp_path / "exports" / "run1" / "model.pt"
        result = invoke("restore", url, "--version", "1", "--out", str(out))
        assert result.exit_code == 0, result.output
        assert f"restored version 1 (epoch 1) to {out}" in result.stdout
        assert_same_state(torch.load(out, weights_only=True), as_torch(states[1]))
        shards = tmp_path / "hf" / "run1" / "export"
        args = ["--format", "safetensors", "--keys", "model", "--max-shard-size", "1KB"]
        result = invoke("restore", url, "--out", str(shards), *args)
        assert result.exit_code == 0, result.output
        assert list(shards.glob("*.safetensors")), sorted(p.name for p in shards.iterdir())

    def test_a_failed_restore_leaves_no_directory_it_created(self, store, tmp_path):
        url, _ = store
        out = tmp_path / "new" / "deeper" / "x.pt"
        result = invoke("restore", url, "-o", str(out), "--keys", "modle")
        assert result.exit_code == 1
        assert result.stderr.startswith("error: no key 'modle' in the checkpoint")
        assert not (tmp_path / "new").exists()

    def test_a_file_in_the_way_of_the_directory_is_named(self, store, tmp_path):
        url, _ = store
        (tmp_path / "notes.txt").write_text("mine")
        result = invoke("restore", url, "-o", str(tmp_path / "notes.txt" / "sub" / "x.pt"))
        assert result.exit_code == 1
        assert result.stderr.strip() == (
            f"error: {tmp_path / 'notes.txt'} is a file, not a directory: give --out a path in a directory"
        )
        assert (tmp_path / "notes.txt").read_text() == "mine"

    @pytest.mark.parametrize("dangling", [False, True])
    def test_a_symlinked_out_is_refused_and_nothing_is_written_through_it(self, store, tmp_path, dangling):
        url, _ = store
        target = tmp_path / "elsewhere" / "precious.pt"
        target.parent.mkdir()
        if not dangling:
            target.write_bytes(b"precious")
        link = tmp_path / "out" / "model.pt"
        link.parent.mkdir()
        link.symlink_to(target)
        result = invoke("restore", url, "-o", str(link), "--force")
        assert result.exit_code == 1, result.output
        assert result.stderr.strip() == (
            f"error: {link} is a symbolic link (to {target}): restore writes no file through a link; "
            "give the path of a real file"
        )
        assert link.is_symlink()
        assert sorted(p.name for p in target.parent.iterdir()) == ([] if dangling else ["precious.pt"])
        if not dangling:
            assert target.read_bytes() == b"precious"
        through_dir = tmp_path / "linked-dir"
        through_dir.symlink_to(tmp_path / "nowhere")  # a dangling link on the way to OUT
        result = invoke("restore", url, "-o", str(through_dir / "sub" / "x.pt"))
        assert result.exit_code == 1
        assert f"error: {through_dir} is a symbolic link to nothing" in result.stderr
        assert not (tmp_path / "nowhere").exists()

    def test_unknown_key_fails(self, store, tmp_path):
        url, _ = store
        out = tmp_path / "x.pt"
        result = invoke("restore", url, "-o", str(out), "--keys", "modle")
        assert result.exit_code == 1
        assert result.stderr.startswith("error: no key 'modle' in the checkpoint")
        assert not out.exists()


class TestPrune:
    def test_keep_last(self, tmp_path):
        url = str(tmp_path / "store")
        many_versions(url, 5)
        result = invoke("prune", url, "--keep-last", "2")
        assert result.exit_code == 0, result.output
        removed = [line.split()[2] for line in result.stdout.splitlines() if line.startswith("removed")]
        assert removed == ["0", "1", "2"]
        assert "kept versions: 3, 4" in result.stdout
        assert committed(url) == [3, 4]
        assert sorted(p.name for p in Path(url).glob("v*")) == ["v000003", "v000004"]

    def test_dry_run_removes_nothing(self, tmp_path):
        url = str(tmp_path / "store")
        many_versions(url, 4)
        result = invoke("prune", url, "--keep-last", "1", "--dry-run")
        assert result.exit_code == 0
        assert [
            line.split()[3] for line in result.stdout.splitlines() if line.startswith("would remove")
        ] == [
            "0",
            "1",
            "2",
        ]
        assert committed(url) == [0, 1, 2, 3]

    def test_keep_best_and_every(self, tmp_path):
        url = str(tmp_path / "store")
        many_versions(url, 6, losses=[5.0, 0.1, 4.0, 3.0, 2.0, 1.0])
        result = invoke("prune", url, "--keep-last", "1", "--keep-best", "loss", "--best-mode", "min")
        assert result.exit_code == 0, result.output
        assert committed(url) == [1, 5]
        many_versions(url2 := str(tmp_path / "other"), 6)
        assert invoke("prune", url2, "--keep-every", "3").exit_code == 0
        assert committed(url2) == [0, 3, 5]

    def test_unknown_metric_removes_nothing(self, tmp_path):
        url = str(tmp_path / "store")
        many_versions(url, 3)
        result = invoke("prune", url, "--keep-last", "1", "--keep-best", "lsos", "--best-mode", "min")
        assert result.exit_code == 1
        assert "no committed version has the metric 'lsos' (metrics: loss)" in result.stderr
        assert committed(url) == [0, 1, 2]


def accuracy_versions(url: str) -> None:
    """Versions 1-7 (epochs 1-7) as the demo makes them: val_acc rising, 0.599 at version 1, best at 6."""
    accs = [0.599, 0.71, 0.82, 0.88, 0.9, 0.953, 0.95]
    with CheckpointStore(url, options=StoreOptions(shards=1, threads=1)) as s:
        for epoch, acc in enumerate(accs, start=1):
            s.save({"w": torch.full((4,), float(epoch))}, epoch=epoch, metrics={"val_acc": acc})


class TestPruneBestMode:
    """Bug fix (issue 34): ``prune --keep-best val_acc`` without ``--mode`` silently took the minimum:
    it kept version 1 (val_acc 0.599) as "best" and removed the best one, without saying which mode
    it used; and the option was ``--mode`` on prune but ``--best-mode`` on run."""

    @pytest.mark.parametrize("extra", [[], ["--dry-run"]])
    def test_keep_best_without_a_direction_is_refused_and_removes_nothing(self, tmp_path, extra):
        url = str(tmp_path / "store")
        accuracy_versions(url)
        result = invoke("prune", url, "--keep-last", "1", "--keep-best", "val_acc", *extra, env=WIDE)
        assert result.exit_code == 2, result.output
        assert "--keep-best val_acc needs --best-mode" in result.output
        assert "max" in result.output and "min" in result.output
        assert committed(url) == [1, 2, 3, 4, 5, 6, 7]

    def test_the_best_by_max_is_kept_and_the_output_names_the_mode(self, tmp_path):
        url = str(tmp_path / "store")
        accuracy_versions(url)
        dry = invoke(
            "prune", url, "--keep-last", "1", "--keep-best", "val_acc", "--best-mode", "max", "--dry-run"
        )
        assert dry.exit_code == 0, dry.output
        assert "would keep the best by val_acc (max): version 6 (epoch 6, val_acc=0.953)" in dry.stdout
        real = invoke("prune", url, "--keep-last", "1", "--keep-best", "val_acc", "--best-mode", "max")
        assert real.exit_code == 0, real.output
        assert "kept the best by val_acc (max): version 6 (epoch 6, val_acc=0.953)" in real.stdout
        assert committed(url) == [6, 7]

    def test_min_is_said_too(self, tmp_path):
        url = str(tmp_path / "store")
        many_versions(url, 4, losses=[3.0, 0.5, 2.0, 1.0])
        result = invoke("prune", url, "--keep-best", "loss", "--best-mode", "min")
        assert result.exit_code == 0, result.output
        assert "kept the best by loss (min): version 1 (epoch 1, loss=0.5)" in result.stdout
        assert committed(url) == [1, 3]

    def test_the_old_mode_option_still_works_hidden_and_says_so(self, tmp_path):
        url = str(tmp_path / "store")
        accuracy_versions(url)
        result = invoke("prune", url, "--keep-last", "1", "--keep-best", "val_acc", "--mode", "max")
        assert result.exit_code == 0, result.output
        assert "--mode is deprecated: use --best-mode" in result.stderr
        assert committed(url) == [6, 7]
        clash = invoke("prune", url, "--keep-best", "val_acc", "--mode", "max", "--best-mode", "min")
        assert clash.exit_code == 2
        assert "--mode is the old name of --best-mode" in clash.output
        help_text = invoke("prune", "--help", env=WIDE).stdout
        assert "--best-mode" in help_text and "--mode " not in help_text
        assert "Required with --keep-best" in help_text

    def test_best_mode_needs_keep_best(self, tmp_path):
        url = str(tmp_path / "store")
        accuracy_versions(url)
        result = invoke("prune", url, "--keep-last", "1", "--best-mode", "max")
        assert result.exit_code == 2
        assert "--best-mode needs --keep-best" in result.output
        assert committed(url) == [1, 2, 3, 4, 5, 6, 7]

    def test_run_refuses_keep_best_without_a_direction_before_anything_starts(self, tmp_path):
        store = tmp_path / "s"
        result = CliRunner().invoke(app, ["run", "--storage", str(store), "--keep-best", "val_acc"], env=WIDE)
        assert result.exit_code == 2, result.output
        assert "--keep-best val_acc needs --best-mode" in result.output
        assert not store.exists()
        help_text = CliRunner().invoke(app, ["run", "--help"], env=WIDE).stdout
        assert "Required with --keep-best" in help_text


class TestGc:
    def test_removes_only_leftovers(self, store):
        url, _ = store
        leftover = Path(url) / "v000003"
        leftover.mkdir()
        (leftover / "shard-r0-00.h5").write_bytes(b"partial")
        hour_ago = time.time() - 3600
        for path in (leftover / "shard-r0-00.h5", leftover):
            os.utime(path, (hour_ago, hour_ago))
        dry = invoke("gc", url, "--dry-run")
        assert dry.exit_code == 0
        assert dry.stdout.strip() == f"would remove uncommitted {url}/v000003"
        assert leftover.exists()
        real = invoke("gc", url)
        assert real.stdout.strip() == f"removed uncommitted {url}/v000003\nfreed 7 B"  # b"partial"
        assert not leftover.exists()
        assert committed(url) == [0, 1, 2]
        assert invoke("verify", url, "--all").exit_code == 0
        again = invoke("gc", url)
        assert again.stdout.strip() == f"no uncommitted leftovers in {url}"

    def test_spares_leftovers_a_save_may_still_be_writing(self, store):
        url, _ = store
        leftover = Path(url) / "v000003"
        leftover.mkdir()
        (leftover / "shard-r0-00.h5").write_bytes(b"being written")
        spared = (
            f"left {url}/v000003: changed in the last 900s, a save may be writing it (--min-age 0 removes it)"
        )
        for args in ((), ("--dry-run",)):
            result = invoke("gc", url, *args)
            assert result.exit_code == 0
            assert result.stdout.strip() == spared
            assert (leftover / "shard-r0-00.h5").read_bytes() == b"being written"
        assert invoke("gc", url, "--min-age", "3600", "--dry-run").stdout.strip() == spared.replace(
            "900s", "3600s"
        )
        real = invoke("gc", url, "--min-age", "0")
        assert real.stdout.strip() == f"removed uncommitted {url}/v000003\nfreed 13 B"  # b"being written"
        assert not leftover.exists()
        assert committed(url) == [0, 1, 2]
        assert invoke("gc", url, "--min-age", "-1").exit_code == 2


@pytest.mark.s3
class TestS3:
    """--storage-options reaches s3fs, and the secret in it is never printed."""

    def test_commands_against_s3(self, s3_bucket, tmp_path):
        bucket, options = s3_bucket
        url = f"s3://{bucket}/run1"
        state = make_state(0)
        CheckpointStore(url, storage_options=options).save(state, epoch=4, metrics={"loss": 0.25})
        text = json.dumps(options)
        ls = invoke("ls", url, "--json", "--storage-options", text)
        assert ls.exit_code == 0, ls.output
        assert [v["url"] for v in json.loads(ls.stdout)["versions"]] == [f"{url}/v000004"]
        verify = invoke("verify", url, env={"CKPTFLOW_STORAGE_OPTIONS": text})
        assert verify.exit_code == 0, verify.output
        options_file = tmp_path / "s3.json"
        options_file.write_text(text)
        out = tmp_path / "s3.pt"
        restore = invoke("restore", url, "-o", str(out), "--storage-options", f"@{options_file}")
        assert restore.exit_code == 0, restore.output
        assert_same_state(torch.load(out, weights_only=True), as_torch(state))
        missing = invoke("show", url, "--version", "3", "--storage-options", text)
        assert missing.exit_code == 1
        outputs = [ls, verify, restore, missing, invoke("show", url, "--storage-options", text, env=WIDE)]
        for result in outputs:
            assert S3_SECRET not in result.stdout + result.stderr


@pytest.mark.parametrize(
    ("args", "early"),
    [
        (["run"], True),
        (["run", "--epochs", "3", "--nproc", "1"], True),
        (["run", "--nproc=1"], True),
        (["run", "--nproc", "2"], True),  # ranks are trainers too: the launcher starts first
        (["run", "--nproc=4"], True),
        (["run", "--in-process"], False),
        (["run", "--help"], False),
        (["ls", "run"], False),
        ([], False),
    ],
)
def test_the_launcher_starts_first_only_for_runs_that_use_trainers(args, early):
    assert trains_in_a_child(args) is early


class TestRunOptions:
    """``ckptflow run``'s options reach their PipelineConfig fields (issue 36: each option names its
    field; six fields had no option); the fields no option sets keep their defaults."""

    # every option of `run`, by its parameter's name, with a value other than its default
    GIVEN = {
        "storage": ["--storage", "somewhere/else"],
        "epochs": ["--epochs", "7"],
        "spec": ["--spec", "tests.pipeline.specs:MarkedDigitsSpec"],
        "spec_config": ["--spec-config", '{"hidden": 8}'],
        "seed": ["--seed", "3"],
        "shards": ["--shards", "2"],
        "async_save": ["--no-async-save"],
        "dedup": ["--no-dedup"],
        "save_every": ["--save-every", "2"],
        "save_every_steps": ["--save-every-steps", "40"],
        "save_every_minutes": ["--save-every-minutes", "15"],
        "stop_grace": ["--stop-grace", "12"],
        "save_retries": ["--save-retries", "0"],
        "save_timeout": ["--save-timeout", "30"],
        "archive_every": ["--archive-every", "3"],
        "archive_size": ["--archive-size", "2MiB"],
        "keep_loose": ["--keep-loose"],
        "max_pending": ["--max-pending", "4"],
        "upload_every": ["--upload-every", "epoch"],
        "durable_keep_last": ["--durable-keep-last", "3"],
        "upload_retry": ["--upload-retry", "5"],
        "stop_drain": ["--stop-drain", "7"],
        "keep_undurable": ["--no-keep-undurable"],
        "upload_to": ["--upload-to", "s3://bucket/mirror"],
        "upload_options": ["--upload-options", '{"client_kwargs": {"region_name": "eu-west-1"}}'],
        "upload_secret": ["--upload-secret", "aws-credentials/uploads"],
        "upload_versions": ["--no-upload-versions"],
        "keep_last": ["--keep-last", "4"],
        "keep_every": ["--keep-every", "5"],
        "keep_best": ["--keep-best", "loss"],
        "best_mode": ["--best-mode", "max"],
        "best_count": ["--best-count", "2"],
        "stop_metric": ["--stop-metric", "accuracy"],
        "stop_mode": ["--stop-mode", "max"],
        "target": ["--target", "0.9"],
        "patience": ["--patience", "2"],
        "max_seconds": ["--max-seconds", "60"],
        "epoch_retries": ["--epoch-retries", "0"],
        "nproc": ["--nproc", "2"],
        "nnodes": ["--nnodes", "2"],
        "rdzv_endpoint": ["--rdzv-endpoint", "10.0.0.1:29400"],
        "rdzv_id": ["--rdzv-id", "run1"],
        "dist_backend": ["--dist-backend", "gloo"],
        "rank_timeout": ["--rank-timeout", "120"],
        "torch_threads": ["--torch-threads", "3"],
        "storage_options": ["--storage-options", '{"auto_mkdir": true}'],
        "storage_secret": ["--storage-secret", "secret/store"],
        "lease_timeout": ["--lease-timeout", "60"],
        "allow_config_change": ["--allow-config-change"],
        "resume_only": ["--resume-only"],
        "in_process": ["--in-process"],
        "verbose": ["--verbose"],  # not a field: it also keeps this process's environment as it is
    }
    WANT = {
        "storage": "somewhere/else",
        "storage_options": {"auto_mkdir": True},
        "storage_secret": "secret/store",
        "spec": "tests.pipeline.specs:MarkedDigitsSpec",
        "spec_config": {"hidden": 8},
        "seed": 3,
        "epochs": 7,
        "save_every": 2,
        "save_every_steps": 40,
        "save_every_minutes": 15.0,
        "stop_grace_seconds": 12.0,
        "shards": 2,
        "async_save": False,
        "dedup": False,
        "epoch_retries": 0,
        "save_retries": 0,
        "save_timeout_seconds": 30.0,
        "torch_threads": 3,
        "retention": {
            "keep_last": 4,
            "keep_every": 5,
            "keep_best": "loss",
            "best_mode": "max",
            "best_count": 2,
            "keep_undurable": False,
        },
        "stop": {"metric": "accuracy", "mode": "max", "target": 0.9, "patience": 2, "max_seconds": 60.0},
        "archive": {
            "every": 3,
            "target_bytes": 2 << 20,
            "keep_loose": True,
            "upload_to": "s3://bucket/mirror",
            "upload_options": {"client_kwargs": {"region_name": "eu-west-1"}},
            "upload_secret": "aws-credentials/uploads",
            "upload_versions": False,
            "max_pending": 4,
            "upload_every": "epoch",
            "durable_keep_last": 3,
            "upload_retry_seconds": 5.0,
            "stop_drain_seconds": 7.0,
        },
        "allow_config_change": True,
        "resume_only": True,
        "nproc": 2,
        "nnodes": 2,
        "rdzv_endpoint": "10.0.0.1:29400",
        "rdzv_id": "run1",
        "dist_backend": "gloo",
        "rank_timeout_seconds": 120.0,
        "lease_timeout_seconds": 60.0,
    }

    NO_OPTION: set[str] = set()  # every field has an option (issue 36)

    def test_every_option_sets_its_field(self, monkeypatch):
        from typer.main import get_command

        from ckptflow.flows import preflight
        from ckptflow.tasks.config import PipelineConfig

        class Checked(Exception):
            """Raised by the store check with the config it got: the run goes no further."""

        def check_store(config: PipelineConfig) -> None:
            raise Checked(config)

        def config_of(*args: str) -> PipelineConfig:
            result = CliRunner().invoke(app, ["run", *args])
            assert isinstance(result.exception, Checked), result.output
            return result.exception.args[0]

        monkeypatch.setattr(preflight, "check_store", check_store)
        run = get_command(app).commands["run"]  # type: ignore[attr-defined]
        # --config gives fields from a file (tests/test_cli_config_flags.py, TestConfigFile)
        assert {p.name for p in run.params} - {"config_file"} == set(self.GIVEN)
        # --in-process goes alone: it refuses --nproc/--nnodes, which train on ranks
        together = [word for name, args in self.GIVEN.items() if name != "in_process" for word in args]
        got = config_of(*together)
        assert got == PipelineConfig.model_validate(self.WANT)
        # the test can fail: every field an option sets differs from what it is without the option
        plain = config_of(*self.GIVEN["storage"], *self.GIVEN["verbose"]).model_dump()
        same = {name for name, value in got.model_dump().items() if value == plain[name]}
        assert same == {"storage", "train_process", *self.NO_OPTION}
        assert plain["train_process"] is True
        alone = config_of(*self.GIVEN["storage"], *self.GIVEN["in_process"])
        assert alone.train_process is False


def test_in_process_refuses_ranks(tmp_path):
    """The debugger's mode trains in the CLI's process: it cannot also train on ranks."""
    args = ["run", "--storage", str(tmp_path / "s"), "--in-process", "--nproc", "2"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert "--in-process trains in this process" in result.output
    assert not (tmp_path / "s").exists()


class TestRestoreBest:
    def test_restores_the_best_by_a_metric_in_the_direction_given(self, tmp_path):
        url = str(tmp_path / "store")
        with CheckpointStore(url) as s:
            for epoch, acc in [(1, 0.5), (2, 0.9), (3, 0.7)]:
                s.save({"w": torch.full((2,), float(epoch))}, epoch=epoch, metrics={"val_acc": acc})
        result = invoke(
            "restore", url, "--best", "val_acc", "--best-mode", "max", "--out", str(tmp_path / "b.pt")
        )
        assert result.exit_code == 0, result.output
        assert "the best by val_acc (max): version 2" in result.stdout
        assert torch.equal(torch.load(tmp_path / "b.pt", weights_only=True)["w"], torch.full((2,), 2.0))
        worst = invoke(
            "restore", url, "--best", "val_acc", "--best-mode", "min", "--out", str(tmp_path / "w.pt")
        )
        assert worst.exit_code == 0 and "version 1" in worst.stdout

    def test_without_a_direction_or_the_metric_it_says_what_to_give(self, tmp_path):
        url = str(tmp_path / "store")
        many_versions(url, 2)
        usage = invoke("restore", url, "--best", "loss", "--out", str(tmp_path / "x.pt"))
        assert usage.exit_code == 2 and "needs --best-mode" in usage.output
        both = invoke(
            "restore", url, "--best", "loss", "--best-mode", "min", "--version", "1", "--out", "x.pt"
        )
        assert both.exit_code == 2 and "not both" in both.output
        missing = invoke(
            "restore", url, "--best", "f1", "--best-mode", "max", "--out", str(tmp_path / "x.pt")
        )
        assert missing.exit_code == 1 and "no committed version records the metric 'f1'" in missing.stderr
        assert "their metrics: loss" in missing.stderr and not (tmp_path / "x.pt").exists()

    def test_store_best_ties_go_to_the_newest(self, tmp_path):
        url = str(tmp_path / "store")
        many_versions(url, 4, losses=[0.3, 0.1, 0.2, 0.1])
        store = CheckpointStore(url)
        assert store.best("loss", "min").version == 3
        assert store.best("loss", "max").version == 0
        with pytest.raises(ValueError, match="mode must be 'max'"):
            store.best("loss", "lower")  # type: ignore[arg-type]


def test_every_command_that_reports_has_json(tmp_path: Path) -> None:
    """``--json`` on prune, gc, archive and restore: one document each, what the text lines say."""
    url = str(tmp_path / "s")
    many_versions(url, 5)
    (tmp_path / "s" / "v000009").mkdir()  # a leftover of a crashed save
    (tmp_path / "s" / "v000009" / "shard-r0-00.h5").write_bytes(b"x" * 100)

    planned = invoke("prune", url, "--keep-last", "2", "--dry-run", "--json")
    assert planned.exit_code == 0, planned.output
    doc = json.loads(planned.stdout)
    assert (doc["dry_run"], doc["kept"], doc["removed"]) == (True, [3, 4], [0, 1, 2])
    assert doc["freed_bytes"] > 0 and [v.version for v in CheckpointStore(url).versions()] == [0, 1, 2, 3, 4]
    pruned = json.loads(invoke("prune", url, "--keep-last", "4", "--json").stdout)
    assert pruned["removed"] == [0] and pruned["dry_run"] is False

    cleaned = json.loads(invoke("gc", url, "--min-age", "0", "--json").stdout)
    assert cleaned["removed"]["versions"] == [9] and cleaned["freed_bytes"] >= 100

    archived = invoke("archive", url, "--versions", "1-2", "--drop-loose", "--json")
    assert archived.exit_code == 0, archived.output
    doc = json.loads(archived.stdout)
    assert doc["versions"] == [1, 2] and doc["loose_removed"] == [1, 2] and doc["tarball"].endswith(".tar")

    out = tmp_path / "w.pt"
    restored = invoke("restore", url, "--version", "3", "--out", str(out), "--json")
    assert restored.exit_code == 0, restored.output
    doc = json.loads(restored.stdout)
    assert (doc["version"], doc["format"], doc["tensors"], doc["bytes"]) == (
        3,
        "torch",
        1,
        out.stat().st_size,
    )
    best = invoke(
        "restore", url, "--best", "loss", "--best-mode", "min", "--out", str(tmp_path / "b.pt"), "--json"
    )
    assert json.loads(best.stdout)["version"] == 4 and "the best by loss" in best.stderr


def test_shell_completion_completes_commands_and_options() -> None:
    """``ckptflow --install-completion`` / ``--show-completion`` give the shell's script; through the
    protocol that script speaks, the real program completes command names and their options."""
    # Typer asks which shell runs the command (its parent process): a user's bash here, whatever
    # shell started pytest (make runs recipes under sh, which Typer does not support).
    shown = f"{shlex.quote(sys.executable)} -m ckptflow.flows.cli --show-completion; exit $?"
    script = subprocess.run(["bash", "-c", shown], capture_output=True, text=True, timeout=120)
    assert script.returncode == 0 and "_ckptflow_completion" in script.stdout, script.stderr

    def complete(words: str) -> list[str]:
        env = {
            **os.environ,
            "_CKPTFLOW_COMPLETE": "complete_bash",
            "COMP_WORDS": words,
            "COMP_CWORD": str(len(words.split()) - 1),
        }
        cmd = [sys.executable, "-m", "ckptflow.flows.cli"]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    assert complete("ckptflow pr") == ["prune"]
    assert complete("ckptflow prune /tmp --keep-") == ["--keep-last", "--keep-every", "--keep-best"]
