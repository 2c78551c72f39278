"""The pipeline's parameters: one typed, validated config.

Prefect validates the flow's parameters against these models before the run
starts, so a bad value fails fast with a message naming the field.
Credentials are never parameters: Prefect stores a run's parameters in clear
(the UI shows them), so ``storage_options`` refuses keys such as ``secret`` or
``token`` with a message saying where credentials go instead: the environment
or an AWS profile (read by s3fs as usual), or a Prefect block named by
``storage_secret`` (a Secret block, or ``aws-credentials/NAME``) whose options
are merged in at run time (see :mod:`.credentials`).

The *identity* of a run (spec, spec config, seed) is stored beside its
checkpoints as ``run.json``. A resumed run must match it; other fields (more
epochs, a different save cadence or shard count) may change freely.
"""

from __future__ import annotations

import json
import math
import re
import types
import typing
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .credentials import check_block_ref, credential_keys, with_secret

if TYPE_CHECKING:  # the storage library imports torch: this module stays light for the CLI's start-up
    from ckptflow.storage import RetentionPolicy

DEMO_SPEC = "ckptflow.flows.demo:DigitsSpec"
MAX_DOCUMENT_DEPTH = 64  # nesting of a config's JSON values (spec_config, storage options)
MAX_EPOCHS = 10**7  # bounds a config's counts and durations so that no date or number overflows later
MAX_STEPS = 10**12
MAX_SECONDS = 10**7  # 115 days
IDENTITY_FIELDS = ("spec", "spec_config", "seed")


def value_problem(value: Any) -> str | None:
    """Why a parsed document cannot be a config's value (None: it can): nested too deeply, a number
    that is not finite or an integer too large to be one. Walks without recursion."""
    stack: list[tuple[Any, int, str]] = [(value, 0, "")]
    while stack:
        node, depth, where = stack.pop()
        if depth > MAX_DOCUMENT_DEPTH:
            return f"it is nested more than {MAX_DOCUMENT_DEPTH} levels deep"
        at = f" (at {where})" if where else ""
        if isinstance(node, bool) or node is None or isinstance(node, str):
            continue
        if isinstance(node, int):
            if abs(node) >= 1 << 63:
                return f"the integer {str(node)[:20]}... is too large{at}: ckptflow takes 64-bit integers"
        elif isinstance(node, float):
            if not math.isfinite(node):
                return f"{node} is not a finite number{at}"
        elif isinstance(node, dict):
            stack += [(v, depth + 1, f"{where}.{_key(k)}" if where else _key(k)) for k, v in node.items()]
        elif isinstance(node, list):
            stack += [(v, depth + 1, f"{where}[{i}]") for i, v in enumerate(node)]
    return None


def _key(key: object) -> str:
    """A key as a message names it: plain, or as JSON where it holds anything else (a newline)."""
    text = str(key)
    return text if re.fullmatch(r"[A-Za-z0-9_.-]{1,40}", text) else json.dumps(text)[:42]


class _Strict(BaseModel):
    """The config models' base: no unknown field, no ``NaN`` or infinity in a float field, and no
    ``true``/``false`` where a number is meant (pydantic would read ``true`` as 1)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info: Any) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if isinstance(value, bool) and field is not None and _numeric(field.annotation):
            raise ValueError(f"must be a number, not {str(value).lower()}")
        return value


def _numeric(annotation: Any) -> bool:
    """Whether a field's type is a number (``int``, ``float``, optional or not) and not a bool."""
    union = isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union
    members = typing.get_args(annotation) if union else (annotation,)
    return bool(set(members) & {int, float}) and bool not in members


