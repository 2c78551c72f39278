"""CheckpointStore: save, load, list, verify, prune and collect garbage at one URL.

This is the library's front door. It composes the pure parts (structure,
planner, retention) with the mechanism (writer, reader, commit) and holds the
one piece of state a store needs in memory: the async save in flight, if any.

What always holds: ``save`` returns only after the version is committed;
``save_async`` returns once the state is copied, and the version is committed
by the time its handle's ``wait()`` returns. A failed or interrupted save
leaves the previous committed version the latest and exposes nothing. Only
one process may write to a store at a time.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from . import catalog, housekeeping
from . import commit as protocol
from .archiving import list_archived
from .async_save import AsyncSaver, SaveHandle
from .byteio import hash_range, tensor_bytes
from .checksum import ALGORITHM
from .commit import version_dir
from .errors import CorruptShardError, ManifestError, VersionExistsError, VersionNotFoundError
from .loader import as_bytes, build_tensors, target_buffers
from .location import open_location, translate_errors
from .manifest import Manifest, TensorEntry, clean_metrics, utc_now, writer_versions
from .planner import SavePlan, plan_save
from .reader import check_size, read_blobs
from .retention import RetentionPolicy
from .staging import StagingBuffer
from .structure import decode, encode, leaf_refs, select
from .tarindex import TarIndex

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoreOptions:
    """How a store writes and reads; the defaults suit a local disk or S3."""

    shards: int = 4
    threads: int = 4
    verify_on_load: bool = True

    def __post_init__(self) -> None:
        if self.shards < 1:
            raise ValueError(f"shards must be >= 1, got {self.shards}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")


@dataclass(frozen=True)
class VersionInfo:
    """A committed version, as listed by :meth:`CheckpointStore.versions`."""

    version: int
    epoch: int | None
    step: int | None
    metrics: dict[str, float]
    created: str
    nbytes: int  # tensor bytes in the state
    size: int  # bytes on storage
    url: str
    save_seconds: float | None = None
    user: dict[str, Any] = field(default_factory=dict)
    archived: bool = False  # lives in a tarball under archive/ (url names the tarball and member)

    @classmethod
    def from_manifest(cls, m: Manifest, url: str, *, archived: bool = False) -> VersionInfo:
        return cls(
            m.version,
            m.epoch,
            m.step,
            dict(m.metrics),
            m.created,
            m.nbytes,
            m.total_size,
            url,
            m.user.get("save_seconds"),
            dict(m.user),
            archived,
        )


class CheckpointStore:
    """Checkpoints of one training run under an fsspec URL (path, file://, s3://, memory://)."""

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        storage_options: dict[str, Any] | None = None,
        options: StoreOptions | None = None,
    ) -> None:
        self.loc = open_location(url, storage_options)
        self.options = options or StoreOptions()
        self._staging = StagingBuffer()
        self._saver = AsyncSaver()

    @property
    def url(self) -> str:
        """The store's URL without credentials."""
        return self.loc.display()

    def __repr__(self) -> str:
        return f"CheckpointStore({self.url!r})"

    # -- saving ---------------------------------------------------------------

    def save(
        self,
        state: object,
        *,
        epoch: int | None = None,
        step: int | None = None,
        metrics: dict[str, float] | None = None,
        version: int | None = None,
        user: dict[str, Any] | None = None,
    ) -> VersionInfo:
        """Write ``state`` as a new committed version and return it."""
        self._saver.wait_previous()
        job = self._prepare(state, epoch, step, metrics, version, user)
        device = [b for b in job.plan.blobs if b.source.device.type != "cpu"]
        staged = self._staging.stage(device) if device else {}
        return self._write(job, lambda b: staged[b.index] if b.index in staged else tensor_bytes(b.source))

    def save_async(
        self,
        state: object,
        *,
        epoch: int | None = None,
        step: int | None = None,
        metrics: dict[str, float] | None = None,
        version: int | None = None,
        user: dict[str, Any] | None = None,
    ) -> SaveHandle:
        """Copy ``state`` to host memory, then write and commit it in the background.

        Returns once the copy is done: the caller may change its tensors. At
        most one save is in flight; a second call waits for the first and
        raises its failure, if it failed and nobody called ``wait()``.
        """
        self._saver.wait_previous()
        job = self._prepare(state, epoch, step, metrics, version, user)
        staged = self._staging.stage(job.plan.blobs)
        attempts = 0

        def write() -> VersionInfo:
            nonlocal attempts
            attempts += 1
            if attempts > 1:  # a resubmitted save: drop what the failed attempt left
                protocol.clear_leftovers(self.loc, job.version)
            return self._write(job, lambda b: staged[b.index])

        return self._saver.submit(write, job.version)

    def wait(self) -> VersionInfo | None:
        """Wait for the async save in flight, if any; raise its failure."""
        return self._saver.wait_previous()

    def _prepare(
        self,
        state: object,
        epoch: int | None,
        step: int | None,
        metrics: dict[str, float] | None,
        version: int | None,
        user: dict[str, Any] | None,
    ) -> _SaveJob:
        structure, leaves = encode(state)  # raises on unsupported values, before any I/O
        plan = plan_save(leaves, shards=self.options.shards)
        refs = [
            TensorEntry(
                path=leaf.path,
                blob=r.blob,
                dtype=_name(r.dtype),
                shape=list(r.shape),
                stride=list(r.stride) if r.stride is not None else None,
                offset=r.offset,
            )
            for leaf, r in zip(leaves, plan.refs, strict=True)
        ]
        clean = clean_metrics(metrics)
        with translate_errors(self.loc, "saving to"):
            number = self._claim_version(version)
        return _SaveJob(number, epoch, step, clean, structure, refs, plan, dict(user or {}))

    def _claim_version(self, version: int | None) -> int:
        if version is None:  # above every directory, committed or not: never reuse a crashed one's name
            return catalog.next_version(self.loc)
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        record = protocol.read_record(self.loc, version)
        if (record is not None and not record.is_writing()) or version in list_archived(self.loc):
            raise VersionExistsError(version, self.url)
        if record is not None:
            log.info("removing leftovers of an interrupted save of version %d", version)
            protocol.clear_leftovers(self.loc, version)
        return version

    def _write(self, job: _SaveJob, blob_bytes) -> VersionInfo:
        from .writer import write_shards

        start = time.perf_counter()
        vdir = version_dir(job.version)
        with translate_errors(self.loc, "saving to"):
            shards, blobs = write_shards(self.loc, vdir, job.plan, blob_bytes, threads=self.options.threads)
            seconds = time.perf_counter() - start
            manifest = Manifest(
                version=job.version,
                epoch=job.epoch,
                step=job.step,
                metrics=job.metrics,
                created=utc_now(),
                writer=writer_versions(),
                checksum_algorithm=ALGORITHM,
                nbytes=job.plan.nbytes,
                shards=shards,
                blobs=blobs,
                tensors=job.refs,
                structure=job.structure,
                user={**job.user, "save_seconds": round(seconds, 4)},
            )
            protocol.commit(self.loc, manifest)
        log.info("committed %s (%d bytes in %.2fs)", self.loc.display(vdir), manifest.total_size, seconds)
        return VersionInfo.from_manifest(manifest, self.loc.display(vdir))

    # -- reading --------------------------------------------------------------

    def versions(self) -> list[VersionInfo]:
        """Committed versions, loose and archived, oldest first."""
        with translate_errors(self.loc, "listing"):
            return [self._info(x) for x in catalog.committed(self.loc)]

    def latest(self) -> VersionInfo | None:
        """The newest committed version (the one a resumed run starts from), or None."""
        with translate_errors(self.loc, "listing"):
            found = catalog.newest(self.loc)
        return self._info(found) if found else None

    def info(self, version: int | None = None) -> VersionInfo:
        """One committed version (the newest when ``version`` is None); raises if not committed."""
        return self._info(self._locate(version))

    def manifest(self, version: int | None = None) -> Manifest:
        """The manifest of a committed version (the newest when ``version`` is None)."""
        return self._locate(version).manifest

    def load(
        self,
        version: int | None = None,
        *,
        keys: Sequence[str] | None = None,
        map_location: str | torch.device = "cpu",
        verify: bool | None = None,
        into: Any = None,
    ) -> Any:
        """The state saved in ``version`` (default: the newest committed one).

        ``keys`` selects parts by slash-separated key path (``["model"]``,
        ``["optimizer/param_groups"]``); only their bytes are read. ``into``: a
        state of existing tensors (e.g. ``{"model": model.state_dict()}``);
        tensors whose key path, dtype and shape match are read into them in
        place and returned as those very tensors. Archived versions are read
        from their tarball by range reads.
        """
        located = self._locate(version)
        manifest = located.manifest
        structure = select(manifest.structure, list(keys)) if keys else manifest.structure
        leaf_ids = sorted(set(leaf_refs(structure)))
        wanted = sorted({manifest.tensors[i].blob for i in leaf_ids})
        check = self.options.verify_on_load if verify is None else verify
        device = torch.device(map_location)
        targets = {}
        if into is not None and device.type == "cpu":
            targets = target_buffers(manifest, leaf_ids, into)
        with translate_errors(self.loc, "loading from"):
            raw = read_blobs(
                self.loc,
                located.sources(self.loc),
                manifest,
                wanted,
                verify=check,
                threads=self.options.threads,
                buffers={blob: as_bytes(t) for blob, t in targets.items()},
            )
        tensors = build_tensors(manifest, raw, leaf_ids, device, targets)
        return decode(structure, lambda i, is_numpy: tensors[i].numpy() if is_numpy else tensors[i])

    def verify(self, version: int | None = None) -> VersionInfo:
        """Check every shard of a version (loose or archived) against its size and checksum."""
        located = self._locate(version)
        with translate_errors(self.loc, "verifying"):
            for shard, source in zip(located.manifest.shards, located.sources(self.loc), strict=True):
                check_size(self.loc, source)
                checksum = hash_range(
                    self.loc.fs, source.path, source.offset, shard.size, local=self.loc.is_local
                )
                if checksum != shard.checksum:
                    raise CorruptShardError(source.name, expected=shard.checksum, actual=checksum)
        return self._info(located)

    def _info(self, located: catalog.Located) -> VersionInfo:
        return VersionInfo.from_manifest(
            located.manifest, located.url(self.loc), archived=located.is_archived
        )

    def _committed(self) -> list[Manifest]:
        """Manifests of the committed versions (loose and archived), oldest first."""
        with translate_errors(self.loc, "listing"):
            return [x.manifest for x in catalog.committed(self.loc)]

    def _locate(self, version: int | None) -> catalog.Located:
        """A committed version and where it lives; raise a clear error for any other state."""
        with translate_errors(self.loc, "reading"):
            if version is None:
                found = catalog.newest(self.loc)
                if found is None:
                    raise VersionNotFoundError(None, self.url, [])
                return found
            return catalog.find(self.loc, version)

    # -- run metadata ---------------------------------------------------------

    def read_json(self, name: str) -> Any:
        """A JSON document stored beside the versions (e.g. ``run.json``), or None."""
        path = self.loc.path(_meta_name(name))
        with translate_errors(self.loc, "reading"):
            try:
                data = self.loc.fs.cat_file(path)
            except FileNotFoundError:
                return None
        try:
            return json.loads(data)
        except ValueError as exc:
            raise ManifestError(f"{self.loc.display(name)} is not valid JSON: {exc}") from None

    def write_json(self, name: str, value: Any) -> None:
        """Store a JSON document beside the versions, atomically."""
        data = json.dumps(value, indent=1, sort_keys=True).encode()
        with translate_errors(self.loc, "writing to"):
            protocol.write_file_atomic(self.loc, _meta_name(name), data)

    # -- deleting -------------------------------------------------------------

    def delete(self, version: int) -> None:
        """Delete a committed version (its manifest first, so a crash leaves only garbage)."""
        self._saver.wait_previous()
        with translate_errors(self.loc, "deleting from"):
            housekeeping.delete_version(self.loc, version)

    def prune(
        self,
        policy: RetentionPolicy | None = None,
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_best: tuple[str, Literal["min", "max"]] | None = None,
    ) -> list[int]:
        """Delete committed versions the policy does not keep; return their numbers."""
        if policy is None:
            policy = RetentionPolicy(
                keep_last=keep_last,
                keep_every=keep_every,
                keep_best=keep_best[0] if keep_best else None,
                best_mode=keep_best[1] if keep_best else "min",
            )
        self._saver.wait_previous()
        with translate_errors(self.loc, "pruning"):
            return housekeeping.prune(self.loc, policy)

    def archive(self, versions: Sequence[int], *, name: str | None = None) -> TarIndex:
        """Consolidate committed loose versions into ``archive/<name>.tar`` plus its index.

        The loose copies stay until :meth:`drop_loose`: remove them only once the
        tarball is where it must be (uploaded and verified, when you upload).
        """
        with translate_errors(self.loc, "archiving in"):
            return housekeeping.archive(self.loc, list(versions), name=name)

    def drop_loose(self, versions: Sequence[int]) -> list[int]:
        """Remove the loose copies of archived versions; they load from their tarball after."""
        with translate_errors(self.loc, "removing loose files from"):
            return housekeeping.drop_loose(self.loc, list(versions))

    def gc(self) -> list[int]:
        """Remove what interrupted saves and archiving left: versions without manifest, tars without index."""
        self._saver.wait_previous()
        with translate_errors(self.loc, "collecting garbage in"):
            return housekeeping.collect_garbage(self.loc)

    def close(self) -> None:
        """Wait for the async save in flight and release the staging buffer."""
        try:
            self._saver.wait_previous()
        finally:
            self._saver.shutdown()
            self._staging.release()

    def __enter__(self) -> CheckpointStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class _SaveJob:
    version: int
    epoch: int | None
    step: int | None
    metrics: dict[str, float]
    structure: Any
    refs: list[TensorEntry]
    plan: SavePlan
    user: dict[str, Any]


def _meta_name(name: str) -> str:
    if not name or "/" in name or name.startswith(".") or protocol.parse_version_dir(name) is not None:
        raise ValueError(f"{name!r} is not a valid metadata file name (a plain name like 'run.json')")
    return name


def _name(dtype: torch.dtype) -> str:
    from .dtypes import dtype_name

    return dtype_name(dtype)


__all__ = ["CheckpointStore", "StoreOptions", "VersionInfo"]
