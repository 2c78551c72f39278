"""The flow's side of its trainers: the training ranks of a run, in processes of their own.

With ``train_process`` on (``ckptflow run``'s default) or ``nproc`` > 1, the
flow's tasks stay in the flow's process and ask the trainers to build the
run, train each epoch and save, through the same functions an in-process run
calls (:mod:`.run_state`). The trainers are a torch.distributed world of
``nproc`` ranks per machine (one rank is the plain case), started by
:mod:`.launcher` with torch's elastic launcher; the flow talks to one of them,
the leader (:mod:`.rank_worker`), which hands every request to the others.
The trainers import torch but not Prefect; the flow's process imports Prefect
and builds nothing. So the two start side by side: the ``ckptflow`` script
starts the launcher first thing (:func:`spawn_early`); it imports torch while
the CLI parses its options and imports Prefect, and gets its job when the
options are valid (:func:`prestart`). The first epoch starts when both sides
are ready instead of after one and then the other.

Protocol: JSON messages on a socket pair that only the launcher's process tree
holds (nothing is unpickled), each request ``{"id", "op", "args"}`` answered
by ``{"id", "ok"}`` or ``{"id", "error"}``; notes for the run's log come as
``{"log", "message"}``, and the launcher's record of a failed rank as
``{"failure"}``, the last message; ``{"spec": "ok"}`` says that the spec
imported (the launcher imports it before it forks the ranks, else the first
thing a build does), so ``ckptflow run`` can refuse a bad spec before it
creates a flow run (:func:`spec_check`). The job (config, resolved storage
options with credentials, the world's size) goes on the launcher's stdin, so
it shows in no process listing or environment. Request 0 is the build.

Ending: ``close`` lets the ranks finish their saves and exit. An interrupted
flow (a worker's SIGTERM, Ctrl-C) sends the launcher SIGTERM: its agent passes
it to the ranks, which stop the epoch in progress, commit the save in flight
and exit, and the flow waits for that. The trainers ignore SIGINT: a Ctrl-C in
the terminal reaches them too, and the flow decides; the launcher starts with
SIGINT blocked, so one that comes before it ignores it is dropped too. If the
flow's process dies, the kernel kills the launcher and the ranks
(PR_SET_PDEATHSIG, :mod:`.lifetime`), as it would an in-process run: nothing
half-written is ever committed. If a rank dies or fails, the launcher stops the
others and every waiting call fails with :class:`TrainerDiedError`, which names
the rank and how it ended; the task's retry starts new trainers
(:func:`relaunch`), which resume from the last commit.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

from .childenv import TRAINER_FD_ENV
from .lifetime import blocked_in_children

GRACE_SECONDS = 150.0  # how long interrupted trainers get to commit (the launcher gives its ranks 120)
Log = Callable[[str, str], None]  # (level name, message)


class TrainerDiedError(RuntimeError):
    """The training process exited before answering; what it committed before is intact."""


class TrainerError(RuntimeError):
    """An error raised in the training process (its type and message; its traceback as a note).

    ``kind``: the error's own type name; ``place``: the file and line that raised it.
    """

    def __init__(self, message: str, *, kind: str = "", place: str = "") -> None:
        super().__init__(message)
        self.kind = kind
        self.place = place


# -- the flow's side -----------------------------------------------------------------------------


class TrainerProcess:
    """A started training process and the calls in flight to it."""

    def __init__(self) -> None:
        """Start the launcher; it imports torch and the storage code while it waits for :meth:`start`."""
        self.config: Any = None
        self.storage_options: dict[str, Any] = {}
        self._failure = ""  # what the launcher recorded of a failed rank
        parent, child = socket.socketpair()
        env = {**os.environ, TRAINER_FD_ENV: str(child.fileno())}
        with blocked_in_children(signal.SIGINT):  # until the child ignores it (see main)
            self.process = subprocess.Popen(
                [sys.executable, "-m", "ckptflow.tasks.launcher", str(os.getpid())],
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
        self._logs: dict[int, Log] = {}
        self._early: list[tuple[str, str]] = []  # notes made before anyone listened (the build)
        self._on_log: Log = lambda level, message: self._early.append((level, message))
        self._reader = threading.Thread(target=self._read, name="ckptflow-trainer-reader", daemon=True)
        self._reader.start()

    def start(self, config: Any, storage_options: dict[str, Any]) -> TrainerProcess:
        """Send the job: the process builds the run of ``config`` (request 0, :meth:`built`)."""
        assert self.process.stdin is not None and self.config is None
        self.config = config
        self.storage_options = storage_options
        world = {
            "nproc": config.nproc,
            "nnodes": config.nnodes,
            "rdzv_endpoint": config.rdzv_endpoint,
            "rdzv_id": config.rdzv_id,
            "backend": config.dist_backend,
            "timeout": config.rank_timeout_seconds,
        }
        job = {
            "config": config.model_dump(mode="json"),
            "storage_options": storage_options,
            "world": world,
            "writers": [os.getpid()],  # the flow takes the store's lease for its trainers
        }
        try:
            self.process.stdin.write(json.dumps(job).encode())
            self.process.stdin.close()
        except BrokenPipeError:
            pass  # it died: the build fails with TrainerDiedError
        return self

    def discard(self) -> None:
        """End a process that got no job (it exits when its stdin closes)."""
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.close(interrupted=True)

    def set_log(self, log: Log) -> None:
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
        """The build's answer: epoch, step, resumed_from, metrics."""
        return self._built

    def spec_imported(self) -> Future[Any]:
        """Done when the build has imported the spec; its error if that (or the build before it) failed."""
        return self._spec

    def call(self, op: str, log: Log | None = None, **args: Any) -> Future[Any]:
        """Send ``op`` with ``args``; the future holds the answer or the child's error.

        ``log(level, message)`` gets the notes the child makes while it answers (default: :meth:`set_log`'s).
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
                self._conn.send_bytes(json.dumps({"id": call_id, "op": op, "args": args}).encode())
        except OSError:
            self._fail_all()
        return future

    def close(self, *, interrupted: bool = False) -> None:
        """End the process: with ``interrupted``, SIGTERM (it commits, then exits); wait for it."""
        if self.process.poll() is None:
            if interrupted:
                self.process.send_signal(signal.SIGTERM)
            else:
                self.call("close")
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
            self._reader.join(5)  # its record is the last message: read up to the end first
        return self._failure[:4000]

    def _read(self) -> None:
        for message in _received(self._conn):
            if "log" in message:
                with self._lock:
                    log = self._logs.get(message["id"], self._on_log)
                log(message["log"], message["message"])
                continue
            if "spec" in message:
                _settle(self._spec, None)
                continue
            if "failure" in message:
                self._failure = str(message["failure"]).strip()
                continue
            with self._lock:
                future = self._calls.pop(message["id"], None)
                self._logs.pop(message["id"], None)
            if future is None:
                continue
            if "error" in message:
                future.set_exception(_remote_error(message["error"]))
                if message["id"] == 0:
                    _settle(self._spec, None, future.exception())
            else:
                future.set_result(message.get("ok"))
        self.process.wait()
        self._fail_all()

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


class RemoteSave:
    """An async save in flight in the training process (what a SaveHandle is in-process)."""

    def __init__(self, trainer: TrainerProcess, version: int, store: Any) -> None:
        self.trainer = trainer
        self.version = version
        self.store = store  # where to look for it if the trainers die while it is written
        self._callbacks: list[Callable[[Any], None]] = []

    def wait(self, timeout: float | None = None) -> Any:
        """The committed version; None if the trainers that wrote it died before it committed."""
        from ckptflow.storage import VersionInfo

        try:
            return VersionInfo(**self.trainer.call("wait", version=self.version).result(timeout))
        except TrainerDiedError:
            return self.store.find(self.version)  # it may have committed just before they died

    def on_commit(self, callback: Callable[[Any], None]) -> None:
        """Call ``callback(info)`` the moment rank 0 has committed the version (in the reader
        thread: it must be quick); nothing if the write fails or the trainers die first."""
        self._callbacks.append(callback)
        self._watch(callback)

    def _watch(self, callback: Callable[[Any], None]) -> None:
        from ckptflow.storage import VersionInfo

        def done(answer: Future[Any]) -> None:
            if answer.exception() is None:
                callback(VersionInfo(**answer.result()))

        self.trainer.call("wait", version=self.version).add_done_callback(done)

    def resubmit(self) -> None:
        if not self.trainer.dead():
            self.trainer.call("resubmit", version=self.version).result()
            for callback in self._callbacks:  # the failed write's wait ended with its error
                self._watch(callback)

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the save has ended; the process stops its epoch and exits to get there."""
        self.trainer.close(interrupted=True)
        return True


