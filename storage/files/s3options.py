"""S3 client options: the one place their timeouts, attempts and pool sizes are decided.

A store (s3fs, through :func:`bounded_s3_options`), a transfer (boto3, through
:func:`client_arguments`) and a mirror's uploads (:func:`upload_storage_options`)
all take the same s3fs-style ``storage_options`` and talk to S3 with clients
shaped here, from one set of defaults:

- every S3 call is bounded: a connect timeout, a read timeout and a number of
  attempts, so an endpoint that accepts connections and never answers fails a call
  in bounded time instead of hanging (botocore's own defaults, 60 s and retries on
  top of s3fs's, let it hang for minutes);
- what the user set in ``config_kwargs`` wins over every default here;
- :class:`TransferOptions` (big files through boto3's transfer engine) default to the
  store's timeouts, with more attempts per request and a pool as wide as their
  parallel parts.

This module imports neither botocore nor s3fs at import time: a store on a local
disk opens through ``files/location.py``, which uses it, without loading them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

MiB = 1 << 20
MIN_PART = 5 * MiB  # S3's smallest part (except the last)
MAX_PART = 5 << 30  # S3's largest part, and largest single PUT


S3_SCHEMES = ("s3", "s3a")

S3_CONNECT_TIMEOUT = 10.0  # seconds to open a connection to an S3 endpoint
S3_READ_TIMEOUT = 30.0  # seconds a request may wait for bytes before it fails
S3_ATTEMPTS = 2  # botocore's attempts per request of a store (standard retry mode)
S3FS_RETRIES = 2  # s3fs retries a timed-out request this many times in all (its default is 5)
QUICK_CONNECT_TIMEOUT = 5.0  # a command that must answer within seconds
QUICK_ATTEMPTS = 3
POOL_CONNECTIONS = 10  # botocore's default connection pool, per client


def is_s3_url(url: str) -> bool:
    return urlsplit(url).scheme in S3_SCHEMES


@dataclass(frozen=True)
class TransferOptions:
    """How to move bytes: part size, parallelism, and the S3 client's timeouts and retries."""

    # boto3's defaults: 8 MiB parts, 10 at once (grown to stay within S3's 10,000 parts).
    part_size: int = 8 * MiB  # bytes per multipart upload part (files up to this size: one PUT)
    range_size: int = 8 * MiB  # bytes per ranged GET of a download
    concurrency: int = POOL_CONNECTIONS  # parts or ranges in flight
    connect_timeout: float = S3_CONNECT_TIMEOUT  # seconds to open a connection
    read_timeout: float = S3_READ_TIMEOUT  # seconds without a byte moving (either way) before a request fails
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

    def client_settings(self) -> dict[str, Any]:
        """The settings among these that shape the S3 client (the others are the transfer engine's)."""
        names = ("connect_timeout", "read_timeout", "max_attempts", "concurrency")
        return {name: getattr(self, name) for name in names}


def bounded_s3_options(
    url: str,
    storage_options: dict[str, Any] | None,
    *,
    connect_timeout: float = S3_CONNECT_TIMEOUT,
    read_timeout: float = S3_READ_TIMEOUT,
    attempts: int = S3_ATTEMPTS,
) -> dict[str, Any]:
    """``storage_options`` with connect and read timeouts and bounded attempts for an S3 URL.

    A silent endpoint (it accepts connections and never answers) then fails a call within
    about S3FS_RETRIES x attempts x read_timeout seconds instead of hanging; botocore's
    ``config_kwargs`` given in the options win.
    """
    options = dict(storage_options or {})
    if not is_s3_url(url):
        return options
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("connect_timeout", connect_timeout)
    config.setdefault("read_timeout", read_timeout)
    config.setdefault("retries", {"total_max_attempts": attempts, "mode": "standard"})
    # Bodies carry a CRC32 that the server checks (and shards their own checksums): a SHA-256 of
    # every body for the signature, botocore's default on http endpoints, would only cost CPU.
    config["s3"] = {"payload_signing_enabled": False, **(config.get("s3") or {})}
    options["config_kwargs"] = config
    return options


def quick_answer_options(url: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """:func:`bounded_s3_options` for a command that must answer within seconds: a 5 s connect
    timeout and 3 attempts (botocore's defaults, 60 s and five attempts, let a command on an
    unreachable endpoint hang for minutes); what the options set themselves wins."""
    return bounded_s3_options(
        url, storage_options, connect_timeout=QUICK_CONNECT_TIMEOUT, attempts=QUICK_ATTEMPTS
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
        max_pool_connections=max(
            int(config.get("max_pool_connections") or POOL_CONNECTIONS), options.concurrency
        ),
    )
    return merged


def upload_storage_options(url: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """fsspec options for uploads to ``url``: on S3 with the transfers' timeouts and bounded attempts
    (those set in ``config_kwargs`` win), so a silent target fails an upload in bounded time."""
    options = dict(storage_options or {})
    if not is_s3_url(url):
        return options
    return s3_storage_options(options, TransferOptions().honouring(options))


def client_arguments(
    storage_options: dict[str, Any], options: TransferOptions
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(botocore ``Config`` arguments, ``client()`` keyword arguments) of a boto3 S3 client for
    s3fs-style ``storage_options`` (``config_kwargs``, ``client_kwargs``, ``endpoint_url``,
    ``use_ssl``, ``anon``) with ``options``' timeouts, attempts and pool size on top."""
    import botocore
    import botocore.config

    merged = s3_storage_options(storage_options, options)["config_kwargs"]
    config = {k: v for k, v in merged.items() if k in botocore.config.Config.OPTION_DEFAULTS}
    if storage_options.get("anon"):
        config["signature_version"] = botocore.UNSIGNED
    client_kwargs = dict(storage_options.get("client_kwargs") or {})
    if "endpoint_url" in storage_options:
        client_kwargs.setdefault("endpoint_url", storage_options["endpoint_url"])
    if storage_options.get("use_ssl") is False:
        client_kwargs.setdefault("use_ssl", False)
    return config, client_kwargs


__all__ = [
    "S3FS_RETRIES",
    "S3_ATTEMPTS",
    "S3_CONNECT_TIMEOUT",
    "S3_READ_TIMEOUT",
    "S3_SCHEMES",
    "TransferOptions",
    "bounded_s3_options",
    "client_arguments",
    "is_s3_url",
    "quick_answer_options",
    "s3_storage_options",
    "upload_storage_options",
]
