"""One rank of a multi-process training run: ``python -m ckptflow.tasks.rank_worker``.

The pipeline's ``train_ranks`` task starts it once per rank on its machine;
any launcher that sets torch.distributed's environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) can start it
the same way, e.g. ``torchrun --nproc-per-node 2 -m ckptflow.tasks.rank_worker
job.json``. Its job is JSON, ``{"config": <PipelineConfig>, "storage_options":
{...}}``: the pipeline passes it on stdin, so that credentials never show in a
process listing or the environment; other launchers name a file.

Every rank builds the spec, restores the newest committed checkpoint (the
replicated state straight into its tensors, its own RNG and spec state from
its own file), trains, and saves through a distributed store: each rank writes
its share of the replicated state, rank 0 commits. Rank 0 decides when to stop
(the epoch budget, the stop conditions, a cancellation relayed by the parent)
and tells the others; rank 0 also reports epochs and commits to the parent,
which turns them into Prefect logs, artifacts and events.

Per-rank state when the number of ranks changed: rank 0 takes rank 0's saved
state; every other rank starts from rank 0's state too and then reseeds its
RNGs from (seed, epoch, rank), so that ranks do not draw the same numbers.

No Prefect import here: a rank starts in a second, not five.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
import warnings
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ckptflow.storage import CheckpointStore, RankGroup, SaveHandle, StoreOptions, VersionInfo

from .childenv import REPORT_ADDRESS_ENV, REPORT_KEY_ENV
from .config import PipelineConfig
from .run_state import RUN_FILE
from .spec import RunFacts, Trainable, TrainingSpec, make_spec
from .stopping import CANCELLED, SIGTERM_STOP, StopTracker
from .training_state import capture, restore, rng_state, run_epoch, seed_everything, split_ranked

log = logging.getLogger("ckptflow.rank")


def rank_seed(seed: int, epoch: int, rank: int) -> int:
    """The RNG seed of a rank whose own state was not saved (the number of ranks changed)."""
    return (seed * 1_000_003 + epoch) * 1_009 + rank


class Reporter:
    """Rank 0's line to the parent: JSON messages out, a cancellation request in."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.cancelled = False

    @classmethod
    def from_env(cls) -> Reporter | None:
        address = os.environ.get(REPORT_ADDRESS_ENV)
        if not address:
            return None
        from multiprocessing.connection import Client

        host, _, port = address.rpartition(":")
        return cls(Client((host, int(port)), authkey=bytes.fromhex(os.environ[REPORT_KEY_ENV])))

    def send(self, kind: str, **data: Any) -> None:
        self.conn.send_bytes(json.dumps({"kind": kind, **data}).encode())

    def cancel_requested(self) -> bool:
        while not self.cancelled and self.conn.poll():
            self.cancelled = json.loads(self.conn.recv_bytes()).get("kind") == "cancel"
        return self.cancelled


