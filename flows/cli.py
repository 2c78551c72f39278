"""ckptflow's command line: list, inspect, verify, restore and tidy a checkpoint store.

Every command takes the store's URL (a path, file://, s3://bucket/prefix,
memory:// ...) and ``--storage-options JSON`` for what the filesystem needs
(s3 credentials, ``client_kwargs.endpoint_url``).

What always holds:
- exit code 0 on success; 1 on a failure, with one line ``error: <message>``
  on stderr and no traceback; 2 on a usage error (typer's default);
- URLs are shown without credentials and storage options are never printed;
- ``restore`` never leaves a half-written file at its target: it writes a
  temporary file beside it and renames it into place;
- the storage library (and torch) is imported only when a command runs, and
  Prefect never on these commands' import path, so ``ckptflow ls --help`` is
  instant. The ``run`` command (registered where marked below) must keep its
  Prefect imports inside its body.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.console import Console
from typer.core import TyperGroup

from . import exits, present
from .archive_cmd import archive_command, extract_command
from .check_cmd import check_command
from .deployments_cmd import app as deployments_app
from .options import BEST_MODE_HELP, StorageOptions, best_mode_needed, parse_storage_options
from .run_cmd import run_command
from .server_cmd import publish_command, setup_server_command

if TYPE_CHECKING:
    from ckptflow.storage import CheckpointStore


class _Group(TyperGroup):
    """Turns storage failures (CheckpointError, OSError) into ``error: ...`` on stderr and exit 1
    (with ``--verbose``, the traceback first)."""

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort, typer.TyperException):  # usage errors, exits
            raise
        except Exception as exc:
            from ckptflow.storage import CheckpointError

            if not isinstance(exc, (CheckpointError, OSError)):
                raise
            if ctx.params.get("verbose"):
                import traceback

                traceback.print_exc()
            _fail(_one_line(exc), code=_exit_code(exc))


app = typer.Typer(
    name="ckptflow",
    cls=_Group,
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="Log what the storage library does.")]


def _print_version(value: bool) -> None:
    if value:
        from .version import version

        typer.echo(f"ckptflow {version()}")
        raise typer.Exit()


VersionFlag = Annotated[
    bool,
    typer.Option("--version", "-V", callback=_print_version, is_eager=True, help="Print the version; exit."),
]


@app.callback()
def _setup(verbose: Verbose = False, show_version: VersionFlag = False) -> None:
    """Crash-safe, sharded PyTorch checkpoints: list, inspect, verify, restore and tidy a store."""
    # The commands report every state themselves (leftovers, unreadable versions, corrupt files), so
    # the library's log lines, which repeat them, are shown only with --verbose.
    logger = logging.getLogger("ckptflow")
    for old in [h for h in logger.handlers if h.get_name() == "ckptflow-cli"]:
        logger.removeHandler(old)
    handler = logging.StreamHandler() if verbose else logging.NullHandler()
    handler.set_name("ckptflow-cli")
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    if verbose:
        logger.setLevel(logging.INFO)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def _fail(message: str, *, code: int = exits.FAILED) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _exit_code(exc: BaseException) -> int:
    """A store command's exit code for a failure (:mod:`.exits`): 75 while another writer holds it."""
    from ckptflow.storage import StoreLockedError

    return exits.STORE_HELD if isinstance(exc, StoreLockedError) else exits.FAILED


Url = Annotated[
    str,
    typer.Argument(
        metavar="URL",
        help="The store: a path, file://..., s3://bucket/prefix, memory://... (or a checkpoint file "
        "of the Lightning plugin, e.g. run1/last.ckpt: its store, and its version by default).",
        show_default=False,
    ),
]
VersionOpt = Annotated[
    int | None,
    typer.Option("--version", min=0, help="Version number (default: the newest committed)."),
]
StepOpt = Annotated[
    int | None,
    typer.Option(
        "--step",
        min=0,
        help="The version saved at this global training step (`ckptflow ls` shows each one's), "
        "instead of --version.",
        show_default=False,
    ),
]
JsonFlag = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead.")]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Only print what would be removed.")]
GC_MIN_AGE = 900.0  # seconds: gc spares leftovers younger than this unless told otherwise


