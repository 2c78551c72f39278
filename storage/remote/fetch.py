"""Bringing a store's newest version back from its durable tier (its mirror) into its fast tier.

A store written on a fast local disk and mirrored to a durable URL (:mod:`.mirror`) is two tiers
of one store: the same version numbers, the same files under the same names, the same identity
(:mod:`..versions.identity`). When the durable tier holds a newer committed version than the fast
tier (the machine was lost, a pod was rescheduled onto an empty disk, ``/dev/shm`` was wiped),
:func:`fetch_newest` brings that version back: only the files it needs and the fast tier lacks,
each downloaded and verified (S3's checksum as it lands, then the manifest's xxh3-64 of the file),
files before the manifest, which commits the version in the fast tier as a save would. The run's
identity (``run.json``) comes with it when the fast tier has none. A file
the fast tier already holds is kept only if its bytes hash to the manifest's checksum; a version
that the durable tier holds only in a tarball comes back as that tarball, its index last.

An empty fast tier takes the durable tier's identity, so that it goes on mirroring to the same
URL; a fast tier that holds versions of another store is refused before a byte is written.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..archive.tarballs import archive_location
from ..archive.tarindex import index_name, read_index
from ..errors import CheckpointError
from ..files.atomic import write_file_atomic
from ..files.byteio import hash_file
from ..files.location import Location, open_location, redact, translate_errors
from ..files.s3options import TransferOptions
from ..format.manifest import Manifest, ShardEntry
from ..format.manifest_checks import MAX_BYTES
from ..format.names import ARCHIVE_DIR, RUN_FILE, STORE_FILE, version_dir
from ..versions import catalog, claims
from ..versions import commit as protocol
from ..versions.identity import StoreIdentity, holds_nothing, read_identity

THREADS = 8  # files downloaded at once: many small shards need several requests in flight


@dataclass(frozen=True)
class Fetched:
    """A version brought back from the durable tier."""

    version: int
    source: str  # the durable tier's URL (credentials redacted)
    files: int  # files downloaded
    bytes: int  # their bytes
    kept: int  # files the fast tier held already, verified
    seconds: float
    archived: bool  # it came as a tarball
    lost: tuple[int, ...] = ()  # newer versions the lost fast tier had committed (known to a pipeline)


def newest_there(url: str, storage_options: dict[str, Any]) -> catalog.Located | None:
    """The newest committed version at ``url`` (None: none)."""
    return catalog.newest(open_location(url.rstrip("/"), storage_options))


def fetch_newest(loc: Location, url: str, storage_options: dict[str, Any]) -> Fetched | None:
    """Bring the durable tier's newest committed version into the local store ``loc`` when it is
    newer than the newest ``loc`` holds; None when ``loc`` is as new (or the durable tier empty).

    The caller holds the store's writer lease: nothing else writes ``loc`` meanwhile."""
    started = time.monotonic()
    root = url.rstrip("/")
    there = open_location(root, storage_options)
    with translate_errors(there, "reading the newest version of"):
        theirs = catalog.newest(there)
    if theirs is None:
        return None
    ours = catalog.newest(loc)
    if ours is not None and ours.version >= theirs.version:
        return None
    adopt_identity(loc, there, holds_versions=ours is not None)
    options = TransferOptions().honouring(storage_options)
    _fetch_beside(loc, there)
    if theirs.archived is not None:
        files, size = _fetch_tarball(loc, root, theirs.archived.tar, storage_options, options)
        kept = 0
    else:
        files, size, kept = _fetch_loose(loc, root, theirs.manifest, storage_options, options)
    return Fetched(
        theirs.version,
        redact(there.display()),
        files,
        size,
        kept,
        time.monotonic() - started,
        theirs.archived is not None,
    )


