"""Verified, resumable transfers: upload_file / download_file on S3 (moto, behind a fault proxy) and fsspec.

S3 tests talk to the moto server through :class:`tests.faultproxy.FaultProxy`,
which drops, resets, stalls or corrupts connections; the bytes are then read
back straight from moto (no proxy) and compared with the source.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
import traceback
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import botocore.exceptions as bex
import fsspec
import pytest
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

from ckptflow.storage import StorageUnavailableError
from ckptflow.storage.files.s3options import s3_storage_options
from ckptflow.storage.remote import s3 as s3_module
from ckptflow.storage.remote import s3client
from ckptflow.storage.remote import transfer as transfer_module
from ckptflow.storage.remote.etag import (
    MAX_PARTS,
    MiB,
    crc32_of,
    etag_of,
    guess_part_size,
    plan_for_etag,
    plan_parts,
    same_checksum,
)
from ckptflow.storage.remote.transfer import (
    TransferOptions,
    TransferVerifyError,
    download_file,
    upload_file,
)
from tests.conftest import S3_KEY, S3_SECRET
from tests.faultproxy import FaultProxy, fault_proxy, moto_fault_proxy  # noqa: F401  (fixtures)

PART = 5 * MiB  # S3's smallest part: keeps multipart tests small
FAST = TransferOptions(part_size=PART, concurrency=4, connect_timeout=2, read_timeout=2, max_attempts=6)
# For tests that count requests: under a loaded machine a 2 s read timeout can expire and retry one.
CALM = dataclasses.replace(FAST, connect_timeout=10, read_timeout=30)


def payload(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def local_etag(data: bytes, part_size: int = PART) -> str:
    plan = plan_parts(len(data), part_size)
    return etag_of(plan, [hashlib.md5(data[p.offset : p.offset + p.length]).digest() for p in plan.parts])


def crc_b64(data: bytes) -> str:
    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()


def local_crc(data: bytes, part_size: int = PART) -> str:
    """The object's CRC32 as computed independently: composite ``<b64>-N`` for multipart."""
    plan = plan_parts(len(data), part_size)
    crcs = [zlib.crc32(data[p.offset : p.offset + p.length]).to_bytes(4, "big") for p in plan.parts]
    if not plan.multipart:
        return crc_b64(data)
    return f"{crc_b64(b''.join(crcs))}-{len(crcs)}"


def via(endpoint: str, storage_options: dict[str, Any]) -> dict[str, Any]:
    """The bucket's s3fs options, but through ``endpoint`` (the proxy)."""
    client_kwargs = {**storage_options["client_kwargs"], "endpoint_url": endpoint}
    return {**storage_options, "client_kwargs": client_kwargs}


def no_secret(*things: object) -> None:
    for thing in things:
        text = repr(thing) + str(thing)
        if isinstance(thing, BaseException):
            text += "".join(traceback.format_exception(thing))
        assert S3_SECRET not in text, f"the secret leaked into {type(thing).__name__}"


def raw_client(endpoint: str) -> Any:
    """A boto3 client straight to the server (no proxy), to look at what really is stored."""
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=S3_KEY,
        aws_secret_access_key=S3_SECRET,
        region_name="us-east-1",
    )


@pytest.fixture
def raw(s3_server: str):
    return raw_client(s3_server)


@pytest.fixture
def s3(s3_bucket, fault_proxy, raw):  # noqa: F811
    """(bucket, storage options through the proxy, the proxy, a raw client), on SeaweedFS."""
    bucket, options = s3_bucket
    return bucket, via(fault_proxy.url, options), fault_proxy, raw


@pytest.fixture
def moto_s3(moto_bucket, moto_fault_proxy, moto_server):  # noqa: F811
    """As ``s3``, on moto: for what a real server does not do (keep a part whose CRC32 does not
    match, so that the check after complete is what catches it; SSE-KMS)."""
    bucket, options = moto_bucket
    return bucket, via(moto_fault_proxy.url, options), moto_fault_proxy, raw_client(moto_server)


@pytest.fixture
def md5_calls(monkeypatch) -> list[int]:
    """Counts the uploader's MD5 computations (one entry per part hashed, its length)."""
    calls: list[int] = []
    md5_range = s3_module.md5_range

    def counted(fd, offset, length):
        calls.append(length)
        return md5_range(fd, offset, length)

    monkeypatch.setattr(s3_module, "md5_range", counted)
    return calls


@pytest.fixture
def no_crc_in_head(monkeypatch) -> None:
    """HEADs answered as by an S3-compatible server without flexible checksums: no ChecksumCRC32."""
    call = s3_module.Object.call

    def without_crc(self, method: str, **kwargs: Any) -> Any:
        resp = call(self, method, **kwargs)
        if method == "head_object":
            resp = {k: v for k, v in resp.items() if not k.startswith("Checksum")}
        return resp

    monkeypatch.setattr(s3_module.Object, "call", without_crc)


def remote_bytes(raw, bucket: str, key: str) -> bytes:
    return raw.get_object(Bucket=bucket, Key=key)["Body"].read()


def pending_uploads(raw, bucket: str) -> list[str]:
    return sorted(u["Key"] for u in raw.list_multipart_uploads(Bucket=bucket).get("Uploads", []))


def first_faulty_seed(rate: float) -> int:
    """A seed whose first draw is a fault, so a run is sure to see at least one."""
    return next(s for s in range(1000) if random.Random(s).random() < rate)


# -- pure parts -----------------------------------------------------------------------------------


