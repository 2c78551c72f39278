"""Atomic writes of small files: readers see the old bytes or the new, never a mix.

On local disks a file is written under a temporary name, fsynced, then renamed into
place (or hard-linked, which never replaces an existing name) and its directory fsynced;
on object stores one PUT is atomic. A killed writer leaves only a temporary file, which
``gc`` removes.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from typing import Any

from .byteio import fsync_dir
from .location import Location

TEMP_FILE = re.compile(r"^\..+\.[0-9a-f]{32}\.tmp$")  # what atomic_local_write leaves when killed


def atomic_local_write(directory: str, name: str, data: bytes, *, durable: bool = True) -> None:
    """Replace ``name`` with ``data``, complete and fsynced: a rename of a durable temporary file.

    ``durable=False``: readers still see the old or the new bytes, never a mix, but a crash of
    the machine (not of the process) may keep the old ones: for hints nobody trusts.
    """
    os.replace(durable_temp(directory, name, data, sync=durable), os.path.join(directory, name))
    if durable:
        fsync_dir(directory)


def exclusive_remote_write(fs: Any, path: str, data: bytes) -> Any:
    """Create ``path`` with ``data`` in one PUT with ``If-None-Match: *`` (fsspec's ``mode="create"``),
    or raise FileExistsError; returns what ``pipe_file`` returns (on S3, the response: its ETag).

    AWS names the failed condition in its 412 answer, and s3fs raises FileExistsError from it;
    other servers (SeaweedFS) answer a bare 412 PreconditionFailed, which s3fs raises as an
    OSError. With no other condition on the PUT, either means the object exists.
    """
    try:
        return fs.pipe_file(path, data, mode="create")
    except FileExistsError:
        raise
    except OSError as exc:
        if _precondition_failed(exc):
            raise FileExistsError(f"{path} exists") from exc
        raise


def _precondition_failed(exc: BaseException) -> bool:
    cause = exc.__cause__
    response = getattr(cause, "response", None) or {}
    code = response.get("Error", {}).get("Code")
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code == "PreconditionFailed" or status == 412


def exclusive_local_write(directory: str, name: str, data: bytes, *, durable: bool = True) -> None:
    """Create ``name`` with ``data``, complete and fsynced, or raise FileExistsError: a hard link
    of a temporary file never replaces an existing name, where a rename would. ``durable=False``:
    complete for every process, but not fsynced (what need not survive a crash of the machine)."""
    tmp = durable_temp(directory, name, data, sync=durable)
    try:
        os.link(tmp, os.path.join(directory, name))
    finally:
        os.unlink(tmp)
    if durable:
        fsync_dir(directory)


def durable_temp(directory: str, name: str, data: bytes, *, sync: bool = True) -> str:
    """A new temporary file beside ``name`` holding ``data``, fsynced (``sync``); none left if it
    fails (a full disk)."""
    tmp = os.path.join(directory, f".{name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def stale_temp_files(loc: Location) -> list[str]:
    """Temporary files of atomic writes under the root (``.latest.<hex>.tmp``) left by a killed writer."""
    if not loc.is_local or not os.path.isdir(loc.root):
        return []
    return sorted(os.path.join(loc.root, n) for n in os.listdir(loc.root) if TEMP_FILE.match(n))


def write_file_atomic(loc: Location, name: str, data: bytes, *, durable: bool = True) -> None:
    """Write a small file under the root so that readers see the old or the new bytes, never a mix
    (``durable=False``: without fsync, see :func:`atomic_local_write`)."""
    if loc.is_local:
        os.makedirs(loc.root, exist_ok=True)
        atomic_local_write(loc.root, name, data, durable=durable)
    else:
        loc.fs.pipe_file(loc.path(name), data)
