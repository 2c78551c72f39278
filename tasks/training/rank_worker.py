"""One training process: a rank of the run's world, serving the trainer protocol to the flow.

Every training process is a rank of a torch.distributed world of size N >= 1,
started by torch's elastic launcher (:mod:`.launcher` on the flow's machine,
``torchrun`` on the others). One rank, the *leader* (local rank 0 on the
flow's machine), holds the flow's end of the channel: :class:`~.protocol.Call`
frames in, :class:`~.protocol.Answer` and :class:`~.protocol.Note` frames out,
validated where they enter; nothing is unpickled. The leader hands each call
to the other ranks through the rendezvous store, in order, and every rank
carries it out on its :class:`~.rank.Rank` (the object the in-process trainer
calls directly): build and restore, train an epoch (a retry restores its start
state first), save (every rank writes its share, the leader's rank 0 commits),
wait for a save, close. The leader answers; the others only act. So the flow
drives N ranks exactly as it drives one.

The leader is rank 0 of the world the ranks build: ranks are renumbered from
it, so that it is the one that commits. Another machine joins a run with
``torchrun --nnodes 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m
ckptflow.tasks.training.rank_worker`` (the job, credentials included, comes from the
leader through the rendezvous store).

Per-rank state when the number of ranks changed: rank 0 takes rank 0's saved
state; every other rank starts from rank 0's state too and then reseeds its
RNGs from (seed, epoch, rank), so that ranks do not draw the same numbers.

Failures: a rank whose request fails (other than the leader's answer of an
error) or that dies ends the world: the launcher stops the other ranks and
the flow's waiting call fails with the failure record. One exception: a build
that fails on every rank (a model that no longer fits the checkpoint) is the
leader's answer, typed; the other ranks wait for it and leave quietly, so the
flow does not take it for a dead rank and retry. SIGTERM (the flow was
interrupted) stops the epoch in progress; a spec's ``train_steps`` stops after
its step instead, on every rank at the same step, and the ranks save it. The
saves in flight commit before the rank exits. SIGUSR1 (a cancellation the flow
saw) only stops ``train_steps`` after its step: the flow saves it. No Prefect
import here: a rank starts in a second, not five.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from .protocol import (
    Answer,
    Built,
    Call,
    Close,
    Done,
    FlowRun,
    Note,
    RemoteError,
    Request,
    Resubmit,
    Save,
    SpecImported,
    Train,
    TrainerJob,
    Wait,
)
from .run_state import open_store

if TYPE_CHECKING:
    from .rank import Rank

log = logging.getLogger("ckptflow.rank")

STORE_PREFIX = "ckptflow"
JOIN_SECONDS = 600.0  # how long another machine's rank waits for the others, before it has the job
BUILD_VERDICT_SECONDS = 30.0  # how long a follower whose build failed waits for the leader's verdict


class _Interrupted(BaseException):
    """SIGTERM: stop the epoch in progress."""


class World:
    """This rank's place: its (renumbered) rank, the world's size, and the command feed."""

    def __init__(self, store: Any, rank: int, size: int, local_world: int) -> None:
        self.store = store
        self.rank = rank
        self.size = size
        self.local_world = local_world
        self.sent = 0

    @property
    def leads(self) -> bool:
        return self.rank == 0

    @classmethod
    def join(cls, may_lead: bool, backend: str, timeout: timedelta) -> World:
        """Meet the other ranks in the launcher's store; the leader becomes rank 0 of the process group."""
        import torch.distributed as dist

        size = int(os.environ.get("WORLD_SIZE", "1"))
        launched = int(os.environ.get("RANK", "0"))
        base = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=timeout,
            wait_for_workers=False,
        )
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"{STORE_PREFIX}/{attempt}/", base)
        if may_lead:
            store.compare_set("leader", "", str(launched))
        try:
            leader = int(store.get("leader"))
        except RuntimeError as exc:
            raise RuntimeError(
                "no rank leads this world: a ckptflow run leads it from the flow's machine "
                "(`ckptflow run --nnodes N --rdzv-endpoint HOST:PORT`); start the other machines' "
                f"ranks with torchrun while it waits ({exc})"
            ) from exc
        rank = (launched - leader) % size
        dist.init_process_group(
            backend, store=dist.PrefixStore("pg/", store), rank=rank, world_size=size, timeout=timeout
        )
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        return cls(store, rank, size, local_world)

    def tell_built(self, ok: bool) -> None:
        """The leader, once it has answered the build: whether it built the run."""
        if self.size > 1:
            self.store.set("built", "ok" if ok else "failed")

    def leader_failed_build(self, wait: float) -> bool:
        """A follower whose build failed: whether the leader's build failed too, waiting up to
        ``wait`` s for its verdict. Then the flow has the leader's error (a model that does not fit
        fails every rank the same way), and this rank leaves quietly; ending the world instead
        would cut the leader's answer off, and the flow would retry as if a rank had died."""
        deadline = time.monotonic() + wait
        while not self.store.check(["built"]):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return bytes(self.store.get("built")) == b"failed"

    def publish(self, call: bytes) -> None:
        """The leader: hand ``call`` (its JSON) to the other ranks (they take them in order)."""
        self.sent += 1
        if self.size > 1:
            self.store.set(f"request/{self.sent}", call)

    def next_request(self) -> bytes:
        """A follower: the leader's next request, however long the flow takes to send it.

        Polled (a store check is one round trip), not waited for: a blocking wait would hold off
        SIGTERM until it returned, and logs a warning each time it times out.
        """
        self.sent += 1
        key = f"request/{self.sent}"
        pause = 0.0005
        while not self.store.check([key]):
            time.sleep(pause)
            pause = min(pause * 1.5, 0.002)  # a request waits at most 2 ms for a follower
        return self.take(key)

    def take(self, key: str) -> bytes:
        """A follower: the value of ``key``; the last follower to read it deletes it (the job's
        credentials, and requests that would pile up over a long run)."""
        value = bytes(self.store.get(key))
        if self.store.add(f"read/{key}", 1) == self.size - 1:
            self.store.delete_key(key)
            self.store.delete_key(f"read/{key}")
        return value


