"""Tarball archives: GNU tar reads them, the index points at the bytes, copies are verified,
extraction is safe, and a crash leaves an uncommitted tar that nothing reads.

Real parts only: versions saved by ``CheckpointStore`` in temp directories, GNU
tar as a subprocess, h5py on extracted shards, a SeaweedFS S3 server (``s3_bucket``
fixture), crafted malicious tarballs built with ``tarfile``, and a child process
killed with SIGKILL while it writes a tar.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import boto3
import h5py
import numpy as np
import pytest
import torch

from ckptflow.storage import CheckpointStore, CorruptShardError, StoreOptions, VersionNotFoundError
from ckptflow.storage.archive.extract import extract_epoch, extract_version
from ckptflow.storage.archive.tarcheck import Gap, check_tarball, gap_finding
from ckptflow.storage.archive.tarindex import INDEX_SEAL_KEY, IndexEntry, parse_index
from ckptflow.storage.archive.tarwriter import (
    ArchiveState,
    Member,
    TarIndex,
    archive_state,
    index_name,
    read_index,
    tar_header,
    write_index,
    write_tar,
)
from ckptflow.storage.errors import (
    ArchiveExistsError,
    ArchiveNotCommittedError,
    CheckpointError,
    CorruptArchiveError,
    FormatVersionError,
    ManifestError,
    UnsafeArchiveError,
)
from ckptflow.storage.files.location import Location, open_location
from ckptflow.storage.format.checksum import digest
from ckptflow.storage.format.manifest import seal
from tests.children import CHILDREN
from tests.conftest import assert_same_state, named, plain_name

VERSIONS = 10
TAR = "epochs-000000-000009.tar"
MTIME = 1_700_000_000
CHILD = CHILDREN / "archive_child.py"


def make_state(version: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1000 + version)
    return {
        "model": {"w": torch.randn(96, 256, generator=gen), "b": torch.arange(100) * version},
        "optimizer": {"step": torch.tensor(float(version)), "lr": 0.1 / (1 + version)},
        "epoch": version,
    }


def vdir(version: int) -> str:
    return f"v{version:06d}"


def members_of(root: Path, versions: list[int]) -> list[Member]:
    """Every shard of each version (size and checksum from its manifest), then its manifest.json."""
    store = CheckpointStore(str(root))
    out = []
    for v in versions:
        for shard in store.manifest(v).shards:
            out.append(
                Member(
                    f"{vdir(v)}/{shard.file}", str(root / vdir(v) / shard.file), shard.size, shard.checksum
                )
            )
        manifest = root / vdir(v) / "manifest.json"
        out.append(Member(f"{vdir(v)}/manifest.json", str(manifest), manifest.stat().st_size, None))
    return out


def gnu_tar() -> str:
    tar = shutil.which("tar")
    assert tar, "these tests need GNU tar on PATH"
    version = subprocess.run([tar, "--version"], capture_output=True, text=True, check=True).stdout
    assert "GNU tar" in version, f"{tar} is not GNU tar: {version.splitlines()[0]}"
    return tar


def files_under(path: Path) -> list[str]:
    """Every non-directory entry under ``path`` (files, symlinks, fifos), relative, sorted."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_symlink() or not p.is_dir())


