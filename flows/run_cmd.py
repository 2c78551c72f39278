"""`ckptflow run`: the training pipeline, run locally with a progress display.

The flow runs in this process; the model trains in a child process started
first (``train_process``, :mod:`ckptflow.tasks.training.trainer`), so that importing
torch and building the model overlap importing Prefect and creating the flow
run (``--in-process`` keeps the model here, for a debugger). Without a
configured API, a temporary local API server is started in a subprocess right
away (:mod:`.api_server`), so its start-up overlaps all of that too.
Prefect's own console log lines are shown from WARNING up unless --verbose
(they all still reach the Prefect API and its UI).

Each option sets one :class:`~ckptflow.tasks.config.PipelineConfig` field,
named beside it: its default is :func:`config_field`, which says which field
(``retention.keep_last`` for ``--keep-last``) and how the flag's text becomes
the field's value. What must hold: every field has a flag
(tests/test_cli_config_flags.py), and the config is the one place for a
field's default (shown in ``--help``) and its bounds (a value out of them is
a usage error naming the flag and the bound). ``--config FILE`` gives fields
from a file, which flags on the command line override; it and ``--verbose``
are this process's own. The config is imported when ``run`` parses or shows its help,
never for the other commands.

Before any of that starts, :mod:`.preflight` checks the spec and the store: a
bad spec or storage URL, a missing bucket, missing credentials or an
unreachable endpoint end the command within seconds with one ``error:`` line
and exit 1 (the traceback with --verbose), and no server or flow run is
started. The training process's verdict on the spec is awaited again just
before the flow run is created.
"""

from __future__ import annotations

import decimal
import functools
import gc
import json
import os
import re
import shlex
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, TypeVar, cast

import typer

from . import exits
from .options import BEST_MODE_HELP, best_mode_needed

if TYPE_CHECKING:
    from pydantic import BaseModel, ValidationError

    from ckptflow.tasks.config import PipelineConfig

Opt = typer.Option
T = TypeVar("T")


@dataclass(frozen=True)
class FlagText:
    """How a flag's text becomes its field's value (``parse(flag, text)``), and the field's default
    back into the flag's terms (``show``)."""

    parse: Callable[[str, Any], Any]
    show: Callable[[Any], Any]


class ConfigField:
    """The default of a ``run`` option that sets the config field ``path``: the config's default
    for that field (in the flag's terms), which ``--help`` shows and which parsing gives when the
    flag is left out. Click calls a callable default; reading it imports the config."""

    def __init__(self, path: str, text: FlagText | None = None, own_default: Any = None) -> None:
        self.path = path
        self.text = text
        self.own_default = own_default  # a default of the CLI's own, for a field the config requires

    def __call__(self) -> Any:
        value = self.own_default if self.own_default is not None else _config_default(self.path)
        return value if value is None or self.text is None else self.text.show(value)

    def __str__(self) -> str:  # the default in --help (none shown for None)
        value = self()
        return "" if value is None else str(value)

    def __bool__(self) -> bool:  # what a boolean flag's --help takes for its default
        return bool(self())

    def __repr__(self) -> str:
        return f"config_field({self.path!r})"

    def value(self, flag: str, given: Any) -> Any:
        """The field's value for the flag's parsed value ``given``."""
        return given if given is None or self.text is None else self.text.parse(flag, given)


def config_field(path: str, text: FlagText | None = None, *, own_default: Any = None) -> Any:
    """The default of an option that sets the PipelineConfig field ``path`` (see :class:`ConfigField`)."""
    return ConfigField(path, text, own_default)


@functools.cache
def _config_defaults() -> BaseModel:
    from ckptflow.tasks.config import PipelineConfig

    return PipelineConfig.model_construct(storage="")  # every default; storage has none (the CLI's own)


def _config_default(path: str) -> Any:
    return functools.reduce(getattr, path.split("."), _config_defaults())


def _json_object(option: str, text: str) -> dict[str, Any]:
    from .inputs import parse_json_option

    value = parse_json_option(text, option=option)
    if not isinstance(value, dict):
        raise typer.BadParameter(f"{option} must be a JSON object")
    return value


_UNITS = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "KB": 1000,
    "KIB": 1 << 10,
    "M": 1 << 20,
    "MB": 10**6,
    "MIB": 1 << 20,
    "G": 1 << 30,
    "GB": 10**9,
    "GIB": 1 << 30,
    "T": 1 << 40,
    "TB": 10**12,
    "TIB": 1 << 40,
}


