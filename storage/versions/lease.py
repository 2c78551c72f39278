"""One writer per store: a lease object at the store's root, renewed while its holder lives.

``<root>/lease.json`` names the writer that holds the store (owner, host, pid,
when it started, when it last renewed, its timeout and a random token). It
is not a version, a tarball or a metadata name the store would read back.

- **Acquire**: create the lease only if none exists: locally a hard link of a
  complete, fsynced temporary file (fails if the name exists), on object
  stores a PUT with ``If-None-Match: *``. A lease whose holder is alive is
  never taken: the caller gets :class:`StoreLockedError` naming the holder.
  An object store may store a PUT and lose its answer: a writer recognises
  its own lease by its token, read back (on create and on takeover).
- **Renew**: every ``timeout / 6`` seconds a daemon thread rewrites
  ``renewed``, but only while the lease still carries this holder's token
  (on S3 a PUT with ``If-Match: <etag of our last write>``). A renewal that
  finds another token marks the lease lost; commits under it then fail with
  :class:`LeaseLostError`.
- **Take over**: a lease not renewed for ``timeout`` seconds (the holder was
  killed, its machine died) may be replaced; so may, at once, one whose
  holder has certainly ended (a process of this host and pid space that no
  longer runs: :mod:`..files.processes`). Replacing is race-free: on S3
  the new lease is a PUT with ``If-Match`` of the stale lease's ETag, so of
  two takers only one wins; locally every change of the lease happens under
  an exclusive ``flock`` of the root directory.
- **Release**: the holder removes the lease when it ends, if it is still its own.

Staleness compares the holder's clock (``renewed``) with the reader's: the
clocks of hosts sharing a store must agree to well within the timeout. Other
object stores than S3 (``memory://``, ...) get exclusive creation where fsspec
offers it, and a takeover that is not guarded against a second taker.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterator
from dataclasses import replace
from typing import Any

from ..errors import CheckpointError, LeaseLostError, StoreLockedError, UnsafeFileError
from ..files.atomic import atomic_local_write, exclusive_local_write, exclusive_remote_write
from ..files.byteio import fsync_dir
from ..files.localfs import open_regular
from ..files.location import Location
from ..files.processes import ancestors, is_this_space, this_process
from ..format.names import LEASE_FILE
from .lease_info import MAX_LEASE_BYTES, LeaseInfo, default_owner

log = logging.getLogger(__name__)

LEASE_KEY = "lease"  # in a manifest's ``writer``: the token of the lease it was committed under
DEFAULT_TIMEOUT = 180.0  # seconds without renewal after which a lease may be taken over
RENEWALS_PER_TIMEOUT = 6  # renew every timeout / 6 seconds (30 s by default)
# Tokens of this process's leases whose PUT failed and may have been stored all the same (an object
# store's answer lost, and reading it back failed too): no live StoreLease holds them.
_UNANSWERED: set[str] = set()


class StoreLease:
    """The lease of one writer on one store: acquire, renew in the background, release.

    A context manager (``with StoreLease(loc): ...``); :meth:`check` raises
    :class:`LeaseLostError` once a renewal found the lease taken by another writer.
    """

    def __init__(self, loc: Location, *, owner: str | None = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        if timeout <= 0:
            raise ValueError(f"the lease timeout must be > 0 seconds, got {timeout}")
        self.loc = loc
        now = time.time()
        host, pid, start, space = this_process()
        self.info = LeaseInfo(
            owner=owner or default_owner(),
            host=host,
            pid=pid,
            started=now,
            renewed=now,
            timeout=float(timeout),
            token=uuid.uuid4().hex,
            start=start,
            space=space,
        )
        self._etag: str | None = None  # S3: the ETag of our last write, for If-Match
        self._lost: str | None = None  # why the lease is no longer ours
        self.took_over: str | None = None  # what taking the lease replaced (a crashed holder's), said once
        self._held = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._io = threading.Lock()

    @property
    def path(self) -> str:
        return self.loc.path(LEASE_FILE)

    @property
    def url(self) -> str:
        """Where the lease lives, for messages."""
        return self.loc.display(LEASE_FILE)

    @property
    def token(self) -> str:
        return self.info.token

    def is_held(self) -> bool:
        return self._held and self._lost is None

    def check(self) -> None:
        """Raise :class:`LeaseLostError` if this writer no longer holds the store."""
        if self._lost is not None:
            raise LeaseLostError(self._lost)
        if not self._held:
            raise LeaseLostError(f"the lease on {self.loc.display()} was released; take it again to write")
        silent = time.time() - self.info.renewed
        if silent > self.info.timeout:  # another writer may have taken it over by now: fence ourselves
            raise LeaseLostError(
                f"the lease on {self.loc.display()} was last renewed {silent:.0f}s ago, more than its "
                f"{self.info.timeout:g}s timeout: another writer may hold the store now; nothing more is "
                "committed by this one"
            )

    def confirm(self) -> None:
        """:meth:`check`, then read the lease: it must still carry this holder's token (a takeover
        this holder has not seen yet marks the lease lost). Called by a commit, under :func:`fence`."""
        self.check()
        current = read_lease(self.loc)
        if current is None or current.token != self.token:
            self._lose(current)  # not under self._io: a renewal holds it while it waits for the fence
            raise LeaseLostError(self._lost)

    # -- acquire --------------------------------------------------------------

    def acquire(self) -> StoreLease:
        """Take the lease or raise :class:`StoreLockedError`; start renewing it."""
        with self._io:
            self.info = replace(self.info, renewed=time.time())
            if self.loc.is_local:
                self._acquire_local()
            else:
                self._acquire_remote()
            self._held, self._lost = True, None
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew_loop, name="ckptflow-lease", daemon=True)
        self._thread.start()
        log.info("took the writer lease on %s", self.loc.display())
        return self

    def _acquire_local(self) -> None:
        os.makedirs(self.loc.root, exist_ok=True)
        with _root_lock(self.loc.root):
            for _ in range(2):
                current = _read_local(self.path)
                if current is None and not os.path.exists(self.path):
                    if _create_local(self.loc.root, LEASE_FILE, self.info.to_json()):
                        return
                    continue  # created by another process in between: look at it
                if current is not None and not current.is_stale():
                    raise _locked(self.loc, current)
                self._log_takeover(current)
                _write_local(self.loc.root, LEASE_FILE, self.info.to_json())
                return
            raise _locked(self.loc, _read_local(self.path))

    def _acquire_remote(self) -> None:
        fs, data = self.loc.fs, self.info.to_json()
        for _ in range(2):
            try:
                self._put_own(exclusive_remote_write, fs, self.path, data)
                return
            except FileExistsError:
                pass
            etag, current = _read_remote(self.loc)
            if etag is None:  # released in between: create it again
                continue
            if current is not None and current.token == self.token:  # our create, retried by the client
                self._etag = etag
                return
            orphan = current.token if current is not None and current.token in _UNANSWERED else None
            if current is not None and not current.is_stale() and orphan is None:
                raise _locked(self.loc, current)
            if orphan is not None:
                log.info("replacing the lease %s that a failed take of this process stored", self.url)
            else:
                self._log_takeover(current)
            if not self.loc.is_s3:
                fs.pipe_file(self.path, data)
                return
            try:
                self._put_own(fs.pipe_file, self.path, data, IfMatch=etag)
            except (FileNotFoundError, OSError):  # another writer took, renewed or removed it since
                break
            _UNANSWERED.discard(orphan or "")
            return
        raise _locked(self.loc, _read_remote(self.loc)[1])

    def _put_own(self, put: Callable[..., object], *args: Any, **kwargs: Any) -> None:
        """Store this writer's lease with ``put(*args, **kwargs)`` (a PUT) and keep its ETag.

        A PUT can be stored while its answer is lost (a reset, a 500, a timeout; a retry of it then
        fails its own condition): a failed PUT is this writer's all the same when the stored lease
        carries its token. A token whose PUT could not be told either way is remembered, so that a
        later take by this process replaces that lease instead of waiting for it to time out.
        """
        try:
            self._etag = _etag_of(put(*args, **kwargs))
        except FileExistsError:
            raise
        except Exception:
            if not self._stored_anyway():
                raise
        _UNANSWERED.discard(self.token)

    def _stored_anyway(self) -> bool:
        """After a failed PUT of this writer's lease: whether it was stored all the same."""
        try:
            etag, current = _read_remote(self.loc)
        except Exception as exc:  # the store still fails: the PUT's own error says more
            log.debug("could not read back %s: %s", self.url, exc)
            _UNANSWERED.add(self.token)
            return False
        if current is None or current.token != self.token:
            return False
        self._etag = etag
        return True

    def _log_takeover(self, stale: LeaseInfo | None) -> None:
        if stale is None:
            self.took_over = f"replacing the unreadable lease {self.loc.display(LEASE_FILE)}"
        elif stale.holder_gone():
            self.took_over = (
                f"taking over the lease on {self.loc.display()}: its holder {stale.describe()} is no "
                "longer running"
            )
        else:
            self.took_over = (
                f"taking over the lease on {self.loc.display()}: its holder {stale.describe()} stopped "
                f"renewing it (timeout {stale.timeout:g}s)"
            )
        log.warning("%s", self.took_over)

    # -- renew ----------------------------------------------------------------

    def renew(self) -> None:
        """Rewrite ``renewed`` if the lease is still ours; otherwise mark it lost."""
        with self._io:
            if not self._held or self._lost is not None:
                return
            fresh = replace(self.info, renewed=time.time())
            if self.loc.is_local:
                with _root_lock(self.loc.root):
                    current = _read_local(self.path)
                    if current is None or current.token != self.token:
                        self._lose(current)
                        return
                    _write_local(self.loc.root, LEASE_FILE, fresh.to_json())
            else:
                if not self._renew_remote(fresh):
                    return
            self.info = fresh

    def _renew_remote(self, fresh: LeaseInfo) -> bool:
        """Renew on an object store; False if the lease is no longer ours (marked lost).

        On S3 the PUT carries ``If-Match`` of our last write, so a takeover in between is never
        overwritten. A server that refuses the condition for another reason (or a store without
        conditions) gets a read of the token, then a plain PUT.
        """
        if self.loc.is_s3 and self._etag is not None:
            try:
                self._etag = _etag_of(self.loc.fs.pipe_file(self.path, fresh.to_json(), IfMatch=self._etag))
                return True
            except FileNotFoundError:
                self._lose(None)
                return False
            except OSError as exc:
                log.debug("conditional renewal of %s failed: %s", self.url, exc)
        etag, current = _read_remote(self.loc)
        if current is None or current.token != self.token:
            self._lose(current)
            return False
        self._etag = _etag_of(self.loc.fs.pipe_file(self.path, fresh.to_json())) or etag
        return True

    def _lose(self, holder: LeaseInfo | None) -> None:
        who = f"now held by {holder.describe()}" if holder is not None else "it was removed"
        self._lost = (
            f"this writer lost its lease on {self.loc.display()} ({who}): it stopped renewing for "
            f"longer than {self.info.timeout:g}s, so another writer took the store over. Nothing more is "
            "committed by this writer; resume from the store's newest version once the other writer ends"
        )
        log.error("%s", self._lost)

    def _renew_loop(self) -> None:
        every = self.info.timeout / RENEWALS_PER_TIMEOUT
        while not self._stop.wait(every):
            try:
                self.renew()
            except Exception as exc:  # a failed renewal is retried; the timeout allows several
                log.warning("could not renew the lease on %s: %s", self.loc.display(), exc)
            if self._lost is not None:
                return

    # -- release --------------------------------------------------------------

    def release(self) -> None:
        """Stop renewing and remove the lease if it is still ours (finishing twice is a no-op)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None
        with self._io:
            if not self._held:
                return
            self._held = False
            if self._lost is not None:
                return
            try:
                if self.loc.is_local:
                    with _root_lock(self.loc.root):
                        current = _read_local(self.path)
                        if current is not None and current.token == self.token:
                            os.unlink(self.path)
                            fsync_dir(self.loc.root)
                else:
                    _, current = _read_remote(self.loc)
                    if current is not None and current.token == self.token:
                        self.loc.fs.rm_file(self.path)
            except (OSError, CheckpointError) as exc:  # it times out by itself
                log.warning("could not remove the lease %s: %s", self.loc.display(LEASE_FILE), exc)
                return
        log.info("released the writer lease on %s", self.loc.display())

    def __enter__(self) -> StoreLease:
        if not self._held:
            self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def read_lease(loc: Location) -> LeaseInfo | None:
    """The lease on a store, if any (unreadable bytes read as None)."""
    if loc.is_local:
        return _read_local(loc.path(LEASE_FILE))
    return _read_remote(loc)[1]


def refuse_if_held(loc: Location, *, writers: Collection[int] = ()) -> LeaseInfo | None:
    """Raise :class:`StoreLockedError` if another writer holds a live lease on the store.

    ``writers``: processes of this host that write on this process's behalf or for which it
    writes (a parent holding the lease for its training process). Nothing is taken: for a
    process that must not build or write anything before its run holds the store. Returns
    the live lease this process may write under (one of ``writers`` holds it), else None.
    """
    holder = read_lease(loc)
    if holder is None or holder.is_stale():
        return None
    if holder.pid in writers and is_this_space(holder.host, holder.space):
        return holder
    family = ancestors()
    ours = holder.pid == family[0] or (holder.pid in family and holder.owner.startswith("ckptflow run"))
    if ours and is_this_space(holder.host, holder.space):  # this process, or the run it trains for
        whose = "this process" if holder.pid == family[0] else f"its parent process {holder.pid}"
        raise StoreLockedError(
            f"{loc.display()} is held by the writer lease of {whose} ({holder.owner}); this store "
            "object does not write under it: save through the store that took the lease, or give this "
            "one the lease with store.write_under(lease). In a ckptflow run, the pipeline saves at its "
            "save points (--save-every); a spec does not save to the run's store itself",
            holder=holder,
        )
    raise _locked(loc, holder)


def commit_lease(loc: Location, lease: StoreLease | None, writers: Collection[int] = ()) -> str | None:
    """Before a version is claimed or committed: the token of the lease it goes under, or None
    when no writer holds the store. Raises :class:`LeaseLostError` if ``lease`` (this writer's
    own) is no longer held, :class:`StoreLockedError` if another writer holds the store."""
    if lease is not None:
        lease.confirm()
        return lease.token
    holder = refuse_if_held(loc, writers=writers)
    return holder.token if holder is not None else None


@contextlib.contextmanager
def fence(loc: Location) -> Iterator[None]:
    """Hold off every change of the lease while the block runs: a commit checks the lease and links
    its manifest in one block, so no takeover falls between the two. Local stores only (the root's
    flock, which every acquire, renewal, takeover and release takes); on object stores the lease is
    read just before the manifest's PUT, a window of one request."""
    if loc.is_local:
        with _root_lock(loc.root):
            yield
    else:
        yield


