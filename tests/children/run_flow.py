"""Child-process entry of the pipeline tests: run ``train_pipeline`` on a JSON config.

    python -m tests.children.run_flow '{"storage": "...", "epochs": 6, ...}'

Prints one JSON line prefixed with ``RESULT `` (the final state's type and the
flow's summary, when it returned one) and exits 0 when the flow run ended
Completed or Cancelled, 1 otherwise. The Prefect API comes from the
environment (``PrefectServer.env()``).
"""

from __future__ import annotations

import faulthandler
import json
import signal
import sys

RESULT_PREFIX = "RESULT "


def main(argv: list[str]) -> int:
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # Child.wait's timeout: where it waits
    from ckptflow.flows.train import train_pipeline
    from ckptflow.tasks.config import PipelineConfig

    config = PipelineConfig.model_validate_json(argv[1])
    state = train_pipeline(config, return_state=True)
    summary = state.result(raise_on_failure=False) if state.is_completed() else None
    out = {
        "state": state.type.value,
        "flow_run_id": str(state.state_details.flow_run_id),
        "summary": summary if isinstance(summary, dict) else None,
        "message": state.message,
    }
    print(RESULT_PREFIX + json.dumps(out), flush=True)
    return 0 if state.is_completed() or state.is_cancelled() else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
