"""The one check of every file name read from storage before any I/O uses it.

Names come from manifests (shard files), tar indexes and tar members, which a
crafted or damaged store controls. A name is used only if it is a relative path
of *plain* components: ASCII letters, digits, ``_``, ``-`` and ``.``, not
starting with a dot, no ``..``, at most 200 characters (a temporary name beside
it must fit in 255). That one rule excludes absolute paths, ``..``, schemes
(``s3:``), backslashes, NULs, newlines, Unicode look-alikes and hidden files, on
every filesystem fsspec reaches.
"""

from __future__ import annotations

import re

_PLAIN = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,199}")


def is_plain_name(name: str) -> bool:
    """Whether ``name`` is one safe path component (a file directly inside its directory)."""
    return isinstance(name, str) and _PLAIN.fullmatch(name) is not None and ".." not in name


def relative_name_problem(name: str) -> str | None:
    """Why ``name`` is not a relative path of plain components (None: it is one)."""
    if not isinstance(name, str) or not name:
        return "is empty"
    if name.startswith("/"):
        return "is an absolute path"
    parts = name.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return "has an empty, '.' or '..' component"
    bad = [part for part in parts if not is_plain_name(part)]
    if bad:
        return f"has the component {bad[0]!r}, not a plain name (letters, digits, '_', '-', '.'; no '..')"
    return None


_VERSION_DIR = re.compile(r"v([0-9]{6,})")  # fullmatch: ASCII digits only, no trailing newline


def version_dir(version: int) -> str:
    """The name of a version's directory: ``v`` and at least six digits."""
    return f"v{version:06d}"


def parse_version_dir(name: str) -> int | None:
    """The version a directory name (or path) stands for; None if it is no version directory."""
    match = _VERSION_DIR.fullmatch(name.rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


# A shard file's identity: the token of the save that wrote it, in its name, e.g.
# ``shard-r0-00-3f9a1c2b7d4e6f80.h5``; the manifest lists that name. A file is the one a manifest
# references only if it has the name the manifest lists (and its size): two saves never write one
# name, in one store or in two, so no other file (a copy from another store, a version saved again
# under a removed number, an earlier run's mirror) passes for it. The names stay plain names, so a
# manifest that lists them is of the same format. Files of older saves have no token: they are read
# as before, but never referenced by a new save nor skipped by a mirror on their name alone.
ID_DIGITS = 16
_IDENTIFIED = re.compile(rf"[A-Za-z0-9_.-]+-([0-9a-f]{{{ID_DIGITS}}})\.h5")


def new_file_token() -> str:
    """A fresh identity for the files of one save (64 random bits)."""
    import secrets

    return secrets.token_hex(ID_DIGITS // 2)


def identified_name(planned: str, token: str) -> str:
    """The name a save writes the planned shard file ``planned`` (``shard-r0-00.h5``) under."""
    stem, dot, suffix = planned.rpartition(".")
    return f"{stem}-{token}.{suffix}" if dot else f"{planned}-{token}"


def file_identity(name: str) -> str | None:
    """The identity token a shard file's name carries; None for a file of an older save (no token)."""
    match = _IDENTIFIED.fullmatch(name)
    return match.group(1) if match else None


# What a store holds beside its version directories (each module that owns one says what it is).
LATEST_FILE = "latest"  # the newest committed version's number (versions/commit.py)
ARCHIVE_DIR = "archive"  # the tarballs (archive/tarballs.py)
LEASE_FILE = "lease.json"  # the writer's lease (versions/lease.py)
STORE_FILE = "store.json"  # the store's identity, and a mirror's (versions/identity.py)
RUN_FILE = "run.json"  # the run's identity, which ckptflow's pipeline writes beside its versions
FAST_TIER_FILE = (
    "fast-tier.json"  # in a durable tier: the newest version its fast tier committed (tasks/archiving.py)
)

# An unreadable file or directory set aside by a writer: ``v000003.unreadable-<UTC time>-<6 hex>``.
_SET_ASIDE_DIR = re.compile(r"v([0-9]{6,})\.unreadable-[0-9]{8}T[0-9]{6}Z-[0-9a-f]{6}")


def aside_name(name: str) -> str:
    """``name.unreadable-<UTC time>-<6 hex>``: where an unreadable file or directory is kept, a name
    nothing lists, reads or removes, unique so that two set-asides never merge."""
    import time
    import uuid

    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    return f"{name}.unreadable-{stamp}-{uuid.uuid4().hex[:6]}"


def is_set_aside_dir(name: str) -> bool:
    """Whether ``name`` is a directory a writer set aside as unreadable."""
    return _SET_ASIDE_DIR.fullmatch(name) is not None
