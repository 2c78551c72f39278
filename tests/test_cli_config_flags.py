"""Every PipelineConfig field has a ``ckptflow run`` flag, and the config alone holds defaults and bounds.

Issue 36: ``run`` built its config from its parameters' names (``locals()``),
so renaming a field silently dropped its flag; five fields had none
(``save_retries``, ``save_timeout_seconds``, ``lease_timeout_seconds``,
``rank_timeout_seconds``, ``archive.max_pending``), and the storage library's
``best_count`` was in neither (now ``retention.best_count``, ``--best-count``);
``--shards`` was bounded by the CLI (>= 1) and again, differently, by the
config (1-256). Each option now names its field; these tests parse real
arguments with the real command and build the config the way the command does
(:func:`ckptflow.flows.run_cmd.config_of`), without starting a run.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from typing import Any

import annotated_types
import pytest
import typer
from pydantic import BaseModel
from typer.main import get_command
from typer.testing import CliRunner

from ckptflow.flows.cli import app
from ckptflow.flows.run_cmd import ConfigField, config_flags, config_of
from ckptflow.tasks.config import DEMO_SPEC, PipelineConfig

RUN = get_command(app).commands["run"]  # type: ignore[attr-defined]
STORE = ["--storage", "somewhere"]

# flag -> (the words that give it a value other than the default, the field it sets, that value);
# some words add what the config requires beside it (--keep-best needs --best-mode)
SAMPLES: dict[str, tuple[list[str], str, Any]] = {
    "--storage": (["--storage", "s3://bucket/run"], "storage", "s3://bucket/run"),
    "--storage-options": (["--storage-options", '{"anon": true}'], "storage_options", {"anon": True}),
    "--storage-secret": (["--storage-secret", "aws-credentials/x"], "storage_secret", "aws-credentials/x"),
    "--spec": (["--spec", "pkg.mod:Spec"], "spec", "pkg.mod:Spec"),
    "--spec-config": (["--spec-config", '{"lr": 0.1}'], "spec_config", {"lr": 0.1}),
    "--seed": (["--seed", "11"], "seed", 11),
    "--epochs": (["--epochs", "9"], "epochs", 9),
    "--save-every": (["--save-every", "3"], "save_every", 3),
    "--save-every-steps": (["--save-every-steps", "50"], "save_every_steps", 50),
    "--save-every-minutes": (["--save-every-minutes", "7.5"], "save_every_minutes", 7.5),
    "--stop-grace": (["--stop-grace", "10"], "stop_grace_seconds", 10.0),
    "--shards": (["--shards", "7"], "shards", 7),
    "--async-save": (["--no-async-save"], "async_save", False),
    "--dedup": (["--no-dedup"], "dedup", False),
    "--epoch-retries": (["--epoch-retries", "4"], "epoch_retries", 4),
    "--save-retries": (["--save-retries", "5"], "save_retries", 5),
    "--save-timeout": (["--save-timeout", "12.5"], "save_timeout_seconds", 12.5),
    "--in-process": (["--in-process"], "train_process", False),
    "--torch-threads": (["--torch-threads", "2"], "torch_threads", 2),
    "--keep-last": (["--keep-last", "3"], "retention.keep_last", 3),
    "--keep-every": (["--keep-every", "10"], "retention.keep_every", 10),
    "--keep-best": (["--keep-best", "val_acc", "--best-mode", "max"], "retention.keep_best", "val_acc"),
    "--best-mode": (["--keep-best", "loss", "--best-mode", "min"], "retention.best_mode", "min"),
    "--best-count": (
        ["--keep-best", "loss", "--best-mode", "min", "--best-count", "3"],
        "retention.best_count",
        3,
    ),
    "--stop-metric": (["--stop-metric", "val_loss"], "stop.metric", "val_loss"),
    "--stop-mode": (["--stop-mode", "max"], "stop.mode", "max"),
    "--target": (["--stop-metric", "acc", "--target", "0.95"], "stop.target", 0.95),
    "--patience": (["--stop-metric", "acc", "--patience", "2"], "stop.patience", 2),
    "--max-seconds": (["--max-seconds", "90"], "stop.max_seconds", 90.0),
    "--archive-every": (["--archive-every", "5"], "archive.every", 5),
    "--archive-size": (["--archive-size", "3MiB"], "archive.target_bytes", 3 << 20),
    "--keep-loose": (["--keep-loose"], "archive.keep_loose", True),
    "--upload-to": (["--upload-to", "s3://b/mirror"], "archive.upload_to", "s3://b/mirror"),
    "--upload-options": (["--upload-options", '{"anon": true}'], "archive.upload_options", {"anon": True}),
    "--upload-secret": (["--upload-secret", "mirror-creds"], "archive.upload_secret", "mirror-creds"),
    "--upload-versions": (["--no-upload-versions"], "archive.upload_versions", False),
    "--max-pending": (["--max-pending", "6"], "archive.max_pending", 6),
    "--upload-every": (["--upload-to", "s3://b/m", "--upload-every", "10m"], "archive.upload_every", "10m"),
    "--durable-keep-last": (
        ["--upload-to", "s3://b/m", "--durable-keep-last", "3"],
        "archive.durable_keep_last",
        3,
    ),
    "--upload-retry": (["--upload-retry", "5"], "archive.upload_retry_seconds", 5.0),
    "--stop-drain": (["--stop-drain", "7"], "archive.stop_drain_seconds", 7.0),
    "--keep-undurable": (["--no-keep-undurable"], "retention.keep_undurable", False),
    "--allow-config-change": (["--allow-config-change"], "allow_config_change", True),
    "--resume-only": (["--resume-only"], "resume_only", True),
    "--nproc": (["--nproc", "3"], "nproc", 3),
    "--nnodes": (["--nnodes", "2", "--rdzv-endpoint", "10.0.0.1:29400"], "nnodes", 2),
    "--rdzv-endpoint": (["--rdzv-endpoint", "10.0.0.1:29400"], "rdzv_endpoint", "10.0.0.1:29400"),
    "--rdzv-id": (["--rdzv-id", "run7"], "rdzv_id", "run7"),
    "--dist-backend": (["--dist-backend", "gloo"], "dist_backend", "gloo"),
    "--rank-timeout": (["--rank-timeout", "45"], "rank_timeout_seconds", 45.0),
    "--lease-timeout": (["--lease-timeout", "30"], "lease_timeout_seconds", 30.0),
}
OWN_FLAGS = {"--verbose", "--config"}  # flags of this process, not fields of the config


def leaf_fields(model: type[BaseModel], prefix: str = "") -> list[str]:
    """The config's fields a user sets, sections included: ``retention.keep_last``, not ``retention``."""
    paths = []
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            paths += leaf_fields(kind, f"{prefix}{name}.")
        else:
            paths.append(prefix + name)
    return paths


