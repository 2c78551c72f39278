"""The Hugging Face Trainer through CkptflowCallback: a tiny GPT-2 from its config, real SIGKILLs.

- a run SIGKILLed mid-training, whose output directory is then lost (a new machine), resumes
  from the store and ends with the same weights, bit for bit, as an uninterrupted run;
- what the store holds is no pickle: the Trainer's ``training_args.bin`` is left out, and
  every other file comes back;
- a crafted version whose file names leave the checkpoint directory is refused;
- ``save_total_limit`` holds in the store as on the Trainer's disk (the best checkpoint kept too),
  and versions the callback did not save are never rotated out.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import TrainerCallback

from ckptflow.storage import CheckpointStore, VersionNotFoundError
from ckptflow.storage.integrations.hf import KEY, CkptflowCallback, restore_trainer_checkpoint, rotated_out
from tests.children import CHILDREN

CHILD = CHILDREN / "hf_child.py"


def run(store: Path, output_dir: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "CKPTFLOW_STORAGE_OPTIONS": "{}", "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, str(CHILD), str(store), str(output_dir), str(out), *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=output_dir.parent)


def resumed_from(proc: subprocess.CompletedProcess) -> str:
    return next(x for x in proc.stdout.splitlines() if x.startswith("resuming from")).split(" ", 2)[2]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One run with sync saves, never stopped: its store, output directory and final weights."""
    tmp = tmp_path_factory.mktemp("hf-ref")
    proc = run(tmp / "store", tmp / "out", tmp / "ref.pt", "--sync")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp


@pytest.mark.crash
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_killed_run_resumes_from_the_store_on_a_new_disk_as_if_never_stopped(
    tmp_path: Path, mode: str, uninterrupted: Path
) -> None:
    store = tmp_path / "store"
    flags = ["--sync"] if mode == "sync" else []
    killed = run(store, tmp_path / "out", tmp_path / "k.pt", "--kill-at-step", "10", *flags)
    assert killed.returncode == -9, killed.stderr[-3000:]
    steps = [v.step for v in CheckpointStore(store).versions()]
    assert steps == [4, 8] if mode == "sync" else steps in ([4], [4, 8])

    resumed = run(store, tmp_path / "new-disk", tmp_path / "r.pt", "--resume", *flags)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed_from(resumed) == str(tmp_path / "new-disk" / f"checkpoint-{steps[-1]}")
    got = torch.load(tmp_path / "r.pt", weights_only=True)
    want = torch.load(uninterrupted / "ref.pt", weights_only=True)
    assert got.keys() == want.keys()
    for k in got:
        assert torch.equal(got[k], want[k]), f"{k} differs from the uninterrupted run"
    assert [v.step for v in CheckpointStore(store).versions()][-1] == 12


def test_the_store_holds_every_file_but_the_pickled_arguments_and_no_pickle(
    tmp_path: Path, uninterrupted: Path
) -> None:
    written = uninterrupted / "out" / "checkpoint-12"
    restored = Path(restore_trainer_checkpoint(str(uninterrupted / "store"), tmp_path / "again"))
    assert restored.name == "checkpoint-12"
    names = sorted(p.name for p in written.iterdir())
    assert sorted(p.name for p in restored.iterdir()) == [n for n in names if n != "training_args.bin"]
    for name in ("trainer_state.json", "config.json"):
        assert (restored / name).read_bytes() == (written / name).read_bytes()
    want = torch.load(written / "optimizer.pt", weights_only=True)
    got = torch.load(restored / "optimizer.pt", weights_only=True)
    for k, v in want["state"][0].items():
        assert torch.equal(got["state"][0][k], v)
    for f in (uninterrupted / "store").rglob("*"):
        if f.is_file():
            data = f.read_bytes()
            assert not data.startswith(b"\x80") and b"PK\x03\x04" not in data, f"{f} holds a pickle"
    info = CheckpointStore(uninterrupted / "store").info()
    assert info.step == 12 and "loss" in info.metrics and info.user[KEY] == "checkpoint-12"