def _open(url: str, storage_options: dict[str, Any] | None, *, command: str) -> CheckpointStore:
    """The store at ``url``; fails within seconds when nothing is stored there, it cannot be reached,
    or it is a version's directory or a directory of stores (naming the store(s) for ``command``).

    A Lightning checkpoint path (``last.ckpt``, a pointer the plugin wrote) stands for its store,
    and its version is the one a command reads unless told another (:func:`_chosen`)."""
    from ckptflow.storage import CheckpointStore, check_pointed, lightning_pointer, quick_answer_options

    pointer = lightning_pointer(url, quick_answer_options(url, storage_options))
    target = pointer.store_url if pointer is not None else url
    store = CheckpointStore(target, storage_options=quick_answer_options(target, storage_options))
    store.probe(must_exist=True)
    problem = present.misplaced_message(store.misplaced(), store.url, command=command)
    if problem is not None:
        _fail(problem)
    if pointer is not None:
        check_pointed(pointer, url, store)
        _POINTED[id(store)] = (store, pointer.version)
        typer.echo(f"{url} is a Lightning checkpoint: version {pointer.version} of {store.url}", err=True)
    return store


# A store opened through a pointer (by id; held, so that its id is not reused) -> the version named.
_POINTED: dict[int, tuple[CheckpointStore, int]] = {}


def _console() -> Console:
    return Console(highlight=False)


def _refuse_both(version: int | None, step: int | None) -> None:
    """A usage error (exit 2) when a version is chosen twice, by number and by step."""
    if version is not None and step is not None:
        raise typer.BadParameter("give either --version or --step, not both", param_hint="'--step'")


def _chosen(store: CheckpointStore, version: int | None, step: int | None) -> int | None:
    """The version ``--version`` or ``--step`` names (None: the newest, or the one the pointer the
    store was opened through names); fails naming the steps nearest to ``step`` when no committed
    version has it."""
    if version is None and step is None:
        pointed = _POINTED.get(id(store))
        return pointed[1] if pointed is not None and pointed[0] is store else None
    return version if step is None else store.version_at_step(step)


# -- ls -------------------------------------------------------------------------


DurableUrl = Annotated[
    str | None,
    typer.Option(
        "--durable",
        metavar="URL",
        help="The store's durable tier (a run's --upload-to): show which tiers hold each version.",
        show_default=False,
    ),
]
DurableOptions = Annotated[
    Any,
    typer.Option(
        "--durable-options",
        metavar="JSON",
        parser=parse_storage_options,
        help="fsspec options for --durable (no credentials).",
        show_default=False,
    ),
]


@app.command("ls")
def ls_command(
    url: Url,
    as_json: JsonFlag = False,
    storage_options: StorageOptions = None,
    durable: DurableUrl = None,
    durable_options: DurableOptions = None,
) -> None:
    """List the committed versions of a store, oldest first (with --durable: in both tiers)."""
    store = _open(url, storage_options, command="ls")
    survey = store.survey()
    infos = [store.info_of(located) for located in survey.committed.values()]
    unreadable = {v: _one_line(e) for v, e in survey.unreadable.items()}
    tiers, lag, durable_url = None, None, None
    if durable:
        tiers, lag, durable_url, only_there = _tiers(infos, durable, durable_options)
        infos = sorted(infos + only_there, key=lambda i: i.version)
    if as_json:
        document = {
            "url": store.url,
            **({"durable": durable_url, "not_durable": lag} if tiers is not None else {}),
            "versions": [
                {**present.version_json(i), **({"tiers": tiers[i.version].split("+")} if tiers else {})}
                for i in infos
            ],
            "uncommitted": survey.writing,
            "unreadable": [{"version": v, "error": e} for v, e in unreadable.items()],
            "set_aside": [store.display(name) for name in survey.set_aside],
            "unreadable_archives": [
                {"tar": t, "error": _one_line(e)} for t, e in survey.bad_archives.items()
            ],
        }
        typer.echo(json.dumps(document, indent=2))
        return
    console = _console()
    if infos:
        console.print(store.url, markup=False, soft_wrap=True)
        console.print(present.versions_table(infos, store=store.url, tiers=tiers), markup=False)
    else:
        console.print(f"no committed versions in {store.url}", markup=False, soft_wrap=True)
    if lag is not None:
        named = f"{'versions' if len(lag) > 1 else 'version'} {', '.join(map(str, lag))}"
        behind = f"{named} not durable yet" if lag else "it holds the newest version"
        console.print(f"durable tier {durable_url}: {behind}", markup=False, soft_wrap=True)
    if survey.writing:
        listing = ", ".join(str(v) for v in survey.writing)
        console.print(
            f"note: uncommitted leftovers of interrupted (or running) saves: version {listing}; "
            f"`ckptflow gc` removes them",
            markup=False,
            soft_wrap=True,
        )
    for version, error in unreadable.items():
        console.print(f"note: version {version} is unreadable: {error}", markup=False, soft_wrap=True)
    for tar, problem in survey.bad_archives.items():
        console.print(
            f"note: the index of archive/{tar} is unreadable ({_one_line(problem)}): its versions are not "
            "listed; `ckptflow archive URL --reindex` rebuilds it from the tarball",
            markup=False,
            soft_wrap=True,
        )
    for name in survey.set_aside:
        console.print(
            f"note: {store.display(name)} was set aside as unreadable by a run that resumed past it; "
            "nothing reads or removes it: inspect it, then delete it by hand",
            markup=False,
            soft_wrap=True,
        )


