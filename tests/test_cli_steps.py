"""Saves inside epochs on the command line: every version shows its epoch and global step, and
``--step N`` picks a version by the step it was saved at.

A store with real saves at an epoch's end and inside one (``user={"in_epoch": k, "epoch_steps": n}``),
run through the real CLI (typer's CliRunner; exit codes also through a real process). Assertions are
on the rows printed, the JSON keys, the bytes restored and the exact error lines.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from ckptflow.flows.cli import app
from ckptflow.storage import CheckpointStore, StoreOptions, VersionNotFoundError
from ckptflow.tasks.reporting.artifacts import checkpoint_row
from ckptflow.tasks.reporting.formatting import epoch_text
from tests.conftest import assert_same_state

WIDE = {"COLUMNS": "250"}  # rich tables wrap cells to the terminal's width
EPOCH = 4000  # steps per epoch
# (version, epoch, global step, user data): epoch 1's end, two saves inside epoch 2 (the second from a
# run that did not know the epoch's length), epoch 2's end.
SAVES = [
    (1, 1, 4000, {}),
    (2, 2, 5200, {"in_epoch": 1200, "epoch_steps": EPOCH}),
    (3, 2, 6400, {"in_epoch": 2400}),
    (4, 2, 8000, {}),
]
SHOWN = {1: "1", 2: "2 (1,200/4,000)", 3: "2 (2,400)", 4: "2"}  # the epoch column of each version


def weights(version: int) -> dict[str, Any]:
    return {"model": {"w": torch.full((3, 2), float(version)), "b": torch.arange(4) + version}}


@pytest.fixture
def store(tmp_path: Path) -> str:
    url = str(tmp_path / "store")
    with CheckpointStore(url, options=StoreOptions(shards=1, threads=1)) as s:
        for version, epoch, step, user in SAVES:
            info = s.save(
                weights(version), epoch=epoch, step=step, metrics={"loss": 1.0 / version}, user=user
            )
            assert info.version == version
    return url


def invoke(*args: str, env: dict[str, str] | None = None):
    return CliRunner().invoke(app, list(args), env=env)


def row_of(out: str, url: str, version: int) -> str:
    """The ls table's line of ``version`` (found by its place in the store, which ends the line)."""
    assert out.startswith(url), "the table's title is the store"
    (line,) = [line for line in out.splitlines() if line.rstrip(" │").endswith(f" v{version:06d}")]
    return line


def cells(line: str) -> list[str]:
    """The cells of a rich table's line (a header's too)."""
    return [cell.strip() for cell in re.split("[│┃]", line.strip().strip("│┃"))]


def summary(out: str) -> dict[str, str]:
    """The label-value rows of ``show``'s summary grid (labels of one or two words)."""
    rows = (re.match(r"^(\S+(?: \S+)?)\s{2,}(.*)$", line) for line in out.splitlines())
    return {m[1]: m[2].strip() for m in rows if m}


class TestLsShowsEpochAndStep:
    def test_table_epoch_column_says_how_far_into_its_epoch_each_version_was(self, store):
        result = invoke("ls", store, env=WIDE)
        assert result.exit_code == 0, result.output
        header = next(line for line in result.stdout.splitlines() if "version" in line and "epoch" in line)
        assert cells(header)[:3] == ["version", "epoch", "step"]
        for version, _, step, _ in SAVES:
            assert cells(row_of(result.stdout, store, version))[:3] == [
                str(version),
                SHOWN[version],
                str(step),
            ]

    def test_json_has_step_in_epoch_and_epoch_steps(self, store):
        result = invoke("ls", store, "--json")
        assert result.exit_code == 0, result.output
        got = [
            (v["version"], v["epoch"], v["step"], v["in_epoch"], v["epoch_steps"])
            for v in json.loads(result.stdout)["versions"]
        ]
        assert got == [
            (1, 1, 4000, None, None),
            (2, 2, 5200, 1200, EPOCH),
            (3, 2, 6400, 2400, None),
            (4, 2, 8000, None, None),
        ]

    def test_a_version_without_a_step_has_an_empty_step_cell(self, tmp_path):
        url = str(tmp_path / "nostep")
        CheckpointStore(url).save(weights(1), epoch=1)
        result = invoke("ls", url, env=WIDE)
        assert result.exit_code == 0, result.output
        assert cells(row_of(result.stdout, url, 1))[:3] == ["1", "1", ""]
        assert json.loads(invoke("ls", url, "--json").stdout)["versions"][0]["step"] is None

    def test_prefect_checkpoint_table_shows_the_epoch_as_ls_does(self, store):
        """The artifacts' epoch column and ls's come from one helper: a number at an epoch's end
        (a numeric column, as before), the same text inside one."""
        infos = CheckpointStore(store).versions()
        assert [epoch_text(i) for i in infos] == [SHOWN[i.version] for i in infos]
        assert [checkpoint_row(i)["epoch"] for i in infos] == [1, "2 (1,200/4,000)", "2 (2,400)", 2]


class TestShowSaysWhereInTheEpoch:
    @pytest.mark.parametrize(
        ("version", "in_epoch"),
        [(2, "1,200 of 4,000 steps"), (3, "2,400 steps"), (4, "its end")],
        ids=["known-length", "unknown-length", "epoch-end"],
    )
    def test_rows_epoch_in_epoch_and_step(self, store, version, in_epoch):
        result = invoke("show", store, "--version", str(version), env=WIDE)
        assert result.exit_code == 0, result.output
        rows = summary(result.stdout)
        _, epoch, step, _ = SAVES[version - 1]
        assert (rows["epoch"], rows["in epoch"], rows["step"]) == (str(epoch), in_epoch, str(step))

    def test_json_is_still_the_manifest_with_step_and_user_data(self, store):
        result = invoke("show", store, "--step", "5200", "--json")
        assert result.exit_code == 0, result.output
        doc = json.loads(result.stdout)
        assert doc == json.loads(CheckpointStore(store).manifest(2).to_json())
        assert (doc["version"], doc["step"], doc["user"]["in_epoch"], doc["user"]["epoch_steps"]) == (
            2,
            5200,
            1200,
            EPOCH,
        )