def test_a_version_naming_files_outside_its_directory_is_refused(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "store")
    evil = {"path": "../escaped.json", "kind": "bytes", "value": torch.tensor(list(b"{}"), dtype=torch.uint8)}
    store.save({KEY: {"name": "checkpoint-1", "files": [evil]}}, step=1)
    with pytest.raises(ValueError, match="outside the checkpoint directory"):
        restore_trainer_checkpoint(str(tmp_path / "store"), tmp_path / "out")
    assert not (tmp_path / "out" / "escaped.json").exists() and not (tmp_path / "escaped.json").exists()
    assert not (tmp_path / "out" / "checkpoint-1").exists()


@pytest.mark.parametrize("name", ["..", "../escaped", "/tmp/escaped"])
def test_a_version_whose_checkpoint_name_leaves_the_output_directory_is_refused(
    tmp_path: Path, name: str
) -> None:
    """Bug fix: the checkpoint's directory name came from the manifest unchecked, so a crafted
    version named ``..`` made the restore replace the output directory's parent."""
    store = CheckpointStore(tmp_path / "store")
    store.save({KEY: {"name": name, "files": []}}, step=1)
    (tmp_path / "out").mkdir()
    with pytest.raises(ValueError, match="not a plain directory name"):
        restore_trainer_checkpoint(str(tmp_path / "store"), tmp_path / "out")
    assert (tmp_path / "store").is_dir() and (tmp_path / "out").is_dir()


def test_an_empty_store_means_a_new_run_said_aloud_or_refused(tmp_path: Path, caplog) -> None:
    """Bug fixed: a URL with nothing there (a typo) returned None in silence, and training started
    from scratch; now a warning names the URL, and ``resume_only=True`` raises."""
    with caplog.at_level("WARNING", logger="ckptflow.storage.integrations.hf"):
        assert restore_trainer_checkpoint(str(tmp_path / "store"), tmp_path / "out") is None
    assert f"no checkpoint in {tmp_path / 'store'}: starting a new run" in caplog.text
    assert not (tmp_path / "out").exists()
    with pytest.raises(VersionNotFoundError, match=r"no committed checkpoint in .*stroe"):
        restore_trainer_checkpoint(str(tmp_path / "stroe"), tmp_path / "out", resume_only=True)
    assert not (tmp_path / "out").exists() and not (tmp_path / "stroe").exists()


# -- what else a checkpoint directory holds: odd names, symlinks -----------------------------

ODD_NAMES = {
    ".hidden.json": b'{"dot": 1}',
    "notes with spaces.txt": b"spaces",
    "caf\u00e9-\u00fcber.txt": "non-ASCII \u00e9".encode(),
    "sub dir/.cfg": b"nested",
    "alias-of-config.json": None,  # a symlink to config.json, inside the directory
}

UNWRITABLE = [b"back\\slash.txt", b"not-utf8-\xff.txt"]  # a Windows separator; bytes no UTF-8 name holds


class Planter(TrainerCallback):
    """Runs before CkptflowCallback's on_save: adds files with odd names and symlinks to the
    checkpoint directory the Trainer just wrote (as a user's own save code or a tool might)."""

    def __init__(self, outside: Path) -> None:
        self.outside = outside

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        for name, data in ODD_NAMES.items():
            (ckpt / name).parent.mkdir(exist_ok=True)
            if data is None:
                (ckpt / name).symlink_to("config.json")
            else:
                (ckpt / name).write_bytes(data)
        (ckpt / "leak.txt").symlink_to(self.outside / "secret.txt")
        (ckpt / "gone.txt").symlink_to(self.outside / "nothing-here.txt")
        (ckpt / "linked-dir").symlink_to(self.outside, target_is_directory=True)
        for name in UNWRITABLE:
            with open(os.path.join(os.fsencode(ckpt), name), "wb") as f:
                f.write(b"kept out")


