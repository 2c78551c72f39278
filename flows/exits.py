"""The exit codes of the ``ckptflow`` command: one table, kept by every command.

Schedulers and scripts read the code to decide whether to resume, retry or give up (SLURM's
requeue, Kubernetes' pod failure policies, a shell loop), so each outcome has its own:

====  ===============================================================================
code  meaning
====  ===============================================================================
0     finished: the run reached its stop condition; a store command did what it was asked
1     failed: the run or the command failed (its ``error:`` line says why)
2     usage: a bad flag, option or config; nothing was started
3     cancelled from Prefect (the UI's Cancel of a local run): saved where it stood
75    refused: another writer holds the store (``EX_TEMPFAIL``: try again once it is gone)
128+N stopped by signal N after saving where it stood: 143 for SIGTERM, 130 for Ctrl-C
====  ===============================================================================

A run stopped by a signal exits 128+N, as a shell reports a process the signal killed, but only
once its stop-save committed (or the grace period ran out, which its last line says): a
scheduler requeues it, and the next run resumes from that save.
"""

from __future__ import annotations

import signal

FINISHED = 0
FAILED = 1
USAGE = 2
CANCELLED = 3
STORE_HELD = 75  # sysexits' EX_TEMPFAIL


def stopped_by(signum: int) -> int:
    """The exit code of a run stopped by ``signum`` after saving."""
    return 128 + int(signum)


SIGTERM_STOPPED = stopped_by(signal.SIGTERM)
INTERRUPTED = stopped_by(signal.SIGINT)
