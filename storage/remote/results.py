"""What a transfer ends with: a verified copy (:class:`TransferResult`) or :class:`TransferVerifyError`.

Both ways of moving a file, boto3's engine on S3 (:mod:`.s3`) and fsspec elsewhere
(:mod:`.transfer`), end the same way: the copy was checked against its source, or it
was deleted and this error names what differed.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import CheckpointError, CorruptShardError


@dataclass(frozen=True)
class TransferResult:
    url: str  # redacted: no credentials
    size: int
    seconds: float
    skipped: bool  # True: the remote copy was already complete and verified, nothing was sent
    etag: str  # S3: the object's ETag; other filesystems: "xxh3_64:<hex>" of the bytes


class TransferVerifyError(CorruptShardError):
    """A transferred copy does not match its source; the bad copy was deleted."""

    def __init__(self, url: str, *, what: str, expected: str, actual: str, deleted: str) -> None:
        self.file, self.expected, self.actual = url, expected, actual
        CheckpointError.__init__(
            self,
            f"the copy at {url} failed verification: {what} expected {expected}, found {actual}; "
            f"{deleted}; transfer it again (if it fails again, the source changed or the storage is faulty)",
        )
