"""Object stores whose answers are lost: the server acts on a request and the client never hears it.

Bugs fixed (issue 35): a manifest PUT that was stored but whose answer was lost (a reset, a 500, a
stall) failed the save with "another writer committed version N", the writer's own; a lease PUT
stored but unanswered left the process refused, naming its own pid, until the lease timed out; a
server that kept answering 500 failed a save with a raw ``OSError: [Errno 121]``; and a ``latest``
hint that could not be written failed a save whose version was committed.

SeaweedFS behind :class:`tests.faultproxy.FaultProxy`, which loses the answers (``answer-*``) or
answers 500 itself (``error-500``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import fsspec
import pytest
import torch

from ckptflow.storage import CheckpointStore, LeaseInfo, StorageUnavailableError, read_lease
from ckptflow.storage.files.s3options import S3_ATTEMPTS, S3FS_RETRIES
from ckptflow.storage.versions.commit import LATEST_FILE
from ckptflow.storage.versions.lease import LEASE_FILE
from tests.conftest import assert_same_state
from tests.faultproxy import FaultProxy, fault_proxy  # noqa: F401  (fixtures)

pytestmark = pytest.mark.s3

EVERY_ATTEMPT = S3FS_RETRIES * S3_ATTEMPTS  # s3fs's tries, each with botocore's attempts
LOST = ["answer-reset", "answer-500", "answer-stall"]


class Setup:
    """A store through the proxy (short read timeouts, so a stalled answer fails fast), and the bucket
    through a filesystem of its own, straight to the server."""

    def __init__(self, bucket: str, options: dict[str, Any], proxy: FaultProxy) -> None:
        self.bucket, self.proxy = bucket, proxy
        proxy.stall_seconds = 3.0
        client_kwargs = {**options["client_kwargs"], "endpoint_url": proxy.url}
        self.options = {**options, "client_kwargs": client_kwargs, "config_kwargs": {"read_timeout": 1}}
        self.raw = fsspec.filesystem("s3", **options)
        self.url = f"s3://{bucket}/run"

    def store(self) -> CheckpointStore:
        return CheckpointStore(self.url, storage_options=self.options)

    def put(self, name: str) -> str:
        """What a proxy ``match`` needs to pick the PUTs of the store's object ``name``."""
        return f"PUT /{self.bucket}/run/{name}"

    def read(self, name: str) -> bytes:
        self.raw.invalidate_cache()
        return self.raw.cat_file(f"{self.bucket}/run/{name}")


@pytest.fixture
def s3(s3_bucket, fault_proxy) -> Setup:  # noqa: F811
    bucket, options = s3_bucket
    return Setup(bucket, options, fault_proxy)


def state(seed: int) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(12, dtype=torch.float32) + seed, "b": torch.full((3,), float(seed))}


class TestManifestAnswerLost:
    """A writer whose manifest PUT was stored recognises its own commit, whatever became of the answer."""

    @pytest.mark.parametrize("kind", LOST)
    def test_a_stored_manifest_whose_answer_was_lost_is_this_writers_commit(self, s3: Setup, kind: str):
        """Bug: the retried PUT found the manifest, and the check that it was this writer's own was
        answered from s3fs's listing cache (no such file): "another writer committed version 1"."""
        store = s3.store()
        s3.proxy.force(kind, match=s3.put("v000001/manifest.json"))
        info = store.save(state(1), epoch=1)
        assert s3.proxy.counts[kind] == 1
        assert info.version == 1 and [v.version for v in store.versions()] == [1]
        assert s3.read("v000001/manifest.json") == store.manifest(1).to_json()
        assert_same_state(store.load(), state(1))

    def test_a_manifest_stored_although_every_attempt_failed_is_this_writers_commit(self, s3: Setup):
        """Bug: when no attempt's answer came back, the save failed although its manifest was stored."""
        store = s3.store()
        s3.proxy.force("answer-reset", EVERY_ATTEMPT, match=s3.put("v000001/manifest.json"))
        info = store.save(state(1), epoch=1)
        assert s3.proxy.counts["answer-reset"] == EVERY_ATTEMPT
        assert info.version == 1 and [v.version for v in store.versions()] == [1]
        assert_same_state(store.load(), state(1))


