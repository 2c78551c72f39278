"""Serve ckptflow's flows from one long-running process: the single-machine case.

No work pool and no worker: ``prefect.serve`` registers two deployments,
``ckptflow-train/train-served`` and ``ckptflow-maintenance/maintenance-served``,
with their schedules, and runs each flow run in a subprocess of this process
until it is stopped with SIGTERM (systemd, ``docker stop``) or Ctrl-C (SIGINT):
the deployments are then paused. SIGTERM first stops the runs in flight as a
worker's cancellation does (each commits where it stands and ends Cancelled);
Prefect's own runner, which ``prefect.serve`` uses, killed them (Prefect 3.9),
or exited before pausing the deployments (3.8).

    export PREFECT_API_URL=http://127.0.0.1:4200/api
    .venv/bin/python deployments/serve.py --storage ./checkpoints/served --epochs 5 \\
        --train-cron "0 2 * * *" --maintenance-cron "0 3 * * *"

The parameters are built from the options and validated before anything is
registered (the flows validate them again on every run); a run started from
the UI or with ``prefect deployment run 'ckptflow-train/train-served' --param
config='{...}'`` replaces the default ``config`` as a whole. Relative storage
paths resolve in the directory it is started in, and flow runs start there (so
``--spec my_specs:MySpec`` finds ``my_specs.py`` in it). Served
runs emit heartbeats every ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` seconds (30
unless set), so the automation of ``ckptflow setup-server`` marks a run whose
process died Crashed here too.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--storage", default="./checkpoints/served", help="where the checkpoints live")
    parser.add_argument("--epochs", type=int, default=5, help="train until this epoch")
    parser.add_argument(
        "--spec", default=None, help="TrainingSpec as package.module:Class (default: the demo)"
    )
    parser.add_argument("--keep-last", type=int, default=5, help="maintenance: keep the newest N versions")
    parser.add_argument("--train-cron", default=None, help="cron schedule of training runs (default: none)")
    parser.add_argument("--maintenance-cron", default="0 3 * * *", help="cron schedule of maintenance runs")
    parser.add_argument("--limit", type=int, default=1, help="flow runs at once (one writer per store)")
    return parser.parse_args(argv)


def build_deployments(args: argparse.Namespace) -> list[Any]:
    """The two deployments, with validated default parameters."""
    from ckptflow.flows.maintenance import maintain_stores
    from ckptflow.flows.train import train_pipeline
    from ckptflow.tasks.config import PipelineConfig
    from ckptflow.tasks.maintenance import MaintenanceConfig

    train = PipelineConfig.model_validate(
        {"storage": args.storage, "epochs": args.epochs, **({"spec": args.spec} if args.spec else {})}
    )
    maintenance = MaintenanceConfig(
        storages=[args.storage],
        retention={"keep_last": args.keep_last},
        skip_missing=True,  # a scheduled run before the first training run there warns, and completes
    )
    return [
        train_pipeline.to_deployment(
            name="train-served",
            parameters={"config": train.model_dump(mode="json", exclude_defaults=True)},
            cron=args.train_cron,
            tags=["ckptflow"],
            description="Train with crash-safe checkpoints (served by deployments/serve.py).",
        ),
        maintain_stores.to_deployment(
            name="maintenance-served",
            parameters={"config": maintenance.model_dump(mode="json", exclude_defaults=True)},
            cron=args.maintenance_cron,
            tags=["ckptflow"],
            description="Retention, leftovers and the checkpoint table (served by deployments/serve.py).",
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "30")
    from pydantic import ValidationError

    try:
        deployments = build_deployments(args)
    except ValidationError as exc:
        print(f"error: invalid parameters: {exc}", file=sys.stderr)
        return 2
    serve_until_stopped(deployments, limit=args.limit)
    return 0


def serve_until_stopped(deployments: list[Any], *, limit: int) -> None:
    """``prefect.serve(*deployments)`` until SIGTERM or Ctrl-C. Once the runner has started,
    SIGTERM stops it as a worker's cancellation stops a run: each run in flight gets SIGTERM (it
    commits where it stands and ends Cancelled, within the runner's grace period), then the runner
    stops polling, pauses the deployments and returns. Before that, SIGTERM is a Ctrl-C."""
    import asyncio

    from prefect.runner import Runner

    signal.signal(signal.SIGTERM, _as_ctrl_c)  # before anything is registered
    runner = Runner(pause_on_shutdown=True, limit=limit)

    def stop(*args: Any) -> None:
        if not runner.started:
            _as_ctrl_c()
            return
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM changes nothing
        print("stopping: the runs in flight save and end Cancelled; then the deployments pause", flush=True)
        runner.execute_in_background(runner.astop)  # cancels each run in flight, then the loops

    runner.handle_sigterm = stop  # type: ignore[method-assign]  # start() installs it for SIGTERM
    try:
        for deployment in deployments:
            runner.add_deployment(deployment)
        names = ", ".join(f"'{d.flow_name}/{d.name}'" for d in deployments)
        print(f"serving {names}; Ctrl-C or SIGTERM stops (and pauses them)", flush=True)
        asyncio.run(runner.start())
        print("stopped: the deployments are paused", flush=True)
    except KeyboardInterrupt:
        # the runner pauses what it served once it has started; a stop before that, here
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _pause(deployments)
        print("stopped: the deployments are paused", flush=True)


def _pause(deployments: list[Any]) -> None:
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        for deployment in deployments:
            try:
                found = client.read_deployment_by_name(f"{deployment.flow_name}/{deployment.name}")
            except ObjectNotFound:  # stopped before it was registered
                continue
            client.pause_deployment(found.id)


def _as_ctrl_c(*args: Any) -> None:
    """SIGTERM as Ctrl-C: asyncio's own SIGINT handling where it has one (it cancels the runner's
    task, which then stops cleanly), else KeyboardInterrupt here (SIGINT ignored: a background job)."""
    if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL, None):
        raise KeyboardInterrupt
    signal.raise_signal(signal.SIGINT)


if __name__ == "__main__":
    sys.exit(main())
