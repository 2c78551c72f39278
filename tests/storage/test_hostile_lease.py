"""The lease file is untrusted input: whatever lies at ``lease.json``, taking or checking the lease
neither hangs, nor reads without bound, nor follows a link out of the store, nor ends in a raw
traceback.

Bugs fixed: a FIFO at ``lease.json`` blocked ``store.lease()`` and ``ckptflow run`` forever;
``/dev/zero`` (through a symlink) or a sparse giant was read without a size limit; a symlink to a
file outside the store was read, and its contents appeared in ``StoreLockedError``; fields such as
``renewed = 1e300``, NaN, a pid of 10**30, deeply nested JSON or a directory gave raw tracebacks
(OverflowError, ValueError, RecursionError, IsADirectoryError); a NaN timeout made a lease never
stale. Now the lease is read like a manifest: a regular file inside the store, read with a bound,
its fields validated. A lease whose bytes are not a valid lease is taken over with a warning, as an
unreadable one always was; a lease that is no file at all (a FIFO, a directory, a device, a link)
is refused with an error that says what it is and what to do.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptflow.storage import CheckpointStore, LeaseInfo, StoreLockedError, read_lease, refuse_if_held
from ckptflow.storage.versions.lease import LEASE_FILE


def within(seconds: float, work: Any) -> Any:
    """``work()``'s result or error, failing the test if it takes longer than ``seconds`` (a hang)."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = work()
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds}s: it hangs"
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def take_and_save(store: CheckpointStore) -> int:
    with store.lease(owner="after", timeout=60) as held:
        assert read_lease(store.loc).token == held.token
        return store.save({"x": torch.ones(2)}).version


def valid_fields() -> dict[str, Any]:
    now = time.time()
    info = LeaseInfo("someone", "other-host", 4242, now - 10, now - 5, 60.0, "a" * 32)
    return json.loads(info.to_json())


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "store").mkdir()
    return tmp_path / "store"


class TestNotAFile:
    """What is no regular file at ``lease.json`` is refused at once, naming what it is."""

    def test_a_fifo_does_not_hang_the_lease_or_the_run_check(self, root: Path) -> None:
        os.mkfifo(root / LEASE_FILE)
        store = CheckpointStore(root)
        for attempt in (lambda: store.lease().__enter__(), lambda: refuse_if_held(store.loc)):
            with pytest.raises(StoreLockedError) as caught:
                within(10, attempt)
            message = str(caught.value)
            assert "is a FIFO, not a regular file" in message and "remove it" in message, message

    def test_a_symlink_out_of_the_store_is_not_read(self, root: Path, tmp_path: Path) -> None:
        secret = tmp_path / "secret.json"
        secret.write_text(json.dumps({**valid_fields(), "owner": "TOP SECRET"}))
        (root / LEASE_FILE).symlink_to(secret)
        with pytest.raises(StoreLockedError) as caught:
            within(10, lambda: CheckpointStore(root).lease().__enter__())
        assert "symlink" in str(caught.value) and "TOP SECRET" not in str(caught.value)
        assert secret.read_text().count("TOP SECRET") == 1  # the target is left alone

    def test_a_link_to_dev_zero_is_not_read(self, root: Path) -> None:
        (root / LEASE_FILE).symlink_to("/dev/zero")
        with pytest.raises(StoreLockedError, match="symlink"):
            within(10, lambda: CheckpointStore(root).lease().__enter__())

    def test_a_directory_is_refused_in_a_sentence(self, root: Path) -> None:
        (root / LEASE_FILE).mkdir()
        with pytest.raises(StoreLockedError, match="is a directory, not a regular file"):
            within(10, lambda: CheckpointStore(root).lease().__enter__())
        with pytest.raises(StoreLockedError, match="is a directory"):
            CheckpointStore(root).save({"x": torch.ones(2)})


class TestBadContents:
    """A regular file whose bytes are no valid lease is an unreadable lease: taken over, with a warning."""

    def test_a_sparse_giant_is_not_read_whole(self, root: Path, caplog) -> None:
        with open(root / LEASE_FILE, "wb") as f:
            f.truncate(8 << 30)  # 8 GiB of holes: reading it whole would take the memory
        with caplog.at_level("WARNING"):
            assert within(20, lambda: take_and_save(CheckpointStore(root))) == 0
        assert "unreadable lease" in caplog.text

    @pytest.mark.parametrize(
        "field, value",
        [
            ("renewed", 1e300),
            ("renewed", math.nan),
            ("started", math.inf),
            ("timeout", math.nan),
            ("timeout", -5.0),
            ("timeout", 1e300),
            ("pid", 10**30),
            ("pid", -1),
            ("host", {"not": "a string"}),
            ("token", ""),
        ],
    )
    def test_a_field_out_of_range_reads_as_unreadable(self, root: Path, field: str, value: Any, caplog):
        fields = {**valid_fields(), field: value}
        (root / LEASE_FILE).write_text(json.dumps(fields))  # json writes NaN and Infinity as Python does
        assert read_lease(CheckpointStore(root).loc) is None
        with caplog.at_level("WARNING"):
            assert within(20, lambda: take_and_save(CheckpointStore(root))) == 0
        assert "unreadable lease" in caplog.text

    def test_deep_json_reads_as_unreadable(self, root: Path) -> None:
        (root / LEASE_FILE).write_text("[" * 100_000 + "]" * 100_000)
        assert read_lease(CheckpointStore(root).loc) is None
        assert within(20, lambda: take_and_save(CheckpointStore(root))) == 0

    def test_a_valid_foreign_lease_still_holds_the_store(self, root: Path) -> None:
        (root / LEASE_FILE).write_text(json.dumps(valid_fields()))
        with pytest.raises(StoreLockedError, match="someone"):
            CheckpointStore(root).lease().__enter__()