def _size(option: str, text: str) -> int:
    """``"1GiB"`` -> 1073741824; ``"500MB"`` -> 500000000."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS:
        raise typer.BadParameter(f"{option} {text!r} is not a size like 512MiB or 1GiB")
    return int(decimal.Decimal(match.group(1)) * _UNITS[unit])  # exact: a float rounds 2**60 + 1 down


JSON = FlagText(parse=_json_object, show=json.dumps)
SIZE = FlagText(parse=_size, show=str)  # a number of bytes is a size too
NEGATED = FlagText(parse=lambda _flag, on: not on, show=lambda on: not on)


def run_command(
    ctx: typer.Context,
    storage: Annotated[
        str, Opt("--storage", "-s", help="Where checkpoints live (path, file://, s3://...).")
    ] = config_field("storage", own_default="./checkpoints"),
    epochs: Annotated[int, Opt("--epochs", "-e", help="Train until this epoch.")] = config_field("epochs"),
    spec: Annotated[str, Opt("--spec", help="TrainingSpec as package.module:Class.")] = config_field("spec"),
    spec_config: Annotated[
        str, Opt("--spec-config", metavar="JSON", help="The spec's config.")
    ] = config_field("spec_config", JSON),
    seed: Annotated[
        int, Opt("--seed", help="The run's seed (with --spec and --spec-config, its identity).")
    ] = (config_field("seed")),
    shards: Annotated[
        int, Opt("--shards", help="HDF5 shard files per version at most: one per 64 MiB of state.")
    ] = config_field("shards"),
    dedup: Annotated[
        bool,
        Opt(
            "--dedup/--no-dedup",
            help="Write only tensors whose bytes no committed version holds (--no-dedup: full copies).",
        ),
    ] = config_field("dedup"),
    async_save: Annotated[
        bool, Opt("--async-save/--no-async-save", help="Save while the next epoch runs.")
    ] = config_field("async_save"),
    save_every: Annotated[
        int, Opt("--save-every", help="Save every N epochs (and at the end).")
    ] = config_field("save_every"),
    save_every_steps: Annotated[
        int | None,
        Opt(
            "--save-every-steps",
            metavar="N",
            help="Also save every N optimizer steps, inside epochs (a spec with train_steps).",
        ),
    ] = config_field("save_every_steps"),
    save_every_minutes: Annotated[
        float | None,
        Opt("--save-every-minutes", metavar="M", help="Also save once M minutes passed since the last save."),
    ] = config_field("save_every_minutes"),
    stop_grace: Annotated[
        float,
        Opt(
            "--stop-grace",
            metavar="SECONDS",
            help="On SIGTERM or a cancellation: time for the step in progress and its save to commit.",
        ),
    ] = config_field("stop_grace_seconds"),
    save_retries: Annotated[
        int, Opt("--save-retries", help="Retries of a failed save or commit task.")
    ] = config_field("save_retries"),
    save_timeout: Annotated[
        float | None,
        Opt(
            "--save-timeout",
            metavar="SECONDS",
            help="Fail a save or commit task that waits longer (it is retried; the write goes on).",
        ),
    ] = config_field("save_timeout_seconds"),
    archive_every: Annotated[
        int | None, Opt("--archive-every", help="Consolidate each K committed epochs into a tarball.")
    ] = config_field("archive.every"),
    archive_size: Annotated[
        str | None,
        Opt("--archive-size", metavar="SIZE", help="Or: once loose checkpoints reach SIZE (1GiB)."),
    ] = config_field("archive.target_bytes", SIZE),
    keep_loose: Annotated[
        bool, Opt("--keep-loose", help="Keep loose files of archived versions.")
    ] = config_field("archive.keep_loose"),
    max_pending: Annotated[
        int,
        Opt("--max-pending", help="Archive and upload jobs run at once (more wait; a commit never waits)."),
    ] = config_field("archive.max_pending"),
    upload_to: Annotated[
        str | None, Opt("--upload-to", metavar="URL", help="Mirror versions and archives to URL (s3://...).")
    ] = config_field("archive.upload_to"),
    upload_options: Annotated[
        str, Opt("--upload-options", metavar="JSON", help="fsspec options for --upload-to (no credentials).")
    ] = config_field("archive.upload_options", JSON),
    upload_secret: Annotated[
        str | None,
        Opt("--upload-secret", metavar="BLOCK", help="Credentials for --upload-to, as --storage-secret."),
    ] = config_field("archive.upload_secret"),
    upload_versions: Annotated[
        bool | None,
        Opt(
            "--upload-versions/--no-upload-versions",
            help="With --upload-to: each version as it commits (default), or archives only.",
            show_default=False,
        ),
    ] = config_field("archive.upload_versions"),
    upload_every: Annotated[
        str | None,
        Opt(
            "--upload-every",
            metavar="CADENCE",
            help="With --upload-to: 'epoch', or a duration (10m): the durable tier's cadence.",
        ),
    ] = config_field("archive.upload_every"),
    durable_keep_last: Annotated[
        int | None,
        Opt(
            "--durable-keep-last", metavar="N", help="With --upload-to: the durable tier keeps its newest N."
        ),
    ] = config_field("archive.durable_keep_last"),
    upload_retry: Annotated[
        float,
        Opt(
            "--upload-retry", metavar="SECONDS", help="After a failed upload: the pause before trying again."
        ),
    ] = config_field("archive.upload_retry_seconds"),
    stop_drain: Annotated[
        float,
        Opt("--stop-drain", metavar="SECONDS", help="On SIGTERM: time to make the newest version durable."),
    ] = config_field("archive.stop_drain_seconds"),
    keep_last: Annotated[int | None, Opt("--keep-last", help="Retention: keep the newest N.")] = config_field(
        "retention.keep_last"
    ),
    keep_undurable: Annotated[
        bool,
        Opt(
            "--keep-undurable/--no-keep-undurable",
            help="Retention keeps the versions --upload-to lacks (default), or applies to them too.",
        ),
    ] = config_field("retention.keep_undurable"),
    keep_every: Annotated[
        int | None, Opt("--keep-every", help="Retention: keep every K-th epoch.")
    ] = config_field("retention.keep_every"),
    keep_best: Annotated[
        str | None, Opt("--keep-best", metavar="METRIC", help="Retention: keep the best.")
    ] = config_field("retention.keep_best"),
    best_mode: Annotated[
        str | None, Opt("--best-mode", help=BEST_MODE_HELP, show_default=False)
    ] = config_field("retention.best_mode"),
    best_count: Annotated[
        int, Opt("--best-count", help="Retention: keep the best N by --keep-best's METRIC.")
    ] = config_field("retention.best_count"),
    stop_metric: Annotated[
        str | None, Opt("--stop-metric", help="Metric for --target/--patience.")
    ] = config_field("stop.metric"),
    stop_mode: Annotated[str, Opt("--stop-mode", help="min or max, for --stop-metric.")] = config_field(
        "stop.mode"
    ),
    target: Annotated[
        float | None, Opt("--target", help="Stop when the metric reaches this.")
    ] = config_field("stop.target"),
    patience: Annotated[
        int | None, Opt("--patience", help="Stop after N epochs without gain.")
    ] = config_field("stop.patience"),
    max_seconds: Annotated[float | None, Opt("--max-seconds", help="Wall-clock budget.")] = config_field(
        "stop.max_seconds"
    ),
    epoch_retries: Annotated[int, Opt("--epoch-retries", help="Retries of a failed epoch.")] = config_field(
        "epoch_retries"
    ),
    nproc: Annotated[
        int, Opt("--nproc", help="Training processes (torch.distributed ranks) on this machine.")
    ] = config_field("nproc"),
    nnodes: Annotated[
        int, Opt("--nnodes", help="Machines; the others join with torchrun (see README).")
    ] = config_field("nnodes"),
    rdzv_endpoint: Annotated[
        str | None, Opt("--rdzv-endpoint", metavar="HOST:PORT", help="The ranks' rendezvous (with --nnodes).")
    ] = config_field("rdzv_endpoint"),
    rdzv_id: Annotated[
        str | None, Opt("--rdzv-id", help="Rendezvous id the other machines' torchrun give.")
    ] = config_field("rdzv_id"),
    dist_backend: Annotated[
        str, Opt("--dist-backend", help="auto, gloo or nccl (with --nproc).")
    ] = config_field("dist_backend"),
    rank_timeout: Annotated[
        float,
        Opt(
            "--rank-timeout",
            metavar="SECONDS",
            help="How long a rank waits for the others in a collective before failing.",
        ),
    ] = config_field("rank_timeout_seconds"),
    torch_threads: Annotated[
        int | None,
        Opt("--torch-threads", help="torch intra-op threads (default: all cores but one)."),
    ] = config_field("torch_threads"),
    storage_options: Annotated[
        str,
        Opt("--storage-options", metavar="JSON", envvar="CKPTFLOW_STORAGE_OPTIONS", help="fsspec options."),
    ] = config_field("storage_options", JSON),
    storage_secret: Annotated[
        str | None,
        Opt(
            "--storage-secret",
            metavar="BLOCK",
            help="Prefect block with credentials: a Secret block NAME or aws-credentials/NAME.",
        ),
    ] = config_field("storage_secret"),
    lease_timeout: Annotated[
        float,
        Opt(
            "--lease-timeout",
            metavar="SECONDS",
            help="The store's writer lease, renewed every sixth of this; another run may take over "
            "a lease left unrenewed this long.",
        ),
    ] = config_field("lease_timeout_seconds"),
    allow_config_change: Annotated[
        bool, Opt("--allow-config-change", help="Resume even if spec, spec config or seed changed.")
    ] = config_field("allow_config_change"),
    resume_only: Annotated[
        bool,
        Opt("--resume-only", help="Fail unless --storage holds a checkpoint to resume from (no new run)."),
    ] = config_field("resume_only"),
    in_process: Annotated[
        bool,
        Opt("--in-process", help="Train in this process, not a child (for a debugger; starts slower)."),
    ] = config_field("train_process", NEGATED),
    config_file: Annotated[
        str | None,
        Opt(
            "--config",
            metavar="FILE",
            help="The config's fields from a JSON, TOML or YAML file, nested as the config is "
            "(retention: {keep_last: 3}); a flag given on the command line wins over the file.",
        ),
    ] = None,
    verbose: Annotated[bool, Opt("--verbose", "-v", help="Show Prefect's log lines.")] = False,
) -> None:
    """Train with checkpoints (resuming from the newest committed one in --storage)."""
    if in_process and (nproc > 1 or nnodes > 1):
        raise typer.BadParameter("--in-process trains in this process: leave it out with --nproc or --nnodes")
    if keep_best is not None and best_mode is None:
        raise typer.BadParameter(best_mode_needed(keep_best), param_hint="'--best-mode'")
    if best_mode is not None and keep_best is None:
        raise typer.BadParameter("--best-mode needs --keep-best", param_hint="'--best-mode'")
    if not verbose:
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")
    from . import preflight

    config = config_of(ctx)
    spec_defined = _before_the_flow_run(verbose, lambda: preflight.spec_defined(config.spec))
    _before_the_flow_run(verbose, lambda: preflight.check_store(config))
    if config.uses_trainers and not preflight.may_fetch(config):
        from ckptflow.tasks.training.trainer import prestart

        prestart(config)  # torch, the spec and the model, while this process imports Prefect
    if not spec_defined:  # only importing it can tell
        _before_the_flow_run(verbose, lambda: preflight.import_spec(config))
    warmup = _warm_up_api()
    result = _run_with_progress(config, warmup, verbose=verbose)
    _print_next_steps(config, result)


def config_flags(ctx: typer.Context) -> dict[str, tuple[str, ConfigField]]:
    """The options of ``ctx``'s command that set config fields: parameter name -> (flag, its ConfigField)."""
    return {
        str(p.name): (max(p.opts, key=len), p.default)  # --storage, not -s
        for p in ctx.command.params
        if isinstance(p.default, ConfigField)  # the others are this process's own (--verbose)
    }