class TestLeaseAnswerLost:
    """A writer whose lease PUT was stored recognises its own lease by its token."""

    def test_a_created_lease_whose_answers_were_all_lost_is_held(self, s3: Setup):
        """Bug: the create failed, and the lease it stored refused this process (its own pid) until
        the lease timed out."""
        store = s3.store()
        s3.proxy.force("answer-reset", EVERY_ATTEMPT, match=s3.put(LEASE_FILE))
        with store.lease(owner="mine") as lease:
            assert read_lease(store.loc).token == lease.token
            assert store.save(state(1), epoch=1).version == 1
        assert read_lease(store.loc) is None

    def test_a_lease_stored_by_a_failed_take_is_taken_at_once_by_the_next(self, s3: Setup):
        """Bug: a take that stored its lease but could not read it back (the server failing) left
        the store refused to this very process, naming its own pid, until the lease timed out."""
        store = s3.store()
        s3.proxy.force("answer-reset", EVERY_ATTEMPT, match=s3.put(LEASE_FILE))
        s3.proxy.force("error-500", 100, match=f"/{s3.bucket}/run/{LEASE_FILE}")  # GET, HEAD, PUT
        with pytest.raises(StorageUnavailableError), store.lease(owner="first try"):
            pass
        assert LeaseInfo.parse(s3.read(LEASE_FILE)).owner == "first try"  # stored all the same
        s3.proxy.clear_forced()
        with store.lease(owner="second try") as lease:
            assert read_lease(store.loc).token == lease.token
            assert store.save(state(1), epoch=1).version == 1

    @pytest.mark.parametrize("kind", LOST)
    def test_a_takeover_whose_answer_was_lost_is_held(self, s3: Setup, kind: str):
        """Bug: the retried takeover (If-Match of the stale lease) failed on this writer's own PUT,
        and the writer was refused with StoreLockedError naming its own pid."""
        now = time.time()
        stale = LeaseInfo("someone else", "other-host", 4242, now - 105, now - 100, 5.0, "f" * 32)
        s3.raw.pipe_file(f"{s3.bucket}/run/{LEASE_FILE}", stale.to_json())
        store = s3.store()
        s3.proxy.force(kind, match=(s3.put(LEASE_FILE), "\nif-match:"))
        with store.lease(owner="taker") as lease:
            assert s3.proxy.counts[kind] == 1
            assert LeaseInfo.parse(s3.read(LEASE_FILE)).token == lease.token
            assert store.save(state(1), epoch=1).version == 1


class TestServerErrors:
    def test_a_server_that_keeps_failing_is_storage_unavailable_naming_the_endpoint(self, s3: Setup):
        """Bug: a persistent 500 (a server restarting mid-save) failed a save with a raw
        ``OSError: [Errno 121] We encountered an internal error``."""
        store = s3.store()
        s3.proxy.force("error-500", 1000, match=(s3.put("v000001/"), ".h5"))
        with pytest.raises(StorageUnavailableError) as caught:
            store.save(state(1), epoch=1)
        message = str(caught.value)
        assert s3.proxy.url.removeprefix("http://") in message and "InternalError" in message
        assert "Try again once it answers" in message and "Traceback" not in message
        assert store.versions() == []
        s3.proxy.clear_forced()  # the server is back
        assert store.save(state(2), epoch=2).version == 2
        assert_same_state(store.load(), state(2))


class TestLatestHint:
    @pytest.mark.parametrize("kind", ["reset", "answer-reset", "error-500"])
    def test_a_failed_latest_update_does_not_fail_a_committed_save(self, s3: Setup, kind: str, caplog):
        """Bug: a reset on the ``latest`` PUT, after the manifest was committed, failed the save; the
        hint is no part of the commit, and readers find the newest version without it."""
        store = s3.store()
        store.save(state(1), epoch=1)
        assert s3.read(LATEST_FILE) == b"v000001\n"
        s3.proxy.force(kind, 100, offset=0, match=s3.put(LATEST_FILE))
        with caplog.at_level(logging.WARNING, logger="ckptflow.storage"):
            info = store.save(state(2), epoch=2)
        assert info.version == 2 and s3.proxy.counts[kind] > 0
        assert f"could not update {s3.url}/{LATEST_FILE}" in caplog.text
        s3.proxy.clear_forced()
        s3.raw.pipe_file(f"{s3.bucket}/run/{LATEST_FILE}", b"v000001\n")  # stale, as a failed update left it
        fresh = s3.store()
        assert [v.version for v in fresh.versions()] == [1, 2] and fresh.latest().version == 2
        assert_same_state(fresh.load(), state(2))


class TestClaimAnswerLost:
    """A writer whose version claim was stored recognises it by its token."""

    def test_a_claim_stored_although_every_attempt_failed_is_this_writers(self, s3: Setup):
        """Bug: when no answer of the claim's PUT came back, the save failed (StorageUnavailableError)
        and left its stored claim behind for gc, although the claim was this writer's."""
        store = s3.store()
        s3.proxy.force("answer-reset", EVERY_ATTEMPT, match=s3.put("v000001/.claim.json"))
        info = store.save(state(1), epoch=1)
        assert s3.proxy.counts["answer-reset"] == EVERY_ATTEMPT
        assert info.version == 1 and [v.version for v in store.versions()] == [1]
        assert_same_state(store.load(), state(1))
