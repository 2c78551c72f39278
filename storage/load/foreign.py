"""Checkpoint files other tools wrote, read one way by every command that reads them (import, diff).

A user hands ckptflow a ``.safetensors`` file or a ``torch.save`` file; it may be damaged,
truncated, crafted, or no checkpoint at all. Each is read here, so that ``ckptflow import`` and
``ckptflow diff`` accept and refuse the same files, and every refusal is one
:class:`~..errors.CheckpointError` naming the file and what is wrong, never a parser's traceback:

- safetensors: by the safetensors library, which checks the header (its length against the
  file, its JSON, each tensor's dtype, shape and offsets, that the tensors cover the data without
  overlapping) before it reads a byte of data;
- torch.save: ``torch.load(weights_only=True)`` (nothing is unpickled but tensors, containers,
  plain values and the few classes :mod:`.pyvalues` allows), without ``mmap``: torch's reader
  then checks that each storage's record holds the bytes the file declares (with ``mmap`` a
  short record is read past its end, into the next one).
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

from ..errors import CheckpointError

MAX_HEADER = 100 << 20  # safetensors' own limit on a header's bytes


def read_safetensors(path: Path) -> dict[str, Any]:
    """The tensors of a safetensors file; CheckpointError naming the file when it is not one."""
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    except Exception as exc:  # safetensors' SafetensorError: the header or the data is not sound
        raise CheckpointError(f"{path} is not a readable safetensors file: {_one_line(exc)}") from None


def read_torch_file(path: Path) -> Any:
    """What a torch.save file holds, unpickling nothing but what ``weights_only`` allows (and
    :mod:`.pyvalues`' classes); CheckpointError naming the file when it is not such a file."""
    import torch

    from ..format.pyvalues import SAFE_CLASSES

    try:
        with torch.serialization.safe_globals(list(SAFE_CLASSES)):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"{path} holds more than tensors and plain values ({_refused_global(exc)}), and ckptflow "
            "never unpickles (it would run the code the file holds): save the state as tensors, "
            "numbers, strings and containers (a state_dict), or as safetensors"
        ) from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror or exc}") from None
    except Exception as exc:  # torch's reader: no zip, a record missing or shorter than declared, ...
        raise CheckpointError(f"{path} is not a readable torch.save file: {_one_line(exc)}") from None


def _refused_global(exc: BaseException) -> str:
    """What torch's weights-only unpickler refused (``Unsupported global: GLOBAL os.system``), not its
    advice to load the file anyway."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(exc).splitlines()]
    said = [line for line in lines if "Unsupported" in line or "WeightsUnpickler error" in line]
    return (said[0] if said else lines[0] if lines else type(exc).__name__)[:200]


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return " ".join(text.split())[:300]
