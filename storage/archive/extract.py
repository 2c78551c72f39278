"""Safe extraction of one version from a tarball, and range reads of archived members.

A tarball may come from anywhere (a copy on S3, a download, a hand-made tar),
so extraction trusts nothing in it:

- Only regular files are extracted. A symlink, hard link, device or FIFO, a
  name that is absolute or has a ``..``, ``.`` or empty component, or a name
  listed twice makes the whole tar refused (UnsafeArchiveError), wherever it
  is in the tar: a tar holding one such member is not one ckptflow wrote.
  Python's ``tarfile`` data filter checks every member too, as a second opinion.
- Members outside the requested version are skipped, never written.
- Nothing already there is replaced or mixed with: :func:`extract_epoch` writes
  only into a new or empty directory, and :func:`extract_version` refuses a
  version directory that exists; ``out_dir`` must not be a symbolic link
  (dangling or not), and a file is placed by a hard link, which never replaces
  a name that appeared meanwhile.
- Files are written to temporary names inside ``out_dir`` (``O_EXCL |
  O_NOFOLLOW``, in directories created one level at a time, refusing any
  existing symlink on the way), so nothing lands outside ``out_dir``. Each is
  verified: against the index, or without one, against the version's
  ``manifest.json`` member when there is one. Only when all are verified are
  they renamed into place, ``manifest.json`` last: an extracted version follows
  the commit protocol, so ``out_dir`` can be opened as a store. On any error
  the temporary files are removed and nothing is renamed.

With an index, the version's members are read by range: first their header
blocks, checked against the index (:func:`.tarcheck.check_members`: a damaged
header is refused, naming the tarball and the member), then their data; nothing
else of the tar is read, so an intact version can be extracted from a tarball
damaged elsewhere. Without one, the tar is read once as a stream. :func:`extract_epoch`
finds the version of an epoch in the index (what ``ckptflow extract`` asks for).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import tarfile
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any, BinaryIO

from ..errors import (
    ArchiveNotCommittedError,
    CheckpointError,
    CorruptShardError,
    UnsafeArchiveError,
    VersionNotFoundError,
)
from ..files.byteio import CHUNK, MAX_REQUEST, ReadRange, fsync_dir, read_ranges
from ..files.localfs import open_regular
from ..files.location import Location, open_location
from ..files.nearby import store_holding
from ..format.checksum import new_hasher
from ..format.manifest import MANIFEST_FILE, parse_manifest
from ..format.names import parse_version_dir, version_dir
from ..info import in_epoch
from .tarcheck import check_members
from .tarindex import TarIndex, check_member_name, read_index

log = logging.getLogger(__name__)


def extract_epoch(
    tar_url: str, out_dir: str, *, epoch: int, storage_options: dict[str, Any] | None = None
) -> tuple[int, list[str]]:
    """Extract one epoch of the tarball at ``tar_url`` (a path or any fsspec URL) into local ``out_dir``.

    With the tarball's index beside it, the epoch's version is found in the index and only its
    byte ranges are read; a tarball without one (made elsewhere) is read as a stream, and its
    version is taken to be numbered as the epoch. Returns (version, paths written).
    """
    check_new_target(out_dir)
    url, slash, name = str(tar_url).rstrip("/").rpartition("/")
    src = open_location(url or slash or ".", storage_options)  # its directory: the index is beside it
    try:
        index = read_index(src, name)
    except ArchiveNotCommittedError:
        index = None  # a tar made elsewhere: scan it, and trust the version's own manifest
    version = _version_of_epoch(index, epoch, src.display(name)) if index is not None else epoch
    written = extract_version(src, name, out_dir, version_prefix=f"{version_dir(version)}/", index=index)
    return version, written


def check_new_target(out_dir: str) -> None:
    """Refuse ``out_dir`` unless it is missing or an empty directory, no symbolic link, and inside
    no store (the store would take the extracted version for a leftover, or a version of its own)."""
    _refuse_link_or_file(out_dir)
    around = store_holding(os.path.dirname(os.path.abspath(out_dir)))
    if around is not None:
        raise CheckpointError(
            f"{out_dir} is inside the checkpoint store {around}: extract writes a store of its own, "
            "outside any other; choose a directory elsewhere"
        )
    try:
        names = sorted(os.listdir(out_dir))
    except FileNotFoundError:
        return
    if names:
        listing = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        raise CheckpointError(
            f"{out_dir} is not empty (it holds {listing}): extract writes only into a new or empty "
            "directory, so that it never replaces or mixes with files there; choose a new directory"
        )


def _refuse_link_or_file(out_dir: str) -> None:
    try:
        mode = os.lstat(out_dir).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode):
        raise CheckpointError(
            f"{out_dir} is a symbolic link (to {os.readlink(out_dir)}): extract writes only into a real "
            "directory; choose a new directory"
        )
    if not stat.S_ISDIR(mode):
        raise CheckpointError(
            f"{out_dir} is a file, not a directory: extract writes into a new or empty directory; "
            "choose a new directory"
        )


def _version_of_epoch(index: TarIndex, epoch: int, where: str) -> int:
    manifests = index.manifests(where)
    ends = [v for v, m in manifests.items() if m.epoch == epoch and in_epoch(m.user) is None]
    if ends:  # the epoch's end: not a save made inside it
        return max(ends)
    epochs = sorted(m.epoch for m in manifests.values() if m.epoch is not None)
    raise CheckpointError(f"{index.tar} holds no epoch {epoch} (epochs: {', '.join(map(str, epochs))})")


def extract_version(
    src: Location, tar_name: str, out_dir: str, *, version_prefix: str, index: TarIndex | None = None
) -> list[str]:
    """Extract the members under ``version_prefix`` (e.g. ``"v000007/"``) into local ``out_dir``.

    Returns the paths written. With ``index``, reads only those members' byte ranges.
    """
    prefix = check_member_name(version_prefix.rstrip("/"), "version prefix") + "/"
    where = src.display(tar_name)
    _refuse_link_or_file(out_dir)
    existing = os.path.join(out_dir, prefix.rstrip("/"))
    if os.path.islink(existing):
        raise UnsafeArchiveError(f"{existing} is a symlink, not a directory: refusing to extract through it")
    if os.path.lexists(existing):
        raise CheckpointError(
            f"{existing} exists: extract never replaces or adds to a version already there; "
            "choose a new directory"
        )
    out = _Staging(out_dir)
    try:
        if index is not None:
            seen = _from_index(src, tar_name, index, prefix, out)
        else:
            seen = _from_stream(src, tar_name, prefix, out)
        if not out.files:
            _not_found(prefix, where, seen)
        return out.publish()
    finally:
        out.discard()


# -- with an index: range reads ----------------------------------------------------------------------


def _from_index(src: Location, tar_name: str, index: TarIndex, prefix: str, out: _Staging) -> set[str]:
    if index.tar != tar_name:
        raise CheckpointError(f"the index given describes {index.tar!r}, not {src.display(tar_name)}")
    entries = [*index.under(prefix), *_referenced(src, tar_name, index, prefix, out)]
    for entry in entries:
        check_member_name(entry.name, src.display(tar_name))
    check_members(src, index, prefix)  # the tarball's size, and these members' headers
    for entry in entries:
        chunks = _range_chunks(src, tar_name, entry.offset, entry.size, entry.name)
        actual = out.write(entry.name, chunks)
        if actual != entry.checksum:
            raise CorruptShardError(
                _member(src, tar_name, entry.name), expected=entry.checksum, actual=actual
            )
    return {e.name for e in index.members}


def _referenced(src: Location, tar_name: str, index: TarIndex, prefix: str, out: _Staging) -> list[Any]:
    """The members of other versions' files whose bytes the version references (format 8): they
    are extracted too, each into its own version's directory (which holds no manifest), so that
    the extracted version loads. One already there is refused, as the version's own would be."""
    where = src.display(tar_name)
    version = parse_version_dir(prefix.rstrip("/"))
    manifest = index.manifests(where).get(version) if version is not None else None
    if manifest is None:
        return []
    found = []
    for shard, (vdir, file) in zip(manifest.shards, manifest.shard_files(), strict=True):
        if shard.version is None:
            continue
        target = os.path.join(out.out_dir, vdir, file)
        if os.path.lexists(target):
            raise CheckpointError(
                f"{target} exists: version {version} references that file of version {shard.version} "
                "and extract never replaces a file; choose a new directory"
            )
        found.append(index.entry(f"{vdir}/{file}"))
    return found


