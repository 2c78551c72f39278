"""Mirroring a local store to another URL, one version or one tarball at a time, committed last.

A mirror is a store of its own, so it is written in the order that makes one: a
version's shards go up first, each uploaded and verified, and its manifest last
(the version's commit on the mirror); a tarball goes up before its index (the
tarball's commit). A mirror therefore never lists a version whose bytes are
not all there. Uploading again after a crash skips what is already there and
verified (:func:`.transfer.upload_file`). Uploads copy from a local store
(:func:`require_local`), with the options of :func:`.options.upload_storage_options`.

A mirror belongs to one store (:func:`..versions.identity.bind_mirror`): before the first byte
of each upload, the mirror's identity is checked, and another store's mirror is refused. A file
that a version references in an older version's directory is skipped when the mirror has it
under its name, which is its identity (:func:`..format.names.file_identity`), with its size; a
file of an older save, without one, is skipped only when its bytes there are verified the same.

:mod:`.transfer` is imported at the first upload, and boto3 at the first
S3 transfer: a process that never uploads does not wait for their imports.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ..archive.tarballs import archive_location
from ..archive.tarindex import index_name, read_index
from ..errors import CheckpointError
from ..files.location import Location, open_location, translate_errors
from ..files.s3options import TransferOptions
from ..format.manifest import MANIFEST_FILE, Manifest
from ..format.names import RUN_FILE, file_identity, version_dir
from ..versions.identity import bind_mirror, check_mirror

# storage/__init__.py imports it from here

if TYPE_CHECKING:
    from .results import TransferResult


def upload_file(local_path: str, url: str, *, storage_options: dict[str, Any]) -> TransferResult:
    """:func:`.transfer.upload_file` with the timeouts and attempts set in ``storage_options``."""
    from . import transfer

    options = TransferOptions().honouring(storage_options)
    return transfer.upload_file(local_path, url, storage_options=storage_options, options=options)


def mirror_version(loc: Location, manifest: Manifest, url: str, storage_options: dict[str, Any]) -> str:
    """Upload the loose version ``manifest`` describes from the local store ``loc`` to ``url``: its
    shards, then its manifest. Returns the URL of the version's directory on the mirror."""
    vdir = version_dir(manifest.version)
    root = url.rstrip("/")
    bind(loc, root, storage_options)
    _refuse_another_version(loc, vdir, root, storage_options)
    # The files of other versions it references first (each into its own version's directory
    # there, skipped when the mirror has it already), then its own, then its manifest: the mirror
    # never holds a manifest whose bytes are not all there.
    shards = sorted(
        zip(manifest.shards, manifest.shard_files(), strict=True), key=lambda p: p[0].version is None
    )
    for shard, (where, name) in shards:
        identified = shard.version is not None and file_identity(name) is not None
        if identified and _mirrored(f"{root}/{where}/{name}", shard.size, storage_options):
            continue
        upload_file(loc.path(where, name), f"{root}/{where}/{name}", storage_options=storage_options)
    mirror_beside(loc, root, storage_options)
    upload_file(
        loc.path(vdir, MANIFEST_FILE), f"{root}/{vdir}/{MANIFEST_FILE}", storage_options=storage_options
    )
    return f"{root}/{vdir}"


def mirror_beside(loc: Location, root: str, storage_options: dict[str, Any]) -> None:
    """The run's identity (``run.json``, which ckptflow's pipeline writes beside the versions) on
    the mirror too, before a version that the run wrote commits there: a run resumed from the
    mirror on another machine is checked against it. Written only when it changed."""
    try:
        ours = bytes(loc.fs.cat_file(loc.path(RUN_FILE)))
    except FileNotFoundError:
        return
    there = open_location(root, storage_options)
    try:
        if bytes(there.fs.cat_file(there.path(RUN_FILE))) == ours:
            return
    except FileNotFoundError:
        pass
    with translate_errors(there, "writing the run's identity to"):
        there.fs.pipe_file(there.path(RUN_FILE), ours)


def _refuse_another_version(loc: Location, vdir: str, root: str, storage_options: dict[str, Any]) -> None:
    """Refuse to replace a version the mirror holds with another of the same number (a copy of the
    store made by hand and trained on, or a version removed here and saved again): the mirror keeps
    what it holds, and says so before anything is written."""
    there = open_location(f"{root}/{vdir}", storage_options)
    try:
        held = bytes(there.fs.cat_file(there.path(MANIFEST_FILE)))
    except FileNotFoundError:
        return
    if held != bytes(loc.fs.cat_file(loc.path(vdir, MANIFEST_FILE))):
        raise CheckpointError(
            f"not mirroring {loc.display(vdir)}: the mirror {root} holds another version under that "
            "number (committed there before: a copy of this store trained on, or a version removed "
            "here and saved again). The mirror keeps it; mirror this store to a URL of its own"
        )


def _mirrored(url: str, size: int, storage_options: dict[str, Any]) -> bool:
    """Whether the mirror holds a file of ``size`` bytes at ``url``, a file name that is its identity
    (a referenced shard an earlier upload of this store sent: shard files are never rewritten)."""
    try:
        found = open_location(url.rsplit("/", 1)[0], storage_options)
        return int(found.fs.size(found.path(url.rsplit("/", 1)[1]))) == size
    except (FileNotFoundError, OSError):
        return False


def mirror_archive(loc: Location, tar: str, url: str, storage_options: dict[str, Any]) -> str:
    """Upload the committed tarball ``tar`` of the local store ``loc`` to ``url``'s ``archive/``, then
    its index. Returns the URL of the tarball on the mirror."""
    aloc = archive_location(loc)
    bind(loc, url.rstrip("/"), storage_options)
    remote = f"{url.rstrip('/')}/archive"
    mirror_beside(loc, url.rstrip("/"), storage_options)
    for name in (tar, index_name(tar)):
        upload_file(aloc.path(name), f"{remote}/{name}", storage_options=storage_options)
    read_index(aloc, tar)  # still committed here, after the upload
    return f"{remote}/{tar}"


def bind(loc: Location, url: str, storage_options: dict[str, Any], *, write: bool = True) -> None:
    """Refuse ``url`` unless it is (or now becomes) the mirror of the store at ``loc``;
    ``write=False``: only check, writing nothing (a run's check before it starts)."""

    def ours_at(path: str) -> bytes | None:
        try:
            return bytes(loc.fs.cat_file(loc.path(path)))
        except FileNotFoundError:
            return None

    (bind_mirror if write else check_mirror)(loc, open_location(url, storage_options), ours_at=ours_at)


def require_local(loc: Location) -> None:
    """Refuse a store that is not a local directory: uploads copy from one."""
    if not loc.is_local or not os.path.isdir(loc.root):
        raise CheckpointError(
            f"uploads copy from a local store; {loc.display()} is not one (write archives there directly)"
        )
