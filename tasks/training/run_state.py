"""The live objects of one run and the steps that act on them, without Prefect.

A rank (:mod:`.rank`) calls these, in the flow's process (the in-process
trainer) or in a training process, which does not import Prefect. Either way,
the run's behaviour is the same: these functions are the one place where a run
is built, restored and trained.

- :func:`build_run` checks the config against ``run.json`` beside the
  checkpoints, builds the spec's objects and restores the newest committed
  checkpoint; only then does it write ``run.json`` (:func:`record_run_identity`).
  So a spec that fails to import, build or restore leaves the store as it was,
  and a store with no committed version never refuses a run: there is nothing
  a different configuration could spoil.
- :func:`train_attempt` trains one epoch; from the second attempt of an epoch
  on, it first puts back the state captured at the start of that epoch.
"""

from __future__ import annotations

import math
import re
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptflow.storage import (
    EPOCH_STEPS,
    IN_EPOCH,
    CheckpointStore,
    RankStateWarning,
    StateMismatchError,
    StoreOptions,
    VersionInfo,
)

from ..cadence import Cadence
from ..config import PipelineConfig, identity_differences
from .order_watch import OrderWatch

if TYPE_CHECKING:  # what trains imports torch; the flow's side of a training process does not
    from ..spec import Trainable, TrainingSpec
    from .training_state import Snapshot

RUN_FILE = "run.json"

Log = Callable[[str], None]  # where notes for the run's log go (the Prefect run logger, or the parent)


class ConfigMismatchError(ValueError):
    """A resumed run's spec, spec config or seed differs from the stored run's."""


class NothingToResumeError(ValueError):
    """``resume_only`` was asked, and the store holds no committed version."""


def nothing_to_resume(url: str) -> NothingToResumeError:
    return NothingToResumeError(
        f"nothing to resume in {url}: it holds no committed checkpoint, and resume_only "
        "(--resume-only) refuses to start a new run there. Check the storage URL (`ckptflow ls URL` "
        "lists a store), or leave resume_only out to start a new run"
    )


@dataclass
class RunState:
    """The live objects of one run in the process that trains it (one rank's)."""

    config: PipelineConfig
    store: CheckpointStore
    spec: TrainingSpec
    trainable: Trainable
    epoch: int = 0  # last completed epoch
    step: int = 0  # optimizer steps trained in all
    in_epoch: int = 0  # steps of the next epoch trained: a run that stands inside an epoch (train_steps)
    steps: Iterator[Any] | None = None  # the spec's live train_steps of the epoch in progress
    saved_at: float = field(default_factory=time.monotonic)  # when the last save started (minutes cadence)
    resumed_from: VersionInfo | None = None
    metrics: dict[int, dict[str, float]] = field(default_factory=dict)
    rng: dict[str, Any] | None = None  # the training RNG states, as the last epoch (or init) left them
    order: OrderWatch | None = None  # the data-order trap, watched over each epoch's first steps
    planned_epochs: int = 0  # the epochs the run was started for (RunFacts.planned_epochs)
    generator_seeds: dict[int, int] | None = None  # the spec's generators' seeds after build; None: checked
    identity: dict[str, Any] | None = None  # what run.json must hold (None: it does already)

    def local(self) -> tuple[TrainingSpec, Trainable]:
        """The spec and its objects."""
        return self.spec, self.trainable


def open_store(
    config: PipelineConfig, storage_options: dict[str, Any] | None = None, *, distributed: Any = None
) -> CheckpointStore:
    """The run's store; ``storage_options`` default to the config's, credentials resolved.

    ``distributed``: a rank's :class:`~ckptflow.storage.RankGroup` (every rank writes a share).
    """
    options = config.resolved_storage_options() if storage_options is None else storage_options
    shards = StoreOptions(shards=config.shards, dedup=config.dedup)
    return CheckpointStore(config.storage, storage_options=options, options=shards, distributed=distributed)


def check_run_identity(store: CheckpointStore, config: PipelineConfig, warn: Log) -> dict[str, Any] | None:
    """Compare the config with ``run.json`` beside the checkpoints; writes nothing.

    Returns the identity to record once the run is built (:func:`record_run_identity`), or None
    when ``run.json`` already holds it. Raises ConfigMismatchError for a changed identity on a
    store with committed versions, unless ``allow_config_change`` (then it warns).
    """
    stored = store.read_json(RUN_FILE)
    current = config.identity()
    if stored is None:
        return current
    diffs = identity_differences(stored, current)
    if not diffs:
        return None
    if store.latest() is None:  # nothing committed under the old identity: nothing to protect
        return current
    if not config.allow_config_change:
        raise ConfigMismatchError(
            f"{store.url} holds a run with a different configuration: {'; '.join(diffs)}. "
            "Resuming would make a different run: use a new storage URL, or set "
            "allow_config_change=true (--allow-config-change) to resume anyway"
        )
    warn(f"resuming with a changed configuration: {'; '.join(diffs)}")
    return current


