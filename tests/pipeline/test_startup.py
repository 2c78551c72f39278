"""What `ckptflow run`'s flow process imports before its first epoch: every import is paid on every run.

Prefect's imports take about 2 s here; torch (2 s more) is the training process's to import,
and nothing else may ride along.
"""

from __future__ import annotations

import subprocess
import sys

# the S3 client stack: 0.2 s of imports that only uploads and s3:// stores need
S3_CLIENT = ("aiohttp", "aiobotocore", "s3fs", "boto3", "s3transfer")


def imported_after(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint('\\n'.join(sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin", "PREFECT_API_URL": "http://127.0.0.1:9/api"},
    ).stdout
    return set(out.split())


def test_the_pipeline_does_not_import_the_s3_client_until_it_uploads():
    modules = imported_after("import ckptflow.flows.train, ckptflow.flows.cli")
    assert "prefect" in modules and "ckptflow.storage.store" in modules  # it did import the pipeline
    assert not [name for name in S3_CLIENT if name in modules]
    assert "torch" not in modules  # the training process imports it


def test_an_upload_still_finds_the_s3_client():
    modules = imported_after(
        "from ckptflow.storage.remote.mirror import upload_file\n"
        "import tempfile, os\n"
        "d = tempfile.mkdtemp(); open(os.path.join(d, 'a'), 'wb').write(b'x')\n"
        "upload_file(os.path.join(d, 'a'), 'file://' + os.path.join(d, 'b'), storage_options={})\n"
        "assert open(os.path.join(d, 'b'), 'rb').read() == b'x'"
    )
    assert "ckptflow.storage.remote.transfer" in modules
