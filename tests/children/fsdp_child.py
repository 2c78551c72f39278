"""One rank of an FSDP2 job (gloo, CPU) for the sharded-state tests.

    RANK=r WORLD_SIZE=w MASTER_ADDR=127.0.0.1 MASTER_PORT=p \\
        python -m tests.children.fsdp_child SCENARIO URL OUTDIR [--mesh 1d|2d] [--version V]
            [--device cpu|cuda] [--frozen]

Every rank builds the same small transformer (:func:`build`), shards it with
``fully_shard`` per block on a 1-D mesh of all ranks (``--mesh 2d``: a 2x2
mesh, tensor parallel inside each FSDP shard), and runs ``SCENARIO``. With ``--device cuda``
(tests/cuda) each rank's model lives on GPU ``LOCAL_RANK`` and the group is NCCL for CUDA
tensors, gloo for the store's CPU collectives.

- ``save`` / ``dcp_save``: two Adam steps from seed 0, then the model and
  optimizer state dicts (DTensors) saved with ``CheckpointStore.save`` on a
  distributed store (with each rank's :func:`own_state` as ``rank_state``) /
  with ``dcp.save`` through ``store.dcp_writer``;
- ``load`` / ``dcp_load``: a model built from another seed (its values all
  differ) and trained one step, filled from version ``--version`` (default:
  the newest) with ``store.load(into=...)`` / ``dcp.load`` through
  ``store.dcp_reader``; ``fresh``: the same model, not filled;
- ``save_async``: like ``save`` with ``save_async``, training two more steps
  before waiting for it (``full.json`` is the state when it was called), then
  again as version 2 (``second.json``);
- ``frozen_saves``: a fine-tune from seed 0 whose embedding and blocks are frozen (only the
  head trains): versions by ``save`` and ``save`` again, ``save_async`` one Adam step later,
  then ``dcp.save`` twice one step later; ``result-r0.json`` lists each one's
  ``[version, new_bytes, size]`` (``saves``) and ``full.json`` is the state of the last;
- ``kill_in_save``: like ``save`` at seed 1, but rank 1 blocks in the middle
  of writing its shard (after creating ``OUTDIR/blocked``) until the test
  SIGKILLs it; rank 0 records the error its save raised (``save``: type, message,
  type of the cause) before it exits with it;
- ``full_disk``: like ``fail_in_save``, on a disk that is really full (the test
  fills it): each rank's error from a ``save`` and a ``save_async``, and rank 0's
  view of the store's files and of the disk's free bytes after each (``left``).

Rank 0 then writes ``OUTDIR/full.json``: the digest of the full (gathered)
model and optimizer state (``full_state_dict=True``): per key path, dtype,
shape and SHA-256 of the bytes; values as JSON. The test compares digests.
``storage_options`` (for S3) come as JSON in ``CKPTFLOW_STORAGE_OPTIONS``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

VOCAB, WIDTH, BLOCKS = 64, 32, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build(seed: int, mesh_kind: str, device: str = "cpu") -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model (same values on every rank for a seed), sharded, and its Adam optimizer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = TinyLM().to(device)
    world = dist.get_world_size()
    if mesh_kind == "2d":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh(device, (world // 2, 2), mesh_dim_names=("dp", "tp"))
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fsdp_mesh = mesh["dp"]
    else:
        fsdp_mesh = init_device_mesh(device, (world,))
    for block in model.blocks:
        fully_shard(block, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(1234)
    device = next(model.parameters()).device
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (4, 8), generator=gen).to(device)
        loss = nn.functional.cross_entropy(model(tokens).reshape(-1, VOCAB), tokens.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()


def state_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optimizer": osd}


class Parts:
    """The model and the optimizer as DCP ``Stateful`` objects, as a training app may hand them to
    a load: ``state_dict`` gives copies (so a load that fills them leaves the model as it was),
    and ``load_state_dict`` puts a loaded state into the live objects after a barrier on the
    default group, as FSDP1's optimizer loading and many apps' own code run collectives there.
    ``applied`` lists the calls of ``load_state_dict``."""

    applied: list[str] = []

    class Model:
        def __init__(self, model: nn.Module) -> None:
            self.model = model

        def state_dict(self) -> dict[str, Any]:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            return copies(get_model_state_dict(self.model))

        def load_state_dict(self, state: dict[str, Any]) -> None:
            from torch.distributed.checkpoint.state_dict import set_model_state_dict

            dist.barrier()
            Parts.applied.append("model")
            set_model_state_dict(self.model, state)

    class Optimizer:
        def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
            self.model, self.opt = model, opt

        def state_dict(self) -> dict[str, Any]:
            from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

            return copies(get_optimizer_state_dict(self.model, self.opt))

        def load_state_dict(self, state: dict[str, Any]) -> None:
            from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

            dist.barrier()
            Parts.applied.append("optimizer")
            set_optimizer_state_dict(self.model, self.opt, state)

    @staticmethod
    def of(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
        return {"model": Parts.Model(model), "optimizer": Parts.Optimizer(model, opt)}


def copies(state: Any) -> Any:
    """``state`` with every tensor (DTensors too) cloned, the rest as it is."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, state)