def config_of(ctx: typer.Context) -> PipelineConfig:
    """The PipelineConfig that ``run``'s parsed options give, each flag to its field. A value the
    config refuses is a usage error naming the flag (the config holds the bounds)."""
    from pydantic import ValidationError

    from ckptflow.tasks.config import PipelineConfig

    path = ctx.params.get("config_file")
    from_file = read_config_file(path) if path else {}
    raw: dict[str, Any] = {}
    flags = config_flags(ctx)
    for name, (flag, field) in flags.items():
        *sections, key = field.path.split(".")
        into: dict[str, Any] = raw
        given: Any = from_file
        for section in sections:
            into = into.setdefault(section, {})
            given = given.get(section) if isinstance(given, dict) else None
        in_file = isinstance(given, dict) and key in given
        source = ctx.get_parameter_source(name)  # (typer's own click: compared by name)
        if in_file and (source is None or source.name in ("DEFAULT", "DEFAULT_MAP")):
            assert isinstance(given, dict)
            into[key] = given[key]  # the file's, unless the command line (or its variable) gave one
        else:
            into[key] = field.value(flag, ctx.params[name])
    _merge_unknown(raw, from_file)  # what no flag sets: the config refuses it, naming it
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as exc:
        where = {field.path: flag for flag, field in flags.values()}
        if path:
            where = {p: f"{flag} (or {path})" for p, flag in where.items()}
        raise _usage_error(exc, where) from None