def _locked(loc: Location, holder: LeaseInfo | None) -> StoreLockedError:
    if holder is None:
        return StoreLockedError(
            f"{loc.display()} is being taken over by another writer right now (its lease changed while "
            "this writer read it): only one writer may use a store at a time; try again later"
        )
    left = max(0.0, holder.timeout - holder.age())
    return StoreLockedError(
        f"{loc.display()} is in use by another writer: {holder.describe()}. Only one writer may use a "
        f"store at a time: wait for it to end, or stop it; if it died, its lease is taken over "
        f"{holder.timeout:g}s after its last renewal (in about {left:.0f}s)",
        holder=holder,
    )


# -- local files ---------------------------------------------------------------


@contextlib.contextmanager
def _root_lock(root: str) -> Iterator[None]:
    """An exclusive flock of the root directory: every change of a local lease happens under it.

    Released with ``LOCK_UN`` before the descriptor is closed: a flock belongs to the open file,
    which a process forked meanwhile (a DataLoader worker) shares, and closing our descriptor alone
    would leave it locked until that child exits."""
    import fcntl

    fd = os.open(root, os.O_RDONLY | os.O_CLOEXEC)
    locked = False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            locked = True
        except OSError as exc:  # NFS, some FUSE mounts: exclusive creation still holds, the fence does not
            _warn_no_flock(root, exc)
        yield
    finally:
        try:
            if locked:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


