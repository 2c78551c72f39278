"""Bytes are known by what they are, never by name and size (issue 52).

Every shard file carries an identity in its name (a random token the save that wrote it chose),
and the manifest lists that name: a file is referenced by a later save, skipped by a mirror, or kept
by a removal only when the file there is the one recorded. Each test below is an ordinary situation
that, before, ended with a version reported saved, mirrored or kept that did not load.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ckptflow.storage import CheckpointError, CheckpointStore

from tests.conftest import StoreTarget, assert_same_state
from tests.storage.test_dedup import dense, fine_tune, verify_all


def base_tuned(seed: int, step: int) -> dict:
    """:func:`fine_tune`'s shape with another frozen base per ``seed``: two stores of the same
    model whose files have the same names and sizes and other bytes."""
    state = fine_tune(step)
    gen = torch.Generator().manual_seed(1000 + seed)
    state["model"]["base.weight"] = torch.randn(256, 256, generator=gen)
    return state


def test_every_shard_file_a_save_writes_carries_its_own_identity(tmp_path: Path) -> None:
    """The same state saved into two stores: the same bytes, in files of other identities."""
    from ckptflow.storage.format.names import file_identity

    for name in ("a", "b"):
        store = CheckpointStore(tmp_path / name)
        store.save(fine_tune(0))
        store.save(dense(1))
    names = [p.name for p in sorted(tmp_path.rglob("*.h5"))]
    ids = [file_identity(n) for n in names]
    assert len(names) == 4 and None not in ids and len(set(ids)) == 4
    raw = json.loads((tmp_path / "a" / "v000001" / "manifest.json").read_bytes())
    assert [s["file"] for s in raw["shards"]] == [
        p.name for p in sorted((tmp_path / "a" / "v000001").glob("*.h5"))
    ]


def test_a_referenced_version_removed_by_hand_heals_at_the_next_save(target: StoreTarget) -> None:
    """Reproduction 1: ``rm -rf v000000`` under versions that reference its base. Before, every
    later save referenced the missing file again and failed ("save again", which never worked)."""
    store = target.open()
    for step in range(3):
        store.save(fine_tune(step))
    target.raw_remove("v000000")
    info = store.save(fine_tune(3))  # the same process, whose index named version 0's file
    assert info.version == 3
    other = target.open()  # and a new process
    assert other.save(fine_tune(4)).version == 4
    for version in (3, 4):
        assert_same_state(target.open().load(version=version), fine_tune(version))
    # the healed save wrote the base again, once: version 4 references version 3's copy
    raw = json.loads(target.raw_read("v000004/manifest.json"))
    assert {s.get("version") for s in raw["shards"]} == {None, 3}


def test_a_version_copied_in_from_another_store_never_lends_that_store_s_offsets(tmp_path: Path) -> None:
    """Reproduction 2: a version directory copied from store A into store B, whose own older
    files have the same names and sizes. Before, the next save in B of A's state referenced B's
    files at A's offsets, returned success, and failed its checksums on load (unverified: it loaded
    B's base in place of A's)."""
    a, b = CheckpointStore(tmp_path / "a"), CheckpointStore(tmp_path / "b")
    for step in range(3):
        a.save(base_tuned(1, step))
    for step in range(2):
        b.save(base_tuned(2, step))
    shutil.copytree(tmp_path / "a" / "v000002", tmp_path / "b" / "v000002")  # A's version 2, by hand
    b = CheckpointStore(tmp_path / "b")
    info = b.save(base_tuned(1, 5))  # training goes on in B from A's state
    assert info.version == 3
    fresh = CheckpointStore(tmp_path / "b")
    assert_same_state(fresh.load(version=3), base_tuned(1, 5))
    assert_same_state(fresh.load(version=3, verify=False), base_tuned(1, 5))
    found = verify_all(fresh)
    assert found[3] is None and found[0] is None and found[1] is None
    assert found[2] is not None and "v000000" in found[2]  # the copy itself lacks A's base: said so


def test_a_reused_mirror_url_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """Reproduction 3: the mirror holds an earlier run's ``v000000`` of the same size. Before,
    ``mirror_version`` skipped the referenced base there, counted the version as mirrored, and it
    did not load from the mirror. Now a mirror belongs to one store: another store is refused,
    naming both, and nothing is written."""
    mirror = tmp_path / "mirror"
    first = CheckpointStore(tmp_path / "old")
    for step in range(2):
        first.save(base_tuned(1, step))
    first.mirror_version(0, str(mirror), storage_options={})
    before = files_of(mirror)
    second = CheckpointStore(tmp_path / "new")
    for step in range(3):
        second.save(base_tuned(2, step))
    with pytest.raises(CheckpointError) as caught:
        second.mirror_version(2, str(mirror), storage_options={})
    message = str(caught.value)
    assert str(mirror) in message and str(tmp_path / "old") in message and str(tmp_path / "new") in message
    assert files_of(mirror) == before
    assert_same_state(CheckpointStore(mirror).load(version=0), base_tuned(1, 0))
    fresh = tmp_path / "fresh-mirror"
    second.mirror_version(2, str(fresh), storage_options={})
    assert_same_state(CheckpointStore(fresh).load(version=2), base_tuned(2, 2))


def files_of(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_setting_aside_an_unreadable_version_keeps_the_files_committed_versions_reference(
    tmp_path: Path,
) -> None:
    """Reproduction 4: a committed version references a file of a version whose manifest became
    unreadable. Before, ``set_aside_unreadable`` moved the whole directory and the committed
    version failed to load."""
    root = tmp_path / "s"
    store = CheckpointStore(root)
    store.save(fine_tune(0), version=7)
    store.save(fine_tune(1), version=3)  # an explicit, lower number: it references version 7's base
    raw = json.loads((root / "v000003" / "manifest.json").read_bytes())
    assert {s.get("version") for s in raw["shards"]} == {None, 7}
    (root / "v000007" / "manifest.json").write_bytes(b"{not json")
    moved = CheckpointStore(root).set_aside_unreadable()
    assert [v for v, _, _ in moved] == [7]
    fresh = CheckpointStore(root)
    assert_same_state(fresh.load(version=3), fine_tune(1))
    assert verify_all(fresh) == {3: None}
    aside = [p for p in root.iterdir() if ".unreadable-" in p.name]
    assert len(aside) == 1 and (aside[0] / "manifest.json").read_bytes() == b"{not json"


class TestHousekeepingBesideAWriter:
    """``gc`` and ``prune`` beside a process saving without the writer lease (the library's plain
    ``store.save``). Before, ``gc(min_age=0)`` removed its saves in flight, and both processes met
    raw ``FileNotFoundError`` / ``OSError: Directory not empty``."""

    def test_gc_and_prune_spare_the_saves_in_flight_and_fail_only_with_checkpoint_errors(
        self, target: StoreTarget, tmp_path: Path
    ) -> None:
        import time

        from tests.storage.test_single_writer import Writer, committed_lines

        writer = Writer.start(target, 1, 25, tmp_path / "go")
        try:
            writer.wait_line("ready")
            (tmp_path / "go").touch()
            store = target.open()
            errors: list[BaseException] = []
            rounds = 0
            while writer.proc.poll() is None:
                for call in (lambda: store.gc(min_age=0), lambda: store.prune(keep_last=3)):
                    try:
                        call()
                    except CheckpointError as exc:  # refused or failed, naming what: allowed
                        errors.append(exc)
                    rounds += 1
                time.sleep(0.2)
            lines = writer.finish()
        finally:
            writer.kill()
        assert writer.proc.returncode == 0, "\n".join(lines)
        # a save is refused while maintenance holds the lease (one writer at a time), never cut off
        refused = [ln for ln in lines if ln.startswith("failed") and " StoreLockedError " in ln]
        others = [ln for ln in lines if not ln.startswith(("ready", "committed")) and ln not in refused]
        assert not others, "\n".join(lines)
        assert committed_lines(lines) and rounds >= 2, "\n".join(lines)
        assert not [e for e in errors if target.url not in str(e)], errors
        fresh = target.open()
        kept = [v.version for v in fresh.versions()]
        assert kept and all(error is None for error in verify_all(fresh).values())