def check_durable_run(
    store: CheckpointStore, durable: CheckpointStore, config: PipelineConfig, warn: Log
) -> None:
    """Before a run with an empty store resumes from its durable tier ``durable`` (``upload_to``):
    refuse (ConfigMismatchError) one that holds another run, one with a different configuration or
    checkpoints that no ckptflow run wrote (no ``run.json`` there), as such a store is refused."""
    if store.latest() is not None or durable.latest() is None:
        return
    if durable.read_json(RUN_FILE) is None:
        raise ConfigMismatchError(
            f"not resuming {store.url} from {durable.url}: it holds checkpoints that no ckptflow run "
            "wrote (no run.json there): another store's. Give --upload-to a URL of its own"
        )
    check_run_identity(durable, config, warn)


def record_run_identity(store: CheckpointStore, identity: dict[str, Any] | None) -> None:
    """Write ``run.json`` (after the run was built and restored); None: it is up to date."""
    if identity is not None:
        store.write_json(RUN_FILE, identity)


def build_run(
    config: PipelineConfig,
    store: CheckpointStore,
    *,
    info: Log,
    warn: Log,
    writes: bool = True,
    world_size: int = 1,
    rank: int = 0,
) -> RunState:
    """Build the spec's objects; restore the newest committed checkpoint if there is one.

    ``writes=False`` (a training process started before its flow holds the store's lease):
    change nothing in the store; the flow calls :func:`claim_store` once it holds the lease.
    Either way the run resumes from the same version: setting unreadable versions aside
    only moves versions that resuming skips.

    In a rank of a world of ``world_size`` > 1 (``store`` distributed), every rank builds the
    same model and restores the replicated state, then its own state (see :mod:`.rank_worker`).
    """
    from ..spec import RunFacts, load_spec_class, make_spec
    from .training_state import (
        capture,
        generator_seeds,
        is_sharded,
        rank_seed,
        restore,
        rng_state,
        seed_everything,
        split_ranked,
    )

    load_spec_class(config.spec)
    identity = check_run_identity(store, config, warn)
    facts = RunFacts(
        epochs=config.epochs,
        planned_epochs=planned_epochs(config, store.latest(), warn),
        save_every=config.save_every,
        save_every_steps=config.save_every_steps,
        save_every_minutes=config.save_every_minutes,
        world_size=world_size,
        rank=rank,
        storage=store.url,
    )
    spec = make_spec(config.spec, config.spec_config, seed=config.seed, run=facts)
    seed_everything(config.seed)  # every rank builds the same model
    run = RunState(config, store, spec, spec.build(), planned_epochs=facts.planned_epochs)
    run.generator_seeds = generator_seeds(spec) if rank == 0 else None  # rank 0 warns of what saves miss
    if writes:
        set_aside_unreadable(store, warn)
    latest = store.latest()
    reseed_epoch: int | None = 0
    if latest is not None:
        spec, trainable = run.local()
        into = capture(trainable, spec, epoch=0, step=0)  # read the model straight into its tensors
        sharded = is_sharded(trainable.model)
        saved_by = len(store.manifest(latest.version).ranks) or 1
        if sharded or saved_by > 1:  # the shared part only: the ranks' own states are apart (below)
            into, _ = split_ranked(into)
        state = store.load(latest.version, into=into)
        if world_size > 1 or sharded:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RankStateWarning)
                own = store.load_rank_state(latest.version)
            own = own if own is not None else {k: state.pop(k) for k in ("rng", "spec") if k in state}
            state.update(own)
        elif "rng" not in state and saved_by > 1:  # saved by several ranks: their own states are apart
            warn(f"version {latest.version} was saved by {saved_by} ranks: resuming with rank 0's RNG state")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RankStateWarning)
                state.update(store.load_rank_state(latest.version, rank=0, world_size=1) or {})
        _check_saved_parts(latest.version, store.url, capture(trainable, spec, epoch=0, step=0), state, warn)
        try:
            run.epoch, run.step, run.in_epoch = restore(trainable, spec, state)
        except (RuntimeError, ValueError) as exc:
            if not _does_not_fit(exc):
                raise
            built = capture(trainable, spec, epoch=0, step=0)
            raise _misfit(latest.version, store.url, exc, state, built) from None
        reseed_epoch = run.epoch if saved_by != world_size else None
        run.resumed_from = latest
        run.metrics = {v.epoch: v.metrics for v in store.versions() if v.epoch is not None and not v.in_epoch}
        where = f"step {run.in_epoch} of epoch {run.epoch + 1}" if run.in_epoch else f"epoch {run.epoch}"
        info(f"resuming from {latest.url} ({where})")
    elif config.resume_only:
        raise nothing_to_resume(store.url)
    else:
        info(f"starting a new run in {store.url}: no committed checkpoint there (resume_only refuses this)")
    if reseed_epoch is not None and rank > 0:  # this rank's own RNG state was not saved
        seed_everything(rank_seed(config.seed, reseed_epoch, rank))
    run.rng = rng_state()
    run.identity = identity
    if writes:
        record_run_identity(store, identity)
    return run


