"""Content-addressed saves: reference the bytes a committed version holds instead of writing them.

Before a save writes, it computes every blob's content key (the xxh3-128 of its bytes, which is
also the blob's checksum in the manifest: :func:`.checksum.content_key`) and looks it up, with
the blob's dtype and size, in a :class:`ContentIndex`: the blobs of the version the store last
committed or loaded (its lineage's parent), which lists every blob that version holds or
references. A blob found there is not written: this version's manifest lists the file that holds
it (a shard of another version's directory, ``ShardEntry.version``) and its place in that file.
Only the other blobs are planned into this version's own shard files.

A frozen base saved at every step is written once; a dense state where everything changes is
written whole, at the cost of one hash per byte, which replaces the blob hash the writer computed
while writing (:mod:`.writer`). A shard file is referenced only when it supplies at least
``1/MIN_SHARE`` of its bytes to the new version, so that a version never keeps a large file of
an old version alive for a few small tensors of it (those are written again instead).

Bytes are referenced only within one store (a manifest's shards name versions of its own
store), only files of loose versions, and only a file that is the one the index recorded: a file
whose name carries an identity (:func:`..format.names.file_identity`) and that is there, under that
name and with its size, when the save is split (:attr:`ContentIndex.present`, asked only of the
files a save would reference: a dense save lists nothing). A file removed by hand, or one of
another store copied in with its version, is never referenced: the save writes those bytes again,
so a store heals by saving. Removal (:mod:`..versions.housekeeping`) never removes a file a
committed version references.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..format.blob import Blob, BlobBytes
from ..format.checksum import KEY_DIGITS, content_key, new_hasher
from ..format.dtypes import dtype_name
from ..format.manifest import BlobEntry, ShardEntry
from ..format.names import file_identity
from .planner import SavePlan, assign_shards

MIN_SHARE = 4  # a referenced shard file supplies at least 1/MIN_SHARE of its bytes

Key = tuple[str, str, int]  # (xxh3-128 of the bytes, dtype name, bytes)


@dataclass(frozen=True)
class Held:
    """Where a committed blob's bytes are: a shard (by its number in the index) and the entry."""

    shard: int
    dataset: str
    offset: int
    piece_bytes: int | None = None  # the piece checksums of a blob a DCP save wrote, kept with it
    pieces: list[str] | None = None


class ContentIndex:
    """The blobs one committed version holds or references, by content key, dtype and size; and,
    for an index this process's own save left, the samples of those blobs (:func:`sample`)."""

    def __init__(
        self,
        version: int,
        shards: list[ShardEntry],
        blobs: Iterable[dict[str, Any] | BlobEntry],
        samples: set[Sample] | None = None,
        *,
        identity: tuple[object, ...] | None = None,
        present: Callable[[list[ShardEntry]], set[int]] | None = None,
    ) -> None:
        self.version = version
        self.identity = identity  # of the manifest it was read from, to tell a later one in its place
        # Which of some shard files are there now, as recorded (by their place in the list given):
        # asked once per save, of the files it would reference. None: all are (a test's index).
        self.present = present
        # None: unknown (an index read from a manifest): every blob of a held dtype and size is
        # hashed whole before it is written or referenced.
        self.samples = samples
        # Every shard in the form a later version's manifest lists it: with the version it is in.
        self.shards = [
            s if s.version is not None else s.model_copy(update={"version": version}) for s in shards
        ]
        self.held: dict[Key, Held] = {}
        # The other places of bytes held more than once (the ones of a LayerNorm's weights in every
        # block, a replicated chunk on every rank): a save references the place in the file that
        # supplies it most, so that the file is worth keeping (MIN_SHARE).
        self.also: dict[Key, list[Held]] = {}
        identified = {i for i, s in enumerate(self.shards) if file_identity(s.file) is not None}
        for blob in blobs:
            b = blob if isinstance(blob, dict) else blob.model_dump()
            checksum = b["checksum"]
            if len(checksum) != KEY_DIGITS or not b["nbytes"] or b["offset"] is None:
                continue  # not content-addressed (an older format), or empty
            if b["shard"] not in identified:
                continue  # a file of an older save, without an identity: its bytes are written again
            key = (checksum, b["dtype"], b["nbytes"])
            held = Held(b["shard"], b["dataset"], b["offset"], b.get("piece_bytes"), b.get("pieces"))
            if key in self.held:
                self.also.setdefault(key, []).append(held)
            else:
                self.held[key] = held
        self.sizes = {(dtype, nbytes) for _, dtype, nbytes in self.held}

    def may_hold(self, blob: Blob, name: str, sampled: Sample | None) -> bool:
        """Whether the index may hold ``blob``'s bytes: a blob of its dtype and size is held and,
        where samples are known, one with its sample (a blob whose sample no held blob has
        differs from every one of them)."""
        if (name, blob.nbytes) not in self.sizes:
            return False
        return sampled is None or self.samples is None or sampled in self.samples


