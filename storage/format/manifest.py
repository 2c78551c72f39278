"""The manifest: the JSON document that makes a version exist.

A version directory holds HDF5 shards and, written last, ``manifest.json``. The
manifest lists every shard with its size and checksum, every blob (dataset)
with its byte offset, size and checksum, every tensor's key path, dtype and
shape, and the non-tensor structure of the state. A reader needs nothing else
to rebuild the state, and nothing in it is pickled.

What must always hold: a version without a manifest that parses and validates
does not exist. A manifest written by a newer format version is refused with a
message that says which ckptflow can read it.
"""

from __future__ import annotations

import functools
import json
import math
import platform
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from pydantic import Field, ValidationError

from ..errors import FormatVersionError, ManifestError
from .checksum import KEY_DIGITS
from .entries import (
    BlobEntry,
    ChunkedEntry,
    Lineage,
    RankPart,
    ShardEntry,
    TensorEntry,
    _Model,
    validation_problems,
)
from .manifest_checks import MAX_BYTES, check_manifest, document_depth_problem

FORMAT_NAME = "ckptflow-checkpoint"
FORMAT_VERSION = 8  # the newest this code reads, and the one it writes
RANKS_FORMAT_VERSION = 2  # added ``world_size`` and ``ranks`` (per-rank state of a multi-process save)
SEALED_FORMAT_VERSION = 3  # added ``manifest_checksum``, the manifest's checksum of itself
SHARDED_FORMAT_VERSION = 4  # added ``chunked``: tensors stored as chunks of a global shape (DTensor)
PIECES_FORMAT_VERSION = 5  # added blobs' ``piece_bytes`` and ``pieces``: checksums of fixed-size pieces
ORDERED_FORMAT_VERSION = 6  # compact JSON, sealed over its keys in document order (one hash of its bytes)
LINEAGE_FORMAT_VERSION = 7  # added ``lineage``: the version a save was derived from, its run, spec and code
SHARED_FORMAT_VERSION = (
    8  # blob checksums of xxh3-128 (content addresses); shards' ``version`` (another's file)
)
SEAL_KEY = "manifest_checksum"
MANIFEST_FILE = "manifest.json"


class Manifest(_Model):
    format: str = FORMAT_NAME
    format_version: int = 1
    version: int = Field(ge=0)
    epoch: int | None = None
    step: int | None = None
    metrics: dict[str, float] = Field(default_factory=dict)
    created: str
    writer: dict[str, str] = Field(default_factory=dict)
    checksum_algorithm: str
    nbytes: int = Field(ge=0)
    shards: list[ShardEntry]
    blobs: list[BlobEntry]
    tensors: list[TensorEntry]
    structure: Any
    user: dict[str, Any] = Field(default_factory=dict)
    world_size: int = Field(default=1, ge=1)  # processes that saved it
    ranks: list[RankPart] = Field(default_factory=list)  # one per rank, or none
    chunked: list[ChunkedEntry] = Field(default_factory=list)  # tensors stored as chunks
    lineage: Lineage | None = None  # where it came from (format 7); None: saved before, or unknown

    @property
    def total_size(self) -> int:
        """Bytes on storage the version reads: all its shards, its own and those it references in
        other versions (the manifest itself not counted)."""
        return sum(s.size for s in self.shards)

    @property
    def own_size(self) -> int:
        """Bytes this version's save wrote: the shards in its own directory."""
        return sum(s.size for s in self.shards if s.version is None)

    def shard_files(self) -> list[tuple[str, str]]:
        """Each shard's (version directory, file name): its own, or another version's it references."""
        return [(s.directory(self.version), s.file) for s in self.shards]

    def to_json(self) -> bytes:
        """The manifest as written (:func:`document_bytes`): what a save of the same content writes."""
        return document_bytes(self.model_dump(mode="json"))

    def rank_view(self, rank: int) -> Manifest:
        """This manifest with rank ``rank``'s own state in place of the shared state (same shards)."""
        part = self.ranks[rank]
        return self.model_copy(
            update={"structure": part.structure, "blobs": part.blobs, "tensors": part.tensors, "ranks": []}
        )


