"""Uploads and downloads of one S3 object through boto3's transfer engine, verified end to end.

boto3's ``TransferManager`` moves the bytes (parallel parts and ranges, retries
of each request, resumed ranges). This module adds what it does not do:

- **Verification.** An upload carries the file's full-object CRC32
  (``ChecksumType=FULL_OBJECT``): the server checks each part's CRC32 as it
  arrives and the whole one when it completes the upload. One HEAD with
  ``ChecksumMode=ENABLED`` then decides: the object's size and checksum must be
  the file's (:func:`mismatch`; servers without flexible checksums: the MD5s
  behind the ETag). A mismatch deletes the object. A download is hashed as its
  bytes land (:class:`HashingSink`) and checked the same way.
- **Idempotence.** An object that already holds the file's bytes (by the same
  test) is not sent again; unfinished multipart uploads of the key are aborted
  before a new one.
- **Corrupt parts.** A part the server refuses for its checksum (corrupted on
  the way) is sent again, like a dropped one; bounded stalls and one-line
  errors come from the client (:mod:`.s3client`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import botocore.exceptions as bex
from botocore.httpchecksum import Crc32Checksum
from s3transfer.manager import TransferConfig, TransferManager
from s3transfer.subscribers import BaseSubscriber

from ..errors import StorageUnavailableError
from ..files.location import open_location, redact
from ..files.s3options import TransferOptions
from .etag import (
    PartPlan,
    b64,
    clean_etag,
    crc32_of,
    crc32_range,
    etag_of,
    etag_parts,
    md5_range,
    plan_for_etag,
    plan_parts,
    same_checksum,
)
from .results import TransferVerifyError
from .s3client import DENIED, DIGEST_ERRORS, client_for, error_code, translate_s3_errors

log = logging.getLogger(__name__)

_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
_KMS = {"aws:kms", "aws:kms:dsse"}


@dataclass(frozen=True)
class Object:
    """One S3 object and the client and settings to move it."""

    client: Any
    bucket: str
    key: str
    extra: dict[str, Any]  # s3_additional_kwargs (SSE, requester pays, ...)
    url: str  # redacted, for messages

    @property
    def get_args(self) -> dict[str, Any]:
        return {k: v for k, v in self.extra.items() if k in TransferManager.ALLOWED_DOWNLOAD_ARGS}

    def fail(self, problem: tuple[str, str, str], deleted: str) -> TransferVerifyError:
        what, expected, actual = problem
        return TransferVerifyError(self.url, what=what, expected=expected, actual=actual, deleted=deleted)

    def call(self, method: str, **kwargs: Any) -> Any:
        return getattr(self.client, method)(Bucket=self.bucket, Key=self.key, **kwargs)


@dataclass(frozen=True)
class Head:
    """What a HEAD says about an object's bytes."""

    size: int
    etag: str  # without quotes
    md5_etag: bool  # False for SSE-KMS / SSE-C objects, whose ETag is no MD5
    crc: str | None  # ChecksumCRC32 ("<base64>" or composite "<base64>-N"); None: none
    full_object: bool  # the CRC32 is of the whole object even if it is multipart


def upload_file(
    url: str, storage_options: dict[str, Any] | None, options: TransferOptions, path: str, fd: int
) -> tuple[str, bool]:
    """Upload the file ``fd`` (at ``path``) to ``url`` unless the object already holds its bytes;
    return (ETag, skipped)."""
    with translate_s3_errors(url, storage_options, "uploading to", options.max_attempts):
        done = _upload(_object(url, storage_options, options), path, fd, _config(options, options.part_size))
    if "s3fs" in sys.modules:  # an s3fs instance of these options must not hide the new object
        with contextlib.suppress(Exception):
            loc = open_location(url, storage_options)
            loc.fs.invalidate_cache(loc.root)
    return done


