"""Verified, resumable uploads and downloads of big files (tarballs, shards) to any fsspec URL.

``upload_file`` is idempotent: a re-run after a crash skips a file whose remote
copy is already complete and verified, and redoes anything else. "Verified"
means checked end to end without downloading:

- on S3, through boto3's transfer engine (:mod:`.s3`): the server checks each
  part's CRC32 and the whole file's, and a HEAD must then show the file's size
  and CRC32 (from a server without flexible checksums: the MD5s behind its
  ETag). Unfinished multipart uploads of the key are aborted first;
- on other filesystems (local disks, ``memory://``, ...), which are cheap to
  read, the size and the xxh3-64 checksum of the remote copy read back.

A copy that fails verification is deleted and :class:`TransferVerifyError`
raised. ``download_file`` writes to a temporary file beside the target and
renames it only after the size and, on S3, the object's checksum match.

Retries: each S3 request is retried (``max_attempts``, with connect and read
timeouts); callers such as a Prefect task retry whole transfers. Credentials
come the usual AWS ways and never appear in results, messages or logs: URLs
are shown redacted.

This module is the transfers' front: it picks the way (:mod:`.s3` or fsspec) by
the URL. What both ways share comes from below it, so that :mod:`.s3` never
imports this module: the options (:class:`TransferOptions`, with every S3 client
setting, in :mod:`.options`) and the outcomes (:mod:`.results`), re-exported here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from ..errors import StorageUnavailableError
from ..files.byteio import fsync_dir, hash_file
from ..files.location import Location, open_location, redact, translate_errors
from ..files.s3options import TransferOptions, is_s3_url
from .results import TransferResult, TransferVerifyError

log = logging.getLogger(__name__)

DEFAULTS = TransferOptions()  # frozen: one instance serves every call that leaves them unset


def upload_file(
    local_path: str | os.PathLike[str],
    url: str,
    *,
    storage_options: dict[str, Any] | None = None,
    options: TransferOptions = DEFAULTS,
) -> TransferResult:
    """Upload one local file to ``url`` and verify it; skip it if an identical copy is already there."""
    local_path = os.fspath(local_path)
    start = time.monotonic()
    with open_local(local_path, os.O_RDONLY) as fd:
        before = os.fstat(fd)
        if not stat.S_ISREG(before.st_mode):
            raise StorageUnavailableError(f"{local_path} is not a regular file: upload files one by one")
        if is_s3_url(url):
            from . import s3

            etag, skipped = s3.upload_file(url, storage_options, options, local_path, fd)
        else:
            etag, skipped = _upload_fsspec(open_location(url, storage_options), local_path, before.st_size)
        _check_unchanged(local_path, before, os.fstat(fd))
    result = TransferResult(redact(url), before.st_size, time.monotonic() - start, skipped, etag)
    log.info(
        "%s %s (%d bytes)", "skipped, already verified:" if skipped else "uploaded", result.url, result.size
    )
    return result


def download_file(
    url: str,
    local_path: str | os.PathLike[str],
    *,
    storage_options: dict[str, Any] | None = None,
    options: TransferOptions = DEFAULTS,
) -> TransferResult:
    """Download ``url`` to ``local_path`` (atomically: temp file, fsync, rename) and verify it."""
    local_path = os.path.abspath(os.fspath(local_path))
    start = time.monotonic()
    directory = os.path.dirname(local_path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(local_path)}.", suffix=".part")
    try:
        try:
            if is_s3_url(url):
                from . import s3

                size, etag = s3.download_file(url, storage_options, options, fd)
            else:
                size, etag = _download_fsspec(open_location(url, storage_options), tmp)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, local_path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)
    return TransferResult(redact(url), size, time.monotonic() - start, False, etag)


# -- other filesystems ---------------------------------------------------------------------------


def _upload_fsspec(loc: Location, local_path: str, size: int) -> tuple[str, bool]:
    _, local_hash = hash_file(LocalFileSystem(), local_path, local=True)
    etag = f"xxh3_64:{local_hash}"
    with translate_errors(loc, "uploading to"):
        if _remote_digest(loc) == (size, local_hash):
            return etag, True
        _put(loc, local_path)
        remote = _remote_digest(loc)
        if remote != (size, local_hash):
            with contextlib.suppress(OSError):
                loc.fs.rm_file(loc.root)
            got_size, got_hash = remote or (0, "nothing")
            what, want, got = (
                ("size", size, got_size) if got_size != size else ("xxh3_64", local_hash, got_hash)
            )
            raise TransferVerifyError(
                loc.display(), what=what, expected=str(want), actual=str(got), deleted="the copy was deleted"
            )
    return etag, False


def _put(loc: Location, local_path: str) -> None:
    """Copy the file; on a local disk through a temp name, fsync and rename (never a torn file)."""
    parent = loc.fs._parent(loc.root)
    if not loc.is_local:
        if parent:
            loc.fs.makedirs(parent, exist_ok=True)
        loc.fs.put_file(local_path, loc.root)
        return
    os.makedirs(parent, exist_ok=True)
    tmp = f"{loc.root}.part-{os.getpid()}"
    try:
        loc.fs.put_file(local_path, tmp)
        with open_local(tmp, os.O_RDONLY) as fd:
            os.fsync(fd)
        os.replace(tmp, loc.root)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(parent)


def _remote_digest(loc: Location) -> tuple[int, str] | None:
    if not loc.fs.exists(loc.root) or loc.fs.isdir(loc.root):
        return None
    return hash_file(loc.fs, loc.root, local=loc.is_local)


def _download_fsspec(loc: Location, tmp: str) -> tuple[int, str]:
    with translate_errors(loc, "downloading"):
        if not loc.fs.exists(loc.root):
            raise StorageUnavailableError(f"no file at {loc.display()}: nothing to download")
        size = int(loc.fs.size(loc.root))
        loc.fs.get_file(loc.root, tmp)
    got = os.path.getsize(tmp)
    if got != size:
        raise TransferVerifyError(
            loc.display(), what="size", expected=str(size), actual=str(got), deleted="nothing was written"
        )
    _, digest = hash_file(LocalFileSystem(), tmp, local=True)
    return size, f"xxh3_64:{digest}"


# -- helpers -------------------------------------------------------------------------------------


@contextlib.contextmanager
def open_local(path: str, flags: int) -> Iterator[int]:
    fd = os.open(path, flags)
    try:
        yield fd
    finally:
        os.close(fd)


def _check_unchanged(path: str, before: os.stat_result, after: os.stat_result) -> None:
    if (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns):
        raise StorageUnavailableError(
            f"{path} changed while it was being uploaded; the upload may mix old and new bytes: "
            "upload it again once it is complete"
        )


__all__ = [
    "TransferOptions",
    "TransferResult",
    "TransferVerifyError",
    "download_file",
    "upload_file",
]