@dataclass(frozen=True)
class Split:
    """A rank's share of a save, split by the index: the blobs it writes, in their own plan, and
    the entries of those it references."""

    plan: SavePlan  # the blobs to write, planned into this version's shard files
    # The content keys computed before the write (the blobs the index may hold, and small ones):
    # their checksums in the manifest; the writer computes the others' as it writes them.
    keys: dict[int, str]
    reused: dict[int, tuple[ShardEntry, Held]]  # blob index -> the file and place of its bytes
    samples: set[Sample]  # every large blob's sample, for the index this save leaves

    @property
    def reused_bytes(self) -> int:
        return sum(self.plan.blobs[i].nbytes for i in self.reused)

    def merge(
        self, shards: list[ShardEntry], entries: dict[int, dict[str, Any]]
    ) -> tuple[list[ShardEntry], dict[int, dict[str, Any]]]:
        """The written shards and blob entries, with the referenced files appended to the shards
        and the referenced blobs' entries pointing at them."""
        from ..format.manifest import blob_doc

        shards = list(shards)
        number: dict[tuple[int | None, str], int] = {}
        entries = dict(entries)
        for index, (shard, held) in self.reused.items():
            place = (shard.version, shard.file)
            if place not in number:
                number[place] = len(shards)
                shards.append(shard)
            blob = self.plan.blobs[index]
            entries[index] = blob_doc(
                shard=number[place],
                dataset=held.dataset,
                offset=held.offset,
                nbytes=blob.nbytes,
                dtype=dtype_name(blob.dtype),
                shape=list(blob.shape),
                checksum=self.keys[index],
                piece_bytes=held.piece_bytes,
                pieces=held.pieces,
            )
        return shards, entries


def split(
    plan: SavePlan,
    blob_bytes: BlobBytes,
    index: ContentIndex | None,
    *,
    rank: int,
    shard_bytes: int,
) -> Split:
    """Split this rank's blobs of ``plan`` into those ``index`` holds and those to write, planned
    into as many files as ``plan`` had (none when every blob is referenced).

    A large blob is hashed whole here only when the index may hold it (:meth:`ContentIndex.may_hold`:
    its sample matches a held blob's); the others, which changed for certain (every blob of a dense
    save), are hashed by the writer as it writes them, as without dedup."""
    mine = [plan.blobs[i] for shard in plan.shards for i in shard.blobs]
    keys: dict[int, str] = {}
    samples: set[Sample] = set()
    found: dict[int, Held] = {}
    elsewhere: dict[int, list[Held]] = {}  # blobs held in more than one place: all of them
    names: dict[Any, str] = {}
    for blob in mine:
        name = names.get(blob.dtype) or names.setdefault(blob.dtype, dtype_name(blob.dtype))
        data = blob_bytes(blob)
        sampled = sample(data, name) if blob.nbytes > SAMPLED else None
        if sampled is not None:
            samples.add(sampled)
        if sampled is not None and (index is None or not index.may_hold(blob, name, sampled)):
            continue  # changed: the writer hashes it
        keys[blob.index] = key = content_key(data)
        if index is None or not blob.nbytes or (key, name, blob.nbytes) not in index.held:
            continue
        found[blob.index] = index.held[(key, name, blob.nbytes)]
        if (key, name, blob.nbytes) in index.also:
            elsewhere[blob.index] = [found[blob.index], *index.also[(key, name, blob.nbytes)]]
    reused: dict[int, tuple[ShardEntry, Held]] = {}
    if found and index is not None and index.present is not None:  # only files that are there now
        places_of = {i: elsewhere.pop(i, [held]) for i, held in found.items()}
        asked = sorted({p.shard for places in places_of.values() for p in places})
        there = {asked[n] for n in index.present([index.shards[s] for s in asked])}
        for i, all_places in places_of.items():
            places = [h for h in all_places if h.shard in there]
            if not places:
                del found[i]
                continue
            found[i] = places[0]
            if len(places) > 1:
                elsewhere[i] = places
    if found and index is not None:
        if elsewhere:  # each from the file that could supply this save the most
            could: dict[int, int] = {}
            for i, places in ((i, elsewhere.get(i, [h])) for i, h in found.items()):
                for s in {h.shard for h in places}:
                    could[s] = could.get(s, 0) + plan.blobs[i].nbytes
            for i, places in elsewhere.items():
                found[i] = max(places, key=lambda h: could[h.shard])
        supplied: dict[int, int] = {}
        for i, held in found.items():
            supplied[held.shard] = supplied.get(held.shard, 0) + plan.blobs[i].nbytes
        worth = {s for s, n in supplied.items() if n * MIN_SHARE >= index.shards[s].size}
        reused = {i: (index.shards[h.shard], h) for i, h in found.items() if h.shard in worth}
    if not reused:
        return Split(plan, keys, {}, samples)
    new = [b for b in mine if b.index not in reused]
    files = assign_shards(new, shards=len(plan.shards), rank=rank, shard_bytes=shard_bytes) if new else []
    return Split(SavePlan(plan.blobs, plan.refs, files, plan.chunks), keys, reused, samples)


Sample = tuple[str, int, str]  # (dtype name, bytes, xxh3-64 of the first and last SAMPLE_BYTES)
SAMPLE_BYTES = 4 << 10
SAMPLED = 4 * SAMPLE_BYTES  # blobs above this size are sampled first; smaller ones hashed whole


def sample(data: memoryview, dtype: str) -> Sample:
    """A cheap fingerprint of a large blob: its first and last 4 KiB. Two blobs with different
    samples differ; with the same sample, only their content keys tell."""
    hasher = new_hasher()
    hasher.update(data[:SAMPLE_BYTES])
    hasher.update(data[-SAMPLE_BYTES:])
    return dtype, len(data), hasher.hexdigest()
