"""ckptflow's storage library: crash-safe, pickle-free, sharded checkpoints on any fsspec URL.

Pure mechanism, no Prefect: usable from any training script.

    from ckptflow.storage import CheckpointStore
    store = CheckpointStore("s3://bucket/run1")
    store.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, epoch=3)
    state = store.load()                 # newest committed version
"""

from .async_save import SaveHandle
from .commit import VersionState
from .distributed import RankFailedError, RankGroup
from .errors import (
    CheckpointError,
    CorruptShardError,
    FormatVersionError,
    ManifestError,
    SaveFailedError,
    StorageUnavailableError,
    UnsupportedValueError,
    VersionExistsError,
    VersionNotFoundError,
)
from .manifest import FORMAT_VERSION, Manifest
from .retention import RetentionPolicy
from .store import CheckpointStore, RankStateWarning, StoreOptions, VersionInfo

__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "CheckpointStore",
    "CorruptShardError",
    "FormatVersionError",
    "Manifest",
    "ManifestError",
    "RankFailedError",
    "RankGroup",
    "RankStateWarning",
    "RetentionPolicy",
    "SaveFailedError",
    "SaveHandle",
    "StorageUnavailableError",
    "StoreOptions",
    "UnsupportedValueError",
    "VersionExistsError",
    "VersionInfo",
    "VersionNotFoundError",
    "VersionState",
]
