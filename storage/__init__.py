"""ckptflow's storage library: crash-safe, pickle-free, sharded checkpoints on any fsspec URL.

Pure mechanism, no Prefect: usable from any training script.

    from ckptflow.storage import CheckpointStore
    store = CheckpointStore("s3://bucket/run1")
    store.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, epoch=3)
    state = store.load()                 # newest committed version

Importing it, opening a store, listing, pruning, archiving and collecting garbage
do not import torch; saving and loading tensors do (and ``RankGroup``,
torch.distributed, loads when first asked for).
"""

from typing import TYPE_CHECKING, Any

from .async_save import SaveHandle
from .commit import VersionState
from .errors import (
    CheckpointError,
    CorruptShardError,
    FormatVersionError,
    LeaseLostError,
    ManifestError,
    RankFailedError,
    SaveFailedError,
    StorageUnavailableError,
    StoreLockedError,
    UnreadableVersionError,
    UnsupportedValueError,
    VersionExistsError,
    VersionNotFoundError,
    VersionTakenError,
)
from .extract import extract_epoch
from .lease import LeaseInfo, StoreLease, read_lease, refuse_if_held
from .location import quick_answer_options, redact
from .manifest import FORMAT_VERSION, Manifest
from .mirror import upload_storage_options
from .retention import PrunePlan, RetentionPolicy
from .store import CheckpointStore, RankStateWarning, StoreOptions, VersionInfo
from .tarindex import TarIndex

if TYPE_CHECKING:
    from .distributed import RankGroup


def __getattr__(name: str) -> Any:
    if name == "RankGroup":
        from .distributed import RankGroup

        return RankGroup
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointStore",
    "CorruptShardError",
    "FormatVersionError",
    "LeaseInfo",
    "LeaseLostError",
    "Manifest",
    "ManifestError",
    "PrunePlan",
    "RankFailedError",
    "RankGroup",
    "RankStateWarning",
    "RetentionPolicy",
    "SaveFailedError",
    "SaveHandle",
    "StorageUnavailableError",
    "StoreLease",
    "StoreLockedError",
    "StoreOptions",
    "TarIndex",
    "UnreadableVersionError",
    "UnsupportedValueError",
    "VersionExistsError",
    "VersionInfo",
    "VersionNotFoundError",
    "VersionState",
    "VersionTakenError",
    "extract_epoch",
    "quick_answer_options",
    "read_lease",
    "redact",
    "refuse_if_held",
    "upload_storage_options",
]
