"""What Python 3.11 added that ckptflow uses, for Python 3.10."""

from __future__ import annotations

import sys


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``; on Python 3.10, which has no notes, the note ends its message."""
    if sys.version_info >= (3, 11):
        exc.add_note(note)
    else:
        exc.args = (f"{exc.args[0]}\n{note}" if exc.args else note, *exc.args[1:])
