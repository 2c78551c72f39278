"""Parallel multipart uploads and ranged downloads on S3, verified by ETag.

Runs on s3fs's event loop with s3fs's aiobotocore client (so the store and the
transfers share credentials, endpoint and connection settings); at most
``concurrency`` parts are in flight, and local file I/O and MD5 run in a small
thread pool beside the loop (both release the GIL).

What must always hold:

- An upload is done only when a HEAD shows the expected size and ETag; an
  existing object counts as uploaded only under the same test (so an object of
  the right size with other bytes is uploaded again). An unfinished multipart
  upload is not an object: it is aborted before a new upload of the key.
- A verification failure deletes the object, so nothing unverified stays.
- A download is written to a temporary file and renamed only after its size
  (and, when the ETag allows it, its MD5s) match.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import logging
import os
import random
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import botocore.exceptions as bex

from .etag import MiB, Part, PartPlan, clean_etag, etag_of, etag_parts, guess_part_size, plan_parts
from .s3client import TRANSIENT, error_code

log = logging.getLogger(__name__)
T = TypeVar("T")
READ_CHUNK = 1 << 20  # bytes per read of a response body
_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
_KMS = {"aws:kms", "aws:kms:dsse"}
_DIGEST_ERRORS = {"BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch", "XAmzContentChecksumMismatch"}


class VerifyFailed(Exception):
    """Internal: the remote bytes are not the expected ones (what, expected, actual)."""


@dataclass(frozen=True)
class Head:
    size: int
    etag: str  # without quotes
    md5_etag: bool  # False for SSE-KMS / SSE-C objects, whose ETag is not an MD5


class S3Transfer:
    """One object (bucket, key) and the means to move it: the client, a semaphore, a thread pool."""

    def __init__(self, fs: Any, bucket: str, key: str, *, concurrency: int, max_attempts: int) -> None:
        self.fs, self.bucket, self.key = fs, bucket, key
        self.max_attempts = max_attempts
        self.sem = asyncio.Semaphore(concurrency)
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="ckptflow-xfer")

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    async def call(self, method: str, **kwargs: Any) -> Any:
        """One S3 request about this key through s3fs's client, with s3fs's extra kwargs (SSE, ...).

        Only botocore retries it (s3fs's own ``_call_s3`` would retry again on top).
        """
        await self.fs.set_session()
        client = await self.fs.get_s3(self.bucket)
        fn = getattr(client, method)
        kwargs.setdefault("Key", self.key)
        kwargs = self.fs._get_s3_method_kwargs(fn, Bucket=self.bucket, **kwargs)
        return await fn(**kwargs)

    def run(self, fn: Callable[..., T], *args: Any) -> Awaitable[T]:
        return asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def head(self) -> Head | None:
        try:
            resp = await self.call("head_object")
        except bex.ClientError as exc:
            if error_code(exc) in _NOT_FOUND:
                return None
            raise
        return Head(int(resp["ContentLength"]), clean_etag(resp.get("ETag")), _md5_etag(resp))

    # -- upload ------------------------------------------------------------------------------

    async def already_uploaded(self, fd: int, size: int, part_size: int) -> str | None:
        """The object's ETag if it holds exactly the local file's bytes, else None."""
        head = await self.head()
        if head is None or head.size != size or not head.md5_etag:
            return None
        plan = plan_for_etag(size, head.etag, part_size)
        if plan is None:
            return None
        md5s = await gather_all([self.run(md5_range, fd, p.offset, p.length) for p in plan.parts])
        return head.etag if etag_of(plan, md5s) == head.etag else None

    async def abort_stale(self) -> int:
        """Abort every unfinished multipart upload of this key; return how many."""
        kwargs: dict[str, Any] = {"Prefix": self.key}
        aborted = 0
        while True:
            resp = await self.call("list_multipart_uploads", Key=None, **kwargs)
            for upload in resp.get("Uploads", []):
                if upload.get("Key") == self.key:
                    await self.abort(upload["UploadId"])
                    aborted += 1
            if not resp.get("IsTruncated"):
                return aborted
            kwargs.update(KeyMarker=resp["NextKeyMarker"], UploadIdMarker=resp["NextUploadIdMarker"])

    async def abort(self, upload_id: str) -> None:
        try:
            await self.call("abort_multipart_upload", UploadId=upload_id)
        except bex.ClientError as exc:
            if error_code(exc) != "NoSuchUpload":
                raise

    async def upload(self, fd: int, plan: PartPlan) -> str:
        """Upload the file by ``plan``; return the ETag S3 must now report for it."""
        if not plan.multipart:
            return await self.put_single(fd, plan.parts[0])
        upload_id = (await self.call("create_multipart_upload"))["UploadId"]
        try:
            md5s = await gather_all([self.put_part(fd, upload_id, p) for p in plan.parts])
            await self.complete(upload_id, [md5.hex() for md5 in md5s])
        except BaseException:
            await asyncio.shield(self._abort_quietly(upload_id))
            raise
        return etag_of(plan, md5s)

    async def put_single(self, fd: int, part: Part) -> str:
        try:
            return (await self.put_checked("put_object", fd, part, "the object")).hex()
        except VerifyFailed:
            await self.call("delete_object")
            raise

    async def put_part(self, fd: int, upload_id: str, part: Part) -> bytes:
        async with self.sem:
            return await self.put_checked(
                "upload_part", fd, part, f"part {part.number}", UploadId=upload_id, PartNumber=part.number
            )

    async def put_checked(self, method: str, fd: int, part: Part, what: str, **kwargs: Any) -> bytes:
        """Send ``part``, check the ETag S3 answers against its MD5 (computed meanwhile); resend if wrong."""
        md5_task = asyncio.ensure_future(self.run(md5_range, fd, part.offset, part.length))
        try:
            for attempt in range(1, self.max_attempts + 1):
                try:
                    resp = await self.call(method, Body=FileSlice(fd, part.offset, part.length), **kwargs)
                except bex.ClientError as exc:  # S3 saw a checksum mismatch: corrupted on the way
                    if error_code(exc) not in _DIGEST_ERRORS or attempt == self.max_attempts:
                        raise
                    continue
                md5, got = await md5_task, clean_etag(resp.get("ETag"))
                if not _md5_etag(resp) or got == md5.hex():
                    return md5
                log.warning("%s of s3://%s/%s arrived corrupt: sending it again", what, self.bucket, self.key)
            raise VerifyFailed(f"ETag of {what}", md5.hex(), got)
        finally:
            md5_task.cancel()

    async def complete(self, upload_id: str, etags: list[str]) -> None:
        parts = [{"PartNumber": i, "ETag": f'"{e}"'} for i, e in enumerate(etags, 1)]
        try:
            await self.call("complete_multipart_upload", UploadId=upload_id, MultipartUpload={"Parts": parts})
        except bex.ClientError as exc:
            # A retried complete whose first try succeeded (its answer was lost) finds no
            # upload any more; the HEAD check that follows tells whether the object is whole.
            if error_code(exc) != "NoSuchUpload":
                raise
            log.debug("complete_multipart_upload retried after success for s3://%s/%s", self.bucket, self.key)

    async def _abort_quietly(self, upload_id: str) -> None:
        try:
            await self.abort(upload_id)
        except Exception as exc:  # the next upload of this key aborts it
            log.warning(
                "could not abort a failed multipart upload (%s); the next upload will", type(exc).__name__
            )

    async def verify(self, size: int, expected_etag: str) -> str:
        """Check the uploaded object by HEAD; on mismatch delete it and raise VerifyFailed."""
        head = await self.head()
        if head is None:
            raise VerifyFailed("object", "an object", "none after the upload")
        problem = _mismatch(head, size, expected_etag)
        if problem:
            await self.call("delete_object")
            raise VerifyFailed(*problem)
        if not head.md5_etag:
            log.warning("s3://%s/%s has a KMS/SSE-C ETag (no MD5): size checked only", self.bucket, self.key)
        return head.etag

    # -- download ----------------------------------------------------------------------------

    async def download(self, fd: int, head: Head, part_size: int) -> None:
        """Fill ``fd`` with the object's bytes by parallel ranged GETs; raise VerifyFailed on mismatch."""
        remote = plan_for_etag(head.size, head.etag, part_size) if head.md5_etag else None
        hashed = remote is not None and remote.multipart
        ranges = _ranges(head.size, part_size, remote if hashed else None)
        md5s = await gather_all([self.get_range(fd, rng, head.etag, hashed) for rng in ranges])
        if remote is None:
            return
        if hashed:
            digests = [d for group in md5s for d in group]
        else:
            digests = [(await self.run(md5_range, fd, 0, head.size))]
        actual = etag_of(remote, digests)
        if actual != head.etag:
            raise VerifyFailed("ETag", head.etag, actual)

    async def get_range(self, fd: int, parts: list[Part], etag: str, hashed: bool) -> list[bytes]:
        """Download consecutive ``parts`` with one ranged GET (resumed after a failure); MD5 each if asked."""
        cursor = _Cursor(parts, hashed)
        failures = 0
        async with self.sem:
            while cursor.pos < cursor.end:
                try:
                    await self._stream(fd, cursor, etag)
                except TRANSIENT as exc:
                    failures += 1
                    if failures >= self.max_attempts:
                        raise
                    log.debug("s3://%s/%s at byte %d: %r, resuming", self.bucket, self.key, cursor.pos, exc)
                    await asyncio.sleep(backoff(failures))
        return [h.digest() for h in cursor.hashers]

    async def _stream(self, fd: int, cur: _Cursor, etag: str) -> None:
        resp = await self.call("get_object", Range=f"bytes={cur.pos}-{cur.end - 1}", IfMatch=f'"{etag}"')
        body = resp["Body"]
        try:
            while cur.pos < cur.end:
                chunk = await body.read(min(READ_CHUNK, cur.end - cur.pos))
                if not chunk:
                    raise bex.IncompleteReadError(actual_bytes=cur.pos, expected_bytes=cur.end)
                await self.run(write_hashed, fd, chunk, cur.pos, cur.parts, cur.hashers)
                cur.pos += len(chunk)
        finally:
            body.close()


class _Cursor:
    """Where a range download stands: the next byte to fetch, and the running MD5 of each part."""

    def __init__(self, parts: list[Part], hashed: bool) -> None:
        self.parts = parts
        self.pos = parts[0].offset
        self.end = parts[-1].offset + parts[-1].length
        self.hashers = [hashlib.md5() for _ in parts] if hashed else []


def plan_for_etag(size: int, etag: str, part_size: int) -> PartPlan | None:
    """The part plan an object of ``size`` bytes with this MD5 ``etag`` was uploaded by, if it can be told."""
    count = etag_parts(etag)
    if count == 0:
        return PartPlan(size, size, False, (Part(1, 0, size),))
    if count == 1:
        return PartPlan(size, size, True, (Part(1, 0, size),))
    p = guess_part_size(size, count, hints=(part_size,))
    return None if p is None else plan_parts(size, p)


def _ranges(size: int, part_size: int, remote: PartPlan | None) -> list[list[Part]]:
    """Download ranges of about ``part_size`` bytes; made of whole remote parts when those are hashed."""
    if remote is None:
        return [[p] for p in plan_parts(max(size, 1), part_size).parts] if size else []
    k = max(1, part_size // max(remote.part_size, MiB))
    return [list(remote.parts[i : i + k]) for i in range(0, len(remote.parts), k)]


def _md5_etag(resp: dict[str, Any]) -> bool:
    return resp.get("ServerSideEncryption") not in _KMS and not resp.get("SSECustomerAlgorithm")


def _mismatch(head: Head, size: int, etag: str) -> tuple[str, str, str] | None:
    if head.size != size:
        return ("size", str(size), str(head.size))
    if head.md5_etag and head.etag != etag:
        return ("ETag", etag, head.etag)
    return None


def backoff(failures: int) -> float:
    return min(0.1 * 2**failures, 5.0) * (0.5 + random.random() / 2)


async def gather_all(aws: list[Awaitable[T]] | list[Coroutine[Any, Any, T]]) -> list[T]:
    """Like asyncio.gather, but the first failure cancels the rest (and is raised after they stop)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    for t in tasks:
        if not t.cancelled() and t.exception() is not None:
            raise t.exception()  # type: ignore[misc]
    return [t.result() for t in tasks]


# -- blocking helpers, run in the thread pool ---------------------------------------------------


class FileSlice(io.RawIOBase):
    """A seekable, read-only view of ``length`` bytes of a file at ``offset``: a request body.

    botocore reads it to sign and checksum it, aiohttp to send it, and seeks
    back to 0 to retry; nothing holds the whole part in memory.
    """

    def __init__(self, fd: int, offset: int, length: int) -> None:
        super().__init__()
        self.fd, self.offset, self.length, self.pos = fd, offset, length, 0

    def __len__(self) -> int:
        return self.length

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = min(max(base + pos, 0), self.length)
        return self.pos

    def read(self, size: int | None = -1) -> bytes:
        want = self.length - self.pos if size is None or size < 0 else min(size, self.length - self.pos)
        data = os.pread(self.fd, want, self.offset + self.pos) if want > 0 else b""
        if len(data) < want and not data:
            raise EOFError(f"the file ended at byte {self.offset + self.pos} while it was being uploaded")
        self.pos += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


def md5_range(fd: int, offset: int, length: int) -> bytes:
    h = hashlib.md5()
    for pos in range(offset, offset + length, 8 * MiB):
        data = os.pread(fd, min(8 * MiB, offset + length - pos), pos)
        if not data:
            raise EOFError(f"the file ended at byte {pos} while it was being read")
        h.update(data)
    return h.digest()


def write_hashed(fd: int, data: bytes, pos: int, parts: list[Part], hashers: list) -> None:
    """pwrite ``data`` at ``pos``; feed each part's hasher the bytes that fall in that part."""
    view = memoryview(data)
    written = 0
    while written < len(view):
        written += os.pwrite(fd, view[written:], pos + written)
    for part, h in zip(parts, hashers, strict=False):  # no hashers: nothing to feed
        lo, hi = max(part.offset, pos), min(part.offset + part.length, pos + len(view))
        if lo < hi:
            h.update(view[lo - pos : hi - pos])