class TestPlanAndEtag:
    def test_small_files_are_one_put(self):
        assert plan_parts(0, PART).multipart is False
        assert plan_parts(PART, PART).parts == plan_parts(PART, PART).parts[:1]
        assert not plan_parts(PART, PART).multipart

    def test_parts_cover_the_file_exactly(self):
        plan = plan_parts(3 * PART + 7, PART)
        assert plan.multipart and [p.length for p in plan.parts] == [PART, PART, PART, 7]
        assert [p.offset for p in plan.parts] == [0, PART, 2 * PART, 3 * PART]
        assert [p.number for p in plan.parts] == [1, 2, 3, 4]

    def test_part_size_grows_to_stay_within_10000_parts(self):
        plan = plan_parts(MAX_PARTS * PART + 1, PART)
        assert len(plan.parts) <= MAX_PARTS and plan.part_size % MiB == 0 and plan.part_size > PART

    def test_multipart_etag_is_md5_of_part_md5s(self):
        data = payload(2 * PART + 3)
        md5s = [hashlib.md5(data[:PART]).digest(), hashlib.md5(data[PART : 2 * PART]).digest()]
        md5s.append(hashlib.md5(data[2 * PART :]).digest())
        assert local_etag(data) == hashlib.md5(b"".join(md5s)).hexdigest() + "-3"
        assert local_etag(b"abc") == hashlib.md5(b"abc").hexdigest()

    def test_composite_crc32_is_crc32_of_part_crc32s(self):
        data = payload(2 * PART + 3)
        plan = plan_parts(len(data), PART)
        crcs = [crc_b64(data[p.offset : p.offset + p.length]) for p in plan.parts]
        assert crc32_of(plan, crcs) == local_crc(data) and local_crc(data).endswith("-3")
        single = plan_parts(1000, PART)
        assert crc32_of(single, [crc_b64(data[:1000])]) == crc_b64(data[:1000])
        one_part = plan_for_etag(len(data), "a" * 32 + "-1", PART)  # a multipart upload of 1 part
        assert one_part is not None and one_part.multipart
        assert crc32_of(one_part, [crc_b64(data)]) == f"{crc_b64(zlib.crc32(data).to_bytes(4, 'big'))}-1"
        with pytest.raises(ValueError):
            crc32_of(plan, crcs[:2])

    def test_reported_checksums_with_or_without_part_count(self):
        assert same_checksum("FJvK5w==-2", "FJvK5w==-2") and same_checksum("FJvK5w==", "FJvK5w==-2")
        assert same_checksum(" FJvK5w== ", "FJvK5w==")
        assert not same_checksum("FJvK5w==-3", "FJvK5w==-2")  # S3's part count disagrees
        assert not same_checksum("FJvK5w==-2", "FJvK5w==")  # a multipart object, a single-PUT plan
        assert not same_checksum("AAAAAA==-2", "FJvK5w==-2") and not same_checksum("AAAAAA==", "FJvK5w==")

    def test_guess_part_size(self):
        assert guess_part_size(20 * MiB, 3) == 8 * MiB
        assert guess_part_size(20 * MiB, 4, hints=(5 * MiB,)) == 5 * MiB
        assert guess_part_size(20 * MiB, 7) is None

    def test_an_objects_plan_is_told_from_its_etag(self):
        md5 = "a" * 32
        plan = plan_for_etag(20 * MiB, f"{md5}-3", PART)
        assert plan is not None and plan.part_size == 8 * MiB and len(plan.parts) == 3
        single = plan_for_etag(20 * MiB, md5, PART)
        assert single is not None and not single.multipart and single.parts[0].length == 20 * MiB
        assert plan_for_etag(20 * MiB, f"{md5}-7", PART) is None
        # Past 10,000 parts boto3 doubles the part size: 10 MiB parts become 20 MiB ones.
        size = MAX_PARTS * 10 * MiB + 1
        grown = plan_for_etag(size, f"{md5}-{-(-size // (20 * MiB))}", 10 * MiB)
        assert grown is not None and grown.part_size == 20 * MiB and len(grown.parts) <= MAX_PARTS

    @pytest.mark.parametrize("kind", ["CRC32", "ETag"])
    def test_a_download_is_hashed_per_part_as_it_is_written(self, tmp_path, kind):
        """Pieces that straddle parts are split between their hashers; the sink is not seekable, so
        boto3 hands it the bytes in order."""
        data = payload(3 * PART + 11, seed=31)
        fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT)
        try:
            sink = s3_module.HashingSink(fd, plan_parts(len(data), PART), kind)
            assert not hasattr(sink, "seek")
            for offset in range(0, len(data), 3 * MiB):  # 3 MiB pieces: parts end mid-piece
                sink.write(data[offset : offset + 3 * MiB])
            got = sink.result()
        finally:
            os.close(fd)
        assert (tmp_path / "f").read_bytes() == data
        assert got == (local_crc(data) if kind == "CRC32" else local_etag(data))


class TestOptions:
    def test_storage_options_merge_keeps_the_users_settings(self):
        user = {"key": "k", "config_kwargs": {"retries": {"mode": "adaptive"}, "signature_version": "s3v4"}}
        opts = TransferOptions(connect_timeout=3, read_timeout=7, max_attempts=4, concurrency=16)
        merged = s3_storage_options(user, opts)
        config = merged["config_kwargs"]
        assert config["connect_timeout"] == 3 and config["read_timeout"] == 7
        assert config["retries"] == {"mode": "adaptive", "total_max_attempts": 4}
        assert config["signature_version"] == "s3v4" and config["max_pool_connections"] == 16
        assert merged["key"] == "k" and user["config_kwargs"]["retries"] == {"mode": "adaptive"}
        assert s3_storage_options(merged, opts) == merged

    @pytest.mark.parametrize(
        "bad", [{"part_size": MiB}, {"part_size": 6 << 30}, {"concurrency": 0}, {"read_timeout": 0}]
    )
    def test_invalid_options_are_refused(self, bad):
        with pytest.raises(ValueError):
            TransferOptions(**bad)


# -- S3 -------------------------------------------------------------------------------------------


