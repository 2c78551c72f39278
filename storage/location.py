"""Where a store lives: an fsspec URL turned into a filesystem and a root path.

Plain paths and ``file://`` URLs are local disks, where the commit protocol
needs fsync and rename; everything else (``s3://``, ``memory://``, ``gs://``,
...) is an object store, where a single PUT is atomic. Errors from the
filesystem layer are translated into :class:`StorageUnavailableError` with a
message that says what to do; URLs in messages never carry credentials.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import fsspec
from fsspec.implementations.local import LocalFileSystem

from .errors import StorageUnavailableError


def redact(url: str) -> str:
    """``url`` without user info, query or fragment (where credentials hide)."""
    parts = urlsplit(url)
    if not parts.scheme:
        return url
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


@dataclass(frozen=True)
class Location:
    url: str
    fs: fsspec.AbstractFileSystem
    root: str  # path inside ``fs``, without a trailing slash

    @property
    def is_local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)

    def path(self, *parts: str) -> str:
        return "/".join([self.root, *parts]) if parts else self.root

    def display(self, *parts: str) -> str:
        """A URL for messages and artifacts: no credentials."""
        base = redact(self.url).rstrip("/")
        return "/".join([base, *parts]) if parts else base


def open_location(url: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Location:
    """Resolve ``url`` into a :class:`Location`; raise a clear error for unknown schemes."""
    text = os.fspath(url)
    if not text:
        raise StorageUnavailableError("the storage URL is empty; give a path, file://, s3://, memory:// ...")
    scheme = urlsplit(text).scheme
    if len(scheme) > 1 and scheme not in fsspec.available_protocols():
        raise StorageUnavailableError(
            f"no filesystem handles {scheme}:// (in {redact(text)}); known schemes: "
            f"{', '.join(sorted(p for p in fsspec.available_protocols() if len(p) > 1)[:20])}, ..."
        )
    try:
        fs, root = fsspec.core.url_to_fs(text, **(storage_options or {}))
    except ImportError as exc:
        raise StorageUnavailableError(
            f"the filesystem for {redact(text)} needs a package that is not installed: {exc}"
        ) from None
    except (TypeError, ValueError) as exc:
        raise StorageUnavailableError(f"cannot open {redact(text)}: {exc}") from None
    root = root.rstrip("/") or root
    if isinstance(fs, LocalFileSystem) and not urlsplit(text).scheme:
        text = root  # show plain paths absolute: messages then say where the files really are
    return Location(text, fs, root)


@contextmanager
def translate_errors(loc: Location, action: str) -> Iterator[None]:
    """Turn filesystem errors into :class:`StorageUnavailableError` naming the URL."""
    try:
        yield
    except StorageUnavailableError:
        raise
    except PermissionError as exc:
        raise StorageUnavailableError(
            f"permission denied while {action} {loc.display()}: check the credentials or "
            f"the directory's permissions ({type(exc).__name__})"
        ) from exc
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise StorageUnavailableError(
                f"no space left on the device while {action} {loc.display()}; the previous "
                "committed version is intact: free space (ckptflow prune/gc) and save again"
            ) from exc
        if exc.errno == errno.EROFS:
            raise StorageUnavailableError(
                f"read-only file system while {action} {loc.display()}: use a writable location"
            ) from exc
        if exc.errno == errno.ENOTDIR:
            raise StorageUnavailableError(
                f"cannot use {loc.display()} while {action} it: {exc.filename or 'a path'} is under a path "
                "that is a file, not a directory"
            ) from exc
        if isinstance(exc, FileNotFoundError) and bucket_missing(loc):
            raise missing_bucket_error(loc) from exc
        raise


def missing_bucket_error(loc: Location) -> StorageUnavailableError:
    return StorageUnavailableError(
        f"the bucket of {loc.display()} does not exist (or is not visible with these "
        "credentials): create it first"
    )


def bucket_missing(loc: Location) -> bool:
    """True when ``loc`` is on an object store and the bucket of its root does not exist."""
    if loc.is_local:
        return False
    bucket = loc.root.split("/", 1)[0]
    try:
        return not loc.fs.exists(bucket)
    except Exception:
        return False