class RankTrainer:
    """The training loop of one rank."""

    def __init__(self, config: PipelineConfig, storage_options: dict[str, Any], reporter: Reporter | None):
        self.config = config
        self.reporter = reporter
        timeout = timedelta(seconds=config.rank_timeout_seconds)
        self.store = CheckpointStore(
            config.storage,
            storage_options=storage_options,
            options=StoreOptions(shards=config.shards),
            distributed=RankGroup.create(timeout),
        )
        self.control = RankGroup.create(timeout)  # stop decisions; never shared with a save in flight
        self.rank, self.world = self.control.rank, self.control.world_size
        facts = RunFacts(
            epochs=config.epochs,
            save_every=config.save_every,
            world_size=self.world,
            rank=self.rank,
            storage=self.store.url,
        )
        self.spec: TrainingSpec = make_spec(config.spec, config.spec_config, seed=config.seed, run=facts)
        seed_everything(config.seed)  # every rank builds the same model
        self.trainable: Trainable = self.spec.build()
        self.epoch, self.step = 0, 0
        self.history: dict[int, dict[str, float]] = {}
        self.term = threading.Event()

    def run(self) -> None:
        resumed = self._resume()
        if self.rank == 0:  # built and restored: now the store is this run's (the flow checked it)
            self.store.write_json(RUN_FILE, self.config.identity())
        self.rng = rng_state()
        stopper = StopTracker(self.config.stop, self.config.epochs)
        stopper.seed(self.history)
        self._report("started", resumed_from=resumed, epoch=self.epoch, world_size=self.world)
        reason = f"already at epoch {self.epoch}" if self.epoch >= self.config.epochs else None
        pending: SaveHandle | None = None
        while reason is None:
            epoch = self.epoch + 1
            metrics = self._train(epoch)
            if self.rank == 0:
                self._report("epoch", epoch=epoch, metrics=metrics)
                reason = stopper.update(epoch, metrics) or self._interrupted()
            reason = self.control.broadcast(reason)
            if epoch % self.config.save_every == 0 or reason is not None:
                self._committed(pending)
                pending = self._save(epoch, metrics)
        self._committed(pending)
        self.store.close()
        self._report("done", reason=reason, epoch=self.epoch)

    def _resume(self) -> int | None:
        version = self.control.agree(lambda: _latest_version(self.store), "finding the newest checkpoint")
        if version is None:
            self._reseed(0)
            return None
        manifest = self.store.manifest(version)
        shared, _ = split_ranked(capture(self.trainable, self.spec, epoch=0, step=0))
        state = self.store.load(version, into=shared)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            own = self.store.load_rank_state(version)
        for w in caught:
            log.warning("rank %d: %s", self.rank, w.message)
        same_world = len(manifest.ranks) == self.world or (not manifest.ranks and self.world == 1)
        own = own if own is not None else {k: state.pop(k) for k in ("rng", "spec") if k in state}
        self.epoch, self.step = restore(self.trainable, self.spec, {**state, **own})
        if not same_world:
            self._reseed(self.epoch)
        if self.rank == 0:
            self.history = {v.epoch: v.metrics for v in self.store.versions() if v.epoch is not None}
        return version

    def _reseed(self, epoch: int) -> None:
        if self.rank > 0:
            seed_everything(rank_seed(self.config.seed, epoch, self.rank))

    def _train(self, epoch: int) -> dict[str, float]:
        clean, steps, self.rng = run_epoch(self.spec, self.trainable, epoch, self.rng)
        self.epoch, self.step = epoch, self.step + steps
        self.history[epoch] = clean
        return clean

    def _save(self, epoch: int, metrics: dict[str, float]) -> SaveHandle | None:
        state = capture(self.trainable, self.spec, epoch=self.epoch, step=self.step, rng=self.rng)
        shared, own = split_ranked(state)
        kwargs: dict[str, Any] = {"epoch": epoch, "step": self.step, "metrics": metrics, "version": epoch}
        if self.config.async_save:
            return self.store.save_async(shared, rank_state=own, **kwargs)
        self._report_commit(self.store.save(shared, rank_state=own, **kwargs))
        return None

    def _committed(self, pending: SaveHandle | None) -> None:
        if pending is not None:
            self._report_commit(pending.wait())

    def _report_commit(self, info: VersionInfo) -> None:
        from dataclasses import asdict

        self._report("committed", info=asdict(info))

    def _interrupted(self) -> str | None:
        if self.term.is_set():
            return SIGTERM_STOP
        if self.reporter is not None and self.reporter.cancel_requested():
            return CANCELLED
        return None

    def _report(self, kind: str, **data: Any) -> None:
        if self.reporter is not None:
            self.reporter.send(kind, **data)
        elif self.rank == 0:
            log.info("%s %s", kind, data)


def _latest_version(store: CheckpointStore) -> int | None:
    latest = store.latest()
    return latest.version if latest is not None else None


def _backend(config: PipelineConfig) -> str:
    if config.dist_backend != "auto":
        return config.dist_backend
    return "nccl" if torch.cuda.is_available() else "gloo"


def _exit_with_parent() -> None:
    """End this rank if the process that started it dies (a SIGKILLed flow must not leave ranks behind)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.2)
        os._exit(70)

    threading.Thread(target=watch, name="ckptflow-parent-watch", daemon=True).start()


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s rank %(process)d %(levelname)s %(message)s")
    if len(argv) > 1 and argv[1] != "-":
        with open(argv[1], encoding="utf-8") as f:
            job = json.load(f)
    else:
        job = json.loads(sys.stdin.read())
    config = PipelineConfig.model_validate(job["config"])
    _exit_with_parent()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(_backend(config), timeout=timedelta(seconds=config.rank_timeout_seconds))
    try:
        reporter = Reporter.from_env() if dist.get_rank() == 0 else None
        trainer = RankTrainer(config, job.get("storage_options") or {}, reporter)
        signal.signal(signal.SIGTERM, lambda *_: trainer.term.set())  # finish the epoch, save, commit
        trainer.run()
        dist.barrier()  # rank 0 hosts the rendezvous store: nobody leaves while others still use it
    finally:
        dist.destroy_process_group()
    return 0


def _exit(code: int) -> None:
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
        status = main(sys.argv)
    except SystemExit as stop:
        status = stop.code if isinstance(stop.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        status = 1
    _exit(status)