@pytest.mark.s3
class TestS3Upload:
    def test_multipart_upload_stores_the_full_object_crc32(self, s3, tmp_path):
        """The file's CRC32 goes with the upload (ChecksumType FULL_OBJECT): the server checks it
        when it completes the upload, and the HEAD shows it."""
        bucket, options, proxy, raw = s3
        data = payload(3 * PART + 1234)
        result = upload_file(
            write(tmp_path / "a.tar", data), f"s3://{bucket}/x/a.tar", storage_options=options, options=CALM
        )
        assert (result.size, result.skipped) == (len(data), False)
        assert result.etag == local_etag(data) and result.etag.endswith("-4")
        head = raw.head_object(Bucket=bucket, Key="x/a.tar", ChecksumMode="ENABLED")
        assert head["ETag"].strip('"') == result.etag
        assert (head["ChecksumCRC32"], head["ChecksumType"]) == (crc_b64(data), "FULL_OBJECT")
        assert remote_bytes(raw, bucket, "x/a.tar") == data
        assert proxy.methods()["PUT"] == 4  # one per part
        assert proxy.methods()["HEAD"] == 2  # is it there already? is it whole?

    @pytest.mark.parametrize("size", [0, 1000, PART])
    def test_small_file_is_one_put(self, s3, tmp_path, size):
        bucket, options, proxy, raw = s3
        data = payload(size, seed=size)
        result = upload_file(
            write(tmp_path / "s", data), f"s3://{bucket}/s", storage_options=options, options=CALM
        )
        assert result.etag == hashlib.md5(data).hexdigest()
        assert remote_bytes(raw, bucket, "s") == data
        assert proxy.methods()["PUT"] == 1 and proxy.methods()["POST"] == 0

    def test_uploads_complete_at_a_20_percent_fault_rate(self, s3, tmp_path):
        bucket, options, proxy, raw = s3
        proxy.rate, proxy.stall_seconds = 0.2, 6.0
        proxy.reseed(first_faulty_seed(0.2))
        for kind in ("drop", "reset", "stall"):  # on top of the random ones: each kind at least once
            proxy.force(kind, 1, offset=3 * MiB)
        files = {f"f{n}": payload(n * PART + n * 1000, seed=n) for n in (3, 4, 6)}
        start = time.monotonic()
        for name, data in files.items():
            result = upload_file(
                write(tmp_path / name, data), f"s3://{bucket}/{name}", storage_options=options, options=FAST
            )
            assert result.etag == local_etag(data)
        assert all(proxy.counts[kind] >= 1 for kind in ("drop", "reset", "stall")), proxy.counts
        assert proxy.faults() >= 4, proxy.counts  # the random ones too
        assert time.monotonic() - start < 120
        proxy.rate = 0.0
        for name, data in files.items():
            assert remote_bytes(raw, bucket, name) == data, name
        assert pending_uploads(raw, bucket) == []

    def test_a_real_server_refuses_a_corrupt_part_and_it_is_sent_again(self, s3, tmp_path, md5_calls):
        """SeaweedFS, as S3, refuses a part whose CRC32 does not match its bytes (BadDigest): the
        part is sent again and the upload completes with the right bytes, no MD5 computed."""
        bucket, options, proxy, raw = s3
        data = payload(3 * PART, seed=3)
        src = write(tmp_path / "c", data)
        proxy.force("corrupt", 2, offset=PART // 2)  # two parts get a byte flipped
        result = upload_file(src, f"s3://{bucket}/c", storage_options=options, options=FAST)
        assert proxy.counts["corrupt"] == 2 and not result.skipped
        assert result.etag == local_etag(data) and remote_bytes(raw, bucket, "c") == data
        assert md5_calls == []

    def test_corruption_in_transit_never_leaves_a_bad_object(self, moto_s3, tmp_path, md5_calls):
        """S3 refuses a part whose CRC32 does not match; moto does not check it, but builds the
        object's CRC32 from the bytes it kept: the HEAD after complete sees the mismatch, the object
        is removed, and the re-run completes. No MD5 is needed for any of it. On moto: the point
        is a server that keeps a corrupt part."""
        bucket, options, proxy, raw = moto_s3
        data = payload(3 * PART, seed=3)
        src = write(tmp_path / "c", data)
        proxy.force("corrupt", 2, offset=PART // 2)  # two parts get a byte flipped
        with pytest.raises(TransferVerifyError, match="CRC32 expected") as err:
            upload_file(src, f"s3://{bucket}/c", storage_options=options, options=FAST)
        assert "remote copy was removed" in str(err.value)
        assert "Contents" not in raw.list_objects_v2(Bucket=bucket) and pending_uploads(raw, bucket) == []
        result = upload_file(src, f"s3://{bucket}/c", storage_options=options, options=FAST)
        assert proxy.counts["corrupt"] == 2 and not result.skipped
        assert result.etag == local_etag(data) and remote_bytes(raw, bucket, "c") == data
        assert md5_calls == []

    def test_a_corrupt_part_is_caught_once_after_complete(self, moto_s3, tmp_path):
        """One corrupt part costs no extra request before complete: the one HEAD finds it. On moto,
        a server that keeps a corrupt part."""
        bucket, options, proxy, raw = moto_s3
        proxy.force("corrupt", 1, offset=PART // 2, match="partNumber=2")
        data = payload(2 * PART + 1, seed=22)
        src = write(tmp_path / "late", data)
        with pytest.raises(TransferVerifyError, match=rf"CRC32 expected {re.escape(crc_b64(data))}, found"):
            upload_file(src, f"s3://{bucket}/late", storage_options=options, options=CALM)
        assert "Contents" not in raw.list_objects_v2(Bucket=bucket) and pending_uploads(raw, bucket) == []
        assert proxy.methods()["POST"] == 2 and proxy.methods()["PUT"] == 3  # nothing sent twice
        assert proxy.methods()["HEAD"] == 2 and proxy.methods()["DELETE"] == 1

    def test_persistent_corruption_fails_and_leaves_nothing(self, moto_s3, tmp_path):
        """On moto, a server that keeps corrupt parts: the check after complete fails every time."""
        bucket, options, proxy, raw = moto_s3
        proxy.force("corrupt", 100, offset=1 << 20)
        src = write(tmp_path / "c", payload(2 * PART, seed=4))
        with pytest.raises(TransferVerifyError, match=rf"s3://{bucket}/c failed verification: CRC32"):
            upload_file(src, f"s3://{bucket}/c", storage_options=options, options=FAST)
        proxy.clear_forced()
        assert "Contents" not in raw.list_objects_v2(Bucket=bucket)
        assert pending_uploads(raw, bucket) == []

    def test_a_mismatch_after_upload_deletes_the_object(self, s3, tmp_path, monkeypatch):
        """The HEAD check after complete is what decides: a wrong CRC32 there removes the object."""
        bucket, options, _, raw = s3
        heads = []

        def wrong_after_upload(obj):  # the second HEAD, after complete, reports another CRC32
            found = head(obj)
            heads.append(found)
            return dataclasses.replace(found, crc="AAAAAA==") if len(heads) == 2 else found

        head = s3_module.head
        monkeypatch.setattr(s3_module, "head", wrong_after_upload)
        with pytest.raises(TransferVerifyError, match=r"CRC32 expected \S+==, found AAAAAA==") as err:
            upload_file(
                write(tmp_path / "m", payload(3 * PART)),
                f"s3://{bucket}/m",
                storage_options=options,
                options=FAST,
            )
        assert "remote copy was removed" in str(err.value)
        assert "Contents" not in raw.list_objects_v2(Bucket=bucket)

    def test_kms_objects_are_verified_and_skipped_by_crc32(self, moto_s3, tmp_path, caplog, md5_calls):
        """SSE-KMS ETags are not MD5s, but the CRC32 is of the bytes, encrypted or not. On moto:
        SeaweedFS has no SSE-KMS."""
        bucket, options, _, raw = moto_s3
        kms = {**options, "s3_additional_kwargs": {"ServerSideEncryption": "aws:kms"}}
        data = payload(2 * PART + 1, seed=20)
        src = write(tmp_path / "kms", data)
        with caplog.at_level("DEBUG", logger="ckptflow"):
            first = upload_file(src, f"s3://{bucket}/kms", storage_options=kms, options=FAST)
            again = upload_file(src, f"s3://{bucket}/kms", storage_options=kms, options=FAST)
        head = raw.head_object(Bucket=bucket, Key="kms", ChecksumMode="ENABLED")
        assert head["ServerSideEncryption"] == "aws:kms" and same_checksum(
            head["ChecksumCRC32"], crc_b64(data)
        )
        assert not first.skipped and again.skipped
        assert "size checked only" not in caplog.text and "no CRC32" not in caplog.text and md5_calls == []
        assert remote_bytes(raw, bucket, "kms") == data

    def test_kms_objects_without_crc32_are_checked_by_size_and_never_skipped(
        self, moto_s3, tmp_path, caplog, no_crc_in_head, md5_calls
    ):
        """Without a CRC32 (a server without flexible checksums), SSE-KMS ETags are not MD5s: the
        upload must neither compare them nor trust them for a skip. On moto: SeaweedFS has no
        SSE-KMS."""
        bucket, options, _, raw = moto_s3
        kms = {**options, "s3_additional_kwargs": {"ServerSideEncryption": "aws:kms"}}
        data = payload(2 * PART + 1, seed=20)
        src = write(tmp_path / "kms", data)
        with caplog.at_level("WARNING", logger="ckptflow"):
            first = upload_file(src, f"s3://{bucket}/kms", storage_options=kms, options=FAST)
            again = upload_file(src, f"s3://{bucket}/kms", storage_options=kms, options=FAST)
        assert raw.head_object(Bucket=bucket, Key="kms")["ServerSideEncryption"] == "aws:kms"
        assert not first.skipped and not again.skipped
        assert "size checked only" in caplog.text and md5_calls == []
        download_file(f"s3://{bucket}/kms", tmp_path / "back", storage_options=kms, options=FAST)
        assert (tmp_path / "back").read_bytes() == data == remote_bytes(raw, bucket, "kms")

    @pytest.mark.parametrize("size", [1000, 2 * PART + 7])
    def test_an_upload_and_its_rerun_compute_no_md5(self, s3, tmp_path, md5_calls, size):
        """The MD5s (~1.3 CPU-s per GiB) made uploads slower than boto3's: CRC32s verify them now."""
        bucket, options, proxy, raw = s3
        data = payload(size, seed=23)
        src = write(tmp_path / "n", data)
        first = upload_file(src, f"s3://{bucket}/n", storage_options=options, options=CALM)
        again = upload_file(src, f"s3://{bucket}/n", storage_options=options, options=CALM)
        assert not first.skipped and again.skipped and first.etag == again.etag == local_etag(data)
        assert md5_calls == []
        head = raw.head_object(Bucket=bucket, Key="n", ChecksumMode="ENABLED")
        assert same_checksum(head["ChecksumCRC32"], crc_b64(data)) and remote_bytes(raw, bucket, "n") == data
        assert proxy.methods()["HEAD"] == 3

    def test_a_directory_is_refused(self, s3, tmp_path):
        bucket, options, proxy, _ = s3
        with pytest.raises(StorageUnavailableError, match="is not a regular file"):
            upload_file(tmp_path, f"s3://{bucket}/d", storage_options=options, options=FAST)
        assert proxy.methods() == {}


@pytest.mark.s3
class TestStalls:
    def test_a_stall_fails_the_request_and_it_is_retried_within_the_timeout(self, s3, tmp_path):
        bucket, options, proxy, raw = s3
        proxy.stall_seconds = 60.0  # far longer than the test may take
        proxy.force("stall", 2, offset=2 * MiB)  # mid-body of two parts
        data = payload(4 * PART, seed=5)
        start = time.monotonic()
        upload_file(write(tmp_path / "st", data), f"s3://{bucket}/st", storage_options=options, options=FAST)
        elapsed = time.monotonic() - start
        assert proxy.counts["stall"] >= 1
        assert elapsed < 30, f"took {elapsed:.1f}s: the stall was waited out instead of timed out"
        assert remote_bytes(raw, bucket, "st") == data

    def test_a_peer_that_stops_reading_the_body_times_out(self, s3_bucket, fault_proxy, tmp_path):  # noqa: F811
        """A PUT to a peer that stops reading its body fails in bounded time, on every attempt: the
        socket's timeout covers sending too (aiohttp's did not: a PUT to such a peer hung)."""
        bucket, options = s3_bucket
        fault_proxy.stall_seconds = 60.0
        fault_proxy.force("stall", 2, offset=2 * MiB)  # mid-body, both attempts
        opts = TransferOptions(part_size=16 * MiB, connect_timeout=1, read_timeout=1, max_attempts=2)
        start = time.monotonic()
        with pytest.raises(StorageUnavailableError, match="after 2 attempts") as err:
            upload_file(
                write(tmp_path / "big", payload(8 * MiB)),
                f"s3://{bucket}/k",
                storage_options=via(fault_proxy.url, options),
                options=opts,
            )
        assert time.monotonic() - start < 15 and fault_proxy.counts["stall"] == 2
        assert fault_proxy.methods()["PUT"] == 2
        no_secret(err.value)

    def test_a_part_whose_answer_never_comes_is_retried_within_the_timeout(self, s3, tmp_path):
        """Fixes: a "100 Continue" that reached aiohttp after the body was out stopped its read timeout,
        and the guard stopped watching once the body was taken: a part whose answer then stalled waited
        for the peer to give up (60 s) instead of the read timeout. moto sends two 100 Continues, so the
        stall test above hit this at random (about 1 run in 6); ``late-continue`` hits it every time,
        here on a part's first attempt and on its retry."""
        bucket, options, proxy, raw = s3
        proxy.stall_seconds = 60.0
        proxy.force("late-continue", 2, offset=1, match="partNumber=2")
        data = payload(3 * PART, seed=7)
        start = time.monotonic()
        upload_file(write(tmp_path / "lc", data), f"s3://{bucket}/lc", storage_options=options, options=FAST)
        elapsed = time.monotonic() - start
        assert proxy.counts["late-continue"] == 2
        assert elapsed < 15, f"took {elapsed:.1f}s: the silent answer was waited out instead of timed out"
        assert remote_bytes(raw, bucket, "lc") == data

    @pytest.mark.parametrize("method", ["put_object", "head_object"])
    def test_a_late_interim_answer_does_not_stop_the_read_timeout(self, s3_bucket, fault_proxy, method):  # noqa: F811
        """A "100 Continue" after the request, then silence: the wait for the real answer is bounded
        by the read timeout, for a request with or without a body (aiohttp stopped its timeout at
        the interim answer and waited for the peer to give up)."""
        bucket, options = s3_bucket
        fault_proxy.stall_seconds = 60.0
        fault_proxy.force("late-continue", 2, offset=1)  # both attempts
        client = s3client.client_for(
            via(fault_proxy.url, options), connect_timeout=1, read_timeout=1, max_attempts=2, concurrency=1
        )
        kwargs = {"Body": b"x" * MiB} if method == "put_object" else {}
        start = time.monotonic()
        with pytest.raises(bex.ReadTimeoutError) as err:
            getattr(client, method)(Bucket=bucket, Key="k", **kwargs)
        assert time.monotonic() - start < 15 and fault_proxy.counts["late-continue"] == 2
        no_secret(err.value)

    def test_unreachable_endpoint_fails_in_bounded_time_without_secrets(self, s3_bucket, tmp_path, caplog):
        bucket, options = s3_bucket
        with FaultProxy("http://127.0.0.1:9", rate=1.0, kinds=("drop",)) as dead:
            opts = TransferOptions(connect_timeout=1, read_timeout=1, max_attempts=2)
            start = time.monotonic()
            with (
                caplog.at_level("DEBUG"),
                pytest.raises(StorageUnavailableError, match="after 2 attempts") as err,
            ):
                upload_file(
                    write(tmp_path / "u", b"abc"),
                    f"s3://{bucket}/u",
                    storage_options=via(dead.url, options),
                    options=opts,
                )
        assert time.monotonic() - start < 20
        assert f"s3://{bucket}/u" in str(err.value)
        no_secret(err.value)
        assert S3_SECRET not in caplog.text


@pytest.mark.s3
class TestIdempotentUpload:
    def test_rerun_skips_without_sending(self, s3, tmp_path):
        bucket, options, proxy, _ = s3
        src = write(tmp_path / "r", payload(2 * PART + 5))
        first = upload_file(src, f"s3://{bucket}/r", storage_options=options, options=CALM)
        proxy.reset_counts()
        again = upload_file(src, f"s3://{bucket}/r", storage_options=options, options=CALM)
        assert again.skipped and not first.skipped and again.etag == first.etag
        assert proxy.methods() == {"HEAD": 1}, proxy.requests
        no_secret(first, again)

    def test_same_bytes_uploaded_by_another_tool_are_skipped(self, s3, tmp_path, raw):
        bucket, options, proxy, _ = s3
        data = payload(4 * MiB * 5, seed=6)  # 20 MiB: boto3 makes 3 parts of 8 MiB
        src = write(tmp_path / "b", data)
        raw.upload_file(
            str(src),
            bucket,
            "b",
            Config=TransferConfig(multipart_threshold=8 * MiB, multipart_chunksize=8 * MiB),
        )
        assert raw.head_object(Bucket=bucket, Key="b")["ETag"].strip('"').endswith("-3")
        proxy.reset_counts()
        assert upload_file(src, f"s3://{bucket}/b", storage_options=options, options=CALM).skipped
        assert proxy.methods()["PUT"] == 0

    @pytest.mark.parametrize("how", ["single-put", "same-plan"])
    def test_right_size_wrong_bytes_is_uploaded_again(self, s3, tmp_path, how):
        bucket, options, _, raw = s3
        data, other = payload(3 * PART, seed=7), payload(3 * PART, seed=8)
        if how == "single-put":
            raw.put_object(Bucket=bucket, Key="w", Body=other)
        else:
            upload_file(
                write(tmp_path / "other", other), f"s3://{bucket}/w", storage_options=options, options=FAST
            )
        result = upload_file(
            write(tmp_path / "w", data), f"s3://{bucket}/w", storage_options=options, options=FAST
        )
        assert not result.skipped
        assert remote_bytes(raw, bucket, "w") == data

    @pytest.mark.parametrize("by", ["ckptflow", "boto3 upload_file", "boto3 put_object"])
    def test_one_byte_off_fails_the_crc32_and_is_uploaded_again(self, s3, tmp_path, md5_calls, by):
        """An object of the right size and part plan, with a CRC32, one byte off: uploaded again."""
        bucket, options, _, raw = s3
        data = payload(3 * PART if by != "boto3 put_object" else PART - 5, seed=24)
        other = bytearray(data)
        other[-2] ^= 0x01
        src, other_src = write(tmp_path / "d", data), write(tmp_path / "o", bytes(other))
        if by == "ckptflow":
            upload_file(other_src, f"s3://{bucket}/d", storage_options=options, options=FAST)
        elif by == "boto3 upload_file":
            config = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART)
            raw.upload_file(str(other_src), bucket, "d", Config=config)
        else:
            raw.put_object(Bucket=bucket, Key="d", Body=bytes(other))
        head = raw.head_object(Bucket=bucket, Key="d", ChecksumMode="ENABLED")
        assert head["ETag"].strip('"') == local_etag(bytes(other)) and "ChecksumCRC32" in head
        result = upload_file(src, f"s3://{bucket}/d", storage_options=options, options=FAST)
        assert not result.skipped and result.etag == local_etag(data)
        assert remote_bytes(raw, bucket, "d") == data and md5_calls == []

    def test_abandoned_multipart_uploads_of_the_key_are_aborted(self, s3, tmp_path, raw):
        bucket, options, _, _ = s3
        for key in ("k.tar", "k.tar.index"):  # the second only shares a prefix: it must survive
            upload_id = raw.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
            raw.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=1, Body=payload(PART))
        result = upload_file(
            write(tmp_path / "k", payload(2 * PART, seed=9)),
            f"s3://{bucket}/k.tar",
            storage_options=options,
            options=FAST,
        )
        assert not result.skipped
        assert pending_uploads(raw, bucket) == ["k.tar.index"]

    def test_upload_killed_midway_is_never_done_and_a_rerun_completes(self, s3, tmp_path, raw):
        """SIGKILL during the upload leaves an unfinished multipart upload and no object; a re-run
        aborts it, uploads, and verifies."""
        bucket, options, proxy, _ = s3
        data = payload(6 * PART, seed=10)
        src = write(tmp_path / "kill", data)
        proxy.stall_seconds = 60.0
        proxy.force("stall", 100, offset=MiB, match="partNumber=3")  # part 3 hangs, the others go through
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(src), f"s3://{bucket}/kill", repr(options)], env=_child_env()
        )
        try:
            deadline = time.monotonic() + 60
            while proxy.counts["stall"] < 1 and time.monotonic() < deadline and child.poll() is None:
                time.sleep(0.05)
            assert proxy.counts["stall"] >= 1 and child.poll() is None
            time.sleep(0.5)  # let the other parts land
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait(timeout=30)
        proxy.clear_forced()
        assert "Contents" not in raw.list_objects_v2(Bucket=bucket)
        assert pending_uploads(raw, bucket) == ["kill"]
        upload_id = raw.list_multipart_uploads(Bucket=bucket)["Uploads"][0]["UploadId"]
        assert raw.list_parts(Bucket=bucket, Key="kill", UploadId=upload_id).get("Parts"), (
            "no part was uploaded"
        )
        result = upload_file(src, f"s3://{bucket}/kill", storage_options=options, options=FAST)
        assert not result.skipped and result.etag == local_etag(data)
        assert remote_bytes(raw, bucket, "kill") == data and pending_uploads(raw, bucket) == []


