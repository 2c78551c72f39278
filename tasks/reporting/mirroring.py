"""What the upload target lacks, said at the end of every run that has one.

A run with ``archive.upload_to`` ends with one line (in its log, the CLI's
output and the run summary) naming the committed versions of the store that
the mirror does not hold yet, or saying that it holds them all. The mirror's
own listing is the truth: a version is mirrored when the target holds its
manifest (a loose copy) or a committed tarball index that lists it. When the
target cannot be listed (unreachable, refused), only the uploads this run
verified count, and the line says why. No Prefect import: the flow logs it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptflow.storage import CheckpointStore, redact

from .formatting import version_ranges

if TYPE_CHECKING:
    from ..config import ArchiveConfig


@dataclass(frozen=True)
class MirrorStatus:
    """The committed versions of a store and those its mirror lacks."""

    url: str  # the target, redacted
    committed: list[int]
    missing: list[int]
    reason: str | None = None  # why they are missing, when known

    def line(self) -> str:
        if not self.missing:
            held = f"all {len(self.committed)} committed versions" if self.committed else "nothing to hold"
            return f"mirror {self.url}: {held} mirrored"
        why = f" ({self.reason})" if self.reason else ""
        return f"mirror {self.url}: versions {version_ranges(self.missing)} not mirrored yet{why}"

    def as_dict(self) -> dict[str, Any]:
        return {"mirror": self.url, "not_mirrored": list(self.missing), "mirror_line": self.line()}


def check_mirror(
    store: CheckpointStore,
    url: str,
    held: Callable[[], set[int]],
    *,
    config: ArchiveConfig,
    confirmed: set[int],
    failures: list[str],
) -> MirrorStatus:
    """The committed versions of ``store`` that ``held()`` (what ``url`` holds) lacks, and why."""
    versions = store.versions()
    committed = [v.version for v in versions]
    archived_here = {v.version for v in versions if v.archived}
    listing_error = None
    try:
        mirrored = held()
    except Exception as exc:
        mirrored = set(confirmed)
        listing_error = f"could not list the mirror: {' '.join(str(exc).split()) or type(exc).__name__}"
    missing = [v for v in committed if v not in mirrored]
    reason = _reason(missing, config, failures, listing_error)
    if reason and config.mirrors_versions() and not archived_here.intersection(missing):
        # a run uploads the loose versions the mirror lacks when it starts
        reason += "; the next run with this upload target uploads them"
    return MirrorStatus(redact(url), committed, missing, reason)


def mirrored_versions(url: str, options: dict[str, Any]) -> set[int]:
    """Versions ``url`` holds: loose with a manifest, or in a committed tarball."""
    mirror = CheckpointStore(url, storage_options=options)
    loose = {v for v, has_manifest in mirror.version_dirs().items() if has_manifest}
    return loose | set(mirror.archived())


def _reason(
    missing: list[int], config: ArchiveConfig, failures: list[str], listing_error: str | None
) -> str | None:
    if not missing:
        return None
    if failures:
        more = f" (and {len(failures) - 1} more failed jobs)" if len(failures) > 1 else ""
        return f"{failures[0]}{more}"
    if listing_error:
        return listing_error
    if not config.mirrors_versions():
        return "upload_versions is off: loose versions go up only in tarballs"
    return "their uploads have not run yet"
