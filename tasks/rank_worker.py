"""One training rank: it builds the run's objects and does what the flow asks, epoch by epoch.

Every training process is a rank of a torch.distributed world of size N >= 1,
started by torch's elastic launcher (:mod:`.launcher` on the flow's machine,
``torchrun`` on the others). One rank, the *leader* (local rank 0 on the
flow's machine), holds the flow's end of the channel: JSON requests
``{"id", "op", "args"}`` in, ``{"id", "ok"}`` / ``{"id", "error"}`` answers
and ``{"log", "message", "id"}`` notes out; nothing is unpickled. The leader
hands each request to the other ranks through the rendezvous store, in order,
and every rank carries it out: build and restore, train an epoch (a retry
restores its start state first), save (every rank writes its share, the leader's rank 0 commits), wait for a
save, close. The leader answers; the others only act. So the flow drives N
ranks exactly as it drives one.

The leader is rank 0 of the world the ranks build: ranks are renumbered from
it, so that it is the one that commits. Another machine joins a run with
``torchrun --nnodes 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m
ckptflow.tasks.rank_worker`` (the job, credentials included, comes from the
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
interrupted) stops the epoch in progress; the saves in flight commit before
the rank exits. No Prefect import here: a rank starts in a second, not five.
"""

from __future__ import annotations

import dataclasses
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
from typing import Any

log = logging.getLogger("ckptflow.rank")

STORE_PREFIX = "ckptflow"
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

    def publish(self, request: dict[str, Any]) -> None:
        """The leader: hand ``request`` to the other ranks (they take them in order)."""
        self.sent += 1
        if self.size > 1:
            self.store.set(f"request/{self.sent}", json.dumps(request))

    def next_request(self) -> dict[str, Any]:
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
        return dict(json.loads(self.take(key)))

    def take(self, key: str) -> bytes:
        """A follower: the value of ``key``; the last follower to read it deletes it (the job's
        credentials, and requests that would pile up over a long run)."""
        value = bytes(self.store.get(key))
        if self.store.add(f"read/{key}", 1) == self.size - 1:
            self.store.delete_key(key)
            self.store.delete_key(f"read/{key}")
        return value


