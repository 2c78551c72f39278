"""The maintenance flow prunes and collects only under the store's writer lease.

Bug fixed (issue 35): maintenance skipped a store only while a Prefect training run
was active on it; a writer outside Prefect (a training script holding the lease)
had its versions pruned and its saves in flight collected. Now the flow holds the
store's lease for archiving, retention and gc, and a store another live writer
holds is only published, the holder named in the report and the run's log.
"""

from __future__ import annotations

import pytest
import torch

from ckptflow.flows.maintenance import maintain_stores
from ckptflow.storage import CheckpointStore, read_lease
from ckptflow.storage.versions.lease import LEASE_FILE
from tests.conftest import StoreTarget
from tests.storage.test_single_writer import Writer

pytestmark = pytest.mark.prefect

CONFIG = {"retention": {"keep_last": 1}, "gc": True, "publish": False}


def test_a_store_held_by_a_writer_is_not_pruned_or_collected(prefect_server, tmp_path):
    target = StoreTarget("local", str(tmp_path / "store"), None)
    writer = Writer.holding(target, tmp_path / "go")
    try:
        target.raw_write("v000050/shard-r0-00.h5", b"a save in flight")

        [report] = maintain_stores({"storages": [target.url], **CONFIG})
        assert report["busy"] == ["writer 1"]
        assert (report["pruned"], report["gc"]) == ([], [])
        assert [v.version for v in CheckpointStore(target.url).versions()] == [0, 1, 2]
        assert target.raw_exists("v000050/shard-r0-00.h5")
        assert read_lease(CheckpointStore(target.url).loc).pid == writer.proc.pid
    finally:
        writer.kill()

    [report] = maintain_stores({"storages": [target.url], **CONFIG})  # the writer is gone
    assert (report["busy"], report["pruned"], report["gc"]) == ([], [0, 1], [50])
    assert [v.version for v in CheckpointStore(target.url).versions()] == [2]
    assert not target.raw_exists(LEASE_FILE)


def test_the_flow_holds_the_lease_while_it_prunes(prefect_server, tmp_path, monkeypatch):
    url = str(tmp_path / "store")
    store = CheckpointStore(url)
    for epoch in range(3):
        store.save({"w": torch.full((8,), float(epoch))}, epoch=epoch)
    holders = []
    real = CheckpointStore.apply_retention

    def apply_retention(self, policy):
        holders.append(read_lease(self.loc))
        return real(self, policy)

    monkeypatch.setattr(CheckpointStore, "apply_retention", apply_retention)
    [report] = maintain_stores({"storages": [url], **CONFIG})
    assert report["pruned"] == [0, 1]
    assert len(holders) == 1 and holders[0] is not None
    assert holders[0].owner.startswith("ckptflow maintenance (flow run ")
