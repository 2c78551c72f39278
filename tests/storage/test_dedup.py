"""Content-addressed saves (format 8): a save writes only the bytes no committed version holds and
references the rest; everything around a version (load, verify, prune, delete, gc, archive, extract,
mirror) follows the references, and removal never takes bytes a committed version references.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch

from ckptflow.storage import CheckpointError, CheckpointStore, StoreOptions
from ckptflow.storage.format.manifest import SHARED_FORMAT_VERSION
from tests.conftest import StoreTarget, assert_same_state, named, plain_name

FROZEN_ROWS, HEAD_ROWS = 256, 8  # the base: 256x256 float32 = 256 KiB; the head: 8 KiB


def fine_tune(step: int) -> dict:
    """A frozen base (~97% of the bytes) and a head plus its optimizer state that change each step."""
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(FROZEN_ROWS, 256, generator=gen)
    return {
        "model": {
            "base.weight": base,
            "base.bias": torch.zeros(256),
            "head.weight": torch.full((HEAD_ROWS, 256), float(step)),
        },
        "optimizer": {"exp_avg": torch.full((HEAD_ROWS, 256), step / 10), "step": torch.tensor(step)},
        "step": step,
    }


def dense(step: int) -> dict:
    gen = torch.Generator().manual_seed(step)
    return {"w": torch.randn(300, 300, generator=gen), "b": torch.randn(300, generator=gen)}


def manifest(store: CheckpointStore, version: int) -> dict:
    return json.loads((Path(store.url) / f"v{version:06d}" / "manifest.json").read_bytes())


def verify_all(store: CheckpointStore) -> dict[int, str | None]:
    """Each committed version's verify error (None: it verifies)."""
    found: dict[int, str | None] = {}
    for info in store.versions():
        try:
            store.verify(info.version)
            found[info.version] = None
        except CheckpointError as exc:
            found[info.version] = str(exc)
    return found


def files(root: Path) -> dict[str, int]:
    """Every file under ``root`` by its path, shard files without their identity (:func:`plain_name`)."""
    return {
        plain_name(str(p.relative_to(root))): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()
    }


def base_file(root: Path, version: int = 0) -> Path:
    """Version ``version``'s one shard file (the frozen base of :func:`fine_tune`)."""
    return (
        root
        / f"v{version:06d}"
        / named([p.name for p in (root / f"v{version:06d}").iterdir()], "shard-r0-00.h5")
    )


def test_a_frozen_base_is_written_once_and_every_version_loads_bitwise(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "s")
    infos = [store.save(fine_tune(step), step=step) for step in range(6)]
    first, later = infos[0], infos[1:]
    changed = 2 * HEAD_ROWS * 256 * 4  # the head and its optimizer state
    for info in later:
        assert info.new_bytes < changed * 1.1 + (16 << 10)  # the head's bytes and an HDF5 header
        assert info.size >= first.size  # it reads the base from version 0's file
    assert sum(files(tmp_path / "s").values()) < first.size + 5 * (changed + (24 << 10))
    raw = manifest(store, 5)
    assert raw["format_version"] == SHARED_FORMAT_VERSION
    assert [s.get("version") for s in raw["shards"]] == [None, 0]  # its own file, and version 0's
    assert all(len(b["checksum"]) == 32 for b in raw["blobs"])  # xxh3-128: the content keys
    fresh = CheckpointStore(tmp_path / "s")
    for step in range(6):
        assert_same_state(fresh.load(version=step), fine_tune(step))
    assert verify_all(fresh) == {v: None for v in range(6)}


def test_an_unchanged_state_saved_again_writes_no_tensor_bytes(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "s")
    state = dense(0)
    first = store.save(state)
    again = store.save(state)
    assert again.new_bytes == 0  # no shard file of its own: every blob is version 0's
    assert again.size == first.size
    assert sorted(files(tmp_path / "s/v000001")) == ["manifest.json"]
    assert_same_state(CheckpointStore(tmp_path / "s").load(version=1), state)


def test_dense_training_references_nothing(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "s")
    infos = [store.save(dense(step)) for step in range(3)]
    assert [i.new_bytes for i in infos] == [i.size for i in infos]
    assert all("version" not in s for s in manifest(store, 2)["shards"])


