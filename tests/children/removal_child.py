"""A process that removes from a store and SIGKILLs itself before its Nth removal of a file or tree.

    python tests/children/removal_child.py URL OPERATION KILL_BEFORE

OPERATION is ``prune`` (keep the last 2), ``delete`` (version 0, if it is committed) or ``gc``.
Every removal a store makes goes through the local filesystem's ``rm_file`` or ``rm``; the child
counts them and kills itself with SIGKILL right before number KILL_BEFORE (0: the first), so a
test can stop a prune, delete or gc at each instant between two removals. It prints ``done N``
(N: the removals made) when the operation ends before that.
"""

from __future__ import annotations

import os
import signal
import sys

from fsspec.implementations.local import LocalFileSystem


def main() -> int:
    url, operation, kill_before = sys.argv[1], sys.argv[2], int(sys.argv[3])
    made = [0]

    def counted(original):
        def remove(self, *args, **kwargs):
            if made[0] == kill_before:
                os.kill(os.getpid(), signal.SIGKILL)
            made[0] += 1
            return original(self, *args, **kwargs)

        return remove

    LocalFileSystem.rm_file = counted(LocalFileSystem.rm_file)  # type: ignore[method-assign]
    LocalFileSystem.rm = counted(LocalFileSystem.rm)  # type: ignore[method-assign]

    from ckptflow.storage import CheckpointStore

    store = CheckpointStore(url)
    if operation == "prune":
        store.prune(keep_last=2)
    elif operation == "delete":
        if 0 in [v.version for v in store.versions()]:
            store.delete(0)
    else:
        store.gc()
    print(f"done {made[0]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
