"""A Hugging Face Trainer run whose checkpoints are committed by CkptflowCallback, for
tests/integrations.

    python tests/children/hf_child.py STORE OUTPUT_DIR OUT [--kill-at-step S] [--resume] [--sync]

Trains a tiny GPT-2 built from its config (random weights, no download) on generated token
sequences for 12 steps, saving every 4. ``--kill-at-step S`` SIGKILLs the process when step S
begins; ``--resume`` first writes the store's newest version into OUTPUT_DIR and resumes from
it. Prints ``resuming from PATH`` (or ``resuming from None``) first, ``done`` last; the final
weights go to OUT (torch.save of a state dict). ``storage_options`` come as JSON in
``CKPTFLOW_STORAGE_OPTIONS``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from ckptflow.storage.integrations.hf import CkptflowCallback, restore_trainer_checkpoint

STEPS = 12
SAVE_EVERY = 4


class KillAt(TrainerCallback):
    def __init__(self, step: int | None) -> None:
        self.step = step

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (64, 16), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("store")
    p.add_argument("output_dir")
    p.add_argument("out")
    p.add_argument("--kill-at-step", type=int)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--sync", action="store_true")
    args = p.parse_args()
    options = json.loads(os.environ.get("CKPTFLOW_STORAGE_OPTIONS", "{}"))

    start = (
        restore_trainer_checkpoint(args.store, args.output_dir, storage_options=options)
        if args.resume
        else None
    )
    print(f"resuming from {start}", flush=True)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16))
    training = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=STEPS,
        save_steps=SAVE_EVERY,
        logging_steps=SAVE_EVERY,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        seed=0,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    callback = CkptflowCallback(args.store, storage_options=options, async_save=not args.sync)
    trainer = Trainer(
        model=model, args=training, train_dataset=dataset(), callbacks=[callback, KillAt(args.kill_at_step)]
    )
    trainer.train(resume_from_checkpoint=start)
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, args.out)
    print("done", flush=True)


if __name__ == "__main__":
    main()