def test_no_dedup_writes_full_copies_in_the_older_format(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "s", options=StoreOptions(dedup=False))
    infos = [store.save(fine_tune(step)) for step in range(3)]
    assert infos[1].new_bytes == infos[1].size == infos[0].size
    raw = manifest(store, 2)
    assert raw["format_version"] < SHARED_FORMAT_VERSION  # readable by ckptflow before format 8
    assert all(len(b["checksum"]) == 16 for b in raw["blobs"])
    # A store with dedup after it: those manifests hold no content keys, so it writes the base once
    # more, then references it.
    deduped = CheckpointStore(tmp_path / "s")
    assert deduped.save(fine_tune(9)).new_bytes == infos[0].size
    assert deduped.save(fine_tune(10)).new_bytes < infos[0].size / 4


def test_async_saves_share_bytes_too(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "s")
    for step in range(3):
        handle = store.save_async(fine_tune(step), step=step)
        handle.wait()
    infos = store.versions()
    assert infos[2].new_bytes < infos[0].size / 4
    for step in range(3):
        assert_same_state(CheckpointStore(tmp_path / "s").load(version=step), fine_tune(step))


def test_a_load_resumes_the_sharing(tmp_path: Path) -> None:
    CheckpointStore(tmp_path / "s").save(fine_tune(0))
    resumed = CheckpointStore(tmp_path / "s")  # a new process: its first save references version 0
    resumed.load()
    assert resumed.save(fine_tune(1)).new_bytes < resumed.versions()[0].size / 4


def test_a_tensor_changed_only_in_its_middle_is_written_again(tmp_path: Path) -> None:
    """A large blob is hashed before the write only when its first and last 4 KiB match a held
    blob's: a change between them still shows in its content key."""
    store = CheckpointStore(tmp_path / "s")
    big = torch.randn(256, 1024)
    store.save({"big": big, "frozen": torch.ones(1024, 1024)})
    changed = big.clone()
    changed[128, 500] += 1.0  # outside the samples
    info = store.save({"big": changed, "frozen": torch.ones(1024, 1024)})
    assert info.new_bytes >= big.numel() * 4  # big written again; frozen referenced
    assert info.new_bytes < info.size
    fresh = CheckpointStore(tmp_path / "s")
    assert torch.equal(fresh.load(version=1)["big"], changed)
    assert torch.equal(fresh.load(version=0)["big"], big)


def test_a_file_that_supplies_little_is_not_kept_alive(tmp_path: Path) -> None:
    """A version references a shard only when it supplies at least a quarter of its bytes."""
    store = CheckpointStore(tmp_path / "s", options=StoreOptions(shards=1))
    small = torch.arange(100.0)
    store.save({"big": torch.randn(1000, 1000), "small": small})
    info = store.save({"big": torch.randn(1000, 1000), "small": small})
    assert info.new_bytes == info.size  # "small" is written again, version 0's file not referenced
    assert all("version" not in s for s in manifest(store, 1)["shards"])


