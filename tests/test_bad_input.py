"""Every bad input gets one line (issue 59): configs and JSON options that stay bounded, never hang and
never print a traceback.

``ckptflow run`` given a config or an option that cannot be a config's value ends with exit 2, an
``error:`` line naming what is wrong and a line saying where to look, within seconds and in
bounded memory, before Prefect starts and with nothing written: a YAML "billion laughs", a FIFO
given as ``--config``, a JSON nested 10,000 deep, a 5,000-digit number, ``NaN`` and infinities,
``true`` where a number is meant, and counts so large that a date overflows later. The
console script runs as a user runs it (:mod:`tests.test_cli_errors`'s launcher).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from tests.clirun import SECONDS, assert_prefect_never_started

BOMB = (
    "storage: ./checkpoints\n"
    "spec_config:\n"
    '  a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n'
    "  b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\n"
    "  c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
    "  d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\n"
    "  e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\n"
    "  f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]\n"
    "  g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]\n"
    "  h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]\n"
    "  i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]\n"
)


def refused(result, *says: str) -> None:
    """Exit 2, an ``error:`` line naming the problem and one saying where to look; nothing else."""
    lines = result.stderr.splitlines()
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert 1 <= len(lines) <= 2 and lines[0].startswith("error: "), result.stderr[-3000:]
    for fragment in says:
        assert fragment in lines[0], lines[0]
    assert result.seconds < SECONDS, f"took {result.seconds:.1f}s: {lines[0]}"


class TestConfigFiles:
    def test_a_yaml_billion_laughs_is_refused_before_it_expands(self, ckptflow):
        """Before: it grew to gigabytes and aborted ("memory allocation of 4294967296 bytes failed")."""
        (ckptflow.work / "bomb.yaml").write_text(BOMB)
        result = ckptflow("run", "--config", "bomb.yaml")
        refused(result, "bomb.yaml", "aliases expand to more than", "YAML bomb")
        assert_prefect_never_started(ckptflow, result)
        assert not (ckptflow.work / "checkpoints").exists()

    def test_yaml_aliases_that_stay_small_are_taken(self, ckptflow):
        (ckptflow.work / "ok.yaml").write_text(
            "storage: ./checkpoints\nspec_config: {base: &b {lr: 0.1}, same: *b}\nepochs: 0\n"
        )
        result = ckptflow("run", "--config", "ok.yaml")
        refused(result, "epochs", "greater than or equal to 1")  # the aliases passed; the bound did not

    def test_a_fifo_given_as_the_config_is_refused_at_once(self, ckptflow):
        """Before: ``--config`` on a FIFO blocked forever."""
        fifo = ckptflow.work / "config.json"
        os.mkfifo(fifo)
        opened = threading.Event()

        def writer() -> None:  # a writer that never comes would leave the test's thread blocked
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                opened.set()
                os.close(fd)
            except OSError:
                pass

        result = ckptflow("run", "--config", "config.json")
        refused(result, "config.json", "not a regular file")
        threading.Thread(target=writer, daemon=True).start()

    @pytest.mark.parametrize(
        ("name", "text", "says"),
        [
            ("deep.json", '{"storage": "./c", "spec_config": ' + "[" * 10_000 + "]" * 10_000 + "}", "nested"),
            ("big.json", '{"storage": "./c", "seed": ' + "7" * 5000 + "}", "thousands of digits"),
            ("nan.json", '{"storage": "./c", "spec_config": {"lr": NaN}}', "NaN"),
            ("inf.yaml", "storage: ./c\nsave_every_minutes: 1e999\n", "finite number"),
            ("bool.json", '{"storage": "./c", "epochs": true}', "must be a number, not true"),
            ("huge.toml", 'storage = "./c"\nepochs = 1000000000000000000\n', "less than or equal to"),
            ("deep.toml", "storage = './c'\n" + "a = " + "[" * 3000 + "]" * 3000 + "\n", "--config"),
        ],
        ids=["json-10k-deep", "5000-digits", "nan", "1e999", "true-as-a-number", "10^18-epochs", "toml-deep"],
    )
    def test_a_config_that_cannot_be_one_is_a_usage_error(self, ckptflow, name, text, says):
        (ckptflow.work / name).write_text(text)
        result = ckptflow("run", "--config", name)
        refused(result, says)
        assert_prefect_never_started(ckptflow, result)
        assert not (ckptflow.work / "c").exists()

    def test_a_config_file_too_large_to_be_one(self, ckptflow):
        (ckptflow.work / "large.json").write_text(
            json.dumps({"storage": "./c", "spec_config": {"x": "y" * (2 << 20)}})
        )
        refused(ckptflow("run", "--config", "large.json"), "large.json", "more than the")


class TestOptions:
    @pytest.mark.parametrize(
        ("args", "says"),
        [
            (["--spec-config", "[" * 10_000 + "]" * 10_000], "--spec-config"),
            (["--spec-config", '{"n": ' + "9" * 5000 + "}"], "thousands of digits"),
            (["--spec-config", '{"lr": NaN}'], "NaN"),
            (["--spec-config", '{"lr": 1e999}'], "not a finite number (at lr)"),
            (["--epochs", str(10**30)], "--epochs"),
            (["--stop-grace", "inf"], "--stop-grace"),
            (["--save-every-minutes", "nan"], "--save-every-minutes"),
            (["--storage-options", '{"a": NaN}'], "--storage-options"),
        ],
        ids=[
            "deep",
            "5000-digits",
            "nan",
            "1e999",
            "10^30-epochs",
            "inf-grace",
            "nan-minutes",
            "nan-options",
        ],
    )
    def test_a_value_that_cannot_be_the_configs_is_a_usage_error(self, ckptflow, args, says):
        """Before: tracebacks (deep, 5000 digits), a run that trained and committed version 1 before
        failing (``--epochs 10**30``), one that failed after 23 s with an empty store (``NaN``), one
        that failed in its trainers (``--stop-grace inf``)."""
        result = ckptflow("run", "--storage", "c", *args)
        refused(result, says)
        assert_prefect_never_started(ckptflow, result)
        assert not (ckptflow.work / "c").exists()

    def test_storage_options_from_a_fifo_are_refused_at_once(self, ckptflow):
        os.mkfifo(ckptflow.work / "opts.json")
        refused(ckptflow("ls", "c", "--storage-options", "@opts.json"), "opts.json", "not a regular file")


def test_the_config_s_bounds_are_in_its_schema_for_a_deployment_too(tmp_path: Path) -> None:
    """A deployment's parameters are validated by the same model: the bounds hold there as well."""
    from pydantic import ValidationError

    from ckptflow.tasks.config import PipelineConfig

    for bad in (
        {"epochs": 10**30},
        {"epochs": True},
        {"stop_grace_seconds": float("inf")},
        {"save_every_minutes": float("nan")},
        {"spec_config": {"lr": float("nan")}},
        {"spec_config": {"deep": json.loads("[" * 100 + "]" * 100)}},
        {"retention": {"keep_last": True}},
        {"archive": {"upload_options": {"x": float("inf")}}},
    ):
        with pytest.raises(ValidationError):
            PipelineConfig(storage=str(tmp_path), **bad)
