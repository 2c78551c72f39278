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

import contextlib
import json
import os
import threading
from pathlib import Path
from typing import Any

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


# -- files other tools wrote ------------------------------------------------------------------------


def _safetensors_cases(root: Path) -> dict[str, Path]:
    """Malformed safetensors files, each a way the header can lie about the data."""
    import struct

    import torch
    from safetensors.torch import save_file

    good = root / "good.safetensors"
    save_file({"a": torch.arange(4, dtype=torch.float32), "b": torch.ones(2, 2)}, str(good))
    data = good.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header, body = json.loads(data[8 : 8 + n]), data[8 + n :]

    def with_header(h: Any) -> bytes:
        raw = h if isinstance(h, bytes) else json.dumps(h).encode()
        return struct.pack("<Q", len(raw)) + raw + body

    def changed(name: str, key: str, value: Any) -> bytes:
        h = json.loads(json.dumps(header))
        h[name][key] = value
        return with_header(h)

    cases = {
        "length-2-63": struct.pack("<Q", 1 << 63) + data[8:],
        "length-past-end": struct.pack("<Q", len(data)) + data[8:],
        "not-json": with_header(b"hello"),
        "nested-100k": with_header(b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        "overlapping": changed("b", "data_offsets", [0, 16]),
        "outside": changed("b", "data_offsets", [16, 9999]),
        "unknown-dtype": changed("b", "dtype", "Q99"),
        "shape-mismatch": changed("b", "shape", [3, 3]),
        "truncated": data[:-5],
        "empty": b"",
    }
    paths = {}
    for name, content in cases.items():
        paths[name] = root / f"{name}.safetensors"
        paths[name].write_bytes(content)
    return paths


def _torch_cases(root: Path) -> dict[str, Path]:
    """Malformed torch.save zips: a storage record shorter than the file declares, one missing."""
    import zipfile

    import torch

    good = root / "good.pt"
    torch.save({"w": torch.arange(16, dtype=torch.float32)}, good)

    def rewrite(name: str, change: Any) -> Path:
        out = root / name
        with zipfile.ZipFile(good) as zin, zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED) as zout:
            for info in zin.infolist():
                data = change(info.filename, zin.read(info.filename))
                if data is not None:
                    zout.writestr(info, data)
        return out

    (root / "noise.pt").write_bytes(b"PK\x03\x04 not really a zip")
    return {
        "short-record": rewrite("short.pt", lambda n, d: d[:32] if n.endswith("data/0") else d),
        "missing-record": rewrite("missing.pt", lambda n, d: None if n.endswith("data/0") else d),
        "not-a-zip": root / "noise.pt",
    }


def one_line_error(result, *says: str) -> None:
    lines = result.stderr.splitlines()
    assert result.returncode == 1, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith("error: "), lines[0]
    for fragment in says:
        assert fragment in lines[0], lines[0]


