"""Options that several ckptflow commands share, defined and checked in one place.

``--storage-options``: fsspec options (s3 credentials,
``client_kwargs.endpoint_url``) arrive as a JSON object, or ``@FILE`` holding
one, from the flag or ``CKPTFLOW_STORAGE_OPTIONS``. What always holds: the
value is never printed, not even in an error message (it may hold secrets).

``--best-mode`` (``prune`` and ``run``): required with ``--keep-best``; no
direction is assumed, since keeping the minimum of an accuracy deletes the
best checkpoint.

This module imports neither the storage library nor Prefect, so every command
module can import it at the top.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

HELP = (
    "fsspec options for the URL as a JSON object (s3: key, secret, "
    'client_kwargs={"endpoint_url": ...}), or @FILE holding it. Never printed.'
)


def parse_storage_options(text: str) -> dict[str, Any]:
    """Parse ``--storage-options``; the message never repeats the value (it may hold secrets)."""
    from .inputs import DocumentError, parse_document, read_file_text

    if text.startswith("@"):
        text = read_file_text(text[1:], option="'--storage-options'")
    try:
        value = parse_document(text, "json")
    except DocumentError as exc:  # its message never quotes the value
        raise typer.BadParameter(f"not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise typer.BadParameter("must be a JSON object, e.g. '{\"anon\": true}'")
    return value


def storage_options_option(help: str = HELP) -> Any:
    """The typer option: parsed by :func:`parse_storage_options`, ``None`` when not given."""
    return typer.Option(
        "--storage-options",
        metavar="JSON",
        parser=parse_storage_options,
        envvar="CKPTFLOW_STORAGE_OPTIONS",
        help=help,
        show_default=False,
    )


StorageOptions = Annotated[Any, storage_options_option()]


BEST_MODE_HELP = (
    "Required with --keep-best: max if a higher METRIC is better (an accuracy), min if a lower one is "
    "(a loss)."
)


def best_mode_needed(metric: str, flag: str = "--keep-best") -> str:
    """The usage error for ``flag`` (--keep-best, restore's --best) without --best-mode (prune, run
    and restore say the same)."""
    return (
        f"{flag} {metric} needs --best-mode: max if a higher {metric} is better (an accuracy), "
        "min if a lower one is (a loss)"
    )
