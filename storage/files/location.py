"""Where a store lives: an fsspec URL turned into a filesystem and a root path.

Plain paths and ``file://`` URLs are local disks, where the commit protocol
needs fsync and rename; everything else (``s3://``, ``memory://``, ``gs://``,
...) is an object store, where a single PUT is atomic. Errors from the
filesystem layer are translated into :class:`StorageUnavailableError` with a
message that says what to do; URLs in messages never carry credentials.

Object stores fail in ways a local disk does not: no credentials, credentials
refused, an endpoint that does not answer, a server that answers 500 (or 503)
to every retry, as one restarting does. Those come from botocore or aiohttp
(through s3fs), and are recognised by the names of their classes, so that this
module imports neither: a store on a local disk never loads them.
:func:`probe` asks one question of a store (is anything there?) with bounded
connection attempts, so a command on a wrong URL fails within seconds. Every S3
store is opened with bounded timeouts and attempts, shaped by
:mod:`ckptflow.storage.files.s3options` (the one place S3 client options are).
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ..errors import StorageUnavailableError

# storage/__init__.py imports it from here
from .localfs import ConfinedLocalFileSystem
from .s3options import S3_SCHEMES, S3FS_RETRIES, bounded_s3_options


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

    def canonical(self) -> str:
        """One name of the store whatever way its URL was written: a local store's real path
        (relative paths, ``file://`` and symbolic links resolved), else its URL without
        credentials or a trailing ``/``. What records match a run to its store by."""
        if self.is_local:
            return os.path.realpath(self.root)
        return self.display()

    @property
    def is_s3(self) -> bool:
        protocol = self.fs.protocol
        return bool(set(S3_SCHEMES) & ({protocol} if isinstance(protocol, str) else set(protocol)))

    def remove_tree(self, path: str) -> None:
        """Remove ``path`` and everything under it (FileNotFoundError if there is nothing).

        On S3 also the key ``path/``: AWS has none (deleting it does nothing), but a server with
        real folders (SeaweedFS) keeps listing an emptied prefix until that key is deleted, and
        an emptied version directory would read as an interrupted save. Such a server deletes a
        folder that way only when it is empty.
        """
        self.fs.rm(path, recursive=True)
        self._drop_folder(path)

    def remove_file(self, path: str) -> None:
        """Remove the file ``path``; on S3 also its folder's key if the folder is left empty (see
        :meth:`remove_tree`: a server with real folders deletes only an empty one)."""
        self.fs.rm_file(path)
        self._drop_folder(path.rsplit("/", 1)[0])

    def _drop_folder(self, path: str) -> None:
        if self.is_s3 and "/" in path:
            bucket, _, key = path.partition("/")
            self.fs.call_s3("delete_object", Bucket=bucket, Key=key.rstrip("/") + "/")


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
    options = bounded_s3_options(text, storage_options)
    if scheme in S3_SCHEMES:
        from .s3roles import s3fs_options

        options = s3fs_options(options)
    try:
        fs, root = fsspec.core.url_to_fs(text, **options)
    except ImportError as exc:
        extra = " (pip install 'ckptflow[s3]')" if scheme in S3_SCHEMES else ""
        raise StorageUnavailableError(
            f"the filesystem for {redact(text)} needs a package that is not installed{extra}: {exc}"
        ) from None
    except (TypeError, ValueError) as exc:
        raise StorageUnavailableError(f"cannot open {redact(text)}: {exc}") from None
    if scheme in S3_SCHEMES and getattr(fs, "retries", 0) > S3FS_RETRIES:
        fs.retries = S3FS_RETRIES  # s3fs's own retries on top of botocore's: bound the total
    root = root.rstrip("/") or root
    if type(fs) is LocalFileSystem:  # a local store reads only regular files inside itself
        fs = ConfinedLocalFileSystem(root, auto_mkdir=fs.auto_mkdir)
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
    except Exception as exc:
        error = remote_failure(loc, action, exc) or _disk_failure(loc, action, exc)
        if error is None:
            raise
        raise error from exc


def _disk_failure(loc: Location, action: str, exc: Exception) -> StorageUnavailableError | None:
    if isinstance(exc, PermissionError):
        return StorageUnavailableError(
            f"permission denied while {action} {loc.display()}: check the credentials or "
            f"the directory's permissions ({type(exc).__name__})"
        )
    if not isinstance(exc, OSError):
        return None
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StorageUnavailableError(
            f"no space left on the device while {action} {loc.display()}; the committed versions are "
            "intact and a failed save removes its own partial files: free space (`ckptflow prune`; "
            "`ckptflow gc --min-age 0` removes older leftovers when nothing is writing) and try again"
        )
    if exc.errno == errno.EROFS:
        return StorageUnavailableError(
            f"read-only file system while {action} {loc.display()}: use a writable location"
        )
    if exc.errno == errno.ENOTDIR:
        return StorageUnavailableError(
            f"cannot use {loc.display()} while {action} it: {exc.filename or 'a path'} is under a path "
            "that is a file, not a directory"
        )
    if isinstance(exc, FileNotFoundError) and bucket_missing(loc):
        return missing_bucket_error(loc)
    return None


# Object-store failures, by the class names of botocore's and aiohttp's exceptions (and their bases).
_NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError"}
_CREDENTIALS_FAILED = {"CredentialRetrievalError", "TokenRetrievalError"}  # a profile's process, SSO, a role
_UNREACHABLE = {"HTTPClientError", "ConnectionError", "ClientConnectionError", "ServerTimeoutError"}
_REFUSED = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "InvalidClientTokenId",
    "TokenRefreshRequired",
    "Forbidden",
    "403",
}
_SERVER_FAILED = {"InternalError", "ServiceUnavailable", "SlowDown"}  # also any HTTP status >= 500


def remote_failure(loc: Location, action: str, exc: BaseException) -> StorageUnavailableError | None:
    """A clear error for an object store that cannot be used (credentials, endpoint); None otherwise."""
    return None if loc.is_local else store_failure(loc.display(), _endpoint(loc), action, exc)


def store_failure(
    where: str, endpoint: str | None, action: str, exc: BaseException
) -> StorageUnavailableError | None:
    """:func:`remote_failure` for the object at the redacted URL ``where``, reached at ``endpoint``
    (None: the default one). Names the object and the endpoint, never the credentials."""
    at = f" at {endpoint}" if endpoint else ""
    for error in _chain(exc):
        names = _class_names(error)
        if names & _NO_CREDENTIALS:
            return StorageUnavailableError(
                f"no credentials found for {where}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "(or AWS_PROFILE) in the environment, or key and secret in the storage options"
            )
        if names & _CREDENTIALS_FAILED:
            return StorageUnavailableError(
                f"could not get credentials for {where} ({error}): check the profile (its "
                "credential_process, SSO login or role) or give key and secret in the storage options"
            )
        if names & _UNREACHABLE:
            hint = "check the network"
            if endpoint:
                hint = "check client_kwargs.endpoint_url in the storage options"
            return StorageUnavailableError(
                f"cannot reach the object store{at} while {action} {where} "
                f"({type(error).__name__}): {hint}, and that the server is running"
            )
        code = _error_code(error)
        if code == "NoSuchBucket":
            return StorageUnavailableError(_no_bucket(where))
        if code in _REFUSED:
            return StorageUnavailableError(
                f"the object store{at} refused the credentials while {action} {where} ({code}): check "
                "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (or the profile, or key and secret in the storage "
                "options) and the bucket's policy"
            )
        status = _status_code(error)
        if code in _SERVER_FAILED or status >= 500:
            return StorageUnavailableError(
                f"the object store{at} failed while {action} {where} ({code or f'HTTP {status}'}, after "
                "retries): the server is down, restarting or overloaded; committed versions are intact. "
                "Try again once it answers"
            )
    return None


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _class_names(exc: BaseException) -> set[str]:
    """Names of the botocore/aiohttp classes ``exc`` is an instance of."""
    return {k.__name__ for k in type(exc).__mro__ if k.__module__.split(".")[0] in ("botocore", "aiohttp")}


def _error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None)
    if not isinstance(response, dict) or "botocore" not in sys.modules:
        return ""
    return str(response.get("Error", {}).get("Code", ""))


def _status_code(exc: BaseException) -> int:
    """The HTTP status of a botocore error's answer (0: none)."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict) or "botocore" not in sys.modules:
        return 0
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status if isinstance(status, int) else 0


