"""A demo spec with sharded state: a small transformer language model trained with FSDP2.

Every block is sharded with ``fully_shard`` over all ranks, and so is the whole model, so
its parameters and Adam's state are DTensors: each rank holds 1/W of them, and a checkpoint
is written shard by shard (see "Sharded state" in the README). It runs on CPU with gloo:

    ckptflow run --nproc 2 --spec ckptflow.flows.demo_lm:TinyLMSpec --epochs 4

and resumes at another ``--nproc``: a checkpoint of W ranks loads at any W. The corpus is
synthetic (sequences of tokens drawn once from the run's seed, each a walk with a learnable
rule), so nothing is downloaded. Run in one process (``--in-process``), the model is not sharded.

Config keys: vocab (64), width (32), blocks (2), heads (2), seq (16), sequences (256),
batch_size (32), lr (3e-3).
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ckptflow.tasks.spec import Trainable, TrainingSpec, epoch_generator


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, each with a residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int, width: int, blocks: int, heads: int, seq: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(blocks))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class TinyLMSpec(TrainingSpec):
    """A tiny causal LM, FSDP2-sharded in ranks; it trains step by step (``train_steps``)."""

    sums: tuple[float, int] = (0.0, 0)

    def build(self) -> Trainable:
        get = self.config.get
        vocab, seq, count = int(get("vocab", 64)), int(get("seq", 16)), int(get("sequences", 256))
        corpus = _corpus(vocab, seq + 1, count, self.seed)
        held_out = max(1, count // 8)
        self.val, self.train = corpus[:held_out], corpus[held_out:]
        self.vocab = vocab
        model = TinyLM(vocab, int(get("width", 32)), int(get("blocks", 2)), int(get("heads", 2)), seq)
        if dist.is_available() and dist.is_initialized():  # a rank, even of a world of 1
            _shard(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=float(get("lr", 3e-3)))
        return Trainable(model=model, optimizer=optimizer)

    def train_steps(
        self, trainable: Trainable, epoch: int, start: int
    ) -> Generator[None, None, dict[str, float]]:
        """One step per batch; resumed at ``start``, it skips the batches trained already and takes
        the loss sums so far from its state (see the digits demo)."""
        model, opt = trainable.model, trainable.optimizer
        assert opt is not None
        rank, world = _rank(), _world()
        order = torch.randperm(len(self.train), generator=epoch_generator(self.seed, epoch))
        model.train()
        if start == 0:
            self.sums = (0.0, 0)
        for batch in self._batches(order)[start:]:
            rows = self.train[batch[rank::world]]  # this rank's part of the batch
            loss = self._loss(model, rows)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            self.sums = (self.sums[0] + loss.item() * len(rows), self.sums[1] + len(rows))
            yield
        sums = torch.tensor([self.sums[0], float(self.sums[1])], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(sums)
        return {"loss": float(sums[0] / sums[1])}

    def _batches(self, order: torch.Tensor) -> list[torch.Tensor]:
        batch = int(self.config.get("batch_size", 32))
        return [order[i : i + batch] for i in range(0, len(order) - batch + 1, batch)]

    def steps_per_epoch(self, epoch: int) -> int:
        return len(self._batches(torch.arange(len(self.train))))

    def state_dict(self) -> dict[str, Any]:
        return {"loss_sum": self.sums[0], "samples": self.sums[1]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if "loss_sum" in state:
            self.sums = (float(state["loss_sum"]), int(state["samples"]))

    def evaluate(self, trainable: Trainable, epoch: int) -> dict[str, float]:
        trainable.model.eval()
        with torch.no_grad():  # every rank runs the whole model: FSDP2 gathers each block's shards
            return {"val_loss": float(self._loss(trainable.model, self.val))}

    def _loss(self, model: nn.Module, rows: torch.Tensor) -> torch.Tensor:
        logits = model(rows[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, self.vocab), rows[:, 1:].reshape(-1))


def _corpus(vocab: int, length: int, count: int, seed: int) -> torch.Tensor:
    """``count`` walks of ``length`` tokens: each step adds one of three small strides, mod vocab."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(vocab, (count, 1), generator=gen)
    strides = torch.tensor([1, 2, 5])[torch.randint(3, (count, length - 1), generator=gen)]
    return torch.cat([starts, starts + strides.cumsum(1)], dim=1) % vocab


def _shard(model: TinyLM) -> None:
    """FSDP2 over every rank: each block its own unit, then the rest of the model."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (_world(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
