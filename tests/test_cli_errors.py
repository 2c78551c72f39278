"""Errors a user sees: a bad spec or store fails in seconds with one line, before Prefect starts.

``ckptflow run`` with a bad ``--spec``, an unknown URL scheme, a missing
bucket, missing credentials or an unreachable endpoint, and the store commands
(ls, show, verify, restore, prune, gc) on such URLs or on a path where nothing
is stored: exit 1, exactly one stderr line ``error: ...`` naming the problem,
no traceback, within seconds. For ``run`` also: this process never imported
Prefect and no temporary API server started (it would create PREFECT_HOME),
so no flow run can exist. The commands run as the console script does: a
script outside the working directory (so ``sys.path[0]`` is not the cwd),
started in a directory of the test's own.
"""

from __future__ import annotations

import json
import os
import sqlite3
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.clirun import SECONDS, assert_prefect_never_started
from tests.conftest import AWS_ENV
from tests.ports import free_port


def endpoint_options(endpoint: str) -> str:
    return json.dumps({"client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}})


NO_CREDENTIALS = tuple(AWS_ENV)


def bad_store(kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    """A store URL that cannot be used: its args, environment, and what the error must say."""
    if kind == "unknown-scheme":
        return {"args": ["gopher://host/run1"], "says": ["no filesystem handles gopher://"]}
    if kind == "unreachable-endpoint":
        endpoint = f"http://127.0.0.1:{free_port()}"
        return {
            "args": ["s3://bucket/run1", "--storage-options", endpoint_options(endpoint)],
            "says": ["cannot reach the object store at " + endpoint, "s3://bucket/run1", "endpoint_url"],
        }
    server = request.getfixturevalue("s3_server")
    if kind == "missing-bucket":
        bucket = f"missing-{uuid.uuid4().hex[:12]}"
        return {
            "args": [f"s3://{bucket}/run1", "--storage-options", endpoint_options(server)],
            "says": [f"the bucket of s3://{bucket}/run1 does not exist", "create it"],
        }
    assert kind == "missing-credentials"
    bucket, _ = request.getfixturevalue("s3_bucket")
    nowhere = str(tmp_path / "no-aws-config")
    return {
        "args": [f"s3://{bucket}/run1", "--storage-options", endpoint_options(server)],
        "says": [f"no credentials found for s3://{bucket}/run1", "AWS_ACCESS_KEY_ID"],
        "env": {"AWS_SHARED_CREDENTIALS_FILE": nowhere, "AWS_CONFIG_FILE": nowhere},
        "drop": NO_CREDENTIALS,
    }


STORES = [
    "unknown-scheme",
    "unreachable-endpoint",
    pytest.param("missing-bucket", marks=pytest.mark.s3),
    pytest.param("missing-credentials", marks=pytest.mark.s3),
]


class TestRunFailsBeforePrefect:
    @pytest.mark.parametrize("kind", STORES)
    def test_a_store_that_cannot_be_used(self, ckptflow, request, tmp_path, kind):
        store = bad_store(kind, request, tmp_path)
        url, *options = store["args"]
        args = ["run", "--storage", url, *options, "--epochs", "1"]
        result = ckptflow(*args, env=store.get("env"), drop=store.get("drop", ()))
        result.assert_one_error_line(*store["says"])
        assert_prefect_never_started(ckptflow, result)

    @pytest.mark.parametrize(
        ("spec", "says"),
        [
            ("ckptflow.flows.demo:DigitSpec", ["has no attribute 'DigitSpec'", "its classes: DigitsSpec"]),
            ("mymodel:Spec", ["no module named 'mymodel'", "check the spelling"]),
            ("ckptflow.nopackage.model:Spec", ["no module named 'ckptflow.nopackage'"]),
        ],
        ids=["class-typo", "module-typo", "package-typo"],
    )
    def test_a_bad_spec(self, ckptflow, spec, says):
        storage = ckptflow.work / "checkpoints"
        result = ckptflow("run", "--storage", str(storage), "--spec", spec, "--epochs", "1")
        result.assert_one_error_line(f"spec {spec!r}", *says)
        assert_prefect_never_started(ckptflow, result)
        assert not storage.exists()  # nothing written: the corrected command starts afresh

    def test_a_store_another_run_holds(self, ckptflow):
        """A second run on a store in use used to start Prefect, then fail with a traceback."""
        from ckptflow.storage import CheckpointStore

        storage = ckptflow.work / "checkpoints"
        with CheckpointStore(storage).lease(owner="the other run"):
            result = ckptflow("run", "--storage", str(storage), "--epochs", "1")
        result.assert_one_error_line(
            "is in use by another writer: the other run", f"pid {os.getpid()}", code=75
        )  # issue 53: its own code (EX_TEMPFAIL), not a failure's 1
        assert_prefect_never_started(ckptflow, result)
        assert not (storage / "run.json").exists()

    def test_an_upload_target_that_mirrors_another_store(self, ckptflow):
        """Issue 52: a reused mirror URL (an earlier store's) was written into, and its versions mixed
        with the new store's; now the run is refused before anything is written, naming both. (Issue
        56: an empty --storage resumes from its --upload-to, the durable tier, when that holds this
        run; the earlier store is no run's: refused.)"""
        from ckptflow.storage import CheckpointStore

        earlier, mirror = ckptflow.work / "earlier", ckptflow.work / "mirror"
        old = CheckpointStore(earlier)
        old.save({"w": [1.0]})
        old.mirror_version(0, str(mirror), storage_options={})
        storage = ckptflow.work / "checkpoints"
        result = ckptflow("run", "--storage", str(storage), "--upload-to", str(mirror), "--epochs", "1")
        result.assert_one_error_line(
            f"not resuming {storage} from {mirror}", "no ckptflow run wrote", "a URL of its own"
        )
        assert_prefect_never_started(ckptflow, result)
        assert not storage.exists()

    def test_a_spec_in_the_working_directory_is_found(self, ckptflow):
        """The training process imports from the working directory; so does the check."""
        (ckptflow.work / "mymodel.py").write_text("class Other:\n    pass\n")
        result = ckptflow("run", "--storage", "ckpt", "--spec", "mymodel:MySpec")
        result.assert_one_error_line("module 'mymodel'", "has no attribute 'MySpec'", "its classes: Other")
        assert_prefect_never_started(ckptflow, result)

    def test_a_spec_module_that_fails_to_import_creates_no_flow_run(self, ckptflow):
        """Only importing it can tell: the training process's verdict comes before the flow run."""
        (ckptflow.work / "broken.py").write_text(
            "raise RuntimeError('this module fails at import')\n\nclass MySpec:\n    pass\n"
        )
        storage = ckptflow.work / "checkpoints"
        result = ckptflow("run", "--storage", str(storage), "--spec", "broken:MySpec", "--epochs", "1")
        # the training process imports torch first: allow it the time, on a loaded machine too
        result.assert_one_error_line(
            "spec 'broken:MySpec'", "RuntimeError: this module fails at import", seconds=2 * SECONDS
        )
        assert not storage.exists()
        database = ckptflow.prefect_home / "prefect.db"
        if database.exists():  # the temporary API server may have started meanwhile: no flow run in it
            with sqlite3.connect(database, timeout=30) as db:
                tables = {row[0] for row in db.execute("select name from sqlite_master where type='table'")}
                if "flow_run" in tables:  # else it was stopped before it made its tables
                    assert db.execute("select count(*) from flow_run").fetchone() == (0,)

    def test_verbose_shows_the_traceback(self, ckptflow):
        result = ckptflow("run", "--spec", "mymodel:Spec", "--verbose")
        assert result.returncode == 1
        assert "Traceback" in result.stderr
        assert result.stderr.splitlines()[-1].startswith("error: cannot import the module of spec")


COMMANDS = {
    "ls": ["ls", "{url}"],
    "show": ["show", "{url}"],
    "verify": ["verify", "{url}", "--all"],
    "restore": ["restore", "{url}", "--out", "model.pt"],
    "prune": ["prune", "{url}", "--keep-last", "1"],
    "gc": ["gc", "{url}"],
}


class TestStoreCommands:
    @pytest.mark.parametrize("command", list(COMMANDS))
    @pytest.mark.parametrize("kind", STORES)
    def test_a_store_that_cannot_be_used(self, ckptflow, request, tmp_path, kind, command):
        store = bad_store(kind, request, tmp_path)
        url, *options = store["args"]
        args = [url if a == "{url}" else a for a in COMMANDS[command]]
        result = ckptflow(*args, *options, env=store.get("env"), drop=store.get("drop", ()))
        result.assert_one_error_line(*store["says"])
        assert "prefect" not in result.modules

    @pytest.mark.parametrize("command", list(COMMANDS))
    def test_nothing_stored_at_the_url(self, ckptflow, command):
        """A mistyped path is not an empty store: nothing there is an error, and nothing is created."""
        missing = ckptflow.work / "no-such-store"
        args = [str(missing) if a == "{url}" else a for a in COMMANDS[command]]
        result = ckptflow(*args)
        result.assert_one_error_line(f"no store at {missing}")
        assert not missing.exists()
        assert not (ckptflow.work / "model.pt").exists()

    @pytest.mark.parametrize("command", list(COMMANDS))
    def test_a_version_directory_names_its_store(self, ckptflow, command):
        """Bug fix (issue 34): a command given a version directory (``ckptflow ls STORE/v000003``) said
        "no committed versions" with exit 0 (or "no committed checkpoint"), not where the store is."""
        store = _small_store(ckptflow.work / "store", versions=(1, 2, 3))
        before = _files(store)
        vdir = store / "v000003"
        args = [str(vdir) if a == "{url}" else a for a in COMMANDS[command]]
        result = ckptflow(*args)
        version = " --version 3" if command in ("show", "verify", "restore") else ""
        result.assert_one_error_line(
            f"{vdir} is the directory of version 3 of the store {store}, not a store",
            f"`ckptflow {command} {store}{version}",
        )
        assert _files(store) == before
        assert not (ckptflow.work / "model.pt").exists()

    @pytest.mark.parametrize("command", list(COMMANDS))
    def test_a_directory_of_stores_names_them(self, ckptflow, command):
        """Bug fix (issue 34): a command given the directory that holds stores said "no committed
        versions" with exit 0 instead of naming the stores in it."""
        parent = ckptflow.work / "checkpoints"
        _small_store(parent / "run-a", versions=(1,))
        _small_store(parent / "run-b", versions=(1, 2))
        (parent / "notes").mkdir()
        (parent / "notes" / "todo.txt").write_text("not a store")
        (parent / "README").write_text("not a store either")
        before = _files(parent)
        args = [str(parent) if a == "{url}" else a for a in COMMANDS[command]]
        result = ckptflow(*args)
        result.assert_one_error_line(
            f"no store at {parent}; it holds the stores {parent}/run-a, {parent}/run-b",
            f"`ckptflow {command} {parent}/run-a",
        )
        assert _files(parent) == before

    def test_an_empty_store_is_still_listed_as_empty(self, ckptflow):
        empty = ckptflow.work / "empty"
        empty.mkdir()
        result = ckptflow("ls", str(empty))
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == f"no committed versions in {empty}"


def _small_store(path: Path, *, versions: tuple[int, ...]) -> Path:
    import torch

    from ckptflow.storage import CheckpointStore

    store = CheckpointStore(str(path))
    for version in versions:
        store.save({"w": torch.full((2,), float(version))}, epoch=version, version=version)
    return path


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