def test_odd_names_are_stored_and_symlinks_out_of_the_checkpoint_are_not_followed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Bug fix: a dotfile, a space or a non-ASCII name in ``checkpoint-N`` made ``on_save`` raise a
    ValueError that stopped training; a symlink was followed, committing a file from outside the
    directory; a symlinked directory was left out without a word."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from tests.children.hf_child import dataset

    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_bytes(b"SECRET-OUTSIDE-BYTES")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16))
    training = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=2,
        save_steps=2,
        per_device_train_batch_size=8,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    store = tmp_path / "store"
    callbacks = [Planter(outside), CkptflowCallback(str(store), async_save=False)]
    trainer = Trainer(model=model, args=training, train_dataset=dataset(), callbacks=callbacks)
    with caplog.at_level("WARNING", logger="ckptflow.storage.integrations.hf"):
        trainer.train()

    written = tmp_path / "out" / "checkpoint-2"
    restored = Path(restore_trainer_checkpoint(str(store), tmp_path / "again"))
    for name, data in ODD_NAMES.items():
        assert (restored / name).read_bytes() == (data or (written / "config.json").read_bytes()), name
    assert not (restored / "alias-of-config.json").is_symlink()
    for link in ("leak.txt", "gone.txt", "linked-dir"):
        assert not (restored / link).exists() and not (restored / link).is_symlink(), link
        assert f"{written / link} is skipped: a symbolic link" in caplog.text, link
    assert "a directory" in caplog.text.split(str(written / "linked-dir"))[1].splitlines()[0]
    assert f"{written}/back\\slash.txt is skipped: its name has '\\\\'" in caplog.text
    assert f"{written}/not-utf8-\\xff.txt is skipped: its name is not valid UTF-8" in caplog.text
    assert [p for p in restored.rglob("*") if p.is_file() and p.read_bytes() == b"kept out"] == []
    for f in store.rglob("*"):
        assert not f.is_file() or b"SECRET-OUTSIDE-BYTES" not in f.read_bytes(), f"{f} holds the outside file"


# -- save_total_limit: the store rotates as the Trainer's output directory does ---------------


class Sampler(TrainerCallback):
    """Runs after CkptflowCallback's on_save: records the checkpoint names the store holds then."""

    def __init__(self, store: Path) -> None:
        self.store = store
        self.seen: list[tuple[int, list[str]]] = []

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        names = [v.user.get(KEY, "") for v in CheckpointStore(self.store).versions()]
        self.seen.append((state.global_step, names))


def train_with_limit(tmp_path: Path, limit: int | None, *, async_save: bool = True, **extra: Any) -> Sampler:
    """12 steps of a tiny GPT-2, a save every 2 (6 saves), into ``tmp_path/store``."""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from tests.children.hf_child import dataset

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16))
    evaluate = extra.pop("compute_metrics", None)
    training = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=12,
        save_steps=2,
        save_total_limit=limit,
        per_device_train_batch_size=16,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        **extra,
    )
    sampler = Sampler(tmp_path / "store")
    callbacks = [CkptflowCallback(str(tmp_path / "store"), async_save=async_save), sampler]
    data = dataset()
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=data,
        eval_dataset=data[:8] if evaluate else None,
        compute_metrics=evaluate,
        callbacks=callbacks,
    )
    trainer.train()
    return sampler


def names_in(store: Path) -> list[str]:
    return [v.user.get(KEY, "") for v in CheckpointStore(store).versions()]