_NO_FLOCK_WARNED: set[str] = set()


def _warn_no_flock(root: str, exc: OSError) -> None:
    if root not in _NO_FLOCK_WARNED:
        _NO_FLOCK_WARNED.add(root)
        log.warning(
            "no flock on %s (%s): leases are still created exclusively, but a takeover and a commit "
            "are not fenced against each other on this filesystem (see the README's 'The commit and "
            "the lease')",
            root,
            exc,
        )


def _read_local(path: str) -> LeaseInfo | None:
    """The lease at ``path``: None if there is none or its bytes are no valid lease (read up to a
    bound); StoreLockedError if it is no regular file (a FIFO, a directory, a device, a symlink)."""
    if not os.path.isdir(os.path.dirname(path)):  # no store there (yet): no lease; the caller says why
        return None
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        return None
    except UnsafeFileError as exc:
        raise StoreLockedError(
            f"cannot read the writer lease: {exc}. It is no lease a writer made, and no writer can take "
            "the store while it is there: remove it (no ckptflow writer uses such a file) and try again"
        ) from None
    try:
        with os.fdopen(fd, "rb") as f:
            return LeaseInfo.parse(f.read(MAX_LEASE_BYTES + 1))
    except OSError:  # e.g. EIO: unreadable, as garbage is
        return None