def download_file(
    url: str, storage_options: dict[str, Any] | None, options: TransferOptions, fd: int
) -> tuple[int, str]:
    """Fill ``fd`` with the object's bytes; with ``download_checksums``, check them as the HEAD allows
    (by ``part_size``, the likeliest part size of a multipart object). Returns (size, ETag)."""
    with translate_s3_errors(url, storage_options, "downloading", options.max_attempts):
        obj = _object(url, storage_options, options)  # its client may fetch credentials: translated
        found = head(obj)
        if found is None:
            raise StorageUnavailableError(f"no object at {obj.url}: nothing to download")
        os.ftruncate(fd, found.size)
        sink = HashingSink(
            fd, *_check_for(found, options.part_size) if options.download_checksums else (None, "")
        )
        with TransferManager(obj.client, _config(options, options.range_size)) as manager:
            manager.download(
                obj.bucket, obj.key, sink, extra_args=obj.get_args, subscribers=[_Known(found)]
            ).result()
    if sink.plan is not None:
        actual = sink.result()
        expected = (found.crc if sink.kind == "CRC32" else None) or found.etag
        if not (same_checksum(expected, actual) if sink.kind == "CRC32" else expected == actual):
            raise obj.fail((sink.kind, expected, actual), "nothing was written")
    return found.size, found.etag


def transfer_client(storage_options: dict[str, Any] | None, options: TransferOptions) -> Any:
    """The boto3 client the transfers with these options use (one per process, see client_for)."""
    return client_for(storage_options, **options.client_settings())


def _object(url: str, storage_options: dict[str, Any] | None, options: TransferOptions) -> Object:
    parts = urlsplit(url)
    key = parts.path.lstrip("/")
    if not key:
        raise StorageUnavailableError(f"{redact(url)} names a bucket, not an object: add a key")
    so = dict(storage_options or {})
    client = transfer_client(so, options)
    extra = dict(so.get("s3_additional_kwargs") or {})
    if so.get("requester_pays"):
        extra.setdefault("RequestPayer", "requester")
    return Object(client, parts.netloc, key, extra, redact(url))


def _config(options: TransferOptions, chunk: int) -> TransferConfig:
    return TransferConfig(
        multipart_threshold=chunk + 1,  # a file of exactly one part goes in one PUT (or GET)
        multipart_chunksize=chunk,
        max_request_concurrency=options.concurrency,
        num_download_attempts=options.max_attempts,
    )


def head(obj: Object) -> Head | None:
    """The object's size, ETag and CRC32; None if there is no object."""
    extra = obj.get_args
    try:
        try:
            resp = obj.call("head_object", **{**extra, "ChecksumMode": "ENABLED"})
        except bex.ClientError as exc:
            if error_code(exc) not in DENIED:
                raise
            # Asking for an SSE-KMS object's checksums needs kms:Decrypt: without them, ETags decide.
            log.debug("%s: checksums refused, HEAD without them", obj.url)
            resp = obj.call("head_object", **extra)
    except bex.ClientError as exc:
        if error_code(exc) in _NOT_FOUND:
            return None
        raise
    md5_etag = resp.get("ServerSideEncryption") not in _KMS and not resp.get("SSECustomerAlgorithm")
    full = resp.get("ChecksumType") == "FULL_OBJECT"
    crc = resp.get("ChecksumCRC32") or None
    return Head(int(resp["ContentLength"]), clean_etag(resp.get("ETag")), md5_etag, crc, full)


def mismatch(
    obj: Object, fd: int, found: Head, whole: str, part_size: int, *, ours: bool
) -> tuple[str, str, str] | None:
    """What differs between the object ``found`` and the file ``fd`` (whose CRC32 is ``whole``);
    None if nothing. An object whose bytes cannot be checked (no CRC32, an ETag that is no MD5, a
    part plan that cannot be told) counts as different, unless it is ``ours`` (just uploaded and
    checked by the server): then its size decides, with a warning."""
    size = os.fstat(fd).st_size
    if found.size != size:
        return ("size", str(size), str(found.size))
    plan, kind = _check_for(found, part_size)
    if plan is None:
        if not ours:
            return ("checksum", "a CRC32 or an MD5 ETag", "neither")
        log.warning("%s has no checksum this can compare (SSE-KMS/SSE-C): size checked only", obj.url)
        return None
    if kind == "ETag":
        log.debug("%s has no CRC32: checking its ETags by MD5s", obj.url)
        expected = etag_of(plan, [md5_range(fd, p.offset, p.length) for p in plan.parts])
        return None if expected == found.etag else ("ETag", expected, found.etag)
    if plan.multipart:
        expected = crc32_of(plan, [crc32_range(fd, p.offset, p.length) for p in plan.parts])
    else:
        expected = whole  # one CRC32 of the whole file: computed already
    assert found.crc is not None
    return None if same_checksum(found.crc, expected) else ("CRC32", expected, found.crc)