def at(config: BaseModel, path: str) -> Any:
    return functools.reduce(getattr, path.split("."), config)


def parsed(*args: str) -> typer.Context:
    return RUN.make_context("run", list(args))


def flag_fields() -> dict[str, str]:
    """Flag -> the field it sets, as the command says."""
    return {flag: field.path for flag, field in config_flags(parsed(*STORE)).values()}


class TestEveryFieldHasAFlag:
    def test_each_field_has_one_flag_and_each_flag_one_field(self):
        fields = flag_fields()
        assert sorted(fields.values()) == sorted(leaf_fields(PipelineConfig))  # no field twice, none left
        assert fields == {flag: path for flag, (_, path, _) in SAMPLES.items()}

    def test_every_option_of_run_is_a_config_flag_or_its_own(self):
        options = {max(p.opts, key=len) for p in RUN.params}
        assert options == set(SAMPLES) | OWN_FLAGS
        assert not OWN_FLAGS & set(flag_fields())

    @pytest.mark.parametrize("flag", sorted(SAMPLES))
    def test_the_flag_reaches_its_field(self, flag):
        words, path, value = SAMPLES[flag]
        plain = config_of(parsed(*STORE))
        given = config_of(parsed(*STORE, *words))
        assert at(given, path) == value
        assert at(plain, path) != value  # the test can fail: without the flag, the field differs
        changed = {p for p in leaf_fields(PipelineConfig) if at(given, p) != at(plain, p)}
        assert path in changed
        assert changed <= {SAMPLES[f][1] for f in SAMPLES if f in words or f == flag}


