"""Fixtures shared by the whole suite: a real S3 protocol server and one store per backend.

``s3_server`` runs a real S3 server, SeaweedFS (tests/seaweed.py), on free
ports of 127.0.0.1 for the whole session; ``s3_bucket`` makes a fresh bucket
per test. ``moto_server``/``moto_bucket`` are moto's, for the few tests whose
point is a mock (AWS behaviour SeaweedFS does not have; each says so).
``store_url`` runs a test once per backend: a plain local path, a ``file://``
URL, ``memory://`` and S3 (SeaweedFS). Every backend also offers a *raw*
filesystem, separate from any store's, to tamper with files the way another
process (or a failing disk) would.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import fsspec
import pytest
import torch

from tests.ports import free_port

# tests/cuda runs on a machine with a CUDA GPU (`pytest tests/cuda`, README "GPUs"); CI has none,
# and there the package is not collected.
collect_ignore = [] if torch.cuda.is_available() else ["cuda"]

# One Prefect API call may wait on a busy server far longer than Prefect's default 60 s on a
# loaded 2-core CI machine. A timed-out call is retried, and a retried final-state proposal is
# rejected (the run is already Completed): the flow's return value is then lost (MissingResult)
# although the run succeeded. Set before prefect is imported; servers and children inherit it.
os.environ.setdefault("PREFECT_API_REQUEST_TIMEOUT", "600")

# Fake credentials: the tests must never reach a real AWS account.
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SECURITY_TOKEN": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
# The secret handed to s3fs by the tests: distinctive, so a test can prove it never leaks.
S3_KEY = "ckptflow-test-key"
S3_SECRET = "ckptflow-test-secret-7f3a9c1e"

os.environ.update(AWS_ENV)
for _name in ("AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
    os.environ.pop(_name, None)


def _wait_until_up(url: str, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"moto server exited early with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:
            return  # it answered, even if with an error status
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"moto server did not answer at {url} within {timeout:.0f}s")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real S3 server for the session: SeaweedFS on free 127.0.0.1 ports; yields its endpoint URL."""
    from tests.seaweed import start_seaweed

    server = start_seaweed(tmp_path_factory.mktemp("seaweedfs"))
    try:
        yield server.endpoint
    finally:
        server.stop()


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    """moto's S3 server in a subprocess on a free local port, for the tests whose point is a mock
    (AWS-only behaviour a real server here does not have); yields its endpoint URL."""
    port = free_port()
    env = {**os.environ, **AWS_ENV}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_until_up(url, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def s3_storage_options(endpoint: str) -> dict[str, Any]:
    """s3fs options for a test S3 server (a fresh filesystem instance per store)."""
    return {
        "key": S3_KEY,
        "secret": S3_SECRET,
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
        "skip_instance_cache": True,
    }


@pytest.fixture
def s3_bucket(s3_server: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """A fresh, empty bucket on the real S3 server; yields (bucket name, storage_options for s3fs)."""
    yield from _bucket(s3_server)


@pytest.fixture
def moto_bucket(moto_server: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """A fresh, empty bucket on moto, for tests whose point is a mock; as ``s3_bucket``."""
    yield from _bucket(moto_server)


def _bucket(endpoint: str) -> Iterator[tuple[str, dict[str, Any]]]:
    import boto3

    bucket = f"ckpt-{uuid.uuid4().hex[:16]}"
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=S3_KEY,
        aws_secret_access_key=S3_SECRET,
        region_name="us-east-1",
    )
    client.create_bucket(Bucket=bucket)
    yield bucket, s3_storage_options(endpoint)
    # drop the bucket's objects so the server stays small (moto keeps everything in memory)
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=bucket):
        objects = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if objects:
            client.delete_objects(Bucket=bucket, Delete={"Objects": objects})
    client.delete_bucket(Bucket=bucket)


@dataclass(frozen=True)
class StoreTarget:
    """A store location for one backend, plus raw access to its files.

    ``url, storage_options = target`` unpacks it. ``open()`` makes a
    :class:`CheckpointStore`; ``raw_*`` helpers read and change files under
    the root through a filesystem instance of their own (so a store's caches
    are not told), with paths relative to the root such as ``"v000001/manifest.json"``.
    """

    backend: str  # "local", "file", "memory" or "s3"
    url: str
    storage_options: dict[str, Any] | None

    def __iter__(self):
        return iter((self.url, self.storage_options))

    def open(self, **options: Any):
        from ckptflow.storage import CheckpointStore, StoreOptions

        return CheckpointStore(
            self.url, storage_options=self.storage_options, options=StoreOptions(**options)
        )

    @property
    def is_s3(self) -> bool:
        return self.backend == "s3"

    def raw_fs(self) -> tuple[fsspec.AbstractFileSystem, str]:
        opts = dict(self.storage_options or {})
        opts["skip_instance_cache"] = True
        fs, root = fsspec.core.url_to_fs(self.url, **opts)
        return fs, root.rstrip("/")

    def raw_path(self, rel: str) -> str:
        return f"{self.raw_fs()[1]}/{rel}" if rel else self.raw_fs()[1]

    def raw_read(self, rel: str) -> bytes:
        fs, root = self.raw_fs()
        return fs.cat_file(f"{root}/{rel}")

    def raw_write(self, rel: str, data: bytes) -> None:
        fs, root = self.raw_fs()
        if self.backend in ("local", "file"):
            fs.makedirs(f"{root}/{rel}".rsplit("/", 1)[0], exist_ok=True)
        fs.pipe_file(f"{root}/{rel}", data)

    def raw_remove(self, rel: str) -> None:
        fs, root = self.raw_fs()
        fs.rm(f"{root}/{rel}", recursive=True)

    def raw_exists(self, rel: str) -> bool:
        fs, root = self.raw_fs()
        return fs.exists(f"{root}/{rel}")

    def raw_listdir(self, rel: str = "") -> list[str]:
        """Names directly under ``rel`` (files and directories); [] when it does not exist."""
        fs, root = self.raw_fs()
        path = f"{root}/{rel}".rstrip("/")
        if not fs.exists(path):
            return []
        return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False))

    def raw_version_dirs(self) -> list[str]:
        return [n for n in self.raw_listdir() if n.startswith("v") and n[1:].isdigit()]