def _tiers(
    infos: list[Any], url: str, options: dict[str, Any] | None
) -> tuple[dict[int, str], list[int], str, list[Any]]:
    """Which tiers hold each version ("fast", "durable", "fast+durable"), the fast tier's versions
    newer than the durable tier's newest (not durable yet), the durable tier's URL, and the
    versions only the durable tier holds."""
    from ckptflow.storage import CheckpointStore, quick_answer_options

    durable = CheckpointStore(url, storage_options=quick_answer_options(url, options))
    found = durable.versions()
    there, here = {i.version for i in found}, {i.version for i in infos}
    tiers = {
        v: "+".join(t for t, held in (("fast", v in here), ("durable", v in there)) if held)
        for v in here | there
    }
    newest = max(there, default=-1)
    lag = sorted(v for v in here if v not in there and v > newest)
    return tiers, lag, durable.url, [i for i in found if i.version not in here]


# -- show -----------------------------------------------------------------------


@app.command("show")
def show_command(
    url: Url,
    version: VersionOpt = None,
    step: StepOpt = None,
    as_json: JsonFlag = False,
    storage_options: StorageOptions = None,
) -> None:
    """Show a version's manifest: summary, shards with sizes and checksums, and its tensors."""
    _refuse_both(version, step)
    store = _open(url, storage_options, command="show")
    manifest = store.manifest(_chosen(store, version, step))
    if as_json:
        typer.echo(manifest.to_json().decode())
        return
    console = _console()
    console.print(present.summary_table(manifest, store.version_url(manifest.version)), markup=False)
    console.print(present.shards_table(manifest), markup=False)
    console.print(present.tensors_table(manifest), markup=False)


# -- log ------------------------------------------------------------------------


@app.command("log")
def log_command(url: Url, as_json: JsonFlag = False, storage_options: StorageOptions = None) -> None:
    """Show where each version came from: its parent (the version it was resumed or derived
    from), its run and code, and where the chain forks or starts anew."""
    store = _open(url, storage_options, command="log")
    infos = store.versions()
    notes = present.lineage_notes(infos)
    if as_json:
        versions: list[dict[str, Any]] = [
            {
                "version": i.version,
                "epoch": i.epoch,
                "step": i.step,
                "created": i.created,
                "url": i.url,
                "lineage": i.lineage,
                "note": notes.get(i.version),
            }
            for i in infos
        ]
        typer.echo(json.dumps({"url": store.url, "versions": versions}, indent=2))
        return
    console = _console()
    if not infos:
        console.print(f"no committed versions in {store.url}", markup=False, soft_wrap=True)
        return
    console.print(store.url, markup=False, soft_wrap=True)
    console.print(present.log_table(infos), markup=False)


# -- diff -----------------------------------------------------------------------


@app.command("diff")
def diff_command(
    url: Url,
    before: Annotated[str, typer.Argument(metavar="A", help="A version of the store (or `latest`).")],
    after: Annotated[
        str,
        typer.Argument(
            metavar="B",
            help="A version of the store (default: the newest), a torch or safetensors file, or another "
            "store's URL (URL@N for its version N).",
        ),
    ] = "latest",
    values: Annotated[
        bool,
        typer.Option(
            "--values",
            help="Read the tensors that changed and show the bytes that differ, the largest absolute "
            "difference and the relative norm of the difference.",
        ),
    ] = False,
    as_json: JsonFlag = False,
    storage_options: StorageOptions = None,
) -> None:
    """Show what changed between two versions: tensors added, removed, retyped, reshaped or
    changed in value (told by checksums, nothing read), and the other values that changed."""
    if not (before.isdigit() or before == "latest"):
        raise typer.BadParameter(f"{before!r} is no version number: give one, or `latest`", param_hint="'A'")
    store = _open(url, storage_options, command="diff")
    first = None if before == "latest" else int(before)
    result = store.diff(first, after, values=values, storage_options=storage_options)
    if as_json:
        typer.echo(json.dumps(result.to_json(), indent=2))
        return
    console = _console()
    console.print(f"{result.before} -> {result.after}", markup=False, soft_wrap=True)
    if result.changes or result.values:
        console.print(present.diff_table(result), markup=False)
    console.print(present.diff_summary(result), markup=False, soft_wrap=True)