def read_config_file(path: str) -> dict[str, Any]:
    """The config's fields in ``path``: JSON (``.json``), TOML (``.toml``) or YAML (``.yaml``,
    ``.yml``), read as :mod:`.inputs` reads documents; a usage error naming the file when it cannot be
    read, is refused there or is no mapping."""
    from .inputs import read_document_file

    value = read_document_file(path, option="'--config'")
    if not isinstance(value, dict):
        raise typer.BadParameter(
            f"{path} must hold a mapping of the config's fields", param_hint="'--config'"
        )
    return value


def _merge_unknown(raw: dict[str, Any], given: dict[str, Any]) -> None:
    """Copy into ``raw`` the keys of ``given`` it lacks (no flag sets them: misspelt fields)."""
    for key, value in given.items():
        if key not in raw:
            raw[key] = value
        elif isinstance(raw[key], dict) and isinstance(value, dict):
            _merge_unknown(raw[key], value)
        elif isinstance(raw[key], dict):  # a section given as something else: the config says why
            raw[key] = value


def _usage_error(exc: ValidationError, flag_of: dict[str, str]) -> typer.BadParameter:
    """``Invalid value for '--shards': Input should be less than or equal to 256``; an error of no
    one flag (options that do not fit together) names the config's field, or ``config``."""
    errors = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"])
        errors.append((flag_of.get(where), where, err["msg"]))
    if len(errors) == 1 and errors[0][0]:
        flag, _, message = errors[0]
        return typer.BadParameter(message, param_hint=f"'{flag}'")
    return typer.BadParameter("; ".join(f"{flag or where or 'config'}: {msg}" for flag, where, msg in errors))