class RetentionConfig(_Strict):
    """Which committed checkpoints to keep at the end of a run (default: all).

    ``keep_best`` needs ``best_mode``: no direction is assumed, since keeping the minimum of an
    accuracy would delete the best checkpoint.
    """

    keep_last: int | None = Field(None, ge=1, le=MAX_EPOCHS, description="keep the newest N checkpoints")
    keep_every: int | None = Field(None, ge=1, le=MAX_EPOCHS, description="keep every K-th epoch")
    keep_best: str | None = Field(None, description="keep the best checkpoint by this metric")
    best_mode: Literal["min", "max"] | None = Field(
        None,
        description="with keep_best (required there): max if a higher metric is better (an accuracy), "
        "min if a lower one is (a loss)",
    )
    best_count: int = Field(
        1, ge=1, le=MAX_EPOCHS, description="with keep_best: keep the best N by its metric"
    )
    keep_undurable: bool = Field(
        True,
        description="with archive.upload_to: keep the versions the durable tier does not hold yet, "
        "whatever the rest says (false: apply the policy to them too)",
    )

    @model_validator(mode="after")
    def _direction_given(self) -> RetentionConfig:
        if self.keep_best is not None and self.best_mode is None:
            raise ValueError(
                f"retention.keep_best {self.keep_best!r} needs retention.best_mode: 'max' if a higher "
                f"{self.keep_best} is better (an accuracy), 'min' if a lower one is (a loss)"
            )
        if self.best_count != 1 and self.keep_best is None:
            raise ValueError(f"retention.best_count {self.best_count} needs retention.keep_best (a metric)")
        return self

    def enabled(self) -> bool:
        return any(v is not None for v in (self.keep_last, self.keep_every, self.keep_best))

    def policy(self, not_durable_from: int | None = None) -> RetentionPolicy:
        """The storage library's policy for these settings; ``not_durable_from``: the first version
        the durable tier does not hold yet (kept, unless ``keep_undurable`` is off)."""
        from ckptflow.storage import RetentionPolicy

        return RetentionPolicy(
            keep_last=self.keep_last,
            keep_every=self.keep_every,
            keep_best=self.keep_best,
            best_mode=self.best_mode,
            best_count=self.best_count,
            keep_from=not_durable_from if self.keep_undurable else None,
        )


class StopConfig(_Strict):
    """Conditions that end training before ``epochs`` (besides cancellation)."""

    metric: str | None = Field(None, description="metric watched by target and patience")
    mode: Literal["min", "max"] = Field("min", description="min if a lower metric is better, else max")
    target: float | None = Field(None, description="stop once the metric reaches this value")
    patience: int | None = Field(
        None, ge=1, le=MAX_EPOCHS, description="stop after N epochs without improvement"
    )
    max_seconds: float | None = Field(None, gt=0, le=MAX_SECONDS, description="wall-clock budget of this run")

    @model_validator(mode="after")
    def _metric_needed(self) -> StopConfig:
        if (self.target is not None or self.patience is not None) and not self.metric:
            raise ValueError("stop.target and stop.patience need stop.metric (e.g. 'val_loss')")
        return self


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}


def upload_interval(text: str) -> float | None:
    """``archive.upload_every`` in seconds: "epoch" is None, "10m" is 600, "90s" (or "90") is 90."""
    spelled = text.strip().lower()
    if spelled == "epoch":
        return None
    number, unit = (spelled[:-1], spelled[-1]) if spelled[-1:] in _UNITS else (spelled, "s")
    try:
        seconds = float(number) * _UNITS[unit]
    except ValueError:
        seconds = -1.0
    if not 0 < seconds <= 7 * 86400:
        raise ValueError(
            f"archive.upload_every {text!r} is not a cadence: give 'epoch' or a duration such as "
            "'10m', '90s' or '1h' (at most a week)"
        )
    return seconds


class ArchiveConfig(_Strict):
    """Consolidating committed checkpoints into tarballs, and mirroring them elsewhere (default: off)."""

    every: int | None = Field(
        None, ge=1, le=MAX_EPOCHS, description="archive each K committed epochs into one tarball"
    )
    target_bytes: int | None = Field(
        None, ge=1, le=1 << 60, description="or: archive once loose checkpoints reach this size"
    )
    keep_loose: bool = Field(False, description="keep the loose files of archived versions")
    upload_to: str | None = Field(
        None, description="a URL (e.g. s3://bucket/run1) to mirror committed versions and archives to"
    )
    upload_options: dict[str, Any] = Field(default_factory=dict, description="fsspec options, no credentials")
    upload_secret: str | None = Field(
        None, description="a Prefect block with upload credentials: NAME of a Secret, or aws-credentials/NAME"
    )
    upload_versions: bool | None = Field(
        None,
        description="upload every committed version as it commits (default: on with upload_to; "
        "false mirrors archives only)",
    )
    max_pending: int = Field(
        2, ge=1, le=16, description="archive and upload jobs run at once (more wait; a commit never waits)"
    )
    upload_every: str | None = Field(
        None,
        description="the durable tier's cadence: 'epoch' (versions at epoch ends), or a duration "
        "('10m', '90s', '1h': the newest version at most that often); unset: every version. The "
        "run's last version always goes up",
    )
    durable_keep_last: int | None = Field(
        None,
        ge=1,
        le=MAX_EPOCHS,
        description="the durable tier's retention: keep its newest N versions, applied at the run's "
        "end once every upload is done (unset: keep all)",
    )
    upload_retry_seconds: float = Field(
        30.0,
        ge=0.1,
        le=3600,
        description="after an upload failed (its retries spent): the pause before the durable tier "
        "is tried again with the newest version; training never waits for it",
    )
    stop_drain_seconds: float = Field(
        20.0,
        ge=0,
        le=3600,
        description="on SIGTERM: how long the run may spend making its newest version durable "
        "before it exits (keep it under the platform's grace period)",
    )

    @field_validator("upload_options")
    @classmethod
    def _plain_json(cls, value: dict[str, Any]) -> dict[str, Any]:
        problem = value_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    def enabled(self) -> bool:
        return self.every is not None or self.target_bytes is not None

    @field_validator("upload_every")
    @classmethod
    def _cadence(cls, value: str | None) -> str | None:
        if value is not None:
            upload_interval(value)  # raises naming what is wrong
        return value

    def upload_interval(self) -> float | None:
        """The durable tier's cadence in seconds (0: every version; None: at epoch ends)."""
        return upload_interval(self.upload_every) if self.upload_every is not None else 0.0

    def mirrors_versions(self) -> bool:
        """Whether each committed version goes to ``upload_to`` as it commits (unset: yes, with a target)."""
        return self.upload_to is not None and self.upload_versions is not False

    @field_validator("upload_secret")
    @classmethod
    def _block_ref(cls, value: str | None) -> str | None:
        return check_block_ref(value, "archive.upload_secret")

    @model_validator(mode="after")
    def _check(self) -> ArchiveConfig:
        found = credential_keys(self.upload_options)
        if found:
            raise ValueError(
                f"archive.upload_options must not hold credentials ({', '.join(found)}): use the "
                "environment, an AWS profile or archive.upload_secret"
            )
        if self.upload_versions is True and not self.upload_to:
            raise ValueError("archive.upload_versions needs archive.upload_to")
        for name in ("upload_every", "durable_keep_last"):
            if getattr(self, name) is not None and not self.upload_to:
                raise ValueError(f"archive.{name} needs archive.upload_to (the durable tier)")
        return self


