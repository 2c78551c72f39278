"""Run metadata: small JSON documents (``run.json``) stored beside a store's versions.

A document is written atomically and read with the limits every manifest gets (size,
nesting); its name is a plain file name that no version directory or the lease can take.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import ManifestError
from ..files.atomic import write_file_atomic
from ..files.location import Location, translate_errors
from ..format.manifest_checks import MAX_BYTES, document_depth_problem
from . import commit as protocol
from .identity import STORE_FILE
from .lease import LEASE_FILE


def read_json(loc: Location, name: str) -> Any:
    """The JSON document ``name`` beside the versions, or None if there is none."""
    path = loc.path(meta_name(name))
    with translate_errors(loc, "reading"):
        try:
            data = loc.fs.cat_file(path, start=0, end=MAX_BYTES + 1)
        except FileNotFoundError:
            return None
    where = loc.display(name)
    if len(data) > MAX_BYTES:
        raise ManifestError(f"{where} is more than {MAX_BYTES} bytes; refused")
    try:
        value = json.loads(data)
    except ValueError as exc:
        raise ManifestError(f"{where} is not valid JSON: {exc}") from None
    except RecursionError:
        raise ManifestError(f"{where} is nested too deeply; refused") from None
    too_deep = document_depth_problem(value)
    if too_deep:
        raise ManifestError(f"{where} is {too_deep}; refused")
    return value


def write_json(loc: Location, name: str, value: Any) -> None:
    """Store the JSON document ``name`` beside the versions, atomically."""
    data = json.dumps(value, indent=1, sort_keys=True).encode()
    with translate_errors(loc, "writing to"):
        write_file_atomic(loc, meta_name(name), data)


def meta_name(name: str) -> str:
    """``name`` if it may name a metadata document; else ValueError."""
    reserved = name in (LEASE_FILE, STORE_FILE) or protocol.parse_version_dir(name) is not None
    if not name or "/" in name or name.startswith(".") or reserved:
        raise ValueError(f"{name!r} is not a valid metadata file name (a plain name like 'run.json')")
    return name
