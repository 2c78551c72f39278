"""What a store takes and what it reports: its options, and a committed version as listed.

Plain frozen dataclasses, apart from the store so that the modules that save
and load can build them without importing the store itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .format.entries import Lineage
from .format.manifest import Manifest, ManifestDraft


@dataclass(frozen=True)
class StoreOptions:
    """How a store writes and reads; the defaults suit a local disk or S3."""

    shards: int = 4  # shard files per version at most (at least one per rank)
    threads: int = 4
    verify_on_load: bool = True
    shard_bytes: int = 64 << 20  # one shard file per this many bytes of state, up to ``shards``
    # Content-addressed saves: bytes a committed version of the store holds are referenced, not
    # written again (:mod:`.save.dedup`). False: every version is a full, self-contained copy.
    dedup: bool = True

    def __post_init__(self) -> None:
        if self.shards < 1:
            raise ValueError(f"shards must be >= 1, got {self.shards}")
        if self.shard_bytes < 1:
            raise ValueError(f"shard_bytes must be >= 1, got {self.shard_bytes}")
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")


IN_EPOCH = "in_epoch"  # user data of a save made inside an epoch: the steps of its epoch trained then
EPOCH_STEPS = "epoch_steps"  # ... and the epoch's length in steps, where its run knew it


def in_epoch(user: dict[str, Any]) -> int | None:
    """The steps into its epoch of a save made inside one (``user`` data); None at an epoch's end."""
    value = user.get(IN_EPOCH)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


@dataclass(frozen=True)
class SaveRequest:
    """What a save records besides the state: :meth:`CheckpointStore.save`'s keyword arguments."""

    epoch: int | None = None
    step: int | None = None
    metrics: dict[str, float] | None = None
    version: int | None = None
    user: dict[str, Any] | None = None
    rank_state: object = None
    lineage: Lineage | None = None  # where the state came from (the parent filled in by the store)


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
    lineage: dict[str, Any] = field(default_factory=dict)  # parent, run, spec, config_hash, code
    own_size: int | None = None  # bytes its save wrote; the rest of ``size`` is referenced (None: all)

    @property
    def new_bytes(self) -> int:
        """Bytes this version's save wrote (its own files); ``size`` counts what it references too."""
        return self.size if self.own_size is None else self.own_size

    @property
    def parent(self) -> int | None:
        """The version this one was resumed or derived from (None: a new start, or not recorded)."""
        value = self.lineage.get("parent")
        return value if isinstance(value, int) else None

    @property
    def in_epoch(self) -> int | None:
        """For a save made inside an epoch: the steps of ``epoch`` trained when it was made; None
        for a save at an epoch's end (every save of a store whose runs save only at epoch ends)."""
        return in_epoch(self.user)

    @property
    def epoch_steps(self) -> int | None:
        """For a save made inside an epoch: the epoch's length in steps, if its run knew it."""
        value = self.user.get(EPOCH_STEPS)
        return value if isinstance(value, int) and value > 0 else None

    @classmethod
    def from_manifest(cls, m: Manifest | ManifestDraft, url: str, *, archived: bool = False) -> VersionInfo:
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
            _lineage_of(m),
            m.own_size,
        )


def _lineage_of(m: Manifest | ManifestDraft) -> dict[str, Any]:
    if m.lineage is None:
        return {}
    if isinstance(m.lineage, dict):
        return {k: v for k, v in m.lineage.items() if v not in (None, {})}
    return m.lineage.model_dump(exclude_none=True, exclude_defaults=True)


__all__ = ["EPOCH_STEPS", "IN_EPOCH", "StoreOptions", "VersionInfo", "in_epoch"]
