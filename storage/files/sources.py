"""Where a shard's bytes are: its own file, or a member of a tarball.

A loose version's shards are files in version directories (its own, and those of
older versions whose bytes it references); an archived version's are ranges of
tarballs. The catalog finds them, the reader reads them, the archive makes them:
all three take this type from here, below them.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..format.manifest import Manifest
from .location import Location


@dataclass(frozen=True)
class ShardSource:
    """Where a shard's bytes are: a whole file (``offset`` 0) or a member of a tarball."""

    path: str  # the file in the store's filesystem
    offset: int  # where the shard starts in that file
    file_size: int  # the size that file must have
    name: str  # for messages: the shard's URL, or the tarball's URL and the member


def loose_sources(loc: Location, manifest: Manifest) -> list[ShardSource]:
    """The shards of a loose version: files in its directory, and the files of other versions'
    directories whose bytes it references."""
    return [
        ShardSource(loc.path(where, name), 0, s.size, loc.display(where, name))
        for s, (where, name) in zip(manifest.shards, manifest.shard_files(), strict=True)
    ]


__all__ = ["ShardSource", "loose_sources"]
