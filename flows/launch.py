"""The ``ckptflow`` console script.

For ``ckptflow run`` it starts the trainers' launcher (:mod:`ckptflow.tasks.training.trainer`) before
anything else is imported, so that torch loads there while this process loads the CLI and
Prefect; every other command goes straight to :mod:`.cli`.

Help and usage errors are printed the way click prints them, wrapped to the terminal's width:
typer's rich panels cut long defaults and words off (``ckptflow.flows.…``) on terminals
narrower than about 120 columns. ``TYPER_USE_RICH=1`` brings the panels back.

``ckptflow --version`` answers with the core alone; every other command needs the
``[prefect]`` extra and says so, in one line, where it is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from .version import version

CLI_PACKAGES = ("typer", "rich")  # every command (the [cli] extra)
PIPELINE_PACKAGES = ("prefect",)  # the commands of the pipeline (the [prefect] extra)
PIPELINE_COMMANDS = ("run", "publish", "setup-server")


def trains_in_a_child(args: list[str]) -> bool:
    """Whether these arguments start a run that trains in training processes (the default).

    A guess from the words alone; a wrong one only costs the launcher (``prestart`` ends it).
    """
    return args[:1] == ["run"] and not any(a in ("--in-process", "--help", "-h") for a in args)


def main() -> None:
    if sys.argv[1:] in (["--version"], ["-V"]):
        print(f"ckptflow {version()}")
        return
    missing = [name for name in CLI_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        print(
            f"error: the ckptflow command needs {', '.join(missing)}: pip install 'ckptflow[cli]' for the "
            "store commands (ls, verify, restore, ...), 'ckptflow[prefect]' for the pipeline too "
            "(the storage library, ckptflow.storage, works without them)",
            file=sys.stderr,
        )
        sys.exit(2)
    command = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    pipeline = [name for name in PIPELINE_PACKAGES if importlib.util.find_spec(name) is None]
    if command in PIPELINE_COMMANDS and pipeline:
        print(
            f"error: ckptflow {command} needs the pipeline ({', '.join(pipeline)} missing): "
            "pip install 'ckptflow[prefect]'; the store commands (ls, verify, restore, ...) work without it",
            file=sys.stderr,
        )
        sys.exit(2)
    os.environ.setdefault("TYPER_USE_RICH", "0")  # read when typer is imported, below
    if trains_in_a_child(sys.argv[1:]):
        from ckptflow.tasks.training.trainer import spawn_early

        spawn_early()
    from .cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
