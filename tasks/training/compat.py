"""What Python 3.11 added that ckptflow uses, for Python 3.10."""

from __future__ import annotations

import sys


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``. Python 3.10 has no notes: there the note ends the message where the
    message is the error's only argument, a string; otherwise (an OSError's errno and text, a
    KeyError's key) the arguments stay as they are, and the note is kept in ``__notes__`` only."""
    if sys.version_info >= (3, 11):
        exc.add_note(note)
        return
    setattr(exc, "__notes__", [*getattr(exc, "__notes__", []), note])  # noqa: B010 (3.10 declares none)
    if type(exc).__str__ is BaseException.__str__ and len(exc.args) <= 1:
        message = exc.args[0] if exc.args else ""
        if isinstance(message, str):
            exc.args = (f"{message}\n{note}" if message else note,)
