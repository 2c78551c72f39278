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
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import stat
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from fsspec.implementations.local import LocalFileSystem

from ..errors import CheckpointError, CorruptShardError, StorageUnavailableError
from ..files.byteio import fsync_dir, hash_file
from ..files.location import S3_SCHEMES, Location, bounded_s3_options, open_location, redact, translate_errors
from .etag import MAX_PART, MIN_PART, MiB

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransferOptions:
    """How to move bytes: part size, parallelism, and the S3 client's timeouts and retries."""

    # boto3's defaults: 8 MiB parts, 10 at once (grown to stay within S3's 10,000 parts).
    part_size: int = 8 * MiB  # bytes per multipart upload part (files up to this size: one PUT)
    range_size: int = 8 * MiB  # bytes per ranged GET of a download
    concurrency: int = 10  # parts or ranges in flight
    connect_timeout: float = 10.0  # seconds to open a connection
    read_timeout: float = 30.0  # seconds without a byte moving (either way) before a request fails
    max_attempts: int = 5  # tries per request (botocore "standard" retries), and per download range
    # Downloads from S3: check the bytes against the object's CRC32 (~0.25 s of CPU per GiB), or,
    # from a server without CRC32s, against the MD5s behind its ETag (~1.3 s per GiB); a composite
    # checksum only when the part size can be told. False: the size only. Uploads always check.
    download_checksums: bool = True

    def __post_init__(self) -> None:
        if not MIN_PART <= self.part_size <= MAX_PART:
            raise ValueError(f"part_size must be between 5 MiB and 5 GiB (S3's limits), not {self.part_size}")
        if self.range_size < MiB:
            raise ValueError(f"range_size must be at least 1 MiB, not {self.range_size}")
        if self.concurrency < 1 or self.max_attempts < 1:
            raise ValueError("concurrency and max_attempts must be at least 1")
        if self.connect_timeout <= 0 or self.read_timeout <= 0:
            raise ValueError("connect_timeout and read_timeout must be positive (a stall must end)")

    def honouring(self, storage_options: dict[str, Any] | None) -> TransferOptions:
        """These options with the timeouts and attempts the user set in ``config_kwargs`` (theirs win).

        ``connect_timeout``, ``read_timeout`` and ``retries`` {``total_max_attempts`` or
        ``max_attempts``, which counts retries} are read as botocore reads them.
        """
        config = (storage_options or {}).get("config_kwargs") or {}
        retries = config.get("retries") or {}
        attempts = retries.get("total_max_attempts")
        if attempts is None and retries.get("max_attempts") is not None:
            attempts = int(retries["max_attempts"]) + 1
        return dataclasses.replace(
            self,
            connect_timeout=float(config.get("connect_timeout", self.connect_timeout)),
            read_timeout=float(config.get("read_timeout", self.read_timeout)),
            max_attempts=int(attempts if attempts is not None else self.max_attempts),
        )


@dataclass(frozen=True)
class TransferResult:
    url: str  # redacted: no credentials
    size: int
    seconds: float
    skipped: bool  # True: the remote copy was already complete and verified, nothing was sent
    etag: str  # S3: the object's ETag; other filesystems: "xxh3_64:<hex>" of the bytes


class TransferVerifyError(CorruptShardError):
    """A transferred copy does not match its source; the bad copy was deleted."""

    def __init__(self, url: str, *, what: str, expected: str, actual: str, deleted: str) -> None:
        self.file, self.expected, self.actual = url, expected, actual
        CheckpointError.__init__(
            self,
            f"the copy at {url} failed verification: {what} expected {expected}, found {actual}; "
            f"{deleted}; transfer it again (if it fails again, the source changed or the storage is faulty)",
        )


def s3_storage_options(
    storage_options: dict[str, Any] | None = None, options: TransferOptions = TransferOptions()
) -> dict[str, Any]:
    """s3fs ``storage_options`` with ``options``' timeouts, attempts and pool size merged in (others
    kept; the user's retry ``mode`` too). For a store on the same target as the transfers."""
    merged = bounded_s3_options("s3://", storage_options)
    config = merged["config_kwargs"]
    retries = {k: v for k, v in (config.get("retries") or {}).items() if k != "max_attempts"}
    config.update(
        connect_timeout=options.connect_timeout,
        read_timeout=options.read_timeout,
        retries={"mode": "standard", **retries, "total_max_attempts": options.max_attempts},
        max_pool_connections=max(int(config.get("max_pool_connections") or 10), options.concurrency),
    )
    return merged


def upload_file(
    local_path: str | os.PathLike[str],
    url: str,
    *,
    storage_options: dict[str, Any] | None = None,
    options: TransferOptions = TransferOptions(),
) -> TransferResult:
    """Upload one local file to ``url`` and verify it; skip it if an identical copy is already there."""
    local_path = os.fspath(local_path)
    start = time.monotonic()
    with open_local(local_path, os.O_RDONLY) as fd:
        before = os.fstat(fd)
        if not stat.S_ISREG(before.st_mode):
            raise StorageUnavailableError(f"{local_path} is not a regular file: upload files one by one")
        if _is_s3(url):
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
    options: TransferOptions = TransferOptions(),
) -> TransferResult:
    """Download ``url`` to ``local_path`` (atomically: temp file, fsync, rename) and verify it."""
    local_path = os.path.abspath(os.fspath(local_path))
    start = time.monotonic()
    directory = os.path.dirname(local_path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(local_path)}.", suffix=".part")
    try:
        try:
            if _is_s3(url):
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


# -- S3 ----------------------------------------------------------------------------------------


def _is_s3(url: str) -> bool:
    return urlsplit(url).scheme in S3_SCHEMES


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
    "s3_storage_options",
    "upload_file",
]