class TestStepSelectsTheVersion:
    def test_find_step_in_the_python_api(self, store):
        s = CheckpointStore(store)
        assert [s.find_step(step).version for _, _, step, _ in SAVES] == [1, 2, 3, 4]
        assert s.find_step(5201) is None and s.find_step(0) is None

    def test_load_by_step_in_the_python_api(self, store):
        s = CheckpointStore(store)
        for version, (_, _, step, _) in enumerate(SAVES, start=1):
            assert_same_state(s.load(step=step), s.load(version))
        with pytest.raises(
            VersionNotFoundError, match=r"has step 6000 in .*step 5200 \(version 2\) and step 6400"
        ):
            s.load(step=6000)
        with pytest.raises(ValueError, match="either version or step"):
            s.load(2, step=5200)

    def test_find_step_reads_archived_versions_and_prefers_the_newest(self, store):
        with CheckpointStore(store) as s:
            s.archive([1, 2])
            s.drop_loose([1, 2])
            assert s.find_step(5200).version == 2 and s.find_step(5200).archived
            again = s.save(weights(5), epoch=2, step=8000)  # a second save at one step
            assert s.find_step(8000).version == again.version == 5

    def test_show_step(self, store):
        result = invoke("show", store, "--step", "6400", env=WIDE)
        assert result.exit_code == 0, result.output
        assert summary(result.stdout)["version"] == f"3  {store}/v000003"

    def test_verify_step(self, store):
        result = invoke("verify", store, "--step", "5200")
        assert result.exit_code == 0, result.output
        assert result.stdout.startswith("ok version 2 (epoch 2 (1,200/4,000), step 5200, ")
        assert result.stdout.endswith(f" {store}/v000002\n")

    def test_restore_step_writes_that_versions_bytes(self, store, tmp_path):
        out = tmp_path / "model.pt"
        result = invoke("restore", store, "--step", "6400", "--out", str(out))
        assert result.exit_code == 0, result.output
        assert result.stdout.startswith(f"restored version 3 (epoch 2 (2,400)) to {out}: ")
        restored = torch.load(out, weights_only=True)
        assert torch.equal(restored["model"]["w"], weights(3)["model"]["w"])
        assert torch.equal(restored["model"]["b"], weights(3)["model"]["b"])


class TestStepErrors:
    @pytest.mark.parametrize(
        ("step", "nearest"),
        [
            (6000, "the nearest are step 5200 (version 2) and step 6400 (version 3)"),
            (10, "the nearest is step 4000 (version 1)"),
            (9000, "the nearest is step 8000 (version 4)"),
        ],
        ids=["between", "below-all", "above-all"],
    )
    @pytest.mark.parametrize("command", ["show", "verify", "restore"])
    def test_unknown_step_names_the_nearest(self, store, tmp_path, command, step, nearest):
        extra = ["--out", str(tmp_path / "out.pt")] if command == "restore" else []
        result = invoke(command, store, "--step", str(step), *extra)
        assert result.exit_code == 1, result.output
        assert result.stderr == (
            f"error: no committed version has step {step} in {store}: {nearest} "
            "(`ckptflow ls` lists every version's step)\n"
        )
        assert not (tmp_path / "out.pt").exists()

    def test_a_store_whose_versions_record_no_step(self, tmp_path):
        url = str(tmp_path / "nostep")
        with CheckpointStore(url) as s:
            s.save(weights(1), epoch=1)
            s.save(weights(2), epoch=2)
        result = invoke("verify", url, "--step", "100")
        assert result.exit_code == 1
        assert result.stderr == (
            f"error: no committed version has step 100 in {url}: none of its versions (1, 2) records a step; "
            "give --version instead\n"
        )

    @pytest.mark.parametrize("command", ["show", "verify", "restore"])
    def test_version_and_step_together_are_refused(self, store, tmp_path, command):
        extra = ["--out", str(tmp_path / "out.pt")] if command == "restore" else []
        result = invoke(command, store, "--version", "2", "--step", "5200", *extra)
        assert result.exit_code == 2, result.output
        assert "Invalid value for '--step': give either --version or --step, not both" in result.output
        assert not (tmp_path / "out.pt").exists()

    def test_verify_all_with_a_step_is_refused(self, store):
        result = invoke("verify", store, "--all", "--step", "5200")
        assert result.exit_code == 2, result.output
        assert "give either --step or --all, not both" in result.output

    def test_exit_codes_of_the_real_process(self, store):
        def run(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "ckptflow.flows.cli", *args],
                capture_output=True,
                text=True,
                timeout=120,
                env={**os.environ, "COLUMNS": "250"},
            )

        missing = run("verify", store, "--step", "6000")
        assert missing.returncode == 1 and "Traceback" not in missing.stderr
        assert missing.stderr.splitlines() == [
            f"error: no committed version has step 6000 in {store}: the nearest are step 5200 (version 2) "
            "and step 6400 (version 3) (`ckptflow ls` lists every version's step)"
        ]
        both = run("show", store, "--version", "1", "--step", "4000")
        assert both.returncode == 2 and "give either --version or --step, not both" in both.stderr
        found = run("verify", store, "--step", "8000")
        assert found.returncode == 0 and found.stdout.startswith("ok version 4 (epoch 2, step 8000, ")
