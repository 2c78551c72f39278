"""``ckptflow check``: whether a spec resumes bitwise, found out in seconds instead of after a crash.

A spec keeps its side of the contract (``tasks/spec.py``) or a resumed run drifts
from one that never stopped, silently. The check trains the spec twice in fresh
stores, saving after every step (a spec with ``train_steps``) or every epoch:

- straight through, in one set of training processes;
- with stops: at a step inside the first epoch and at one inside the second (or,
  for a spec that trains whole epochs, at the first epoch's end). At each stop the
  training processes end, and new ones build the spec, restore the newest version
  and go on: the resume ckptflow makes after a crash or a preemption.

Then it compares, bitwise, every leaf the two runs saved at each step: model,
optimizer, scheduler, scaler, ``extras``, the spec's own state, the RNG states and
the position. It names the leaves that differ at the end, the first step where they
differ, and the likely cause. It needs no Prefect: the trainers are the pipeline's
own (``ProcessTrainer``, at any ``nproc``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptflow.storage import CheckpointStore

from ..config import PipelineConfig
from ..spec import load_spec_class, trains_by_steps
from .protocol import Notes, Progress

Log = Callable[[str], None]
DATA_ORDER_TRAP = "drew this epoch's order"  # in the warning of tasks/training/run_state.py
MAX_NAMED = 12  # leaves named in the report; the rest are counted
DEFAULT_EPOCHS = 2


@dataclass(frozen=True)
class Position:
    """Where a saved version stands: the last epoch completed, the steps of the next one, the
    steps in all."""

    epoch: int
    in_epoch: int
    step: int

    @classmethod
    def of(cls, progress: Progress) -> Position:
        return cls(progress.epoch, progress.in_epoch, progress.step)

    @property
    def order(self) -> tuple[int, int]:
        """Training order: the last step of an epoch comes before the epoch's end, which has the
        same step count."""
        return (self.step, self.epoch)

    def text(self) -> str:
        if self.in_epoch:
            return f"step {self.step} (step {self.in_epoch} of epoch {self.epoch + 1})"
        return f"step {self.step} (the end of epoch {self.epoch})"


@dataclass
class CheckReport:
    """What :func:`check_resume` found (``passed``: every leaf the same at every step)."""

    spec: str
    world_size: int
    trained: Position  # where both runs ended
    stops: list[Position]  # where the resumed run was stopped and resumed
    leaves: int  # leaves of the final state
    differences: list[str] = field(default_factory=list)  # leaves of the final state that differ
    first: Position | None = None  # the first saved position whose state differs
    first_differences: list[str] = field(default_factory=list)  # the leaves that differ there
    cause: str | None = None
    seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)  # what the training processes warned of

    def to_json(self) -> dict[str, Any]:
        """The report as JSON (``ckptflow check --json``)."""
        return {
            "passed": self.passed,
            "spec": self.spec,
            "world_size": self.world_size,
            "trained": dataclasses.asdict(self.trained),
            "stops": [dataclasses.asdict(p) for p in self.stops],
            "leaves": self.leaves,
            "differences": self.differences,
            "first": dataclasses.asdict(self.first) if self.first is not None else None,
            "first_differences": self.first_differences,
            "cause": self.cause,
            "warnings": self.warnings,
            "seconds": round(self.seconds, 3),
        }

    @property
    def trap_warned(self) -> bool:
        return any(DATA_ORDER_TRAP in w for w in self.warnings)

    @property
    def passed(self) -> bool:
        return self.first is None and not self.differences

    def text(self) -> str:
        where = ", ".join(p.text() for p in self.stops) or "nowhere (too few steps to stop inside)"
        processes = "1 process" if self.world_size == 1 else f"{self.world_size} processes"
        head = (
            f"{self.spec}, {processes}: trained to {self.trained.text()} straight through and with stops "
            f"at {where}, each resumed in new training processes ({self.seconds:.1f}s)"
        )
        if self.passed:
            return f"{head}\nPASS: all {self.leaves} leaves of every saved state are bitwise the same"
        lines = [head]
        if self.differences:
            lines.append(
                f"FAIL: {len(self.differences)} of {self.leaves} leaves of the final state differ: "
                + _named(self.differences)
            )
        else:
            lines.append("FAIL: the final states are the same, but states saved on the way differ")
        if self.first is not None:
            lines.append(f"first difference at {self.first.text()}: {_named(self.first_differences)}")
        if self.cause:
            lines.append(f"likely cause: {self.cause}")
        return "\n".join(lines)


def check_resume(
    spec: str,
    spec_config: Mapping[str, Any] | None = None,
    *,
    nproc: int = 1,
    steps: int | None = None,
    epochs: int = DEFAULT_EPOCHS,
    seed: int = 0,
    stops: Sequence[int] | None = None,
    draw: int | None = None,
    log: Log | None = None,
) -> CheckReport:
    """Check that ``spec`` resumes bitwise (see the module's docstring); the report says how.

    ``steps``: train only so many optimizer steps in all (default: ``epochs`` whole epochs);
    ``stops``: the steps to stop and resume at (default: drawn at random, ``draw`` seeding the
    draw, one inside the first epoch and one inside the second). A spec that cannot be built or
    trained raises as a run would.
    """
    began = time.monotonic()
    say = log or (lambda message: None)
    kind = load_spec_class(spec)
    by_steps = trains_by_steps(kind)
    scratch = Path(tempfile.mkdtemp(prefix="ckptflow-check-"))
    try:

        def config(name: str) -> PipelineConfig:
            return PipelineConfig(
                storage=str(scratch / name),
                spec=spec,
                spec_config=dict(spec_config or {}),
                seed=seed,
                epochs=epochs,
                save_every_steps=1 if by_steps else None,
                nproc=nproc,
                train_process=True,
                async_save=False,
                shards=1,
            )

        unit = "step" if by_steps else "epoch"
        say(f"training {spec} straight through, saving every {unit}, in {nproc} process(es)")
        warnings: list[str] = []
        train = functools.partial(_train, by_steps=by_steps, limit=steps, say=say, warnings=warnings)
        straight, _ = train(config("straight"), stops=())
        end = max(straight, key=lambda p: p.order)
        chosen = (
            sorted(set(stops)) if stops is not None else _draw_stops(straight, by_steps, random.Random(draw))
        )
        chosen = [s for s in chosen if 0 < s < end.step]
        say(f"training again, stopped and resumed at step(s) {', '.join(map(str, chosen)) or 'none'}")
        resumed, stopped = train(config("resumed"), stops=chosen)
        report = _compare(
            CheckpointStore(scratch / "straight"), straight, CheckpointStore(scratch / "resumed"), resumed
        )
        report.spec, report.world_size, report.trained, report.warnings = spec, nproc, end, warnings
        report.stops = stopped
        report.cause = None if report.passed else _cause(report, by_steps)
        report.seconds = time.monotonic() - began
        return report
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# -- the two runs ----------------------------------------------------------------------------------


def _train(
    config: PipelineConfig,
    *,
    by_steps: bool,
    limit: int | None,
    stops: Sequence[int],
    say: Log,
    warnings: list[str],
) -> tuple[dict[Position, int], list[Position]]:
    """Train ``config``'s run, saving after every stretch (each step, or each epoch); at each step of
    ``stops``, end the training processes and resume in new ones. The positions saved, with their
    versions, and those it stopped and resumed at."""
    from .trainer import ProcessTrainer

    notes = _notes(say, warnings)
    saved: dict[Position, int] = {}
    stopped: list[Position] = []
    pending = sorted(stops)
    trainer = ProcessTrainer.take(config)
    try:
        trainer.build(flow_run=None, log=notes)
        while True:
            progress = trainer.progress
            if (limit is not None and progress.step >= limit) or (
                progress.epoch >= config.epochs and not progress.in_epoch
            ):
                break
            until = progress.step + 1 if by_steps else None  # one step, or the whole epoch
            trainer.train(progress.epoch + 1, keep_snapshot=False, log=notes, until=until)
            version = len(saved)
            trainer.save(version, log=notes).wait()
            at = Position.of(trainer.progress)
            saved[at] = version
            if pending and at.step >= pending[0]:
                pending = [s for s in pending if s > at.step]
                stopped.append(at)
                trainer.stop()  # the processes end here; new ones restore what was just committed
                trainer = ProcessTrainer.take(config)
                built = trainer.build(flow_run=None, log=notes)
                resumed = built.resumed_from
                if resumed is None or resumed.version != version:
                    raise RuntimeError(
                        f"the new training processes resumed from {resumed}, not version {version}"
                    )
    finally:
        trainer.stop()
    return saved, stopped


def _notes(say: Log, warnings: list[str]) -> Notes:
    """What the trainers note: warnings and errors are the user's to see (and kept); the rest is the
    check's own business."""

    def noted(level: str, message: str) -> None:
        if level in ("warning", "error") and message not in warnings:
            warnings.append(message)
            say(f"{level}: {message}")

    return noted


def _draw_stops(saved: Mapping[Position, int], by_steps: bool, draw: random.Random) -> list[int]:
    """One step inside the first epoch and one inside the second (a spec that trains by steps), or
    the first epoch's end (one that trains whole epochs)."""
    ends = sorted(p.step for p in saved if p.in_epoch == 0)
    if not by_steps:
        return ends[:1] if len(ends) > 1 else []
    inside = sorted(p.step for p in saved if p.in_epoch)
    first_end = ends[0] if ends else math.inf
    chosen = []
    first = [s for s in inside if s < first_end]
    if first:
        chosen.append(draw.choice(first))
    second = [s for s in inside if s > first_end and (len(ends) < 2 or s < ends[1])]
    if second:
        chosen.append(draw.choice(second))
    return chosen


# -- the comparison --------------------------------------------------------------------------------


def _compare(
    left: CheckpointStore, straight: dict[Position, int], right: CheckpointStore, resumed: dict[Position, int]
) -> CheckReport:
    common = sorted(set(straight) & set(resumed), key=lambda p: p.order)
    report = CheckReport(spec="", world_size=1, trained=common[-1], stops=[], leaves=0)
    for position in common:
        a, b = _leaves(left, straight[position]), _leaves(right, resumed[position])
        differing = _differing(a, b)
        if differing and report.first is None:
            report.first, report.first_differences = position, differing
        if position == common[-1]:
            report.leaves, report.differences = len(a), differing
    missing = sorted(set(straight) ^ set(resumed), key=lambda p: p.order)
    if missing and report.first is None:  # one run saved where the other did not: its steps differ
        report.first, report.first_differences = missing[0], ["progress"]
    return report


def _leaves(store: CheckpointStore, version: int) -> dict[str, Any]:
    """Every leaf a version holds, by path: the shared state, each rank's own, and the metrics its
    manifest records (an epoch's, which the spec computed from what it accumulated)."""
    manifest = store.manifest(version)
    world = manifest.world_size
    found = dict(_flat(store.load(version), ""))
    found.update((f"metrics/{name}", value) for name, value in manifest.metrics.items())
    for rank in range(world):
        own = store.load_rank_state(version, rank=rank, world_size=world)
        if own is not None:
            found.update(_flat(own, f"rank {rank}/" if world > 1 else ""))
    return found


def _flat(node: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(node, Mapping):
        for key, value in node.items():
            yield from _flat(value, f"{prefix}{key}/")
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            yield from _flat(value, f"{prefix}{i}/")
    else:
        yield prefix.rstrip("/") or "<root>", node


def _differing(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    return [
        path
        for path in sorted(set(a) | set(b))
        if path not in a or path not in b or not _same(a[path], b[path])
    ]


def _same(a: Any, b: Any) -> bool:
    """Bitwise for tensors (NaNs of the same bits are the same), exact for everything else."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return bool(torch.equal(_bits(a), _bits(b)))
    if type(a).__module__ == "numpy" or type(b).__module__ == "numpy":  # arrays, numpy scalars
        return type(a) is type(b) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return type(a) is type(b) and a == b


def _bits(tensor: Any) -> Any:
    import torch

    flat = tensor.detach().cpu().contiguous().reshape(-1)
    with contextlib.suppress(RuntimeError):  # a dtype whose bytes cannot be viewed: its values
        return flat.view(torch.uint8)
    return flat


# -- why --------------------------------------------------------------------------------------------


def _cause(report: CheckReport, by_steps: bool) -> str:
    """The likely cause of a difference, from where it first shows and what differs there."""
    first, leaves = report.first, report.first_differences
    stops = [s for s in report.stops if first is not None and s.step < first.step]
    if first is None:
        return "the final states differ although every saved state on the way was the same"
    if not stops:
        return (
            "the runs differ before any stop, so training is not deterministic: a nondeterministic op "
            "(torch.use_deterministic_algorithms(True) names it), or randomness drawn from a source the "
            "checkpoint does not hold (a generator outside Trainable.extras, time, an unseeded library)"
        )
    resumed_at = stops[-1]
    roots = {leaf.split("/")[1] if leaf.startswith("rank ") else leaf.split("/")[0] for leaf in leaves}
    after = f"after the resume at {resumed_at.text()}"
    if roots <= {"spec", "metrics"}:
        return (
            f"only the spec's own state or the epoch's metrics differ {after}: something the spec "
            "accumulates is missing from its state_dict() or is not put back by load_state_dict() (a "
            "running sum, a counter)"
        )
    if resumed_at.in_epoch and by_steps:
        trap = (
            " A DataLoader shuffles with a generator kept in Trainable.extras (the run warned of it): "
            "the epoch's order was drawn before the save, so the resumed run draws another order from "
            "the restored generator."
            if report.trap_warned
            else ""
        )
        return (
            f"the steps {after} trained on other data, or skipped the wrong number of batches.{trap} "
            "Make the epoch's order from (seed, epoch) alone (epoch_generator(self.seed, epoch), re-made "
            "each epoch) or use torchdata's StatefulDataLoader in extras; and skip `start` optimizer "
            "steps, which is start * accumulation batches when gradients are accumulated"
        )
    return (
        f"the state differs {after}: something training depends on is not in the checkpoint (an "
        "object or generator outside Trainable.extras, a plain attribute of the spec set during "
        "training)"
    )


def _named(leaves: Sequence[str]) -> str:
    shown = ", ".join(leaves[:MAX_NAMED])
    return shown + (f" (and {len(leaves) - MAX_NAMED} more)" if len(leaves) > MAX_NAMED else "")


__all__ = ["CheckReport", "Position", "check_resume"]
