"""tasks/training/compat.py: notes on errors read the same on Python 3.10, which has no add_note."""

from __future__ import annotations

import sys
import traceback

import pytest

from ckptflow.tasks.training.compat import add_note


def test_a_note_is_shown_with_its_error():
    exc = ValueError("bad shard")
    add_note(exc, "in the training process:\nline 3")
    shown = "".join(traceback.format_exception(exc))
    assert "ValueError: bad shard" in shown
    assert "in the training process:\nline 3" in shown


def test_on_python_3_10_the_note_ends_the_message(monkeypatch):
    monkeypatch.setattr(sys, "version_info", (3, 10, 14, "final", 0))
    exc = RuntimeError("rank 1 failed")
    add_note(exc, "no retry fixes this")
    assert str(exc) == "rank 1 failed\nno retry fixes this"
    assert exc.__notes__ == ["no retry fixes this"]
    bare = RuntimeError()
    add_note(bare, "why")
    assert bare.args == ("why",)
    with pytest.raises(RuntimeError, match="no retry fixes this"):
        raise exc


def test_on_python_3_10_arguments_that_are_not_a_message_stay(monkeypatch):
    """A KeyError's key and an OSError's errno are data: the note does not go into them."""
    monkeypatch.setattr(sys, "version_info", (3, 10, 14, "final", 0))
    key = KeyError("model.weight")
    add_note(key, "in the training process")
    assert key.args == ("model.weight",)
    disk = OSError(28, "No space left on device")
    add_note(disk, "in the training process")
    assert disk.errno == 28 and disk.args == (28, "No space left on device")
    assert disk.__notes__ == ["in the training process"]
