"""Background saves: one writer thread, at most one save in flight.

The caller has already copied the state into staging memory; the background
thread writes the shards and commits. A failure is kept on the handle and
raised by ``wait()``; if nobody waited, the next save (or ``close``) raises
it instead, so a failed checkpoint is never silently skipped.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from ..errors import SaveFailedError

if TYPE_CHECKING:
    from ..info import VersionInfo

log = logging.getLogger(__name__)


class SaveHandle:
    """The result of :meth:`CheckpointStore.save_async`."""

    def __init__(self, saver: AsyncSaver, job: Callable[[], VersionInfo], version: int) -> None:
        self._saver = saver
        self._job = job
        self._future: Future[Any] = saver._start(job)
        self.version = version
        self._reported = False
        self.attempts = 1
        self._on_commit: list[Callable[[VersionInfo], None]] = []

    def on_commit(self, callback: Callable[[VersionInfo], None]) -> None:
        """Call ``callback(info)`` once the version is committed (at once if it is already).

        It runs in the writer thread, the moment the commit lands, also for a write that
        :meth:`resubmit` started again; a failed write calls nothing. It must be quick and must
        not raise (an error is logged): hand anything slow to a thread of your own.
        """
        self._on_commit.append(callback)
        self._future.add_done_callback(functools.partial(_when_done, callback=callback))

    def resubmit(self) -> None:
        """Write the same staged state again after a failure (the staging is kept until the next save)."""
        if not self._future.done():
            raise RuntimeError(f"the save of version {self.version} is still running")
        if self._future.exception() is None:
            return
        self._future = self._saver._start(self._job)
        for callback in self._on_commit:
            self._future.add_done_callback(functools.partial(_when_done, callback=callback))
        self._reported = False
        self.attempts += 1
        self._saver._inflight = self

    def done(self) -> bool:
        return self._future.done()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the save to end, committed or failed, without raising; True if it ended."""
        try:
            self._future.exception(timeout)
        except TimeoutError:
            return False
        return True

    def wait(self, timeout: float | None = None) -> VersionInfo:
        """Block until the version is committed; raise :class:`SaveFailedError` if it was not."""
        try:
            return self._future.result(timeout)
        except TimeoutError:
            raise
        except BaseException as exc:
            self._reported = True
            raise SaveFailedError(
                f"the background save of version {self.version} failed: {exc}; "
                "the previous committed version is intact"
            ) from exc


def _when_done(future: Future[Any], callback: Callable[[VersionInfo], None]) -> None:
    if future.cancelled() or future.exception() is not None:
        return
    try:
        callback(future.result())
    except Exception:
        log.exception("an on_commit callback failed")


class AsyncSaver:
    def __init__(self, committed: Callable[[VersionInfo], None] | None = None) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: SaveHandle | None = None
        self._committed = committed  # told of each commit before its handle's waiters are

    def submit(self, job: Callable[[], VersionInfo], version: int) -> SaveHandle:
        def tracked() -> VersionInfo:
            info = job()
            if self._committed is not None:
                self._committed(info)
            return info

        handle = SaveHandle(self, tracked, version)
        self._inflight = handle
        return handle

    def _start(self, job: Callable[[], VersionInfo]) -> Future[Any]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckptflow-async-save")
        return self._pool.submit(job)

    def wait_previous(self) -> VersionInfo | None:
        """Wait for the save in flight; raise its failure unless it was already reported."""
        handle, self._inflight = self._inflight, None
        if handle is None:
            return None
        if handle._reported:
            return None
        return handle.wait()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
