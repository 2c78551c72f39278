"""``python -m ckptflow.tasks.rank_worker``, the command the other machines of a multi-machine run
start, as configs written before 2026-12-07 name it: it runs :mod:`ckptflow.tasks.training.rank_worker`,
the rank worker itself, as ``__main__``."""

import runpy

if __name__ == "__main__":
    runpy.run_module("ckptflow.tasks.training.rank_worker", run_name="__main__", alter_sys=True)