def _upload(obj: Object, path: str, fd: int, config: TransferConfig) -> tuple[str, bool]:
    """Upload the file unless the object already holds its bytes; return (ETag, skipped)."""
    whole = crc32_range(fd, 0, os.fstat(fd).st_size)
    found = head(obj)
    if found is not None and mismatch(obj, fd, found, whole, config.multipart_chunksize, ours=False) is None:
        return found.etag, True
    aborted = abort_stale(obj)
    if aborted:
        log.info("aborted %d unfinished multipart upload(s) of %s", aborted, obj.url)
    args = {k: v for k, v in obj.extra.items() if k in TransferManager.ALLOWED_UPLOAD_ARGS}
    try:
        with TransferManager(obj.client, config) as manager:
            manager.upload(path, obj.bucket, obj.key, extra_args={**args, "ChecksumCRC32": whole}).result()
    except bex.ClientError as exc:
        if error_code(exc) not in DIGEST_ERRORS:
            raise
        differs = ("CRC32", whole, f"other bytes ({error_code(exc)} from the server)")
        raise obj.fail(differs, "the remote copy was removed") from None
    done = head(obj)
    if done is None:
        raise obj.fail(("object", "an object", "none after the upload"), "the remote copy was removed")
    problem = mismatch(obj, fd, done, whole, config.multipart_chunksize, ours=True)
    if problem:
        obj.call("delete_object")
        raise obj.fail(problem, "the remote copy was removed")
    return done.etag, False


def abort_stale(obj: Object) -> int:
    """Abort every unfinished multipart upload of this key; return how many."""
    aborted = 0
    pages = obj.client.get_paginator("list_multipart_uploads").paginate(Bucket=obj.bucket, Prefix=obj.key)
    for page in pages:
        for stale in page.get("Uploads", []):
            if stale.get("Key") == obj.key:
                with contextlib.suppress(bex.ClientError):  # gone already: fine
                    obj.call("abort_multipart_upload", UploadId=stale["UploadId"])
                aborted += 1
    return aborted


def _check_for(found: Head, part_size: int) -> tuple[PartPlan | None, str]:
    """How a download of ``found`` is checked: (the part plan to hash by, "CRC32" or "ETag")."""
    if found.crc is not None and (found.full_object or not etag_parts(found.etag)):
        return plan_parts(found.size, max(found.size, 1)), "CRC32"
    plan = plan_for_etag(found.size, found.etag, part_size)
    if found.crc is not None:
        return plan, "CRC32"
    return (plan, "ETag") if found.md5_etag else (None, "")


class _Known(BaseSubscriber):
    """Tells the transfer the size and ETag from our HEAD, so it sends none of its own."""

    def __init__(self, found: Head) -> None:
        self.found = found

    def on_queued(self, future: Any, **kwargs: Any) -> None:
        future.meta.provide_transfer_size(self.found.size)
        future.meta.provide_object_etag(f'"{self.found.etag}"')


class HashingSink:
    """The file a download writes into, hashing each part's bytes on their way to it.

    It is not seekable, so boto3 hands it the bytes in order (holding back, in a
    bounded queue, the ranges that arrive early, and passing each byte once even
    when a range is retried): each piece is hashed from memory as it is written.
    """

    def __init__(self, fd: int, plan: PartPlan | None, kind: str) -> None:
        self.fd, self.plan, self.kind = fd, plan, kind
        self.pos = 0
        self.digests: list[bytes] = []
        self.current: Any = None

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], self.pos + done)
        if self.plan is not None:
            self._hash(view)
        self.pos += done
        return done

    def _hash(self, view: memoryview) -> None:
        assert self.plan is not None
        at = self.pos
        while view:
            part = self.plan.parts[len(self.digests)]
            self.current = self.current or _hasher(self.kind)
            take = part.offset + part.length - at
            self.current.update(view[:take])
            view, at = view[take:], at + min(take, len(view))
            if at == part.offset + part.length:
                self.digests.append(self.current.digest())
                self.current = None

    def result(self) -> str:
        """The object's checksum as the server reports it, from the bytes written."""
        assert self.plan is not None
        if self.plan.size == 0:
            self.digests = [_hasher(self.kind).digest()]
        if self.kind == "ETag":
            return etag_of(self.plan, self.digests)
        return crc32_of(self.plan, [b64(int.from_bytes(d, "big")) for d in self.digests])


def _hasher(kind: str) -> Any:
    return hashlib.md5() if kind == "ETag" else Crc32Checksum()