@pytest.fixture(scope="module")
def store_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Ten committed versions saved by CheckpointStore (two shards each)."""
    root = tmp_path_factory.mktemp("store") / "run"
    store = CheckpointStore(str(root), options=StoreOptions(shards=2, threads=2, shard_bytes=1))
    for v in range(VERSIONS):
        store.save(make_state(v), epoch=v)
    return root


@pytest.fixture(scope="module")
def archived(store_root: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Location, TarIndex]:
    """All ten versions in one committed tarball (index written)."""
    dst = open_location(str(tmp_path_factory.mktemp("archive")))
    members = members_of(store_root, list(range(VERSIONS)))
    index = write_tar(open_location(str(store_root)), members, dst, TAR, mtime=MTIME)
    write_index(dst, index)
    return dst, index


def copy_archive(archived: tuple[Location, TarIndex], to: Path) -> Location:
    loc, index = archived
    to.mkdir(parents=True, exist_ok=True)
    for name in (index.tar, index_name(index.tar)):
        shutil.copyfile(loc.path(name), to / name)
    return open_location(str(to))


class TestTarFormat:
    def test_gnu_tar_lists_every_member_as_a_plain_file(self, archived, store_root):
        loc, _ = archived
        out = subprocess.run([gnu_tar(), "-tvf", loc.path(TAR)], capture_output=True, text=True, check=True)
        rows = [line.split(maxsplit=5) for line in out.stdout.splitlines()]
        members = members_of(store_root, list(range(VERSIONS)))
        assert [r[5] for r in rows] == [m.name for m in members]
        assert {(r[0], r[1]) for r in rows} == {("-rw-r--r--", "0/0")}
        assert [int(r[2]) for r in rows] == [m.size for m in members]
        assert out.stderr == ""

    def test_gnu_tar_extracts_byte_identical_files(self, archived, store_root, tmp_path):
        loc, _ = archived
        subprocess.run([gnu_tar(), "-xf", loc.path(TAR), "-C", str(tmp_path)], check=True)
        for m in members_of(store_root, list(range(VERSIONS))):
            assert (tmp_path / m.name).read_bytes() == Path(m.source).read_bytes(), m.name
        assert len(files_under(tmp_path)) == len(members_of(store_root, list(range(VERSIONS))))

    def test_index_offsets_sizes_and_checksums_match_the_bytes(self, archived, store_root):
        loc, index = archived
        data = Path(loc.path(TAR)).read_bytes()
        assert index.size == len(data) and index.checksum == digest(data)
        assert len(data) % tarfile.RECORDSIZE == 0 and data[-1024:] == bytes(1024)
        sources = {m.name: Path(m.source).read_bytes() for m in members_of(store_root, list(range(VERSIONS)))}
        assert [e.name for e in index.members] == list(sources)
        for e in index.members:
            assert data[e.offset : e.offset + e.size] == sources[e.name], e.name
            assert e.checksum == digest(sources[e.name]), e.name
        assert index.versions() == list(range(VERSIONS))

    def test_long_names_use_pax_headers_gnu_tar_reads(self, tmp_path):
        names = ["v000001/" + "long-" * 30 + "name.h5", "v000001/" + "x" * 190 + ".h5", "v000001/short.h5"]
        members = []
        for i, name in enumerate(names):
            path = tmp_path / f"src-{i}"
            path.write_bytes(os.urandom(1000 + 777 * i))
            members.append(Member(name, str(path), path.stat().st_size, None))
        out = tmp_path / "out"
        index = write_tar(open_location(str(tmp_path)), members, open_location(str(out)), TAR)
        listed = subprocess.run(
            [gnu_tar(), "-tf", str(out / TAR)], capture_output=True, text=True, check=True
        )
        assert listed.stdout.splitlines() == names
        data = (out / TAR).read_bytes()
        for m, e in zip(members, index.members, strict=True):
            assert data[e.offset : e.offset + e.size] == Path(m.source).read_bytes()
        extracted = tmp_path / "x"
        extract_version(open_location(str(out)), TAR, str(extracted), version_prefix="v000001", index=index)
        assert sorted(files_under(extracted)) == sorted(names)

    def test_same_members_and_mtime_give_the_same_bytes(self, archived, store_root, tmp_path):
        """Deterministic tars make re-runs after a crash produce (and upload) identical objects."""
        _, index = archived
        again = write_tar(
            open_location(str(store_root)),
            members_of(store_root, list(range(VERSIONS))),
            open_location(str(tmp_path)),
            TAR,
            mtime=MTIME,
        )
        assert (again.size, again.checksum, again.members) == (index.size, index.checksum, index.members)

    def test_extracted_shard_opens_in_h5py_and_the_version_loads(self, archived, tmp_path):
        loc, index = archived
        written = extract_version(loc, TAR, str(tmp_path), version_prefix="v000007", index=index)
        assert sorted(written) == sorted(str(tmp_path / e.name) for e in index.under("v000007/"))
        want = make_state(7)
        found = {}
        for path in written:
            if path.endswith(".h5"):
                with h5py.File(path, "r") as f:
                    found.update({name: f[name][()] for name in f})
        assert np.array_equal(found["model.w"], want["model"]["w"].numpy())
        assert np.array_equal(found["model.b"], want["model"]["b"].numpy())
        loaded = CheckpointStore(str(tmp_path)).load(7)
        assert_same_state(loaded, want)


class TestIndexFile:
    def test_index_round_trips_with_extra(self, archived, tmp_path):
        _, index = archived
        assert index_name(TAR) == "epochs-000000-000009.index.json"
        copy = copy_archive(archived, tmp_path / "a")
        (tmp_path / "a" / index_name(TAR)).unlink()
        with_extra = index.model_copy(update={"extra": {"manifests": {"7": {"epoch": 7}}}})
        write_index(copy, with_extra)
        assert read_index(copy, TAR) == with_extra
        assert parse_index(with_extra.to_json(), "here") == with_extra
        assert archive_state(copy, TAR) is ArchiveState.COMMITTED
        assert archive_state(copy, "other.tar") is None

    def test_tar_without_index_is_not_committed(self, archived, tmp_path):
        copy = copy_archive(archived, tmp_path)
        (tmp_path / index_name(TAR)).unlink()
        with pytest.raises(ArchiveNotCommittedError, match=f"{TAR} has no index"):
            read_index(copy, TAR)
        assert archive_state(copy, TAR) is ArchiveState.PARTIAL

    @pytest.mark.parametrize(
        ("change", "error", "message"),
        [
            (lambda raw: "{not json", ManifestError, "not valid JSON"),
            (lambda raw: {**raw, "format": "zip"}, ManifestError, "not a ckptflow archive index"),
            (lambda raw: {**raw, "format_version": 99}, FormatVersionError, "upgrade ckptflow"),
            (lambda raw: {**raw, "tar": "other.tar"}, ManifestError, "describes 'other.tar'"),
            (
                lambda raw: {**raw, "members": [{**raw["members"][0], "offset": raw["size"]}]},
                ManifestError,
                "inside",
            ),
            (
                lambda raw: {**raw, "members": [{**raw["members"][0], "name": "../x"}]},
                UnsafeArchiveError,
                r"'\.\./x'",
            ),
            (lambda raw: {**raw, "members": raw["members"][:1] * 2}, UnsafeArchiveError, "listed twice"),
            (
                lambda raw: {**raw, "members": [{**raw["members"][0], "name": "v000007/x.h5\n"}]},
                UnsafeArchiveError,
                "not a plain name",
            ),
            (
                lambda raw: {**raw, "members": [{**raw["members"][0], "name": "v000007\\..\\..\\x"}]},
                UnsafeArchiveError,
                "not a plain name",
            ),
        ],
        ids=["json", "format", "version", "tar", "offset", "dotdot", "duplicate", "newline", "backslash"],
    )
    def test_invalid_index_is_refused(self, archived, tmp_path, change, error, message):
        copy = copy_archive(archived, tmp_path)
        raw = json.loads((tmp_path / index_name(TAR)).read_bytes())
        changed = change(raw)
        if isinstance(
            changed, dict
        ):  # sealed again, as a deliberate crafter would: the checks below the seal
            changed = json.dumps(seal(changed, INDEX_SEAL_KEY))
        (tmp_path / index_name(TAR)).write_text(changed)
        with pytest.raises(error, match=message):
            read_index(copy, TAR)
        assert archive_state(copy, TAR) is ArchiveState.UNREADABLE

    def test_an_edited_index_fails_its_own_checksum(self, archived, tmp_path):
        """An index edited after it was written (a member's offset moved) used to be trusted."""
        copy = copy_archive(archived, tmp_path)
        raw = json.loads((tmp_path / index_name(TAR)).read_bytes())
        raw["members"][0]["offset"] += 512
        (tmp_path / index_name(TAR)).write_text(json.dumps(raw))
        with pytest.raises(ManifestError, match="was changed after it was written"):
            read_index(copy, TAR)

    def test_index_is_not_written_for_a_truncated_tar(self, archived, tmp_path):
        copy = copy_archive(archived, tmp_path)
        (tmp_path / index_name(TAR)).unlink()
        with open(tmp_path / TAR, "r+b") as f:
            f.truncate(archived[1].size - 512)
        with pytest.raises(CorruptShardError, match="size expected"):
            write_index(copy, archived[1])
        assert not (tmp_path / index_name(TAR)).exists()

    def test_committed_tar_is_not_overwritten(self, archived, store_root, tmp_path):
        copy = copy_archive(archived, tmp_path)
        before = (tmp_path / TAR).read_bytes()
        with pytest.raises(ArchiveExistsError, match="immutable"):
            write_tar(open_location(str(store_root)), members_of(store_root, [0]), copy, TAR)
        assert (tmp_path / TAR).read_bytes() == before


class TestVerifiedCopy:
    def _broken_copy(self, store_root: Path, tmp_path: Path) -> Path:
        src = tmp_path / "src"
        shutil.copytree(store_root, src)
        return src

    def test_checksum_mismatch_aborts_the_tar(self, store_root, tmp_path):
        src = self._broken_copy(store_root, tmp_path)
        members = members_of(src, [3, 4, 5])
        victim = members[3]  # a shard of v000004
        data = bytearray(Path(victim.source).read_bytes())
        data[len(data) // 2] ^= 0x40
        Path(victim.source).write_bytes(data)
        dst = tmp_path / "archive"
        with pytest.raises(CorruptShardError, match=f"{victim.source}: checksum expected {victim.checksum}"):
            write_tar(open_location(str(src)), members, open_location(str(dst)), TAR)
        assert files_under(dst) == []

    def test_aborted_tar_leaves_no_object_on_a_memory_filesystem(self, store_root, tmp_path):
        """memory:// files have no discard(): the sink's abort commits them, so write_tar removes it."""
        src = self._broken_copy(store_root, tmp_path)
        members = members_of(src, [2])
        Path(members[0].source).write_bytes(b"\0" * members[0].size)
        dst = open_location(f"memory://ckptflow-archive-{os.getpid()}-{id(tmp_path)}/archive")
        with pytest.raises(CorruptShardError, match="checksum expected"):
            write_tar(open_location(str(src)), members, dst, TAR)
        assert not dst.fs.exists(dst.path(TAR))
        assert archive_state(dst, TAR) is None

    @pytest.mark.parametrize("change", ["grow", "shrink", "remove"])
    def test_size_mismatch_or_missing_source_aborts_the_tar(self, store_root, tmp_path, change):
        src = self._broken_copy(store_root, tmp_path)
        members = members_of(src, [3])
        victim = Path(members[1].source)
        if change == "grow":
            victim.write_bytes(victim.read_bytes() + b"x")
        elif change == "shrink":
            victim.write_bytes(victim.read_bytes()[:-1])
        else:
            victim.unlink()
        dst = tmp_path / "archive"
        with pytest.raises(CorruptShardError, match=f"{victim}: (size|presence) expected"):
            write_tar(open_location(str(src)), members, open_location(str(dst)), TAR)
        assert files_under(dst) == []

    @pytest.mark.parametrize("name", ["../x", "/etc/x", "v000001/./a", "v000001//a", ""])
    def test_unsafe_member_name_is_refused_before_writing(self, store_root, tmp_path, name):
        member = members_of(store_root, [1])[0]
        bad = Member(name, member.source, member.size, member.checksum)
        with pytest.raises(UnsafeArchiveError):
            write_tar(open_location(str(store_root)), [member, bad], open_location(str(tmp_path)), TAR)
        assert files_under(tmp_path) == []


@pytest.mark.s3
class TestS3:
    def test_tar_on_s3_is_identical_and_range_reads_return_member_bytes(
        self, archived, store_root, s3_bucket, tmp_path
    ):
        """Range reads through extraction with the index: every member's bytes, every version."""
        bucket, options = s3_bucket
        _, local_index = archived
        dst = open_location(f"s3://{bucket}/archive", options)
        members = members_of(store_root, list(range(VERSIONS)))
        index = write_tar(open_location(str(store_root)), members, dst, TAR, mtime=MTIME)
        write_index(dst, index)
        fresh = open_location(f"s3://{bucket}/archive", options)
        assert read_index(fresh, TAR) == index
        assert (index.size, index.checksum) == (local_index.size, local_index.checksum)
        every = tmp_path / "every-version"
        for v in range(VERSIONS):
            extract_version(fresh, TAR, str(every), version_prefix=f"{vdir(v)}/", index=index)
        for m in members:
            assert (every / m.name).read_bytes() == Path(m.source).read_bytes()
        for given, out in ((index, tmp_path / "by-range"), (None, tmp_path / "by-stream")):
            written = extract_version(fresh, TAR, str(out), version_prefix="v000005/", index=given)
            assert len(written) == len(index.under("v000005/"))
            assert_same_state(CheckpointStore(str(out)).load(5), make_state(5))

    def test_tar_of_versions_stored_on_s3(self, s3_bucket, tmp_path):
        bucket, options = s3_bucket
        store = CheckpointStore(
            f"s3://{bucket}/run", storage_options=options, options=StoreOptions(shards=2, shard_bytes=1)
        )
        for v in range(2):
            store.save(make_state(v), epoch=v)
        src = open_location(f"s3://{bucket}/run", options)
        members = [
            Member(f"{vdir(v)}/{s.file}", src.path(vdir(v), s.file), s.size, s.checksum)
            for v in range(2)
            for s in store.manifest(v).shards
        ]
        index = write_tar(src, members, open_location(str(tmp_path)), TAR)
        subprocess.run([gnu_tar(), "-xf", str(tmp_path / TAR), "-C", str(tmp_path)], check=True)
        for m, e in zip(members, index.members, strict=True):
            assert (tmp_path / m.name).read_bytes() == src.fs.cat_file(m.source) and e.checksum == m.checksum

    @pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
    def test_corrupt_source_aborts_the_multipart_upload(self, s3_bucket, tmp_path):
        """No object, no pending multipart upload, and no error from the discarded file later.

        Fixes byteio.FsspecSink.abort: after ``discard()`` the s3fs file stayed open, so its
        ``__del__`` flushed the discarded buffer and raised AttributeError (ignored, but printed).
        """
        bucket, options = s3_bucket
        big = tmp_path / "big.bin"
        big.write_bytes(os.urandom(70 << 20))  # more than one 64 MiB part: a multipart upload starts
        members = [Member("v000000/big.bin", str(big), big.stat().st_size, "0" * 16)]
        dst = open_location(f"s3://{bucket}/archive", options)
        with pytest.raises(CorruptShardError, match=r"big\.bin: checksum expected 0000000000000000"):
            write_tar(open_location(str(tmp_path)), members, dst, TAR)
        client = boto3.client(
            "s3",
            endpoint_url=options["client_kwargs"]["endpoint_url"],
            aws_access_key_id=options["key"],
            aws_secret_access_key=options["secret"],
            region_name="us-east-1",
        )
        assert client.list_objects_v2(Bucket=bucket).get("Contents", []) == []
        assert client.list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


# -- malicious tarballs --------------------------------------------------------------------------------


def _file(name: str, data: bytes) -> tuple[tarfile.TarInfo, bytes]:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info, data


def _special(name: str, kind: bytes, linkname: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, linkname
    if kind == tarfile.CHRTYPE:
        info.devmajor, info.devminor = 1, 3
    return info, None


def craft(path: Path, entries: list[tuple[tarfile.TarInfo, bytes | None]]) -> None:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in entries:
            tar.addfile(info, io.BytesIO(data) if data is not None else None)


def malicious_cases(box: Path) -> dict[str, list[tuple[tarfile.TarInfo, bytes | None]]]:
    """Each tar starts with a harmless member of v000007, then the attack."""
    ok = _file("v000007/ok.bin", b"fine")
    outside = str(box / "outside")
    return {
        "dotdot": [ok, _file("../evil.txt", b"x")],
        "dotdot-inside-version": [ok, _file("v000007/../../evil.txt", b"x")],
        "absolute": [ok, _file(str(box / "abs-evil.txt"), b"x")],
        "symlink-then-file-through-it": [
            ok,
            _special("v000007/link", tarfile.SYMTYPE, outside),
            _file("v000007/link/evil.txt", b"x"),
        ],
        "hardlink-escape": [ok, _special("v000007/hl", tarfile.LNKTYPE, "../../outside/secret")],
        "device": [ok, _special("v000007/null", tarfile.CHRTYPE)],
        "fifo": [ok, _special("v000007/fifo", tarfile.FIFOTYPE)],
        "duplicate": [ok, _file("v000007/ok.bin", b"again")],
        "other-version-escape": [ok, _file("v000003/../../evil.txt", b"x")],
    }


class TestExtractSafety:
    @pytest.mark.parametrize("case", list(malicious_cases(Path("/x"))))
    def test_malicious_tar_is_refused_and_nothing_is_written(self, tmp_path, case):
        box = tmp_path / "box"
        (box / "outside").mkdir(parents=True)
        (box / "outside" / "secret").write_text("secret")
        craft(tmp_path / "evil.tar", malicious_cases(box)[case])
        with pytest.raises(UnsafeArchiveError, match=r"refus|only regular files"):
            extract_version(
                open_location(str(tmp_path)), "evil.tar", str(box / "out"), version_prefix="v000007"
            )
        assert files_under(box) == ["outside/secret"]
        assert (box / "outside" / "secret").read_text() == "secret"

    def test_existing_symlink_in_the_target_is_not_followed(self, archived, tmp_path):
        loc, index = archived
        outside = tmp_path / "outside"
        outside.mkdir()
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "v000007").symlink_to(outside)
        for given in (index, None):
            with pytest.raises(UnsafeArchiveError, match=r"not a directory|outside the destination"):
                extract_version(loc, TAR, str(tmp_path / "out"), version_prefix="v000007", index=given)
        assert list(outside.iterdir()) == []

    def test_index_object_with_unsafe_name_is_refused(self, archived, tmp_path):
        loc, index = archived
        bad = index.model_copy(
            update={"members": [index.members[0].model_copy(update={"name": "v000000/../../evil"})]}
        )
        with pytest.raises(UnsafeArchiveError, match=r"'\.\.' component"):
            extract_version(loc, TAR, str(tmp_path / "out"), version_prefix="v000000", index=bad)
        assert files_under(tmp_path) == []


class TestExtractSelection:
    @pytest.mark.parametrize("use_index", [True, False], ids=["index", "stream"])
    def test_only_the_requested_version_is_written(self, archived, store_root, tmp_path, use_index):
        loc, index = archived
        written = extract_version(
            loc, TAR, str(tmp_path), version_prefix="v000007/", index=index if use_index else None
        )
        expected = [e.name for e in index.under("v000007/")]
        assert files_under(tmp_path) == sorted(expected)
        assert written == [str(tmp_path / n) for n in expected]
        for name in expected:
            assert (tmp_path / name).read_bytes() == (store_root / name).read_bytes()

    def test_with_an_index_nothing_else_of_the_tar_is_read(self, archived, tmp_path):
        """Every byte outside v000007's headers and data is overwritten: extraction by index still works."""
        copy = copy_archive(archived, tmp_path / "a")
        index = read_index(copy, TAR)
        data = bytearray(b"\xff" * index.size)
        original = Path(copy.path(TAR)).read_bytes()
        for e in index.under("v000007/"):
            data[e.offset - 512 : e.offset + e.size] = original[e.offset - 512 : e.offset + e.size]
        Path(copy.path(TAR)).write_bytes(data)
        extract_version(copy, TAR, str(tmp_path / "out"), version_prefix="v000007", index=index)
        assert_same_state(CheckpointStore(str(tmp_path / "out")).load(7), make_state(7))
        with pytest.raises(CorruptShardError, match="readable tar"):
            extract_version(copy, TAR, str(tmp_path / "out2"), version_prefix="v000007")

    @pytest.mark.parametrize("what", ["v000002", "."], ids=["version-dir", "dot-prefixed-store"])
    def test_a_gnu_tar_archive_of_a_store_extracts_and_verifies(self, store_root, tmp_path, what):
        """A tar made by hand (directory entries, ``./`` prefixes) extracts without an index."""
        subprocess.run([gnu_tar(), "-cf", str(tmp_path / "gnu.tar"), "-C", str(store_root), what], check=True)
        written = extract_version(
            open_location(str(tmp_path)), "gnu.tar", str(tmp_path / "out"), version_prefix="v000002"
        )
        assert sorted(written) == sorted(
            str(tmp_path / "out" / "v000002" / n) for n in os.listdir(store_root / "v000002")
        )
        assert_same_state(CheckpointStore(str(tmp_path / "out")).load(2), make_state(2))

    @pytest.mark.parametrize("use_index", [True, False], ids=["index", "stream"])
    def test_missing_version_names_the_versions_in_the_tar(self, archived, tmp_path, use_index):
        loc, index = archived
        with pytest.raises(VersionNotFoundError, match=r"version 42 .*0, 1, 2, 3, 4, 5, 6, 7, 8, 9"):
            extract_version(
                loc, TAR, str(tmp_path), version_prefix="v000042", index=index if use_index else None
            )
        assert files_under(tmp_path) == []


class TestCorruption:
    @pytest.mark.parametrize("use_index", [True, False], ids=["index", "stream"])
    def test_flipped_byte_fails_naming_the_member(self, archived, tmp_path, use_index):
        copy = copy_archive(archived, tmp_path / "a")
        index = read_index(copy, TAR)
        victim = index.under("v000007/")[0]
        with open(copy.path(TAR), "r+b") as f:
            f.seek(victim.offset + victim.size // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x01]))
        out = tmp_path / "out"
        with pytest.raises(CorruptShardError, match=f"{TAR} member {victim.name}: checksum expected"):
            extract_version(copy, TAR, str(out), version_prefix="v000007", index=index if use_index else None)
        assert files_under(out) == []

    def test_truncated_tar_fails(self, archived, tmp_path):
        copy = copy_archive(archived, tmp_path / "a")
        index = read_index(copy, TAR)
        with open(copy.path(TAR), "r+b") as f:
            f.truncate(index.under("v000009/")[0].offset + 100)
        for given in (index, None):
            with pytest.raises(CorruptShardError):
                extract_version(copy, TAR, str(tmp_path / "out"), version_prefix="v000009", index=given)
        assert files_under(tmp_path / "out") == []


# -- the tarball's tar structure: what GNU tar and extraction read ------------------------------------

STORE_TAR = "epochs-000001-000002.tar"


@pytest.fixture
def archived_store(store_url):
    """Versions 1 and 2 only in the store's tarball (loose copies dropped), version 3 loose; on
    every backend (S3: the SeaweedFS server)."""
    store = store_url.open(shards=2, threads=2, shard_bytes=1)
    for epoch in (1, 2, 3):
        store.save(make_state(epoch), epoch=epoch, version=epoch)
    store.archive([1, 2])
    store.drop_loose([1, 2])
    return store_url, store


def tar_lists(tmp_path: Path, data: bytes) -> subprocess.CompletedProcess[str]:
    """``tar -tf`` of these bytes: what GNU tar makes of the tarball."""
    path = tmp_path / "listed.tar"
    path.write_bytes(data)
    return subprocess.run([gnu_tar(), "-tf", str(path)], capture_output=True, text=True)


def store_members(target) -> list[dict[str, Any]]:
    """The members of the store's tarball, from its index: v000001's shards and manifest, then v000002's."""
    return json.loads(target.raw_read(f"archive/{index_name(STORE_TAR)}"))["members"]


def store_member(target, name: str) -> dict[str, Any]:
    return next(m for m in store_members(target) if plain_name(m["name"]) == name)


def flip_bit(target, position: int) -> None:
    data = bytearray(target.raw_read(f"archive/{STORE_TAR}"))
    data[position] ^= 0x01
    target.raw_write(f"archive/{STORE_TAR}", bytes(data))


class TestTarStructure:
    @pytest.mark.parametrize(
        ("member", "field"),
        [
            ("v000001/shard-r0-00.h5", 3),
            ("v000001/manifest.json", 124 + 8),
            ("v000002/manifest.json", 148 + 2),
            ("v000002/shard-r0-00.h5", 100 + 4),
        ],
        ids=["first-name", "manifest-size", "chksum", "mode"],
    )
    def test_a_flipped_bit_in_a_member_header_fails_verify(self, archived_store, tmp_path, member, field):
        """Issue 34: one flipped bit in a member's tar header, and verify said ok for both archived
        versions while GNU tar refused the file; verify now names the tarball and the member."""
        target, store = archived_store
        original = target.raw_read(f"archive/{STORE_TAR}")
        listed = tar_lists(tmp_path, original)
        assert listed.returncode == 0 and listed.stderr == ""
        assert [store.verify(v).version for v in (1, 2, 3)] == [1, 2, 3]  # undamaged: all verify
        entry = store_member(target, member)
        flip_bit(target, entry["offset"] - 512 + field)
        assert tar_lists(tmp_path, target.raw_read(f"archive/{STORE_TAR}")).returncode != 0  # tar agrees
        for version in (1, 2):
            with pytest.raises(
                CorruptArchiveError, match=rf"{STORE_TAR}: the header of member {entry['name']}"
            ):
                CheckpointStore(target.url, storage_options=target.storage_options).verify(version)
        assert store.verify(3).version == 3  # a loose version is not in the tarball

    @pytest.mark.parametrize(
        ("damage", "message"),
        [
            (lambda data, end: flip(data, end + 700), "the end of the archive .* other bytes from byte {at}"),
            (
                lambda data, end: flip(data, len(data) - 1),
                "the end of the archive .* other bytes from byte {at}",
            ),
            (lambda data, end: flip(data, end + 3), "the end of the archive .* other bytes from byte {at}"),
            (lambda data, end: data[:-1024], "its size: expected {size} bytes, found {new} bytes"),
            (lambda data, end: data + bytes(512), "its size: expected {size} bytes, found {new} bytes"),
        ],
        ids=["end-block", "record-padding", "last-member-padding", "truncated", "grown"],
    )
    def test_a_damaged_end_or_size_fails_verify(self, archived_store, damage, message):
        """The end-of-archive blocks (and the padding around them) and the tarball's size are checked."""
        target, store = archived_store
        last = store_members(target)[-1]
        original = target.raw_read(f"archive/{STORE_TAR}")
        data = damage(original, last["offset"] + last["size"])
        target.raw_write(f"archive/{STORE_TAR}", data)
        at = next((i for i, (a, b) in enumerate(zip(original, data, strict=False)) if a != b), None)
        expected = message.format(at=at, size=len(original), new=len(data))
        for version in (1, 2):
            with pytest.raises(CorruptArchiveError, match=rf"{STORE_TAR}: {expected}"):
                store.verify(version)

    def test_a_version_with_a_damaged_member_header_does_not_load_and_its_neighbour_does(
        self, archived_store
    ):
        """A load checks the headers of the members it reads: the damaged version is refused, naming
        the tarball and the member; an intact version of the same tarball still loads (to be rescued)."""
        target, _ = archived_store
        entry = store_member(target, "v000001/manifest.json")
        flip_bit(target, entry["offset"] - 512 + 1)
        fresh = CheckpointStore(target.url, storage_options=target.storage_options)
        with pytest.raises(CorruptArchiveError, match=rf"{STORE_TAR}: the header of member v000001/manifest"):
            fresh.load(1)
        assert_same_state(fresh.load(1, verify=False), make_state(1))  # checks nothing, as ever
        assert_same_state(fresh.load(2), make_state(2))

    def test_extract_refuses_a_damaged_member_header(self, archived_store, tmp_path):
        """``ckptflow extract`` (extract_epoch) names the tarball and the member and writes nothing."""
        target, _ = archived_store
        entry = store_member(target, "v000002/shard-r0-00.h5")
        flip_bit(target, entry["offset"] - 512 + 130)
        tar_url = f"{target.url.rstrip('/')}/archive/{STORE_TAR}"
        out = tmp_path / "out"
        with pytest.raises(CorruptArchiveError, match=rf"the header of member {entry['name']}") as caught:
            extract_epoch(tar_url, str(out), epoch=2, storage_options=target.storage_options)
        assert "restore it from the mirror" in str(caught.value)
        assert files_under(out) == []
        version, _ = extract_epoch(
            tar_url, str(tmp_path / "one"), epoch=1, storage_options=target.storage_options
        )
        assert_same_state(CheckpointStore(str(tmp_path / "one")).load(version), make_state(1))


@pytest.fixture
def local_archived(tmp_path: Path) -> tuple[Path, CheckpointStore]:
    """Versions 1 and 2 archived in a local store (loose copies dropped); (the tarball, the store)."""
    store = CheckpointStore(str(tmp_path / "store"), options=StoreOptions(shards=2, shard_bytes=1))
    for epoch in (1, 2):
        store.save(make_state(epoch), epoch=epoch, version=epoch)
    store.archive([1, 2])
    store.drop_loose([1, 2])
    return tmp_path / "store" / "archive" / STORE_TAR, store


def flip(data: bytes, position: int) -> bytes:
    changed = bytearray(data)
    changed[position] ^= 0x01
    return bytes(changed)


def rewrite_header(tar: Path, offset: int, **fields: Any) -> None:
    """Replace the ustar header before ``offset`` with one whose ``fields`` differ, its tar checksum
    recomputed: a change the tar checksum cannot see."""
    data = bytearray(tar.read_bytes())
    info = tarfile.TarInfo.frombuf(bytes(data[offset - 512 : offset]), "utf-8", "surrogateescape")
    for name, value in fields.items():
        setattr(info, name, value)
    data[offset - 512 : offset] = info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape")
    tar.write_bytes(bytes(data))


def as_format_2(index_path: Path) -> None:
    """Rewrite an index as an older ckptflow wrote it: format 2, no header checksums."""
    raw = json.loads(index_path.read_bytes())
    raw.pop(INDEX_SEAL_KEY)
    raw["format_version"] = 2
    for member in raw["members"]:
        member.pop("header_checksum")
    index_path.write_text(json.dumps(seal(raw, INDEX_SEAL_KEY, ordered=False)))


class TestHeaderChecksums:
    def test_a_header_rewritten_with_a_valid_tar_checksum_fails_against_the_recorded_one(
        self, local_archived
    ):
        """The index records each member's header blocks: a change that keeps the tar checksum valid
        (GNU tar lists the file) is still found."""
        tar, store = local_archived
        entry = read_index(open_location(str(tar.parent)), STORE_TAR).entry("v000001/manifest.json")
        assert entry.header_checksum == digest(tar.read_bytes()[entry.offset - 512 : entry.offset])
        rewrite_header(tar, entry.offset, mode=0o600)
        subprocess.run([gnu_tar(), "-tf", str(tar)], check=True, capture_output=True)
        with pytest.raises(
            CorruptArchiveError, match=r"member v000001/manifest.json .*header blocks written"
        ):
            store.verify(1)

    def test_an_index_of_format_2_is_read_and_its_headers_checked_by_parsing(self, local_archived):
        """Old indexes stay readable: without header checksums, verify parses the headers."""
        tar, store = local_archived
        index_path = tar.parent / index_name(STORE_TAR)
        as_format_2(index_path)
        old = read_index(open_location(str(tar.parent)), STORE_TAR)
        again = json.loads(old.to_json())  # written again, it stays in its format
        assert again["format_version"] == 2 and all("header_checksum" not in m for m in again["members"])
        assert [CheckpointStore(store.url).verify(v).version for v in (1, 2)] == [1, 2]
        entry = old.entry("v000002/manifest.json")
        assert entry.header_checksum is None
        original = tar.read_bytes()
        rewrite_header(tar, entry.offset, mode=0o600)  # parsing cannot tell: the tar is still sound
        assert CheckpointStore(store.url).verify(2).version == 2
        for damaged, message in [
            (flip(original, entry.offset - 512 + 40), "tar checksum"),
            (flip(original, entry.offset - 512 + 124 + 9), "tar checksum"),
        ]:
            tar.write_bytes(damaged)
            with pytest.raises(CorruptArchiveError, match=rf"member v000002/manifest.json .*{message}"):
                CheckpointStore(store.url).verify(2)
        tar.write_bytes(original)
        rewrite_header(tar, entry.offset, size=entry.size + 1)
        with pytest.raises(CorruptArchiveError, match=rf"a size of {entry.size + 1} bytes"):
            CheckpointStore(store.url).verify(1)
        tar.write_bytes(original)
        rewrite_header(tar, entry.offset, name="v000002/manifest.jsoN")
        with pytest.raises(CorruptArchiveError, match=r"the name 'v000002/manifest\.jsoN'"):
            CheckpointStore(store.url).verify(1)
        tar.write_bytes(original)
        rewrite_header(tar, entry.offset, type=tarfile.SYMTYPE)
        with pytest.raises(CorruptArchiveError, match="not a regular file"):
            CheckpointStore(store.url).verify(1)

    @pytest.mark.parametrize("with_checksums", [True, False], ids=["format-3", "format-2"])
    def test_a_flipped_bit_in_a_pax_path_record_is_found(self, tmp_path, with_checksums):
        """A long name lives in a PAX extended header, whose records have no tar checksum."""
        names = ["v000001/" + "long-" * 30 + "name.h5", "v000001/short.h5"]
        members = []
        for i, name in enumerate(names):
            path = tmp_path / f"src-{i}"
            path.write_bytes(os.urandom(1000 + 777 * i))
            members.append(Member(name, str(path), path.stat().st_size, None))
        out = open_location(str(tmp_path / "out"))
        written = write_tar(open_location(str(tmp_path)), members, out, TAR)
        index = written
        if not with_checksums:
            index = written.model_copy(
                update={"members": [e.model_copy(update={"header_checksum": None}) for e in written.members]}
            )
        assert check_tarball(out, index) == {e.name: e.header_checksum for e in written.members}
        data = Path(out.path(TAR)).read_bytes()
        record = data.index(b" path=v000001/long-")
        Path(out.path(TAR)).write_bytes(flip(data, record + 20))
        assert (
            subprocess.run([gnu_tar(), "-tf", out.path(TAR)], capture_output=True, text=True).stdout.split()[
                0
            ]
            != names[0]
        )
        with pytest.raises(CorruptArchiveError, match=rf"member {names[0]} .*the name"):
            check_tarball(out, index)

    def test_a_size_past_the_ustar_field_is_read_from_its_pax_record(self):
        """A member of 9 GiB: the ustar size field says 0 and a PAX record holds the size."""
        name = "v000001/huge.h5"
        header = tar_header(name, 9 << 30, MTIME)
        assert len(header) > 512  # the PAX header, then the ustar one
        entry = IndexEntry(name=name, offset=len(header), size=9 << 30, checksum="0" * 16)
        assert gap_finding(Gap(0, entry, None), header) is None
        other = entry.model_copy(update={"size": (9 << 30) + 1})
        assert "a size of 9663676416 bytes" in str(gap_finding(Gap(0, other, None), header))

    def test_reindex_refuses_a_tarball_with_a_damaged_header(self, local_archived):
        """Python's tarfile stops at a damaged header mid-tar as if the archive ended there, so a
        rebuilt index silently lost the versions behind it; the rebuilt index is now checked first."""
        tar, store = local_archived
        index_path = tar.parent / index_name(STORE_TAR)
        index = read_index(open_location(str(tar.parent)), STORE_TAR)
        entry = index.entry(named([m.name for m in index.members], "v000002/shard-r0-00.h5"))
        tar.write_bytes(flip(tar.read_bytes(), entry.offset - 512 + 5))
        index_path.write_text("{damaged")
        with pytest.raises(
            CheckpointError, match=rf"index of .*: the end .* from byte {entry.offset - 512};"
        ):
            store.reindex()
        assert index_path.read_text() == "{damaged"


@pytest.mark.crash
def test_sigkill_while_writing_leaves_a_tar_without_index(tmp_path):
    """A killed archiver leaves a partial tar that read_index reports as not committed; a re-run commits."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"part-{i}.bin").write_bytes(os.urandom(16 << 20))
    dst = tmp_path / "archive"
    child = subprocess.Popen(
        [sys.executable, str(CHILD), str(src), str(dst), TAR], stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "started"
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
    partial = (dst / TAR).stat().st_size
    assert 0 < partial < 6 * (16 << 20)
    loc = open_location(str(dst))
    with pytest.raises(ArchiveNotCommittedError, match="never committed"):
        read_index(loc, TAR)
    assert archive_state(loc, TAR) is ArchiveState.PARTIAL
    members = [
        Member(f"v000000/{p.name}", str(p), p.stat().st_size, digest(p.read_bytes()))
        for p in sorted(src.iterdir())
    ]
    index = write_tar(open_location(str(src)), members, loc, TAR)
    write_index(loc, index)
    assert archive_state(loc, TAR) is ArchiveState.COMMITTED
    listed = subprocess.run([gnu_tar(), "-tf", str(dst / TAR)], capture_output=True, text=True, check=True)
    assert listed.stdout.split() == [m.name for m in members]
