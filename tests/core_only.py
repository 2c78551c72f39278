"""The storage library with only the core installed (``make test-core``, run by CI).

Run by the Python of a fresh virtualenv holding a wheel of this checkout and
its core dependencies only (torch, h5py, numpy, fsspec, xxhash, pydantic): no Prefect,
no s3fs, no boto3. It checks that ``import ckptflow.storage`` works and pulls
none of them in, that the wheel holds every subpackage (it once lacked
``ckptflow.storage.sharded``), that a checkpoint saves, lists and loads
bit for bit, that an ``s3://`` store names the extra to install, and that the
``ckptflow`` script (and ``python -m ckptflow``) answers ``--version`` and names the ``[cli]`` and
``[prefect]`` extras for everything else. Exits non-zero with a message on the first failure.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

ABSENT = ("prefect", "s3fs", "boto3", "typer", "rich")


def main() -> None:
    for name in ABSENT:
        assert importlib.util.find_spec(name) is None, f"{name} is installed: this is not a core-only venv"

    import torch

    import ckptflow.storage as storage
    from ckptflow.storage import CheckpointStore, StorageUnavailableError

    assert importlib.util.find_spec("ckptflow.storage.sharded") is not None, "the wheel lacks storage/sharded"
    with tempfile.TemporaryDirectory() as tmp:
        store = CheckpointStore(str(Path(tmp) / "store"))
        state = {"model": {"w": torch.randn(64, 32), "b": torch.arange(5)}, "step": 7, "name": "core"}
        info = store.save(state, epoch=1, metrics={"loss": 0.5})
        assert [v.version for v in store.versions()] == [info.version]
        loaded = store.load()
        assert torch.equal(loaded["model"]["w"], state["model"]["w"])
        assert torch.equal(loaded["model"]["b"], state["model"]["b"])
        assert loaded["step"] == 7 and loaded["name"] == "core"
    try:
        CheckpointStore("s3://bucket/run").versions()
    except StorageUnavailableError as exc:
        assert "pip install 'ckptflow[s3]'" in str(exc), exc
    else:
        raise AssertionError("an s3:// store opened without s3fs")
    imported = [name for name in ABSENT if name in sys.modules]
    assert not imported, f"import ckptflow.storage pulled in {imported}"

    script = Path(sys.executable).parent / "ckptflow"
    version = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("ckptflow "), version
    as_module = subprocess.run(
        [sys.executable, "-m", "ckptflow", "--version"], capture_output=True, text=True, timeout=60
    )
    assert as_module.returncode == 0 and as_module.stdout == version.stdout, as_module
    run = subprocess.run([script, "run", "--epochs", "1"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "pip install 'ckptflow[cli]'" in run.stderr, run
    assert "'ckptflow[prefect]' for the pipeline" in run.stderr, run
    print(f"core-only install of ckptflow {version.stdout.split()[1]}: {storage.__name__} saves and loads")


if __name__ == "__main__":
    main()