def test_prune_keeps_the_bytes_kept_versions_reference_and_says_what_it_freed(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store = CheckpointStore(root)
    for step in range(5):
        store.save(fine_tune(step))
    plan = store.apply_retention(_policy(keep_last=2))
    assert plan.remove == (0, 1, 2)
    assert plan.freed is not None and 0 < plan.freed < 3 * (40 << 10)  # the heads, not the base
    assert sorted(files(root / "v000000")) == ["shard-r0-00.h5"]  # version 0's base stays, no manifest
    assert not (root / "v000001").exists() and not (root / "v000002").exists()
    assert [v.version for v in store.versions()] == [3, 4]
    for step in (3, 4):
        assert_same_state(CheckpointStore(root).load(version=step), fine_tune(step))
    assert store.gc() == []  # what version 0's directory keeps is not garbage
    assert base_file(root).exists()
    store.delete(3)
    store.delete(4)  # nothing references version 0's file now
    report = store.collect_garbage()
    assert report.removed.versions == (0,) and report.freed > FROZEN_ROWS * 256 * 4
    assert not (root / "v000000").exists()


def test_an_unreadable_manifest_makes_removals_keep_every_shard_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """What an unreadable manifest references is unknown: a prune keeps every shard file of the
    versions it removes (saying so once), and they load again once the manifest is mended."""
    root = tmp_path / "s"
    store = CheckpointStore(root)
    for step in range(4):
        store.save(fine_tune(step))
    damaged = root / "v000003" / "manifest.json"
    good = damaged.read_bytes()
    damaged.write_bytes(good[: len(good) // 2])
    with caplog.at_level("WARNING", logger="ckptflow"):
        assert store.prune(keep_last=1) == [0, 1]  # version 2 kept; 3 unreadable, not counted
    warned = [r for r in caplog.records if "bytes it references are unknown" in r.getMessage()]
    assert len(warned) == 1, caplog.text
    for version in (0, 1):
        assert [plain_name(p.name) for p in (root / f"v{version:06d}").iterdir()] == ["shard-r0-00.h5"]
    damaged.write_bytes(good)
    assert_same_state(CheckpointStore(root).load(version=3), fine_tune(3))
    store.gc()  # version 1's head is referenced by nothing now; version 0's base by 2 and 3
    assert not (root / "v000001").exists() and base_file(root).exists()


def test_a_removed_version_number_is_not_reused_while_its_bytes_are_referenced(
    tmp_path: Path,
) -> None:
    store = CheckpointStore(tmp_path / "s")
    for step in range(3):
        store.save(fine_tune(step))
    store.prune(keep_last=1)
    with pytest.raises(CheckpointError, match=r"version 0 .* keeps shard-r0-00-[0-9a-f]{16}\.h5"):
        store.save(dense(0), version=0)
    assert_same_state(store.load(version=2), fine_tune(2))
    assert store.save(fine_tune(3)).version == 3


def test_verify_checks_the_bytes_a_version_references(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store = CheckpointStore(root)
    store.save(fine_tune(0))
    store.save(fine_tune(1))
    shard = base_file(root)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # inside the base
    shard.write_bytes(bytes(data))
    problems = verify_all(store)
    assert problems[0] is not None and problems[1] is not None
    assert f"v000000/{shard.name}" in problems[1]
    with pytest.raises(CheckpointError, match=rf"v000000/{shard.name}"):
        CheckpointStore(root).load(version=1)


def test_a_save_never_commits_a_reference_to_a_file_removed_meanwhile(tmp_path: Path) -> None:
    """Another process pruned the version this store's next save references: the save reads what
    it may reference again (its manifest is gone: the store reads the index of the newest)."""
    root = tmp_path / "s"
    store = CheckpointStore(root)
    store.save(fine_tune(0))
    store.save(dense(1))  # now the index holds only the dense state
    store.save(fine_tune(2))  # references nothing of version 1; writes the base again
    CheckpointStore(root).delete(2)  # another store object removes what `store` last committed
    info = store.save(fine_tune(3))
    assert_same_state(CheckpointStore(root).load(version=info.version), fine_tune(3))


def test_a_version_saved_again_under_its_number_is_not_mistaken_for_the_one_removed(
    tmp_path: Path,
) -> None:
    """Bug: the index a store kept of its last save was trusted while a manifest of that number
    existed. Another store object deleted the version and saved another state under its number:
    the next save referenced the new file at the old one's offsets, and failed (its commit check
    found the file changed). The index is now tied to its manifest file, not to its number."""
    root = tmp_path / "s"
    store = CheckpointStore(root)
    store.save(fine_tune(0))
    other = CheckpointStore(root)
    other.delete(0)
    other.save(dense(0), version=0)
    info = store.save(fine_tune(1))
    assert_same_state(CheckpointStore(root).load(version=info.version), fine_tune(1))
    assert verify_all(CheckpointStore(root)) == {0: None, info.version: None}


def test_on_a_filesystem_without_change_times_the_index_is_tied_to_the_manifest_bytes() -> None:
    """memory:// keeps no modification time, ETag or inode: a manifest saved again under the number
    of a deleted version, of the same size, is told apart by its bytes."""
    import uuid

    url = f"memory://dedup-{uuid.uuid4().hex}"
    store = CheckpointStore(url)
    store.save(fine_tune(0))
    other = CheckpointStore(url)
    other.delete(0)
    replaced = fine_tune(0)
    replaced["model"]["base.weight"] = replaced["model"]["base.weight"] * 2  # same shapes and sizes
    other.save(replaced, version=0)
    info = store.save(fine_tune(1))
    assert_same_state(CheckpointStore(url).load(version=info.version), fine_tune(1))
    assert verify_all(CheckpointStore(url)) == {0: None, info.version: None}


def test_archives_are_self_contained_and_extract_gives_a_loadable_store(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store = CheckpointStore(root)
    for step in range(4):
        store.save(fine_tune(step), epoch=step)
    index = store.archive([2, 3])
    names = [plain_name(m.name) for m in index.members]
    assert "v000000/shard-r0-00.h5" in names  # the base the two versions reference
    assert names.count("v000000/shard-r0-00.h5") == 1
    store.drop_loose([2, 3])
    store.prune(keep_last=2)  # versions 0 and 1 go; version 0's loose base is no longer referenced
    store.gc()
    assert not (root / "v000000").exists()
    fresh = CheckpointStore(root)
    for step in (2, 3):
        assert_same_state(fresh.load(version=step), fine_tune(step))
    assert all(e is None for e in verify_all(fresh).values())
    from ckptflow.storage import extract_epoch

    out = tmp_path / "out"
    version, _ = extract_epoch(str(root / "archive" / index.tar), str(out), epoch=3)
    assert version == 3
    assert sorted(files(out)) == ["v000000/shard-r0-00.h5", "v000003/manifest.json", "v000003/shard-r0-00.h5"]
    assert_same_state(CheckpointStore(out).load(version=3), fine_tune(3))


def test_a_mirror_gets_the_referenced_bytes_before_the_manifest(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store = CheckpointStore(root)
    for step in range(3):
        store.save(fine_tune(step))
    mirror = tmp_path / "mirror"
    store.mirror_version(2, str(mirror), storage_options={})
    assert sorted(files(mirror)) == [
        "store.json",  # the store it mirrors (issue 52)
        "v000000/shard-r0-00.h5",
        "v000002/manifest.json",
        "v000002/shard-r0-00.h5",
    ]
    assert_same_state(CheckpointStore(mirror).load(version=2), fine_tune(2))
    base = base_file(mirror)
    before = base.stat().st_mtime_ns
    store.mirror_version(1, str(mirror), storage_options={})  # the base is there already: not sent again
    assert base.stat().st_mtime_ns == before
    assert_same_state(CheckpointStore(mirror).load(version=1), fine_tune(1))


@pytest.mark.parametrize("seed", range(4))
def test_random_sequences_of_saves_prunes_gcs_and_archives_lose_nothing(tmp_path: Path, seed: int) -> None:
    """A property test: after any sequence of saves (frozen-base, dense, unchanged; sync, async),
    prunes, deletes, gcs, archives, dropped loose copies and uploads to a mirror, every committed
    version loads bitwise and verifies (and each uploaded one loads from the mirror)."""
    target = StoreTarget("local", str(tmp_path / "s"), None)
    _random_sequence(target, seed, steps=14, mirror=tmp_path / "mirror")


@pytest.mark.s3
def test_random_sequences_on_s3(s3_bucket) -> None:
    bucket, options = s3_bucket
    _random_sequence(StoreTarget("s3", f"s3://{bucket}/run1", options), seed=7, steps=10)


OPERATIONS = ["save", "save", "save", "async", "prune", "delete", "gc", "archive", "upload", "reload"]


def _random_sequence(target: StoreTarget, seed: int, *, steps: int, mirror: Path | None = None) -> None:
    rng = random.Random(seed)
    store = CheckpointStore(target.url, storage_options=target.storage_options)
    expected: dict[int, dict] = {}
    last: dict | None = None
    for _ in range(steps):
        op = rng.choice(OPERATIONS)
        committed = [v.version for v in store.versions()]
        if op in ("save", "async"):
            kind = rng.choice(["fine", "dense", "same"])
            state = (
                fine_tune(rng.randrange(100))
                if kind == "fine"
                else dense(rng.randrange(100))
                if kind == "dense" or last is None
                else last
            )
            version = save_by(store, state, asynchronously=op == "async")
            expected[version] = state
            last = state
        elif op == "prune" and committed:
            store.prune(keep_last=rng.randint(1, 3))
        elif op == "delete" and len(committed) > 1:
            try:
                store.delete(rng.choice(committed))
            except CheckpointError as exc:  # archived with others: a tarball is removed whole
                assert "removed whole" in str(exc)
        elif op == "gc":
            store.gc()
        elif op == "archive" and target.backend == "local":
            archived = store.archived()
            loose = [v for v in committed if v not in archived]
            if loose:
                chosen = sorted(rng.sample(loose, rng.randint(1, len(loose))))
                store.archive(chosen)
                if rng.random() < 0.5:
                    store.drop_loose(chosen)
        elif op == "upload" and target.backend == "local" and mirror is not None:
            loose = [v for v in committed if v not in store.archived()]
            if loose:  # a loose version up to the mirror: it loads there bitwise, with what it references
                version = rng.choice(loose)
                store.mirror_version(version, str(mirror), storage_options={})
                assert_same_state(CheckpointStore(mirror).load(version=version), expected[version])
        elif op == "reload":
            store = CheckpointStore(target.url, storage_options=target.storage_options)
        fresh = CheckpointStore(target.url, storage_options=target.storage_options)
        for version in [v.version for v in fresh.versions()]:
            assert_same_state(fresh.load(version=version), expected[version])
    fresh = CheckpointStore(target.url, storage_options=target.storage_options)
    assert all(error is None for error in verify_all(fresh).values())


def save_by(store: CheckpointStore, state: dict, *, asynchronously: bool) -> int:
    """Save ``state`` with ``save`` or ``save_async`` (waited for); its version."""
    if not asynchronously:
        return store.save(state).version
    handle = store.save_async(state)
    handle.wait()
    return handle.version


def _policy(**kwargs):
    from ckptflow.storage import RetentionPolicy

    return RetentionPolicy(**kwargs)


def test_the_root_holds_no_version_directory_after_a_full_cleanup(tmp_path: Path) -> None:
    root = tmp_path / "s"
    store = CheckpointStore(root)
    for step in range(4):
        store.save(fine_tune(step))
    for version in range(3, -1, -1):
        store.delete(version)
    store.gc()
    assert [name for name in os.listdir(root) if name.startswith("v")] == []


# -- SIGKILL during removals ----------------------------------------------------------------------

ROOT_DIR = Path(__file__).resolve().parents[2]


def _kill_during(url: str, operation: str, kill_before: int) -> str:
    import subprocess
    import sys

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT_DIR), os.environ.get("PYTHONPATH")])),
    }
    child = ROOT_DIR / "tests" / "children" / "removal_child.py"
    done = subprocess.run(
        [sys.executable, str(child), url, operation, str(kill_before)],
        env=env,
        cwd=ROOT_DIR,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode in (0, -9), done.stderr[-2000:]
    return done.stdout


@pytest.mark.crash
@pytest.mark.parametrize("operation", ["prune", "delete", "gc"])
def test_sigkill_at_every_removal_of_a_prune_delete_or_gc_loses_no_referenced_byte(
    tmp_path: Path, operation: str
) -> None:
    """Version 0 holds the base every version references; version 2 is a dense state; a crashed
    save left a directory without a manifest, and for gc a prune killed after removing the
    manifests of versions 0 and 1 left their files. The child is SIGKILLed before each of its
    removals in turn; after each kill every committed version loads bitwise, the kept ones are all
    still committed, and the operation run again completes."""
    import shutil

    template = tmp_path / "template"
    store = CheckpointStore(template)
    states = {0: fine_tune(0), 1: fine_tune(1), 2: dense(2), 3: fine_tune(3), 4: fine_tune(4)}
    for version, state in states.items():
        store.save(state, version=version)
    (template / "v000009").mkdir()  # a crashed save's leftovers
    (template / "v000009" / "shard-r0-00.h5").write_bytes(b"partial")
    if operation == "gc":
        for version in (0, 1):
            (template / f"v{version:06d}" / "manifest.json").unlink()
    kept = {"prune": [3, 4], "delete": [1, 2, 3, 4], "gc": [2, 3, 4]}[operation]
    kill_before = 0
    while True:
        root = tmp_path / f"run{kill_before}"
        shutil.copytree(template, root)
        out = _kill_during(str(root), operation, kill_before)
        after = CheckpointStore(root)
        committed = [v.version for v in after.versions()]
        assert set(kept) <= set(committed), (kill_before, committed)
        for version in committed:
            assert_same_state(after.load(version=version), states[version])
        _kill_during(str(root), operation, 10**6)  # again, to the end
        after.gc()
        final = CheckpointStore(root)
        assert [v.version for v in final.versions()] == kept
        for version in kept:
            assert_same_state(final.load(version=version), states[version])
        assert all(e is None for e in verify_all(final).values())
        shutil.rmtree(root)
        if out.startswith("done"):  # it ended before this kill point: every instant was tried
            break
        kill_before += 1
    assert kill_before >= {"prune": 4, "delete": 1, "gc": 2}[operation]  # so many instants were tried


# -- row chunks of large tensors -------------------------------------------------------------------


def test_a_partly_changed_large_tensor_writes_only_its_changed_chunks(tmp_path: Path) -> None:
    """A tensor above 16 MiB is saved as row chunks: a save that changes one row of an embedding
    writes that row's chunk; every way of reading it back gets the whole tensor."""
    from ckptflow.storage.save.planner import CHUNK_BYTES

    store = CheckpointStore(tmp_path / "s")
    emb = torch.randn(48 * 1024, 256)  # 48 MiB: 3 chunks
    store.save({"emb": emb, "bias": torch.zeros(8)})
    changed = emb.clone()
    changed[40_000] += 1.0
    info = store.save({"emb": changed, "bias": torch.zeros(8)})
    assert CHUNK_BYTES <= info.new_bytes < CHUNK_BYTES + (64 << 10)  # one chunk and a header
    raw = manifest(store, 1)
    assert raw["structure"]["emb"] == {"$chunked": 0}
    assert [c["sizes"][0] for c in raw["chunked"][0]["chunks"]] == [16384, 16384, 16384]
    fresh = CheckpointStore(tmp_path / "s")
    assert torch.equal(fresh.load(version=1)["emb"], changed)
    assert torch.equal(fresh.load(version=0, keys=["emb"])["emb"], emb)
    target = {"emb": torch.empty(48 * 1024, 256), "bias": torch.ones(8)}
    fresh.load(version=1, into=target)  # into the caller's tensors, in place
    assert torch.equal(target["emb"], changed) and torch.equal(target["bias"], torch.zeros(8))
    diff = fresh.diff(0, 1)
    assert [(c.path, c.kind) for c in diff.changes] == [("emb", "values")]
    assert all(e is None for e in verify_all(fresh).values())


def test_a_chunked_version_reads_through_dcp_and_exports_whole(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    store = CheckpointStore(tmp_path / "s")
    emb = torch.randn(40 * 1024, 256)
    store.save({"model": {"emb": emb}})
    into = {"model": {"emb": torch.empty(40 * 1024, 256)}}
    dcp.load(into, storage_reader=CheckpointStore(tmp_path / "s").dcp_reader(), no_dist=True)
    assert torch.equal(into["model"]["emb"], emb)
    from typer.testing import CliRunner

    from ckptflow.flows.cli import app

    out = tmp_path / "model.pt"
    result = CliRunner().invoke(app, ["restore", str(tmp_path / "s"), "--out", str(out), "--keys", "model"])
    assert result.exit_code == 0, result.output
    assert torch.equal(torch.load(out, weights_only=True)["emb"], emb)


def test_the_checkpoint_table_s_throughput_counts_the_bytes_a_save_wrote(tmp_path: Path) -> None:
    """Bug: the Prefect table's throughput divided the bytes a version reads (its references
    included) by the save's time, claiming GB/s for a save that wrote a few KiB."""
    from ckptflow.tasks.reporting.artifacts import checkpoint_row

    store = CheckpointStore(tmp_path / "s")
    store.save(fine_tune(0))
    info = store.save(fine_tune(1))
    assert info.save_seconds
    shown = float(checkpoint_row(info)["throughput"].split()[0])
    assert shown == round(info.new_bytes / info.save_seconds / 1e6)