def blob_doc(
    *,
    shard: int,
    dataset: str,
    offset: int | None,
    nbytes: int,
    dtype: str,
    shape: list[int],
    checksum: str,
    piece_bytes: int | None = None,
    pieces: list[str] | None = None,
) -> dict[str, Any]:
    """A blob's manifest entry as a save writes it: :class:`BlobEntry`'s fields, in its order, as
    JSON. A save of thousands of tensors builds a dict for each, not a model: 4 us less per tensor.
    The piece fields are there only when the blob has pieces."""
    doc = {
        "shard": shard,
        "dataset": dataset,
        "offset": offset,
        "nbytes": nbytes,
        "dtype": dtype,
        "shape": shape,
        "checksum": checksum,
    }
    if pieces is not None:
        doc["piece_bytes"] = piece_bytes
        doc["pieces"] = pieces
    return doc


def tensor_doc(
    path: str, blob: int, dtype: str, shape: list[int], stride: list[int] | None = None, offset: int = 0
) -> dict[str, Any]:
    """A tensor's manifest entry as a save writes it: :class:`TensorEntry`'s fields, in its order."""
    return {"path": path, "blob": blob, "dtype": dtype, "shape": shape, "stride": stride, "offset": offset}


@dataclass(frozen=True)
class ManifestDraft:
    """A manifest as a save builds it, before it is written: :class:`Manifest`'s fields, with the
    entries (blobs, tensors, ranks' parts, chunked tensors) already JSON (:func:`blob_doc`,
    :func:`tensor_doc`). Its bytes are those :meth:`Manifest.to_json` writes for the same content;
    :meth:`manifest` validates them into one."""

    version: int
    epoch: int | None
    step: int | None
    metrics: dict[str, float]
    created: str
    writer: dict[str, str]
    checksum_algorithm: str
    nbytes: int
    shards: list[ShardEntry]
    blobs: list[dict[str, Any]]
    tensors: list[dict[str, Any]]
    structure: Any
    user: dict[str, Any]
    world_size: int = 1
    ranks: list[dict[str, Any]] = field(default_factory=list)
    chunked: list[dict[str, Any]] = field(default_factory=list)
    lineage: dict[str, Any] | None = None  # :class:`Lineage`'s fields

    @property
    def total_size(self) -> int:
        return sum(s.size for s in self.shards)

    @property
    def own_size(self) -> int:
        return sum(s.size for s in self.shards if s.version is None)

    def document(self) -> dict[str, Any]:
        """The JSON fields, in :class:`Manifest`'s order."""
        return {
            "format": FORMAT_NAME,
            "format_version": 1,  # set by document_bytes: the lowest that reads what it holds
            "version": self.version,
            "epoch": self.epoch,
            "step": self.step,
            "metrics": self.metrics,
            "created": self.created,
            "writer": self.writer,
            "checksum_algorithm": self.checksum_algorithm,
            "nbytes": self.nbytes,
            "shards": [s.model_dump(mode="json", exclude_none=True) for s in self.shards],
            "blobs": self.blobs,
            "tensors": self.tensors,
            "structure": self.structure,
            "user": self.user,
            "world_size": self.world_size,
            "ranks": self.ranks,
            "chunked": self.chunked,
            "lineage": self.lineage,
        }

    def to_json(self) -> bytes:
        return document_bytes(self.document())

    def manifest(self, where: str) -> Manifest:
        """The manifest a reader gets from these bytes, validated and checked as a reader does."""
        raw = json.loads(self.to_json())
        del raw[SEAL_KEY]
        return validate_manifest(raw, where)


