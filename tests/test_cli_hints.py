"""What the CLI and README tell a user on the way: each test names the fault it fixed.

- The resume hint printed at the end of ``ckptflow run`` omitted ``--spec`` and
  ``--spec-config``, so the command it suggested was refused as a
  configuration change; it said nothing of what training longer does to a
  schedule.
- ``--help`` was cut off on narrow terminals (the default of ``--spec`` showed
  as ``ckptflow.flows.…``).
- Restored safetensors files were created 0600 while torch files were 0644.
- The README never showed how to pass an S3 endpoint.
- The README spoke of the sessions that wrote it rather than of the project.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.main import get_command
from typer.testing import CliRunner

from ckptflow.flows.cli import app
from ckptflow.flows.run_cmd import _print_next_steps
from ckptflow.storage import CheckpointStore
from ckptflow.tasks.config import PipelineConfig

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"


def parsed_run_command(line: str) -> dict:
    """The options ``ckptflow run`` would get from a shell line (parsed by the real command)."""
    words = shlex.split(line)
    assert words[:2] == ["ckptflow", "run"], words
    command = get_command(app).commands["run"]  # type: ignore[attr-defined]
    return command.make_context("run", words[2:]).params


class TestResumeHint:
    @pytest.mark.parametrize("nproc", [1, 2])
    def test_it_repeats_the_identity_and_quotes_for_the_shell(self, tmp_path, capsys, nproc):
        storage = str(tmp_path / "my store")
        config = PipelineConfig(
            storage=storage,
            spec="tests.pipeline.specs:MarkedDigitsSpec",
            spec_config={"hidden": 32, "note": 'it\'s a "b" $HOME'},
            seed=7,
            epochs=3,
            nproc=nproc,
        )
        _print_next_steps(config, {"storage": storage, "latest_url": f"{storage}/v000003"})
        out = capsys.readouterr().out
        line = next(x for x in out.splitlines() if "resume / train longer:" in x).split(":", 1)[1].strip()

        params = parsed_run_command(line)
        assert params["storage"] == storage
        assert params["spec"] == config.spec
        assert json.loads(params["spec_config"]) == config.spec_config
        assert params["seed"] == 7
        assert params["epochs"] == 8
        assert params["nproc"] == nproc
        # the resumed run would have the same identity: it is not refused
        resumed = PipelineConfig(
            storage=params["storage"],
            spec=params["spec"],
            spec_config=json.loads(params["spec_config"]),
            seed=params["seed"],
        )
        assert resumed.identity() == config.identity()
        for other in [x for x in out.splitlines() if x.strip().startswith(("list", "inspect", "verify"))]:
            assert shlex.split(other.split(":", 1)[1])[-1] == storage

    def test_it_says_a_longer_run_keeps_the_schedule_it_was_planned_for(self, tmp_path, capsys):
        """Bug fix: the hint offered ``--epochs N`` (train longer) without a word on schedules, and
        the README's OneCycleLR, sized from the run's epochs, failed on it (``Tried to step 97
        times``). It now says which epochs a schedule stays planned for, and where to read more."""
        storage = str(tmp_path / "s")
        result = {"storage": storage, "latest_url": "x", "planned_epochs": 10}
        _print_next_steps(PipelineConfig(storage=storage, epochs=10), result)
        out = capsys.readouterr().out.splitlines()
        at = next(i for i, x in enumerate(out) if "resume / train longer:" in x)
        assert "--epochs 15" in out[at]
        note = out[at + 1]
        assert "RunFacts.planned_epochs stays 10" in note and "Your own model" in note, note

    def test_it_keeps_the_durable_tier(self, tmp_path, capsys):
        """Bug fix: with ``--upload-to`` the hint left it out, so the resume it offered neither
        fetched from nor drained to the durable tier (and on a new machine started over)."""
        storage = str(tmp_path / "fast")
        archive = {
            "upload_to": "s3://bucket/run 1",
            "upload_options": {"endpoint_url": "http://127.0.0.1:8333"},
            "upload_every": "epoch",
            "durable_keep_last": 3,
        }
        config = PipelineConfig(storage=storage, epochs=2, archive=archive)
        _print_next_steps(config, {"storage": storage, "latest_url": "x"})
        line = next(x for x in capsys.readouterr().out.splitlines() if "resume / train longer:" in x)
        params = parsed_run_command(line.split(":", 1)[1].strip())
        assert params["upload_to"] == "s3://bucket/run 1"
        assert json.loads(params["upload_options"]) == archive["upload_options"]
        assert params["upload_every"] == "epoch" and params["durable_keep_last"] == 3

    def test_defaults_are_left_out(self, tmp_path, capsys):
        storage = str(tmp_path / "s")
        _print_next_steps(PipelineConfig(storage=storage, epochs=2), {"storage": storage, "latest_url": "x"})
        line = next(x for x in capsys.readouterr().out.splitlines() if "resume / train longer:" in x)
        assert line.split(":", 1)[1].strip() == f"ckptflow run --storage {storage} --epochs 7"


class TestHelpOnNarrowTerminals:
    @pytest.mark.parametrize("command", ["run", "restore", "prune", "verify"])
    def test_nothing_is_cut_off_at_60_columns(self, tmp_path, command):
        """Through the console script (flows/launch.py), as a user's shell runs it."""
        script = Path(sys.executable).parent / "ckptflow"
        env = {**os.environ, "COLUMNS": "60"}
        env.pop("TYPER_USE_RICH", None)
        args = [str(script), command, "--help"]
        proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert "…" not in proc.stdout, proc.stdout
        joined = "".join(proc.stdout.split())
        click_command = get_command(app).commands[command]  # type: ignore[attr-defined]
        for param in click_command.params:
            if getattr(param, "hidden", False):  # a deprecated alias (prune's --mode) is not shown
                continue
            for name in param.opts:
                assert name in joined, f"{name} missing from {command} --help"
        if command == "run":
            assert "[default:ckptflow.flows.demo:DigitsSpec]" in joined
            assert "[default:./checkpoints]" in joined