class TestSaveTotalLimit:
    """``TrainingArguments.save_total_limit`` holds in the store too, not only on the Trainer's disk."""

    @pytest.mark.parametrize("mode", ["sync", "async"])
    def test_the_store_keeps_only_the_newest_limit_versions(
        self, tmp_path: Path, mode: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Bug fix: with save_total_limit=2 and 6 saves the store kept all 6 versions (the Trainer's
        disk held 2). An async save is rotated out only once the next one committed: limit + 1 at most."""
        with caplog.at_level("INFO", logger="ckptflow.storage.integrations.hf"):
            sampler = train_with_limit(tmp_path, 2, async_save=mode == "async")
        assert [step for step, _ in sampler.seen] == [2, 4, 6, 8, 10, 12]
        assert names_in(tmp_path / "store") == ["checkpoint-10", "checkpoint-12"]
        most = max(len(names) for _, names in sampler.seen)
        assert most <= (2 if mode == "sync" else 3), sampler.seen
        if mode == "sync":
            assert sampler.seen[-1][1] == ["checkpoint-10", "checkpoint-12"]
        assert "removed version 0 (checkpoint-2)" in caplog.text
        restored = Path(restore_trainer_checkpoint(str(tmp_path / "store"), tmp_path / "again"))
        assert restored.name == "checkpoint-12" and (restored / "trainer_state.json").is_file()

    def test_the_best_checkpoint_survives_beside_the_newest(self, tmp_path: Path) -> None:
        """With load_best_model_at_end and save_total_limit=1 the Trainer keeps 2: the best and the
        newest; so does the store. The best here is the save at step 4 (score 0.9)."""
        scores = iter([0.1, 0.9, 0.2, 0.3, 0.4, 0.5])
        sampler = train_with_limit(
            tmp_path,
            1,
            eval_strategy="steps",
            eval_steps=2,
            load_best_model_at_end=True,
            metric_for_best_model="score",
            greater_is_better=True,
            compute_metrics=lambda _: {"score": next(scores)},
        )
        assert names_in(tmp_path / "store") == ["checkpoint-4", "checkpoint-12"]
        for step, names in sampler.seen:
            if step >= 6:
                assert "checkpoint-4" in names, (step, names)
        assert CheckpointStore(tmp_path / "store").versions()[0].metrics["eval_score"] == pytest.approx(0.9)

    def test_no_limit_keeps_every_version(self, tmp_path: Path) -> None:
        train_with_limit(tmp_path, None)
        assert names_in(tmp_path / "store") == [f"checkpoint-{s}" for s in (2, 4, 6, 8, 10, 12)]

    def test_versions_the_callback_did_not_save_are_kept(self, tmp_path: Path) -> None:
        store = CheckpointStore(tmp_path / "store")
        store.save({"weights": torch.zeros(3)}, step=0, user={"note": "exported by hand"})
        train_with_limit(tmp_path, 2)
        versions = CheckpointStore(tmp_path / "store").versions()
        assert [(v.version, v.user.get(KEY)) for v in versions] == [
            (0, None),
            (5, "checkpoint-10"),
            (6, "checkpoint-12"),
        ]
        assert versions[0].user["note"] == "exported by hand"  # the oldest: it would go first if it counted

    @pytest.mark.parametrize(
        ("limit", "best", "gone"),
        [
            (2, None, [0, 1, 2, 3]),
            (2, "checkpoint-12", [0, 1, 2, 3]),  # the best is the newest
            (2, "checkpoint-4", [0, 2, 3, 4]),  # the Trainer's rule: the best counts in the limit
            (1, "checkpoint-4", [0, 2, 3, 4]),  # ... and raises a limit of 1 to 2
            (6, None, []),
            (7, None, []),
        ],
    )
    def test_rotated_out_follows_the_trainers_rule(
        self, limit: int, best: str | None, gone: list[int]
    ) -> None:
        saved = [(v, f"checkpoint-{2 * (v + 1)}") for v in range(6)]
        assert rotated_out(saved, limit=limit, best=best) == gone


class StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            control.should_training_stop = True


def test_a_run_resumed_into_another_directory_still_ends_with_its_best_model(tmp_path: Path) -> None:
    """Bug: ``trainer_state.json`` names the best checkpoint by the old directory's path: resumed into a
    new output directory (another disk), ``load_best_model_at_end`` read the old disk or silently kept
    the last model. The restore writes the best checkpoint beside the newest and points the state at it."""
    import json

    from safetensors.torch import load_file
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from tests.children.hf_child import dataset

    def trainer(output_dir: Path, *callbacks: TrainerCallback) -> Trainer:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=16))
        scores = {2: 0.1, 4: 0.9, 6: 0.2, 8: 0.3, 10: 0.4, 12: 0.5}  # the best: step 4
        training = TrainingArguments(
            output_dir=str(output_dir),
            max_steps=12,
            save_steps=2,
            eval_strategy="steps",
            eval_steps=2,
            load_best_model_at_end=True,
            metric_for_best_model="score",
            greater_is_better=True,
            per_device_train_batch_size=16,
            report_to="none",
            use_cpu=True,
            disable_tqdm=True,
        )
        data = dataset()
        made = Trainer(
            model=model, args=training, train_dataset=data, eval_dataset=data[:8], callbacks=list(callbacks)
        )
        made.compute_metrics = lambda _: {"score": scores[made.state.global_step]}
        return made

    store = str(tmp_path / "store")
    trainer(tmp_path / "old", CkptflowCallback(store, async_save=False), StopAt(8)).train()
    best_weights = load_file(tmp_path / "old" / "checkpoint-4" / "model.safetensors")
    shutil.rmtree(tmp_path / "old")  # the old disk is gone

    new = tmp_path / "new"
    start = restore_trainer_checkpoint(store, new)
    assert start == str(new / "checkpoint-8")
    state = json.loads((new / "checkpoint-8" / "trainer_state.json").read_text())
    assert state["best_model_checkpoint"] == str(new / "checkpoint-4")
    assert (new / "checkpoint-4" / "model.safetensors").is_file()

    resumed = trainer(new, CkptflowCallback(store, async_save=False))
    resumed.train(resume_from_checkpoint=start)
    assert resumed.state.best_model_checkpoint == str(new / "checkpoint-4")
    for name, tensor in resumed.model.state_dict().items():
        if name in best_weights:
            assert torch.equal(tensor, best_weights[name]), f"{name} is not the best model's"


def test_restore_format_hf_gives_a_directory_from_pretrained_loads(tmp_path: Path) -> None:
    """Bug: the README's export (``restore --keys model --max-shard-size``) fit no Trainer store (its
    tensors are under ``hf_checkpoint/files/N/tensors``) and wrote no config.json, so from_pretrained
    fell back to a default config and failed. ``--format hf`` writes the checkpoint's model files."""
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel
    from typer.testing import CliRunner

    from ckptflow.flows.cli import app

    train_with_limit(tmp_path, None, async_save=False)
    out = tmp_path / "export" / "model"
    result = CliRunner().invoke(
        app, ["restore", str(tmp_path / "store"), "--format", "hf", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "config.json" in result.stdout and "model.safetensors" in result.stdout
    names = sorted(p.name for p in out.iterdir())
    assert "config.json" in names and "optimizer.pt" not in names and "trainer_state.json" not in names
    model = GPT2LMHeadModel.from_pretrained(out)
    saved = load_file(tmp_path / "out" / "checkpoint-12" / "model.safetensors")
    for name, tensor in saved.items():
        assert torch.equal(model.state_dict()[name], tensor), name

    again = CliRunner().invoke(app, ["restore", str(tmp_path / "store"), "--format", "hf", "--out", str(out)])
    assert again.exit_code == 1 and "exists; pass --force" in again.output
    forced = CliRunner().invoke(
        app, ["restore", str(tmp_path / "store"), "--format", "hf", "--out", str(out), "--force"]
    )
    assert forced.exit_code == 0 and sorted(p.name for p in out.iterdir()) == names

    onto_store = CliRunner().invoke(
        app,
        ["restore", str(tmp_path / "store"), "--format", "hf", "--out", str(tmp_path / "store"), "--force"],
    )
    assert onto_store.exit_code == 1 and "holds a checkpoint store" in onto_store.output
    assert names_in(tmp_path / "store")  # untouched

    plain = tmp_path / "plain"
    CheckpointStore(plain).save({"w": torch.zeros(2)})
    refused = CliRunner().invoke(app, ["restore", str(plain), "--format", "hf", "--out", str(tmp_path / "x")])
    assert refused.exit_code == 1 and "not a Hugging Face Trainer checkpoint" in refused.output
    assert not (tmp_path / "x").exists()