def _range_chunks(src: Location, tar_name: str, start: int, length: int, name: str) -> Iterator[memoryview]:
    """``length`` bytes of the tar from ``start``, in reused chunks (8 MiB local, 64 MiB remote)."""
    buf = memoryview(bytearray(min(length, CHUNK if src.is_local else MAX_REQUEST)))
    pos, end = start, start + length
    while pos < end:
        view = buf[: min(len(buf), end - pos)]
        _read(src, tar_name, [ReadRange(pos, view)], name)
        pos += len(view)
        yield view


def _read(src: Location, tar_name: str, ranges: list[ReadRange], name: str) -> None:
    try:
        read_ranges(src.fs, src.path(tar_name), ranges, local=src.is_local)
    except EOFError as exc:
        raise CorruptShardError(
            _member(src, tar_name, name), expected="more bytes", actual=str(exc), what="size"
        ) from None


# -- without an index: one streaming pass -----------------------------------------------------------


def _from_stream(src: Location, tar_name: str, prefix: str, out: _Staging) -> set[str]:
    where = src.display(tar_name)
    seen: set[str] = set()
    with _open(src, tar_name) as raw:
        try:
            with tarfile.open(fileobj=raw, mode="r|", bufsize=CHUNK) as tar:
                for info in tar:
                    name = _check_info(info, out.root, where)
                    seen.add(name)
                    if info.isreg() and name.startswith(prefix):
                        out.write(name, _file_chunks(tar.extractfile(info)))
        except tarfile.TarError as exc:
            raise CorruptShardError(
                where, expected="a readable tar", actual=str(exc), what="format"
            ) from None
    _check_against_manifest(out, prefix, where)
    return seen