def full_digest(model: nn.Module, opt: torch.optim.Optimizer) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(model, opt, options=options)
    return digest({"model": msd, "optimizer": osd})


def digest(value: Any) -> Any:
    """Tensors as [dtype, shape, sha256 of their bytes]; containers and values as JSON."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return ["tensor", str(t.dtype), list(t.shape), hashlib.sha256(raw).hexdigest()]
    if isinstance(value, dict):
        return {str(k): digest(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [digest(v) for v in value]
    return value


def own_state(rank: int) -> dict[str, Any]:
    """What rank ``rank`` keeps for itself (``rank_state``): different on every rank."""
    return {"rank": rank, "cursor": 100 + rank, "perm": torch.arange(5) + rank}


def block_in_write(marker: Path) -> None:
    """Rank 1 stops in the middle of writing a shard (after its first bytes) until it is killed."""
    from ckptflow.storage.save import writer

    original = writer.write_hashed

    def stuck(sink: Any, data: Any, *hashers: Any) -> None:
        original(sink, data, *hashers)
        marker.touch()
        time.sleep(3600)

    writer.write_hashed = stuck  # type: ignore[assignment]


def fail_in_write() -> None:
    """Rank 1's writes fail the way a full disk fails them."""
    from ckptflow.storage import StorageUnavailableError
    from ckptflow.storage.save import writer

    def full(sink: Any, data: Any, *hashers: Any, **pieces: Any) -> None:
        raise StorageUnavailableError("no space left on device (rank 1's disk)")

    writer.write_hashed = full  # type: ignore[assignment]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario")
    parser.add_argument("url")
    parser.add_argument("out", type=Path)
    parser.add_argument("--mesh", default="1d")
    parser.add_argument("--version", type=int, default=None)
    parser.add_argument("--stateful", action="store_true", help="load into Stateful wrappers of the model")
    parser.add_argument(
        "--rank0-looks-early",
        action="store_true",
        help="rank 0 sees version 1 as the newest (as if it "
        "looked before a save committed version 2) while the other ranks see version 2",
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--frozen", action="store_true", help="freeze all but the head, as frozen_saves")
    args = parser.parse_args()
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    import torch.distributed.checkpoint as dcp

    from ckptflow.storage import CheckpointStore

    result: dict[str, Any] = {}
    options = json.loads(os.environ.get("CKPTFLOW_STORAGE_OPTIONS") or "null")  # s3fs's, for S3
    store = CheckpointStore(args.url, distributed=True, storage_options=options)
    if args.rank0_looks_early and rank == 0:
        locate = store._locate
        store._locate = lambda version: locate(1 if version is None else version)  # type: ignore[method-assign]
    saving = args.scenario in {"save", "dcp_save", "kill_in_save", "save_async", "fail_in_save", "full_disk"}
    saving = saving or args.scenario == "frozen_saves"
    # Seeds other than the stored version's where a save must write (dedup would reference it all).
    seeds = {"kill_in_save": 1, "full_disk": 2, "fail_in_save": 3}
    model, opt = (
        build(seeds.get(args.scenario, 0), args.mesh, args.device)
        if saving
        else build(7, args.mesh, args.device)
    )
    if args.frozen or args.scenario == "frozen_saves":
        for name, param in model.named_parameters():
            param.requires_grad_(name.startswith("head."))
    if saving:
        train(model, opt, 2)
        state = state_of(model, opt)
        if args.scenario == "kill_in_save" and rank == 1:
            block_in_write(args.out / "blocked")
        start = time.perf_counter()
        if args.scenario in ("fail_in_save", "full_disk"):  # each rank's error, from a save and an async save
            from ckptflow.storage import CheckpointError
            from tests.disks import files_under, free_bytes

            if rank == 1 and args.scenario == "fail_in_save":
                fail_in_write()
            for name, save in (("save", store.save), ("save_async", lambda s: store.save_async(s).wait())):
                try:
                    save(state)
                except CheckpointError as exc:
                    result[name] = [type(exc).__name__, str(exc)]
                if args.scenario == "full_disk" and rank == 0:  # the files once its save has raised
                    root = Path(args.url)
                    result.setdefault("left", {})[name] = [files_under(root), free_bytes(root)]
        elif args.scenario == "kill_in_save":
            try:
                store.save(state, epoch=1, rank_state=own_state(rank))
            except Exception as exc:
                cause = type(exc.__cause__).__name__ if exc.__cause__ else None
                result["save"] = [type(exc).__name__, str(exc), cause]
                (args.out / f"result-r{rank}.json").write_text(json.dumps(result))
                raise
        elif args.scenario == "save_async":  # twice: the second reuses the first one's host copy
            handle = store.save_async(state, epoch=1, metrics={"loss": 1.5}, rank_state=own_state(rank))
            full = full_digest(model, opt)  # what was saved: the training steps below must not change it
            train(model, opt, 2)
            result["version"] = handle.wait().version
            second = full_digest(model, opt)
            handle = store.save_async(state_of(model, opt), epoch=2)
            train(model, opt, 2)
            result["second"] = handle.wait().version
            if rank == 0:
                (args.out / "full.json").write_text(json.dumps(full))
                (args.out / "second.json").write_text(json.dumps(second))
            result["after"] = full_digest(model, opt) not in (full, second)
        elif args.scenario == "frozen_saves":
            infos = [store.save(state, epoch=1), store.save(state_of(model, opt), epoch=2)]
            train(model, opt, 1)
            infos.append(store.save_async(state_of(model, opt), epoch=3).wait())
            train(model, opt, 1)
            for _ in range(2):  # the second: its parent is the first, its chunks all referenced
                writer = store.dcp_writer(epoch=4)
                dcp.save(state_of(model, opt), storage_writer=writer, process_group=store.group.group)
                if rank == 0:  # the coordinator committed it
                    assert writer.info is not None
                    infos.append(writer.info)
            if rank == 0:
                result["saves"] = [[i.version, i.new_bytes, i.size] for i in infos]
        elif args.scenario == "dcp_save":
            writer = store.dcp_writer(epoch=1, metrics={"loss": 1.5})
            dcp.save(state, storage_writer=writer, process_group=store.group.group)
            result["version"] = writer.info.version if writer.info else None
        else:
            info = store.save(state, epoch=1, metrics={"loss": 1.5}, rank_state=own_state(rank))
            result["version"] = info.version
        result["seconds"] = time.perf_counter() - start
    elif args.scenario == "fresh":
        train(model, opt, 1)
    elif args.scenario == "load_errors":  # each rank's error, loading a missing and a damaged version
        from ckptflow.storage import CheckpointError

        for name, version in (("missing", 99), ("damaged", args.version)):
            try:
                store.load(version, into=state_of(model, opt))
            except CheckpointError as exc:
                result[name] = [type(exc).__name__, str(exc)]
        try:  # no load_state_dict (and its barrier) may run while a rank failed its read
            store.load(args.version, into=Parts.of(model, opt))
        except CheckpointError as exc:
            result["stateful"] = [type(exc).__name__, str(exc), Parts.applied]
        # states that do not fit the version: refused before a byte is read, on every rank
        extra = state_of(model, opt)
        extra["model"]["extra.weight"] = torch.zeros(2)
        shape = state_of(model, opt)
        shape["model"]["head.weight"] = torch.zeros(3)
        before = full_digest(model, opt)
        for name, state in (("extra", extra), ("shape", shape)):
            try:
                store.load(args.version, into=state)
            except CheckpointError as exc:
                result[name] = [type(exc).__name__, str(exc)]
        result["untouched"] = full_digest(model, opt) == before
    else:
        train(model, opt, 1)  # the optimizer has state to be overwritten
        state = state_of(model, opt)
        if args.scenario == "dcp_load":
            dcp.load(
                state, storage_reader=store.dcp_reader(version=args.version), process_group=store.group.group
            )
            loaded = state
        elif args.stateful:  # the objects take their state themselves
            store.load(args.version, into=Parts.of(model, opt))
            result["applied"] = Parts.applied
            loaded = None
        else:
            loaded = store.load(args.version, into=state)
            result["same_object"] = loaded is state
        from torch.distributed.checkpoint.state_dict import set_state_dict

        if loaded is not None:
            set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])
    if args.scenario != "save_async":
        full = full_digest(model, opt)
        if rank == 0:
            (args.out / "full.json").write_text(json.dumps(full))
    (args.out / f"result-r{rank}.json").write_text(json.dumps(result))
    store.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
