"""Entry scripts of the child processes the tests start, and kill: a crash-test saver, a rank of a
gloo job, a racing writer, an archiver, a flow run (``python -m tests.children.run_flow``) and one
with a hang planted in archiving. The tests import their state builders and constants from here."""

from pathlib import Path

CHILDREN = Path(__file__).resolve().parent