# -- verify ---------------------------------------------------------------------


@app.command("verify")
def verify_command(
    url: Url,
    version: VersionOpt = None,
    step: StepOpt = None,
    all_versions: Annotated[bool, typer.Option("--all", help="Verify every committed version.")] = False,
    as_json: JsonFlag = False,
    storage_options: StorageOptions = None,
) -> None:
    """Check every shard of a version against the sizes and checksums in its manifest.

    Exit 0 when all match (one line per verified version); exit 1 naming the bad file otherwise.
    With --all, every committed version, loose or archived, and every unreadable one (a failure).
    With --json, one document: each version's result ("ok", or its "error"), and the same exit code.
    """
    if all_versions and version is not None:
        raise typer.BadParameter("give either --version or --all, not both", param_hint="'--all'")
    if all_versions and step is not None:
        raise typer.BadParameter("give either --step or --all, not both", param_hint="'--all'")
    _refuse_both(version, step)
    store = _open(url, storage_options, command="verify")
    from ckptflow.storage import CheckpointError, StorageUnavailableError, VersionNotFoundError

    results: list[dict[str, Any]] = []  # for --json: each version's result, in the order checked
    if not all_versions:
        chosen = _chosen(store, version, step)
        if not as_json:
            typer.echo(f"ok {present.describe(store.verify(chosen))}")
            return
        try:
            results.append({"ok": True, **present.version_json(store.verify(chosen))})
        except StorageUnavailableError:
            raise
        except VersionNotFoundError:
            raise
        except CheckpointError as exc:
            results.append({"version": chosen, "ok": False, "error": _one_line(exc)})
        _print_verified(store.url, results, [])
        return
    survey = store.survey()
    numbers = sorted({*survey.committed, *survey.unreadable})
    if not numbers and not survey.bad_archives:
        raise VersionNotFoundError(None, store.url, [])
    failed = 0
    archives = []
    for tar, error in survey.bad_archives.items():
        failed += 1
        archives.append({"tar": tar, "error": _one_line(error)})
        if not as_json:
            typer.echo(
                f"error: the index of archive/{tar} is unreadable, its versions are unchecked: "
                f"{_one_line(error)} (`ckptflow archive URL --reindex` rebuilds it)",
                err=True,
            )
    for number in numbers:
        if number in survey.unreadable:
            failed += 1
            problem = f"unreadable: {_one_line(survey.unreadable[number])}"
            results.append({"version": number, "ok": False, "error": problem})
            if not as_json:
                typer.echo(f"error: version {number} is {problem}", err=True)
            continue
        try:
            info = store.verify_located(survey.committed[number])
        except StorageUnavailableError:
            raise
        except CheckpointError as exc:
            failed += 1
            results.append({"version": number, "ok": False, "error": _one_line(exc)})
            if not as_json:
                typer.echo(f"error: version {number}: {_one_line(exc)}", err=True)
            continue
        results.append({"ok": True, **present.version_json(info)})
        if not as_json:
            typer.echo(f"ok {present.describe(info)}")
    if as_json:
        _print_verified(store.url, results, archives)
    elif failed:
        raise typer.Exit(1)


def _print_verified(url: str, results: list[dict[str, Any]], archives: list[dict[str, str]]) -> None:
    """verify --json: the document, then exit 1 if anything failed."""
    ok = all(r["ok"] for r in results) and not archives
    document = {"url": url, "ok": ok, "versions": results, "unreadable_archives": archives}
    typer.echo(json.dumps(document, indent=2))
    if not ok:
        raise typer.Exit(1)


# -- restore --------------------------------------------------------------------


class Format(str, Enum):
    torch = "torch"
    safetensors = "safetensors"
    hf = "hf"


class Mode(str, Enum):
    min = "min"
    max = "max"