BACKENDS = ["local", "file", "memory", pytest.param("s3", marks=pytest.mark.s3)]


@pytest.fixture
def silent_endpoint() -> Iterator[str]:
    """A TCP server on 127.0.0.1 that accepts connections and never sends a byte."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    server.settimeout(0.2)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            held.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        for conn in held:
            conn.close()
        server.close()


@pytest.fixture(params=BACKENDS)
def store_url(request: pytest.FixtureRequest, tmp_path) -> Iterator[StoreTarget]:
    """One store location per backend; tests that use it run on all four."""
    backend = request.param
    if backend == "local":
        yield StoreTarget(backend, str(tmp_path / "store"), None)
    elif backend == "file":
        yield StoreTarget(backend, (tmp_path / "store").as_uri(), None)
    elif backend == "memory":
        name = f"ckpt-{uuid.uuid4().hex}"
        yield StoreTarget(backend, f"memory://{name}/store", None)
        fs = fsspec.filesystem("memory")
        if fs.exists(f"/{name}"):
            fs.rm(f"/{name}", recursive=True)
    else:
        bucket, options = request.getfixturevalue("s3_bucket")
        yield StoreTarget(backend, f"s3://{bucket}/run1", options)


# -- shard file names --------------------------------------------------------------------------


def plain_name(name: str) -> str:
    """A shard file's name (or path) without the identity token every save writes into it:
    ``v000002/shard-r0-00-3f9a1c2b7d4e6f80.h5`` -> ``v000002/shard-r0-00.h5``."""
    return re.sub(r"-[0-9a-f]{16}\.h5$", ".h5", name)


def named(names, plain: str) -> str:
    """The one of ``names`` whose :func:`plain_name` is ``plain``."""
    found = [n for n in names if plain_name(str(n)) == plain]
    assert len(found) == 1, (plain, sorted(map(str, names)))
    return found[0]


# -- comparing states --------------------------------------------------------------------------


def tensor_bits(t) -> bytes:
    """The raw bytes of a tensor's elements, in row-major order (bit-exact, NaN payloads included)."""
    import torch

    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_same_state(got: object, want: object, path: str = "") -> None:
    """``got`` equals ``want`` bit for bit, with the same types, dict key order and key types."""
    import math
    import struct
    from collections import OrderedDict

    import numpy as np
    import torch

    where = path or "<root>"
    # A Parameter comes back as a plain tensor and an OrderedDict (state_dict()) as a dict.
    allowed = {torch.nn.Parameter: (torch.Tensor, torch.nn.Parameter), OrderedDict: (dict, OrderedDict)}
    assert type(got) in allowed.get(type(want), (type(want),)), (
        f"{where}: type {type(got).__name__}, expected {type(want).__name__}"
    )
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype, f"{where}: dtype {got.dtype}, expected {want.dtype}"
        assert got.shape == want.shape, f"{where}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        assert tensor_bits(got) == tensor_bits(want), f"{where}: tensor bytes differ"
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype, f"{where}: dtype {got.dtype}, expected {want.dtype}"
        assert got.shape == want.shape, f"{where}: shape {got.shape}, expected {want.shape}"
        assert got.tobytes() == want.tobytes(), f"{where}: array bytes differ"
    elif isinstance(want, dict):
        assert list(got) == list(want), f"{where}: keys {list(got)!r}, expected {list(want)!r}"
        for gk, k in zip(got, want, strict=True):
            assert type(gk) is type(k), f"{where}: key {k!r} came back as {type(gk).__name__}"
            assert_same_state(got[k], want[k], f"{path}/{k}" if path else str(k))
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: length {len(got)}, expected {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same_state(g, w, f"{path}/{i}" if path else str(i))
    elif isinstance(want, float):
        if math.isnan(want):
            assert math.isnan(got), f"{where}: {got!r}, expected nan"
        else:
            assert struct.pack("<d", got) == struct.pack("<d", want), f"{where}: {got!r}, expected {want!r}"
    else:
        assert got == want, f"{where}: {got!r}, expected {want!r}"


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist (``make test`` runs 3 workers) hands out every test on its own, except the
    packages and modules in ``TOGETHER``, each of which goes to one worker whole: the deployment
    tests' Prefect server, work pool and deployments, and the sharded-state tests' saved FSDP2 jobs
    and runs, are set up once. (xdist's own ``--dist loadgroup`` cannot be used: it renames test
    ids through an attribute pytest 9.2 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class PackagesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return next((p for p in TOGETHER if nodeid.startswith((p + "/", p + "::"))), nodeid)

    return PackagesTogether(config, log)


TOGETHER = ("tests/deploy", "tests/sharded", "tests/cuda", "tests/pipeline/test_sharded_pipeline.py")


from tests.clirun import ckptflow  # noqa: E402, F401  (the fixture: run the console script as a user does)