SAVED_BY_EVERY_RUN = ("model", "spec", "rng", "progress")  # what capture() writes whatever the spec builds


def _check_saved_parts(
    version: int, url: str, wanted: Mapping[str, Any], saved: Mapping[str, Any], warn: Log
) -> None:
    """Refuse to resume from a version that lacks what every ckptflow save holds (a library save
    into the run's store, another program's version), naming what it lacks, rather than fail in
    the restore. The parts a spec may gain after a save (optimizer, scheduler, scaler, extras)
    start fresh where the version lacks them: a warning names them."""
    missing = [k for k in wanted if k != "extras" and k not in saved]
    extras = saved.get("extras")
    extras = extras if isinstance(extras, Mapping) else {}
    missing += [f"extras.{k}" for k in wanted.get("extras", {}) if k not in extras]
    if any(k in missing for k in SAVED_BY_EVERY_RUN):
        raise StateMismatchError(
            f"version {version} of {url} does not hold what this run saves (it lacks "
            f"{', '.join(missing)}): it was not saved by a ckptflow run of this spec, e.g. a library "
            f"save into the run's store. Remove it (CheckpointStore(url).delete({version})) to resume "
            "from the version before it, or start the run in a new storage URL"
        )
    if missing:
        starts = "it starts" if len(missing) == 1 else "they start"
        warn(
            f"version {version} holds no saved state for {', '.join(missing)} (added to the spec "
            f"since it was saved?): {starts} fresh, as build() made it"
        )


PLANNED_EPOCHS = "planned_epochs"  # in each manifest's user data: the epochs its run was started for


def planned_epochs(config: PipelineConfig, latest: VersionInfo | None, warn: Log) -> int:
    """The epochs the run was started for: what the newest version records (so every resume keeps
    it), or, for a new run, its own target."""
    if latest is None:
        return config.epochs
    recorded = latest.user.get(PLANNED_EPOCHS)
    if isinstance(recorded, int) and recorded >= 1:
        return recorded
    warn(
        f"version {latest.version} does not record the epochs its run was started for (an older "
        f"ckptflow saved it): RunFacts.planned_epochs is this run's target, {config.epochs}"
    )
    return config.epochs


def _misfit(
    version: int, url: str, exc: BaseException, saved: Mapping[str, Any], built: Mapping[str, Any]
) -> StateMismatchError:
    """A saved state torch refused, in a few lines: the keys and shapes that differ, and what to do."""
    from .training_state import state_differences

    extras = saved.get("extras") or {}
    parts = [("model", saved.get("model"), built.get("model"))]
    parts += [(f"extras.{k}", extras.get(k), v) for k, v in built.get("extras", {}).items()]
    lines = [
        f"  {name}: {line}"
        for name, old, new in parts
        if isinstance(old, Mapping) and isinstance(new, Mapping)
        for line in state_differences(old, new)
    ]
    if not lines:  # not a module's keys or shapes (an optimizer's parameter groups): torch's first line
        lines = ["  " + (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]]
    return StateMismatchError(
        "\n".join(
            [
                f"version {version} of {url} does not fit the model the spec builds:",
                *lines,
                "Build the model as it was saved (the same code and spec_config), or train the changed "
                "model in a new storage URL.",
            ]
        )
    )


def _does_not_fit(exc: BaseException) -> bool:
    """Whether torch refused a saved state for the objects it was to go into (a module's keys or
    shapes, an optimizer's parameter groups), rather than failing for another reason."""
    text = str(exc)
    if isinstance(exc, RuntimeError):
        return text.startswith("Error(s) in loading state_dict")
    return text.startswith("loaded state dict")


