"""``ckptflow check``: does a spec resume bitwise? (``ckptflow.tasks.training.check`` does the work.)"""

from __future__ import annotations

import json
import os
import sys
from typing import Annotated

import typer

from . import exits

Opt = typer.Option


def check_command(
    spec: Annotated[str, Opt("--spec", help="The TrainingSpec to check, as package.module:Class.")],
    spec_config: Annotated[
        str, Opt("--spec-config", metavar="JSON", help="The spec's config (a JSON object).")
    ] = "{}",
    nproc: Annotated[int, Opt("--nproc", min=1, max=64, help="Training processes (ranks).")] = 1,
    steps: Annotated[
        int | None,
        Opt("--steps", min=2, max=100_000, help="Optimizer steps to train in all (default: two epochs)."),
    ] = None,
    epochs: Annotated[int, Opt("--epochs", min=1, max=1000, help="Epochs to train (without --steps).")] = 2,
    seed: Annotated[int, Opt("--seed", help="The run's seed.")] = 0,
    draw: Annotated[
        int | None, Opt("--draw", help="Seed of the draw of the stop steps (default: a new draw each time).")
    ] = None,
    as_json: Annotated[bool, Opt("--json", help="The report as JSON.")] = False,
) -> None:
    """Train the spec straight through, then again with stops inside an epoch and across an epoch
    boundary, each resumed in new processes, and compare every saved leaf bitwise. Exit 0: it
    resumes bitwise; 1: it does not (the leaves that differ, where, and the likely cause)."""
    from ckptflow.tasks.training.check import check_resume

    from .inputs import parse_json_option

    if os.getcwd() not in sys.path:  # the spec's module, as the training processes find it (python -m)
        sys.path.insert(0, os.getcwd())
    config = parse_json_option(spec_config, option="--spec-config")
    if not isinstance(config, dict):
        raise typer.BadParameter("--spec-config must be a JSON object")

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    report = check_resume(
        spec, config, nproc=nproc, steps=steps, epochs=epochs, seed=seed, draw=draw, log=say
    )
    if as_json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(report.text())
    raise typer.Exit(exits.FINISHED if report.passed else exits.FAILED)