class Rank:
    """The run's objects in this rank, and the requests it carries out."""

    def __init__(self, world: World, conn: Connection | None) -> None:
        self.world = world
        self.conn = conn
        self.send_lock = threading.Lock()
        self.run: Any = None
        self.attempts: Any = None
        self.handles: dict[int, Any] = {}
        self.current = 0  # the request being carried out in the main thread: its notes go with it

    # -- the flow's channel (the leader only) --

    def send(self, message: dict[str, Any]) -> None:
        if self.conn is None:
            return
        with self.send_lock:
            self.conn.send_bytes(json.dumps(message).encode())

    def log(self, level: str) -> Callable[[str], None]:
        if self.world.leads:
            return lambda message: self.send({"log": level, "message": message, "id": self.current})
        rank = self.world.rank
        return lambda message: getattr(log, level)("rank %d: %s", rank, message)

    def answer(self, call_id: int, work: Callable[[], Any]) -> None:
        """Carry out ``work``; the leader sends its answer or error, another rank fails on an error."""
        try:
            result = work()
        except Exception as exc:
            if not self.world.leads:
                raise
            frames = traceback.extract_tb(exc.__traceback__)
            place = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else ""  # tells repeats apart
            error = {
                "type": type(exc).__name__,
                "message": str(exc),
                "traceback": traceback.format_exc(),
                "place": place,
            }
            self.send({"id": call_id, "error": error})
        else:
            self.send({"id": call_id, "ok": result})

    def in_thread(self, call_id: int, work: Callable[[], Any]) -> None:
        def run() -> None:
            try:
                self.answer(call_id, work)
            except BaseException:  # a follower's failed write: end the world, as in the main thread
                traceback.print_exc()
                os._exit(1)

        threading.Thread(target=run, name="ckptflow-rank-call").start()

    def requests(self) -> Iterator[dict[str, Any]]:
        """The flow's requests: the leader reads and publishes them, the others take them in turn."""
        if not self.world.leads:
            while True:
                yield self.world.next_request()
        assert self.conn is not None
        while True:
            try:
                request = json.loads(self.conn.recv_bytes())
            except (EOFError, OSError):  # the flow's end closed: end as if asked to
                request = {"id": -1, "op": "close", "args": {}}
            self.world.publish(request)
            yield request

    # -- the requests --

    def build(self, job: dict[str, Any]) -> dict[str, Any]:
        import torch

        from ckptflow.storage import RankGroup

        from .config import PipelineConfig
        from .run_state import build_run, open_store
        from .spec import load_spec_class
        from .threads import intra_op_threads

        config = PipelineConfig.model_validate(job["config"])
        load_spec_class(config.spec)
        self.send({"spec": "ok"})
        world = self.world
        threads = intra_op_threads(config.torch_threads) if world.local_world == 1 else None
        if world.local_world > 1 and not os.environ.get("OMP_NUM_THREADS"):
            threads = max(1, (os.cpu_count() or 1) // world.local_world)
        if threads is not None:
            torch.set_num_threads(threads)
        timeout = timedelta(seconds=config.rank_timeout_seconds)
        group = RankGroup.create(timeout) if world.size > 1 else None
        store = open_store(config, job["storage_options"], distributed=group)
        if job.get("writers"):
            store.write_for(job["writers"])  # commits go under the flow's lease, and no other writer's
        if world.leads and job.get("writers"):
            from ckptflow.storage import refuse_if_held

            # started before the flow took the store's lease: build nothing on a store another run holds
            refuse_if_held(store.loc, writers=set(job["writers"]))
        # the flow writes run.json and sets unreadable versions aside once it holds the lease
        self.run = build_run(
            config,
            store,
            info=self.log("info"),
            warn=self.log("warning"),
            writes=False,
            world_size=world.size,
            rank=world.rank,
        )
        resumed = self.run.resumed_from
        return {
            "identity": self.run.identity,
            "epoch": self.run.epoch,
            "step": self.run.step,
            "resumed_from": dataclasses.asdict(resumed) if resumed is not None else None,
            "metrics": {str(k): v for k, v in self.run.metrics.items()},
            "threads": torch.get_num_threads(),
            "world_size": world.size,
            "planned_epochs": self.run.planned_epochs,
        }

    def serve(self) -> None:
        """Carry out requests until ``close`` (or until the flow's end of the channel closes)."""
        for request in self.requests():
            if request["op"] == "close":
                self.finish()
                if request["id"] >= 0:
                    self.send({"id": request["id"], "ok": None})
                return
            self.current = request["id"]
            self.handle(request["id"], request["op"], request["args"])

    def handle(self, call_id: int, op: str, args: dict[str, Any]) -> None:
        """Epochs and the staging of saves run here, in turn; writes and waits in threads of their own."""
        from .childenv import FLOW_RUN_ENV

        if op == "train":
            self.answer(call_id, lambda: self.train(args["epoch"], bool(args["keep_snapshot"])))
        elif op == "save" and args["async"]:
            self.answer(call_id, lambda: self.save_async(args["epoch"]))
        elif op == "save":
            (shared, own), kwargs = self.capture(args["epoch"])
            store = self.run.store
            self.in_thread(call_id, lambda: dataclasses.asdict(store.save(shared, rank_state=own, **kwargs)))
        elif op == "wait":
            handle = self.handles[args["version"]]
            self.in_thread(call_id, lambda: dataclasses.asdict(handle.wait()))
        elif op == "flow_run":  # for the spec's own logging
            os.environ[FLOW_RUN_ENV] = args["id"]
            self.answer(call_id, lambda: None)
        elif op == "resubmit":
            self.answer(call_id, self.handles[args["version"]].resubmit)
        else:
            self.answer(call_id, lambda: _unknown(op))

    def capture(self, epoch: int) -> tuple[tuple[dict[str, Any], dict[str, Any] | None], dict[str, Any]]:
        """The state to save (shared, this rank's own), and the save's arguments."""
        from .run_state import capture_run, save_options
        from .training_state import is_sharded, split_ranked

        run = self.run
        kwargs = save_options(run, epoch)
        state = capture_run(run, self.log("warning"))
        if self.world.size == 1 and not is_sharded(run.local()[1].model):  # sharded: RNGs stay apart
            return (state, None), kwargs
        return split_ranked(state), kwargs

    def save_async(self, epoch: int) -> int:
        (shared, own), kwargs = self.capture(epoch)
        self.handles[epoch] = self.run.store.save_async(shared, rank_state=own, **kwargs)
        return epoch

    def train(self, epoch: int, keep_snapshot: bool) -> dict[str, Any]:
        """An attempt at ``epoch``: the first keeps the epoch's start state (``keep_snapshot``), a
        later one (the flow's retry after an error) restores it first."""
        from .run_state import EpochAttempts, train_attempt

        if self.attempts is None or self.attempts.epoch != epoch:
            if epoch != self.run.epoch + 1:
                raise RuntimeError(
                    f"asked to train epoch {epoch}, but these trainers stand at epoch {self.run.epoch}"
                )
            self.attempts = EpochAttempts(self.run, keep_snapshot=keep_snapshot)
        self.attempts.count += 1
        metrics = train_attempt(self.run, epoch, self.attempts, self.log("warning"))
        return {"metrics": metrics, "step": self.run.step}

    def finish(self) -> None:
        """Let every save end (committed or failed) before the rank exits."""
        for handle in self.handles.values():
            handle.join()
        if self.run is not None:
            self.run.store.close()


def _unknown(op: str) -> None:
    raise ValueError(f"unknown training request {op!r}")


class _Stops:
    """The rank's SIGTERM handler, installed once: the first stop interrupts the rank's work (it
    raises :class:`_Interrupted`), every later one is only counted, and so is a stop once
    ``raising`` is off (the work has ended: the saves in flight commit first). Never swapping
    handlers while leaving matters: a stop that arrived while ``signal.signal`` itself ran got
    the old, raising handler, and its exception escaped the rank's cleanup as a traceback."""

    def __init__(self) -> None:
        self.count = 0
        self.raising = True

    def __call__(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.raising:
            self.raising = False  # one interruption only: the rank is on its way out
            raise _Interrupted()


def _backend(requested: str) -> str:
    import torch

    if requested != "auto":
        return requested
    return "nccl" if torch.cuda.is_available() else "gloo"


def serve_rank(job: dict[str, Any] | None, fd: int | None, launcher: int | None) -> None:
    """A rank's life: join the world, take the job (from the flow, or from the leader), serve, leave.

    ``job`` and ``fd`` (the flow's channel) are given to the ranks the flow's launcher forks;
    ``launcher`` is its pid: a rank dies with it, as it would with an in-process run.
    """
    import torch
    import torch.distributed as dist

    from .lifetime import die_with_parent

    if launcher is not None:
        die_with_parent(signal.SIGKILL, launcher)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    may_lead = job is not None and fd is not None and local_rank == 0
    world_job = (job or {}).get("world", {})
    timeout = timedelta(seconds=float(world_job.get("timeout", 600)))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    stops = _Stops()
    signal.signal(signal.SIGTERM, stops)
    world = World.join(may_lead, _backend(world_job.get("backend", "auto")), timeout)
    conn = Connection(fd) if world.leads and fd is not None else None
    if fd is not None and conn is None:
        os.close(fd)  # another local rank leads: this one never speaks to the flow
    rank = Rank(world, conn)
    try:
        if world.leads:
            assert job is not None
            if world.size > 1:
                world.store.set("job", json.dumps(job))
        else:
            job = json.loads(world.take("job"))
        assert job is not None
        try:
            rank.answer(0, lambda: rank.build(job))
        except Exception:  # a follower: unless the leader failed too (the flow has its error), end the world
            if world.leads or not world.leader_failed_build(BUILD_VERDICT_SECONDS):
                raise
        if world.leads:
            world.tell_built(rank.run is not None)
        if rank.run is not None:
            rank.serve()
        stops.raising = False  # from here a stop is counted: the saves in flight commit first
    except _Interrupted:
        pass
    finally:
        stops.raising = False
        rank.finish()
        if dist.is_initialized():
            dist.destroy_process_group()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # nothing in flight: a stop now ends the process
    if stops.count:  # leave now, as a stopped rank (the agent waits for no result then)
        exit_now(128 + signal.SIGTERM)


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