class PipelineConfig(_Strict):
    """Everything a training pipeline run needs; JSON in, JSON out."""

    storage: str = Field(description="where checkpoints live: a path, file://, s3://bucket/prefix, ...")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec options without credentials, e.g. an endpoint or a profile"
    )
    storage_secret: str | None = Field(
        None,
        description="a Prefect block whose credentials join storage_options: NAME of a Secret block "
        "(a JSON object of fsspec options) or aws-credentials/NAME (a prefect-aws AwsCredentials block)",
    )
    spec: str = Field(DEMO_SPEC, description="the TrainingSpec, as 'package.module:ClassName'")
    spec_config: dict[str, Any] = Field(default_factory=dict, description="the spec's config (JSON)")
    seed: int = Field(
        0, ge=-(1 << 63), lt=1 << 64, description="the run's seed; with spec and spec_config, its identity"
    )
    epochs: int = Field(5, ge=1, le=MAX_EPOCHS, description="train until this epoch (epochs count from 1)")
    save_every: int = Field(
        1, ge=1, le=MAX_EPOCHS, description="save a checkpoint every N epochs (and at the end)"
    )
    save_every_steps: int | None = Field(
        None,
        ge=1,
        le=MAX_STEPS,
        description="also save every N optimizer steps, inside epochs (a spec with train_steps; "
        "a spec with train_epoch saves at the end of the epoch in which the step falls)",
    )
    save_every_minutes: float | None = Field(
        None,
        gt=0,
        le=MAX_SECONDS / 60,
        description="also save once M minutes have passed since the last save (as --save-every-steps)",
    )
    stop_grace_seconds: float = Field(
        25.0,
        gt=0,
        le=MAX_SECONDS,
        description="on SIGTERM or a cancellation: how long the step in progress and the save of it may "
        "take before the run gives up waiting for the commit (fits a 30 s notice)",
    )
    shards: int = Field(
        4, ge=1, le=256, description="HDF5 shard files per version at most: one per 64 MiB of state"
    )
    dedup: bool = Field(
        True,
        description="write only the tensors whose bytes no committed version holds, and reference the "
        "rest (off: every version a full copy)",
    )
    async_save: bool = Field(True, description="save while the next epoch trains")
    epoch_retries: int = Field(1, ge=0, le=100, description="retries of a failed epoch, from its start state")
    save_retries: int = Field(3, ge=0, le=100, description="retries of a failed save or commit task")
    save_timeout_seconds: float | None = Field(
        None,
        gt=0,
        le=MAX_SECONDS,
        description="fail a save or commit task that waits longer (retried; the write goes on)",
    )
    train_process: bool = Field(
        True,
        description="train in training processes, ranks launched by torch's elastic launcher: they "
        "start beside Prefect instead of after it; off, the model lives in the flow's process (for a "
        "debugger; nproc and nnodes must then be 1)",
    )
    torch_threads: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="torch intra-op threads of the training process (default: all cores but one, "
        "leaving one to Prefect and the background saves; OMP_NUM_THREADS is respected)",
    )
    retention: RetentionConfig = Field(default_factory=lambda: RetentionConfig())
    stop: StopConfig = Field(default_factory=lambda: StopConfig())
    archive: ArchiveConfig = Field(default_factory=lambda: ArchiveConfig())
    allow_config_change: bool = Field(False, description="resume even if spec/spec_config/seed differ")
    resume_only: bool = Field(
        False,
        description="fail, before anything is built or written, unless the store holds a committed "
        "version to resume from (a mistyped storage URL then fails instead of training from scratch)",
    )
    nproc: int = Field(
        1, ge=1, le=256, description="training processes (torch.distributed ranks) launched for this run"
    )
    nnodes: int = Field(
        1,
        ge=1,
        le=4096,
        description="machines the run trains on: this one leads; the others join with torchrun "
        "(--nnodes N --rdzv-backend c10d --rdzv-endpoint ENDPOINT -m ckptflow.tasks.training.rank_worker)",
    )
    rdzv_endpoint: str | None = Field(
        None,
        description="host:port of the ranks' c10d rendezvous (needed with nnodes > 1; default: a port "
        "of 127.0.0.1 the rendezvous store binds itself)",
    )
    rdzv_id: str | None = Field(None, description="the rendezvous id the other machines' torchrun give")
    dist_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed backend of the ranks (auto: nccl with GPUs, else gloo)"
    )
    rank_timeout_seconds: float = Field(
        600,
        gt=0,
        le=MAX_SECONDS,
        description="how long a rank waits for the others in a collective before failing",
    )
    lease_timeout_seconds: float = Field(
        180,
        gt=0,
        le=MAX_SECONDS,
        description="the run's writer lease on the store is renewed every sixth of this; a lease not "
        "renewed for this long (its run was killed) may be taken over by another run",
    )

    @field_validator("storage_secret")
    @classmethod
    def _block_ref(cls, value: str | None) -> str | None:
        return check_block_ref(value, "storage_secret")

    @field_validator("spec_config", "storage_options")
    @classmethod
    def _plain_json(cls, value: dict[str, Any]) -> dict[str, Any]:
        problem = value_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _no_credentials(self) -> PipelineConfig:
        found = credential_keys(self.storage_options)
        if found:
            raise ValueError(
                f"storage_options must not hold credentials ({', '.join(found)}): Prefect stores "
                "parameters in clear. Use environment variables (AWS_ACCESS_KEY_ID, "
                "AWS_SECRET_ACCESS_KEY), an AWS profile ({'profile': 'name'}), or a Prefect block "
                "named by storage_secret: a Secret block holding the options as JSON, or "
                "'aws-credentials/NAME' for a prefect-aws AwsCredentials block"
            )
        return self

    @model_validator(mode="after")
    def _check(self) -> PipelineConfig:
        if not self.storage.strip():
            raise ValueError("storage must name a location, e.g. ./checkpoints or s3://bucket/run1")
        if ":" not in self.spec:
            raise ValueError(f"spec {self.spec!r} must look like 'package.module:ClassName'")
        if not self.train_process and (self.nproc > 1 or self.nnodes > 1):
            raise ValueError(
                "train_process=false trains in the flow's process: nproc and nnodes must be 1 (leave "
                "train_process on to train on ranks)"
            )
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError(
                f"nnodes={self.nnodes} needs rdzv_endpoint (host:port that every machine reaches, "
                "e.g. this machine's address and a free port)"
            )
        return self

    @property
    def uses_trainers(self) -> bool:
        """Whether the run trains in training processes (ranks) rather than in the flow's process."""
        return self.train_process

    def identity(self) -> dict[str, Any]:
        """The fields that define the run: a resumed run must match them."""
        return {name: getattr(self, name) for name in IDENTITY_FIELDS}

    def resolved_storage_options(self) -> dict[str, Any]:
        """``storage_options`` with the credential block's options merged in (call inside a run)."""
        return with_secret(self.storage_options, self.storage_secret)


def identity_differences(stored: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Names of identity fields (``spec_config.lr`` for nested keys) that differ."""
    diffs: list[str] = []
    for name in IDENTITY_FIELDS:
        old, new = stored.get(name), current.get(name)
        if isinstance(old, dict) and isinstance(new, dict):
            for key in sorted(set(old) | set(new)):
                if old.get(key) != new.get(key):
                    diffs.append(f"{name}.{key} ({old.get(key)!r} -> {new.get(key)!r})")
        elif old != new:
            diffs.append(f"{name} ({old!r} -> {new!r})")
    return diffs