def claim_store(store: CheckpointStore, identity: dict[str, Any] | None, warn: Log) -> None:
    """What a run built with ``writes=False`` leaves to its flow, which holds the lease: set the
    unreadable versions aside and record the run's identity."""
    set_aside_unreadable(store, warn)
    record_run_identity(store, identity)


def set_aside_unreadable(store: CheckpointStore, warn: Log) -> None:
    """Move aside the unreadable versions above the newest readable one (a run resumes from that).

    A tarball whose index cannot be read stops the run instead: its versions may be the newest.
    """
    for version, where, error in store.set_aside_unreadable():
        reason = " ".join(str(error).split())
        warn(f"version {version} is unreadable ({reason}): moved aside to {where}; resuming before it")


class EpochAttempts:
    """Tracks attempts of one stretch of training (an epoch, or its steps up to a save point) in the
    process that trains it; from the second on, the start state (kept by the first, with
    ``keep_snapshot``) is restored first. ``done``: its last attempt trained through.

    ``saved``: a stretch that starts where a save was just made restores that save instead (it
    holds the same state), so no second copy of the state is made at every save point."""

    def __init__(
        self, run: RunState, *, keep_snapshot: bool, saved: Callable[[], None] | None = None
    ) -> None:
        self.snapshot: Snapshot | None = None
        self.keep_snapshot = keep_snapshot
        self.epoch = run.epoch + 1
        self.done = False
        self.saved = saved if keep_snapshot else None
        if keep_snapshot and saved is None:
            from .training_state import Snapshot

            spec, trainable = run.local()
            where = {"epoch": run.epoch, "step": run.step, "in_epoch": run.in_epoch}
            self.snapshot = Snapshot(trainable, spec, **where, rng=run.rng)
        self.count = 0


@dataclass(frozen=True)
class Stretch:
    """How a stretch of training ended: the epoch's metrics at its end (None: paused inside it,
    at a save point or a stop), whether a stop was asked, whether a step or minute save fell due
    (at an epoch's end: in its last step, or in a spec that trains whole epochs)."""

    metrics: dict[str, float] | None
    stopped: bool = False
    due: bool = False


Pause = Callable[["RunState"], tuple[bool, bool]]  # after a step: (a save is due, a stop was asked)


def train_attempt(
    run: RunState,
    epoch: int,
    attempts: EpochAttempts,
    warn: Log,
    *,
    pause: Pause | None = None,
    until: int | None = None,
) -> Stretch:
    """Attempt ``attempts.count`` of ``epoch`` from where the run stands: to the epoch's end, or,
    for a spec that trains by steps, to the first step after which ``pause`` says a save is due or
    a stop was asked (``until``: exactly to that global step, or the epoch's end)."""
    from ..spec import trains_by_steps
    from .training_state import run_epoch

    spec, trainable = run.local()
    if attempts.count > 1:
        run.steps = None
        if attempts.saved is not None:
            attempts.saved()  # the save the stretch started at: the same state, bit for bit
        elif attempts.snapshot is not None:
            run.epoch, run.step, run.in_epoch = attempts.snapshot.restore(trainable, spec)
        else:
            raise RuntimeError(f"epoch {epoch} cannot be retried: no start state was kept")
        from .training_state import rng_state

        run.rng = rng_state()
        where = f"step {run.in_epoch} of epoch {epoch}" if run.in_epoch else f"epoch {epoch}"
        warn(f"retrying from the start state of {where} (attempt {attempts.count})")
    if trains_by_steps(spec):
        return _train_steps(run, epoch, pause, until)
    before = run.step
    clean, steps, run.rng = run_epoch(spec, trainable, epoch, run.rng)
    run.epoch, run.step = epoch, run.step + steps
    run.metrics[epoch] = clean
    due = Cadence.of(run.config).steps_due(before, run.step)  # a step save fell due in the epoch
    if pause is not None:
        timed, stopped = pause(run)
        return Stretch(clean, stopped=stopped, due=due or timed)
    return Stretch(clean, due=due)


