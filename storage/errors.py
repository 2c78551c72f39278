"""One exception hierarchy for everything the storage library raises.

Every message names the thing that is wrong (a key path, a file, a version, a
URL) and, where there is one, what the user can do about it. Messages never
contain credentials: URLs are shown without their query string or user info.
"""

from __future__ import annotations

from typing import Any


class CheckpointError(Exception):
    """Base class of every error raised by ckptflow's storage library."""

    def __reduce__(self) -> tuple[Any, ...]:
        # torch.distributed's object collectives pickle a rank's error to send it to the others
        # (DCP gathers them): rebuilt from its message and attributes, not through an __init__
        # that wants other arguments.
        return (_rebuilt, (type(self), self.args), self.__dict__)


def _rebuilt(kind: type[CheckpointError], args: tuple[Any, ...]) -> CheckpointError:
    error = kind.__new__(kind)
    error.args = args
    return error


class UnsupportedValueError(CheckpointError, TypeError):
    """A value in the state cannot be stored; raised before any byte is written."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        super().__init__(f"cannot store the value at {path or '<root>'}: {reason}")


class VersionNotFoundError(CheckpointError, LookupError):
    """The requested version is not committed in this store."""

    def __init__(
        self, version: int | None, url: str, committed: list[int], *, reason: str | None = None
    ) -> None:
        self.version = version
        self.committed = committed
        listing = ", ".join(str(v) for v in committed) if committed else "none"
        what = "no committed checkpoint" if version is None else f"version {version} is not committed"
        if reason is not None:  # another question than a number: say which (e.g. no version has a metric)
            what = reason
        super().__init__(f"{what} in {url} (committed versions: {listing})")


class VersionExistsError(CheckpointError):
    """A committed version is immutable; saving over it is refused."""

    def __init__(self, version: int, url: str) -> None:
        self.version = version
        super().__init__(
            f"version {version} is already committed in {url}; committed versions are "
            "immutable: save under a new version or delete this one first"
        )


class FormatVersionError(CheckpointError):
    """A manifest written by a newer (or unknown) format version."""


class ManifestError(CheckpointError):
    """A manifest exists but cannot be parsed or fails validation."""


class UnreadableVersionError(ManifestError):
    """The newest version of a store has a manifest that cannot be read: verifying stops there."""

    def __init__(self, version: int, url: str, reason: CheckpointError, readable: int | None) -> None:
        self.version = version
        self.reason = reason
        after = (
            f"version {readable} is the newest readable one (verify it with --version {readable}); "
            f"a training run on this store resumes from it and sets version {version} aside"
            if readable is not None
            else "no older version is readable"
        )
        text = " ".join(str(reason).split())
        super().__init__(f"version {version}, the newest in {url}, is unreadable: {text}. {after}")


class CorruptShardError(CheckpointError):
    """A shard's bytes do not match the checksum or size in its manifest."""

    def __init__(self, file: str, *, expected: str, actual: str, what: str = "checksum") -> None:
        self.file = file
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"corrupt checkpoint file {file}: {what} expected {expected}, found {actual}; "
            "load an earlier version or restore this file from a copy"
        )


class CorruptArchiveError(CorruptShardError):
    """A tarball is not the tar that was archived outside its members' data: a member's header,
    the padding or the end-of-archive blocks, or its size (what tar and extraction read)."""

    def __init__(self, tar: str, *, part: str, expected: str, actual: str, advice: str) -> None:
        self.file = tar
        self.part = part
        self.expected = expected
        self.actual = actual
        CheckpointError.__init__(
            self, f"corrupt tarball {tar}: {part}: expected {expected}, found {actual}; {advice}"
        )


class StorageUnavailableError(CheckpointError, OSError):
    """The storage URL cannot be used: unknown scheme, missing bucket, no permission, disk full."""


class SaveFailedError(CheckpointError):
    """A background (async) save failed; the previous committed version is intact."""


class RankFailedError(SaveFailedError):
    """Another rank of a multi-process save failed; nothing was committed."""


class RankLoadError(CheckpointError):
    """Another rank of a multi-process load failed; its error is in the message, and no rank goes on."""


class StateMismatchError(CheckpointError, ValueError):
    """A sharded load's ``into`` state does not fit the version: a key it lacks, a shape it stores
    otherwise. Raised before any byte is read."""


class UnsafeArchiveError(CheckpointError):
    """A tarball member that extraction refuses: absolute path, ``..``, link, device, escape."""


class ArchiveNotCommittedError(CheckpointError, FileNotFoundError):
    """A tarball without a valid index: never committed (archiving crashed or is running), so garbage."""


class ArchiveExistsError(CheckpointError, FileExistsError):
    """A committed tarball (one with an index) is immutable; writing over it is refused."""


class StoreLockedError(CheckpointError):
    """Another writer holds the store's lease: only one writer may use a store at a time."""

    def __init__(self, message: str, *, holder: object = None) -> None:
        self.holder = holder  # a ckptflow.storage.lease.LeaseInfo, when known
        super().__init__(message)


class LeaseLostError(CheckpointError):
    """This writer's lease on the store was taken over by another writer; it may not commit."""


class VersionTakenError(CheckpointError):
    """Another writer claimed or committed this version number while this one was saving it."""


class UnsafeFileError(ManifestError):
    """A file a store names is not a regular file inside the store (a symlink out of it, a FIFO,
    a device, a directory): it is never opened. A manifest that is one makes its version unreadable."""
