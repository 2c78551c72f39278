"""The pipeline's parameters: one typed, validated config.

Prefect validates the flow's parameters against these models before the run
starts, so a bad value fails fast with a message naming the field.
``storage_options`` may hold credentials: it is excluded from ``repr``, from
logs and from artifacts (see :meth:`PipelineConfig.public`).

The *identity* of a run (spec, spec config, seed) is stored beside its
checkpoints as ``run.json``. A resumed run must match it; other fields (more
epochs, a different save cadence or shard count) may change freely.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEMO_SPEC = "ckptflow.flows.demo:DigitsSpec"
IDENTITY_FIELDS = ("spec", "spec_config", "seed")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RetentionConfig(_Strict):
    """Which committed checkpoints to keep at the end of a run (default: all)."""

    keep_last: int | None = Field(None, ge=1, description="keep the newest N checkpoints")
    keep_every: int | None = Field(None, ge=1, description="keep every K-th epoch")
    keep_best: str | None = Field(None, description="keep the best checkpoint by this metric")
    best_mode: Literal["min", "max"] = "min"

    def enabled(self) -> bool:
        return any(v is not None for v in (self.keep_last, self.keep_every, self.keep_best))


class StopConfig(_Strict):
    """Conditions that end training before ``epochs`` (besides cancellation)."""

    metric: str | None = Field(None, description="metric watched by target and patience")
    mode: Literal["min", "max"] = "min"
    target: float | None = Field(None, description="stop once the metric reaches this value")
    patience: int | None = Field(None, ge=1, description="stop after N epochs without improvement")
    max_seconds: float | None = Field(None, gt=0, description="wall-clock budget of this run")

    @model_validator(mode="after")
    def _metric_needed(self) -> StopConfig:
        if (self.target is not None or self.patience is not None) and not self.metric:
            raise ValueError("stop.target and stop.patience need stop.metric (e.g. 'val_loss')")
        return self


class PipelineConfig(_Strict):
    """Everything a training pipeline run needs; JSON in, JSON out."""

    storage: str = Field(description="where checkpoints live: a path, file://, s3://bucket/prefix, ...")
    storage_options: dict[str, Any] = Field(default_factory=dict, repr=False)
    spec: str = Field(DEMO_SPEC, description="the TrainingSpec, as 'package.module:ClassName'")
    spec_config: dict[str, Any] = Field(default_factory=dict)
    seed: int = 0
    epochs: int = Field(5, ge=1, description="train until this epoch (epochs count from 1)")
    save_every: int = Field(1, ge=1, description="save a checkpoint every N epochs (and at the end)")
    shards: int = Field(4, ge=1, le=256)
    async_save: bool = True
    epoch_retries: int = Field(1, ge=0, description="retries of a failed epoch, from its start state")
    save_retries: int = Field(3, ge=0)
    save_timeout_seconds: float | None = Field(None, gt=0)
    retention: RetentionConfig = Field(default_factory=lambda: RetentionConfig())
    stop: StopConfig = Field(default_factory=lambda: StopConfig())
    allow_config_change: bool = Field(False, description="resume even if spec/spec_config/seed differ")

    @model_validator(mode="after")
    def _check(self) -> PipelineConfig:
        if not self.storage.strip():
            raise ValueError("storage must name a location, e.g. ./checkpoints or s3://bucket/run1")
        if ":" not in self.spec:
            raise ValueError(f"spec {self.spec!r} must look like 'package.module:ClassName'")
        return self

    def identity(self) -> dict[str, Any]:
        """The fields that define the run: a resumed run must match them."""
        return {name: getattr(self, name) for name in IDENTITY_FIELDS}

    def public(self) -> dict[str, Any]:
        """The config without credentials, for logs and artifacts."""
        data = self.model_dump(mode="json", exclude={"storage_options"})
        data["storage_options"] = sorted(self.storage_options)  # names only, never values
        return data


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