@pytest.mark.s3
class TestWithoutFlexibleChecksums:
    """S3-compatible servers that keep no CRC32: the ETags are checked against MD5s, as before."""

    def test_an_upload_is_checked_by_md5s(self, s3, tmp_path, no_crc_in_head, md5_calls, caplog):
        bucket, options, _, raw = s3
        data = payload(2 * PART + 9, seed=25)
        with caplog.at_level("DEBUG", logger="ckptflow"):
            result = upload_file(
                write(tmp_path / "f", data), f"s3://{bucket}/f", storage_options=options, options=FAST
            )
        assert result.etag == local_etag(data) and remote_bytes(raw, bucket, "f") == data
        assert sorted(md5_calls) == [9, PART, PART]  # each part once, after complete
        assert "has no CRC32: checking its ETags by MD5s" in caplog.text

    def test_a_corrupt_part_is_caught_by_its_etag(self, moto_s3, tmp_path, no_crc_in_head):
        """On moto, a server that keeps a corrupt part (a real one refuses it on arrival)."""
        bucket, options, proxy, raw = moto_s3
        data = payload(2 * PART + 1, seed=26)
        proxy.force("corrupt", 1, offset=PART // 2, match="partNumber=2")
        with pytest.raises(TransferVerifyError, match=f"ETag expected {local_etag(data)}, found") as err:
            upload_file(
                write(tmp_path / "c", data), f"s3://{bucket}/c", storage_options=options, options=FAST
            )
        assert "remote copy was removed" in str(err.value)
        assert "Contents" not in raw.list_objects_v2(Bucket=bucket) and pending_uploads(raw, bucket) == []

    def test_objects_without_a_crc32_are_skipped_or_replaced_by_md5s(
        self, s3, s3_server, tmp_path, md5_calls
    ):
        """Objects uploaded without checksums (older ckptflow, other tools): the MD5 ETag decides."""
        bucket, options, _, _ = s3
        plain = boto3.client(
            "s3",
            endpoint_url=s3_server,
            aws_access_key_id=S3_KEY,
            aws_secret_access_key=S3_SECRET,
            region_name="us-east-1",
            config=Config(request_checksum_calculation="when_required"),
        )
        data, other = payload(3 * PART, seed=27), payload(3 * PART, seed=28)
        src = write(tmp_path / "same", data)
        config = TransferConfig(multipart_threshold=PART, multipart_chunksize=PART)
        plain.upload_file(str(src), bucket, "same", Config=config)
        plain.upload_file(str(write(tmp_path / "other", other)), bucket, "other", Config=config)
        for key in ("same", "other"):
            assert "ChecksumCRC32" not in plain.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
        assert upload_file(src, f"s3://{bucket}/same", storage_options=options, options=FAST).skipped
        assert sorted(md5_calls) == [PART] * 3
        replaced = upload_file(src, f"s3://{bucket}/other", storage_options=options, options=FAST)
        assert not replaced.skipped and remote_bytes(plain, bucket, "other") == data
        assert "ChecksumCRC32" in plain.head_object(Bucket=bucket, Key="other", ChecksumMode="ENABLED")

    def test_a_head_refused_its_checksums_falls_back_to_etags(self, s3, tmp_path, monkeypatch, md5_calls):
        """A HEAD with ChecksumMode on an SSE-KMS object needs kms:Decrypt: refused, it is asked again
        without, and the ETags decide."""
        bucket, options, _, raw = s3
        call = s3_module.Object.call

        def refuse_checksums(self, method: str, **kwargs: Any) -> Any:
            if method == "head_object" and kwargs.get("ChecksumMode"):
                raise bex.ClientError({"Error": {"Code": "403", "Message": "Forbidden"}}, "HeadObject")
            return call(self, method, **kwargs)

        monkeypatch.setattr(s3_module.Object, "call", refuse_checksums)
        data = payload(PART + 3, seed=29)
        result = upload_file(
            write(tmp_path / "r", data), f"s3://{bucket}/r", storage_options=options, options=FAST
        )
        assert result.etag == local_etag(data) and remote_bytes(raw, bucket, "r") == data
        assert sorted(md5_calls) == [3, PART]


_CHILD = textwrap.dedent(
    """
    import ast, sys
    from ckptflow.storage.remote.transfer import TransferOptions, upload_file
    opts = TransferOptions(part_size=5 << 20, concurrency=2, read_timeout=120, max_attempts=1)
    upload_file(sys.argv[1], sys.argv[2], storage_options=ast.literal_eval(sys.argv[3]), options=opts)
    """
)


def _child_env() -> dict[str, str]:
    root = str(Path(__file__).resolve().parents[2])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}


