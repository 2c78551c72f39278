"""Claiming a version number before writing it: one writer per version, whatever the race.

A writer creates ``.claim.json`` in the version's directory exclusively (a hard
link locally, ``If-None-Match: *`` on S3) before its first shard; its commit
checks the claim is still its own, creates the manifest and then removes the
claim (:mod:`.commit`). What a writer killed after its commit leaves, ``gc``
removes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass

from ..errors import ManifestError, VersionTakenError
from ..files.atomic import exclusive_local_write, exclusive_remote_write
from ..files.byteio import fsync_dir
from ..files.location import Location
from ..files.processes import has_ended, is_running, this_process
from ..format.manifest import MANIFEST_FILE
from ..format.names import parse_version_dir, version_dir

log = logging.getLogger(__name__)

CLAIM_FILE = ".claim.json"  # inside a version directory while it is written; removed by the commit
CLAIM_DIR_TRIES = 5  # makes of a version directory a gc beside the writer removed while empty


@dataclass(frozen=True)
class Claim:
    """Who is writing a version: made exclusively before its first shard, removed when it commits."""

    token: str
    host: str
    pid: int
    created: float  # seconds since the epoch, the claimer's clock
    start: str = ""  # the claimer's start time and pid space (files.processes); "" from older writers
    space: str = ""

    def writer_ended(self) -> bool:
        """Whether the claimer has certainly ended (its process is gone)."""
        return has_ended(self.host, self.pid, self.start, self.space)

    def writer_runs(self) -> bool:
        """Whether the claimer certainly runs (a process of this host, the one that claimed)."""
        return is_running(self.host, self.pid, self.start, self.space)

    def describe(self) -> str:
        return f"host {self.host}, pid {self.pid}, {time.time() - self.created:.0f}s ago"


def new_claim(token: str) -> Claim:
    host, pid, start, space = this_process()
    return Claim(token, host, pid, time.time(), start, space)


def claim_version(loc: Location, version: int, claim: Claim) -> bool:
    """Claim ``version`` for a writer: True if it is now this claim's, False if another holds it.

    An exclusive create of the claim file (a hard link locally, ``If-None-Match: *`` on S3): two
    writers that picked the same number never both write its shards; nor does one that picked
    it just before the other committed it and removed its claim (the manifest is checked after).
    """
    vdir = version_dir(version)
    data = json.dumps(dataclasses.asdict(claim), sort_keys=True).encode()
    try:
        if loc.is_local:
            _claim_local(loc, vdir, data)
        else:
            exclusive_remote_write(loc.fs, loc.path(vdir, CLAIM_FILE), data)
    except FileExistsError:
        found = read_claim(loc, version)
        return found is not None and found.token == claim.token  # our create, retried by the client
    except Exception:  # every answer lost (a reset, a stall): the claim may be stored all the same
        found = None if loc.is_local else _read_back(loc, version)
        if found is None or found.token != claim.token:
            raise
        log.info("the claim of %s was stored although its answers were lost", loc.display(vdir))
    loc.fs.invalidate_cache(loc.path(vdir))
    if loc.fs.exists(loc.path(vdir, MANIFEST_FILE)):
        drop_claim(loc, version)
        return False
    return True


def _claim_local(loc: Location, vdir: str, data: bytes) -> None:
    """Make the version's directory and create its claim in it. A ``gc(min_age=0)`` beside this
    writer may remove the directory while it is still empty (it holds nothing of anyone yet): it
    is made again, a few times, before the claim gives up."""
    for attempt in range(CLAIM_DIR_TRIES):
        os.makedirs(loc.path(vdir), exist_ok=True)
        # The version's directory entry must survive a crash of the machine once its manifest
        # is fsynced: the root is fsynced now, once per version. The claim itself is not: it
        # stands for a live writer, and after a crash of the machine every writer of it is gone,
        # so a claim that did not survive changes nothing (its leftovers are garbage either way,
        # and their directory keeps the number from being reused).
        fsync_dir(loc.root)
        try:
            exclusive_local_write(loc.path(vdir), CLAIM_FILE, data, durable=False)
            return
        except FileNotFoundError:
            if attempt == CLAIM_DIR_TRIES - 1 or os.path.isdir(loc.path(vdir)):
                raise
            log.info("%s was removed before its claim was written; making it again", loc.display(vdir))


def _read_back(loc: Location, version: int) -> Claim | None:
    """The claim as stored now, or None when even reading it fails."""
    try:
        return read_claim(loc, version)
    except Exception:
        return None


def read_claim(loc: Location, version: int) -> Claim | None:
    """The claim of a version being written (None: none, or unreadable)."""
    path = loc.path(version_dir(version), CLAIM_FILE)
    try:
        raw = json.loads(loc.fs.cat_file(path))
        identity = (str(raw.get("start", "")), str(raw.get("space", "")))
        return Claim(str(raw["token"]), str(raw["host"]), int(raw["pid"]), float(raw["created"]), *identity)
    except (FileNotFoundError, ValueError, KeyError, TypeError, RecursionError, ManifestError):
        return None


def check_claim(loc: Location, version: int, token: str) -> None:
    """Raise VersionTakenError unless ``version`` is still claimed with ``token``."""
    found = read_claim(loc, version)
    if found is None or found.token != token:
        who = f"claimed by another writer ({found.describe()})" if found else "its claim was removed"
        raise VersionTakenError(
            f"not committing {loc.display(version_dir(version))}: {who} while this writer was saving it, "
            "so its shard files may not be this writer's. Only one writer may use a store at a time; "
            "the store's other versions are intact: save again"
        )


def drop_claim(loc: Location, version: int) -> None:
    """Remove the claim of a committed version (what a kill leaves here, ``gc`` removes)."""
    try:
        loc.fs.rm_file(loc.path(version_dir(version), CLAIM_FILE))
    except FileNotFoundError:
        pass
    except OSError as exc:  # the commit stands
        log.warning("could not remove %s: %s", loc.display(version_dir(version), CLAIM_FILE), exc)


def stray_claims(loc: Location) -> list[int]:
    """Committed versions whose claim file is still there (a writer killed right after its commit)."""
    loc.fs.invalidate_cache()
    if not loc.fs.exists(loc.root):
        return []
    names: dict[int, set[str]] = {}
    for path in loc.fs.find(loc.root, maxdepth=2, detail=False):
        rel = path[len(loc.root) :].strip("/").split("/")
        version = parse_version_dir(rel[0])
        if version is not None and len(rel) == 2:
            names.setdefault(version, set()).add(rel[1])
    return sorted(v for v, files in names.items() if {CLAIM_FILE, MANIFEST_FILE} <= files)
