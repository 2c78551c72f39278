"""Parallel multipart uploads and ranged downloads on S3, verified by CRC32 (MD5 where S3 has none).

Runs on s3fs's event loop with s3fs's aiobotocore client (so the store and the
transfers share credentials, endpoint and connection settings); at most
``concurrency`` parts are in flight; local file I/O and CRC32s run in a small
thread pool beside the loop, MD5s in an even smaller one (both release the GIL).

How an upload is verified, end to end and without MD5s (~1.3 CPU-s per GiB):
every part is sent with its CRC32 (zlib, ~6 GB/s), which S3 checks on arrival
(a part corrupted on the way is refused and sent again); then one HEAD with
``ChecksumMode=ENABLED`` must show the file's size and the CRC32 computed
locally from the part CRC32s (see :mod:`.etag`), which S3 derives from the
parts it kept. A server without flexible checksums (no CRC32 in the HEAD) gets
the older test: each part's ETag and the object's against MD5s of the file,
computed then; SSE-KMS/SSE-C ETags are no MD5s, so such an object without a
CRC32 is checked by size only (with a warning).

What must always hold:

- An upload is done only when that HEAD matches; an existing object counts as
  uploaded only under the same test, with the part plan told from its ETag's
  ``-N`` (so an object of the right size with other bytes is uploaded again).
  An unfinished multipart upload is not an object: it is aborted before a new
  upload of the key.
- A verification failure deletes the object, so nothing unverified stays.
- A download is written to a temporary file and renamed only after its size
  and its CRC32 match (from a server without CRC32s: the MD5s behind its ETag),
  hashed per part as the bytes stream in. A multipart object whose part size
  cannot be told from its size and part count is checked by size only.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import botocore.exceptions as bex

from .download_checks import CRC32, Check, Cursor, Head, checker
from .etag import (
    Part,
    PartPlan,
    clean_etag,
    crc32_of,
    download_ranges,
    etag_of,
    plan_for_etag,
    plan_parts,
    same_checksum,
)
from .file_ranges import FileSlice, crc32_range, md5_range, write_hashed
from .s3client import TRANSIENT, error_code

log = logging.getLogger(__name__)
T = TypeVar("T")
READ_CHUNK = 1 << 20  # bytes per read of a response body
# MD5 (downloads; uploads only on servers without CRC32s) runs at ~0.8 GB/s per core. Threads for
# it are capped at a quarter of the cores, so that hashing never crowds out the transfer itself
# (nor, on a training node, the training).
HASH_THREADS = max(1, (os.cpu_count() or 1) // 4)
_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
_KMS = {"aws:kms", "aws:kms:dsse"}
_DIGEST_ERRORS = {"BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch", "XAmzContentChecksumMismatch"}
# A HEAD asking for the checksums of an SSE-KMS object needs kms:Decrypt, which a single-PUT
# uploader may lack: refused, it asks again without them (and falls back to the ETag test).
_DENIED = {"403", "AccessDenied", "Forbidden"}


class VerifyFailed(Exception):
    """Internal: the remote bytes are not the expected ones (what, expected, actual)."""


@dataclass(frozen=True)
class Sent:
    """A part as S3 took it (after checking its CRC32, when S3 has flexible checksums)."""

    what: str  # "part 3", "the object"
    etag: str
    crc: str  # base64, as sent
    md5_etag: bool  # False: the ETag is no MD5 (KMS/SSE-C), there is nothing to compare


class S3Transfer:
    """One object (bucket, key) and the means to move it: the client, a semaphore, a thread pool."""

    def __init__(self, fs: Any, bucket: str, key: str, *, concurrency: int, max_attempts: int) -> None:
        self.fs, self.bucket, self.key = fs, bucket, key
        self.max_attempts = max_attempts
        self.sem = asyncio.Semaphore(concurrency)
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="ckptflow-xfer")
        self.hash_pool = ThreadPoolExecutor(max_workers=HASH_THREADS, thread_name_prefix="ckptflow-md5")

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.hash_pool.shutdown(wait=True)

    async def call(self, method: str, **kwargs: Any) -> Any:
        """One S3 request about this key through s3fs's client, with s3fs's extra kwargs (SSE, ...).

        Only botocore retries it (s3fs's own ``_call_s3`` would retry again on top).
        """
        await self.fs.set_session()
        client = await self.fs.get_s3(self.bucket)
        fn = getattr(client, method)
        kwargs.setdefault("Key", self.key)
        extra = getattr(self.fs, "_get_s3_method_kwargs", None)  # adds and filters s3_additional_kwargs
        if extra is not None:
            kwargs = extra(fn, Bucket=self.bucket, **kwargs)
        else:
            kwargs = {"Bucket": self.bucket, **{k: v for k, v in kwargs.items() if v is not None}}
        return await fn(**kwargs)

    def run(self, fn: Callable[..., T], *args: Any) -> Awaitable[T]:
        """Blocking file I/O, off the event loop."""
        return asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def hash(self, fn: Callable[..., T], *args: Any) -> Awaitable[T]:
        """MD5 work, on at most HASH_THREADS threads."""
        return asyncio.get_running_loop().run_in_executor(self.hash_pool, fn, *args)

    async def head(self, *, checksums: bool = False) -> Head | None:
        """The object's size, ETag and (if ``checksums``) CRC32; None if there is no object."""
        try:
            resp = await self.call("head_object", **({"ChecksumMode": "ENABLED"} if checksums else {}))
        except bex.ClientError as exc:
            if error_code(exc) in _NOT_FOUND:
                return None
            if checksums and error_code(exc) in _DENIED:
                log.debug("s3://%s/%s: checksums refused, HEAD without them", self.bucket, self.key)
                return await self.head()
            raise
        crc = resp.get("ChecksumCRC32") or None
        full = resp.get("ChecksumType") == "FULL_OBJECT"
        return Head(int(resp["ContentLength"]), clean_etag(resp.get("ETag")), _md5_etag(resp), crc, full)

    # -- upload ------------------------------------------------------------------------------

    async def already_uploaded(self, fd: int, size: int, part_size: int) -> str | None:
        """The object's ETag if it holds exactly the local file's bytes (by CRC32, else MD5s), else None."""
        head = await self.head(checksums=True)
        if head is None or head.size != size:
            return None
        plan = plan_for_etag(size, head.etag, part_size)
        if plan is None:
            return None
        if head.crc is not None:
            return head.etag if same_checksum(head.crc, await self.local_crc(fd, plan, head)) else None
        if not head.md5_etag:
            return None
        log.debug("s3://%s/%s has no CRC32: comparing its ETag with MD5s", self.bucket, self.key)
        return head.etag if etag_of(plan, await self.md5s(fd, plan)) == head.etag else None

    async def local_crc(self, fd: int, plan: PartPlan, head: Head, crcs: list[str] | None = None) -> str:
        """The CRC32 ``head`` must show if the object holds the file's bytes, uploaded by ``plan``."""
        if head.full_object and plan.multipart:  # another uploader's choice: a CRC32 of the whole
            return await self.run(crc32_range, fd, 0, plan.size)
        if crcs is None:
            crcs = await gather_all([self.run(crc32_range, fd, p.offset, p.length) for p in plan.parts])
        return crc32_of(plan, crcs)

    async def md5s(self, fd: int, plan: PartPlan) -> list[bytes]:
        return await gather_all([self.hash(md5_range, fd, p.offset, p.length) for p in plan.parts])

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

    async def upload(self, fd: int, plan: PartPlan) -> list[Sent]:
        """Upload the file by ``plan``; return its parts as S3 took them (for :meth:`verify`)."""
        if not plan.multipart:
            return [await self.put_checked("put_object", fd, plan.parts[0], "the object")]
        upload_id = (await self.call("create_multipart_upload", ChecksumAlgorithm="CRC32"))["UploadId"]
        try:
            sent = await gather_all([self.put_part(fd, upload_id, p) for p in plan.parts])
            await self.complete(upload_id, [(s.etag, s.crc) for s in sent])
        except BaseException:
            await asyncio.shield(self._abort_quietly(upload_id))
            raise
        return sent

    async def put_part(self, fd: int, upload_id: str, part: Part) -> Sent:
        async with self.sem:
            return await self.put_checked(
                "upload_part", fd, part, f"part {part.number}", UploadId=upload_id, PartNumber=part.number
            )

    async def put_checked(self, method: str, fd: int, part: Part, what: str, **kwargs: Any) -> Sent:
        """Send ``part`` with its CRC32; S3 checks it on arrival and refuses a part corrupted on the
        way, which is then sent again (up to ``max_attempts`` times)."""
        # Computed here, in a thread, the CRC32 spares botocore a pass over the body on the
        # event loop, which would hold up every other part meanwhile.
        crc = await self.run(crc32_range, fd, part.offset, part.length)
        attempt = 1
        while True:
            body = FileSlice(fd, part.offset, part.length)
            try:
                resp = await self.call(
                    method, Body=body, ChecksumAlgorithm="CRC32", ChecksumCRC32=crc, **kwargs
                )
            except bex.ClientError as exc:  # S3 saw a checksum mismatch: corrupted on the way
                if error_code(exc) not in _DIGEST_ERRORS or attempt >= self.max_attempts:
                    raise
                attempt += 1
                log.warning("%s of s3://%s/%s arrived corrupt: sending it again", what, self.bucket, self.key)
                continue
            return Sent(what, clean_etag(resp.get("ETag")), crc, _md5_etag(resp))

    async def complete(self, upload_id: str, sent: list[tuple[str, str]]) -> None:
        """Complete the upload from each part's (ETag, CRC32)."""
        parts = [{"PartNumber": i, "ETag": f'"{e}"', "ChecksumCRC32": c} for i, (e, c) in enumerate(sent, 1)]
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

    async def verify(self, fd: int, plan: PartPlan, sent: list[Sent]) -> str:
        """Check the uploaded object by one HEAD: size and CRC32 (without a CRC32: ETags by MD5s).

        On a mismatch delete the object and raise VerifyFailed; return the object's ETag.
        """
        head = await self.head(checksums=True)
        if head is None:
            raise VerifyFailed("object", "an object", "none after the upload")
        if head.size != plan.size:
            problem: tuple[str, str, str] | None = ("size", str(plan.size), str(head.size))
        elif head.crc is not None:
            expected = await self.local_crc(fd, plan, head, [s.crc for s in sent])
            problem = None if same_checksum(head.crc, expected) else ("CRC32", expected, head.crc)
        else:
            problem = await self.md5_mismatch(fd, plan, sent, head)
        if problem:
            await self.call("delete_object")
            raise VerifyFailed(*problem)
        return head.etag

    async def md5_mismatch(
        self, fd: int, plan: PartPlan, sent: list[Sent], head: Head
    ) -> tuple[str, str, str] | None:
        """The check for servers without flexible checksums: every ETag against MD5s of the file."""
        if not head.md5_etag:
            log.warning(
                "s3://%s/%s has no CRC32 and a KMS/SSE-C ETag (no MD5): size checked only",
                self.bucket,
                self.key,
            )
            return None
        log.debug("s3://%s/%s has no CRC32: checking its ETags by MD5s", self.bucket, self.key)
        md5s = await self.md5s(fd, plan)
        for part, md5 in zip(sent, md5s, strict=True):
            if part.md5_etag and md5.hex() != part.etag:
                return (f"ETag of {part.what}", md5.hex(), part.etag)
        expected = etag_of(plan, md5s)
        return None if expected == head.etag else ("ETag", expected, head.etag)

    # -- download ----------------------------------------------------------------------------

    async def download(self, fd: int, head: Head, range_size: int, *, verify: bool = True) -> None:
        """Fill ``fd`` with the object's bytes by parallel ranged GETs; raise VerifyFailed on mismatch.

        With ``verify``, the bytes are checked against the object's CRC32 when the HEAD had one
        (zlib, ~6 GB/s), else against the MD5s behind its ETag (~0.8 GB/s); both per upload part,
        as the bytes stream in, when the object is multipart and its part plan can be told.
        """
        check = checker(head) if verify else None
        remote = plan_for_etag(head.size, head.etag, range_size) if check is not None else None
        if check is CRC32 and (head.full_object or (remote is not None and not remote.multipart)):
            remote = plan_parts(head.size, head.size)  # one part: one CRC32 of it all
        # Parts are hashed as the bytes stream in, unless one part spans several ranges: then afterwards.
        hashed = remote is not None and (len(remote.parts) > 1 or head.size <= range_size)
        ranges = download_ranges(head.size, range_size, remote if hashed else None)
        streamed = check if hashed else None
        by_range = await gather_all([self.get_range(fd, rng, head.etag, streamed) for rng in ranges])
        if check is None or remote is None:
            return
        if hashed:
            digests = [d for group in by_range for d in group]
        else:
            digests = [await check.whole(self, fd, head.size)]
        expected, actual = check.expected(head), check.combine(remote, digests)
        if not check.same(expected, actual):
            raise VerifyFailed(check.name, expected, actual)

    async def get_range(self, fd: int, parts: list[Part], etag: str, check: Check | None) -> list[bytes]:
        """Download consecutive ``parts`` by one ranged GET (resumed after a failure); hash each if asked."""
        cursor = Cursor(parts, check)
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

    async def _stream(self, fd: int, cur: Cursor, etag: str) -> None:
        resp = await self.call("get_object", Range=f"bytes={cur.pos}-{cur.end - 1}", IfMatch=f'"{etag}"')
        body = resp["Body"]
        run = cur.check.runner(self) if cur.check is not None else self.run
        try:
            while cur.pos < cur.end:
                chunk = await body.read(min(READ_CHUNK, cur.end - cur.pos))
                if not chunk:
                    raise bex.IncompleteReadError(actual_bytes=cur.pos, expected_bytes=cur.end)
                await run(write_hashed, fd, chunk, cur.pos, cur.parts, cur.hashers)
                cur.pos += len(chunk)
        finally:
            body.close()


def _md5_etag(resp: dict[str, Any]) -> bool:
    return resp.get("ServerSideEncryption") not in _KMS and not resp.get("SSECustomerAlgorithm")


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
