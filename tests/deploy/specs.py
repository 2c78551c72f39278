"""The training spec of the deployment tests: the demo's DigitsSpec, observable and slowed on request.

Deployed runs execute in a worker's child process, and one worker may run
several at once, so each run has its own marker directory, named by the
spec's config key ``markers`` (the config is part of the run identity: a
resumed run passes the same one). The run writes there ``pid`` (its process
id) when built and ``epoch-<n>-started`` (holding the flow run id) as each
epoch begins. The test steers it with ``steer.json`` in that directory, read
when the spec is built (remove it and the next run goes at full speed):

- ``slow_from`` / ``slow_seconds``: sleep that long in every epoch >= ``slow_from``;
- ``slow_commit``: ``[version, seconds]``: the commit of that version (the
  manifest write, once every shard is on disk) first writes
  ``commit-<version>-started`` and waits until SIGTERM has reached the process
  (``sigterm`` below), at most ``seconds``, then commits and writes
  ``commit-<version>-done`` (both holding ``time.time()``): a test can cancel
  the run while a save is in flight, at the instant that matters most, however
  long the cancellation takes to arrive on a loaded machine.

And when SIGTERM reaches the process (a worker cancelling the run), it writes
``sigterm`` (holding ``time.time()``) before Prefect's own handler runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from ckptflow.flows.demo import DigitsSpec
from ckptflow.tasks.spec import Trainable

SPEC = "tests.deploy.specs:ObservedDigitsSpec"
BASE_CONFIG = {"hidden": 32, "batch_size": 128}


def spec_params(markers: Path, **steer: Any) -> dict[str, Any]:
    """``spec`` and ``spec_config`` of a training config for this spec; ``steer`` goes to steer.json."""
    markers.mkdir(parents=True, exist_ok=True)
    if steer:
        (markers / "steer.json").write_text(json.dumps(steer))
    # This spec watches the flow's own process (its SIGTERM handler, Prefect's flow run context):
    # it trains there. Deployed runs of the other tests train in trainers, the default.
    return {"spec": SPEC, "spec_config": {**BASE_CONFIG, "markers": str(markers)}, "train_process": False}


def _slow_commit(directory: Path, version: int, seconds: float) -> None:
    from ckptflow.storage.versions import commit as protocol

    original = protocol.commit

    def commit(loc: Any, manifest: Any, **options: Any) -> None:
        if manifest.version != version:
            original(loc, manifest, **options)
            return
        (directory / f"commit-{version}-started").write_text(repr(time.time()))
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not (directory / "sigterm").exists():
            time.sleep(0.05)
        original(loc, manifest, **options)
        (directory / f"commit-{version}-done").write_text(repr(time.time()))

    protocol.commit = commit


def _record_sigterm(directory: Path) -> None:
    """Write ``sigterm`` (holding ``time.time()``) when SIGTERM arrives, then let Prefect's handler run."""
    previous = signal.getsignal(signal.SIGTERM)
    if not callable(previous):
        return

    def handler(signum: int, frame: Any) -> None:
        (directory / "sigterm").write_text(repr(time.time()))
        previous(signum, frame)

    with contextlib.suppress(ValueError):  # not the main thread: nothing to record
        signal.signal(signal.SIGTERM, handler)


class ObservedDigitsSpec(DigitsSpec):
    """DigitsSpec that reports its process and epochs to a marker directory, and slows down on request."""

    steer: dict[str, Any]

    def build(self) -> Trainable:
        self.steer = {}
        directory = self._markers()
        if directory is not None:
            (directory / "pid").write_text(str(os.getpid()))
            _record_sigterm(directory)
            steer_file = directory / "steer.json"
            self.steer = json.loads(steer_file.read_text()) if steer_file.exists() else {}
            if self.steer.get("slow_commit"):
                version, seconds = self.steer["slow_commit"]
                _slow_commit(directory, int(version), float(seconds))
        return super().build()

    def train_epoch(self, trainable: Trainable, epoch: int) -> dict[str, float]:
        directory = self._markers()
        if directory is not None:
            from prefect.runtime import flow_run

            (directory / f"epoch-{epoch}-started").write_text(str(flow_run.get_id() or ""))
            if epoch >= int(self.steer.get("slow_from", 10**9)):
                time.sleep(float(self.steer.get("slow_seconds", 0)))
        return super().train_epoch(trainable, epoch)

    def _markers(self) -> Path | None:
        directory = self.config.get("markers")
        return Path(directory) if directory else None