def document_bytes(raw: dict[str, Any]) -> bytes:
    """A manifest's fields as written by every save path: sealed with its own checksum, the
    multi-process and chunked fields only when it has them, a blob's piece fields only when it has
    pieces, a lineage only when it has one, and its format version the lowest that reads what it
    holds (never below format 6, whose seal covers its bytes in order; format 8 for content keys
    and shards of other versions); a shard's ``version`` only when it has one. ``raw`` is changed
    in place."""
    if raw.get("world_size", 1) == 1 and not raw.get("ranks"):
        raw.pop("world_size", None)
        raw.pop("ranks", None)
    if not raw.get("chunked"):
        raw.pop("chunked", None)
    if raw.get("lineage") is None:
        raw.pop("lineage", None)
    needed = SHARDED_FORMAT_VERSION if "chunked" in raw else SEALED_FORMAT_VERSION  # the oldest that reads it
    if "lineage" in raw:
        needed = LINEAGE_FORMAT_VERSION
    for shard in raw["shards"]:
        if "version" in shard:
            if shard["version"] is None:
                del shard["version"]
            else:
                needed = max(needed, SHARED_FORMAT_VERSION)
    for blobs in [raw["blobs"], *(part["blobs"] for part in raw.get("ranks", []))]:
        for blob in blobs:
            if len(blob["checksum"]) == KEY_DIGITS:
                needed = max(needed, SHARED_FORMAT_VERSION)
            if "pieces" not in blob:
                continue
            if blob["pieces"] is None:  # a blob without pieces reads as formats 1-4 wrote it
                del blob["piece_bytes"], blob["pieces"]
            else:
                needed = max(needed, PIECES_FORMAT_VERSION)
    raw["format_version"] = max(raw["format_version"], needed, ORDERED_FORMAT_VERSION)
    return sealed_json(raw, SEAL_KEY)


def writer_versions() -> dict[str, str]:
    """What wrote a manifest: ckptflow's, torch's and Python's versions."""
    return dict(_versions())


@functools.cache
def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    try:
        ours = version("ckptflow")
    except PackageNotFoundError:  # running from a source tree that is not installed
        ours = "unknown"
    return {
        "ckptflow": ours,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def clean_metrics(metrics: dict[str, Any] | None) -> dict[str, float]:
    """Metrics as finite floats; raises ``ValueError`` naming a bad metric."""
    out: dict[str, float] = {}
    for name, value in (metrics or {}).items():
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"metric {name!r} must be a number, got {value!r}") from None
        if not math.isfinite(number):
            raise ValueError(f"metric {name!r} must be finite, got {number}")
        out[str(name)] = number
    return out


class _NotJson(ValueError):
    """NaN or Infinity in a document: Python's JSON reader takes them, JSON has no such values."""


def _no_constant(name: str) -> None:
    raise _NotJson(name)


def load_versioned_json(
    data: bytes,
    where: str,
    *,
    kind: str,
    name: str,
    version: int,
    verb: str,
    free: tuple[str, ...] | None = None,
) -> dict:
    """The JSON object of a ckptflow document (a manifest, an archive index), its format checked.

    A document written by a newer format version is refused with FormatVersionError. Its depth
    is checked in the values of the ``free`` keys (those a schema types as any JSON: the rest is
    refused by validation at its first level), or everywhere.
    """

    if len(data) > MAX_BYTES:
        raise ManifestError(
            f"{kind} {where} is {len(data)} bytes, more than the {MAX_BYTES} a {kind} may have"
        )
    try:
        raw = json.loads(data, parse_constant=_no_constant)
    except _NotJson as exc:
        raise ManifestError(
            f"{kind} {where} is not valid JSON: it holds {exc}, which JSON does not have and ckptflow "
            "never writes"
        ) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{kind} {where} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ManifestError(f"{kind} {where} is nested too deeply to be a ckptflow {kind}") from None
    if not isinstance(raw, dict) or raw.get("format") != name:
        raise ManifestError(f"{where} is not a ckptflow {kind}")
    too_deep = document_depth_problem(raw if free is None else [raw.get(key) for key in free])
    if too_deep:
        raise ManifestError(f"{kind} {where} is {too_deep}")
    found = raw.get("format_version")
    if not isinstance(found, int) or found > version:
        raise FormatVersionError(
            f"{kind} {where} has format version {found!r}, but this ckptflow reads versions up to "
            f"{version}; upgrade ckptflow to {verb} it"
        )
    return raw