def _open(src: Location, tar_name: str) -> BinaryIO:
    if src.is_local:
        return os.fdopen(open_regular(src.path(tar_name), src.fs), "rb", buffering=0)
    return src.fs.open(src.path(tar_name), "rb", block_size=MAX_REQUEST)


def _check_info(info: tarfile.TarInfo, root: str, where: str) -> str:
    """The member's name (without a leading ``./``); refuse anything but a regular file or directory."""
    name = info.name
    while name.startswith("./"):  # ``tar -C dir -cf x.tar .`` writes ./v000007/...
        name = name[2:]
    if info.isdir() and name in ("", "."):
        return "."
    check_member_name(name, where)
    if not (info.isreg() or info.isdir()):
        kinds = {tarfile.SYMTYPE: "a symlink", tarfile.LNKTYPE: "a hard link", tarfile.FIFOTYPE: "a FIFO"}
        kind = kinds.get(info.type, "a device" if info.isdev() else f"of type {info.type!r}")
        raise UnsafeArchiveError(f"{where}: member {info.name!r} is {kind}; only regular files are extracted")
    data_filter = getattr(tarfile, "data_filter", None)  # Python >= 3.11.4, 3.10.12
    try:
        if data_filter is not None:
            data_filter(info, root)
    except tarfile.FilterError as exc:
        raise UnsafeArchiveError(f"{where}: member {info.name!r} refused: {exc}") from None
    return name


def _file_chunks(f: IO[bytes] | None) -> Iterator[memoryview]:
    if f is None:
        return
    while chunk := f.read(CHUNK):
        yield memoryview(chunk)


def _check_against_manifest(out: _Staging, prefix: str, where: str) -> None:
    """Without an index, the version's own manifest says what its shards must be."""
    staged = out.files.get(prefix + MANIFEST_FILE)
    if staged is None:
        if out.files:
            log.warning("%s has no %s%s: extracted files are not verified", where, prefix, MANIFEST_FILE)
        return
    with open(staged.temp, "rb") as f:
        manifest = parse_manifest(f.read(), f"{where} member {prefix}{MANIFEST_FILE}")
    others = sorted({s.version for s in manifest.shards if s.version is not None})
    if others:
        raise CheckpointError(
            f"{where}: {prefix}{MANIFEST_FILE} references bytes of version(s) {others}, which only the "
            "tarball's index can find: rebuild it (`ckptflow archive URL --reindex`) and extract again"
        )
    for shard in manifest.shards:
        name = f"{where} member {prefix}{shard.file}"
        got = out.files.get(prefix + shard.file)
        if got is None:
            raise CorruptShardError(name, expected="a member", actual="none", what="presence")
        if got.size != shard.size:
            raise CorruptShardError(
                name, expected=f"{shard.size} bytes", actual=f"{got.size} bytes", what="size"
            )
        if got.checksum != shard.checksum:
            raise CorruptShardError(name, expected=shard.checksum, actual=got.checksum)


