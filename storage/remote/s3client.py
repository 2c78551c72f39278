"""How ckptflow talks to S3: client timeouts, retries, a stall guard, and error translation.

Retries happen at two levels. This module configures the first: every S3
request (through s3fs's aiobotocore client) gets a connect timeout, a read
timeout and botocore's "standard" retry mode with ``max_attempts`` tries, so a
dropped, reset or stalled connection costs one bounded attempt, not a hang.
The second level is the caller's (a Prefect task's retries).

aiohttp's read timeout has two gaps. It starts only once a request body has
been sent: aiohttp waits for "100 Continue" and for the peer to drain the body
without any time limit. And every bodiless message it reads stops it, interim
ones too: a "100 Continue" that arrives after the body (moto's server sends
two) leaves the wait for the real answer with no limit at all. Either way a
request to a peer that went silent would hang until the peer gave up.
:class:`StallGuardSession` closes both: until its response headers arrive, a
request that makes no progress for ``read_timeout`` (no connection, no body
piece taken, no answer once the body is out) fails with botocore's
``ReadTimeoutError``, which botocore retries like any other timeout. Once the
headers are in, aiohttp's read timeout bounds the response body: it runs
while the body streams and stops only at its end.

Credentials come the usual AWS ways (environment, profile, or ``key``/``secret``
in ``storage_options``). They are never logged, and every message this module
builds names the object by a redacted URL only.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

import aiohttp
import botocore.exceptions as bex
from aiobotocore.httpsession import AIOHTTPSession

from ..errors import StorageUnavailableError

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
    # endpoints it would SHA-256 every body on the event loop. The CRC32 checks (or, without
    # them, the ETag's MD5s) cover the bytes; to sign them anyway, set config_kwargs
    # {"s3": {"payload_signing_enabled": True}}.
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
    """aiobotocore's aiohttp session, failing a request that stops moving for ``read_timeout``.

    It watches every request until its response headers arrive (aiohttp's own
    read timeout, once running, bounds the response body): the body piece by
    piece, then the wait for the answer.
    """

    async def _get_session(self, proxy_url):
        session = await super()._get_session(proxy_url)
        if _TRACE not in session.trace_configs:  # the live list: aiohttp reads it for each request
            session.trace_configs.append(_TRACE)
        return session

    async def send(self, request):
        limit = self._timeout.sock_read
        body = request.body
        if not limit or (body and not _watchable(body)):
            return await super().send(request)
        watch = _Watch(grace=self._timeout.sock_connect or 0.0, has_body=bool(body))
        if body:
            request.body = watch.chunks(body)
        try:
            return await watch.guard(super().send(request), limit, request.url)
        finally:
            request.body = body


def _watchable(body: Any) -> bool:
    if isinstance(body, (bytes, bytearray)):
        return True
    read = getattr(body, "read", None)
    return read is not None and not asyncio.iscoroutinefunction(read)


class _Watch:
    """One request's progress until its response headers arrive: the stall guard's clock.

    States: ``connecting`` (a connection is due within the connect timeout, plus
    ``limit``), ``queued`` (waiting for a free pooled connection: no clock, the
    requests ahead are bounded themselves), ``sending`` (each body piece aiohttp
    takes restarts the clock), ``waiting`` (the whole body is out: the answer is
    due within ``limit``), ``answered`` (the response headers are in; the guard
    is done). aiohttp's signals (see ``_TRACE``) move it along.
    """

    LIMITS = {"connecting": "no connection", "sending": "the request stalled", "waiting": "no answer"}

    def __init__(self, *, grace: float, has_body: bool) -> None:
        self.grace, self.has_body = grace, has_body
        self.state = "connecting"
        self.last = time.monotonic() + grace

    def queued(self) -> None:
        self.state = "queued"

    def dequeued(self) -> None:
        self.state, self.last = "connecting", time.monotonic() + self.grace

    def connected(self) -> None:
        self.state, self.last = ("sending" if self.has_body else "waiting"), time.monotonic()

    def answered(self) -> None:
        self.state = "answered"

    def stalled(self, limit: float) -> bool:
        return self.state in self.LIMITS and time.monotonic() - self.last > limit

    async def chunks(self, body: Any) -> AsyncIterator[bytes]:
        """``body`` in pieces, noting when aiohttp takes each one and when it asks past the last."""
        if isinstance(body, (bytes, bytearray)):
            view = memoryview(body)
            pieces: Iterator[Any] = (view[i : i + BODY_CHUNK] for i in range(0, len(view), BODY_CHUNK))
        else:
            pieces = iter(lambda: body.read(BODY_CHUNK), b"")
        for piece in pieces:
            self.last = time.monotonic()
            yield piece
        if self.state == "sending":  # aiohttp drained the last piece: now the answer is due
            self.state, self.last = "waiting", time.monotonic()

    async def guard(self, send: Awaitable[T], limit: float, url: str) -> T:
        token = _WATCH.set(self)  # the task below copies the context: aiohttp's signals find this watch
        try:
            task = asyncio.ensure_future(send)
        finally:
            _WATCH.reset(token)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=min(limit, 1.0) / 4)
                if done:
                    return task.result()
                if self.stalled(limit):
                    raise bex.ReadTimeoutError(
                        endpoint_url=url, error=f"{self.LIMITS[self.state]} for {limit:g}s"
                    )
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)


_WATCH: ContextVar[_Watch | None] = ContextVar("ckptflow_s3_watch", default=None)


def _on(step: Callable[[_Watch], None]) -> Callable[..., Awaitable[None]]:
    async def signal(session: Any, context: Any, params: Any) -> None:
        watch = _WATCH.get()
        if watch is not None:
            step(watch)

    return signal


def _trace_config() -> aiohttp.TraceConfig:
    """aiohttp's request signals, forwarded to the :class:`_Watch` of the request they belong to."""
    trace = aiohttp.TraceConfig()
    trace.on_connection_queued_start.append(_on(_Watch.queued))
    trace.on_connection_queued_end.append(_on(_Watch.dequeued))
    trace.on_connection_create_end.append(_on(_Watch.connected))
    trace.on_connection_reuseconn.append(_on(_Watch.connected))
    trace.on_request_end.append(_on(_Watch.answered))  # the final answer's headers, not a 1xx's
    trace.freeze()
    return trace


_TRACE = _trace_config()


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
