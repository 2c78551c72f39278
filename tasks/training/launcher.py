"""The trainers' launcher: ``python -m ckptflow.tasks.training.launcher PARENT``, the flow's one child.

The flow starts it early (before Prefect is imported, see :mod:`.trainer`): it
imports torch and the training code while it waits for its job on stdin, then
starts the run's ranks on this machine with torch's elastic launcher
(``elastic_launch``, the engine under ``torchrun``): c10d rendezvous on the
endpoint the job names when other machines join (else a rendezvous of this
machine alone, :mod:`.one_machine`), one agent per machine, failure records. The ranks are forked
from this warmed-up process, so none imports torch again, and the flow's first
epoch starts as soon as they have met (:mod:`.rank_worker`).

It ends with the flow's process (PR_SET_PDEATHSIG) and so do its ranks. SIGTERM
(the flow was interrupted) is passed by the agent to every rank, which commits
the save in flight and exits; they get ``GRACE_SECONDS`` before SIGKILL. A rank
that fails ends the world: the agent stops the others, and this process writes
the failure record (which rank, its exit code or signal, its error) to the
flow, as the last message on the trainers' socket: nothing is left behind in
the temporary directory (torch's per-rank error files live in one that is
removed when the launch ends).
"""

from __future__ import annotations

import gc
import os
import shutil
import signal
import sys
import tempfile
import threading
import uuid
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from .childenv import TRAINER_FD_ENV
from .lifetime import die_with_parent, ignore

if TYPE_CHECKING:  # imported once the job is on its way (see main): the process starts light
    from .protocol import TrainerJob

GRACE_SECONDS = 120  # how long interrupted ranks get to commit the save in flight
RENDEZVOUS_SECONDS = 900  # how long this machine's agent waits for the others to join


def _warm_up() -> None:
    """What every rank needs, imported once here while the job is on its way: torch, the launcher,
    the storage code, and ``torch._dynamo``, which constructing any torch optimizer imports."""
    import torch._dynamo
    import torch.distributed.launcher.api  # noqa: F401

    from . import protocol, rank, rank_worker, run_state  # noqa: F401


def _import_spec(job: TrainerJob, fd: int) -> None:
    """Import the run's spec now, before the ranks are forked (they inherit it), and tell the flow
    that it imports: the flow creates its run while the ranks start, not after.

    A spec that fails to import is left to the ranks' build, which reports its error as always.
    Only with a CPU build of torch: with CUDA, a spec's module may touch the GPU when imported,
    and ranks forked after that could not use it.
    """
    import torch

    if torch.version.cuda is not None or torch.version.hip is not None:
        return
    from ..spec import load_spec_class
    from .protocol import SpecImported

    try:
        load_spec_class(job.config.spec)
    except Exception:
        return
    with Connection(os.dup(fd)) as conn:  # the ranks keep the channel: write on a copy
        conn.send_bytes(SpecImported().model_dump_json().encode())


def launch(job: TrainerJob, fd: int, log_dir: str) -> None:
    """Start this machine's ranks of the job's world and wait until they have all ended.

    ``log_dir`` holds torch's failure records of the ranks (their ``error.json``) while they run.
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from . import one_machine

    run = job.config
    nnodes = run.nnodes
    endpoint = run.rdzv_endpoint  # other machines meet this one there
    config = LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=run.nproc,
        run_id=run.rdzv_id or uuid.uuid4().hex,
        rdzv_backend="c10d" if nnodes > 1 or endpoint else one_machine.BACKEND,
        rdzv_endpoint=endpoint or f"{one_machine.HOST}:0",
        rdzv_configs={"timeout": RENDEZVOUS_SECONDS},
        max_restarts=0,  # a failed rank fails the flow's task; its retry starts a new world
        monitor_interval=0.1,
        start_method="fork",  # from this process, torch already imported
        local_addr="127.0.0.1" if nnodes == 1 else None,
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
        shutdown_timeout=GRACE_SECONDS,
        signals_to_handle="SIGTERM",  # Ctrl-C reaches the flow, which decides (SIGINT stays ignored)
    )
    elastic_launch(config, _rank)(job.model_dump_json(), fd, os.getpid())


def _rank(job: str, fd: int, launcher: int) -> None:
    """A forked rank, given the job's JSON; it returns (or raises: the agent records the error) and
    multiprocessing ends the process with ``os._exit``, so C++ static destructors never run in a rank."""
    from .rank_worker import serve_rank

    serve_rank(job, fd, launcher)


def failure_text(error: BaseException) -> str:
    """What went wrong, one line per failed rank: its rank, how it ended, its error's last line."""
    failures = getattr(error, "failures", None)
    if not failures:
        return f"{type(error).__name__}: {error}"
    lines = []
    for rank, failure in sorted(failures.items()):
        code, signal_name = failure.exitcode, failure.signal_name()
        if signal_name not in ("", "<N/A>"):
            how = f"was killed by {signal_name}"
        else:
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        message = failure.message
        if isinstance(message, dict):
            message = str(message.get("message", ""))
        detail = " ".join(message.split())[-400:] if message and "To enable traceback" not in message else ""
        lines.append(f"rank {rank} {how}" + (f": {detail}" if detail else ""))
    return "; ".join(lines)