def seal(raw: dict[str, Any], key: str, *, ordered: bool = True) -> dict[str, Any]:
    """``raw`` with ``key`` set to the xxh3 of its canonical JSON (no spaces; keys in document
    order, or sorted, as sealed by documents of older format versions)."""
    from .checksum import digest

    body = {k: v for k, v in raw.items() if k != key}
    return {**body, key: digest(_canonical(body, ordered))}


def sealed_json(raw: dict[str, Any], key: str) -> bytes:
    """``raw`` as written: its canonical JSON (keys in document order) with the seal added last.

    The bytes before the seal are exactly what the seal hashes, so a reader checks an untouched
    document with one hash of its bytes (:func:`check_sealed_bytes`) instead of encoding it again;
    a document reformatted by hand still checks the slow way.
    """
    from .checksum import digest

    canonical = _canonical({k: v for k, v in raw.items() if k != key}, ordered=True)
    if canonical == b"{}":
        return json.dumps({key: digest(canonical)}).encode()
    return canonical[:-1] + b',"' + key.encode() + b'":"' + digest(canonical).encode() + b'"}'


def check_sealed_bytes(data: bytes, raw: dict[str, Any], key: str) -> dict[str, Any] | None:
    """``raw`` without its seal when ``data`` is exactly as :func:`sealed_json` wrote it and the
    seal matches its bytes; None when it must be checked the slow way (:func:`check_seal`)."""
    from .checksum import digest

    seal_value = raw.get(key)
    if not isinstance(seal_value, str):
        return None
    suffix = b',"' + key.encode() + b'":"' + seal_value.encode() + b'"}'
    end = len(data.rstrip())
    if data[end - len(suffix) : end] != suffix or digest(data[: end - len(suffix)] + b"}") != seal_value:
        return None
    return {k: v for k, v in raw.items() if k != key}


def check_seal(
    raw: dict[str, Any], key: str, where: str, *, kind: str, required: bool, ordered: bool
) -> dict[str, Any]:
    """``raw`` without its seal, after checking it; ManifestError if it was changed after writing.

    ``ordered``: the seal hashes keys in document order (else sorted: older format versions).
    """
    from .checksum import digest

    if key not in raw:
        if required:
            raise ManifestError(f"{kind} {where} has no {key}: it was changed after it was written")
        return raw
    body = {k: v for k, v in raw.items() if k != key}
    actual = digest(_canonical(body, ordered))
    if raw[key] != actual:
        raise ManifestError(
            f"{kind} {where} was changed after it was written: its {key} is {raw[key]!r}, its content "
            f"hashes to {actual!r}; do not trust it: load another version, or restore it from a copy"
        )
    return body


def _canonical(raw: dict[str, Any], ordered: bool) -> bytes:
    try:
        return json.dumps(raw, sort_keys=not ordered, separators=(",", ":"), allow_nan=False).encode()
    except ValueError as exc:
        raise ManifestError(f"not a JSON document ckptflow writes: {exc}") from None


# Fields of a manifest that hold any JSON, whose depth is checked before validation; the structure
# is one too, and check_manifest checks its depth (validation does not walk it).
_FREE = ("user", "ranks")


def parse_manifest(data: bytes, where: str) -> Manifest:
    """Parse and validate a manifest; ``where`` names it in error messages."""
    raw = load_versioned_json(
        data, where, kind="manifest", name=FORMAT_NAME, version=FORMAT_VERSION, verb="load", free=_FREE
    )
    ordered = raw["format_version"] >= ORDERED_FORMAT_VERSION
    body = check_sealed_bytes(data, raw, SEAL_KEY) if ordered else None
    if body is None:
        required = raw["format_version"] >= SEALED_FORMAT_VERSION
        body = check_seal(raw, SEAL_KEY, where, kind="manifest", required=required, ordered=ordered)
    return validate_manifest(body, where)


def validate_manifest(raw: object, where: str) -> Manifest:
    """A manifest from an already parsed JSON value (a file's, or an archive index's copy), fully checked."""
    try:
        manifest = Manifest.model_validate(raw)
    except ValidationError as exc:
        raise ManifestError(f"manifest {where} is invalid: {validation_problems(exc)}") from None
    check_manifest(manifest, where)
    return manifest