# -- writing into out_dir ---------------------------------------------------------------------------


@dataclass
class _Staged:
    temp: str
    final: str
    size: int = 0
    checksum: str = ""


@dataclass
class _Staging:
    """Temporary files inside ``out_dir``, renamed into place together once all are verified."""

    out_dir: str
    root: str = ""
    files: dict[str, _Staged] = field(default_factory=dict)
    made: list[str] = field(default_factory=list)  # directories created, to remove on failure

    def __post_init__(self) -> None:
        missing, path = [], os.path.abspath(self.out_dir)
        while not os.path.lexists(path):
            missing.append(path)
            path = os.path.dirname(path)
        for directory in reversed(missing):  # removed again if the extraction fails
            os.mkdir(directory, 0o755)
            self.made.append(directory)
        _refuse_link_or_file(self.out_dir)
        self.root = os.path.realpath(self.out_dir)

    def write(self, name: str, chunks: Iterable[memoryview]) -> str:
        """Write member ``name`` to a temporary file; return its xxh3."""
        if name in self.files:
            raise UnsafeArchiveError(f"member {name!r} appears twice in the tar; refused")
        parts = name.split("/")
        parent = self._make_dirs(parts[:-1])
        temp = os.path.join(parent, f".{parts[-1]}.{uuid.uuid4().hex}.tmp")
        staged = self.files[name] = _Staged(temp, os.path.join(parent, parts[-1]))
        h = new_hasher()
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        try:
            for chunk in chunks:
                h.update(chunk)
                staged.size += len(chunk)
                while chunk:
                    chunk = chunk[os.write(fd, chunk) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        staged.checksum = h.hexdigest()
        return staged.checksum

    def _make_dirs(self, parts: list[str]) -> str:
        """``root/parts...``, created one level at a time; an existing non-directory (symlink) is refused."""
        path = self.root
        for part in parts:
            path = os.path.join(path, part)
            try:
                os.mkdir(path, 0o755)
                self.made.append(path)
            except FileExistsError:
                if not stat.S_ISDIR(os.lstat(path).st_mode):
                    raise UnsafeArchiveError(
                        f"{path} exists and is not a directory (a symlink?): refusing to extract through it"
                    ) from None
        return path

    def publish(self) -> list[str]:
        """Rename every verified file into place: shards first and durable, then the manifests."""
        is_manifest = [s for s in self.files.values() if os.path.basename(s.final) == MANIFEST_FILE]
        for group in ([s for s in self.files.values() if s not in is_manifest], is_manifest):
            for staged in group:
                _place(staged.temp, staged.final)
            for directory in sorted({os.path.dirname(s.final) for s in group}):
                fsync_dir(directory)
        self.made.clear()
        return [s.final for s in self.files.values()]

    def discard(self) -> None:
        """Remove what a failed extraction left: temporary files, then directories it created."""
        for staged in self.files.values():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staged.temp)
        for path in reversed(self.made):
            with contextlib.suppress(OSError):  # not empty: not ours to remove
                os.rmdir(path)


def _place(temp: str, final: str) -> None:
    """Rename ``temp`` to ``final`` unless ``final`` exists: a hard link never replaces a name."""
    try:
        os.link(temp, final)
    except FileExistsError:
        raise CheckpointError(
            f"{final} appeared while extracting; nothing there is replaced: choose a new directory"
        ) from None
    except OSError:  # no hard links on this filesystem: a rename, after a last look
        if os.path.lexists(final):
            raise CheckpointError(f"{final} appeared while extracting; choose a new directory") from None
        os.rename(temp, final)
        return
    os.unlink(temp)


def _member(src: Location, tar_name: str, name: str) -> str:
    return f"{src.display(tar_name)} member {name}"


def _not_found(prefix: str, where: str, seen: set[str]) -> None:
    versions = sorted({v for n in seen if (v := parse_version_dir(n.split("/", 1)[0])) is not None})
    version = parse_version_dir(prefix.rstrip("/"))
    if version is not None:
        raise VersionNotFoundError(version, where, versions)
    raise CheckpointError(f"{where} holds no member under {prefix}")