class _ApiWarmup:
    """The temporary API server (:mod:`.api_server`), started in a thread while torch imports.

    The thread outlives the start: on Linux the server is bound to the life of the thread that
    started it (PR_SET_PDEATHSIG), so it waits, a daemon, until the process exits.
    """

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._start, name="ckptflow-api-server", daemon=True)
        self.thread.start()

    def _start(self) -> None:
        from .api_server import start_for_cli

        try:
            server = start_for_cli()
        except BaseException as exc:
            self.error = exc
            return
        finally:
            self.ready.set()
        if server is not None:
            threading.Event().wait()

    def join(self) -> None:
        """Wait for the server; exit 1 with its reason if it did not start."""
        self.ready.wait()
        if self.error is not None:
            typer.echo(f"error: {self.error}", err=True)
            raise typer.Exit(1)


def _warm_up_api() -> _ApiWarmup | None:
    """Start a temporary local API server in the background when no API is configured."""
    if os.environ.get("PREFECT_API_URL"):
        return None
    return _ApiWarmup()


def _warm_up_torch() -> None:
    """Import what building a model first pulls in: constructing any torch optimizer imports
    ``torch._dynamo`` (1.1 s here). Done now, before Prefect is imported, it overlaps the start of
    a temporary API server; left to the flow's first task, it would wait for the API and share
    the GIL with Prefect's background threads (1.3-1.4 s there)."""
    import torch._dynamo  # noqa: F401


def _server_unless_the_spec_failed(warmup: _ApiWarmup, verbose: bool) -> None:
    """Wait for the temporary API server, but report a spec that failed to import at once (a first
    start of the server creates its database: seconds a broken spec need not wait)."""
    from ckptflow.tasks.training.trainer import spec_check

    pending = spec_check()
    while not warmup.ready.wait(0.05):
        if pending is not None and pending.done() and pending.exception() is not None:
            _before_the_flow_run(verbose, pending.result)


