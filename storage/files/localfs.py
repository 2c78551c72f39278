"""A local store reads only regular files inside its own directory.

A store may come from anywhere (a shared directory, an unpacked download), and
a name that passes :mod:`.names` can still be a symlink out of the store, a
FIFO (reading it hangs), a device or a directory. Every file a store opens on
a local disk goes through one of two doors that refuse those before reading a
byte:

- :class:`ConfinedLocalFileSystem`, the fsspec filesystem of every local
  :class:`~.location.Location`: a path (symlinks resolved) must lie inside the
  store's root, and one opened for reading must be a regular file;
- :func:`open_regular`, the raw ``os.open`` of the fast read paths
  (``preadv``): the same check given the store's filesystem, then no symlink as
  the last component, no blocking open, and a regular file or nothing.

Both raise :class:`~.errors.UnsafeFileError` (a :class:`~.errors.ManifestError`:
a manifest that is one leaves its version unreadable, the others unharmed).
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from ..errors import UnsafeFileError

_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFLNK: "a symlink",
}


def _refuse_special(path: str, mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
        raise UnsafeFileError(f"{path} is {kind}, not a regular file; refused")


def open_regular(path: str, fs: Any = None) -> int:
    """A read-only descriptor of the regular file ``path`` (not a symlink, FIFO, device or directory);
    with a store's ``fs``, also one inside the store (a directory on the way may not lead out)."""
    if isinstance(fs, ConfinedLocalFileSystem):
        fs.check(path, reading=True)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFileError(f"{path} is a symlink; store files are read directly; refused") from None
        if exc.errno in (errno.EISDIR, errno.ENOTDIR, errno.ENAMETOOLONG):
            raise UnsafeFileError(f"{path} cannot be opened as a file ({exc.strerror}); refused") from None
        raise
    try:
        _refuse_special(path, os.fstat(fd).st_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd


class ConfinedLocalFileSystem(LocalFileSystem):
    """fsspec's local filesystem that opens nothing outside ``confined_to`` and reads only regular files."""

    def __init__(self, confined_to: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.confined_to = os.path.realpath(confined_to)

    def check(self, path: str, *, reading: bool) -> str:
        """``path`` if it (symlinks resolved) lies in the store and, for ``reading``, is a regular file."""
        real = os.path.realpath(path)
        inside = self.confined_to.rstrip(os.sep) + os.sep
        if real != self.confined_to and not real.startswith(inside):
            raise UnsafeFileError(f"{path} leads outside the store (to {real}); refused")
        if reading:
            try:
                mode = os.stat(real).st_mode
            except FileNotFoundError:
                raise  # as without the check
            except OSError as exc:  # a symlink loop, a name too long, ...
                raise UnsafeFileError(f"{path} cannot be opened ({exc.strerror}); refused") from None
            _refuse_special(path, mode)
        return path

    def _open(self, path: str, mode: str = "rb", block_size: Any = None, **kwargs: Any) -> Any:
        path = self._strip_protocol(path)
        self.check(path, reading=not any(c in mode for c in "wxa+"))
        return super()._open(path, mode, block_size, **kwargs)
