"""A process that archives files into a tarball slowly, to be SIGKILLed mid-tar by a test.

    python tests/children/archive_child.py SRC_DIR DST_DIR TAR_NAME

Archives every file of SRC_DIR (members ``v000000/<file>``) with ``write_tar``
and then commits the index. Once the first bytes are in the tar it prints
``started`` (flushed) and from then on sleeps a little after every write, as a
slow disk would, so the parent can kill it while the tar is incomplete. It
stops by itself when its parent dies.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from ckptflow.storage.archive.tarwriter import Member, write_index, write_tar
from ckptflow.storage.files import byteio
from ckptflow.storage.files.location import open_location


def _slow_writes() -> None:
    original = byteio.LocalSink.write
    parent = os.getppid()
    started = [False]

    def write(self: byteio.LocalSink, data: Any) -> None:
        original(self, data)
        if not started[0]:
            started[0] = True
            print("started", flush=True)
        if os.getppid() != parent:
            os._exit(1)  # the test that started us is gone
        time.sleep(0.05)

    byteio.LocalSink.write = write  # type: ignore[method-assign]


def main(src_dir: str, dst_dir: str, tar_name: str) -> int:
    src, dst = open_location(src_dir), open_location(dst_dir)
    names = sorted(os.listdir(src_dir))
    members = [
        Member(f"v000000/{n}", os.path.join(src.root, n), os.path.getsize(os.path.join(src.root, n)))
        for n in names
    ]
    _slow_writes()
    index = write_tar(src, members, dst, tar_name)
    write_index(dst, index)
    print("committed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