class TestDefaultsComeFromTheConfig:
    def test_no_flag_gives_the_configs_defaults(self):
        assert config_of(parsed(*STORE)) == PipelineConfig(storage="somewhere")
        assert config_of(parsed()).storage == "./checkpoints"  # the one default of the CLI's own

    def test_help_shows_the_configs_default(self):
        ctx = parsed(*STORE)
        defaults = PipelineConfig.model_construct(storage="")
        shown = {}
        for param in RUN.params:
            field = param.default
            if not isinstance(field, ConfigField) or field.path == "storage":
                continue
            value = at(defaults, field.path)
            if value is None or isinstance(value, bool):  # a flag's default is its name (--async-save)
                continue
            help_text = param.get_help_record(ctx)[1]
            shown[field.path] = re.search(r"default: ([^\]]*)\]", help_text).group(1)  # type: ignore[union-attr]
        assert shown["shards"] == str(PipelineConfig.model_fields["shards"].default)
        assert shown["spec"] == DEMO_SPEC
        assert shown["spec_config"] == "{}"
        assert shown["rank_timeout_seconds"] == str(
            PipelineConfig.model_fields["rank_timeout_seconds"].default
        )
        assert shown["archive.max_pending"] == "2"
        for path, text in shown.items():
            value = at(defaults, path)
            assert text == (str(value) if not isinstance(value, dict) else "{}"), path

    def test_async_save_shows_its_default_by_name(self):
        help_text = next(p for p in RUN.params if p.name == "async_save").get_help_record(parsed(*STORE))[1]
        assert help_text.endswith("[default: async-save]")


def bounds(path: str) -> list[tuple[str, Any, Any]]:
    """The field's numeric bounds as the config declares them: (kind, the bound, a value beyond it)."""
    model: type[BaseModel] = PipelineConfig
    *sections, name = path.split(".")
    for section in sections:
        model = model.model_fields[section].annotation  # type: ignore[assignment]
    found = []
    for rule in model.model_fields[name].metadata:
        if isinstance(rule, annotated_types.Ge):
            found.append(("greater than or equal to", rule.ge, rule.ge - 1))
        elif isinstance(rule, annotated_types.Gt):
            found.append(("greater than", rule.gt, rule.gt))
        elif isinstance(rule, annotated_types.Le):
            found.append(("less than or equal to", rule.le, rule.le + 1))
        elif isinstance(rule, annotated_types.Lt):
            found.append(("less than", rule.lt, rule.lt))
    return found


BOUNDED = [
    (flag, kind, bound, beyond)
    for flag, path in sorted(flag_fields().items())
    for kind, bound, beyond in bounds(path)
]


class TestBoundsComeFromTheConfig:
    def test_the_bounded_fields_are_found(self):
        flags = {flag for flag, *_ in BOUNDED}
        assert {"--shards", "--epochs", "--nproc", "--save-retries", "--max-pending", "--best-count"} <= flags
        assert ("--shards", "less than or equal to", 256, 257) in BOUNDED  # the config says 1-256

    @pytest.mark.parametrize(("flag", "kind", "bound", "beyond"), BOUNDED)
    def test_a_value_beyond_the_configs_bound_names_the_flag(self, flag, kind, bound, beyond):
        with pytest.raises(typer.BadParameter) as err:
            config_of(parsed(*STORE, flag, str(beyond)))
        message = err.value.format_message()
        assert message.startswith(f"Invalid value for '{flag}': Input should be {kind} {bound}"), message

    @pytest.mark.parametrize(("flag", "kind", "bound", "beyond"), BOUNDED)
    def test_the_cli_takes_any_value_the_config_takes(self, flag, kind, bound, beyond):
        """The parser holds no bound of its own: the bound itself (when inside) gets through it."""
        if kind in ("greater than", "less than"):
            bound = bound + 1 if kind == "greater than" else bound - 1
        params = parsed(*STORE, flag, str(bound)).params
        name = next(p.name for p in RUN.params if flag in p.opts)
        assert (int(params[name]) if isinstance(bound, int) else float(params[name])) == bound  # exact

    def test_shards_out_of_bounds_is_a_usage_error_before_anything_starts(self, tmp_path):
        store = tmp_path / "s"
        for value, says in (("0", "greater than or equal to 1"), ("257", "less than or equal to 256")):
            result = CliRunner().invoke(app, ["run", "--storage", str(store), "--shards", value, "--verbose"])
            assert result.exit_code == 2, result.output
            assert f"Invalid value for '--shards': Input should be {says}" in result.output
        assert not store.exists()