def _settle(future: Future[Any], result: Any, error: BaseException | None = None) -> None:
    if not future.done():
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)


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


def _started(config: Any, storage_options: dict[str, Any]) -> TrainerProcess:
    global _spare
    process, _spare = _spare, None
    return (process or TrainerProcess()).start(config, storage_options)


def prestart(config: Any) -> None:
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


def take(config: Any) -> tuple[TrainerProcess, bool]:
    """The prestarted process if it was started for ``config`` (True), else a new one (False)."""
    global _prestarted
    found, _prestarted = _prestarted, None
    if found is not None and found.config == config and found.process.poll() is None:
        return found, True
    if found is not None:
        found.close(interrupted=True)
    return _started(config, config.resolved_storage_options()), False


def relaunch(config: Any, storage_options: dict[str, Any]) -> TrainerProcess:
    """New trainers for a run whose trainers died: they build the run and resume from the last commit."""
    return TrainerProcess().start(config, storage_options)


def _received(conn: Connection) -> Iterator[dict[str, Any]]:
    """The messages from the other side, until it closes its end."""
    while True:
        try:
            yield json.loads(conn.recv_bytes())
        except (EOFError, OSError, ValueError):  # ValueError: a frame cut short by a killed rank
            return


def _remote_error(error: dict[str, Any]) -> BaseException:
    from ckptflow.storage import LeaseLostError, StateMismatchError, StoreLockedError

    from .run_state import ConfigMismatchError, NothingToResumeError
    from .spec import SpecError

    known: dict[str, type[Exception]] = {
        "SpecError": SpecError,
        "ConfigMismatchError": ConfigMismatchError,
        "NothingToResumeError": NothingToResumeError,
        "StateMismatchError": StateMismatchError,  # what only the user can change: not retried
        "StoreLockedError": StoreLockedError,  # another writer has the store: not retried either
        "LeaseLostError": LeaseLostError,
    }
    kind = known.get(error["type"])
    if kind is not None:
        exc: BaseException = kind(error["message"])
    else:
        message = f"{error['type']}: {error['message']}"
        exc = TrainerError(message, kind=error["type"], place=error.get("place", ""))
    exc.add_note(f"in the training process:\n{error['traceback']}")
    return exc
