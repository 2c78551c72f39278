"""A damaged archive index is reported, never hides its versions silently, and is rebuilt from its tarball.

Before, a corrupt index made its versions vanish from ``ls`` (exit 0, no note), ``verify --all``
passed, and ``load(1)`` said "version 1 is not committed" without naming the index.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ckptflow.storage import CheckpointStore, StoreOptions, VersionNotFoundError
from tests.test_cli import invoke


@pytest.fixture
def archived(tmp_path: Path) -> tuple[str, Path]:
    """Versions 1-3 in epochs-000001-000003.tar (no loose copies) and version 4 loose."""
    url = str(tmp_path / "store")
    store = CheckpointStore(url, options=StoreOptions(shards=2))
    for epoch in range(1, 5):
        store.save({"w": torch.full((64,), float(epoch)), "e": epoch}, epoch=epoch)
    store.archive([1, 2, 3])
    store.drop_loose([1, 2, 3])
    return url, Path(url) / "archive" / "epochs-000001-000003.index.json"


def test_a_corrupt_index_is_reported_by_ls_verify_and_load(archived: tuple[str, Path]) -> None:
    url, index = archived
    index.write_text(index.read_text()[:-30])  # truncated
    listing = invoke("ls", url, "--json")
    assert listing.exit_code == 0
    document = json.loads(listing.stdout)
    assert [v["version"] for v in document["versions"]] == [4]
    [bad] = document["unreadable_archives"]
    assert bad["tar"] == "epochs-000001-000003.tar" and "not valid JSON" in bad["error"]
    text = invoke("ls", url, env={"COLUMNS": "250"}).stdout
    assert "note: the index of archive/epochs-000001-000003.tar is unreadable" in text and "--reindex" in text
    verify = invoke("verify", url, "--all")
    assert verify.exit_code == 1
    assert "epochs-000001-000003.tar is unreadable" in verify.stderr
    with pytest.raises(VersionNotFoundError, match=r"epochs-000001-000003\.index\.json cannot be read"):
        CheckpointStore(url).load(1)


def test_reindex_rebuilds_the_index_and_keeps_the_damaged_one(archived: tuple[str, Path]) -> None:
    url, index = archived
    original = json.loads(index.read_text())
    index.write_text("{not json")
    result = invoke("archive", url, "--reindex")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().endswith("epochs-000001-000003.tar: versions 1, 2, 3")
    store = CheckpointStore(url)
    assert [v.version for v in store.versions()] == [1, 2, 3, 4]
    for v in (1, 2, 3):
        assert torch.equal(store.load(v)["w"], torch.full((64,), float(v)))
        store.verify(v)
    rebuilt = json.loads(index.read_text())
    assert rebuilt["members"] == original["members"]
    assert (rebuilt["size"], rebuilt["checksum"]) == (original["size"], original["checksum"])
    [kept] = index.parent.glob("epochs-000001-000003.index.json.unreadable-*")
    assert kept.read_text() == "{not json"
    assert invoke("verify", url, "--all").exit_code == 0
    assert invoke("archive", url, "--reindex").stdout.startswith("every tarball index")


def test_reindex_refuses_a_damaged_tarball(archived: tuple[str, Path]) -> None:
    url, index = archived
    index.write_text("{not json")
    tar = index.parent / "epochs-000001-000003.tar"
    data = bytearray(tar.read_bytes())
    data[len(data) // 3] ^= 0xFF
    tar.write_bytes(bytes(data))
    result = invoke("archive", url, "--reindex")
    assert result.exit_code == 1
    assert "the tarball is damaged" in result.stderr or "cannot rebuild" in result.stderr, result.stderr
    assert index.read_text() == "{not json"  # nothing written


def test_nothing_is_written_while_an_index_cannot_be_read(archived: tuple[str, Path]) -> None:
    """Its versions' numbers are unknown: a new save could take one, and a reindex would then bring
    back two versions of one number (the newer one lost to drop_loose)."""
    from ckptflow.storage import CheckpointError

    url, index = archived
    index.write_text("{not json")
    store = CheckpointStore(url)
    for epoch in (2, 9):
        with pytest.raises(CheckpointError, match="--reindex"):
            store.save({"w": torch.ones(2)}, epoch=epoch)
    assert sorted(p.name for p in Path(url).glob("v0*")) == ["v000004"]
    assert invoke("archive", url, "--reindex").exit_code == 0
    assert store.save({"w": torch.ones(2)}, epoch=5).version == 5


def test_nothing_is_set_aside_while_an_index_cannot_be_read(archived: tuple[str, Path]) -> None:
    """The versions of that tarball are unknown: one of them may be the newest, so an unreadable
    version above the others is not known to be above it. Before, the store moved it aside anyway;
    only the pipeline checked the indexes first."""
    from ckptflow.storage import CheckpointError

    url, index = archived
    store = CheckpointStore(url)
    store.save({"w": torch.ones(2)}, epoch=5)
    manifest = Path(url) / "v000005" / "manifest.json"
    manifest.write_text('{"format": "ckptflow-checkpoint"')
    index.write_text("{not json")
    with pytest.raises(CheckpointError, match="--reindex"):
        store.set_aside_unreadable()
    assert sorted(p.name for p in Path(url).glob("v0*")) == ["v000004", "v000005"]  # nothing moved
    assert invoke("archive", url, "--reindex").exit_code == 0
    assert [v for v, _, _ in store.set_aside_unreadable()] == [5]
