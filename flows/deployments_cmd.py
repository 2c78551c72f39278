"""`ckptflow deployments init`: the deployment files, for a user who installed the package.

A checkout has them in deployments/; the wheel carries the same files as the package
``ckptflow.deployments`` (pyproject.toml), and this command writes them into a directory of
the user's. Nothing is imported from Prefect: the files are copied as they are, so the
README's commands (`prefect deploy --all --prefect-file deployments/prefect.yaml`, `python
deployments/serve.py`) work from that directory as from a checkout's root.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from pathlib import Path
from typing import Annotated

import typer

FILES = ("prefect.yaml", "serve.py")  # the process-pool deployments, and the single-machine server

app = typer.Typer(
    name="deployments",
    no_args_is_help=True,
    help="Prefect deployments of ckptflow's flows: write the files to start from.",
)

NEXT_STEPS = """next, from {where} (Prefect's server running, PREFECT_API_URL set):
  ckptflow setup-server
  prefect deploy --all --prefect-file deployments/prefect.yaml
  prefect worker start --pool ckptflow-process
or, on one machine without a worker:
  python deployments/serve.py --storage ./checkpoints/served --epochs 5"""


@app.command("init")
def init_command(
    directory: Annotated[
        Path,
        typer.Argument(
            help="Where to write deployments/prefect.yaml and deployments/serve.py.",
            file_okay=False,
            show_default="the current directory",
        ),
    ] = Path("."),
    force: Annotated[
        bool, typer.Option("--force", help="Replace those files where they exist already.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead.")] = False,
) -> None:
    """Write deployments/prefect.yaml (a process work pool: training and nightly maintenance) and
    deployments/serve.py (both flows served from one process) into DIRECTORY.

    Flow runs start in DIRECTORY, so relative storage paths and specs of your own
    (`spec: my_specs:MySpec`) resolve there. Existing files are left alone unless --force."""
    target = directory / "deployments"
    paths = [target / name for name in FILES]
    existing = [str(p) for p in paths if p.exists()]
    if existing and not force:
        typer.echo(f"error: {', '.join(existing)} exists already: --force replaces it", err=True)
        raise typer.Exit(1)
    source = resources.files("ckptflow.deployments")
    try:
        target.mkdir(parents=True, exist_ok=True)
        for name, path in zip(FILES, paths, strict=True):
            _write(path, source.joinpath(name).read_bytes(), replace=force)
    except FileExistsError as exc:  # created since the check above
        typer.echo(f"error: {exc.filename} exists already: --force replaces it", err=True)
        raise typer.Exit(1) from None
    except OSError as exc:
        typer.echo(f"error: cannot write {exc.filename or target}: {exc.strerror}", err=True)
        raise typer.Exit(1) from None
    if as_json:
        typer.echo(json.dumps({"written": [str(p) for p in paths], "replaced": existing}, indent=2))
        return
    for path in paths:
        typer.echo(f"{'replaced' if str(path) in existing else 'wrote'} {path}")
    typer.echo(NEXT_STEPS.format(where="this directory" if directory == Path(".") else directory))


def _write(path: Path, data: bytes, *, replace: bool) -> None:
    """Write ``path`` whole or not at all: a new file is created exclusively; a replaced one is
    written beside it and renamed over it, so a failed write leaves the old file as it was."""
    if not replace:
        with open(path, "xb") as out:
            out.write(data)
        return
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        partial.write_bytes(data)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
