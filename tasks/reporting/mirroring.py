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

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
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
    skipped: list[int] = field(default_factory=list)  # let go by the cadence: a newer one went up
    cadence: str | None = None  # archive.upload_every

    def line(self) -> str:
        skipped = ""
        if self.skipped:
            skipped = f"; versions {version_ranges(self.skipped)} skipped by upload_every {self.cadence!r}"
        if not self.missing:
            count = len(self.committed) - len(self.skipped)
            held = f"all {count} versions due" if self.skipped else f"all {count} committed versions"
            return f"mirror {self.url}: {held if self.committed else 'nothing to hold'} mirrored{skipped}"
        why = f" ({self.reason})" if self.reason else ""
        return f"mirror {self.url}: versions {version_ranges(self.missing)} not mirrored yet{why}{skipped}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "mirror": self.url,
            "not_mirrored": list(self.missing),
            "mirror_skipped": list(self.skipped),
            "mirror_line": self.line(),
        }


def check_mirror(
    store: CheckpointStore,
    url: str,
    held: Callable[[], set[int]],
    *,
    config: ArchiveConfig,
    confirmed: set[int],
    failures: list[str],
    skipped: Collection[int] = (),
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
    let_go = [v for v in committed if v in skipped and v not in mirrored]
    missing = [v for v in committed if v not in mirrored and v not in let_go]
    reason = _reason(missing, config, failures, listing_error)
    if reason and config.mirrors_versions() and not archived_here.intersection(missing):
        # a run uploads the loose versions the mirror lacks when it starts
        reason += "; the next run with this upload target uploads them"
    return MirrorStatus(redact(url), committed, missing, reason, let_go, config.upload_every)


def holds_versions(url: str, options: dict[str, Any]) -> bool:
    """Whether the store at ``url`` (a durable tier) holds a committed version (False when it
    cannot be read now)."""
    try:
        return CheckpointStore(url, storage_options=options).latest() is not None
    except Exception:
        return False


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