def _endpoint(loc: Location) -> str | None:
    """The object store's endpoint URL, if one was given (shown without credentials)."""
    kwargs = getattr(loc.fs, "client_kwargs", None) or {}
    url = getattr(loc.fs, "endpoint_url", None) or kwargs.get("endpoint_url")
    return redact(str(url)) if url else None


def probe(loc: Location, *, must_exist: bool) -> bool:
    """Whether anything is stored at ``loc``: one listing, failing with a clear error on a missing
    bucket, missing or refused credentials or an unreachable endpoint.

    ``must_exist``: an empty or missing location is an error too (a command on a mistyped URL).
    """
    with translate_errors(loc, "opening"):
        try:
            loc.fs.ls(loc.root, detail=False)
            exists = True
        except FileNotFoundError:
            exists = False
        if not exists and bucket_missing(loc):
            raise missing_bucket_error(loc)
    if exists and loc.is_local and not os.path.isdir(loc.root):
        raise StorageUnavailableError(f"{loc.display()} is a file, not a checkpoint store: give a directory")
    if not exists and must_exist:
        raise StorageUnavailableError(f"no store at {loc.display()}: nothing is stored there; check the URL")
    return exists


def missing_bucket_error(loc: Location) -> StorageUnavailableError:
    return StorageUnavailableError(_no_bucket(loc.display()))


def _no_bucket(where: str) -> str:
    return f"the bucket of {where} does not exist (or is not visible with these credentials): create it first"


def bucket_missing(loc: Location) -> bool:
    """True when ``loc`` is on an object store and the bucket of its root does not exist."""
    if loc.is_local:
        return False
    bucket = loc.root.split("/", 1)[0]
    try:
        return not loc.fs.exists(bucket)
    except Exception:
        return False