def adopt_identity(loc: Location, there: Location, *, holds_versions: bool) -> None:
    """Give ``loc`` the identity of the store ``there`` mirrors, or refuse: a fast tier holding
    versions of another store is not filled from this one."""
    theirs = read_identity(there)
    if theirs is None:  # a mirror an older ckptflow wrote: the first upload checks its manifests
        return
    ours = read_identity(loc)
    if ours is not None and ours.id == theirs.id:
        return
    if holds_versions or not holds_nothing(loc):
        raise CheckpointError(
            f"not fetching from {there.display()} into {loc.display()}: {loc.display()} holds versions of "
            f"another store (its {STORE_FILE} says so). Give the run an empty --storage directory, or "
            "the durable URL this store mirrors to"
        )
    write_file_atomic(loc, STORE_FILE, StoreIdentity(theirs.id).to_json())  # nothing of its own yet


def _fetch_beside(loc: Location, there: Location) -> None:
    """The run's identity (``run.json``) the mirror holds, when this store has none."""
    if os.path.exists(loc.path(RUN_FILE)):
        return
    try:
        data = bytes(there.fs.cat_file(there.path(RUN_FILE), start=0, end=MAX_BYTES + 1))
    except FileNotFoundError:
        return
    if len(data) <= MAX_BYTES:
        write_file_atomic(loc, RUN_FILE, data)


def _fetch_loose(
    loc: Location,
    root: str,
    manifest: Manifest,
    storage_options: dict[str, Any],
    options: TransferOptions,
) -> tuple[int, int, int]:
    """The version's files the fast tier lacks, downloaded and verified, then its manifest.
    Returns (files downloaded, their bytes, files kept)."""
    version = manifest.version
    record = protocol.read_record(loc, version)
    if record is not None and record.is_writing():  # a save here that never committed
        protocol.clear_leftovers(loc, version)
    token = f"fetch-{os.getpid()}-{time.monotonic_ns()}"
    if not claims.claim_version(loc, version, claims.new_claim(token)):
        raise CheckpointError(f"{loc.display(version_dir(version))} is being written by another process")
    shards = list(zip(manifest.shards, manifest.shard_files(), strict=True))
    needed = [(s, where, name) for s, (where, name) in shards if not _holds(loc, where, name, s)]
    with ThreadPoolExecutor(max_workers=THREADS) as pool:
        list(
            pool.map(
                lambda item: _download(root, loc, item[1], item[2], item[0], storage_options, options),
                needed,
            )
        )
    protocol.commit(loc, manifest, claim=token)
    return len(needed), sum(s.size for s, _, _ in needed), len(shards) - len(needed)


def _holds(loc: Location, where: str, name: str, shard: ShardEntry) -> bool:
    """Whether the fast tier has this file with the manifest's bytes (hashed: a name and a size
    say nothing of the bytes)."""
    path = loc.path(where, name)
    try:
        if os.path.getsize(path) != shard.size:
            return False
    except OSError:
        return False
    return hash_file(loc.fs, path, local=True)[1] == shard.checksum


def _download(
    root: str,
    loc: Location,
    where: str,
    name: str,
    shard: ShardEntry,
    storage_options: dict[str, Any],
    options: TransferOptions,
) -> None:
    from .transfer import download_file

    path = loc.path(where, name)
    url = f"{root}/{where}/{name}"
    download_file(url, path, storage_options=storage_options, options=options)
    size, checksum = hash_file(loc.fs, path, local=True)
    if size != shard.size or checksum != shard.checksum:
        os.unlink(path)
        raise CheckpointError(
            f"{redact(url)} does not hold the bytes its manifest names (size {size}, "
            f"xxh3-64 {checksum}; the manifest: {shard.size}, {shard.checksum}): the durable copy was "
            "changed by hand or damaged; nothing of it was kept"
        )


def _fetch_tarball(
    loc: Location, root: str, tar: str, storage_options: dict[str, Any], options: TransferOptions
) -> tuple[int, int]:
    """The tarball holding the version, then its index (the tarball's commit in the fast tier)."""
    from .transfer import download_file

    ours = archive_location(loc)
    size = 0
    for name in (tar, index_name(tar)):
        url = f"{root}/{ARCHIVE_DIR}/{name}"
        result = download_file(url, ours.path(name), storage_options=storage_options, options=options)
        size += result.size
    read_index(ours, tar)  # committed here, and whole
    return 2, size