@pytest.mark.s3
class TestS3Download:
    def test_round_trip_through_faults(self, s3, tmp_path):
        bucket, options, proxy, _ = s3
        data = payload(4 * PART + 77, seed=11)
        upload_file(write(tmp_path / "src", data), f"s3://{bucket}/d", storage_options=options, options=FAST)
        proxy.rate, proxy.stall_seconds, proxy.max_offset = 0.2, 6.0, 3 * MiB
        proxy.reseed(first_faulty_seed(0.2))
        proxy.force("reset", 1, offset=2 * MiB)  # mid-body of a ranged GET: resumed where it broke
        proxy.force("stall", 1, offset=2 * MiB)
        out = tmp_path / "out" / "d.bin"  # its directory does not exist yet
        for _ in range(2):
            result = download_file(f"s3://{bucket}/d", out, storage_options=options, options=FAST)
            assert out.read_bytes() == data and result.size == len(data) and result.etag == local_etag(data)
        assert proxy.counts["reset"] >= 1 and proxy.counts["stall"] >= 1, proxy.counts
        assert os.listdir(out.parent) == ["d.bin"]

    def test_object_of_another_tool_is_verified(self, s3, tmp_path, raw):
        bucket, options, _, _ = s3
        data = payload(20 * MiB + 3, seed=12)
        raw.upload_fileobj(
            _Reader(data),
            bucket,
            "o",
            Config=TransferConfig(multipart_threshold=8 * MiB, multipart_chunksize=8 * MiB),
        )
        singles = {"single": data[: PART + 9], "tiny": data[:1000], "empty": b""}  # 2 ranges, 1, none
        for key, body in singles.items():
            raw.put_object(Bucket=bucket, Key=key, Body=body)
        for key, want in {"o": data, **singles}.items():
            result = download_file(
                f"s3://{bucket}/{key}", tmp_path / key, storage_options=options, options=FAST
            )
            assert (tmp_path / key).read_bytes() == want and result.size == len(want)

    @pytest.mark.parametrize("server", ["with CRC32s", "without CRC32s"])
    def test_corrupt_bytes_are_refused_and_nothing_is_written(self, s3, tmp_path, raw, request, server):
        """Checked against the object's CRC32 when the HEAD has one, else the MD5s behind its ETag."""
        if server == "without CRC32s":
            request.getfixturevalue("no_crc_in_head")
        what = "CRC32" if server == "with CRC32s" else "ETag"
        bucket, options, proxy, _ = s3
        raw.put_object(Bucket=bucket, Key="c", Body=payload(3 * PART, seed=13))
        upload_file(
            write(tmp_path / "c-src", payload(3 * PART, seed=13)),
            f"s3://{bucket}/c2",
            storage_options=options,
            options=FAST,
        )
        write(tmp_path / "out" / "old", b"old")
        proxy.force("corrupt", 100, offset=2 * MiB)
        for key in ("c", "c2"):  # one PUT, and multipart
            s3client.forget_clients()  # new connections: the proxy faults each once
            with pytest.raises(TransferVerifyError, match=f"s3://{bucket}/{key} failed verification: {what}"):
                download_file(
                    f"s3://{bucket}/{key}", tmp_path / "out" / "old", storage_options=options, options=FAST
                )
        assert os.listdir(tmp_path / "out") == ["old"] and (tmp_path / "out" / "old").read_bytes() == b"old"
        proxy.clear_forced()
        for key in ("c", "c2"):  # the same objects, whole on the wire, pass the same checks
            download_file(f"s3://{bucket}/{key}", tmp_path / key, storage_options=options, options=FAST)
            assert (tmp_path / key).read_bytes() == payload(3 * PART, seed=13)

    def test_size_only_when_asked(self, s3, tmp_path, raw):
        bucket, options, proxy, _ = s3
        raw.put_object(Bucket=bucket, Key="c", Body=payload(2 * PART, seed=21))
        proxy.force("corrupt", 100, offset=2 * MiB)
        size_only = TransferOptions(part_size=PART, download_checksums=False)
        result = download_file(f"s3://{bucket}/c", tmp_path / "c", storage_options=options, options=size_only)
        proxy.clear_forced()
        assert result.size == 2 * PART and proxy.counts["corrupt"] >= 1  # not caught: nothing checked it
        assert (tmp_path / "c").read_bytes() != payload(2 * PART, seed=21)

    def test_missing_object(self, s3, tmp_path):
        bucket, options, _, _ = s3
        with pytest.raises(StorageUnavailableError, match=f"no object at s3://{bucket}/nope"):
            download_file(f"s3://{bucket}/nope", tmp_path / "x", storage_options=options, options=FAST)
        assert os.listdir(tmp_path) == []

    def test_missing_bucket_named_without_secrets(self, s3_bucket, tmp_path):
        _, options = s3_bucket
        with pytest.raises(
            StorageUnavailableError, match="bucket of s3://no-such-bucket-x/k does not exist"
        ) as err:
            upload_file(
                write(tmp_path / "f", b"abc"),
                "s3://no-such-bucket-x/k",
                storage_options=options,
                options=FAST,
            )
        no_secret(err.value)