class TestRestoredFileModes:
    @pytest.mark.parametrize("umask", [0o022, 0o027])
    def test_both_formats_get_the_mode_of_a_plain_file(self, tmp_path, umask):
        store = str(tmp_path / "store")
        CheckpointStore(store).save({"w": torch.arange(4.0)}, epoch=1)
        old = os.umask(umask)
        try:
            modes = {}
            for fmt in ("torch", "safetensors"):
                out = tmp_path / f"model.{fmt}"
                result = CliRunner().invoke(app, ["restore", store, "--out", str(out), "--format", fmt])
                assert result.exit_code == 0, result.output
                modes[fmt] = out.stat().st_mode & 0o777
        finally:
            os.umask(old)
        assert modes == {"torch": 0o666 & ~umask, "safetensors": 0o666 & ~umask}

    def test_an_overwritten_file_keeps_its_mode(self, tmp_path):
        store = str(tmp_path / "store")
        CheckpointStore(store).save({"w": torch.arange(4.0)}, epoch=1)
        out = tmp_path / "model.safetensors"
        out.write_bytes(b"old")
        out.chmod(0o604)
        args = ["restore", store, "--out", str(out), "--format", "safetensors", "--force"]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        assert out.stat().st_mode & 0o777 == 0o604


class TestReadme:
    @pytest.mark.s3
    def test_the_s3_endpoint_example_reaches_an_s3_server(self, s3_bucket, s3_server):
        """The README's `--storage-options` for an endpoint, pointed at the test server, lists a store."""
        text = README.read_text()
        shown = re.findall(r"ckptflow (run --storage|ls) (s3://\S+) --storage-options '([^']+)'", text)
        ls_example = [(url, options) for command, url, options in shown if command == "ls"]
        assert ls_example, "the README shows no S3 endpoint"
        url, options_text = ls_example[0]
        options = json.loads(options_text)
        endpoint = options["client_kwargs"]["endpoint_url"]
        bucket, _ = s3_bucket
        ours = json.loads(options_text.replace(endpoint, s3_server))
        store_url = url.replace("s3://bucket/", f"s3://{bucket}/")
        CheckpointStore(store_url, storage_options=ours).save({"w": torch.ones(2)}, epoch=1)
        result = CliRunner().invoke(app, ["ls", store_url, "--json", "--storage-options", json.dumps(ours)])
        assert result.exit_code == 0, result.output
        assert [v["epoch"] for v in json.loads(result.stdout)["versions"]] == [1]
        run_examples = [u for command, u, _ in shown if command == "run --storage"]
        assert run_examples, "the README shows no `ckptflow run` with an S3 endpoint"

    def test_it_speaks_of_the_project_not_of_sessions(self):
        for path in [
            README,
            REPO / "bench" / "README.md",
            REPO / "CHANGELOG.md",
            *(REPO / "docs").glob("*.md"),
        ]:
            if path.exists():
                text = path.read_text().replace("boto3 session", "")
                assert not re.findall(r"(?i)\bsessions?\b", text), path
