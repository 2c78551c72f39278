"""Clear errors: each names what is wrong (a key path, a URL, a version) and leaves the store as it was."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import traceback
import uuid

import numpy as np
import pytest
import torch

from ckptflow.storage import (
    CheckpointError,
    CheckpointStore,
    CorruptShardError,
    StorageUnavailableError,
    UnsupportedValueError,
    VersionExistsError,
    VersionNotFoundError,
)
from tests.conftest import S3_SECRET, assert_same_state
from tests.disks import small_tmpfs

pytestmark = pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")


class _Sub(torch.Tensor):
    pass


UNSUPPORTED = {
    "object": lambda: object(),
    "set": lambda: {1, 2},
    "sparse": lambda: torch.eye(3).to_sparse(),
    "lambda": lambda: lambda x: x,
    "quantized": lambda: torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8),
    "meta": lambda: torch.empty(3, device="meta"),
    "subclass": lambda: torch.ones(2).as_subclass(_Sub),
    "object-array": lambda: np.array([object()]),
    "datetime-array": lambda: np.array(["2024-01-01"], dtype="datetime64[D]"),
    "lone-surrogate": lambda: "bad \ud800",
    "generator": lambda: torch.Generator(),  # it has get_state(), not state_dict()
}


class TestUnsupportedValues:
    @pytest.mark.parametrize("kind", ["object", "set", "sparse", "lambda"])
    def test_named_by_key_path_and_nothing_written(self, store_url, kind):
        store = store_url.open()
        state = {"model": {"w": torch.ones(3), "foo": UNSUPPORTED[kind]()}, "epoch": 1}
        with pytest.raises(UnsupportedValueError, match="at model/foo:") as err:
            store.save(state)
        assert err.value.path == "model/foo"
        assert store_url.raw_version_dirs() == []
        assert store.versions() == []

    @pytest.mark.parametrize("kind", sorted(UNSUPPORTED))
    def test_every_kind_is_refused_before_any_io(self, tmp_path, kind):
        store = CheckpointStore(tmp_path / "store")
        store.save({"ok": torch.ones(1)})
        with pytest.raises(UnsupportedValueError) as err:
            store.save({"a": [{"b": torch.ones(1)}, {"c": UNSUPPORTED[kind]()}]})
        assert err.value.path == "a/1/c"
        assert "a/1/c" in str(err.value)
        assert sorted(os.listdir(tmp_path / "store")) == ["latest", "v000000"]
        assert (tmp_path / "store" / "latest").read_text() == "v000000\n"

    def test_the_message_says_what_to_do(self, tmp_path):
        store = CheckpointStore(tmp_path)
        with pytest.raises(
            UnsupportedValueError, match=r"objects with state_dict\(\) and load_state_dict\(\)"
        ):
            store.save({"rng": torch.Generator()})
        with pytest.raises(UnsupportedValueError, match=r"\.to_dense\(\)"):
            store.save({"s": torch.eye(2).to_sparse()})

    def test_is_a_checkpoint_error_and_a_type_error(self, tmp_path):
        with pytest.raises(UnsupportedValueError) as err:
            CheckpointStore(tmp_path).save({"x": {1, 2}})
        assert isinstance(err.value, CheckpointError) and isinstance(err.value, TypeError)


class TestBadLocations:
    def test_unknown_url_scheme(self):
        with pytest.raises(StorageUnavailableError, match=r"no filesystem handles nosuchscheme://") as err:
            CheckpointStore("nosuchscheme://bucket/run")
        assert "known schemes" in str(err.value)

    def test_scheme_whose_package_is_not_installed(self):
        assert importlib.util.find_spec("adlfs") is None, "this test needs a scheme without its package"
        with pytest.raises(StorageUnavailableError, match=r"abfs://container/run needs a package"):
            CheckpointStore("abfs://container/run")

    def test_empty_url(self):
        with pytest.raises(StorageUnavailableError, match="URL is empty"):
            CheckpointStore("")

    def test_missing_s3_bucket(self, s3_bucket, s3_server):
        import boto3

        _, options = s3_bucket
        missing = f"no-such-bucket-{uuid.uuid4().hex[:12]}"
        store = CheckpointStore(f"s3://{missing}/run", storage_options=options)
        for call in (
            lambda: store.save({"w": torch.ones(2)}),
            store.load,
            store.versions,
        ):
            with pytest.raises(
                StorageUnavailableError, match=f"bucket of s3://{missing}/run does not exist"
            ) as err:
                call()
            chain = "".join(traceback.format_exception(err.value))
            assert S3_SECRET not in chain
        client = boto3.client("s3", endpoint_url=s3_server)
        assert missing not in [b["Name"] for b in client.list_buckets()["Buckets"]], "save created the bucket"

    def test_a_file_where_the_directory_should_be(self, tmp_path):
        """Bug fixed: a store under a regular file raised a bare NotADirectoryError."""
        blocker = tmp_path / "file"
        blocker.write_bytes(b"not a directory")
        store = CheckpointStore(blocker / "store")
        with pytest.raises(StorageUnavailableError, match=r"is under a path that is a file, not a directory"):
            store.save({"w": torch.ones(1)})
        assert blocker.read_bytes() == b"not a directory"


# Runs in a child process without CAP_DAC_OVERRIDE, so that even root gets a real EACCES.
_READ_ONLY_CHILD = textwrap.dedent(
    """
    import json, sys, torch
    from ckptflow.storage import CheckpointStore
    store = CheckpointStore(sys.argv[1])
    result = {"versions": [v.version for v in store.versions()]}
    try:
        store.save({"w": torch.zeros(2)})
    except Exception as exc:
        result["save_error"] = [type(exc).__name__, str(exc)]
    result["loaded"] = store.load()["w"].tolist()
    print(json.dumps(result))
    """
)


def _drop_file_capabilities() -> None:  # runs in the child, before exec
    if os.geteuid() != 0:
        return  # an ordinary user is subject to permissions anyway
    libc = ctypes.CDLL(None, use_errno=True)
    pr_capbset_drop, cap_dac_override, cap_dac_read_search = 24, 1, 2
    for cap in (cap_dac_override, cap_dac_read_search):
        if libc.prctl(pr_capbset_drop, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


class TestPermissions:
    def test_read_only_directory(self, tmp_path):
        root = tmp_path / "store"
        CheckpointStore(root).save({"w": torch.ones(2)})
        root.chmod(0o555)
        try:
            proc = subprocess.run(
                [sys.executable, "-c", _READ_ONLY_CHILD, str(root)],
                preexec_fn=_drop_file_capabilities,
                capture_output=True,
                text=True,
                timeout=120,
            )
        finally:
            root.chmod(0o755)
        assert proc.returncode == 0, proc.stderr
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result["versions"] == [0]
        kind, message = result["save_error"]
        assert kind == "StorageUnavailableError"
        assert message.startswith(f"permission denied while saving to {root}")
        assert result["loaded"] == [1.0, 1.0]  # a read-only store still loads
        assert sorted(os.listdir(root)) == ["latest", "v000000"]


class TestVersionErrors:
    def test_version_not_found_lists_the_committed_versions(self, store_url):
        store = store_url.open()
        for v in (0, 1, 3):
            store.save({"v": v}, version=v)
        with pytest.raises(VersionNotFoundError) as err:
            store.load(2)
        assert f"version 2 is not committed in {store.url} (committed versions: 0, 1, 3)" == str(err.value)
        assert err.value.committed == [0, 1, 3]
        with pytest.raises(VersionNotFoundError, match="committed versions: 0, 1, 3"):
            store.manifest(7)
        with pytest.raises(VersionNotFoundError, match="committed versions: 0, 1, 3"):
            store.delete(2)

    def test_empty_store_says_there_is_no_committed_checkpoint(self, store_url):
        store = store_url.open()
        with pytest.raises(
            VersionNotFoundError, match=r"no committed checkpoint in .*\(committed versions: none\)"
        ):
            store.load()
        assert store.versions() == [] and store.latest() is None

    def test_a_half_written_version_is_not_a_checkpoint(self, store_url):
        store_url.raw_write("v000000/shard-r0-00.h5", b"partial")
        store = store_url.open()
        with pytest.raises(VersionNotFoundError, match="no committed checkpoint"):
            store.load()
        with pytest.raises(VersionNotFoundError, match="version 0 is not committed"):
            store.load(0)


@pytest.fixture
def small_disk(tmp_path):
    """A real 1 MiB tmpfs, so writes fail with ENOSPC (needs root: mount)."""
    with small_tmpfs(tmp_path / "disk", "1m") as mountpoint:
        yield mountpoint


class TestDiskFull:
    def test_no_space_keeps_the_previous_version(self, small_disk):
        store = CheckpointStore(small_disk / "store")
        first = {"w": torch.randn(20_000), "step": 1}  # 80 KB
        store.save(first, epoch=0)

        with pytest.raises(StorageUnavailableError, match="no space left on the device") as err:
            store.save({"w": torch.randn(500_000)}, epoch=1)  # 2 MB on a 1 MiB disk
        assert str(small_disk / "store") in str(err.value)
        assert [v.version for v in store.versions()] == [0]
        assert_same_state(store.load(), first)
        store.verify(0)
        assert (small_disk / "store" / "latest").read_text() == "v000000\n"

        # the failed save removed its own partial files: the disk is free again without gc (which
        # spares recent leftovers for 900 s by default, so its advice used to fail on a full disk)
        assert sorted(p.name for p in (small_disk / "store").iterdir()) == ["latest", "v000000"]
        assert "a failed save removes its own partial files" in str(err.value)
        assert store.gc() == []
        info = store.save({"w": torch.ones(10)}, epoch=1)
        assert info.version == 1
        assert [v.version for v in store.versions()] == [0, 1]

    def test_read_only_file_system(self, small_disk):
        store = CheckpointStore(small_disk / "store")
        store.save({"w": torch.ones(3)})
        subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
        try:
            with pytest.raises(StorageUnavailableError, match="read-only file system while saving to"):
                store.save({"w": torch.zeros(3)})
            assert torch.equal(store.load()["w"], torch.ones(3))
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(small_disk)], check=True)


@pytest.mark.parametrize(
    "error",
    [
        CorruptShardError("v000001/shard-0.h5", expected="crc32c:1", actual="crc32c:2"),
        VersionNotFoundError(4, "file:///store", [1, 2]),
        VersionExistsError(2, "file:///store"),
        UnsupportedValueError("model/w", "a tensor subclass"),
        StorageUnavailableError("no space left on device"),
    ],
    ids=lambda error: type(error).__name__,
)
def test_an_error_crosses_torch_distributed_as_it_was(error: CheckpointError) -> None:
    """torch.distributed's object collectives pickle a rank's error to the others (DCP gathers
    them); one whose __init__ takes other arguments than its message must come back whole, not as
    a TypeError from the unpickling."""
    import torch.distributed as dist

    here = not dist.is_initialized()
    if here:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        gathered: list[object] = [None]
        dist.all_gather_object(gathered, error)
    finally:
        if here:
            dist.destroy_process_group()
    back = gathered[0]
    assert type(back) is type(error) and str(back) == str(error) and vars(back) == vars(error)
