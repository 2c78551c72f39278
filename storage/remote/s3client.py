"""The S3 client of the transfers: boto3 from s3fs-style options, a retry of corrupt bodies, errors.

:func:`client_for` builds (once per set of options, in a process) a boto3
client from the ``storage_options`` a store takes: keys, a profile or an
``assume_role`` (whose credentials refresh), ``anon``, the endpoint, ``client_kwargs`` and
``config_kwargs``, with the transfers' timeouts, attempts and pool size on top
(shaped by :func:`.options.client_arguments`).
botocore's blocking sockets bound every stall: a peer that stops reading,
answering or sending fails the attempt within the connect or read timeout.
:func:`translate_s3_errors` turns botocore's errors into one line naming the
object by a redacted URL, never holding credentials.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from collections.abc import Iterator
from typing import Any

import botocore.config
import botocore.exceptions as bex
from s3transfer.exceptions import RetriesExceededError

from ..errors import StorageUnavailableError
from ..files.location import redact, store_failure
from ..files.s3options import TransferOptions, client_arguments
from ..files.s3roles import boto3_session

log = logging.getLogger(__name__)

TRANSIENT = (
    bex.HTTPClientError,  # ReadTimeoutError, ConnectionClosedError, ResponseStreamingError, ...
    bex.ConnectionError,  # EndpointConnectionError, ConnectTimeoutError
    bex.IncompleteReadError,
    RetriesExceededError,  # a download range that failed every attempt
    ConnectionError,
    TimeoutError,
)
DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "Forbidden", "403"}
DIGEST_ERRORS = {"BadDigest", "InvalidDigest", "XAmzContentSHA256Mismatch", "XAmzContentChecksumMismatch"}


def client_for(storage_options: dict[str, Any] | None, **settings: Any) -> Any:
    """A boto3 S3 client from s3fs-style ``storage_options`` (key/secret/token, profile, anon,
    endpoint_url, client_kwargs, config_kwargs, assume_role) with ``settings`` (timeouts,
    retries, pool) on top.
    One per distinct set of options and settings in a process: boto3 clients are thread-safe and
    credentials from a profile or a role refresh themselves."""
    return _cached_client(json.dumps([storage_options or {}, settings], sort_keys=True, default=repr))


@functools.lru_cache(maxsize=8)
def _cached_client(frozen: str) -> Any:
    options, settings = json.loads(frozen)
    config, client_kwargs = client_arguments(options, TransferOptions(**settings))
    client = boto3_session(options).client("s3", config=botocore.config.Config(**config), **client_kwargs)
    attempts = settings["max_attempts"]
    for op in ("UploadPart", "PutObject"):
        client.meta.events.register_first(
            f"needs-retry.s3.{op}", functools.partial(_resend_corrupt, max_attempts=attempts)
        )
    return client


def _resend_corrupt(response: Any, attempts: int, max_attempts: int, **_: Any) -> float | None:
    """botocore retry hook: a body the server refused for its checksum is sent again."""
    code = (response[1].get("Error") or {}).get("Code") if response else None
    if code in DIGEST_ERRORS and attempts < max_attempts:
        log.warning("a part arrived corrupt (%s): sending it again", code)
        return 0.05 * attempts
    return None


def forget_clients() -> None:
    """Drop the cached clients, and with them their pooled connections."""
    _cached_client.cache_clear()


def error_code(exc: BaseException) -> str:
    return str(exc.response.get("Error", {}).get("Code", "")) if isinstance(exc, bex.ClientError) else ""


@contextlib.contextmanager
def translate_s3_errors(
    url: str, storage_options: dict[str, Any] | None, action: str, attempts: int
) -> Iterator[None]:
    """Turn botocore errors into :class:`StorageUnavailableError` naming ``url`` redacted and the
    endpoint the options name: the store's messages (:func:`store_failure`), and for a network
    failure the attempts made."""
    display_url = redact(url)
    endpoint = ((storage_options or {}).get("client_kwargs") or {}).get("endpoint_url")
    endpoint = redact(endpoint or (storage_options or {}).get("endpoint_url") or "") or None
    try:
        yield
    except TRANSIENT as exc:
        raise StorageUnavailableError(
            f"cannot reach S3 while {action} {display_url} after {attempts} attempts "
            f"({type(exc).__name__}); the transfer can be re-run: finished work is kept"
        ) from exc
    except (bex.ClientError, bex.BotoCoreError) as exc:  # refused, no or partial credentials, ...
        error = store_failure(display_url, endpoint, action, exc)
        if error is None and not isinstance(exc, bex.ClientError):
            raise
        code = error_code(exc) or type(exc).__name__
        raise error or StorageUnavailableError(f"S3 refused {action} {display_url}: {code}") from exc
