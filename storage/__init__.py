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

from .archive.extract import extract_epoch
from .archive.tarindex import TarIndex
from .diff import StateDiff
from .errors import (
    CheckpointError,
    CorruptArchiveError,
    CorruptShardError,
    FormatVersionError,
    LeaseLostError,
    ManifestError,
    RankFailedError,
    RankLoadError,
    SaveFailedError,
    StateMismatchError,
    StorageUnavailableError,
    StoreLockedError,
    UnreadableVersionError,
    UnsupportedValueError,
    VersionExistsError,
    VersionNotFoundError,
    VersionTakenError,
)
from .files.location import redact
from .files.nearby import StoresBelow, VersionDirectory, store_holding
from .files.processes import has_ended as process_ended
from .files.processes import this_process as current_process
from .files.s3options import quick_answer_options, upload_storage_options
from .format.entries import Lineage
from .format.manifest import FORMAT_VERSION, Manifest
from .format.names import FAST_TIER_FILE
from .info import EPOCH_STEPS, IN_EPOCH
from .integrations.pointers import check_pointed, lightning_pointer
from .load.restore import RankStateWarning
from .remote.fetch import Fetched
from .save.async_save import SaveHandle
from .store import CheckpointStore, StoreOptions, VersionInfo
from .versions.commit import VersionState
from .versions.lease import LeaseInfo, StoreLease, read_lease, refuse_if_held
from .versions.retention import PrunePlan, RetentionPolicy

if TYPE_CHECKING:
    from .save.group import RankGroup


def export_pretrained(state: Any, out: Any) -> list[str]:
    """Write a Hugging Face Trainer checkpoint's model files as a ``from_pretrained`` directory
    (:func:`.integrations.hfdir.export_pretrained`; imports torch, not transformers)."""
    from .integrations.hfdir import export_pretrained as export

    return export(state, out)


def import_checkpoint(store: CheckpointStore, source: Any, **facts: Any) -> VersionInfo:
    """Commit a checkpoint another tool made (a torch.save or safetensors file, a Hugging Face
    directory) as a new version of ``store`` (:mod:`.integrations.imports`)."""
    from .integrations.imports import import_checkpoint as run

    return run(store, source, **facts)


def read_import(source: Any, **facts: Any) -> Any:
    """Read and check a checkpoint another tool made, writing nothing: ``import_checkpoint`` without
    the save, for a caller that takes a store's lease only once it is read (:mod:`.integrations.imports`)."""
    from .integrations.imports import read_import as run

    return run(source, **facts)


def __getattr__(name: str) -> Any:
    if name == "RankGroup":
        from .save.group import RankGroup

        return RankGroup
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "EPOCH_STEPS",
    "FAST_TIER_FILE",
    "FORMAT_VERSION",
    "IN_EPOCH",
    "CheckpointError",
    "CheckpointStore",
    "CorruptArchiveError",
    "CorruptShardError",
    "Fetched",
    "FormatVersionError",
    "LeaseInfo",
    "LeaseLostError",
    "Lineage",
    "Manifest",
    "ManifestError",
    "PrunePlan",
    "RankFailedError",
    "RankGroup",
    "RankLoadError",
    "RankStateWarning",
    "RetentionPolicy",
    "SaveFailedError",
    "SaveHandle",
    "StateDiff",
    "StateMismatchError",
    "StorageUnavailableError",
    "StoreLease",
    "StoreLockedError",
    "StoreOptions",
    "StoresBelow",
    "TarIndex",
    "UnreadableVersionError",
    "UnsupportedValueError",
    "VersionDirectory",
    "VersionExistsError",
    "VersionInfo",
    "VersionNotFoundError",
    "VersionState",
    "VersionTakenError",
    "check_pointed",
    "current_process",
    "export_pretrained",
    "extract_epoch",
    "import_checkpoint",
    "lightning_pointer",
    "process_ended",
    "quick_answer_options",
    "read_import",
    "read_lease",
    "redact",
    "refuse_if_held",
    "store_holding",
    "upload_storage_options",
]