def _before_the_flow_run(verbose: bool, check: Callable[[], T]) -> T:
    """``check()``; a bad spec or store ends the command before any flow run exists: one ``error:``
    line, exit 1 (75 for a store another writer holds)."""
    from ckptflow.storage import CheckpointError, StoreLockedError
    from ckptflow.tasks.spec import SpecError
    from ckptflow.tasks.training.run_state import ConfigMismatchError, NothingToResumeError
    from ckptflow.tasks.training.trainer import TrainerDiedError, TrainerError

    refused = (CheckpointError, OSError, SpecError, ConfigMismatchError, NothingToResumeError)
    try:
        return check()
    except (*refused, TrainerDiedError, TrainerError) as exc:
        if verbose:
            import traceback

            traceback.print_exc()
        typer.echo(f"error: {' '.join(str(exc).split()) or type(exc).__name__}", err=True)
        raise typer.Exit(exits.STORE_HELD if isinstance(exc, StoreLockedError) else exits.FAILED) from None


def _hide_tracebacks() -> None:
    """Keep tracebacks out of Prefect's console lines: a failed run ends with one ``error:`` line.

    They still reach the API (the run's logs in the UI); --verbose prints them here too.
    """
    import logging

    from prefect.logging.handlers import PrefectConsoleHandler

    loggers = [
        logging.root,
        *(x for x in logging.root.manager.loggerDict.values() if isinstance(x, logging.Logger)),
    ]
    for handler in {h for logger in loggers for h in logger.handlers if isinstance(h, PrefectConsoleHandler)}:
        handler.addFilter(lambda record: record.exc_info is None)


def _run_with_progress(config: Any, warmup: _ApiWarmup | None, *, verbose: bool = False) -> dict[str, Any]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ckptflow.tasks.reporting.formatting import human_size, metrics_text
    from ckptflow.tasks.reporting.monitoring import add_listener, resume_text

    console = Console(stderr=True)
    progress = Progress(
        TextColumn("[bold]epochs"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.description}"),
        console=console,
        transient=False,
    )
    task_id = progress.add_task("starting Prefect and building the model...", total=config.epochs)

    def on_event(kind: str, data: dict[str, Any]) -> None:
        if kind == "start":
            progress.update(task_id, completed=data["first_epoch"] - 1, description="training")
            if data.get("fetched") is not None:  # the fast tier lacked the newest version
                got = data["fetched"]
                console.print(
                    f"fetched version {got['version']} from the durable tier {got['source']}: {got['files']} "
                    f"file(s), {human_size(got['bytes'])} in {got['seconds']:.1f}s",
                    markup=False,
                    highlight=False,
                )
                if got.get("lost"):
                    console.print(
                        f"versions {got['lost'][0]}-{got['lost'][-1]} were committed on the lost fast tier "
                        "only: they are trained again",
                        markup=False,
                        highlight=False,
                    )
            if data.get("resumed") is not None:  # inside epoch 1 too, with the step it stands at
                console.print(f"resuming from {resume_text(data['resumed'])} in {data['url']}", markup=False)
            elif not data.get("committed"):  # a mistyped --storage would otherwise train from scratch unseen
                console.print(
                    f"starting a new store in {data['url']}: no committed checkpoint there "
                    "(--resume-only refuses to start one)",
                    markup=False,
                    highlight=False,
                )
        elif kind == "epoch":
            progress.update(task_id, completed=data["epoch"], description=metrics_text(data["metrics"]))
            console.print(f"epoch {data['epoch']:>4}  {metrics_text(data['metrics'])}")
        elif kind == "step":
            from ckptflow.tasks.reporting.monitoring import step_text

            length, done = data["epoch_steps"], data["in_epoch"]
            where = data["epoch"] - 1 + (done / length if length else 0)
            progress.update(task_id, completed=where, description=step_text(done, length))
        elif kind == "retention":
            console.print(data["text"], markup=False, soft_wrap=True)
        elif kind == "committed":
            info = data["info"]
            console.print(
                f"  committed {info.url} ({human_size(info.size)} in {info.save_seconds or 0:.2f}s)"
            )
        elif kind == "note":
            console.print(data["line"], markup=False, highlight=False)

    remove = add_listener(on_event)
    started = time.perf_counter()
    try:
        if not config.uses_trainers:
            _warm_up_torch()  # while a temporary API server starts in its own process
        from .preflight import wait_for_spec

        if warmup is not None:
            _server_unless_the_spec_failed(warmup, verbose)
            warmup.join()  # before Prefect is imported: it reads PREFECT_API_URL then
        from ckptflow.flows.train import train_pipeline  # Prefect, while the trainers import the spec

        gc.freeze()  # what is imported lives as long as the process: the collector no longer walks it

        _before_the_flow_run(verbose, wait_for_spec)  # no flow run for a spec that failed to import
        if not verbose:
            _hide_tracebacks()

        with progress:
            state = train_pipeline(config, return_state=True)
    except KeyboardInterrupt:  # Ctrl-C: the run saved where it stood (its summary says what)
        console.print("[yellow]interrupted[/] (Ctrl-C): a resume continues from the newest committed version")
        raise typer.Exit(exits.INTERRUPTED) from None
    finally:
        remove()
    if state.is_cancelled():
        console.print(f"[yellow]cancelled[/]: {state.message}")
        from ckptflow.tasks.stopping import stop_signal

        signum = stop_signal()  # a SIGTERM (a scheduler, a spot notice), or a cancel from Prefect
        raise typer.Exit(exits.stopped_by(signum) if signum is not None else exits.CANCELLED)
    if not state.is_completed():
        exc, held = _exception_of(state)
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(exits.STORE_HELD if held else exits.FAILED)
    result = cast(dict[str, Any], state.result())
    console.print(f"done in {time.perf_counter() - started:.1f}s: {result['stop_reason']}")
    return result