class Server:
    """This rank's end of the trainer protocol: it carries the flow's calls out on its
    :class:`~.rank.Rank`. The leader reads them off the flow's channel, hands them on and sends
    the answers (each with the run's progress); the others only act."""

    def __init__(self, world: World, conn: Connection | None) -> None:
        from .rank import Rank

        self.world = world
        self.conn = conn
        self.rank = Rank(world_size=world.size, rank=world.rank)
        self.built = False
        self.send_lock = threading.Lock()
        self.current = 0  # the call being carried out in the main thread: its notes go with it

    # -- the flow's channel (the leader only) --

    def send(self, frame: BaseModel) -> None:
        if self.conn is None:
            return
        with self.send_lock:
            if isinstance(frame, Answer) and self.built:  # read now: the last answer sent is the newest
                frame = frame.model_copy(update={"progress": self.rank.progress})
            self.conn.send_bytes(frame.model_dump_json().encode())

    def notes(self, level: str, message: str) -> None:
        """A note for the run's log: the leader's go to the flow, with the call in progress."""
        if self.world.leads:
            self.send(Note.model_validate({"id": self.current, "level": level, "message": message}))
        else:
            getattr(log, level)("rank %d: %s", self.world.rank, message)

    def answer(self, call_id: int, work: Callable[[], BaseModel]) -> None:
        """Carry out ``work``; the leader sends its reply or error, another rank fails on an error."""
        try:
            reply = work()
        except Exception as exc:
            if not self.world.leads:
                raise
            self.send(Answer(id=call_id, error=RemoteError.of(exc)))
        else:
            self.send(Answer(id=call_id, reply=reply.model_dump(mode="json")))

    def in_thread(self, call_id: int, work: Callable[[], BaseModel]) -> None:
        def run() -> None:
            try:
                self.answer(call_id, work)
            except BaseException:  # a follower's failed write: end the world, as in the main thread
                traceback.print_exc()
                os._exit(1)

        threading.Thread(target=run, name="ckptflow-rank-call").start()

    def calls(self) -> Iterator[Call]:
        """The flow's calls: the leader reads, validates and publishes them, the others take them
        in turn. A call the leader cannot read is answered with its error, if it names its id."""
        if not self.world.leads:
            while True:
                yield Call.model_validate_json(self.world.next_request())
        assert self.conn is not None
        while True:
            try:
                raw = self.conn.recv_bytes()
            except (EOFError, OSError):  # the flow's end closed: end as if asked to
                raw = Call(id=0, request=Close(flow_gone=True)).model_dump_json().encode()
            try:
                call = Call.model_validate_json(raw)
            except ValidationError as exc:
                self._refuse(raw, exc)
                continue
            self.world.publish(raw)
            yield call

    def _refuse(self, raw: bytes, exc: ValidationError) -> None:
        try:
            call_id = int(json.loads(raw)["id"])
        except (ValueError, TypeError, KeyError):
            raise exc from None
        self.send(Answer(id=call_id, error=RemoteError.of(exc)))

    # -- the calls --

    def build(self, job: TrainerJob) -> Built:
        """Build the run of ``job`` in this rank: its store shared by the world's ranks, commits
        under the flow's lease; nothing written (the flow claims the store once it holds it)."""
        from ckptflow.storage import RankGroup

        from ..spec import load_spec_class

        config = job.config
        load_spec_class(config.spec)
        self.send(SpecImported())
        group = (
            RankGroup.create(timedelta(seconds=config.rank_timeout_seconds)) if self.world.size > 1 else None
        )
        store = open_store(config, job.storage_options, distributed=group)
        if job.writers:
            store.write_for(job.writers)  # commits go under the flow's lease, and no other writer's
        if self.world.leads and job.writers:
            # started before the flow took the store's lease: build nothing on a store another run holds
            store.refuse_if_held(writers=job.writers)
        built = self.rank.build(config, store, writes=False, log=self.notes)
        self.built = True
        return built

    def serve(self) -> None:
        """Carry out calls until ``close`` (or until the flow's end of the channel closes)."""
        for call in self.calls():
            request = call.request
            if isinstance(request, Close):
                self.rank.close()
                if not request.flow_gone:
                    self.send(Answer(id=call.id, reply=Done().model_dump(mode="json")))
                return
            self.current = call.id
            self.handle(call.id, request)

    def handle(self, call_id: int, request: Request) -> None:
        """Epochs and the staging of saves run here, in turn; waits in threads of their own."""
        from .childenv import FLOW_RUN_ENV

        rank = self.rank
        if isinstance(request, Train):
            self.answer(
                call_id,
                lambda: rank.train(
                    request.epoch, keep_snapshot=request.keep_snapshot, log=self.notes, until=request.until
                ),
            )
        elif isinstance(request, Save):
            self.answer(call_id, lambda: rank.save(request.version, log=self.notes))
        elif isinstance(request, Wait):
            self.in_thread(call_id, lambda: rank.wait(request.version))
        elif isinstance(request, Resubmit):
            self.answer(call_id, lambda: rank.resubmit(request.version))
        elif isinstance(request, FlowRun):  # for the spec's own logging
            os.environ[FLOW_RUN_ENV] = request.id
            self.answer(call_id, Done)