def _create_local(directory: str, name: str, data: bytes) -> bool:
    """Create ``name`` with ``data`` only if it does not exist (a hard link never replaces)."""
    try:
        exclusive_local_write(directory, name, data)
    except FileExistsError:
        return False
    return True


def _write_local(directory: str, name: str, data: bytes) -> None:
    atomic_local_write(directory, name, data)


# -- object stores ---------------------------------------------------------------


def _etag_of(response: object) -> str | None:
    return response.get("ETag") if isinstance(response, dict) else None


def _read_remote(loc: Location) -> tuple[str | None, LeaseInfo | None]:
    """(ETag, lease) of the remote lease object, (None, None) if there is none; the ETag is read
    first, so a conditional PUT on it fails if the object changed after the bytes were read."""
    path = loc.path(LEASE_FILE)
    loc.fs.invalidate_cache(path)
    try:
        found = loc.fs.info(path)
        etag = found.get("ETag") or ""  # "": a store without ETags
        if found.get("type") == "directory" or (found.get("size") or 0) > MAX_LEASE_BYTES:
            return etag, None  # no lease (and not read): unreadable, as garbage is
        data = loc.fs.cat_file(path)
    except FileNotFoundError:
        return None, None
    return etag, LeaseInfo.parse(data)


__all__ = [
    "DEFAULT_TIMEOUT",
    "LEASE_FILE",
    "LEASE_KEY",
    "LeaseInfo",
    "StoreLease",
    "commit_lease",
    "fence",
    "read_lease",
    "refuse_if_held",
]
