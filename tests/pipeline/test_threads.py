"""torch's intra-op threads in a run: all cores but one unless the user chose, put back at the end.

With every core given to torch, Prefect's threads and the background saves
stall its parallel regions (on 2 cores the demo paid 96 ms per epoch of
overhead with 2 threads, 40 ms with 1).
"""

from __future__ import annotations

import pytest
import torch
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
from prefect.logging.handlers import APILogHandler

from ckptflow.tasks.training.threads import intra_op_threads
from tests.pipeline.helpers import make_config, poll, run_summary


class TestPolicy:
    @pytest.mark.parametrize(("cores", "expected"), [(1, 1), (2, 1), (8, 7), (64, 63)])
    def test_all_cores_but_one_by_default(self, cores, expected):
        assert intra_op_threads(None, cores=cores, environ={}) == expected

    def test_an_explicit_count_wins(self):
        assert intra_op_threads(3, cores=2, environ={"OMP_NUM_THREADS": "8"}) == 3

    def test_omp_num_threads_is_left_to_torch(self):
        assert intra_op_threads(None, cores=8, environ={"OMP_NUM_THREADS": "4"}) is None


@pytest.mark.prefect
def test_a_run_sets_the_threads_and_puts_them_back(prefect_server, tmp_path):
    before = torch.get_num_threads()
    wanted = 1 if before != 1 else 2
    summary, run_id = run_summary(make_config(tmp_path / "store", epochs=1, torch_threads=wanted))
    assert summary["last_epoch"] == 1
    assert torch.get_num_threads() == before
    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        logs = poll(
            lambda: [
                x.message for x in client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
            ],
            lambda messages: any(m.startswith("torch intra-op threads") for m in messages),
        )
    assert any(m.startswith(f"torch intra-op threads: {wanted} of ") for m in logs), logs
