"""The installed ckptflow's version: what ``ckptflow --version`` prints.

Read from the installed distribution's metadata, with the standard library only:
the console script (:mod:`.launch`) answers ``--version`` before it imports the CLI,
so that it works where the pipeline's packages are not installed, and the CLI's own
``--version`` flag (:mod:`.cli`) prints the same line.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as installed


def version() -> str:
    try:
        return installed("ckptflow")
    except PackageNotFoundError:
        return "unknown (not installed)"