class _Reader:
    """A file object boto3 cannot stat: forces its multipart path with the given part size."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def read(self, n: int = -1) -> bytes:
        end = len(self.data) if n < 0 else self.pos + n
        chunk, self.pos = self.data[self.pos : end], min(end, len(self.data))
        return chunk


# -- other filesystems ----------------------------------------------------------------------------


@pytest.fixture(params=["local", "file", "memory"])
def target(request, tmp_path) -> Iterator[str]:
    if request.param == "local":
        yield str(tmp_path / "remote" / "sub" / "a.tar")
    elif request.param == "file":
        yield (tmp_path / "remote" / "sub" / "a.tar").as_uri()
    else:
        name = f"xfer-{uuid.uuid4().hex}"
        yield f"memory://{name}/sub/a.tar"
        fs = fsspec.filesystem("memory")
        if fs.exists(f"/{name}"):
            fs.rm(f"/{name}", recursive=True)


class TestOtherFilesystems:
    def test_upload_verify_skip_and_download(self, target, tmp_path):
        data = payload(3 * MiB + 1, seed=14)
        src = write(tmp_path / "src" / "a.tar", data)
        first = upload_file(src, target, options=FAST)
        assert not first.skipped and first.etag.startswith("xxh3_64:") and first.size == len(data)
        assert upload_file(src, target, options=FAST).skipped
        write(src, payload(len(data), seed=15))  # same size, other bytes
        assert not upload_file(src, target, options=FAST).skipped
        out = tmp_path / "back.tar"
        result = download_file(target, out, options=FAST)
        assert out.read_bytes() == src.read_bytes() and result.size == len(data)
        if "memory" not in target:
            assert sorted(os.listdir(tmp_path / "remote" / "sub")) == ["a.tar"]  # no temp file left

    def test_a_bad_copy_is_deleted(self, target, tmp_path, monkeypatch):
        def bad_put(loc, local_path):
            loc.fs.makedirs(loc.fs._parent(loc.root), exist_ok=True)
            loc.fs.pipe_file(loc.root, b"not the bytes")

        monkeypatch.setattr(transfer_module, "_put", bad_put)
        with pytest.raises(TransferVerifyError, match="failed verification: size expected 3, found 13"):
            upload_file(write(tmp_path / "x", b"abc"), target, options=FAST)
        fs, path = fsspec.core.url_to_fs(target)
        assert not fs.exists(path)


def test_transfer_options_honour_the_users_timeouts_and_attempts():
    """An upload target's ``config_kwargs`` set its timeouts and attempts (they were overridden
    by the defaults, so a silent target held every upload job for minutes)."""
    default = TransferOptions()
    assert default.honouring({}) == default
    assert default.honouring({"client_kwargs": {"endpoint_url": "http://x"}}) == default
    mine = default.honouring(
        {"config_kwargs": {"connect_timeout": 2, "read_timeout": 3, "retries": {"total_max_attempts": 1}}}
    )
    assert (mine.connect_timeout, mine.read_timeout, mine.max_attempts) == (2.0, 3.0, 1)
    assert mine.part_size == default.part_size
    retries_only = default.honouring({"config_kwargs": {"retries": {"max_attempts": 2}}})
    assert retries_only.max_attempts == 3  # botocore's max_attempts counts retries
    with pytest.raises(ValueError, match="must be positive"):
        default.honouring({"config_kwargs": {"read_timeout": 0}})
