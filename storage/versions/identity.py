"""Which store a location holds: the store's identity, and the one store a mirror belongs to.

A store is named by its URL, and URLs are not identities: a directory is copied, moved or
mounted elsewhere, a mirror URL is reused by a later run. Each store therefore has an identity of
its own, a random id in ``store.json`` beside its versions, created (exclusively: two processes
agree on one) the first time something needs it. A mirror holds the same document with the id
of the store it mirrors and that store's URL (``mirror_of``), written before its first byte.

What always holds: nothing of one store is written into a mirror of another. A store that holds
nothing yet (a fast tier on a new machine) takes its mirror's identity: it is that store again,
filled from its mirror. A mirror without
the document (empty, or written by an older ckptflow) is taken only when it holds no version, or
when every manifest it holds of a version the store also holds is the store's own, byte for byte;
anything else is refused before a byte is written, naming both stores.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from ..archive.tarballs import ARCHIVE_DIR, list_tarballs
from ..archive.tarindex import index_name
from ..errors import CheckpointError, ManifestError
from ..files.atomic import exclusive_local_write, exclusive_remote_write
from ..files.location import Location, translate_errors
from ..format.manifest import MANIFEST_FILE
from ..format.manifest_checks import MAX_BYTES
from ..format.names import STORE_FILE, version_dir
from . import commit as protocol

FORMAT = "ckptflow-store"


@dataclass(frozen=True)
class StoreIdentity:
    id: str  # 32 hex digits
    mirror_of: str | None = None  # in a mirror: the URL of the store it mirrors, as that store showed it

    def to_json(self) -> bytes:
        doc: dict[str, object] = {"format": FORMAT, "id": self.id}
        if self.mirror_of is not None:
            doc["mirror_of"] = self.mirror_of
        return json.dumps(doc, indent=1).encode() + b"\n"


def read_identity(loc: Location) -> StoreIdentity | None:
    """The identity ``loc`` holds (None: none yet); ManifestError if its document is not one."""
    where = loc.display(STORE_FILE)
    path = loc.path(STORE_FILE)
    loc.fs.invalidate_cache(path)
    try:
        data = loc.fs.cat_file(path, start=0, end=MAX_BYTES + 1)
    except FileNotFoundError:
        return None
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError):
        raw = None
    ok = isinstance(raw, dict) and raw.get("format") == FORMAT and isinstance(raw.get("id"), str)
    mirror_of = raw.get("mirror_of") if isinstance(raw, dict) else None
    if not ok or not isinstance(mirror_of, (str, type(None))) or len(data) > MAX_BYTES:
        raise ManifestError(
            f"{where} is not a ckptflow store identity; it was changed by hand: restore it from a copy, "
            "or remove it if this location holds no mirror of another store"
        )
    assert isinstance(raw, dict)
    return StoreIdentity(raw["id"], mirror_of)


def store_identity(loc: Location) -> StoreIdentity:
    """``loc``'s identity, created now if it has none."""
    with translate_errors(loc, "reading the identity of"):
        found = read_identity(loc)
        if found is not None:
            return found
        return _create(loc, StoreIdentity(secrets.token_hex(16)))


def _create(loc: Location, identity: StoreIdentity) -> StoreIdentity:
    """Write ``identity`` unless the location has one already; return the one it holds."""
    try:
        if loc.is_local:
            loc.fs.makedirs(loc.root, exist_ok=True)
            exclusive_local_write(loc.root, STORE_FILE, identity.to_json())
        else:
            exclusive_remote_write(loc.fs, loc.path(STORE_FILE), identity.to_json())
        return identity
    except FileExistsError:
        found = read_identity(loc)
        if found is None:  # removed meanwhile: someone is changing the location by hand
            raise CheckpointError(
                f"{loc.display(STORE_FILE)} appeared and went while it was created"
            ) from None
        return found


def bind_mirror(store: Location, mirror: Location, *, ours_at: Callable[[str], bytes | None]) -> None:
    """Make ``mirror`` the mirror of ``store``, or refuse before anything is written there.

    ``ours_at(path)``: the bytes of the store's file at a path relative to its root (None: it has
    none), to recognise a mirror an older ckptflow wrote without an identity.
    """
    with translate_errors(mirror, "reading the identity of"):
        theirs = read_identity(mirror)
    if theirs is not None and read_identity(store) is None and holds_nothing(store):
        _create(store, StoreIdentity(theirs.id))  # a new fast tier of the store the mirror holds
    ours = store_identity(store)
    with translate_errors(mirror, "reading the identity of"):
        if theirs is None:
            _check_unmarked(store, mirror, ours_at)
            theirs = _create(mirror, StoreIdentity(ours.id, store.display()))
    _refuse_another(store, mirror, ours, theirs)


def check_mirror(store: Location, mirror: Location, *, ours_at: Callable[[str], bytes | None]) -> None:
    """:func:`bind_mirror`'s refusal, if it would refuse, without writing anything anywhere."""
    with translate_errors(store, "reading the identity of"):
        ours = read_identity(store)
    with translate_errors(mirror, "reading the identity of"):
        theirs = read_identity(mirror)
        if theirs is None:
            _check_unmarked(store, mirror, ours_at)
    if theirs is not None and not (ours is None and holds_nothing(store)):
        _refuse_another(store, mirror, ours, theirs)


def holds_nothing(loc: Location) -> bool:
    """Whether ``loc`` holds no committed version and no tarball: a store with nothing of its own
    to protect, which may become a new fast tier of the store a mirror holds (the mirror's
    identity is then its own; see :mod:`..remote.fetch`)."""
    if any(protocol.list_dirs(loc).values()):
        return False
    committed, _ = list_tarballs(loc)
    return not committed


def _refuse_another(
    store: Location, mirror: Location, ours: StoreIdentity | None, theirs: StoreIdentity
) -> None:
    if ours is not None and theirs.id == ours.id:
        return
    whose = f"the store at {theirs.mirror_of}" if theirs.mirror_of else "another store"
    raise CheckpointError(
        f"not mirroring {store.display()} to {mirror.display()}: that location belongs to {whose} "
        f"(its {STORE_FILE} says so). A mirror belongs to one store: give {store.display()} a mirror "
        "URL of its own"
    )


def _check_unmarked(store: Location, mirror: Location, ours_at: Callable[[str], bytes | None]) -> None:
    """A mirror without an identity is this store's only if it holds nothing (no version, no
    tarball), or if every manifest and tarball index of it that the store also has is the store's
    own, byte for byte, and there is at least one."""
    held = [
        f"{version_dir(v)}/{MANIFEST_FILE}"
        for v, has_manifest in protocol.list_dirs(mirror).items()
        if has_manifest
    ]
    committed, _ = list_tarballs(mirror)
    held += [f"{ARCHIVE_DIR}/{index_name(tar)}" for tar in committed]
    if not held:
        return
    same: list[str] = []
    other: list[str] = []
    for path in held:
        ours = ours_at(path)
        if ours is None:
            continue
        try:
            theirs = bytes(mirror.fs.cat_file(mirror.path(path)))
        except FileNotFoundError:
            continue
        (same if theirs == ours else other).append(path)
    if same and not other:
        return
    why = f"its {other[0]} is not this store's" if other else "it holds nothing this store holds"
    raise CheckpointError(
        f"not mirroring {store.display()} to {mirror.display()}: that location holds versions of another "
        f"store ({why}) and no {STORE_FILE} says whose. A mirror belongs to one store: give "
        f"{store.display()} a mirror URL of its own"
    )
