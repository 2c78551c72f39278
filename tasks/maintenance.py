"""Upkeep of checkpoint stores outside training runs: archives, retention, leftovers, the published table.

The maintenance flow (``flows/maintenance.py``) runs these tasks per store, in
order; each is a thin wrapper over ``ckptflow.storage`` and safe to retry.

What must hold:

- A store that a training run is writing to right now is only *published*,
  never pruned or collected: ``gc`` cannot tell a save in progress from a
  crashed one, and retention during a run is that run's own ``finalize``
  step. "Writing right now" means a ``ckptflow-train`` flow run in Pending,
  Running or Cancelling whose ``config.storage`` names the same store, or any
  live writer holding the store's lease (a run, a training script, ``ckptflow
  gc``). A run whose process died stays Running until the heartbeat automation
  (``ckptflow setup-server``) or the next training run on its host marks it
  Crashed (:mod:`.crashed`), and holds its store until then.
- Writing tarballs, dropping loose copies, retention and gc run under the store's
  writer lease (:func:`holding_store`), so no writer starts on the store meanwhile;
  uploads hold no lease, so a training run can start while a big tarball goes up.
- Credentials are never parameters, as for the training pipeline:
  ``storage_options`` refuse them; they come from the environment, an AWS
  profile, a credential block (``storage_secret``: a Secret block or
  ``aws-credentials/NAME``), or, for a flow run started
  in-process by the CLI, :func:`private_storage_options`, which never
  reaches the Prefect API.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar
from typing import Any
from uuid import UUID

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ckptflow.storage import CheckpointStore, StoreLockedError

from .config import ArchiveConfig, PipelineConfig, RetentionConfig
from .reporting.formatting import retention_line
from .reporting.monitoring import publish_store
from .reporting.prefect_runs import active_train_runs, on_store, prefect_client

_private_options: ContextVar[dict[str, Any] | None] = ContextVar("ckptflow_private_options", default=None)


class MaintenanceConfig(BaseModel):
    """The maintenance flow's parameter: which stores, and what to do to each."""

    model_config = ConfigDict(extra="forbid")

    storages: list[str] = Field(min_length=1, description="store URLs: paths, file://, s3://bucket/prefix")
    storage_options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec options without credentials, shared by the stores"
    )
    storage_secret: str | None = Field(
        None,
        description="a Prefect block whose credentials join storage_options: NAME of a Secret block "
        "or aws-credentials/NAME (a prefect-aws AwsCredentials block)",
    )
    retention: RetentionConfig = Field(
        default_factory=lambda: RetentionConfig(), description="versions to keep (default: all)"
    )
    gc: bool = Field(True, description="remove the leftovers of interrupted saves")
    archive: ArchiveConfig = Field(
        default_factory=lambda: ArchiveConfig(),
        description="consolidate (and upload) the loose versions the policy says are due (default: off)",
    )
    publish: bool = Field(True, description="publish each store's checkpoint table and latest checkpoint")
    skip_missing: bool = Field(
        False,
        description="skip a store where nothing is stored yet, with a warning, instead of failing the run "
        "(the scheduled deployments set it: a store appears with its first training run; off, a "
        "mistyped URL fails the run)",
    )

    @model_validator(mode="after")
    def _valid_stores(self) -> MaintenanceConfig:
        for url in self.storages:
            self.store_config(url)
        if self.archive.upload_to and len(self.storages) > 1:
            # a mirror belongs to one store: their versions and tarballs would mix in it
            raise ValueError(
                f"archive.upload_to {self.archive.upload_to!r} would mirror {len(self.storages)} stores "
                f"({', '.join(self.storages)}), and a mirror belongs to one store: give each store its "
                "own maintenance config with its own upload_to"
            )
        return self

    def store_config(self, url: str) -> PipelineConfig:
        """The options of one store, checked like a training run's (no credentials, a real location)."""
        try:
            return PipelineConfig(
                storage=url, storage_options=self.storage_options, storage_secret=self.storage_secret
            )
        except ValidationError as exc:
            reasons = (str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
            raise ValueError("; ".join(reasons)) from None


@contextmanager
def private_storage_options(options: dict[str, Any]) -> Iterator[None]:
    """Extra fsspec options (credentials) for the stores opened in this context, never sent to Prefect."""
    token = _private_options.set(dict(options))
    try:
        yield
    finally:
        _private_options.reset(token)


def maintained_store(config: MaintenanceConfig, url: str) -> CheckpointStore:
    """The store at ``url`` with the config's options (and the private ones); not probed yet."""
    options = {**config.store_config(url).resolved_storage_options(), **(_private_options.get() or {})}
    return CheckpointStore(url, storage_options=options)


def open_maintained_store(config: MaintenanceConfig, url: str) -> CheckpointStore:
    """The store at ``url``; StorageUnavailableError when nothing is stored there (a mistyped URL)."""
    store = maintained_store(config, url)
    store.probe(must_exist=True)
    return store


@contextmanager
def holding_store(store: CheckpointStore, *, owner: str) -> Iterator[str | None]:
    """Hold the store's writer lease for the block and yield None; while another live writer
    holds the store, hold nothing and yield who it is (then nothing may be removed)."""
    held = ExitStack()
    try:
        held.enter_context(store.lease(owner=owner))
    except StoreLockedError as exc:
        holder = getattr(exc.holder, "owner", None) or "another writer"
    else:
        holder = None
    with held:
        yield holder


def active_training_runs(store: CheckpointStore) -> list[str]:
    """Names of the training flow runs in progress on this store (see the module docstring)."""
    with prefect_client() as client:
        runs = active_train_runs(client)
    return [run.name for run in on_store(runs, store)]


@task(name="apply_retention", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=exponential_backoff(1))
def apply_retention(store: CheckpointStore, policy: RetentionConfig) -> list[int]:
    """Delete the committed versions the policy does not keep (the newest is always kept)."""
    plan = store.apply_retention(policy.policy())
    get_run_logger().info("%s: %s", store.url, retention_line(policy, plan))
    return list(plan.remove)


@task(name="collect_garbage", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=exponential_backoff(1))
def collect_garbage(store: CheckpointStore) -> list[int]:
    """Remove what interrupted saves and archive jobs left; return the versions removed."""
    removed = store.collect_garbage().removed
    if removed.versions:
        get_run_logger().info(
            "%s: removed the leftovers of interrupted saves %s", store.url, removed.versions
        )
    if removed.tarballs or removed.temp_files:
        get_run_logger().info(
            "%s: removed tarballs without an index %s and temporary files %s",
            store.url,
            list(removed.tarballs),
            list(removed.temp_files),
        )
    return list(removed.versions)


@task(
    name="publish_checkpoints", cache_policy=NO_CACHE, retries=2, retry_delay_seconds=exponential_backoff(1)
)
def publish_checkpoints(store: CheckpointStore, *, source: str) -> dict[str, UUID | None]:
    """Publish the store's checkpoint table and latest checkpoint; return the artifact ids by key."""
    return publish_store(store.url, store.versions(), source=source)


__all__ = [
    "MaintenanceConfig",
    "active_training_runs",
    "apply_retention",
    "collect_garbage",
    "holding_store",
    "maintained_store",
    "open_maintained_store",
    "private_storage_options",
    "publish_checkpoints",
]
