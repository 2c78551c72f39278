"""`ckptflow archive` and `ckptflow extract`: tarballs of committed versions from the command line.

``archive`` consolidates committed versions of a store into one tarball with its
index (and, with ``--drop-loose``, then removes their loose copies), under the
store's writer lease: refused, naming the holder, while a run or another writer
holds the store.
``extract`` safely unpacks one epoch of a tarball, local or remote, into a
directory that opens as a store: with the tarball's index it reads only that
epoch's byte ranges; absolute paths, ``..``, links, devices and members of
other versions are refused, and checksums are verified. It writes only into a
new or empty directory that is no symbolic link, never into an existing store.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from .options import storage_options_option

# The shared option (parsed, never printed) with these commands' shorter help text.
StorageOptionsOpt = Annotated[Any, storage_options_option(help="fsspec options.")]


def archive_command(
    url: Annotated[str, typer.Argument(metavar="URL", help="The store.")],
    versions: Annotated[
        str | None, typer.Option("--versions", help="Versions to archive: '3-7' or '1,2,5'.")
    ] = None,
    drop_loose: Annotated[bool, typer.Option("--drop-loose", help="Then remove their loose copies.")] = False,
    reindex: Annotated[
        bool,
        typer.Option("--reindex", help="Rebuild unreadable tarball indexes from the tarballs instead."),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead.")] = False,
    storage_options: StorageOptionsOpt = None,
) -> None:
    """Consolidate committed versions into archive/epochs-A-B.tar (plus its index)."""
    from ckptflow.storage import CheckpointStore

    if reindex == (versions is not None):
        raise typer.BadParameter("give either --versions or --reindex", param_hint="'--versions'")
    numbers = _parse_versions(versions) if versions is not None else []
    store = CheckpointStore(url, storage_options=storage_options)
    # It writes tarballs and indexes (and removes loose copies): under the store's writer lease,
    # refused naming the holder while a run (whose own archive jobs may write the same tarball)
    # or another writer holds the store.
    with store.lease(owner="ckptflow archive"):
        if reindex:
            rebuilt = store.reindex()
            if as_json:
                docs = [
                    {"tarball": i.tar, "versions": sorted(int(v) for v in i.extra.get("manifests", {}))}
                    for i in rebuilt
                ]
                typer.echo(json.dumps({"url": store.url, "rebuilt": docs}, indent=2))
                return
            for index in rebuilt:
                listed = ", ".join(sorted(index.extra.get("manifests", {}), key=int))
                typer.echo(f"rebuilt the index of {store.url}/archive/{index.tar}: versions {listed}")
            if not rebuilt:
                typer.echo(f"every tarball index in {store.url} is readable: nothing to rebuild")
            return
        archived = store.archived()
        held = {archived[v].tar for v in numbers if v in archived}
        if drop_loose and len(held) == 1 and all(v in archived for v in numbers):
            # already archived together: only their loose copies go (a damaged one, say: `verify`)
            index = archived[numbers[0]].index
            if not as_json:
                typer.echo(f"versions {_span(numbers)} are archived in {store.url}/archive/{index.tar}")
        else:
            index = store.archive(numbers)
            if not as_json:
                where = f"{store.url}/archive/{index.tar}"
                typer.echo(f"archived versions {_span(numbers)} into {where} ({index.size} bytes)")
        dropped = store.drop_loose(numbers) if drop_loose else []
        if drop_loose and not as_json:
            typer.echo(f"removed the loose copies of versions {_span(dropped) or 'none'}")
    if as_json:
        doc = {
            "url": store.url,
            "tarball": store.tarball_url(index.tar),
            "versions": numbers,
            "bytes": index.size,
            "loose_removed": dropped,
        }
        typer.echo(json.dumps(doc, indent=2))


def extract_command(
    tar_url: Annotated[
        str, typer.Argument(metavar="TAR_URL", help="A tarball made by ckptflow (path or URL).")
    ],
    epoch: Annotated[int, typer.Option("--epoch", "-e", min=0, help="The epoch to extract.")],
    out: Annotated[
        Path, typer.Option("--out", "-o", help="A new or empty directory to extract into (created).")
    ],
    storage_options: StorageOptionsOpt = None,
) -> None:
    """Safely extract one epoch of a tarball into DIR (verified; DIR then opens as a store)."""
    from ckptflow.storage import extract_epoch

    version, written = extract_epoch(tar_url, str(out), epoch=epoch, storage_options=storage_options)
    typer.echo(f"extracted epoch {epoch} (version {version}): {len(written)} files into {out}")


def _parse_versions(text: str) -> list[int]:
    numbers: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            numbers.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise typer.BadParameter(f"--versions {text!r}: use ranges and lists like 3-7 or 1,2,5") from None
    return sorted(numbers)


def _span(numbers: list[int]) -> str:
    return ", ".join(map(str, numbers))
