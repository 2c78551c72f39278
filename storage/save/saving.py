"""How a save becomes a committed version: plan it, claim a number, write, commit.

:class:`VersionWriter` runs the same phases for every save, whether one
process makes it (the group of one, :meth:`RankGroup.solo`) or every rank of
a torch.distributed job: each rank plans the same split of the replicated
state (:meth:`VersionWriter.prepare`), rank 0 claims the version number for
all and every rank learns it, each rank writes its share and reports it, and
rank 0 commits (:meth:`VersionWriter.write`). A DCP save
(:mod:`..sharded.writer`) lets DCP plan and calls the same phases:
:meth:`~VersionWriter.claim`, :meth:`~VersionWriter.ensure_claim`,
:meth:`~VersionWriter.commit`, :meth:`~VersionWriter.discard`, and
:func:`new_manifest`. The store around it decides when (now, or in the
background from staged bytes) and keeps the state.

What must always hold: nothing is written before the whole state is known to
be storable and the version number is claimed (exclusively: two writers never
write one version's shards; see :mod:`.commit`); the manifest, written last,
is what makes the version exist; a failed save exposes nothing and leaves
the previous version the latest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

from ..errors import (
    CheckpointError,
    RankFailedError,
    SaveFailedError,
    UnsupportedValueError,
    VersionExistsError,
    VersionTakenError,
)
from ..files.location import Location, translate_errors
from ..format.blob import Blob, BlobBytes
from ..format.checksum import ALGORITHM, digest
from ..format.dtypes import dtype_name
from ..format.manifest import (
    MANIFEST_FILE,
    ManifestDraft,
    ShardEntry,
    clean_metrics,
    utc_now,
    writer_versions,
)
from ..format.manifest_checks import MAX_DOCUMENT_DEPTH, json_depth
from ..format.names import version_dir
from ..format.structure import Leaf, encode
from ..info import SaveRequest, StoreOptions, VersionInfo
from ..versions import catalog, claims
from ..versions import commit as protocol
from ..versions.catalog import archived_for_writing
from ..versions.housekeeping import last_change
from ..versions.lease import DEFAULT_TIMEOUT, LEASE_KEY, StoreLease, commit_lease, fence, read_lease
from . import dedup
from .distributed import OwnPlan, RankPlan, RankReport, assemble, plan_rank, tensor_entries
from .group import RankGroup
from .planner import CHUNK_BYTES, ChunkPlan
from .planner import SavePlan as BlobPlan

log = logging.getLogger(__name__)


CLAIM_TRIES = 100  # new numbers tried when other writers keep taking the next one
STALE_CLAIM_SECONDS = DEFAULT_TIMEOUT  # a claim on a version unchanged for this long is garbage


@dataclass(frozen=True)
class SaveJob:
    """A save, planned and numbered: what writing it needs."""

    version: int
    request: SaveRequest  # its metrics checked
    structure: Any
    refs: list[dict[str, Any]]  # the tensors' manifest entries, as JSON
    plan: RankPlan
    claimed: bool = True  # False: its number is claimed when the write starts (a solo async save)


# An epoch is a version number by default: a bound keeps directory names and dates sane.
MAX_EPOCH = 10**9
MAX_VERSION = 10**9
MAX_STEP = (1 << 63) - 1


def checked(request: SaveRequest) -> SaveRequest:
    """``request`` with its metrics as finite floats; raises before any I/O on what a manifest
    could not hold (a bad metric, metadata nested too deep)."""
    if json_depth(request.user) >= MAX_DOCUMENT_DEPTH:  # a reader would refuse the manifest
        raise UnsupportedValueError(
            "user", f"the metadata nests more than the {MAX_DOCUMENT_DEPTH - 1} levels it may hold"
        )
    for name, bound in (("epoch", MAX_EPOCH), ("step", MAX_STEP), ("version", MAX_VERSION)):
        value = getattr(request, name)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= bound
        ):
            raise ValueError(f"{name} must be an integer from 0 to {bound:,}, got {value!r}")
    return dataclasses.replace(
        request,
        metrics=clean_metrics(request.metrics),
        user=dict(request.user or {}),
    )


def new_manifest(
    request: SaveRequest,
    version: int,
    *,
    structure: Any,
    shards: list[ShardEntry],
    blobs: list[dict[str, Any]],
    tensors: list[dict[str, Any]],
    nbytes: int,
    seconds: float,
    **extra: Any,
) -> ManifestDraft:
    """The manifest of a save whose files are written, by any path (``extra``: the fields of a
    save from several ranks, or of chunked tensors); its entries are JSON. Its format version is
    the lowest that can read it (:func:`.document_bytes`)."""
    return ManifestDraft(
        version=version,
        epoch=request.epoch,
        step=request.step,
        metrics=clean_metrics(request.metrics),
        created=utc_now(),
        writer=writer_versions(),
        checksum_algorithm=ALGORITHM,
        nbytes=nbytes,
        shards=shards,
        blobs=blobs,
        tensors=tensors,
        structure=structure,
        user={**(request.user or {}), "save_seconds": round(seconds, 4)},
        lineage=request.lineage.model_dump(mode="json") if request.lineage else None,
        **extra,
    )


def chunked_structure(structure: Any, leaves: list[Leaf], chunks: list[ChunkPlan]) -> tuple[Any, list[Leaf]]:
    """The structure and leaves with each chunked leaf taken out: its ``{"$tensor": i}`` becomes
    ``{"$chunked": k}`` (its place among ``chunks``), the other leaves (``$tensor``, ``$ndarray``)
    renumbered in order."""
    chunk_of = {c.leaf: k for k, c in enumerate(chunks)}
    number: dict[int, int] = {}
    kept: list[Leaf] = []
    for i, leaf in enumerate(leaves):
        if i not in chunk_of:
            number[i] = len(kept)
            kept.append(leaf)

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(v) for v in node]
        if isinstance(node, dict):
            if len(node) == 1 and ("$tensor" in node or "$ndarray" in node):  # a leaf (arrays: never chunked)
                ((tag, i),) = node.items()
                return {"$chunked": chunk_of[i]} if i in chunk_of else {tag: number[i]}
            return {k: walk(v) for k, v in node.items()}
        return node

    return walk(structure), kept


def chunked_docs(chunks: list[ChunkPlan]) -> list[dict[str, Any]]:
    """The manifest's chunked entries (:class:`.ChunkedEntry`'s fields) of tensors in row chunks."""
    docs = []
    for c in chunks:
        rest = list(c.shape[1:])
        docs.append(
            {
                "path": c.path,
                "dtype": dtype_name(c.dtype),
                "shape": list(c.shape),
                "requires_grad": False,
                "chunks": [
                    {"offsets": [first, *[0] * len(rest)], "sizes": [rows, *rest], "blob": blob}
                    for first, rows, blob in c.rows
                ],
            }
        )
    return docs


# Fields of fsspec's file info that change with every write: local (mtime, ino), s3fs (ETag,
# LastModified), gcsfs (generation, md5Hash, updated), adlfs (etag, last_modified).
CHANGE_MARKS = (
    "ETag",
    "etag",
    "generation",
    "md5Hash",
    "mtime",
    "ino",
    "LastModified",
    "last_modified",
    "updated",
)


class VersionWriter:
    """Writes versions into one store, as one process or as one rank of a group."""

    def __init__(self, loc: Location, options: StoreOptions, group: RankGroup) -> None:
        self.loc, self.options, self.group = loc, options, group
        self.claim_token = claims.new_claim(uuid.uuid4().hex)  # how this writer claims version numbers
        self.lease: StoreLease | None = None  # the store's lease, when this writer's store holds it
        self.writes_for: frozenset[int] = frozenset()  # pids of this host whose lease it commits under
        self._index: dedup.ContentIndex | None = None  # what the next save may reference (:mod:`.dedup`)
        # The samples of the blobs this rank wrote or referenced in its last save, and its version.
        self._samples: tuple[int, set[dedup.Sample]] | None = None

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def world_size(self) -> int:
        return self.group.world_size

    def prepare(self, state: object, request: SaveRequest, *, defer_claim: bool = False) -> SaveJob:
        """Plan the save (nothing is written before the whole state is known to be storable), then
        agree on its version number: rank 0 claims it for every rank.

        ``defer_claim`` (one process, a given version number): the claim, and the checks that come
        with it, are made when the write starts, in the background: an async save returns after its
        copy alone. A refusal is then the save's failure, as a write's is."""
        try:
            request = checked(request)
            structure, leaves = encode(state)  # raises on unsupported values, before any I/O
            plan = plan_rank(
                leaves,
                request.rank_state,
                shards=self.options.shards,
                shard_bytes=self.options.shard_bytes,
                rank=self.rank,
                world_size=self.world_size,
                chunk_bytes=CHUNK_BYTES if self.options.dedup else None,
            )
            if plan.shared.chunks:  # large tensors in row chunks: chunked tensors of the manifest
                structure, leaves = chunked_structure(structure, leaves, plan.shared.chunks)
            refs = tensor_entries(leaves, plan.shared.refs)
        except Exception as exc:
            if not self.group.is_solo:  # the other ranks wait for this one in the claim: tell them
                with contextlib.suppress(CheckpointError):
                    self._claim_together(request.version, request.epoch, None, failure=exc)
            raise
        if defer_claim and self.group.is_solo and request.version is not None:
            if request.version < 0:
                raise ValueError(f"version must be >= 0, got {request.version}")
            return SaveJob(request.version, request, structure, refs, plan, claimed=False)
        number = self._claim_together(request.version, request.epoch, plan.shared.blobs)
        return SaveJob(number, request, structure, refs, plan)

    def _claim_together(
        self,
        version: int | None,
        epoch: int | None,
        blobs: list[Blob] | None,
        *,
        failure: Exception | None = None,
    ) -> int:
        """Rank 0 checks that every rank has the same replicated state and claims the version.

        A rank that could not plan its save (``failure``) takes part all the same, so that no rank
        waits for it: every rank then raises.
        """
        group = self.group
        if group.is_solo and failure is None:  # one process: nothing to compare, nobody waiting
            with translate_errors(self.loc, "saving to"):
                return self.claim(version, epoch)
        if failure is not None or blobs is None:
            found = group.gather({"error": f"{type(failure).__name__}: {failure}"})
        else:
            found = group.gather([[b.name, str(b.dtype), list(b.shape)] for b in blobs])

        def claim() -> int:
            assert found is not None
            failed = [f"rank {r}: {sig['error']}" for r, sig in enumerate(found) if isinstance(sig, dict)]
            if failed:
                raise RankFailedError(
                    f"nothing was written, a rank could not prepare its save: {'; '.join(failed)}"
                )
            differ = [r for r, sig in enumerate(found) if sig != found[0]]
            if differ:
                raise CheckpointError(
                    f"the replicated state of rank(s) {differ} differs from rank 0's (tensor names, "
                    "dtypes or shapes): every rank must pass the same state; put what differs in rank_state"
                )
            with translate_errors(self.loc, "saving to"):
                return self.claim(version, epoch)

        return int(group.agree(claim, "claiming a version"))

    # -- the phases every save path calls (a DCP save too: :mod:`..sharded.writer`) --

    def claim(self, version: int | None, epoch: int | None = None) -> int:
        """``version``, or by default the epoch's number when it is above every version directory
        (committed or not: a crashed save's name is never reused), else the next number above them;
        claimed exclusively before any shard is written. A store another writer holds is refused."""
        commit_lease(self.loc, self.lease, self.writes_for)
        if version is None:
            floor = epoch if epoch is not None and epoch >= 0 else 0
            number = catalog.next_version(self.loc, at_least=floor)
            for _ in range(CLAIM_TRIES):
                if self._claim_exclusively(number):
                    return number
                number = max(number + 1, catalog.next_version(self.loc, at_least=floor))  # taken meanwhile
            raise VersionTakenError(
                f"could not claim a new version number in {self.loc.display()}: other writers took "
                f"{CLAIM_TRIES} numbers in a row. Only one writer may use a store at a time"
            )
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        record = protocol.read_record(self.loc, version)
        if (record is not None and not record.is_writing()) or version in archived_for_writing(self.loc):
            raise VersionExistsError(version, self.loc.display())
        if record is not None:
            kept = catalog.references(self.loc).keep(version)
            if kept:
                raise CheckpointError(
                    f"version {version} of {self.loc.display()} was removed, but its directory keeps "
                    f"{', '.join(sorted(kept))}, whose bytes committed versions reference: its number "
                    "cannot be written again; save without a version number (the next free one)"
                )
            self.clear_leftovers(version)
        if not self._claim_exclusively(version):
            raise self._taken(version, claims.read_claim(self.loc, version))
        return version

    def _claim_exclusively(self, version: int) -> bool:
        """Create ``version``'s claim (False: another writer's is there). A claim that could not be
        written (a full disk) leaves no empty version directory, which would keep its number taken."""
        try:
            return claims.claim_version(self.loc, version, self.claim_token)
        except BaseException:
            if self.loc.is_local:
                with contextlib.suppress(OSError):  # only an empty one: nothing anyone wrote
                    os.rmdir(self.loc.path(version_dir(version)))
            raise

    def clear_leftovers(self, version: int) -> None:
        """Remove an uncommitted ``version`` before writing it, unless another live writer is writing it."""
        found = claims.read_claim(self.loc, version)
        if found is not None and found.token != self.claim_token.token and not self._is_stale(found, version):
            raise self._taken(version, found)
        log.info("removing leftovers of an interrupted save of version %d", version)
        protocol.clear_leftovers(self.loc, version)

    def _is_stale(self, found: claims.Claim, version: int) -> bool:
        """Whether another writer's claim is a leftover: its process is gone, or it predates the
        store's current lease (this writer holds it, or writes for its holder), or nothing changed
        in the version for a lease timeout."""
        if found.writer_ended():
            return True
        if self.lease is not None and self.lease.is_held():
            return True
        holder = read_lease(self.loc)
        if holder is not None and holder.started > found.created:
            return True
        changed = last_change(self.loc, self.loc.path(version_dir(version)))
        return changed is not None and time.time() - changed > STALE_CLAIM_SECONDS

    def _taken(self, version: int, found: claims.Claim | None) -> VersionTakenError:
        who = f" ({found.describe()})" if found is not None else ""
        return VersionTakenError(
            f"version {version} in {self.loc.display()} is being written by another writer{who}. Only "
            "one writer may use a store at a time: wait for it, or if it is gone, remove the leftovers "
            f"with `ckptflow gc` (or store.gc()); they also count as gone {STALE_CLAIM_SECONDS:g}s after "
            "their last change"
        )

    def ensure_claim(self, version: int) -> None:
        """Before writing: the version is still this writer's claim (claim it again after leftovers
        of a failed attempt were cleared)."""
        found = claims.read_claim(self.loc, version)
        if found is not None and found.token == self.claim_token.token:
            return
        if found is not None or not self._claim_exclusively(version):
            raise self._taken(version, claims.read_claim(self.loc, version))

    def commit(self, manifest: ManifestDraft) -> None:
        """Commit under this writer's claim and under the store's lease, if a writer holds it (this
        one, or the process it writes for: the manifest records the lease's token); a failure drops
        the claim. While another writer holds the store, nothing is committed."""
        try:
            with fence(self.loc):  # no takeover between the lease's check and the manifest's link
                token = commit_lease(self.loc, self.lease, self.writes_for)
                if token is not None:
                    manifest = dataclasses.replace(manifest, writer={**manifest.writer, LEASE_KEY: token})
                protocol.commit(self.loc, manifest, claim=self.claim_token.token)
        except BaseException:
            self.discard(manifest.version)
            raise
        if self.options.dedup:
            with contextlib.suppress(Exception):  # (unknown: the next save reads the index again)
                self._index = None
                self._index = self._new_index(
                    manifest.version,
                    manifest.shards,
                    manifest.blobs,
                    self._manifest_identity(manifest.version),
                )

    def content_index(self, parent: int | None) -> dedup.ContentIndex | None:
        """The blobs the next save may reference: those of ``parent`` (the version the store last
        committed or loaded), else of the newest committed version; None when there is none, or it
        is archived (its bytes are then no loose files to reference). The index kept from the last
        save or read is used while its version is committed: removal keeps every file a committed
        version references, so a prune or gc here or in another process leaves it valid. Either
        way, a file is referenced only if it is there as the index recorded it when the save is
        split (:attr:`.dedup.ContentIndex.present`): a directory removed by hand heals at the next save."""
        index = self._index
        if index is not None and index.identity is not None and (parent is None or index.version == parent):
            with translate_errors(self.loc, "reading"):  # still this manifest (another process may prune)
                if self._manifest_identity(index.version) == index.identity:
                    return index
        with translate_errors(self.loc, "reading"):
            found = catalog.lookup(self.loc, parent) if parent is not None else catalog.newest(self.loc)
            if found is None or found.is_archived:
                return None
            identity = self._manifest_identity(found.version)
        self._index = self._new_index(found.version, found.manifest.shards, found.manifest.blobs, identity)
        return self._index

    def _new_index(
        self, version: int, shards: list[ShardEntry], blobs: Any, identity: tuple[object, ...] | None
    ) -> dedup.ContentIndex:
        loc = self.loc

        def present(files: list[ShardEntry]) -> set[int]:
            with translate_errors(loc, "reading"):
                return protocol.present_shards(loc, files)

        return dedup.ContentIndex(
            version, shards, blobs, self._samples_of(version), identity=identity, present=present
        )

    def _manifest_identity(self, version: int) -> tuple[object, ...] | None:
        """What tells ``version``'s manifest file from another written in its place (a version
        deleted and saved again under its number): its size and what the filesystem changes with
        every write (an ETag, a generation, a modification time and inode), or, where it keeps
        none of these (``memory://``), the digest of its bytes; None if it is absent."""
        path = self.loc.path(version_dir(version), MANIFEST_FILE)
        self.loc.fs.invalidate_cache(path)
        try:
            info = self.loc.fs.info(path)
            marks = tuple(str(info[k]) for k in CHANGE_MARKS if info.get(k) is not None)
            if not marks:
                marks = (digest(self.loc.fs.cat_file(path)),)
        except FileNotFoundError:
            return None
        return (info.get("size"), *marks)

    def keep_samples(self, version: int, split: dedup.Split) -> None:
        """Remember the samples of this rank's blobs in the save of ``version`` (:func:`.dedup.sample`),
        for the index the next save reads. A rank of a multi-process save knows only its own share's:
        a blob another rank wrote then counts as changed on this one, and is written again (never
        referenced wrongly); deterministic plans give every rank the same share at every save."""
        self._samples = (version, split.samples)

    def _samples_of(self, version: int) -> set[dedup.Sample] | None:
        """The samples kept for ``version``, if this rank's last save wrote it; else None (unknown)."""
        return self._samples[1] if self._samples is not None and self._samples[0] == version else None

    def discard(self, version: int) -> None:
        """After a failed save: remove its partial files (its claim shows they are this writer's,
        and no manifest made them a version), so a full disk is freed at once. Ranked saves call
        it on rank 0 once every rank has reported, i.e. stopped writing."""
        with contextlib.suppress(Exception):
            found = claims.read_claim(self.loc, version)
            record = protocol.read_record(self.loc, version)
            if found is not None and found.token == self.claim_token.token and record and record.is_writing():
                self.loc.remove_tree(self.loc.path(version_dir(version)))
                log.info("removed the partial files of the failed save of version %d", version)
                return
        self._abandon(version)

    def _abandon(self, version: int) -> None:
        """After a failed save: drop this writer's claim, so its leftovers count as garbage."""
        with contextlib.suppress(Exception):
            found = claims.read_claim(self.loc, version)
            if found is not None and found.token == self.claim_token.token:
                claims.drop_claim(self.loc, version)

    def _vanished(self, version: int, exc: FileNotFoundError) -> SaveFailedError:
        """A save's own files or directory gone while it wrote: removed by hand, or by another
        process's removal that took them for a crash's leftovers."""
        error = SaveFailedError(
            f"not committing {self.loc.display(version_dir(version))}: {exc.filename or 'a file'} went "
            "while the save was writing it (removed by hand, or by another process). The previous "
            "version stays the latest; save again"
        )
        error.__cause__ = exc
        return error

    def write_share(
        self,
        version: int,
        plan: BlobPlan,
        blob_bytes: BlobBytes,
        parent: int | None,
        *,
        rank: int | None = None,
        piece_bytes: int | None = None,
    ) -> tuple[list[ShardEntry], dict[int, dict[str, Any]]]:
        """Write this rank's share of a version's tensors: with dedup, reference the chunks the
        store already holds (from ``parent`` on) and write the rest; return the shard entries and
        blob entries, as :func:`.write_shards` does. Plain and DCP saves both write through here
        (``rank``: the writing rank, when DCP's numbering is not the group's)."""
        from .writer import write_shards

        rank = self.rank if rank is None else rank
        split = None
        if self.options.dedup and plan.shards:
            index = self.content_index(parent)
            split = dedup.split(plan, blob_bytes, index, rank=rank, shard_bytes=self.options.shard_bytes)
            plan = split.plan
        files, written = write_shards(
            self.loc,
            version_dir(version),
            plan,
            blob_bytes,
            threads=self.options.threads,
            rank=rank,
            piece_bytes=piece_bytes,
            keys=split.keys if split is not None else None,
        )
        if split is not None:
            files, written = split.merge(files, written)
            self.keep_samples(version, split)
        return files, written

    def write_own(
        self, version: int, own: OwnPlan, own_bytes: BlobBytes, *, rank: int | None = None
    ) -> dict[str, Any]:
        """Write this rank's own state (its RNG, its loader) in its own file; its report."""
        from .writer import write_shards

        rank = self.rank if rank is None else rank
        files, written = write_shards(
            self.loc, version_dir(version), own.plan, own_bytes, threads=1, rank=rank
        )
        return own.report(files, written)

    def write(self, job: SaveJob, shared_bytes: BlobBytes, own_bytes: BlobBytes) -> VersionInfo:
        """Write this rank's files and report them to rank 0, which commits if every rank succeeded;
        every rank returns the committed version, or raises (its own failure, if it had one)."""
        start = time.perf_counter()
        vdir = version_dir(job.version)
        failure: BaseException | None = None
        try:
            with translate_errors(self.loc, "saving to"):
                if not job.claimed:
                    self.claim(job.version, job.request.epoch)
                elif self.rank == 0:
                    self.ensure_claim(job.version)
                parent = job.request.lineage.parent if job.request.lineage else None
                shards, written = self.write_share(job.version, job.plan.shared, shared_bytes, parent)
                own = None
                if job.plan.own is not None:
                    own = self.write_own(job.version, job.plan.own, own_bytes)
            mine = RankReport(shards, written, own)
        except BaseException as exc:  # tell rank 0, so that it does not commit and nobody waits forever
            failure = self._vanished(job.version, exc) if isinstance(exc, FileNotFoundError) else exc
            mine = RankReport.failed(failure)
        reports = self.group.gather(mine, wire=(RankReport.to_json, RankReport.from_json))

        def commit() -> dict[str, Any]:
            assert reports is not None
            errors = [f"rank {r}: {rep.error}" for r, rep in enumerate(reports) if rep.error is not None]
            if errors:  # every rank has stopped writing (it reported): the partial files can go
                self.discard(job.version)
                raise RankFailedError(f"nothing was committed: {'; '.join(errors)}")
            try:
                parts = assemble(reports, len(job.plan.shared.blobs))
            except BaseException:
                self.discard(job.version)
                raise
            seconds = time.perf_counter() - start
            manifest = new_manifest(
                job.request,
                job.version,
                structure=job.structure,
                shards=parts.shards,
                blobs=parts.blobs,
                tensors=job.refs,
                nbytes=job.plan.shared.nbytes + parts.own_nbytes,
                seconds=seconds,
                world_size=self.world_size,
                ranks=parts.ranks,
                chunked=chunked_docs(job.plan.shared.chunks),
            )
            with translate_errors(self.loc, "saving to"):
                self.commit(manifest)
            log.info(
                "committed %s (%d bytes in %.2fs, %d rank(s))",
                self.loc.display(vdir),
                manifest.total_size,
                seconds,
                self.world_size,
            )
            return dataclasses.asdict(VersionInfo.from_manifest(manifest, self.loc.display(vdir)))

        try:
            info = self.group.agree(commit, f"the save of version {job.version}")
        except RankFailedError:
            if failure is not None:
                raise failure from None
            raise
        if failure is not None:  # only an interrupt reaches here: rank 0 committed nothing without it
            raise failure
        return VersionInfo(**info)


__all__ = ["SaveJob", "VersionWriter", "checked", "new_manifest"]