# What torch's agent logs (at WARNING) on every stop the flow asks for: a clean stop's console
# stays clean. Its other lines (a rank that would not stop, a failure) pass.
EXPECTED_STOP = (
    ("torch.distributed.elastic.agent.server.api", "Received %s death signal, shutting down workers"),
    ("torch.distributed.elastic.multiprocessing.api", "Closing process %s via signal %s"),
    ("torch.distributed.elastic.multiprocessing.api", "Sending process %s closing signal %s"),
)


def _quiet_expected_stops() -> None:
    import logging

    class Expected(logging.Filter):
        def __init__(self, template: str) -> None:
            super().__init__()
            self.template = template

        def filter(self, record: logging.LogRecord) -> bool:
            return record.msg != self.template

    for name, template in EXPECTED_STOP:
        logging.getLogger(name).addFilter(Expected(template))


def main() -> int:
    die_with_parent(signal.SIGKILL, int(sys.argv[1]))  # as an in-process run dies with the flow's process
    ignore(signal.SIGINT)  # Ctrl-C reaches the flow too: it stops the ranks
    _quiet_expected_stops()
    signal.signal(signal.SIGUSR1, _pass_on)  # a cancellation: the ranks stop after their step
    fd = int(os.environ[TRAINER_FD_ENV])
    received: list[bytes] = []
    reading = threading.Thread(target=lambda: received.append(sys.stdin.buffer.read()), daemon=True)
    reading.start()  # so that a large job never blocks the flow's write
    _warm_up()
    reading.join()
    if not received[0]:
        return 0  # discarded before it got a job
    from .protocol import JobError, TrainerJob

    try:
        job = TrainerJob.parse(received[0])
    except JobError as exc:  # the flow's build fails with this, as the launcher's record
        _tell_flow(fd, str(exc))
        return 1
    _import_spec(job, fd)
    # What is imported stays for the process's life: the collector stops walking it, in the agent's
    # monitor loop (6 ms of CPU per epoch less at W=2) and in the forked ranks (their pages stay shared).
    gc.freeze()
    log_dir = tempfile.mkdtemp(prefix="ckptflow-ranks-")
    try:
        launch(job, fd, log_dir)
    except BaseException as exc:
        _tell_flow(fd, failure_text(exc))  # every rank has ended: this process alone writes on it now
        return 1
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    return 0


def _pass_on(signum: int, frame: object) -> None:
    """Send ``signum`` on to this process's children (the ranks; in a rank, that has none yet: nothing)."""
    me = str(os.getpid())
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as stat:
                parent = stat.read().rpartition(")")[2].split()[1]
            if parent == me:
                os.kill(int(entry.name), signum)
        except (OSError, IndexError):
            continue  # ended meanwhile


def _tell_flow(fd: int, failure: str) -> None:
    """The launcher's record of how the ranks ended (or why none started), the last frame."""
    from .protocol import LaunchFailed

    with Connection(fd) as conn:
        conn.send_bytes(LaunchFailed(failure=failure).model_dump_json().encode())


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
