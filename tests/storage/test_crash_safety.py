"""Crash safety: SIGKILL a real saving process at any instant; the store stays consistent.

A child process (``crash_child.py``) saves a ~128 MiB training-like state as
version after version. After it has committed at least one version, the test
kills it with SIGKILL, either at a random moment spread over the write of the
next version (before the shards, mid-shard, between the shards and the
manifest, just after the manifest) or at a precise point of the commit
protocol the child arranges itself. Then, from a fresh store:

- every listed version loads bitwise-equal to what the child saved as it
  (recomputed here from the seed and the version number),
- the newest committed version is at least the last one the child reported,
- no directory without a manifest is listed, and ``gc()`` removes exactly
  those, after which the root holds only committed version dirs and ``latest``,
- a new save works and gets a higher version number.

The random moments come from a seeded RNG (``CKPTFLOW_CRASH_SEED`` changes
it); delays are drawn after the child's ``saving N`` line, as a fraction of
the measured time of one save, stratified over the trials so that every
phase of the write gets hit.
"""

from __future__ import annotations

import json
import os
import queue
import random
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch

from ckptflow.storage import CheckpointStore, StoreOptions
from ckptflow.storage.versions.claims import CLAIM_FILE
from tests.children import CHILDREN
from tests.children.crash_child import KILL_POINTS, make_state

pytestmark = pytest.mark.crash

CHILD = CHILDREN / "crash_child.py"
ROOT_DIR = Path(__file__).resolve().parents[2]
SEED = int(os.environ.get("CKPTFLOW_CRASH_SEED", "20240611"))
LOCAL_MIB = 128
S3_MIB = 48
SYNC_TRIALS = 9
ASYNC_TRIALS = 5
S3_TRIALS = 3
LINE_TIMEOUT = 60.0


# -- the child process ---------------------------------------------------------


