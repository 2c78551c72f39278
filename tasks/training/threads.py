"""How many intra-op threads torch gets in a pipeline run: all cores but one, unless told.

The orchestration runs beside the training loop: Prefect's event, log and
heartbeat threads (and, with the ephemeral API, its server), the background
save's writer threads and the archive jobs. When torch's intra-op threads take
every core, each parallel region waits for a thread that the scheduler gave to
one of those, and a small model's epoch runs 2-3x slower: on 2 cores the demo
paid 96 ms of overhead per epoch with 2 threads and 40 ms with 1 (the epoch
itself was no slower with 1). So a run leaves one core free, unless the user
chose: ``torch_threads`` in the config, or ``OMP_NUM_THREADS`` in the
environment (which torch reads itself). The process's setting is put back when
the run ends, since a flow may run inside a longer-lived process.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping


def intra_op_threads(
    requested: int | None, *, cores: int | None = None, environ: Mapping[str, str] = os.environ
) -> int | None:
    """The thread count to set for a run; None leaves torch's own choice alone."""
    if requested is not None:
        return requested
    if environ.get("OMP_NUM_THREADS"):
        return None
    cores = cores if cores is not None else (os.cpu_count() or 1)
    return max(1, cores - 1)


@contextlib.contextmanager
def torch_threads(requested: int | None) -> Iterator[int]:
    """Run the block with torch's intra-op threads set by :func:`intra_op_threads`; yield the count."""
    import torch

    before = torch.get_num_threads()
    wanted = intra_op_threads(requested)
    if wanted is None or wanted == before:
        yield before
        return
    torch.set_num_threads(wanted)
    try:
        yield wanted
    finally:
        torch.set_num_threads(before)
