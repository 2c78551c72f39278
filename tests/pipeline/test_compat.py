"""tasks/compat.py: notes on errors read the same on Python 3.10, which has no add_note."""

from __future__ import annotations

import sys
import traceback

import pytest

from ckptflow.tasks.compat import add_note


def test_a_note_is_shown_with_its_error():
    exc = ValueError("bad shard")
    add_note(exc, "in the training process:\nline 3")
    shown = "".join(traceback.format_exception(exc))
    assert "ValueError: bad shard" in shown
    assert "in the training process:\nline 3" in shown


def test_on_python_3_10_the_note_ends_the_message(monkeypatch):
    monkeypatch.setattr(sys, "version_info", (3, 10, 14, "final", 0))
    exc = KeyError("model.weight")
    add_note(exc, "no retry fixes this")
    assert exc.args == ("model.weight\nno retry fixes this",)
    bare = RuntimeError()
    add_note(bare, "why")
    assert bare.args == ("why",)
    with pytest.raises(KeyError, match="no retry fixes this"):
        raise exc
