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

from . import commit as protocol
from .async_save import AsyncSaver, SaveHandle
from .byteio import hash_file, tensor_bytes
from .checksum import ALGORITHM
from .commit import version_dir
from .errors import CorruptShardError, ManifestError, VersionExistsError, VersionNotFoundError
from .loader import as_bytes, build_tensors, target_buffers
from .location import Location, open_location, translate_errors
from .manifest import Manifest, TensorEntry, clean_metrics, utc_now, writer_versions
from .planner import SavePlan, plan_save
from .reader import ShardSource, loose_sources, read_blobs
from .retention import RetentionPolicy, versions_to_keep
from .staging import StagingBuffer
from .structure import decode, encode, leaf_refs, select

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

    @classmethod
    def from_manifest(cls, m: Manifest, loc: Location) -> VersionInfo:
        seconds = m.user.get("save_seconds")
        return cls(
            m.version,
            m.epoch,
            m.step,
            dict(m.metrics),
            m.created,
            m.nbytes,
            m.total_size,
            loc.display(version_dir(m.version)),
            seconds,
            dict(m.user),
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
            return max(protocol.list_dirs(self.loc), default=-1) + 1
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        record = protocol.read_record(self.loc, version)
        if record is not None and not record.is_writing():
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
        return VersionInfo.from_manifest(manifest, self.loc)

    # -- reading --------------------------------------------------------------

    def versions(self) -> list[VersionInfo]:
        """Committed versions, oldest first."""
        return [VersionInfo.from_manifest(m, self.loc) for m in self._committed()]

    def latest(self) -> VersionInfo | None:
        """The newest committed version (the one a resumed run starts from), or None."""
        with translate_errors(self.loc, "listing"):
            record = protocol.newest_committed(self.loc)
        return VersionInfo.from_manifest(record.manifest, self.loc) if record and record.manifest else None

    def info(self, version: int | None = None) -> VersionInfo:
        """One committed version (the newest when ``version`` is None); raises if not committed."""
        return VersionInfo.from_manifest(self._manifest(version), self.loc)

    def manifest(self, version: int | None = None) -> Manifest:
        """The manifest of a committed version (the newest when ``version`` is None)."""
        return self._manifest(version)

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
        place and returned as those very tensors.
        """
        manifest = self._manifest(version)
        structure = select(manifest.structure, list(keys)) if keys else manifest.structure
        leaf_ids = sorted(set(leaf_refs(structure)))
        wanted = sorted({manifest.tensors[i].blob for i in leaf_ids})
        check = self.options.verify_on_load if verify is None else verify
        device = torch.device(map_location)
        targets = (
            target_buffers(manifest, leaf_ids, into) if into is not None and device.type == "cpu" else {}
        )
        with translate_errors(self.loc, "loading from"):
            raw = read_blobs(
                self.loc,
                self._sources(manifest),
                manifest,
                wanted,
                verify=check,
                threads=self.options.threads,
                buffers={blob: as_bytes(t) for blob, t in targets.items()},
            )
        tensors = build_tensors(manifest, raw, leaf_ids, device, targets)
        return decode(structure, lambda i, is_numpy: tensors[i].numpy() if is_numpy else tensors[i])

    def verify(self, version: int | None = None) -> VersionInfo:
        """Check every shard of a version against its size and checksum; raise on mismatch."""
        manifest = self._manifest(version)
        vdir = version_dir(manifest.version)
        with translate_errors(self.loc, "verifying"):
            for shard in manifest.shards:
                path = self.loc.path(vdir, shard.file)
                try:
                    size, checksum = hash_file(self.loc.fs, path, local=self.loc.is_local)
                except FileNotFoundError:
                    raise CorruptShardError(
                        self.loc.display(vdir, shard.file),
                        expected="a shard file",
                        actual="no file",
                        what="presence",
                    ) from None
                if size != shard.size:
                    raise CorruptShardError(
                        self.loc.display(vdir, shard.file),
                        expected=f"{shard.size} bytes",
                        actual=f"{size} bytes",
                        what="size",
                    )
                if checksum != shard.checksum:
                    raise CorruptShardError(
                        self.loc.display(vdir, shard.file), expected=shard.checksum, actual=checksum
                    )
        return VersionInfo.from_manifest(manifest, self.loc)

    def _sources(self, manifest: Manifest) -> list[ShardSource]:
        """Where the shards of a committed version are read from."""
        return loose_sources(self.loc, version_dir(manifest.version), manifest)

    def _committed(self) -> list[Manifest]:
        """Manifests of the committed versions, oldest first."""
        with translate_errors(self.loc, "listing"):
            return [r.manifest for r in protocol.scan(self.loc).values() if r.manifest is not None]

    def _manifest(self, version: int | None) -> Manifest:
        """The manifest of a committed version; raise a clear error for any other state."""
        with translate_errors(self.loc, "reading"):
            if version is None:
                newest = protocol.newest_committed(self.loc)
                if newest is None or newest.manifest is None:
                    raise VersionNotFoundError(None, self.url, [])
                return newest.manifest
            record = protocol.read_record(self.loc, version)
        if record is not None and record.error is not None:
            raise record.error
        if record is None or record.manifest is None:
            raise VersionNotFoundError(version, self.url, [m.version for m in self._committed()])
        return record.manifest

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
        committed = [m.version for m in self._committed()]
        if version not in committed:
            raise VersionNotFoundError(version, self.url, committed)
        with translate_errors(self.loc, "deleting from"):
            protocol.remove_version(self.loc, version)
            protocol.refresh_latest(self.loc, [v for v in committed if v != version])

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
        committed = self._committed()
        keep = versions_to_keep(committed, policy)
        doomed = [m.version for m in committed if m.version not in keep]
        with translate_errors(self.loc, "pruning"):
            for v in doomed:
                protocol.remove_version(self.loc, v)
            protocol.refresh_latest(self.loc, sorted(keep))
        return doomed

    def gc(self) -> list[int]:
        """Remove version directories left without a manifest by interrupted saves (and their temp files)."""
        self._saver.wait_previous()
        with translate_errors(self.loc, "collecting garbage in"):
            garbage = [v for v, has_manifest in protocol.list_dirs(self.loc).items() if not has_manifest]
            for v in garbage:
                self.loc.fs.rm(self.loc.path(version_dir(v)), recursive=True)
            for path in protocol.stale_temp_files(self.loc):
                os.remove(path)
        return garbage

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
