"""Child-process entry of the archive crash tests: ``run_flow`` with a hang planted in archiving or upload.

    python -m tests.children.hang_child '{"storage": "...", "archive": {...}}'

A test needs the kill to land at a known point of a background job, and the
jobs are not part of the TrainingSpec, so this entry plants the hang in the
storage library of the child process only (the test process and the re-runs
are untouched). It announces the point with a marker file, then sleeps until
the test SIGKILLs it:

- ``CKPTFLOW_TEST_HANG_IN_TAR=DIR``: the first tarball is being written: its
  first member is in the file, the other members and the index are not.
  ``DIR/tar-started`` names the tarball.
- ``CKPTFLOW_TEST_HANG_IN_UPLOAD=DIR``: uploads use 5 MiB parts (so a small
  tarball goes up as a multipart upload); part 1 of the first multipart upload
  is sent, the other parts wait. ``DIR/upload-started`` names the key.
- ``CKPTFLOW_TEST_HANG_IN_VERSION_UPLOAD=DIR``: the upload of a loose version
  (``upload_versions``) has sent its shards, not its manifest (the remote
  commit). ``DIR/version-upload-started`` names the manifest's URL.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
import uuid
from pathlib import Path

from tests.children.run_flow import main

HANG_IN_TAR_ENV = "CKPTFLOW_TEST_HANG_IN_TAR"
HANG_IN_UPLOAD_ENV = "CKPTFLOW_TEST_HANG_IN_UPLOAD"
HANG_IN_VERSION_UPLOAD_ENV = "CKPTFLOW_TEST_HANG_IN_VERSION_UPLOAD"
TAR_MARKER = "tar-started"
UPLOAD_MARKER = "upload-started"
VERSION_UPLOAD_MARKER = "version-upload-started"
HANG_SECONDS = 600


def announce(marker: Path, text: str) -> None:
    """Write the marker once: it names the first job that got there (later ones hang silently).

    The marker appears with its text already in it (written aside, then linked): a test that
    kills this process as soon as the marker exists must not find it empty (it once did).
    """
    aside = marker.with_name(f".{marker.name}.{uuid.uuid4().hex}")
    aside.write_text(text)
    try:
        with contextlib.suppress(FileExistsError):
            os.link(aside, marker)
    finally:
        aside.unlink()


def hang_in_tar(directory: Path) -> None:
    from ckptflow.storage.archive import tarwriter as archive

    original = archive._TarWriter.add

    def add(self, src, member, mtime):
        entry = original(self, src, member, mtime)
        os.fsync(self.fd)  # the partial tar is on disk, as a crash would find it
        announce(directory / TAR_MARKER, os.path.basename(self.sink.path))
        time.sleep(HANG_SECONDS)
        return entry

    archive._TarWriter.add = add


def hang_in_upload(directory: Path) -> None:
    from s3transfer.upload import UploadPartTask

    from ckptflow.storage.remote import transfer
    from ckptflow.storage.remote.etag import MiB

    whole_file = transfer.upload_file

    def upload_file(*args, options=None, **kwargs):
        options = dataclasses.replace(options or transfer.TransferOptions(), part_size=5 * MiB)
        return whole_file(*args, options=options, **kwargs)

    transfer.upload_file = upload_file  # storage.remote.mirror imports it at each upload
    original = UploadPartTask._main

    def send_part(self, client, fileobj, bucket, key, upload_id, part_number, extra_args):
        if part_number > 1:
            time.sleep(HANG_SECONDS)
        sent = original(self, client, fileobj, bucket, key, upload_id, part_number, extra_args)
        announce(directory / UPLOAD_MARKER, f"{bucket}/{key}")
        return sent

    UploadPartTask._main = send_part


def hang_in_version_upload(directory: Path) -> None:
    from ckptflow.storage.remote import transfer

    original = transfer.upload_file

    def upload_file(local_path, url, **kwargs):
        if "/archive/" not in url and url.endswith("/manifest.json"):
            announce(directory / VERSION_UPLOAD_MARKER, url)
            time.sleep(HANG_SECONDS)
        return original(local_path, url, **kwargs)

    transfer.upload_file = upload_file  # storage.remote.mirror imports it at each upload


if __name__ == "__main__":
    if os.environ.get(HANG_IN_TAR_ENV):
        hang_in_tar(Path(os.environ[HANG_IN_TAR_ENV]))
    if os.environ.get(HANG_IN_UPLOAD_ENV):
        hang_in_upload(Path(os.environ[HANG_IN_UPLOAD_ENV]))
    if os.environ.get(HANG_IN_VERSION_UPLOAD_ENV):
        hang_in_version_upload(Path(os.environ[HANG_IN_VERSION_UPLOAD_ENV]))
    sys.exit(main(sys.argv))
