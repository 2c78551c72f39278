"""The training process: a run's model, optimizer and data in a child process.

With ``train_process`` on (``ckptflow run``'s default), the flow's tasks stay
in the flow's process and ask a child, ``python -m ckptflow.tasks.trainer``,
to build the run, train each epoch and save, through the same functions an
in-process run calls (:mod:`.run_state`). The child imports torch but not
Prefect; the flow's process imports Prefect and does not build anything. So
the two start side by side: the ``ckptflow`` script starts the child first
thing (:func:`spawn_early`); the child imports torch while the CLI parses its
options and imports Prefect, and gets its job when the options are valid
(:func:`prestart`). The first epoch starts when both sides are ready instead
of after one and then the other.

Protocol: JSON messages on a socket pair (nothing is unpickled), each request
``{"id", "op", "args"}`` answered by ``{"id", "ok"}`` or ``{"id", "error"}``;
notes for the run's log come as ``{"log", "message"}``; ``{"spec": "ok"}`` says
that the spec imported, the first thing a build does, so ``ckptflow run`` can
refuse a bad spec before it creates a flow run (:func:`spec_check`). The job (config and
resolved storage options, credentials included) goes on the child's stdin, so
it shows in no process listing or environment. Request 0 is the build.

Ending: ``close`` lets the child finish its saves and exit. An interrupted
flow (a worker's SIGTERM, Ctrl-C) sends the child SIGTERM: it stops the epoch
in progress, commits the save in flight and exits, and the flow waits for
that. The child ignores SIGINT: a Ctrl-C in the terminal reaches both, and
the flow decides; it starts with SIGINT blocked, so one that comes before it
ignores it is dropped too. If the flow's process dies, the kernel kills the
child (PR_SET_PDEATHSIG, :mod:`.lifetime`), as it would an in-process run:
nothing half-written is ever committed. If the child dies, every waiting call
fails with :class:`TrainerDiedError`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

from .childenv import FLOW_RUN_ENV
from .lifetime import blocked_in_children, die_with_parent, ignore

FD_ENV = "CKPTFLOW_TRAINER_FD"
GRACE_SECONDS = 120.0  # how long an interrupted child gets to commit the save in flight
Log = Callable[[str, str], None]  # (level name, message)


class TrainerDiedError(RuntimeError):
    """The training process exited before answering; what it committed before is intact."""


class TrainerError(RuntimeError):
    """An error raised in the training process (its type and message; its traceback as a note)."""


# -- the flow's side -----------------------------------------------------------------------------


class TrainerProcess:
    """A started training process and the calls in flight to it."""

    def __init__(self) -> None:
        """Start the process; it imports torch and the storage code while it waits for :meth:`start`."""
        self.config: Any = None
        parent, child = socket.socketpair()
        env = {**os.environ, FD_ENV: str(child.fileno())}
        with blocked_in_children(signal.SIGINT):  # until the child ignores it (see main)
            self.process = subprocess.Popen(
                [sys.executable, "-m", "ckptflow.tasks.trainer", str(os.getpid())],
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
        job = {"config": config.model_dump(mode="json"), "storage_options": storage_options}
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

    def _died(self) -> TrainerDiedError:
        code = self.process.poll()
        how = (
            "is closed"
            if code is None
            else f"was killed by signal {-code}"
            if code < 0
            else f"exited with code {code}"
        )
        return TrainerDiedError(
            f"the training process (pid {self.process.pid}) {how}; the checkpoints it committed are "
            "intact: run again to resume from the newest"
        )


class RemoteSave:
    """An async save in flight in the training process (what a SaveHandle is in-process)."""

    def __init__(self, trainer: TrainerProcess, version: int) -> None:
        self.trainer = trainer
        self.version = version

    def wait(self, timeout: float | None = None) -> Any:
        from ckptflow.storage import VersionInfo

        return VersionInfo(**self.trainer.call("wait", version=self.version).result(timeout))

    def resubmit(self) -> None:
        self.trainer.call("resubmit", version=self.version).result()

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
    if not (config.train_process and config.nproc == 1):
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


def _received(conn: Connection) -> Iterator[dict[str, Any]]:
    """The messages from the other side, until it closes its end."""
    while True:
        try:
            yield json.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return


def _remote_error(error: dict[str, Any]) -> BaseException:
    from .run_state import ConfigMismatchError
    from .spec import SpecError

    known: dict[str, type[Exception]] = {"SpecError": SpecError, "ConfigMismatchError": ConfigMismatchError}
    kind = known.get(error["type"])
    exc = kind(error["message"]) if kind else TrainerError(f"{error['type']}: {error['message']}")
    exc.add_note(f"in the training process:\n{error['traceback']}")
    return exc


# -- the child's side ----------------------------------------------------------------------------


class _Interrupted(BaseException):
    """SIGTERM: stop the epoch in progress."""


class _Child:
    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.send_lock = threading.Lock()
        self.run: Any = None
        self.attempts: Any = None
        self.handles: dict[int, Any] = {}
        self.current = 0  # the request being answered in the main thread: its notes go with it

    def send(self, message: dict[str, Any]) -> None:
        with self.send_lock:
            self.conn.send_bytes(json.dumps(message).encode())

    def log(self, level: str) -> Callable[[str], None]:
        return lambda message: self.send({"log": level, "message": message, "id": self.current})

    def answer(self, call_id: int, work: Callable[[], Any]) -> None:
        try:
            result = work()
        except Exception as exc:
            error = {"type": type(exc).__name__, "message": str(exc), "traceback": traceback.format_exc()}
            self.send({"id": call_id, "error": error})
        else:
            self.send({"id": call_id, "ok": result})

    def in_thread(self, call_id: int, work: Callable[[], Any]) -> None:
        threading.Thread(target=self.answer, args=(call_id, work), name="ckptflow-trainer-call").start()

    def build(self, job: dict[str, Any]) -> dict[str, Any]:
        import torch

        from ckptflow.storage import refuse_if_held

        from .config import PipelineConfig
        from .run_state import build_run, open_store
        from .spec import load_spec_class
        from .threads import intra_op_threads

        config = PipelineConfig.model_validate(job["config"])
        load_spec_class(config.spec)
        self.send({"spec": "ok"})
        threads = intra_op_threads(config.torch_threads)
        if threads is not None:
            torch.set_num_threads(threads)
        store = open_store(config, job["storage_options"])
        # started before the flow took the store's lease: build nothing on a store another run holds
        refuse_if_held(store.loc, writers={os.getppid()})
        # the flow writes run.json and sets unreadable versions aside once it holds the lease
        self.run = build_run(config, store, info=self.log("info"), warn=self.log("warning"), writes=False)
        resumed = self.run.resumed_from
        return {
            "identity": self.run.identity,
            "epoch": self.run.epoch,
            "step": self.run.step,
            "resumed_from": dataclasses.asdict(resumed) if resumed is not None else None,
            "metrics": {str(k): v for k, v in self.run.metrics.items()},
            "threads": torch.get_num_threads(),
        }

    def serve(self) -> None:
        """Answer requests until ``close`` or until the flow's end of the socket closes."""
        for request in _received(self.conn):
            if request["op"] == "close":
                self.finish()
                self.send({"id": request["id"], "ok": None})
                return
            self.current = request["id"]
            self.handle(request["id"], request["op"], request["args"])

    def handle(self, call_id: int, op: str, args: dict[str, Any]) -> None:
        """Epochs and the staging of saves run here, in turn; writes and waits in threads of their own."""
        if op == "begin_epoch":
            self.answer(call_id, lambda: self.begin_epoch(bool(args["keep_snapshot"])))
        elif op == "train":
            self.answer(call_id, lambda: self.train(args["epoch"], args["attempt"]))
        elif op == "save" and args["async"]:
            self.answer(call_id, lambda: self.save_async(args["epoch"]))
        elif op == "save":
            state, kwargs = self.capture(args["epoch"])
            self.in_thread(call_id, lambda: dataclasses.asdict(self.run.store.save(state, **kwargs)))
        elif op == "wait":
            handle = self.handles[args["version"]]
            self.in_thread(call_id, lambda: dataclasses.asdict(handle.wait()))
        elif op == "flow_run":  # for the spec's own logging, as the ranks have it
            os.environ[FLOW_RUN_ENV] = args["id"]
            self.answer(call_id, lambda: None)
        elif op == "resubmit":
            self.answer(call_id, self.handles[args["version"]].resubmit)
        else:
            self.answer(call_id, lambda: _unknown(op))

    def capture(self, epoch: int) -> tuple[dict[str, Any], dict[str, Any]]:
        from .run_state import capture_run

        run = self.run
        kwargs = {"epoch": epoch, "step": run.step, "version": epoch, "metrics": run.metrics.get(epoch)}
        return capture_run(run), kwargs

    def save_async(self, epoch: int) -> int:
        state, kwargs = self.capture(epoch)
        self.handles[epoch] = self.run.store.save_async(state, **kwargs)
        return epoch

    def begin_epoch(self, keep_snapshot: bool) -> None:
        from .run_state import EpochAttempts

        self.attempts = EpochAttempts(self.run, keep_snapshot=keep_snapshot)

    def train(self, epoch: int, attempt: int) -> dict[str, Any]:
        from .run_state import train_attempt

        if self.attempts is None:
            raise RuntimeError(f"epoch {epoch} was not begun")
        self.attempts.count = attempt
        metrics = train_attempt(self.run, epoch, self.attempts, self.log("warning"))
        return {"metrics": metrics, "step": self.run.step}

    def finish(self) -> None:
        """Let every save end (committed or failed) before the process exits."""
        for handle in self.handles.values():
            handle.join()


def _unknown(op: str) -> None:
    raise ValueError(f"unknown training process request {op!r}")


def _interrupt(signum: int, frame: Any) -> None:
    raise _Interrupted()


def _warm_up() -> None:
    """What every build needs, imported while the job is on its way: torch, the storage code, and
    ``torch._dynamo``, which constructing any torch optimizer imports (about a third of the wait)."""
    import torch._dynamo  # noqa: F401

    from . import run_state  # noqa: F401


def main() -> int:
    die_with_parent(signal.SIGKILL, int(sys.argv[1]))  # as an in-process run dies with the flow's process
    ignore(signal.SIGINT)  # Ctrl-C reaches the flow too: it stops this process
    job: list[bytes] = []
    reading = threading.Thread(target=lambda: job.append(sys.stdin.buffer.read()), daemon=True)
    reading.start()  # so that a large job never blocks the flow's write
    _warm_up()
    reading.join()
    if not job[0]:
        return 0  # discarded before it got a job
    conn = Connection(int(os.environ[FD_ENV]))
    child = _Child(conn)
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        child.answer(0, lambda: child.build(json.loads(job[0])))
        if child.run is not None:
            child.serve()
    except _Interrupted:
        pass
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the saves in flight commit now
        child.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
