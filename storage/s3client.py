"""How ckptflow talks to S3: client timeouts, retries, a stall guard, and error translation.

Retries happen at two levels. This module configures the first: every S3
request (through s3fs's aiobotocore client) gets a connect timeout, a read
timeout and botocore's "standard" retry mode with ``max_attempts`` tries, so a
dropped, reset or stalled connection costs one bounded attempt, not a hang.
The second level is the caller's (a Prefect task's retries).

aiohttp applies its read timeout only once a request body has been sent: it
waits for "100 Continue" and for the peer to drain the body without any time
limit, so an upload to a peer that stopped reading would hang forever.
:class:`StallGuardSession` closes that gap: a request whose body makes no
progress for ``read_timeout`` fails with botocore's ``ReadTimeoutError``, which
botocore retries like any other timeout.

Credentials come the usual AWS ways (environment, profile, or ``key``/``secret``
in ``storage_options``). They are never logged, and every message this module
builds names the object by a redacted URL only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import aiohttp
import botocore.exceptions as bex
from aiobotocore.httpsession import AIOHTTPSession

from .errors import StorageUnavailableError

T = TypeVar("T")
BODY_CHUNK = 1 << 20  # request bodies are sent in pieces of this size, so progress can be watched
DEFAULT_POOL = 10  # botocore's default number of pooled connections

# Errors of one request attempt that another attempt may not repeat.
TRANSIENT = (
    bex.HTTPClientError,  # ReadTimeoutError, ConnectionClosedError, ResponseStreamingError, ...
    bex.ConnectionError,  # EndpointConnectionError, ConnectTimeoutError
    bex.IncompleteReadError,
    aiohttp.ClientError,
    asyncio.TimeoutError,
    ConnectionError,
)
_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "Forbidden", "403"}
_MISSING_BUCKET = {"NoSuchBucket"}


def merge_storage_options(
    storage_options: dict[str, Any] | None,
    *,
    connect_timeout: float,
    read_timeout: float,
    max_attempts: int,
    concurrency: int,
) -> dict[str, Any]:
    """``storage_options`` for s3fs with timeouts, retries and the stall guard set.

    The user's other ``config_kwargs`` (their retry ``mode``, ``s3`` settings, an
    ``http_session_cls`` of their own) are kept; the timeouts and the attempt
    count given here win. Merging twice is harmless.
    """
    merged = dict(storage_options or {})
    config = dict(merged.get("config_kwargs") or {})
    retries = dict(config.get("retries") or {})
    retries.pop("max_attempts", None)  # in botocore's client config that counts retries, not attempts
    retries["total_max_attempts"] = max_attempts
    retries.setdefault("mode", "standard")
    s3 = dict(config.get("s3") or {})
    # On https botocore signs no payload anyway (the checksum header protects it); on plain-http
    # endpoints it would SHA-256 every body on the event loop. The ETag checks cover the bytes.
    s3.setdefault("payload_signing_enabled", False)
    config.update(
        s3=s3,
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        retries=retries,
        max_pool_connections=max(int(config.get("max_pool_connections") or DEFAULT_POOL), concurrency),
    )
    config.setdefault("http_session_cls", StallGuardSession)  # a session class of the user's own wins
    merged["config_kwargs"] = config
    return merged


class StallGuardSession(AIOHTTPSession):
    """aiobotocore's aiohttp session, failing a request whose body stops moving for ``read_timeout``."""

    async def send(self, request):
        limit = self._timeout.sock_read
        body = request.body
        if not limit or not _watchable(body):
            return await super().send(request)
        watch = _BodyWatch(body, grace=self._timeout.sock_connect or 0.0)
        request.body = watch.chunks()
        try:
            return await watch.guard(super().send(request), limit, request.url)
        finally:
            request.body = body


def _watchable(body: Any) -> bool:
    if isinstance(body, (bytes, bytearray)):
        return len(body) > 0
    read = getattr(body, "read", None)
    return read is not None and not asyncio.iscoroutinefunction(read)


class _BodyWatch:
    """Feeds a request body to aiohttp in pieces and notes when each piece is taken."""

    def __init__(self, body: Any, *, grace: float) -> None:
        self.body = body
        self.last = time.monotonic() + grace  # the connection may take up to the connect timeout
        self.done = False

    async def chunks(self) -> AsyncIterator[bytes]:
        if isinstance(self.body, (bytes, bytearray)):
            view = memoryview(self.body)
            pieces: Iterator[Any] = (view[i : i + BODY_CHUNK] for i in range(0, len(view), BODY_CHUNK))
        else:
            pieces = iter(lambda: self.body.read(BODY_CHUNK), b"")
        for piece in pieces:
            self.last = time.monotonic()
            yield piece
        self.done = True  # aiohttp asked for more after the last piece was drained

    async def guard(self, send: Awaitable[T], limit: float, url: str) -> T:
        task = asyncio.ensure_future(send)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=min(limit, 1.0) / 4)
                if done:
                    return task.result()
                if not self.done and time.monotonic() - self.last > limit:
                    raise bex.ReadTimeoutError(endpoint_url=url, error=f"request body stalled for {limit:g}s")
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)


def error_code(exc: BaseException) -> str:
    if isinstance(exc, bex.ClientError):
        return str(exc.response.get("Error", {}).get("Code", ""))
    return ""


@contextmanager
def translate_s3_errors(display_url: str, action: str, attempts: int) -> Iterator[None]:
    """Turn botocore errors into :class:`StorageUnavailableError` naming ``display_url`` (no credentials)."""
    try:
        yield
    except bex.ClientError as exc:
        code = error_code(exc)
        if code in _MISSING_BUCKET:
            raise StorageUnavailableError(
                f"the bucket of {display_url} does not exist (or is not visible with these credentials): "
                "create it first"
            ) from None
        if code in _DENIED:
            raise StorageUnavailableError(
                f"permission denied while {action} {display_url} ({code}): check the credentials "
                "(environment, profile or storage_options) and the bucket policy"
            ) from None
        raise StorageUnavailableError(
            f"S3 refused {action} {display_url}: {code or type(exc).__name__}"
        ) from exc
    except bex.NoCredentialsError:
        raise StorageUnavailableError(
            f"no AWS credentials found for {display_url}: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
            "a profile, or key/secret in storage_options"
        ) from None
    except TRANSIENT as exc:
        raise StorageUnavailableError(
            f"cannot reach S3 while {action} {display_url} after {attempts} attempts "
            f"({type(exc).__name__}); the transfer can be re-run: finished work is kept"
        ) from exc