def _resume_command(config: Any, url: str) -> str:
    """``ckptflow run`` that resumes this run for 5 more epochs: the store, the identity where it is
    not the default (a resume with another one is refused), the credentials block and ranks; shell-quoted."""
    from ckptflow.tasks.config import DEMO_SPEC

    args = ["ckptflow", "run", "--storage", url, "--epochs", str(config.epochs + 5)]
    if config.spec != DEMO_SPEC:
        args += ["--spec", config.spec]
    if config.spec_config:
        args += ["--spec-config", json.dumps(config.spec_config, separators=(",", ":"))]
    if config.seed != 0:
        args += ["--seed", str(config.seed)]
    if config.storage_secret is not None:
        args += ["--storage-secret", config.storage_secret]
    if config.nproc > 1:
        args += ["--nproc", str(config.nproc)]
    archive = config.archive
    if archive.upload_to is not None:  # the durable tier: a resume on another machine starts from it
        args += ["--upload-to", archive.upload_to]
        if archive.upload_options:
            args += ["--upload-options", json.dumps(archive.upload_options, separators=(",", ":"))]
        if archive.upload_secret is not None:
            args += ["--upload-secret", archive.upload_secret]
        if archive.upload_every is not None:
            args += ["--upload-every", archive.upload_every]
        if archive.durable_keep_last is not None:
            args += ["--durable-keep-last", str(archive.durable_keep_last)]
    return " ".join(shlex.quote(a) for a in args)


def _exception_of(state: Any) -> tuple[str, bool]:
    """Why a run failed, in one line, and whether another writer holding the store was why."""
    from ckptflow.storage import StoreLockedError

    try:
        state.result()
    except BaseException as exc:
        return " ".join(str(exc).split()) or type(exc).__name__, isinstance(exc, StoreLockedError)
    return state.message or "the run did not complete", False


def _schedule_note(planned: int | None) -> list[str]:
    """What training longer does to an LR schedule: it stays the one the run was planned with."""
    if not planned:
        return []
    return [
        f"    (a longer run keeps its plan: RunFacts.planned_epochs stays {planned}, so a schedule sized "
        'from it ends there; see the README\'s "Your own model")'
    ]


def _print_next_steps(config: Any, result: dict[str, Any]) -> None:
    url = result["storage"]
    quoted = shlex.quote(url)
    lines = [
        "",
        f"checkpoints: {url}  (latest: {result['latest_url']})",
        f"  resume / train longer:  {_resume_command(config, url)}",
        *_schedule_note(result.get("planned_epochs")),
        f"  list checkpoints:       ckptflow ls {quoted}",
        f"  inspect the latest:     ckptflow show {quoted}",
        f"  verify checksums:       ckptflow verify {quoted}",
        f"  restore for torch.load: ckptflow restore {quoted} --out model.pt",
    ]
    sys.stdout.write("\n".join(lines) + "\n")
