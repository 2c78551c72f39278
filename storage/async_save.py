"""Background saves: one writer thread, at most one save in flight.

The caller has already copied the state into staging memory; the background
thread writes the shards and commits. A failure is kept on the handle and
raised by ``wait()``; if nobody waited, the next save (or ``close``) raises
it instead, so a failed checkpoint is never silently skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from .errors import SaveFailedError

if TYPE_CHECKING:
    from .store import VersionInfo

log = logging.getLogger(__name__)


class SaveHandle:
    """The result of :meth:`CheckpointStore.save_async`."""

    def __init__(self, future: Future[Any], version: int) -> None:
        self._future = future
        self.version = version
        self._reported = False

    def done(self) -> bool:
        return self._future.done()

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

    def _unreported_failure(self) -> bool:
        return self._future.done() and not self._reported and self._future.exception() is not None


class AsyncSaver:
    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: SaveHandle | None = None

    def submit(self, job: Callable[[], VersionInfo], version: int) -> SaveHandle:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckptflow-async-save")
        handle = SaveHandle(self._pool.submit(job), version)
        self._inflight = handle
        return handle

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