def test_shards_help_says_it_caps_the_files_of_a_version():
    """The meaning of --shards: files per version at most (a small state is one file)."""
    shards = next(p for p in RUN.params if p.name == "shards")
    assert shards.help == "HDF5 shard files per version at most: one per 64 MiB of state."


def test_other_commands_do_not_import_the_config():
    """The defaults are read when `run` parses or shows help: `ls --help` stays light."""
    code = (
        "import sys\n"
        "sys.argv = ['ckptflow', 'ls', '--help']\n"
        "from ckptflow.flows.cli import main\n"
        "try:\n    main()\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
        "print('CONFIG', 'ckptflow.tasks.config' in sys.modules, file=sys.stderr)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "CONFIG False" in proc.stderr


class TestConfigFile:
    """``run --config FILE``: the config's fields from JSON, TOML or YAML; the command line wins."""

    TEXTS = {
        "json": '{"storage": "s3://b/run", "epochs": 7, "retention": {"keep_last": 4}, "shards": 3}',
        "toml": 'storage = "s3://b/run"\nepochs = 7\nshards = 3\n[retention]\nkeep_last = 4\n',
        "yaml": "storage: s3://b/run\nepochs: 7\nshards: 3\nretention:\n  keep_last: 4\n",
    }

    @pytest.mark.parametrize("kind", sorted(TEXTS))
    def test_the_file_sets_fields_and_flags_win(self, tmp_path, kind):
        path = tmp_path / f"run.{kind}"
        path.write_text(self.TEXTS[kind])
        config = config_of(parsed("--config", str(path)))
        assert (config.storage, config.epochs, config.shards, config.retention.keep_last) == (
            "s3://b/run",
            7,
            3,
            4,
        )
        assert (
            config.retention.keep_every == PipelineConfig(storage="x").retention.keep_every
        )  # not in the file
        flagged = config_of(parsed("--config", str(path), "--epochs", "9", "--keep-last", "2"))
        assert (flagged.epochs, flagged.retention.keep_last, flagged.shards) == (9, 2, 3)

    def test_a_misspelt_field_or_a_bad_file_is_a_usage_error_naming_it(self, tmp_path):
        typo = tmp_path / "typo.yaml"
        typo.write_text("storage: here\nretention:\n  keep_lats: 3\n")
        with pytest.raises(typer.BadParameter, match="keep_lats"):
            config_of(parsed("--config", str(typo)))
        shaped = tmp_path / "shaped.yaml"
        shaped.write_text("storage: here\nretention: 3\n")
        with pytest.raises(typer.BadParameter, match="retention"):
            config_of(parsed("--config", str(shaped)))
        broken = tmp_path / "broken.toml"
        broken.write_text("epochs = [\n")
        with pytest.raises(typer.BadParameter, match=r"broken\.toml is not valid TOML"):
            config_of(parsed("--config", str(broken)))
        with pytest.raises(typer.BadParameter, match=r"give a \.json, \.toml, \.yaml or \.yml file"):
            (tmp_path / "run.ini").write_text("[run]\n")
            config_of(parsed("--config", str(tmp_path / "run.ini")))
        bounded = tmp_path / "bounded.json"
        bounded.write_text('{"storage": "here", "shards": 0}')
        with pytest.raises(typer.BadParameter, match="greater than or equal to 1") as err:
            config_of(parsed("--config", str(bounded)))
        assert err.value.param_hint == f"'--shards (or {bounded})'"