class TestForeignFiles:
    """Before: 53-68-line tracebacks from ``import`` and ``diff`` for each of these; and ``diff`` read
    8 bytes past a torch file's short record that ``import`` refused."""

    def test_malformed_safetensors_and_torch_files_are_one_line_from_import_and_diff(self, ckptflow):
        import torch

        from ckptflow.storage import CheckpointStore

        store = ckptflow.work / "store"
        CheckpointStore(store).save({"a": torch.zeros(4)})
        files = {**_safetensors_cases(ckptflow.work), **_torch_cases(ckptflow.work)}
        for name, path in files.items():
            imported = ckptflow("import", str(path), str(ckptflow.work / f"new-{name}"))
            one_line_error(imported, path.name)
            assert not (ckptflow.work / f"new-{name}").exists(), name  # nothing left behind
            diffed = ckptflow("diff", str(store), "0", str(path))
            one_line_error(diffed, path.name)
            # one reader, one refusal (safetensors names the first bad tensor it meets, in no fixed order)
            said = [r.stderr.split("`")[0].split(":", 2)[2] for r in (imported, diffed)]
            assert said[0] == said[1], name

    @pytest.mark.parametrize(
        ("state", "says"),
        [
            ({"epoch": float("nan"), "global_step": 3}, "epoch is nan"),
            ([1, 2], "holds a JSON list"),
            ({"epoch": -3, "global_step": 7}, "epoch is -3"),
            ({"epoch": 1, "global_step": -7}, "global_step is -7"),
            ({"epoch": 1, "global_step": True}, "global_step is true"),
            ({"epoch": 2**100, "global_step": 1}, "epoch is 1267650600228229401496703205376"),
        ],
        ids=["epoch-nan", "a-list", "negative-epoch", "negative-step", "true-step", "2^100-epoch"],
    )
    def test_a_trainer_state_that_records_no_epoch_or_step_is_refused(self, ckptflow, state, says):
        """Before: tracebacks (NaN, a list), or imports of ``epoch -3, step -7``, ``true`` as a step,
        and a version numbered ``v1267650600228229401496703205376``."""
        pytest.importorskip("transformers")
        checkpoint = _hf_dir(ckptflow.work / "checkpoint-7")
        (checkpoint / "trainer_state.json").write_text(json.dumps(state))
        store = ckptflow.work / "store"
        one_line_error(ckptflow("import", str(checkpoint), str(store)), "trainer_state.json", says)
        assert not store.exists()
        given = ckptflow("import", str(checkpoint), str(store), "--epoch", "1", "--step", "7")
        if isinstance(state, dict):  # told the epoch and step, it needs none of the file's
            assert given.returncode == 0, given.stderr
        else:  # no Trainer's state at all: the directory is no checkpoint a Trainer resumes from
            one_line_error(given, says)

    def test_an_index_that_names_files_outside_or_missing_is_refused(self, ckptflow):
        """Before: both imported with exit 0 and no word; from_pretrained then failed on the copy."""
        pytest.importorskip("transformers")
        store = ckptflow.work / "store"
        for shard, says in (
            ("../../etc/passwd", "outside the directory"),
            ("model-2.safetensors", "does not hold"),
        ):
            checkpoint = _hf_dir(ckptflow.work / f"model-{says.split()[0]}")
            index = {"metadata": {}, "weight_map": {"a": "model.safetensors", "b": shard}}
            (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
            one_line_error(
                ckptflow("import", str(checkpoint), str(store)), "model.safetensors.index.json", says
            )
        assert not store.exists()

    def test_what_an_import_skips_is_said_without_verbose(self, ckptflow):
        """Before: links skipped by an import were reported only with -v."""
        pytest.importorskip("transformers")
        checkpoint = _hf_dir(ckptflow.work / "model")
        (ckptflow.work / "secret.txt").write_text("outside")
        (checkpoint / "notes.txt").symlink_to(ckptflow.work / "secret.txt")
        done = ckptflow("import", str(checkpoint), str(ckptflow.work / "store"))
        assert done.returncode == 0, done.stderr
        assert "note: " in done.stderr and "notes.txt is skipped: a symbolic link to" in done.stderr


def _hf_dir(path: Path) -> Path:
    """A small ``save_pretrained``-like directory: a config and one safetensors file."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "test"}))
    save_file({"a": torch.zeros(2), "b": torch.ones(3)}, str(path / "model.safetensors"))
    return path


class TestWhereOutputGoes:
    def test_restore_and_extract_refuse_an_out_inside_any_store(self, ckptflow):
        """Before: ``restore --out`` inside the source store was accepted: it wrote into a committed
        version's directory, or left what ``ls`` calls uncommitted leftovers."""
        import torch

        from ckptflow.storage import CheckpointStore

        store_dir = ckptflow.work / "store"
        store = CheckpointStore(store_dir)
        for epoch in (1, 2):
            store.save({"w": torch.full((4,), float(epoch))}, epoch=epoch)
        store.archive([1, 2])
        before = sorted(str(p.relative_to(store_dir)) for p in store_dir.rglob("*"))
        for out in ("store/model.pt", "store/v000001/model.pt", "store/archive/x/model.pt"):
            result = ckptflow("restore", str(store_dir), "--out", out)
            one_line_error(result, out, f"inside the checkpoint store {store_dir}")
        tar = next((store_dir / "archive").glob("*.tar"))
        for out in ("store/extracted", "store/v000001/extracted"):
            result = ckptflow("extract", str(tar), "--epoch", "1", "--out", out)
            one_line_error(result, out, f"inside the checkpoint store {store_dir}")
        assert sorted(str(p.relative_to(store_dir)) for p in store_dir.rglob("*")) == before
        assert ckptflow("restore", str(store_dir), "--out", "model.pt").returncode == 0  # beside it: fine

    def test_a_store_named_like_a_checkpoint_file_is_listed(self, ckptflow):
        """Before: a store at ``run.ckpt`` was read as a Lightning pointer: "is not a ckptflow
        checkpoint pointer", and it could not be listed."""
        import torch

        from ckptflow.storage import CheckpointStore

        CheckpointStore(ckptflow.work / "run.ckpt").save({"w": torch.zeros(2)}, epoch=1)
        listed = ckptflow("ls", "run.ckpt", "--json")
        assert listed.returncode == 0, listed.stderr
        assert [v["version"] for v in json.loads(listed.stdout)["versions"]] == [1]


# -- fuzzing: whatever the bytes, one clear refusal or a value -------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.one_of(st.text(max_size=200), JSON_VALUES.map(lambda v: json.dumps(v, allow_nan=True))))
def test_any_json_option_is_a_value_or_one_usage_error(text: str) -> None:
    """``--spec-config`` and friends: any text is either a JSON value within the config's limits or a
    ``typer.BadParameter`` (a usage error, exit 2), never another exception."""
    import typer

    from ckptflow.flows.inputs import parse_json_option
    from ckptflow.tasks.config import value_problem

    try:
        value = parse_json_option(text, option="--spec-config")
    except typer.BadParameter as exc:
        assert "\n" not in exc.format_message()
        return
    assert value_problem(value) is None


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(document=JSON_VALUES, kind=st.sampled_from(["json", "yaml", "toml"]))
def test_any_config_document_is_a_config_or_one_usage_error(
    tmp_path_factory, document: Any, kind: str
) -> None:
    """A config file of any content: the run's config, or one usage error naming the file; nothing
    is started or written (the config is read before anything else)."""
    import typer
    from pydantic import ValidationError

    from ckptflow.flows.run_cmd import read_config_file
    from ckptflow.tasks.config import PipelineConfig

    folder = tmp_path_factory.mktemp("cfg")
    path = folder / f"run.{kind}"
    if kind == "json":
        path.write_text(json.dumps(document, allow_nan=True))
    elif kind == "yaml":
        import yaml

        path.write_text(yaml.safe_dump(document))
    else:
        if not isinstance(document, dict):
            document = {"spec_config": {"v": document}}
        path.write_text(_toml(document))
    try:
        raw = read_config_file(str(path))
    except typer.BadParameter as exc:
        assert str(path) in exc.format_message() and "\n" not in exc.format_message()
        return
    with contextlib.suppress(ValidationError):  # the CLI names the field then (a usage error)
        PipelineConfig.model_validate({"storage": str(folder / "store"), **raw})
    assert not (folder / "store").exists()


def _toml(doc: dict[str, Any]) -> str:
    """A TOML document of ``doc``'s scalars and tables, as far as TOML can say them (else JSON-ish text)."""
    lines = []
    for key, value in doc.items():
        lines.append(f"{json.dumps(str(key))} = {json.dumps(value, allow_nan=True)}")
    return "\n".join(lines) + "\n"


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    header=st.one_of(st.binary(max_size=300), JSON_VALUES.map(lambda v: json.dumps(v).encode())),
    length=st.integers(0, 2**64 - 1) | st.none(),
    body=st.binary(max_size=64),
)
def test_any_safetensors_bytes_read_or_one_refusal_and_nothing_written(
    tmp_path_factory, header: bytes, length: int | None, body: bytes
) -> None:
    """A ``.safetensors`` file of any header: its tensors, or one CheckpointError naming the file;
    an import of it writes nothing, not even the store's directory."""
    import struct

    from ckptflow.storage import CheckpointError, CheckpointStore
    from ckptflow.storage.integrations.imports import read_import
    from ckptflow.storage.load.foreign import read_safetensors

    folder = tmp_path_factory.mktemp("st")
    path = folder / "f.safetensors"
    size = len(header) if length is None else length
    path.write_bytes(struct.pack("<Q", size) + header + body)
    try:
        read_safetensors(path)
    except CheckpointError as exc:
        assert str(path) in str(exc) and "\n" not in str(exc)
        try:
            read_import(path)
        except CheckpointError as again:
            assert str(again) == str(exc)  # import refuses it the same way, before any store
        else:
            raise AssertionError("import read what read_safetensors refused")
        assert not (folder / "store").exists()
        return
    store = CheckpointStore(folder / "store")
    info = store.save(read_import(path).state)
    assert store.verify(info.version).version == info.version
