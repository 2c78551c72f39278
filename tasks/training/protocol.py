"""The trainer protocol: what the flow asks of the ranks that train its run, and what they answer.

The flow's tasks drive a :class:`Trainer` (build, train, save, wait, stop) and never ask which
kind they hold. Two kinds exist, chosen once, when the run is built (``train_process``):
:class:`~.in_process.InProcessTrainer` (the flow's own process: a debugger sees the epoch) and
:class:`~.trainer.ProcessTrainer` (a torch.distributed world of N >= 1 ranks in processes of
their own). Both carry every request out on the same object, a :class:`~.rank.Rank`; the
process kind sends it across a socket as the JSON of the models here.

What must always hold:

- What crosses the process boundary is a model of this module, validated where it enters: the
  job (:class:`TrainerJob`) when the launcher or a rank reads it, a request (:class:`Call`)
  when a rank reads it, a reply when the flow reads it. Nothing is unpickled.
- Every answer carries the run's progress (:class:`Progress`), read when the answer is sent:
  the flow knows where its run stands from the last answer it got, and keeps no copy of it.
- An error crosses as its own type (:class:`RemoteError`): every ``CheckpointError`` of ckptflow
  and the pipeline's own refusals (a spec that does not import, a changed configuration,
  nothing to resume) are raised again in the flow as the same class with the same message and
  attributes (and cause); a ``CheckpointError`` of a class the flow does not know as its
  nearest known base class, its message led by its own class's name; any other error as a
  :class:`TrainerError` that names its type and the line that raised it.
- The save mode is the run's config's (``async_save``), fixed when the run is built: a save
  request carries the version number alone, and saves where the run stands.
- A stretch of training ends at the epoch's end, or, for a spec that trains by steps, at a
  save point or a stop inside it (:class:`Trained` says which); where it stands is the
  progress of the answer.

No torch and no Prefect here: both sides import this module.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable
from typing import Annotated, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from ckptflow.storage import CheckpointError, CheckpointStore, VersionInfo

from ..config import PipelineConfig
from .compat import add_note

Notes = Callable[[str, str], None]  # where a trainer's notes for the run's log go: (level name, message)
Level = Literal["debug", "info", "warning", "error"]


class TrainerDiedError(RuntimeError):
    """The training process exited before answering; what it committed before is intact."""


class TrainerError(RuntimeError):
    """An error raised in the training process that is not one of ckptflow's own types (its type
    and message; its traceback as a note).

    ``kind``: the error's own type name; ``place``: the file and line that raised it.
    """

    def __init__(self, message: str, *, kind: str = "", place: str = "") -> None:
        super().__init__(message)
        self.kind = kind
        self.place = place


class JobError(ValueError):
    """The job a trainer was given is not a valid :class:`TrainerJob`."""


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# -- the job --------------------------------------------------------------------------------------


class TrainerJob(_Message):
    """What the ranks of a run are given once: the run's config (their world too: ``nproc``,
    ``nnodes``, the rendezvous, the backend), the store's resolved options (credentials included:
    the job travels on the launcher's stdin and the ranks' private store, never in an argument or
    the environment), and the processes whose writer lease they commit under."""

    config: PipelineConfig
    storage_options: dict[str, Any] = Field(default_factory=dict, repr=False)
    writers: list[int] = Field(default_factory=list)  # pids holding the store's lease for the ranks

    @classmethod
    def for_run(
        cls, config: PipelineConfig, storage_options: dict[str, Any], *, writers: list[int]
    ) -> TrainerJob:
        return cls(config=config, storage_options=storage_options, writers=writers)

    @classmethod
    def parse(cls, raw: bytes | str) -> TrainerJob:
        """The job in ``raw`` (JSON); :class:`JobError` names every field that is wrong."""
        try:
            return cls.model_validate_json(raw)
        except ValidationError as exc:
            raise JobError(f"the trainers' job is malformed ({problems(exc)}): nothing was built") from None


def problems(exc: ValidationError) -> str:
    """What is wrong with a message, one ``field: problem`` for each wrong field."""
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'the message'}: {e['msg']}" for e in exc.errors())


# -- progress and replies ----------------------------------------------------------------------


class Progress(_Message):
    """Where the run stands: the last epoch trained (0: none yet), the optimizer steps so far, and
    the steps of the next epoch trained (0: at an epoch's end) of its ``epoch_steps`` (if known)."""

    epoch: int = Field(0, ge=0)
    step: int = Field(0, ge=0)
    in_epoch: int = Field(0, ge=0)
    epoch_steps: int | None = None

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, in_epoch): where the run stands, in training order."""
        return self.epoch, self.in_epoch


class Built(_Message):
    """The run is built, restored from ``resumed_from`` if a version was committed."""

    kind: Literal["built"] = "built"
    resumed_from: VersionInfo | None = None
    metrics: dict[int, dict[str, float]] = Field(default_factory=dict)  # the committed epochs' metrics
    planned_epochs: int = Field(ge=1)
    identity: dict[str, Any] | None = None  # what run.json must hold (None: it does already)
    threads: int = Field(ge=1)  # torch's intra-op threads in each rank
    world_size: int = Field(1, ge=1)


class Trained(_Message):
    """A stretch of training ended: at the epoch's end (its ``metrics``), or inside it (None), at a
    save point or, ``stopped``, at a stop; ``due``: a step or minute save fell due."""

    kind: Literal["trained"] = "trained"
    metrics: dict[str, float] | None
    stopped: bool = False
    due: bool = False


class Staged(_Message):
    """A save has started: its state is copied (async) or being written (sync); :class:`Wait` for it."""

    kind: Literal["staged"] = "staged"
    version: int


class Committed(_Message):
    kind: Literal["committed"] = "committed"
    info: VersionInfo


class Done(_Message):
    kind: Literal["done"] = "done"


# -- requests ------------------------------------------------------------------------------------


class Train(_Message):
    """Train ``epoch`` on from where the run stands, to its end or its next save point (``until``:
    exactly to that optimizer step); the first attempt keeps its start state (``keep_snapshot``),
    a later one restores it first."""

    op: Literal["train"] = "train"
    epoch: int = Field(ge=1)
    keep_snapshot: bool
    until: int | None = Field(None, ge=1)


class Save(_Message):
    """Save where the run stands as ``version`` (every rank writes its share, rank 0 commits)."""

    op: Literal["save"] = "save"
    version: int = Field(ge=0)


class Wait(_Message):
    """Answer once the save of ``version`` is committed (its error if it failed)."""

    op: Literal["wait"] = "wait"
    version: int


class Resubmit(_Message):
    """Write a failed async save again, from its staged state."""

    op: Literal["resubmit"] = "resubmit"
    version: int


class FlowRun(_Message):
    """The flow run's id, for the spec's own logging (it reads ``CKPTFLOW_FLOW_RUN_ID``)."""

    op: Literal["flow_run"] = "flow_run"
    id: str


class Close(_Message):
    """Let every save end, then leave (``flow_gone``: the flow's end of the channel closed)."""

    op: Literal["close"] = "close"
    flow_gone: bool = False


Request = Annotated[Train | Save | Wait | Resubmit | FlowRun | Close, Field(discriminator="op")]


class Call(_Message):
    """A request on the channel, answered by a reply of its own kind (train: :class:`Trained`,
    save: :class:`Staged`, wait: :class:`Committed`, the others: :class:`Done`). Call 0 is the
    build: the job itself, on the launcher's stdin, answered by :class:`Built`."""

    id: int = Field(ge=0)
    request: Request


# -- errors --------------------------------------------------------------------------------------

_CAUSES = 4  # how deep an error's chain of causes crosses


class RemoteError(_Message):
    """An error raised in a rank, as it crosses: enough to raise it again in the flow as itself.

    ``args`` and ``attributes`` are the exception's own (those JSON can carry), so that an error
    whose ``__init__`` takes other arguments than its message is rebuilt without calling it.
    """

    type: str
    message: str
    lineage: list[str] = Field(default_factory=list)  # a CheckpointError's classes, its own first
    args: list[Any] = Field(default_factory=list)
    attributes: dict[str, Any] = Field(default_factory=dict)
    traceback: str = ""
    place: str = ""  # file:line that raised it (the same failure twice is told apart by it)
    cause: RemoteError | None = None

    @classmethod
    def of(cls, exc: BaseException, depth: int = 0) -> RemoteError:
        frames = traceback.extract_tb(exc.__traceback__)
        cause = exc.__cause__
        return cls(
            type=type(exc).__name__,
            message=str(exc),
            lineage=[c.__name__ for c in type(exc).__mro__ if issubclass(c, CheckpointError)],
            args=[a if _carried(a) else str(a) for a in exc.args],
            attributes={k: v if _carried(v) else None for k, v in vars(exc).items() if not k.startswith("_")},
            traceback="".join(traceback.format_exception(exc)) if depth == 0 else "",
            place=f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "",
            cause=cls.of(cause, depth + 1) if cause is not None and depth < _CAUSES else None,
        )

    def exception(self) -> BaseException:
        """The error, raised in the flow as the class that raised it in the rank (see the module's
        docstring); its traceback there as a note."""
        exc = self._rebuilt()
        if self.traceback:
            add_note(exc, f"in the training process:\n{self.traceback}")
        return exc

    def _rebuilt(self) -> BaseException:
        known = known_errors()
        kind = next((known[name] for name in [self.type, *self.lineage] if name in known), None)
        exc: BaseException
        if kind is not None:
            exc = kind.__new__(kind, *self.args)  # args as the rank's error had them; no __init__
            vars(exc).update(self.attributes)
            if kind.__name__ != self.type:  # a class only the rank knows: its nearest known base
                exc.args = (f"{self.type}: {self.message}",)
            elif str(exc) != self.message:  # a message made from other than its args
                exc.args = (self.message,)
        else:
            exc = TrainerError(f"{self.type}: {self.message}", kind=self.type, place=self.place)
        setattr(exc, ORIGIN, (self.type, self.place))
        if self.cause is not None:
            exc.__cause__ = self.cause._rebuilt()
        return exc


ORIGIN = "ckptflow_raised_in_trainer"  # (type name, file:line) of an error rebuilt from a rank's


def origin(exc: BaseException) -> tuple[str, str] | None:
    """(type name, file:line) where a rank raised ``exc``, if it was raised in one."""
    if isinstance(exc, TrainerError) and exc.kind:
        return exc.kind, exc.place
    found = getattr(exc, ORIGIN, None)
    return found if isinstance(found, tuple) else None


def known_errors() -> dict[str, type[BaseException]]:
    """The error types that cross as themselves, by class name: every ``CheckpointError`` that
    ckptflow defines (and has imported), and the pipeline's refusals of a run."""
    from ..spec import SpecError
    from .run_state import ConfigMismatchError, NothingToResumeError

    known: dict[str, type[BaseException]] = {}
    pending: list[type[BaseException]] = [CheckpointError]
    while pending:
        kind = pending.pop()
        if kind.__module__.startswith("ckptflow."):
            known.setdefault(kind.__name__, kind)
        pending.extend(kind.__subclasses__())
    for kind in (SpecError, ConfigMismatchError, NothingToResumeError):
        known[kind.__name__] = kind
    return known


def _carried(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


# -- the channel ---------------------------------------------------------------------------------


class Answer(_Message):
    """A rank's answer to call ``id``: its reply (JSON, validated by the caller, who knows what it
    asked) or its error, and the run's progress when it was sent (None before the build)."""

    frame: Literal["answer"] = "answer"
    id: int
    progress: Progress | None = None
    reply: dict[str, Any] | None = None
    error: RemoteError | None = None


class Note(_Message):
    """A note for the run's log, made while call ``id`` was carried out."""

    frame: Literal["note"] = "note"
    id: int
    level: Level
    message: str


class SpecImported(_Message):
    """The run's spec imported (the launcher's, or the build's first step): the CLI may go on."""

    frame: Literal["spec"] = "spec"


class LaunchFailed(_Message):
    """The launcher's record of how the ranks ended, the last frame: which rank, how, its error."""

    frame: Literal["failure"] = "failure"
    failure: str


Frame = Annotated[Answer | Note | SpecImported | LaunchFailed, Field(discriminator="frame")]
FRAMES: TypeAdapter[Answer | Note | SpecImported | LaunchFailed] = TypeAdapter(Frame)


# -- the protocol --------------------------------------------------------------------------------


class PendingSave(Protocol):
    """A save in flight, the one shape of it: committed (:meth:`wait`) or failed, and written again
    (:meth:`resubmit`). An async save's storage ``SaveHandle``, a rank's sync write and a save in
    the trainer processes (seen from the flow) are each one."""

    version: int

    def wait(self, timeout: float | None = None) -> VersionInfo | None:
        """The committed version; None if the trainers that wrote it died before it committed."""
        ...

    def on_commit(self, callback: Callable[[VersionInfo], None]) -> None:
        """Call ``callback(info)`` once it is committed (quickly: it runs in a thread of the trainer's)."""
        ...

    def resubmit(self) -> None:
        """Write a failed save again, from the state it staged."""
        ...

    def done(self) -> bool:
        """Whether it has ended, committed or failed."""
        ...

    def join(self, timeout: float | None = None) -> bool:
        """Wait for it to end without raising; True if it ended within ``timeout``."""
        ...


class Trainer(Protocol):
    """The run's model, wherever it trains. ``progress`` is where the run stands (the last
    answer's); ``store`` the run's store, as this process reads it."""

    store: CheckpointStore
    async_save: bool

    @property
    def progress(self) -> Progress: ...

    def build(self, *, flow_run: str | None, log: Notes) -> Built:
        """Build the spec's objects; restore the newest committed checkpoint, if any."""
        ...

    def train(self, epoch: int, *, keep_snapshot: bool, log: Notes) -> Trained:
        """Train ``epoch`` (the one in progress, or the next) to its end or its next save point;
        a retry restores the stretch's start state first."""
        ...

    def save(self, version: int, *, log: Notes) -> PendingSave:
        """Start the save of where the run stands as ``version``: async, it returns once the state
        is copied."""
        ...

    def request_stop(self) -> None:
        """Ask the training in progress to stop after its current step (a cancellation): the
        stretch ends ``stopped``. Returns at once; from any thread."""
        ...

    def wait(self, version: int, timeout: float | None = None) -> VersionInfo | None:
        """Wait until the save of ``version`` is committed (None: its trainers died first)."""
        ...

    def stop(self, *, interrupted: bool = False, preempted: bool = False) -> None:
        """End training: the saves in flight commit (or fail) first; ``interrupted``: the stretch
        in progress is given up; ``preempted`` (SIGTERM, Ctrl-C): where the run stands is saved
        first, within the grace period."""
        ...
