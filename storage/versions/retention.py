"""Retention policy: which committed versions to keep, and what a prune removes.

Pure functions over the list of committed versions; the store deletes what
they do not keep. The newest committed version is always kept, whatever the
policy says: pruning never takes away the checkpoint a run would resume from.
"The best" has no default direction: a policy that keeps the best by a metric
says whether its min or its max is best (a loss or an accuracy), since a wrong
guess would delete the very version the policy means to keep.

A tarball is removed whole (members cannot be cut out of a tar), so a version
the policy drops stays while its tarball holds a version the policy keeps: it
is *held*, not removed. :func:`plan_prune` is the one place that decides; the
dry run prints its plan, and the real prune carries out that plan.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, TypeVar

from ..format.manifest import Manifest
from ..info import in_epoch


class _HasMetrics(Protocol):
    @property
    def version(self) -> int: ...
    @property
    def metrics(self) -> Mapping[str, float]: ...


Ranked = TypeVar("Ranked", bound=_HasMetrics)


@dataclass(frozen=True)
class RetentionPolicy:
    """Keep the union of: the last ``keep_last``, every ``keep_every``-th epoch, the best by a metric."""

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: str | None = None
    best_mode: Literal["min", "max"] | None = None  # required with keep_best: no direction is assumed
    best_count: int = 1
    # Keep every version numbered at least this, whatever the rest says: those a durable tier does
    # not hold yet (a run with an upload target), which its fast tier must not drop.
    keep_from: int | None = None

    def __post_init__(self) -> None:
        for name in ("keep_last", "keep_every"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.best_count < 1:
            raise ValueError(f"best_count must be >= 1, got {self.best_count}")
        if self.best_mode is not None and self.best_mode not in ("min", "max"):
            raise ValueError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}")
        if self.keep_best is not None and self.best_mode is None:
            raise ValueError(
                f"keep_best={self.keep_best!r} needs best_mode: 'max' if a higher {self.keep_best} is "
                "better (an accuracy), 'min' if a lower one is (a loss)"
            )
        if self.keep_last is None and self.keep_every is None and self.keep_best is None:
            raise ValueError("a retention policy needs at least one of keep_last, keep_every, keep_best")


def versions_to_keep(manifests: list[Manifest], policy: RetentionPolicy) -> set[int]:
    """Version numbers the policy keeps, out of ``manifests`` (committed versions)."""
    ordered = sorted(manifests, key=lambda m: m.version)
    if not ordered:
        return set()
    keep = {ordered[-1].version}
    if policy.keep_last:
        keep.update(m.version for m in ordered[-policy.keep_last :])
    if policy.keep_every:
        keep.update(
            m.version for m in ordered if in_epoch(m.user) is None and _epoch(m) % policy.keep_every == 0
        )
    keep.update(best_versions(ordered, policy))
    if policy.keep_from is not None:
        keep.update(m.version for m in ordered if m.version >= policy.keep_from)
    return keep


def best_versions(manifests: list[Manifest], policy: RetentionPolicy) -> list[int]:
    """The versions the policy keeps as the best by its metric, best first (none without keep_best)."""
    metric = policy.keep_best
    if not metric:
        return []
    assert policy.best_mode is not None  # checked with the policy
    return [m.version for m in ranked_by(manifests, metric, policy.best_mode)[: policy.best_count]]


def ranked_by(versions: Sequence[Ranked], metric: str, mode: Literal["min", "max"]) -> list[Ranked]:
    """Those of ``versions`` (manifests, or VersionInfo) that record ``metric``, best first: the
    lowest (``min``) or highest (``max``), ties to the newest."""
    sign = 1 if mode == "min" else -1
    scored = [v for v in versions if metric in v.metrics]
    return sorted(scored, key=lambda v: (sign * v.metrics[metric], -v.version))


def _epoch(m: Manifest) -> int:
    return m.epoch if m.epoch is not None else m.version


@dataclass(frozen=True)
class PrunePlan:
    """What pruning a store does: versions kept, removed and held by a shared tarball."""

    keep: tuple[int, ...]  # versions the policy keeps
    remove: tuple[int, ...]  # versions that are gone afterwards
    held: Mapping[int, str]  # version the policy drops -> the tarball that keeps it (with a kept version)
    tarballs: tuple[str, ...]  # tarballs removed whole
    loose: tuple[int, ...]  # version directories removed (loose copies of held versions included)
    kept_in: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # tarball -> kept versions in it
    best: tuple[int, ...] = ()  # the versions kept as the best by the policy's metric, best first
    freed: int | None = None  # bytes it removes (a plan: would remove now; None: not computed)
    # Of the loose versions it removes, the bytes each frees: its own files but those the versions
    # that stay reference (which stay with them); its size counts those and the files it references.
    freed_each: Mapping[int, int] = field(default_factory=dict)

    @property
    def remaining(self) -> tuple[int, ...]:
        """Every version still committed after the prune."""
        return tuple(sorted({*self.keep, *self.held}))

    def describe_held(self) -> str | None:
        """Which versions a shared tarball holds back, and why; None when there are none."""
        if not self.held:
            return None
        parts = []
        for tar in sorted(set(self.held.values())):
            dropped = [v for v, t in sorted(self.held.items()) if t == tar]
            parts.append(f"{_versions(dropped)} ({tar} holds kept {_versions(self.kept_in.get(tar, ()))})")
        return "; ".join(parts) + ": a tarball is removed only whole"


def plan_prune(
    manifests: list[Manifest],
    policy: RetentionPolicy,
    *,
    tarball_of: Mapping[int, str],
    loose: Collection[int],
) -> PrunePlan:
    """The prune of committed ``manifests``; ``tarball_of``: archived version -> its tarball,
    ``loose``: versions with a directory of their own."""
    keep = versions_to_keep(manifests, policy)
    numbers = sorted(m.version for m in manifests)
    members: dict[str, list[int]] = {}
    for version in numbers:
        if version in tarball_of:
            members.setdefault(tarball_of[version], []).append(version)
    doomed = sorted(tar for tar, versions in members.items() if not keep.intersection(versions))
    held = {
        v: tarball_of[v] for v in numbers if v not in keep and v in tarball_of and tarball_of[v] not in doomed
    }
    return PrunePlan(
        keep=tuple(v for v in numbers if v in keep),
        remove=tuple(v for v in numbers if v not in keep and v not in held),
        held=held,
        tarballs=tuple(doomed),
        loose=tuple(v for v in numbers if v not in keep and v in loose),
        kept_in={tar: tuple(v for v in versions if v in keep) for tar, versions in members.items()},
        best=tuple(best_versions(manifests, policy)),
    )


def _versions(numbers: Collection[int]) -> str:
    return f"version{'s' if len(numbers) != 1 else ''} {', '.join(map(str, sorted(numbers)))}"