def _train_steps(run: RunState, epoch: int, pause: Pause | None, until: int | None) -> Stretch:
    """Drive the spec's ``train_steps`` (its live generator, or a new one from ``run.in_epoch``)."""
    from .training_state import rng_state, set_rng_state

    spec, trainable = run.local()
    if run.rng is not None:  # what ran since the last step (a save, Prefect's threads) draws nothing here
        set_rng_state(run.rng)
    if run.steps is None:
        if run.order is None:
            run.order = OrderWatch(trainable)
        run.order.epoch_begins()
        run.steps = iter(spec.train_steps(trainable, epoch, run.in_epoch))
    length = spec.steps_per_epoch(epoch)
    due_at_end = False
    try:
        while True:
            next(run.steps)
            run.step += 1
            run.in_epoch += 1
            if run.order is not None:
                run.order.stepped()
            if until is not None:
                if run.step >= until:
                    break
                continue
            due, stopped = pause(run) if pause is not None else (False, False)
            if stopped or (due and run.in_epoch != length):
                run.rng = rng_state()
                return Stretch(None, stopped=stopped, due=due)
            due_at_end = due_at_end or due  # at the epoch's last step: saved at its end
    except StopIteration as end:
        metrics = dict(end.value or {})
    except BaseException:
        run.steps = None  # a generator that raised is finished: a retry starts a new one
        raise
    else:  # reached ``until`` inside the epoch
        run.rng = rng_state()
        return Stretch(None)
    run.steps = None
    metrics.update(spec.evaluate(trainable, epoch))
    run.rng = rng_state()
    metrics.pop("steps", None)
    clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(v)}
    run.epoch, run.in_epoch = epoch, 0
    run.metrics[epoch] = clean
    return Stretch(clean, due=due_at_end)


def restore_committed(run: RunState, version: int, *, ranked: bool) -> None:
    """Put the run back where committed ``version`` stands (a save this run made: the same spec and
    ranks): its state read straight into the live tensors; ``ranked``: this rank's own state from
    its own file."""
    from .training_state import capture, is_sharded, restore, split_ranked

    spec, trainable = run.local()
    into = capture(trainable, spec, epoch=0, step=0)
    if is_sharded(trainable.model):
        into, _ = split_ranked(into)
    state = run.store.load(version, into=into)
    if ranked:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RankStateWarning)
            state.update(run.store.load_rank_state(version) or {})
    run.epoch, run.step, run.in_epoch = restore(trainable, spec, state)


def capture_run(run: RunState, warn: Log | None = None) -> dict[str, Any]:
    """The state to checkpoint now (references to live tensors), with the RNGs of the last epoch.

    The first capture of a run given ``warn`` (on rank 0) warns of the spec's generators it
    leaves out.
    """
    from .training_state import capture, unsaved_generators

    spec, trainable = run.local()
    state = capture(trainable, spec, epoch=run.epoch, step=run.step, in_epoch=run.in_epoch, rng=run.rng)
    if warn is not None and run.generator_seeds is not None:
        seeds, run.generator_seeds = run.generator_seeds, None
        lost = unsaved_generators(spec, state, seeds, epoch=run.epoch + (1 if run.in_epoch else 0))
        if lost:
            warn(_unsaved_generators_note(lost))
    return state


def _unsaved_generators_note(lost: list[list[str]]) -> str:
    named = "; ".join(p[0] + (f" (also {', '.join(p[1:])})" if p[1:] else "") for p in lost)
    path = lost[0][0]
    key = re.sub(r"\W+", "_", path.removeprefix("self.")).strip("_")
    return (
        f"the spec keeps a torch.Generator that its checkpoints do not restore: {named}. A resumed "
        "run would draw from it as build() left it, unlike the run that never stopped: put it in "
        f'Trainable.extras (extras={{"{key}": {path}, ...}}), or make it afresh each epoch with '
        "epoch_generator(self.seed, epoch)"
    )


def save_options(run: RunState, version: int | None) -> dict[str, Any]:
    """The arguments of the save of where the run stands, as ``version`` (None: the next number
    above every version), whichever process saves it. A save inside an epoch records the epoch in
    progress, and the steps of it trained (``in_epoch``), and no metrics."""
    user: dict[str, Any] = {PLANNED_EPOCHS: run.planned_epochs}
    epoch, metrics = run.epoch, run.metrics.get(run.epoch)
    if run.in_epoch:
        epoch, metrics = run.epoch + 1, None
        user[IN_EPOCH] = run.in_epoch
        length = run.spec.steps_per_epoch(epoch)
        if length:
            user[EPOCH_STEPS] = length
    from .lineage import run_lineage

    kwargs = {"epoch": epoch, "step": run.step, "metrics": metrics, "version": version, "user": user}
    return {**kwargs, "lineage": run_lineage(run.config)}
