"""The flow's side of its trainers: the training ranks of a run, in processes of their own.

With ``train_process`` on (``ckptflow run``'s default) or ``nproc`` > 1, the
flow's tasks drive a :class:`ProcessTrainer`: the trainer protocol
(:mod:`.protocol`) over a channel to a torch.distributed world of ``nproc``
ranks per machine (one rank is the plain case), started by :mod:`.launcher`
with torch's elastic launcher. Every rank carries the requests out on its
:class:`~.rank.Rank`, as the in-process trainer does in the flow's process;
the flow talks to one of them, the leader (:mod:`.rank_worker`), which hands
every request to the others. The trainers import torch but not Prefect; the
flow's process imports Prefect and builds nothing. So the two start side by
side: the ``ckptflow`` script starts the launcher first thing
(:func:`spawn_early`); it imports torch while the CLI parses its options and
imports Prefect, and gets its job when the options are valid
(:func:`prestart`). The first epoch starts when both sides are ready instead
of after one and then the other.

Channel: :class:`~.protocol.Call` frames in, :class:`~.protocol.Answer`,
:class:`~.protocol.Note`, :class:`~.protocol.SpecImported` and (the last one)
:class:`~.protocol.LaunchFailed` frames out, as JSON on a socket pair that only
the launcher's process tree holds; nothing is unpickled. The job
(:class:`~.protocol.TrainerJob`: config, resolved storage options with
credentials, the world) goes on the launcher's stdin, so it shows in no process
listing or environment; its build is call 0. :class:`TrainerProcess` is the
channel and the process; :class:`ProcessTrainer` the protocol over it, with
the replies validated where they enter.

Ending: ``stop`` lets the ranks finish their saves and exit. An interrupted
flow (a worker's SIGTERM, Ctrl-C) sends the launcher SIGTERM: its agent passes
it to the ranks, which stop the epoch in progress, commit the save in flight
and exit, and the flow waits for that. The trainers ignore SIGINT: a Ctrl-C in
the terminal reaches them too, and the flow decides; the launcher starts with
SIGINT blocked, so one that comes before it ignores it is dropped too. If the
flow's process dies, the kernel kills the launcher and the ranks
(PR_SET_PDEATHSIG, :mod:`.lifetime`), as it would an in-process run: nothing
half-written is ever committed. If a rank dies or fails, the launcher stops the
others and every waiting call fails with :class:`TrainerDiedError`, which names
the rank and how it ended; the next request starts new trainers
(:meth:`ProcessTrainer._revive`), which resume from the last commit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from ckptflow.storage import VersionInfo

from ..config import PipelineConfig
from .childenv import TRAINER_FD_ENV
from .lifetime import blocked_in_children
from .protocol import (
    FRAMES,
    Answer,
    Built,
    Call,
    Close,
    Committed,
    Done,
    FlowRun,
    LaunchFailed,
    Note,
    Notes,
    PendingSave,
    Progress,
    RemoteError,
    Request,
    Resubmit,
    Save,
    SpecImported,
    Staged,
    Train,
    Trained,
    TrainerDiedError,
    TrainerError,
    TrainerJob,
    Wait,
    problems,
)
from .run_state import claim_store, open_store

GRACE_SECONDS = 150.0  # how long interrupted trainers get to commit (the launcher gives its ranks 120)

R = TypeVar("R", bound=BaseModel)


# -- the channel and the process -----------------------------------------------------------------


class TrainerProcess:
    """A started training process (the launcher of the run's ranks) and the calls in flight to it.

    Futures hold a reply's JSON as the rank sent it; :class:`ProcessTrainer` validates it.
    """

    def __init__(self) -> None:
        """Start the launcher; it imports torch and the storage code while it waits for :meth:`start`."""
        self.config: PipelineConfig | None = None
        self.storage_options: dict[str, Any] = {}
        self.progress = Progress()  # the run's, as of the last answer
        self._failure = ""  # what the launcher recorded of a failed rank
        parent, child = socket.socketpair()
        env = {**os.environ, TRAINER_FD_ENV: str(child.fileno())}
        with blocked_in_children(signal.SIGINT):  # until the child ignores it (see the launcher's main)
            self.process = subprocess.Popen(
                [sys.executable, "-m", "ckptflow.tasks.training.launcher", str(os.getpid())],
                stdin=subprocess.PIPE,
                env=env,
                pass_fds=(child.fileno(),),
            )
        child.close()
        self._conn = Connection(parent.detach())
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._built: Future[Any] = Future()
        self._spec: Future[Any] = Future()  # the spec imported (its error if not)
        self._calls: dict[int, Future[Any]] = {0: self._built}
        self._next = 1
        self._closed = False
        self._logs: dict[int, Notes] = {}
        self._early: list[tuple[str, str]] = []  # notes made before anyone listened (the build)
        self._on_log: Notes = lambda level, message: self._early.append((level, message))
        self._reader = threading.Thread(target=self._read, name="ckptflow-trainer-reader", daemon=True)
        self._reader.start()

    def start(self, config: PipelineConfig, storage_options: dict[str, Any]) -> TrainerProcess:
        """Send the job: the process builds the run of ``config`` (call 0, :meth:`built`)."""
        assert self.process.stdin is not None and self.config is None
        self.config = config
        self.storage_options = storage_options
        job = TrainerJob.for_run(config, storage_options, writers=[os.getpid()])
        try:
            self.process.stdin.write(job.model_dump_json().encode())
            self.process.stdin.close()
        except BrokenPipeError:
            pass  # it died: the build fails with TrainerDiedError
        return self

    def discard(self) -> None:
        """End a process that got no job (it exits when its stdin closes)."""
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.close(interrupted=True)

    def set_log(self, log: Notes) -> None:
        """Where notes of no particular call go (the build's); the ones made so far go there now."""
        with self._lock:
            early, self._early = self._early, []
            self._on_log = log
        for level, message in early:
            log(level, message)

    @property
    def pid(self) -> int:
        return self.process.pid

    def built(self) -> Future[Any]:
        """The build's reply (a :class:`~.protocol.Built`, as JSON)."""
        return self._built

    def spec_imported(self) -> Future[Any]:
        """Done when the build has imported the spec; its error if that (or the build before it) failed."""
        return self._spec

    def call(self, request: Request, log: Notes | None = None) -> Future[Any]:
        """Send ``request``; the future holds the reply's JSON or the rank's error.

        ``log(level, message)`` gets the notes the ranks make while they answer (default: :meth:`set_log`'s).
        """
        future: Future[Any] = Future()
        with self._lock:
            if self.process.poll() is not None or self._closed:
                future.set_exception(self._died())
                return future
            call_id, self._next = self._next, self._next + 1
            self._calls[call_id] = future
            if log is not None:
                self._logs[call_id] = log
        try:
            with self._send_lock:
                self._conn.send_bytes(Call(id=call_id, request=request).model_dump_json().encode())
        except OSError:
            self._fail_all()
        return future

    def close(self, *, interrupted: bool = False) -> None:
        """End the process: with ``interrupted``, SIGTERM (it commits, then exits); wait for it."""
        if self.process.poll() is None:
            if interrupted:
                self.process.send_signal(signal.SIGTERM)
            else:
                self.call(Close())
            try:
                self.process.wait(GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._closed = True
        self._conn.close()

    def dead(self) -> bool:
        """Whether the trainers have ended (a rank failed, or they were closed)."""
        return self._closed or self.process.poll() is not None

    def failure(self) -> str:
        """What the launcher recorded of the rank that failed ('' if none did)."""
        if self.process.poll() is not None and threading.current_thread() is not self._reader:
            self._reader.join(5)  # its record is the last frame: read up to the end first
        return self._failure[:4000]

    def _read(self) -> None:
        try:
            for frame in _received(self._conn):
                if isinstance(frame, Note):
                    with self._lock:
                        log = self._logs.get(frame.id, self._on_log)
                    log(frame.level, frame.message)
                elif isinstance(frame, SpecImported):
                    _settle(self._spec, None)
                elif isinstance(frame, LaunchFailed):
                    self._failure = frame.failure.strip()
                else:
                    self._answered(frame)
        except ValidationError as exc:  # nothing more can be read: stop them (they commit, then exit)
            self._failure = f"they sent a frame this flow cannot read ({problems(exc)[:400]})"
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGTERM)
        self.process.wait()
        self._fail_all()

    def _answered(self, answer: Answer) -> None:
        if answer.progress is not None:  # answers come in the order they were sent: the last is the newest
            self.progress = answer.progress
        with self._lock:
            future = self._calls.pop(answer.id, None)
            self._logs.pop(answer.id, None)
        if future is None:
            return
        if answer.error is not None:
            future.set_exception(answer.error.exception())
            if answer.id == 0:
                _settle(self._spec, None, future.exception())
        else:
            future.set_result(answer.reply)

    def _fail_all(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, {}
        for future in [*calls.values(), self._spec]:
            if not future.done():
                future.set_exception(self._died())

    def died_message(self) -> str:
        """How the trainers ended, for the run's log."""
        return str(self._died())

    def _died(self) -> TrainerDiedError:
        code = self.process.poll()
        failure = self.failure()
        if failure:
            how = f"ended: {failure}"
        elif code is None:
            how = "are closed"
        elif code < 0:
            how = f"were killed (signal {-code} to the launcher, pid {self.process.pid})"
        else:
            how = f"ended (the launcher, pid {self.process.pid}, exited with code {code})"
        return TrainerDiedError(
            f"the training ranks {how}; the checkpoints they committed are intact: a retry, or "
            "another run, resumes from the newest"
        )


def _settle(future: Future[Any], result: Any, error: BaseException | None = None) -> None:
    if not future.done():
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


def _received(conn: Connection) -> Iterator[Answer | Note | SpecImported | LaunchFailed]:
    """The frames from the other side, until it closes its end; ValidationError for a frame that
    is JSON but no frame of the protocol."""
    while True:
        try:
            raw = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            yield FRAMES.validate_json(raw)
        except ValidationError as exc:
            if any(error["type"] == "json_invalid" for error in exc.errors()):
                return  # a frame cut short by a killed rank
            raise


def _remote_error(error: dict[str, Any]) -> BaseException:
    """The error a rank sent (a :class:`~.protocol.RemoteError`'s JSON), raised as its own type."""
    return RemoteError.model_validate(error).exception()


# -- the trainer protocol over it ----------------------------------------------------------------


class ProcessTrainer:
    """A :class:`~.protocol.Trainer` whose ranks live in processes of their own.

    ``progress`` is the last answer's; trainers that died are replaced by the next request
    (:meth:`_revive`), and stand where the run stood before they are asked anything.
    """

    def __init__(self, config: PipelineConfig, process: TrainerProcess, *, prestarted: bool = False) -> None:
        self.config = config
        self.store = open_store(config)
        self.async_save = config.async_save
        self._process = process
        self._prestarted = prestarted
        self._flow_run: str | None = None
        self._saved_at: dict[int, Progress] = {}  # the saves started: version -> where the run stood

    @classmethod
    def take(cls, config: PipelineConfig) -> ProcessTrainer:
        """The trainers :func:`prestart` started for ``config``, else new ones."""
        process, prestarted = take(config)
        return cls(config, process, prestarted=prestarted)

    @property
    def progress(self) -> Progress:
        return self._process.progress

    def build(self, *, flow_run: str | None, log: Notes) -> Built:
        """The ranks' build; trainers started before this flow held the store and that restored an
        older version than the newest (another run committed since) are built again. Then this
        flow, which holds the lease, claims the store for them (see :func:`~.run_state.claim_store`)."""
        self._flow_run = flow_run
        built = self._built(self._process, log)
        if self._prestarted:
            built = self._from_the_newest(built, log)
        world = "a training process" if built.world_size == 1 else f"{built.world_size} ranks"
        early = ", started before Prefect" if self._prestarted else ""
        log(
            "info",
            f"training in {world} (launcher pid {self._process.pid}{early}), torch intra-op threads: "
            f"{built.threads} of {os.cpu_count() or 1} cores",
        )
        claim_store(self.store, built.identity, lambda message: log("warning", message))
        return built

    def _built(self, process: TrainerProcess, log: Notes) -> Built:
        """``process``'s build, once it has been told the flow run; the process ends if it failed."""
        process.set_log(log)  # what the build noted (resuming from, config changes)
        try:
            built = Built.model_validate(process.built().result())
            if self._flow_run is not None:  # for the spec's own logging
                _reply(process.call(FlowRun(id=self._flow_run)), Done)
        except BaseException:
            process.close(interrupted=True)
            raise
        return built

    def _from_the_newest(self, built: Built, log: Notes) -> Built:
        """Trainers restored from the store's newest version now that this flow holds the lease:
        a run never continues from a version that is no longer the newest."""
        latest = self.store.latest()
        restored = built.resumed_from.version if built.resumed_from is not None else None
        if (latest.version if latest is not None else None) == restored:
            return built
        newest = latest.url if latest is not None else "none"
        log(
            "warning",
            f"the training process restored {f'version {restored}' if restored is not None else 'nothing'} "
            "before this run held the store, and a newer version is there since (committed by another "
            f"run, or fetched from the durable tier): building it again from {newest}",
        )
        self._process.close(interrupted=True)
        self._process = relaunch(self.config, self._process.storage_options)
        return self._built(self._process, log)

    def train(self, epoch: int, *, keep_snapshot: bool, log: Notes, until: int | None = None) -> Trained:
        self._revive(log)  # new trainers count their own attempts: their first keeps the start state
        request = Train(epoch=epoch, keep_snapshot=keep_snapshot, until=until)
        return _reply(self._process.call(request, log), Trained)

    def save(self, version: int, *, log: Notes) -> PendingSave:
        self._revive(log, saving=version)
        staged = _reply(self._process.call(Save(version=version), log), Staged)  # its notes show on the task
        self._saved_at[version] = self._process.progress
        return _ProcessSave(self._process, staged.version, self)

    def request_stop(self) -> None:
        """SIGUSR1 to the launcher, which passes it to its ranks: they stop after the step in progress."""
        with contextlib.suppress(ProcessLookupError):
            if not self._process.dead():
                self._process.process.send_signal(signal.SIGUSR1)

    def wait(self, version: int, timeout: float | None = None) -> VersionInfo | None:
        return _ProcessSave(self._process, version, self).wait(timeout)

    def stop(self, *, interrupted: bool = False, preempted: bool = False) -> None:
        """End the trainers; ``interrupted``: SIGTERM, they stop the stretch in progress (a spec's
        ``train_steps`` after its step, which they save) and commit what is in flight, then exit."""
        self._process.close(interrupted=interrupted or preempted)

    def _revive(self, log: Notes, *, saving: int | None = None) -> None:
        """Replace trainers that died (a rank failed or was killed) by new ones, which resume from
        the last commit and train again up to where the run stands (:attr:`progress`). Training is
        deterministic from a commit (its RNG states are saved), so they stand exactly there. A
        save that died with the old trainers (an async save in flight) is made again on the way,
        as the same version, unless it is ``saving`` (the caller saves it)."""
        old = self._process
        if not old.dead():
            return
        log("warning", f"{old.died_message()}: starting new trainers")
        target = old.progress
        process = relaunch(self.config, old.storage_options)
        self._built(process, log)
        try:
            resumed = process.progress
            if resumed.position > target.position:
                raise RuntimeError(
                    f"the new trainers resumed at {_where(resumed)}, after the run's {_where(target)}"
                )
            lost = sorted(
                (where.position, version, where)
                for version, where in self._saved_at.items()
                if version != saving
                and resumed.position < where.position <= target.position
                and self.store.find(version) is None
            )
            for _, version, where in lost:
                _replay(process, where, log)
                log(
                    "info",
                    f"saving {_where(where)} again, as version {version}: its save died with the trainers",
                )
                _reply(process.call(Save(version=version), log), Staged)
                _reply(process.call(Wait(version=version)), Committed)
            _replay(process, target, log)
        except BaseException:
            process.close(interrupted=True)
            raise
        self._process = process


def _replay(process: TrainerProcess, target: Progress, log: Notes) -> None:
    """Train new trainers again up to ``target`` (where the old ones stood)."""
    while process.progress.position < target.position:
        epoch = process.progress.epoch + 1
        until = target.step if target.in_epoch and epoch == target.epoch + 1 else None  # inside its epoch
        log("info", f"training {_where(process.progress, 'from')} again: its trainers died first")
        _reply(process.call(Train(epoch=epoch, keep_snapshot=False, until=until), log), Trained)


def _where(progress: Progress, word: str = "at") -> str:
    if progress.in_epoch:
        return f"step {progress.in_epoch} of epoch {progress.epoch + 1}"
    return f"the end of epoch {progress.epoch}" if word == "at" else f"epoch {progress.epoch + 1}"


class _ProcessSave:
    """A save in flight in the trainers that started it (``process``)."""

    def __init__(self, process: TrainerProcess, version: int, trainer: ProcessTrainer) -> None:
        self.process = process
        self.version = version
        self.trainer = trainer  # its store: where to look for the version if the trainers die
        self._callbacks: list[Callable[[VersionInfo], None]] = []
        self._answer: Future[Any] | None = None  # the write in progress: its Wait, once asked

    def wait(self, timeout: float | None = None) -> VersionInfo | None:
        """The committed version; None if the trainers that wrote it died before it committed."""
        try:
            return _reply(self.process.call(Wait(version=self.version)), Committed, timeout).info
        except TrainerDiedError:
            return self.trainer.store.find(self.version)  # it may have committed just before they died

    def on_commit(self, callback: Callable[[VersionInfo], None]) -> None:
        """Call ``callback(info)`` the moment rank 0 has committed the version (in the reader
        thread: it must be quick); nothing if the write fails or the trainers die first."""
        self._callbacks.append(callback)
        self._watch(callback)

    def _watch(self, callback: Callable[[VersionInfo], None]) -> None:
        def done(answer: Future[Any]) -> None:
            if answer.exception() is None:
                callback(Committed.model_validate(answer.result()).info)

        self.process.call(Wait(version=self.version)).add_done_callback(done)

    def done(self) -> bool:
        return self._ended().done()

    def join(self, timeout: float | None = None) -> bool:
        try:
            self._ended().exception(timeout)
        except TimeoutError:
            return False
        return True

    def _ended(self) -> Future[Any]:
        """The answer to one Wait for the write in progress (asked once per write)."""
        if self._answer is None:
            self._answer = self.process.call(Wait(version=self.version))
        return self._answer

    def resubmit(self) -> None:
        if not self.process.dead():
            _reply(self.process.call(Resubmit(version=self.version)), Done)
            self._answer = None  # a new write: a new Wait
            for callback in self._callbacks:  # the failed write's wait ended with its error
                self._watch(callback)


def _reply(answer: Future[Any], kind: type[R], timeout: float | None = None) -> R:
    """The reply ``answer`` holds, validated as the ``kind`` its request is answered with."""
    return kind.model_validate(answer.result(timeout))


# -- started early -------------------------------------------------------------------------------

_spare: TrainerProcess | None = None  # started, no job yet
_prestarted: TrainerProcess | None = None  # started with a job


def spawn_early() -> None:
    """Start a training process now, to be given its job by :func:`prestart` or :func:`take`.

    ``ckptflow run`` calls this first thing: the process imports torch while the CLI parses and
    validates its options.
    """
    global _spare
    if _spare is None:
        _spare = TrainerProcess()


def _started(config: PipelineConfig, storage_options: dict[str, Any]) -> TrainerProcess:
    global _spare
    process, _spare = _spare, None
    return (process or TrainerProcess()).start(config, storage_options)


def prestart(config: PipelineConfig) -> None:
    """Start the training process of ``config`` now (before Prefect is imported); :func:`take` adopts it.

    Not with a credentials block: resolving it needs Prefect's API, so the flow sends the job
    (to the process :func:`spawn_early` started, if any).
    """
    global _prestarted, _spare
    if not config.uses_trainers:
        if _spare is not None:
            _spare.discard()
            _spare = None
    elif config.storage_secret is None:
        _prestarted = _started(config, dict(config.storage_options))


def spec_check() -> Future[Any] | None:
    """The prestarted process's verdict on its spec (see :meth:`TrainerProcess.spec_imported`), if any."""
    return _prestarted.spec_imported() if _prestarted is not None else None


def take(config: PipelineConfig) -> tuple[TrainerProcess, bool]:
    """The prestarted process if it was started for ``config`` (True), else a new one (False)."""
    global _prestarted
    found, _prestarted = _prestarted, None
    if found is not None and found.config == config and found.process.poll() is None:
        return found, True
    if found is not None:
        found.close(interrupted=True)
    return _started(config, config.resolved_storage_options()), False


def relaunch(config: PipelineConfig, storage_options: dict[str, Any]) -> TrainerProcess:
    """New trainers for a run whose trainers died: they build the run and resume from the last commit."""
    return TrainerProcess().start(config, storage_options)


__all__ = [
    "ProcessTrainer",
    "TrainerDiedError",
    "TrainerError",
    "TrainerProcess",
    "prestart",
    "spawn_early",
    "spec_check",
    "take",
]
