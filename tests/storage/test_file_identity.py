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
from tests.storage.test_dedup import dense, fine_tune, save_by, verify_all


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

    def test_a_version_directory_gc_removes_before_its_claim_is_made_again(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """The instant the test above met at random: ``gc(min_age=0)`` removed the new, still empty
        version directory between its making and the claim. Before, the save failed with a raw
        ``FileNotFoundError``."""
        from ckptflow.storage.versions import claims

        store = CheckpointStore(tmp_path / "s")
        store.save(dense(0))
        real, removed = claims.fsync_dir, []

        def gc_meanwhile(path: str) -> None:
            real(path)
            empties = [p for p in Path(path).iterdir() if p.is_dir() and not any(p.iterdir())]
            for empty in empties[: 1 - len(removed)]:  # once, as a gc beside the writer would
                removed.append(empty.name)
                assert store.gc(min_age=0) == [int(empty.name[1:])]

        monkeypatch.setattr(claims, "fsync_dir", gc_meanwhile)
        store.save(dense(1))
        monkeypatch.setattr(claims, "fsync_dir", real)
        assert removed == ["v000001"]
        assert [v.version for v in store.versions()] == [0, 1]
        assert_same_state(CheckpointStore(tmp_path / "s").load(version=1), dense(1))


def test_prune_says_what_each_removal_frees_when_other_versions_keep_its_bytes(tmp_path: Path) -> None:
    """Before, ``prune`` printed "removed version 0 (278.6 KiB)" though nearly all of those bytes
    stayed, read by the kept versions; now each line says what its removal freed."""
    from typer.testing import CliRunner

    from ckptflow.flows.cli import app
    from ckptflow.storage.format.names import version_dir

    root = tmp_path / "s"
    store = CheckpointStore(root)
    for step in range(5):
        store.save(fine_tune(step))
    sizes = {v.version: v.size for v in store.versions()}
    own = {
        v: sum(p.stat().st_size for p in (root / version_dir(v)).iterdir()) for v in sizes
    }  # what each directory holds
    done = CliRunner().invoke(app, ["prune", str(root), "--keep-last", "2", "--json"])
    assert done.exit_code == 0, done.output
    doc = json.loads(done.output)
    each = {int(v): n for v, n in doc["freed_bytes_by_version"].items()}
    assert sorted(each) == [0, 1, 2] and sum(each.values()) == doc["freed_bytes"]
    assert each[0] < own[0] // 10  # version 0's base stays: versions 3 and 4 read it
    assert each[1] == own[1] and each[2] == own[2]  # their heads go whole
    for step in (0, 1, 2):
        store.save(fine_tune(10 + step))
    lines = CliRunner().invoke(app, ["prune", str(root), "--keep-last", "1"]).output.splitlines()
    removed = [ln for ln in lines if ln.startswith("removed version")]
    assert len(removed) == 4 and all("freed" in ln and "read by other versions" in ln for ln in removed), (
        lines
    )


def test_the_good_copy_wins_when_a_loose_copy_is_damaged_or_missing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A version held loose and in a tarball: before, a damaged or missing loose file failed the
    load although the tarball held the version intact, and the error did not mention it. Now the
    load reads the tarball's copy, saying so once; verify names the damaged copy and the repair."""
    from typer.testing import CliRunner

    from ckptflow.flows.cli import app
    from ckptflow.storage import CorruptShardError

    root = tmp_path / "s"
    store = CheckpointStore(root)
    for step in range(3):
        store.save(dense(step))
    store.archive([1, 2])  # the loose copies stay
    shard = next((root / "v000001").glob("*.h5"))
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    next((root / "v000002").glob("*.h5")).unlink()
    fresh = CheckpointStore(root)
    with caplog.at_level("WARNING", logger="ckptflow"):
        for _ in range(2):
            assert_same_state(fresh.load(version=1), dense(1))
            assert_same_state(fresh.load(version=2), dense(2))
    told = [r.getMessage() for r in caplog.records if "reading its copy in" in r.getMessage()]
    assert len(told) == 2 and "epochs-" in told[0], told
    with pytest.raises(CorruptShardError) as caught:
        fresh.verify(1)
    message = str(caught.value)
    assert "version 1's loose copy" in message and shard.name in message and "is intact" in message
    repair = f"ckptflow archive {root} --versions 1 --drop-loose"
    assert repair in message
    done = CliRunner().invoke(app, repair.split()[1:])
    assert done.exit_code == 0, done.output
    assert fresh.verify(1).version == 1 and not (root / "v000001").exists()
    assert_same_state(CheckpointStore(root).load(version=1), dense(1))
    assert fresh.verify(0).version == 0  # a version held once is checked as before


def test_two_stores_never_mix_in_one_mirror(tmp_path: Path) -> None:
    """Before, one maintenance run given two stores and one ``archive.upload_to`` mixed them into
    one mirror, and one store's ``epochs-000001-000002.tar`` overwrote the other's while
    ``verify --all`` on the mirror still said ok. Now the second store is refused, naming both,
    before anything of it is written; and so is a maintenance config that would do it."""
    from pydantic import ValidationError

    from ckptflow.tasks.maintenance import MaintenanceConfig

    mirror = tmp_path / "mirror"
    stores = [CheckpointStore(tmp_path / name) for name in ("a", "b")]
    for seed, store in enumerate(stores):
        for step in range(3):
            store.save(base_tuned(seed, step), epoch=step)
        store.archive([1, 2])
    tar = stores[0].archived()[1].tar
    assert tar == stores[1].archived()[1].tar  # the same name in both stores
    stores[0].mirror_archive(tar, str(mirror), storage_options={})
    stores[0].mirror_version(0, str(mirror), storage_options={})
    before = files_of(mirror)
    for call in (
        lambda: stores[1].mirror_archive(tar, str(mirror), storage_options={}),
        lambda: stores[1].mirror_version(0, str(mirror), storage_options={}),
    ):
        with pytest.raises(CheckpointError, match="belongs to the store at") as caught:
            call()
        assert str(tmp_path / "a") in str(caught.value) and str(tmp_path / "b") in str(caught.value)
    assert files_of(mirror) == before
    copy = CheckpointStore(mirror)
    for version in (0, 1, 2):
        assert_same_state(copy.load(version=version), base_tuned(0, version))
    with pytest.raises(ValidationError, match="a mirror belongs to one store"):
        MaintenanceConfig(
            storages=[str(tmp_path / "a"), str(tmp_path / "b")], archive={"upload_to": str(mirror)}
        )


# -- a property test: ckptflow's operations mixed with a user's ordinary accidents -----------------

ACTS = [
    "save",
    "save",
    "save",
    "async",
    "load",
    "prune",
    "gc",
    "archive",
    "mirror",
    "copy-in",
    "remove-by-hand",
    "set-aside",
]


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_and_accidents_never_leave_a_reported_version_unloadable(
    tmp_path: Path, seed: int
) -> None:
    """After any sequence of saves, loads, prunes, gcs, archives, mirror uploads, and a user's
    accidents (a version copied in from another store whose files have the same names and sizes,
    a version directory removed by hand, an unreadable manifest set aside), every version ckptflow
    reported committed, kept or mirrored loads bitwise, unless the accident itself took its bytes;
    and every save after an accident commits at once."""
    target = StoreTarget("local", str(tmp_path / "s"), None)
    _random_accidents(target, seed, steps=18, scratch=tmp_path)


@pytest.mark.s3
def test_random_operations_and_accidents_on_s3(s3_bucket, tmp_path: Path) -> None:
    bucket, options = s3_bucket
    _random_accidents(StoreTarget("s3", f"s3://{bucket}/run1", options), seed=11, steps=14, scratch=tmp_path)


def _random_accidents(target: StoreTarget, seed: int, *, steps: int, scratch: Path) -> None:
    import random

    rng = random.Random(seed)
    store = target.open()
    other = CheckpointStore(scratch / "other")  # the store versions are copied in from
    for step in range(2):
        other.save(base_tuned(7, step))
    expected: dict[int, dict] = {}  # what each version ckptflow committed holds
    taken: set[int] = set()  # versions an accident took bytes from: nothing is promised of them
    mirrored: dict[int, dict] = {}
    mirror = scratch / "mirror"
    state: dict | None = None
    acts = [*rng.sample(ACTS, len(ACTS)), *(rng.choice(ACTS) for _ in range(steps))]  # each at least once
    for act in acts[: max(steps, len(ACTS))]:
        committed = [v.version for v in store.versions()]
        loose = [v.version for v in store.versions() if not v.archived]
        if act in ("save", "async"):
            kind = rng.choice(["fine", "dense", "same", "other"])
            if kind == "fine" or state is None:
                state = fine_tune(rng.randrange(50))
            elif kind == "dense":
                state = dense(rng.randrange(50))
            elif kind == "other":
                state = base_tuned(7, rng.randrange(50))  # the copied-in store's base: its offsets differ
            version = save_by(store, state, asynchronously=act == "async")
            expected[version] = state
            taken.discard(version)  # a number an accident freed, saved again
        elif act == "load" and committed:
            version = rng.choice([v for v in committed if v not in taken] or committed)
            if version not in taken:
                state = store.load(version=version)  # the next save continues from it
                assert_same_state(state, expected[version])
        elif act == "prune" and committed:
            store.prune(keep_last=rng.randint(1, 3))
        elif act == "gc":
            store.gc()
        elif act == "archive" and loose and target.backend == "local":
            chosen = sorted(rng.sample(loose, rng.randint(1, len(loose))))
            if set(chosen) & taken:  # bytes an accident took: refused, naming the missing file
                with pytest.raises(CheckpointError, match="no file"):
                    store.archive(chosen)
                continue
            store.archive(chosen)
            if rng.random() < 0.5:
                store.drop_loose(chosen)
        elif act == "mirror" and target.backend == "local":
            ok = [v for v in loose if v not in taken]
            if ok:
                version = rng.choice(ok)
                store.mirror_version(version, str(mirror), storage_options={})
                mirrored[version] = expected[version]
        elif act == "copy-in":
            number = catalog_next(target)
            source = other.versions()[-1].version
            _copy_version(target, scratch / "other", source, number)
            taken.add(number)  # a version of another store under our number: its references are not here
        elif act == "remove-by-hand" and loose:
            gone = rng.choice(loose)
            users = {v for v in committed if _references(target, v, gone)}
            target.raw_remove(f"v{gone:06d}")
            taken.update(users | {gone})
        elif act == "set-aside" and committed:
            top = max(committed)
            if top in loose and top not in taken:
                target.raw_write(f"v{top:06d}/manifest.json", b"{damaged")
                store.set_aside_unreadable()
                taken.add(top)
                state = None
        fresh = target.open()
        for info in fresh.versions():
            if info.version not in taken:
                assert_same_state(fresh.load(version=info.version), expected[info.version])
        if mirrored:
            copy = CheckpointStore(mirror)
            for version, want in mirrored.items():
                assert_same_state(copy.load(version=version), want)
    version = target.open().save(dense(99)).version  # a save after any accident commits at once
    assert_same_state(target.open().load(version=version), dense(99))


def catalog_next(target: StoreTarget) -> int:
    """A number above every version directory of the store (where a user's copy would go)."""
    numbers = [int(n[1:]) for n in target.raw_version_dirs()]
    return max(numbers, default=-1) + 1


def _copy_version(target: StoreTarget, source_root: Path, source: int, number: int) -> None:
    """Copy a version directory of a local store into ``target`` under ``number``, its manifest's
    version set to that number (as a user renaming a copied directory would have to, to load it)."""
    from ckptflow.storage.format.manifest import SEAL_KEY, sealed_json

    for path in sorted((source_root / f"v{source:06d}").iterdir()):
        data = path.read_bytes()
        if path.name == "manifest.json":
            raw = json.loads(data)
            raw["version"] = number
            data = sealed_json({k: v for k, v in raw.items() if k != SEAL_KEY}, SEAL_KEY)
        target.raw_write(f"v{number:06d}/{path.name}", data)


def _references(target: StoreTarget, version: int, gone: int) -> bool:
    """Whether committed ``version`` reads a file of version ``gone``'s directory."""
    if version == gone:
        return True
    try:
        raw = json.loads(target.raw_read(f"v{version:06d}/manifest.json"))
    except (FileNotFoundError, ValueError):
        return False
    return any(s.get("version") == gone for s in raw["shards"])


def test_a_mirror_written_before_store_identities_is_taken_only_when_it_is_this_store_s(
    tmp_path: Path,
) -> None:
    """A mirror an older ckptflow wrote has no ``store.json``: it is this store's mirror when the
    manifests it holds are the store's own, byte for byte, and refused otherwise."""
    mirror, stranger = tmp_path / "mirror", tmp_path / "stranger"
    store = CheckpointStore(tmp_path / "s")
    for step in range(3):
        store.save(fine_tune(step))
    store.mirror_version(0, str(mirror), storage_options={})
    other = CheckpointStore(tmp_path / "o")
    other.save(base_tuned(3, 0))
    other.mirror_version(0, str(stranger), storage_options={})
    for where in (tmp_path / "s", mirror, stranger):
        (where / "store.json").unlink()  # as an older ckptflow left them
    store.mirror_version(2, str(mirror), storage_options={})
    assert_same_state(CheckpointStore(mirror).load(version=2), fine_tune(2))
    assert (
        json.loads((mirror / "store.json").read_bytes())["id"]
        == json.loads((tmp_path / "s" / "store.json").read_bytes())["id"]
    )
    before = files_of(stranger)
    with pytest.raises(CheckpointError, match=r"holds versions of another store .*v000000/manifest\.json"):
        store.mirror_version(1, str(stranger), storage_options={})
    assert files_of(stranger) == before


def test_a_removal_that_meets_a_changed_store_fails_with_a_checkpoint_error_naming_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, ``gc`` beside a writer raised a raw ``OSError: Directory not empty``."""
    import errno
    import os

    from ckptflow.storage.versions import commit as protocol

    store = CheckpointStore(tmp_path / "s")
    for step in range(3):
        store.save(dense(step))
    (tmp_path / "s" / "v000007").mkdir()
    (tmp_path / "s" / "v000007" / "half.h5").write_bytes(b"left by a crash")
    real = protocol.remove_version

    def refilled(loc, version, **kwargs):  # a writer put a file back into the directory meanwhile
        path = loc.path(f"v{version:06d}")
        raise OSError(errno.ENOTEMPTY, os.strerror(errno.ENOTEMPTY), path)

    monkeypatch.setattr(protocol, "remove_version", refilled)
    for call in (store.gc, lambda: store.prune(keep_last=1)):
        with pytest.raises(CheckpointError, match=r"failed at .*/s/v00000[07]: Directory not empty"):
            call()
    monkeypatch.setattr(protocol, "remove_version", real)
    # the prune had removed the manifests of 0 and 1 (first, as ever): their files are garbage now
    assert store.gc() == [0, 1, 7] and [v.version for v in store.versions()] == [2]
    assert_same_state(CheckpointStore(tmp_path / "s").load(), dense(2))


def test_a_copy_of_a_store_trained_on_never_replaces_a_mirrored_version(tmp_path: Path) -> None:
    """A store copied by hand shares its identity, so the copy may upload to the mirror; a version
    the mirror holds is never replaced by another of the same number, and the refusal says so
    before anything of it is written."""
    mirror = tmp_path / "mirror"
    store = CheckpointStore(tmp_path / "s")
    for step in range(2):
        store.save(dense(step))
        store.mirror_version(step, str(mirror), storage_options={})
    shutil.copytree(tmp_path / "s", tmp_path / "copy")
    store.save(dense(10))
    store.mirror_version(2, str(mirror), storage_options={})
    copy = CheckpointStore(tmp_path / "copy")
    assert copy.save(dense(20)).version == 2
    before = files_of(mirror)
    with pytest.raises(CheckpointError, match="holds another version under that number"):
        copy.mirror_version(2, str(mirror), storage_options={})
    assert files_of(mirror) == before
    assert_same_state(CheckpointStore(mirror).load(version=2), dense(10))