@dataclass
class Child:
    """A running crash_child.py; its stdout lines are collected with arrival times."""

    proc: subprocess.Popen
    stderr_path: Path
    lines: queue.Queue = field(default_factory=queue.Queue)
    seen: list[tuple[float, str]] = field(default_factory=list)

    @classmethod
    def start(
        cls,
        url: str,
        seed: int,
        tmp: Path,
        *,
        mode: str = "sync",
        mib: int = LOCAL_MIB,
        kill_at: str | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> Child:
        cmd = [sys.executable, str(CHILD), url, str(seed), "--mode", mode, "--mib", str(mib)]
        if kill_at:
            cmd += ["--kill-at", kill_at]
        env = {**os.environ, "CKPTFLOW_STORAGE_OPTIONS": json.dumps(storage_options)}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT_DIR), env.get("PYTHONPATH")]))
        stderr_path = tmp / f"child-{uuid.uuid4().hex[:8]}.err"
        with open(stderr_path, "wb") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=env, cwd=ROOT_DIR)
        child = cls(proc, stderr_path)
        threading.Thread(target=child._pump, daemon=True).start()
        return child

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.put((time.monotonic(), raw.decode().strip()))
        self.lines.put((time.monotonic(), None))

    def wait_for(self, line: str) -> float:
        """Block until the child prints ``line`` (plus maybe more words); return when it arrived."""
        deadline = time.monotonic() + LINE_TIMEOUT
        while True:
            try:
                at, text = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"the child did not print {line!r} within {LINE_TIMEOUT:.0f}s{self._tail()}")
            if text is None:
                pytest.fail(f"the child exited ({self.proc.wait()}) before printing {line!r}{self._tail()}")
            self.seen.append((at, text))
            if text == line or text.startswith(line + " "):
                return at

    def kill(self) -> list[str]:
        """SIGKILL the child; return every line it printed, including those not read yet."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        while True:
            at, text = self.lines.get(timeout=30)
            if text is None:
                break
            self.seen.append((at, text))
        return [text for _, text in self.seen]

    def reap(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def _tail(self) -> str:
        err = self.stderr_path.read_text(errors="replace")[-3000:]
        return f"\nlines: {[t for _, t in self.seen]}\nstderr:\n{err}"


def last_reported(lines: list[str]) -> int:
    committed = [int(line.split()[1]) for line in lines if line.startswith("committed ")]
    return max(committed, default=-1)


# -- raw access to the store's files, bypassing the library ----------------------


@dataclass(frozen=True)
class Raw:
    fs: fsspec.AbstractFileSystem
    root: str

    @classmethod
    def open(cls, url: str, storage_options: dict[str, Any] | None) -> Raw:
        fs, root = fsspec.core.url_to_fs(url, **{**(storage_options or {}), "skip_instance_cache": True})
        return cls(fs, root.rstrip("/"))

    def listdir(self, rel: str = "") -> set[str]:
        path = f"{self.root}/{rel}".rstrip("/")
        self.fs.invalidate_cache()
        if not self.fs.exists(path):
            return set()
        return {p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(path, detail=False)}

    def version_dirs(self) -> dict[int, set[str]]:
        """Every ``v%06d`` entry under the root and the names inside it."""
        return {int(n[1:]): self.listdir(n) for n in self.listdir() if n.startswith("v") and n[1:].isdigit()}

    def read(self, rel: str) -> bytes:
        return self.fs.cat_file(f"{self.root}/{rel}")


# -- comparing states bit for bit -----------------------------------------------


def assert_bitwise_equal(actual: Any, expected: Any, path: str = "") -> None:
    where = path or "<root>"
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: {type(actual).__name__}, expected a tensor"
        assert (actual.dtype, tuple(actual.shape)) == (expected.dtype, tuple(expected.shape)), where
        a = actual.contiguous().reshape(-1).view(torch.uint8)
        e = expected.contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(a, e), f"{where}: the bytes differ"
    elif isinstance(expected, np.ndarray):
        assert isinstance(actual, np.ndarray), f"{where}: {type(actual).__name__}, expected an ndarray"
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), where
        assert actual.tobytes() == expected.tobytes(), f"{where}: the bytes differ"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), where
        assert list(actual) == list(expected), f"{where}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            assert_bitwise_equal(actual[key], expected[key], f"{path}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_bitwise_equal(a, e, f"{path}/{i}")
    elif isinstance(expected, float):
        assert isinstance(actual, float) and struct.pack("<d", actual) == struct.pack("<d", expected), where
    else:
        assert type(actual) is type(expected) and actual == expected, f"{where}: {actual!r} != {expected!r}"


# -- what must hold after a crash -----------------------------------------------


@dataclass(frozen=True)
class Outcome:
    committed: list[int]  # versions listed after the crash, before gc
    leftovers: list[int]  # version dirs without a manifest, removed by gc
    root_before_gc: set[str]


def check_after_crash(
    url: str,
    storage_options: dict[str, Any] | None,
    *,
    seed: int,
    mib: int,
    reported: int,
    max_ahead: int,
) -> Outcome:
    """Assert every invariant of a store whose writer was just killed; return what was found."""
    raw = Raw.open(url, storage_options)
    root_before = raw.listdir()
    dirs = raw.version_dirs()
    leftovers = sorted(v for v, names in dirs.items() if "manifest.json" not in names)

    store = CheckpointStore(url, storage_options=storage_options, options=StoreOptions(threads=2))
    listed = [info.version for info in store.versions()]
    context = f"listed {listed}, dirs {dict(sorted(dirs.items()))}, reported {reported}"
    assert listed == list(range(len(listed))), f"committed versions have gaps: {context}"
    assert listed, f"the store lost every version: {context}"
    assert listed[-1] >= reported, f"the last reported version is not committed: {context}"
    assert listed[-1] <= reported + max_ahead, context
    assert not set(leftovers) & set(listed), f"a version without manifest is listed: {context}"
    assert store.latest().version == listed[-1], context

    for v in listed:
        assert "manifest.json" in dirs[v], context
        assert store.manifest(v).epoch == v
        assert_bitwise_equal(store.load(v), make_state(seed, v, mib))  # checksums verified on load

    assert sorted(store.gc()) == leftovers, context
    assert raw.listdir() == {f"v{v:06d}" for v in listed} | {"latest"}, f"after gc: {raw.listdir()}"
    held: dict[int, set[str]] = {v: set() for v in listed}  # each directory's files, as manifests list them
    for v in listed:
        for s in store.manifest(v).shards:
            held.setdefault(v if s.version is None else s.version, set()).add(s.file)
    for v in listed:
        assert raw.listdir(f"v{v:06d}") == held[v] | {"manifest.json"}, f"stray files in v{v:06d}"
    hinted = raw.read("latest").decode().strip()
    assert hinted in {f"v{v:06d}" for v in listed}, f"latest points at {hinted!r}: {context}"

    new_state = {"after": torch.arange(1000, dtype=torch.float64) * seed, "epoch": listed[-1] + 1}
    info = store.save(new_state, epoch=listed[-1] + 1)
    assert info.version == listed[-1] + 1 > reported
    assert store.latest().version == info.version
    assert_bitwise_equal(store.load(), new_state)
    assert raw.read("latest").decode().strip() == f"v{info.version:06d}"
    store.close()
    return Outcome(listed, leftovers, root_before)


def kill_at_random(child: Child, rng: random.Random, *, fraction: float, first: int, scale: float) -> float:
    """Let versions up to ``first - 1`` commit, then kill ``fraction * scale`` save-times after
    ``saving first``; return the delay used."""
    previous = child.wait_for(f"saving {first - 1}")
    started = child.wait_for(f"saving {first}")
    period = max(started - previous, 0.01)  # one save (sync) or one save cycle (async)
    delay = fraction * scale * period
    time.sleep(max(0.0, started + delay - time.monotonic()))
    os.kill(child.proc.pid, signal.SIGKILL)
    return delay


def stratified(trials: int, trial: int, rng: random.Random) -> float:
    """A fraction in [0, 1): trial ``i`` of ``n`` draws from the i-th of n equal slices."""
    return (trial + rng.random()) / trials


@pytest.fixture
def local_url(tmp_path: Path):
    root = tmp_path / "store"
    yield str(root)
    shutil.rmtree(root, ignore_errors=True)  # a few hundred MiB per trial: do not keep them


def _random_trial(
    url: str,
    tmp_path: Path,
    *,
    mode: str,
    trial: int,
    trials: int,
    mib: int,
    storage_options: dict[str, Any] | None = None,
) -> Outcome:
    backend = "s3" if storage_options else "local"
    rng = random.Random(f"{SEED}:{backend}:{mode}:{trial}")
    seed = rng.randrange(1 << 30)
    fraction = stratified(trials, trial, rng)
    # async: the period between two "saving" lines is one cycle only from the 2nd version on
    first = rng.choice([1, 2]) if mode == "sync" else rng.choice([2, 3])
    scale = 1.15 if mode == "sync" else 2.0
    child = Child.start(url, seed, tmp_path, mode=mode, mib=mib, storage_options=storage_options)
    try:
        delay = kill_at_random(child, rng, fraction=fraction, first=first, scale=scale)
        lines = child.kill()
    finally:
        child.reap()
    reported = last_reported(lines)
    # async: version N-2 is reported once save_async(N-1) has returned, before "saving N"
    assert reported >= (first - 1 if mode == "sync" else first - 2) >= 0, lines
    outcome = check_after_crash(
        url,
        storage_options,
        seed=seed,
        mib=mib,
        reported=reported,
        max_ahead=1 if mode == "sync" else 2,
    )
    print(
        f"trial {trial}: seed {seed}, killed {delay * 1000:.0f} ms after 'saving {first}'; "
        f"reported {reported}, committed {outcome.committed}, leftovers {outcome.leftovers}"
    )
    return outcome


# -- the tests ------------------------------------------------------------------


class TestKillDuringSave:
    """SIGKILL at a random moment of a synchronous save, on a local disk."""

    @pytest.mark.parametrize("trial", range(SYNC_TRIALS))
    def test_store_consistent_after_kill(self, local_url: str, tmp_path: Path, trial: int) -> None:
        _random_trial(local_url, tmp_path, mode="sync", trial=trial, trials=SYNC_TRIALS, mib=LOCAL_MIB)


class TestKillDuringAsyncSave:
    """SIGKILL while ``save_async`` writes in the background and training changes the state."""

    @pytest.mark.parametrize("trial", range(ASYNC_TRIALS))
    def test_store_consistent_after_kill(self, local_url: str, tmp_path: Path, trial: int) -> None:
        _random_trial(local_url, tmp_path, mode="async", trial=trial, trials=ASYNC_TRIALS, mib=LOCAL_MIB)


# (kill point, committed versions right after the kill, leftover dirs, an entry of the leftover dir)
EXPECTED_AT_POINT = {
    "mid-shard": ([0], [1], None),
    "before-manifest": ([0], [1], None),
    "manifest-rename": ([0], [1], ".manifest.json."),
    "before-latest": ([0, 1], [], None),
    "latest-rename": ([0, 1], [], None),
}


class TestKillAtEachCommitStep:
    """SIGKILL at each step of the commit protocol of version 1, deterministically."""

    def test_every_kill_point_is_tested(self) -> None:
        assert set(EXPECTED_AT_POINT) == set(KILL_POINTS)

    @pytest.mark.parametrize("point", KILL_POINTS)
    def test_store_consistent_after_kill(self, local_url: str, tmp_path: Path, point: str) -> None:
        """Bug fixed: a kill at ``latest-rename`` left ``.latest.<hex>.tmp`` in the root and gc kept it."""
        seed = random.Random(f"{SEED}:{point}").randrange(1 << 30)
        child = Child.start(local_url, seed, tmp_path, kill_at=point)
        try:
            child.wait_for("committed 0")
            assert child.proc.wait(timeout=LINE_TIMEOUT) == -signal.SIGKILL, child._tail()
            lines = child.kill()
        finally:
            child.reap()
        assert lines == ["saving 0", lines[1], "saving 1"] and lines[1].startswith("committed 0 ")

        committed, leftovers, marker = EXPECTED_AT_POINT[point]
        dirs = Raw.open(local_url, None).version_dirs()
        if point == "before-manifest":
            shards = dirs[1] - {CLAIM_FILE}  # the claim goes with the commit
            assert CLAIM_FILE in dirs[1] and len(shards) == 4, dirs[1]
            assert all(n.endswith(".h5") for n in shards), dirs[1]
        if marker:
            assert any(n.startswith(marker) for n in dirs[1]), dirs[1]
        outcome = check_after_crash(local_url, None, seed=seed, mib=LOCAL_MIB, reported=0, max_ahead=1)
        assert (outcome.committed, outcome.leftovers) == (committed, leftovers)
        if point == "latest-rename":
            assert any(n.startswith(".latest.") for n in outcome.root_before_gc), outcome.root_before_gc


@pytest.mark.s3
class TestKillDuringSaveOnS3:
    """SIGKILL during saves to a real S3 protocol server (SeaweedFS): uploads are atomic per object."""

    @pytest.mark.parametrize("trial", range(S3_TRIALS))
    def test_store_consistent_after_kill(
        self, s3_bucket: tuple[str, dict[str, Any]], tmp_path: Path, trial: int
    ) -> None:
        bucket, options = s3_bucket
        _random_trial(
            f"s3://{bucket}/run",
            tmp_path,
            mode="sync",
            trial=trial,
            trials=S3_TRIALS,
            mib=S3_MIB,
            storage_options=options,
        )


class TestDurableOnReturn:
    def test_a_save_returns_once_everything_its_version_needs_is_fsynced(
        self, tmp_path: Path, monkeypatch: Any
    ) -> None:
        """A process kill cannot undo what the kernel holds, but a crash of the machine undoes what
        is not fsynced: before ``save`` returns, the shard's bytes, the manifest's bytes, their
        entries in the version directory (after both), and the version directory's own entry in
        the root must be on disk."""
        import torch

        from ckptflow.storage import CheckpointStore

        synced: list[str] = []
        real = os.fsync

        def record(fd: int) -> None:
            synced.append(os.readlink(f"/proc/self/fd/{fd}"))
            real(fd)

        store = CheckpointStore(tmp_path / "store")
        store.save({"w": torch.ones(3)})  # the store's first save also makes its root
        monkeypatch.setattr(os, "fsync", record)
        info = store.save({"w": torch.zeros(3)})
        root = str(tmp_path / "store")
        vdir = f"{root}/v{info.version:06d}"
        (shard,) = [f"{vdir}/{s.file}" for s in store.manifest(info.version).shards]
        manifest_bytes = [i for i, p in enumerate(synced) if p.startswith(f"{vdir}/.manifest.json.")]
        assert root in synced, f"the version directory's entry in the root is not fsynced: {synced}"
        assert shard in synced and manifest_bytes, synced
        last_dir_sync = max(i for i, p in enumerate(synced) if p == vdir)
        assert last_dir_sync > max(synced.index(shard), *manifest_bytes), (
            "the version directory is fsynced after the shard and the manifest are written"
        )