@app.command("restore")
def restore_command(
    url: Url,
    out: Annotated[
        Path,
        typer.Option(
            "--out", "-o", help="The file to write (a directory with --max-shard-size).", show_default=False
        ),
    ],
    version: VersionOpt = None,
    step: StepOpt = None,
    file_format: Annotated[
        Format,
        typer.Option(
            "--format",
            help="torch: the nested state as saved, for torch.load(FILE, weights_only=True) (numpy arrays "
            "become tensors). safetensors: only the tensors, flat, keyed by slash-joined key path "
            "(e.g. model/layer.weight); non-tensor values are left out. hf: a Hugging Face Trainer "
            "checkpoint's model as a directory OUT that from_pretrained loads (config, weights, "
            "tokenizer; not the optimizer).",
        ),
    ] = Format.torch,
    keys: Annotated[
        list[str] | None,
        typer.Option(
            "--keys",
            help="Restore only these key paths (repeat or comma-separate). One subtree (e.g. model) is "
            "written without its prefix, so that model.load_state_dict(...) takes the file as it is.",
        ),
    ] = None,
    max_shard_size: Annotated[
        str | None,
        typer.Option(
            "--max-shard-size",
            help="With --format safetensors: write Hugging Face's sharded layout into the directory OUT "
            "(model-0000k-of-0000n.safetensors of at most this size, e.g. 5GB or 500MB, and "
            "model.safetensors.index.json).",
            show_default=False,
        ),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite OUT if it exists.")] = False,
    best: Annotated[
        str | None,
        typer.Option(
            "--best",
            metavar="METRIC",
            help="Restore the version with the best METRIC (needs --best-mode); ties go to the newest.",
        ),
    ] = None,
    best_mode: Annotated[
        Mode | None, typer.Option("--best-mode", help=BEST_MODE_HELP, show_default=False)
    ] = None,
    as_json: JsonFlag = False,
    storage_options: StorageOptions = None,
) -> None:
    """Write a version (or part of it) to one torch or safetensors file, or a sharded directory.

    With --json, one document: the version, what was written where, and how many tensors."""
    _refuse_both(version, step)
    if best is not None and (version is not None or step is not None):
        raise typer.BadParameter("give --best or --version/--step, not both", param_hint="'--best'")
    if best is not None and best_mode is None:
        raise typer.BadParameter(best_mode_needed(best, "--best"), param_hint="'--best'")
    if best is None and best_mode is not None:
        raise typer.BadParameter("--best-mode goes with --best METRIC", param_hint="'--best-mode'")
    if max_shard_size is not None and file_format is not Format.safetensors:
        _fail("--max-shard-size writes safetensors shards: add --format safetensors")
    if file_format is Format.hf and keys:
        _fail("--format hf writes a Trainer checkpoint's whole model: leave out --keys")
    if out.is_symlink():
        _fail(
            f"{out} is a symbolic link (to {os.readlink(out)}): restore writes no file through a link; "
            "give the path of a real file"
        )
    if out.exists() and not force:
        _fail(f"{out} exists; pass --force to overwrite it")
    if out.is_dir() and max_shard_size is None and file_format is not Format.hf:
        _fail(f"{out} is a directory; give a file name (or --max-shard-size for a sharded directory)")
    from ckptflow.storage import store_holding

    around = store_holding(out.absolute().parent)
    if around is not None:  # a file there would be a leftover, or part of a version, of that store
        _fail(f"{out} is inside the checkpoint store {around}: give an --out outside stores")
    missing_dirs = _missing_directories(out)
    store = _open(url, storage_options, command="restore")
    if out.is_dir() and _holds_a_store(out, store):  # --force replaces the directory OUT
        _fail(
            f"{out} holds a checkpoint store (version directories): restore replaces no store; "
            "give another --out"
        )
    if best is not None and best_mode is not None:
        info = store.best(best, best_mode.value)
        typer.echo(f"the best by {best} ({best_mode.value}): {present.describe(info)}", err=as_json)
    else:
        info = store.info(_chosen(store, version, step))
    selected = [k for item in keys or [] for k in item.split(",") if k.strip("/ ")]
    try:
        state = store.load(info.version, keys=selected or None)
    except KeyError as exc:
        _fail(f"{exc.args[0]} (version {info.version})")
    if file_format is Format.hf:
        from ckptflow.storage import export_pretrained

        with _directories_kept_on_success(missing_dirs):
            if out.exists():  # --force: replaced once the new directory is whole
                _replace_dir(out, lambda tmp: export_pretrained(state, tmp), store)
                names = sorted(p.name for p in out.iterdir())
            else:
                names = export_pretrained(state, out)
        if as_json:
            _restored_json(info, out, "hf", None, names)
            return
        typer.echo(
            f"restored version {info.version} (epoch {present.epoch_text(info)}) to {out}/ for "
            f"from_pretrained: {', '.join(names)}"
        )
        return
    from .export import selected_subtree, write_hf_shards, write_state

    subtree = selected_subtree(state, selected[0]) if len(selected) == 1 else None
    if isinstance(subtree, dict):
        state = subtree  # one subtree: its own keys, as a state_dict has them
    meta = {"format": "pt", "ckptflow.version": str(info.version), "ckptflow.source": store.url}
    with _directories_kept_on_success(missing_dirs):
        if max_shard_size is not None:
            tensors, files = write_hf_shards(state, out, max_shard_size=max_shard_size, metadata=meta)
        else:
            tensors = write_state(state, out, fmt=file_format.value, metadata=meta)
    if as_json:
        _restored_json(
            info, out, file_format.value, tensors, files if max_shard_size is not None else [out.name]
        )
        return
    if max_shard_size is not None:
        typer.echo(
            f"restored version {info.version} (epoch {present.epoch_text(info)}) to {out}/: "
            f"{tensors} tensors in {len([f for f in files if f.endswith('.safetensors')])} shards "
            f"({', '.join(files)})"
        )
        return
    typer.echo(
        f"restored version {info.version} (epoch {present.epoch_text(info)}) to {out}: "
        f"{tensors} tensors, {present.human_size(out.stat().st_size)}"
    )


def _restored_json(info: Any, out: Path, fmt: str, tensors: int | None, files: list[str]) -> None:
    """restore --json: the version, the path written, its format, tensors and files."""
    doc = {
        "version": info.version,
        "epoch": info.epoch,
        "step": info.step,
        "out": str(out.absolute()),
        "format": fmt,
        "tensors": tensors,
        "files": sorted(files),
        "bytes": sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
        if out.is_dir()
        else out.stat().st_size,
    }
    typer.echo(json.dumps(doc, indent=2))


def _replace_dir(out: Path, write: Any, store: CheckpointStore) -> None:
    """Write a directory beside ``out`` with ``write(path)``, then put it in ``out``'s place (the old
    one moved aside first, removed last; restore refused an ``out`` that holds a store before)."""
    import shutil
    import tempfile

    spare = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        write(spare / "new")
        out.rename(spare / "old")
        (spare / "new").rename(out)
    finally:
        shutil.rmtree(spare, ignore_errors=True)


def _holds_a_store(directory: Path, store: CheckpointStore) -> bool:
    """Whether ``directory`` is, or is above, the root of ``store`` (local), or holds version
    directories of a store of its own."""
    import re

    here = os.path.realpath(directory)
    root = os.path.realpath(store.url) if os.path.isabs(store.url) else None
    if root is not None and (root == here or root.startswith(here + os.sep)):
        return True
    return any(re.fullmatch(r"v[0-9]{6,}", p.name) and p.is_dir() for p in directory.iterdir())


def _missing_directories(out: Path) -> list[Path]:
    """The directories above ``out`` that restore creates, outermost first; fails (before the store is
    read) when the nearest existing one is a file, or a link on the way leads nowhere."""
    missing: list[Path] = []
    parent = out.absolute().parent
    while not parent.exists():
        if parent.is_symlink():
            _fail(
                f"{parent} is a symbolic link to nothing ({os.readlink(parent)}): give --out a real directory"
            )
        missing.append(parent)
        parent = parent.parent
    if not parent.is_dir():
        _fail(f"{parent} is a file, not a directory: give --out a path in a directory")
    return missing[::-1]


@contextmanager
def _directories_kept_on_success(directories: list[Path]) -> Iterator[None]:
    """Create ``directories`` (outermost first) for a write; remove them again if it fails."""
    made: list[Path] = []
    try:
        for directory in directories:
            directory.mkdir()
            made.append(directory)
        yield
    except BaseException:
        for directory in reversed(made):
            with suppress(OSError):
                directory.rmdir()
        raise


# -- prune and gc ---------------------------------------------------------------


@app.command("import")
def import_command(
    source: Annotated[
        str,
        typer.Argument(
            metavar="SOURCE",
            help="A torch.save or safetensors file, or a Hugging Face directory (save_pretrained, a "
            "Trainer's checkpoint-N).",
            show_default=False,
        ),
    ],
    url: Url,
    epoch: Annotated[
        int | None, typer.Option("--epoch", min=0, help="The epoch to record (default: the source's).")
    ] = None,
    step: Annotated[
        int | None, typer.Option("--step", min=0, help="The global step to record (default: the source's).")
    ] = None,
    as_json: JsonFlag = False,
    storage_options: StorageOptions = None,
) -> None:
    """Commit a checkpoint another tool made as a new version of the store at URL (created if new)."""
    from ckptflow.storage import CheckpointStore, read_import

    found = read_import(source, epoch=epoch, step=step)  # refused here: no store is touched
    for line in found.skipped:  # a link out of a directory, a name that cannot come back, ...
        typer.echo(f"note: {line}", err=True)
    store = CheckpointStore(url, storage_options=storage_options)
    created = store.loc.is_local and not os.path.exists(store.loc.root)
    try:
        with store.lease(owner="ckptflow import"):
            info = store.save(found.state, epoch=found.epoch, step=found.step, user=found.user)
    except BaseException:
        if created:  # the lease made the directory: a failed import leaves nothing behind
            with suppress(OSError):
                os.rmdir(store.loc.root)
        raise
    if as_json:
        doc = {
            "url": store.url,
            "version": info.version,
            "epoch": info.epoch,
            "step": info.step,
            "bytes": info.size,
        }
        typer.echo(
            json.dumps(
                {**doc, "source": info.user.get("imported_from"), "kind": info.user.get("import_kind")}
            )
        )
        return
    typer.echo(f"imported {source} ({info.user.get('import_kind')}) as {present.describe(info)}")


@app.command("prune")
def prune_command(
    url: Url,
    keep_last: Annotated[int | None, typer.Option("--keep-last", min=1, help="Keep the newest N.")] = None,
    keep_every: Annotated[
        int | None, typer.Option("--keep-every", min=1, help="Keep epochs that are multiples of K.")
    ] = None,
    keep_best: Annotated[
        str | None, typer.Option("--keep-best", metavar="METRIC", help="Keep the best version by METRIC.")
    ] = None,
    best_mode: Annotated[
        Mode | None, typer.Option("--best-mode", help=BEST_MODE_HELP, show_default=False)
    ] = None,
    old_mode: Annotated[Mode | None, typer.Option("--mode", hidden=True)] = None,  # the old --best-mode
    dry_run: DryRun = False,
    as_json: JsonFlag = False,
    storage_options: StorageOptions = None,
) -> None:
    """Delete the committed versions a retention policy does not keep (the newest is always kept).

    With --json, one document: the versions kept, removed and held (by a tarball shared with a
    kept version), the tarballs and loose copies removed, and the bytes freed."""
    if keep_last is None and keep_every is None and keep_best is None:
        raise typer.BadParameter(
            "give at least one of them", param_hint="'--keep-last' / '--keep-every' / '--keep-best'"
        )
    if old_mode is not None:
        if best_mode is not None and best_mode is not old_mode:
            raise typer.BadParameter("--mode is the old name of --best-mode: give only --best-mode")
        typer.echo("note: --mode is deprecated: use --best-mode", err=True)
        best_mode = old_mode
    if best_mode is not None and keep_best is None:
        raise typer.BadParameter("--best-mode needs --keep-best", param_hint="'--best-mode'")
    if keep_best is not None and best_mode is None:
        raise typer.BadParameter(best_mode_needed(keep_best), param_hint="'--best-mode'")
    from ckptflow.storage import RetentionPolicy

    policy = RetentionPolicy(
        keep_last=keep_last,
        keep_every=keep_every,
        keep_best=keep_best,
        best_mode=best_mode.value if best_mode is not None else None,
    )
    store = _open(url, storage_options, command="prune")
    with _writer_lease(store, command="prune", dry_run=dry_run):
        survey = store.survey()
        if not survey.committed:
            from ckptflow.storage import VersionNotFoundError

            raise VersionNotFoundError(None, store.url, [])
        manifests = [x.manifest for x in survey.committed.values()]
        if keep_best is not None and not any(keep_best in m.metrics for m in manifests):
            found = sorted({name for m in manifests for name in m.metrics})
            _fail(
                f"no committed version has the metric {keep_best!r} (metrics: {', '.join(found) or 'none'})"
            )
        infos = {v: store.info_of(x) for v, x in survey.committed.items()}
        plan = store.plan_retention(policy) if dry_run else store.apply_retention(policy)
    if as_json:
        doc = {
            "url": store.url,
            "dry_run": dry_run,
            "kept": list(plan.keep),
            "removed": list(plan.remove),
            "held": {str(v): tar for v, tar in plan.held.items()},
            "best": list(plan.best),
            "tarballs_removed": list(plan.tarballs),
            "loose_removed": list(plan.loose),
            "freed_bytes": plan.freed,
            "freed_bytes_by_version": {str(v): n for v, n in plan.freed_each.items()},
        }
        typer.echo(json.dumps(doc, indent=2))
        return
    for line in present.prune_lines(plan, infos, dry_run=dry_run, policy=policy):
        typer.echo(line)


@app.command("gc")
def gc_command(
    url: Url,
    dry_run: DryRun = False,
    min_age: Annotated[
        float,
        typer.Option(
            "--min-age",
            metavar="SECONDS",
            min=0,
            help="Spare leftovers changed more recently: a save may still be writing them (0: remove all).",
        ),
    ] = GC_MIN_AGE,
    as_json: JsonFlag = False,
    storage_options: StorageOptions = None,
) -> None:
    """Remove the uncommitted leftovers of interrupted saves and archive jobs.

    It holds the store's writer lease (refused while a run or another writer holds it). A save in
    flight without the lease is known by its claim and stays; so do leftovers changed in the last
    --min-age seconds.
    With --json, one document: what was removed (would be, with --dry-run), what was left, the bytes freed.
    """
    store = _open(url, storage_options, command="gc")
    with _writer_lease(store, command="gc", dry_run=dry_run):
        report = store.collect_garbage(min_age=min_age, dry_run=dry_run)
    if as_json:

        def listed(found: Any) -> dict[str, list[Any]]:
            return {
                "versions": list(found.versions),
                "tarballs": list(found.tarballs),
                "temp_files": list(found.temp_files),
            }

        doc = {
            "url": store.url,
            "dry_run": dry_run,
            "min_age_seconds": min_age,
            "removed": listed(report.removed),
            "left": listed(report.spared),
            "writing": list(report.writing),
            "freed_bytes": report.freed,
        }
        typer.echo(json.dumps(doc, indent=2))
        return
    done = "would remove" if dry_run else "removed"
    for number in report.removed.versions:
        typer.echo(f"{done} uncommitted {store.version_url(number)}")
    for tar in report.removed.tarballs:
        typer.echo(
            f"{done} {store.tarball_url(tar)}: a tarball without an index (an interrupted archive job)"
        )
    for name in report.removed.temp_files:
        typer.echo(f"{done} {store.display(name)}: a temporary file of an interrupted write")
    recent, again = f"changed in the last {min_age:g}s", "(--min-age 0 removes it)"
    for number in report.spared.versions:
        typer.echo(f"left {store.version_url(number)}: {recent}, a save may be writing it {again}")
    for tar in report.spared.tarballs:
        typer.echo(f"left {store.tarball_url(tar)}: {recent}, an archive job may be writing it {again}")
    for name in report.spared.temp_files:
        typer.echo(f"left {store.display(name)}: {recent}, a write may be in progress {again}")
    for number in report.writing:
        typer.echo(f"left {store.version_url(number)}: a save in flight (a live writer claims it)")
    if not (report.removed or report.spared or report.writing):
        typer.echo(f"no uncommitted leftovers in {store.url}")
    elif report.freed:
        typer.echo(f"freed {present.human_size(report.freed)}")


@contextmanager
def _writer_lease(store: CheckpointStore, *, command: str, dry_run: bool) -> Iterator[None]:
    """Hold the store's writer lease while ``command`` removes things (a dry run only reads); fails
    naming the holder while a run or another writer holds the store."""
    if dry_run:
        yield
        return
    with store.lease(owner=f"ckptflow {command}"):
        yield


# -- run ------------------------------------------------------------------------
# The training pipeline; flows/run_cmd.py imports Prefect only inside the command's body.
app.command("run")(run_command)
app.command("check")(check_command)
app.command("archive")(archive_command)
app.command("extract")(extract_command)
# Commands for a Prefect server (flows/server_cmd.py, Prefect imported inside their bodies as well).
app.command("publish")(publish_command)
app.command("setup-server")(setup_server_command)
app.add_typer(deployments_app)


def main() -> None:
    """The ``ckptflow`` console script: what click does, but a usage error is one ``error:`` line and
    where to look (click prints the usage block, a blank line and ``Error: ...``), exit 2."""
    # click's classes, from typer's (typer may carry its own copy of click)
    bases: dict[str, type[Exception]] = {
        c.__name__: c for c in typer.BadParameter.__mro__ if issubclass(c, Exception)
    }
    usage_error, click_exception = bases["UsageError"], bases["ClickException"]
    try:
        code = app(prog_name="ckptflow", standalone_mode=False)
    except click_exception as exc:
        if not isinstance(exc, usage_error) or type(exc).__name__ == "NoArgsIsHelpError":
            exc.show()  # type: ignore[attr-defined]  # `ckptflow` alone: its help; click's other errors
            sys.exit(exc.exit_code)  # type: ignore[attr-defined]
        ctx = getattr(exc, "ctx", None)
        command = ctx.command_path if ctx is not None else "ckptflow"
        typer.echo(f"error: {' '.join(exc.format_message().split())}", err=True)  # type: ignore[attr-defined]
        typer.echo(f"  (`{command} -h` lists the options)", err=True)
        sys.exit(exits.USAGE)
    except typer.Abort:
        typer.echo("Aborted!", err=True)
        sys.exit(exits.FAILED)
    sys.exit(code if isinstance(code, int) else exits.FINISHED)


if __name__ == "__main__":
    main()
