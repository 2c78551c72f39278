"""The entries of a manifest: its shards, blobs, tensors, chunked tensors, rank parts and lineage.

Types only, checked field by field as pydantic models; what must hold between them (a blob
inside its shard, a tensor inside its blob) is checked by :mod:`.manifest_checks`, and the
manifest itself, which holds them, is :mod:`.manifest`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..errors import UnsupportedValueError
from .dtypenames import itemsize


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ShardEntry(_Model):
    file: str
    size: int = Field(ge=0)
    checksum: str
    rank: int = 0
    # A file of another version's directory of the same store (format 8): bytes an earlier save
    # wrote, which this version references instead of writing them again. None: its own file.
    version: int | None = Field(default=None, ge=0)

    def directory(self, own: int) -> str:
        """The version directory holding this shard's file, for a shard of version ``own``'s manifest."""
        from .names import version_dir

        return version_dir(own if self.version is None else self.version)


class BlobEntry(_Model):
    shard: int = Field(ge=0)
    dataset: str
    offset: int | None  # None for blobs of zero bytes (HDF5 allocates nothing)
    nbytes: int = Field(ge=0)
    dtype: str
    shape: list[int]
    # xxh3-64 (16 hex digits), or from format 8 xxh3-128 (32): then it is also the blob's content
    # address, and a later save that holds the same bytes (same dtype and size) references this blob
    # instead of writing it again.
    checksum: str
    # The blob's bytes cut into pieces of ``piece_bytes`` (the last one shorter), each with its
    # own checksum: a load that needs part of the blob (a resharded load) reads and verifies
    # only the pieces it overlaps. Chunks of sharded saves have them; other blobs do not.
    piece_bytes: int | None = Field(default=None, ge=1)
    pieces: list[str] | None = None


class TensorEntry(_Model):
    path: str
    blob: int = Field(ge=0)
    dtype: str
    shape: list[int]
    stride: list[int] | None = None
    offset: int = 0

    @property
    def nbytes(self) -> int | None:
        """Bytes of the tensor's own elements (None for a dtype this ckptflow does not store)."""
        size = itemsize(self.dtype)
        return None if size is None else math.prod(self.shape) * size


class ChunkEntry(_Model):
    """One stored piece of a chunked tensor: the box ``offsets``..``offsets + sizes`` of its global
    shape, held (contiguous, row-major) by blob ``blob``."""

    offsets: list[int]
    sizes: list[int]
    blob: int = Field(ge=0)


class ChunkedEntry(_Model):
    """A tensor stored as chunks of its global shape (a DTensor's shards, written by the ranks
    that held them); ``path`` names it in messages, the structure places it."""

    path: str
    dtype: str
    shape: list[int]
    requires_grad: bool = False
    chunks: list[ChunkEntry]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * (itemsize(self.dtype) or 0)


class RankPart(_Model):
    """One rank's own state (RNG states, data position) in a checkpoint saved by several processes.

    Its blobs live in the manifest's shared shard list; its tensors index its own blobs.
    """

    structure: Any
    blobs: list[BlobEntry]
    tensors: list[TensorEntry]


class Lineage(_Model):
    """Where a version came from: the version its state was resumed or derived from (``parent``),
    the run that saved it (a Prefect flow run's id, when there is one), the spec and a hash of the
    run's config, and the git commit of the spec's code (``code``: ``{"git": commit}``)."""

    parent: int | None = Field(default=None, ge=0)
    run: str | None = None
    spec: str | None = None
    config_hash: str | None = None
    code: dict[str, str] = Field(default_factory=dict)

    @classmethod
    def given(cls, value: Lineage | Mapping[str, Any] | None) -> Lineage | None:
        """A save's lineage as a caller gives it (a Lineage, a dict of its fields, or None; an empty
        one is none); :class:`UnsupportedValueError` for one a manifest could not hold."""
        if value is None or isinstance(value, Lineage):
            return value if value is None or value.model_fields_set else None
        if not value:
            return None
        try:
            return cls.model_validate(dict(value))
        except ValidationError as exc:
            raise UnsupportedValueError(
                "lineage", f"{validation_problems(exc)} (its fields: parent, run, spec, config_hash, code)"
            ) from None

    def with_parent(self, parent: int | None) -> Lineage:
        """This lineage with ``parent`` as its parent, unless it names one (even None)."""
        if parent is None or "parent" in self.model_fields_set:
            return self
        return Lineage(**self.model_dump(exclude_unset=True), parent=parent)


def validation_problems(exc: ValidationError) -> str:
    """The first five problems pydantic found, ``field.path: message``, and how many more."""
    problems = "; ".join(
        f"{'.'.join(str(part) for part in e['loc']) or '<root>'}: {e['msg']}"
        for e in exc.errors(include_url=False)[:5]
    )
    more = f" (and {exc.error_count() - 5} more)" if exc.error_count() > 5 else ""
    return problems + more


__all__ = [
    "BlobEntry",
    "ChunkEntry",
    "ChunkedEntry",
    "Lineage",
    "RankPart",
    "ShardEntry",
    "TensorEntry",
    "validation_problems",
]
