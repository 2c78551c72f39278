"""A save's ranks: this process's place in the job and the checkpoint's own process group.

One process is :meth:`RankGroup.solo`, the group of one, whose collectives hand back
this process's own value; a store that is not distributed holds that group, so
every save and load runs the same phases at every world size. Nothing here imports
torch until a collective of more than one process runs: opening, listing and
pruning a store stay free of it.

The collectives carry JSON in uint8 tensors (nothing a rank receives is unpickled)
on a gloo group of the checkpoint's own, so that an async save's background thread
never interleaves with the training loop's collectives on the default group.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..errors import RankFailedError, RankLoadError

if TYPE_CHECKING:
    import torch

DEFAULT_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class RankGroup:
    """This process's place in the job, and the checkpoint's own process group."""

    rank: int
    world_size: int
    group: Any  # a torch.distributed ProcessGroup (gloo)

    @classmethod
    def create(cls, timeout: timedelta = DEFAULT_TIMEOUT) -> RankGroup:
        """A new gloo group over every rank of the default group (a collective call: all ranks make it)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "a distributed CheckpointStore needs torch.distributed to be initialised: "
                "call torch.distributed.init_process_group(...) on every rank first"
            )
        group = dist.new_group(backend="gloo", timeout=timeout)
        return cls(dist.get_rank(), dist.get_world_size(), group)

    @classmethod
    def solo(cls) -> RankGroup:
        """One process: the group of one, whose collectives hand back this process's own value."""
        return cls(0, 1, None)

    @property
    def is_solo(self) -> bool:
        return self.world_size == 1 and self.group is None

    def broadcast(self, value: Any) -> Any:
        """Rank 0's JSON value, on every rank."""
        if self.is_solo:
            return value
        import torch
        import torch.distributed as dist

        data = _encode(value) if self.rank == 0 else torch.empty(0, dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        with _collective():
            dist.broadcast(size, src=0, group=self.group)
            if self.rank != 0:
                data = torch.empty(int(size.item()), dtype=torch.uint8)
            if data.numel():
                dist.broadcast(data, src=0, group=self.group)
        return _decode(data)

    def gather(self, value: Any, *, wire: tuple[Callable, Callable] | None = None) -> list[Any] | None:
        """Every rank's value, in rank order, on rank 0 (None on the others). Values cross as JSON:
        ``wire`` gives the functions to and from JSON of a value that is not (unused by one process)."""
        if self.is_solo:
            return [value]
        import torch
        import torch.distributed as dist

        to_json, from_json = wire or (lambda v: v, lambda v: v)
        with _collective():
            sizes, padded = self._padded(to_json(value))
            if self.rank == 0:
                out = [torch.empty_like(padded) for _ in range(self.world_size)]
                dist.gather(padded, out, dst=0, group=self.group)
                return [from_json(v) for v in _unpadded(out, sizes)]
            dist.gather(padded, None, dst=0, group=self.group)
        return None

    def all_gather(self, value: Any, *, what: str | None = None) -> list[Any]:
        """Every rank's JSON value, in rank order, on every rank (``what``: the work other than a save
        that it is part of, for the error if a rank is gone)."""
        if self.is_solo:
            return [value]
        import torch
        import torch.distributed as dist

        with _collective(what):
            sizes, padded = self._padded(value)
            out = [torch.empty_like(padded) for _ in range(self.world_size)]
            dist.all_gather(out, padded, group=self.group)
        return _unpadded(out, sizes)

    def _padded(self, value: Any) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Every rank's encoded size (a collective), and ``value`` encoded, padded to the longest."""
        import torch
        import torch.distributed as dist

        data = _encode(value)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64), group=self.group)
        padded = torch.zeros(max(int(n.item()) for n in sizes), dtype=torch.uint8)
        padded[: data.numel()] = data
        return sizes, padded

    def together(self, work: Any, what: str) -> list[Any]:
        """Run ``work()`` on every rank and give every rank all their JSON results, in rank order;
        if it failed anywhere, every rank raises.

        The rank that failed raises its own error; the others raise :class:`RankLoadError`
        with the first failed rank's error in its message.
        """
        if self.is_solo:
            return [work()]
        failure: BaseException | None = None
        try:
            outcome = {"ok": work()}
        except BaseException as exc:  # every rank must hear of it (an interrupt too), or they would wait
            failure = exc
            outcome = {"error": f"{type(exc).__name__}: {exc}"}
        try:
            outcomes = self.all_gather(outcome, what=what)
        except RankLoadError:
            if failure is not None:  # this rank's own error says more than a peer gone quiet
                raise failure from None
            raise
        if failure is not None:
            raise failure
        for rank, theirs in enumerate(outcomes):
            if "error" in theirs:
                raise RankLoadError(f"{what} failed on rank {rank}: {theirs['error']}")
        return [theirs["ok"] for theirs in outcomes]

    def agree(self, work: Any, what: str) -> Any:
        """Run ``work()`` on rank 0 and give its result (or its failure) to every rank."""
        if self.is_solo:
            return work()
        outcome: dict[str, Any] | None = None
        if self.rank == 0:
            try:
                outcome = {"ok": work()}
            except Exception as exc:  # every rank must hear of it, or they would wait forever
                outcome = {"error": f"{type(exc).__name__}: {exc}"}
                self.broadcast(outcome)
                raise
        outcome = self.broadcast(outcome)
        if "error" in outcome:
            raise RankFailedError(f"{what} failed on rank 0: {outcome['error']}")
        return outcome["ok"]


@contextmanager
def _collective(what: str | None = None) -> Iterator[None]:
    """A collective of the checkpoint group that failed (a rank died, or it timed out): RankFailedError
    in a save, RankLoadError in ``what`` (anything else)."""
    try:
        yield
    except RuntimeError as exc:  # what gloo raises for a peer that closed its connection, or a timeout
        if what is None:
            raise RankFailedError(
                f"a rank of the checkpoint group died or timed out ({exc}); the save did not complete on "
                "every rank and the previous committed version is intact"
            ) from exc
        raise RankLoadError(
            f"a rank of the checkpoint group died or timed out in {what} ({exc}); "
            "it did not complete on every rank"
        ) from exc


def collective_failed(exc: BaseException) -> bool:
    """Whether ``exc`` came out of a torch.distributed collective: a rank died or it timed out.

    gloo raises a plain RuntimeError for a peer that closed its connection, or for a timeout, from
    inside the collective; a RuntimeError of anything else (a library's own check) is not one.
    """
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_globals.get("__name__") == dist.distributed_c10d.__name__:
            return True
        tb = tb.tb_next
    return False


def _encode(value: Any) -> torch.Tensor:
    import torch

    raw = json.dumps(value, allow_nan=False).encode()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)


def _unpadded(gathered: list[torch.Tensor], sizes: list[torch.Tensor]) -> list[Any]:
    return [_decode(t[: int(n.item())]) for t, n in zip(gathered, sizes, strict=True)]


def _decode(data: torch.Tensor) -> Any:
    return json.loads(bytes(data.numpy().tobytes()).decode())


__all__ = ["DEFAULT_TIMEOUT", "RankGroup", "collective_failed"]
