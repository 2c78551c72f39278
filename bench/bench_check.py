"""``ckptflow check``: how long proving a spec resumes bitwise takes, against its floors.

For the README's step spec (accumulation, a per-step scheduler) and the demo's digits spec, at 1 and
2 processes, ``--repeats`` runs of ``check_resume`` (two epochs of about 20 steps, stops drawn
inside each epoch: 4 sets of training processes in all, a save and a comparison at every step)
against:

- ``plain loop``: the same two epochs trained in this process, ``train_steps`` driven directly
  (no saves, no processes): the training itself, done twice by the check;
- ``process start``: one ``python -c "import torch, ckptflow.tasks.training.rank_worker"``, which
  the check pays at least 4 times (the launcher and each rank pay about one).

Columns: median seconds of each, and the check's time in units of each floor.

    .venv/bin/python bench/bench_check.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MARKER = "<!-- tests/pipeline/test_check.py checks the next code block with ckptflow check, at 1 and 2 processes -->"  # noqa: E501


def readme_spec(directory: Path) -> str:
    """The README's step spec, written as module ``readme_habits`` in ``directory``."""
    block = (REPO / "README.md").read_text().split(MARKER, 1)[1].lstrip()
    (directory / "readme_habits.py").write_text(block[len("```python\n") :].split("\n```", 1)[0] + "\n")
    sys.path.insert(0, str(directory))
    return "readme_habits:StepSpec"


def plain_loop(spec_path: str, config: dict, epochs: int = 2) -> float:
    """Seconds to train ``epochs`` epochs of the spec in this process, without saves."""
    from ckptflow.tasks.spec import RunFacts, make_spec

    spec = make_spec(spec_path, config, seed=0, run=RunFacts(epochs=epochs, planned_epochs=epochs))
    trainable = spec.build()
    began = time.perf_counter()
    for epoch in range(1, epochs + 1):
        for _ in spec.train_steps(trainable, epoch, 0):
            pass
    return time.perf_counter() - began


def process_start() -> float:
    began = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, ckptflow.tasks.training.rank_worker"], check=True)
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from ckptflow.tasks.training.check import check_resume

    with tempfile.TemporaryDirectory() as scratch:
        specs = [(readme_spec(Path(scratch)), {}), ("ckptflow.flows.demo:DigitsSpec", {"hidden": 32})]
        import os

        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [scratch, os.environ.get("PYTHONPATH")]))
        start = statistics.median(process_start() for _ in range(args.repeats))
        print(f"process start (python, torch, the rank worker): {start:.2f} s\n")
        print(
            "| spec | processes | check (s) | passed | plain loop, 2 epochs (s) | check / plain loop "
            "| check / process start |"
        )
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for spec, config in specs:
            plain = statistics.median(plain_loop(spec, config) for _ in range(args.repeats))
            for nproc in (1, 2):
                times, passed = [], True
                for draw in range(args.repeats):
                    report = check_resume(spec, config, nproc=nproc, draw=draw)
                    times.append(report.seconds)
                    passed = passed and report.passed
                check = statistics.median(times)
                print(
                    f"| {spec} | {nproc} | {check:.1f} | {passed} | {plain:.2f} | {check / plain:.0f}x | "
                    f"{check / start:.1f}x |"
                )


if __name__ == "__main__":
    main()