class _Stops:
    """The rank's SIGTERM handler, installed once: the first stop interrupts the rank's work (it
    raises :class:`_Interrupted`), every later one is only counted, and so is a stop once
    ``raising`` is off (the work has ended: the saves in flight commit first). Never swapping
    handlers while leaving matters: a stop that arrived while ``signal.signal`` itself ran got
    the old, raising handler, and its exception escaped the rank's cleanup as a traceback.

    A spec's ``train_steps`` is not interrupted: the rank stops after the step in progress,
    saves it and raises :class:`~.rank.Preempted` itself."""

    def __init__(self) -> None:
        self.count = 0
        self.raising = True
        self.rank: Rank | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.rank is not None:
            again = self.rank.terminating is not None
            self.rank.terminate()
            if self.rank.in_steps or again:  # the step ends, then the rank saves it: never cut that short
                self.raising = False
                return
        if self.raising:
            self.raising = False  # one interruption only: the rank is on its way out
            raise _Interrupted()


def _backend(requested: str) -> str:
    import torch

    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def serve_rank(job: str | None, fd: int | None, launcher: int | None) -> None:
    """A rank's life: join the world, take the job (from the flow, or from the leader), serve, leave.

    ``job`` (a :class:`~.protocol.TrainerJob`'s JSON) and ``fd`` (the flow's channel) are given
    to the ranks the flow's launcher forks; ``launcher`` is its pid: a rank dies with it, as it
    would with an in-process run.
    """
    import torch
    import torch.distributed as dist

    from .lifetime import die_with_parent
    from .rank import Preempted

    if launcher is not None:
        die_with_parent(signal.SIGKILL, launcher)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    given = TrainerJob.parse(job) if job is not None else None
    may_lead = given is not None and fd is not None and local_rank == 0
    # another machine's ranks get the job from the leader once they have joined: they join with defaults
    backend = given.config.dist_backend if given is not None else "auto"
    timeout = timedelta(seconds=given.config.rank_timeout_seconds if given is not None else JOIN_SECONDS)
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    stops = _Stops()
    signal.signal(signal.SIGTERM, stops)
    world = World.join(may_lead, _backend(backend), timeout)
    conn = Connection(fd) if world.leads and fd is not None else None
    if fd is not None and conn is None:
        os.close(fd)  # another local rank leads: this one never speaks to the flow
    server = Server(world, conn)
    stops.rank = server.rank
    signal.signal(signal.SIGUSR1, lambda signum, frame: server.rank.request_stop())
    try:
        if world.leads:
            assert given is not None
            if world.size > 1:
                world.store.set("job", given.model_dump_json())
        else:
            given = TrainerJob.parse(world.take("job"))
        the_job = given
        _set_threads(the_job.config.torch_threads, world.local_world)
        try:
            server.answer(0, lambda: server.build(the_job))
        except Exception:  # a follower: unless the leader failed too (the flow has its error), end the world
            if world.leads or not world.leader_failed_build(BUILD_VERDICT_SECONDS):
                raise
        if world.leads:
            world.tell_built(server.built)
        if server.built:
            server.serve()
        stops.raising = False  # from here a stop is counted: the saves in flight commit first
    except (_Interrupted, Preempted):
        stops.raising = False
        if world.size == 1:  # between requests: where the run stands is saved (one rank needs no peers)
            with contextlib.suppress(Exception):
                server.rank.preempt(server.notes)
    finally:
        stops.raising = False
        server.rank.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # nothing in flight: a stop now ends the process
    if stops.count:  # leave now, as a stopped rank (the agent waits for no result then)
        exit_now(128 + signal.SIGTERM)


def _set_threads(requested: int | None, local_world: int) -> None:
    """torch's intra-op threads in this process: :func:`~.threads.intra_op_threads` for one rank
    on this machine, the cores shared out for several (unless ``OMP_NUM_THREADS`` says)."""
    import torch

    from .threads import intra_op_threads

    threads = intra_op_threads(requested) if local_world == 1 else None
    if local_world > 1 and not os.environ.get("OMP_NUM_THREADS"):
        threads = max(1, (os.cpu_count() or 1) // local_world)
    if threads is not None:
        torch.set_num_threads(threads)


def main() -> int:
    """A rank started by ``torchrun`` on another machine: it joins a world a flow leads."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        serve_rank(None, None, None)
    return 0


def exit_now(code: int) -> None:
    """Leave without running C++ static destructors.

    A torch.distributed process that exits normally sometimes aborts in them ("terminate
    called without an active exception", SIGABRT, about 1 run in 10 on this machine), which
    would fail a run whose every checkpoint was committed. Everything of ours is flushed first.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        status = main()
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        traceback.print_exc()
        status = 1
    exit_now(status)
