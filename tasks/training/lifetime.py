"""Children that end with the process that started them.

The flow's process starts children that must not outlive it: the training
process (killed, as an in-process run would be, so nothing half-written is
ever committed) and the temporary Prefect API server (stopped). On Linux the
kernel sends a chosen signal to a process when the thread that started it ends
(PR_SET_PDEATHSIG); elsewhere nothing is asked for.

What must hold:

- The child asks for that signal itself, first thing in its main
  (:func:`die_with_parent`), not in ``subprocess``'s ``preexec_fn``: code run
  between fork and exec is unsafe in a process with threads, as the flow's is.
- A parent that died before the child asked sends no signal, so the child
  compares its parent with the pid the parent passed it and, if they differ,
  sends itself the signal.
- A child that must never see a signal (the training process and Ctrl-C)
  starts with it blocked (:func:`blocked_in_children`) and ignores it before
  it unblocks it: a signal that came meanwhile was pending, and is dropped.

Neither torch nor Prefect is imported here: both sides import this module.
Run as ``python -m ckptflow.tasks.training.lifetime SIGNAL PARENT MODULE ARGS...``, it
runs ``python -m MODULE ARGS...`` that gets SIGNAL when PARENT ends
(:func:`command` builds that line), for a child whose main is not ours.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import signal
import sys
from collections.abc import Iterator

PR_SET_PDEATHSIG = 1
MODULE = "ckptflow.tasks.training.lifetime"


def die_with_parent(sig: signal.Signals, parent: int) -> None:
    """Get ``sig`` when the parent ends (Linux); get it now if the parent, pid ``parent``, has ended."""
    if sys.platform != "linux":
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)  # only if the signal was handled or ignored


@contextlib.contextmanager
def blocked_in_children(*sigs: signal.Signals) -> Iterator[None]:
    """Block ``sigs`` in this thread meanwhile: a child started here starts with them blocked.

    This thread gets them (they were pending, not lost) when the block ends.
    """
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def ignore(*sigs: signal.Signals) -> None:
    """In a child started with ``sigs`` blocked: ignore them, dropping any that came, then unblock them."""
    for sig in sigs:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, sigs)


def command(sig: signal.Signals, module: str, *args: str) -> list[str]:
    """The command line of ``python -m module args`` that gets ``sig`` when this process ends
    (strictly, the thread that starts it)."""
    return [sys.executable, "-m", MODULE, sig.name, str(os.getpid()), module, *args]


def main(argv: list[str]) -> None:
    sig, parent, module, *args = argv
    die_with_parent(signal.Signals[sig], int(parent))
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
