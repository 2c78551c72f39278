"""The ckptflow command with the light ``[cli]`` extra alone (``make test-core``, run by CI).

Run by the Python of the core-only virtualenv of tests/core_only.py once the wheel's ``[cli]``
extra (typer, rich, safetensors) is installed into it: no Prefect and no server stack. The store
commands work (ls, show, verify, restore, prune, gc, import, each with --json where it reports),
`deployments init` writes the deployment files the wheel carries, and the pipeline's commands
name the extra they need. Exits non-zero on the first failure.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ABSENT = ("prefect", "fastapi", "sqlalchemy", "uvicorn", "s3fs", "boto3")


def ckptflow(*args: str, code: int = 0) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).parent / "ckptflow"
    done = subprocess.run([str(script), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == code, f"ckptflow {' '.join(args)}: exit {done.returncode}\n{done.stderr}"
    return done


def main() -> None:
    for name in ABSENT:
        assert importlib.util.find_spec(name) is None, f"{name} is installed: [cli] should not pull it in"
    for name in ("typer", "rich", "safetensors"):
        assert importlib.util.find_spec(name) is not None, f"{name} is missing: [cli] should install it"

    import torch

    from ckptflow.storage import CheckpointStore

    with tempfile.TemporaryDirectory() as tmp:
        url = str(Path(tmp) / "store")
        store = CheckpointStore(url)
        for epoch in range(3):
            store.save({"w": torch.full((8,), float(epoch))}, epoch=epoch, metrics={"loss": 3.0 - epoch})
        listed = json.loads(ckptflow("ls", url, "--json").stdout)
        assert [v["version"] for v in listed["versions"]] == [0, 1, 2], listed
        assert json.loads(ckptflow("show", url, "--version", "1", "--json").stdout)["version"] == 1
        assert ckptflow("verify", url).stdout.startswith("ok version 2 ")
        out = Path(tmp) / "w.safetensors"
        restored = json.loads(
            ckptflow("restore", url, "--out", str(out), "--format", "safetensors", "--json").stdout
        )
        assert restored["version"] == 2 and out.is_file()
        pruned = json.loads(ckptflow("prune", url, "--keep-last", "1", "--json").stdout)
        assert pruned["removed"] == [0, 1], pruned
        assert json.loads(ckptflow("gc", url, "--json").stdout)["removed"]["versions"] == []
        torch.save({"w": torch.ones(3)}, Path(tmp) / "other.pt")
        imported = json.loads(ckptflow("import", str(Path(tmp) / "other.pt"), url, "--json").stdout)
        assert imported["kind"] == "torch" and imported["version"] == 3, imported
        # The wheel carries the deployment files: a user without a checkout gets them from it.
        written = json.loads(ckptflow("deployments", "init", tmp, "--json").stdout)["written"]
        assert [Path(p).name for p in written] == ["prefect.yaml", "serve.py"], written
        yaml_text = (Path(tmp) / "deployments" / "prefect.yaml").read_text()
        assert "entrypoint: ckptflow.flows.train.train_pipeline" in yaml_text
        compile((Path(tmp) / "deployments" / "serve.py").read_text(), "serve.py", "exec")
    run = ckptflow("run", "--epochs", "1", code=2)
    assert "pip install 'ckptflow[prefect]'" in run.stderr and "store commands" in run.stderr, run.stderr
    assert "needs the pipeline" in ckptflow("setup-server", code=2).stderr
    print(
        "the [cli] extra: the store commands and `deployments init` work without Prefect; "
        "run names the [prefect] extra"
    )


if __name__ == "__main__":
    main()
