"""The recipes of README.md (whole checkpoints), each run for real: whole checkpoint directories from a
Trainer-style save, the transformers Trainer, accelerate's save_state and
torch.distributed.checkpoint, committed with staged_dir onto the kit's hdfs and mountpoint
mounts, then resumed from latest_complete. The code inside each test is the recipe's code,
with the paths of the test.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from _clients import CLIENTS, assert_nested_equal, need, tiny_llama
from _helpers import fresh_dir

import safestage

pytestmark = pytest.mark.integration


def tiny_tokenizer(scratch: Path) -> Any:
    """A word-level tokenizer built in memory: nothing downloaded."""
    transformers = need("transformers", "transformers")
    tokenizers = need("tokenizers", "tokenizers")
    vocab = {"[UNK]": 0, "[PAD]": 1, **{f"w{i}": i + 2 for i in range(126)}}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", pad_token="[PAD]")


def assert_complete(directory: Path) -> None:
    """Complete (digests, safetensors headers), and nothing else there: no temp file."""
    result = safestage.verify(directory, deep=True)
    assert result.complete, result.problems
    assert result.extra == [], result.extra


@pytest.mark.parametrize("mode", ["hdfs", "mountpoint"])
def test_recipe_trainer_style_directory(mode: str, kit_mounts: dict[str, Any], tmp_path: Path) -> None:
    run = fresh_dir(kit_mounts[mode], "run42")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    model = tiny_llama()
    tokenizer = tiny_tokenizer(tmp_path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[2, 3, 4]]), labels=torch.tensor([[2, 3, 4]])).loss.backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    step = 1000

    # -- recipe ---------------------------------------------------------------------------
    with safestage.staged_dir(run / f"checkpoint-{step}", scratch) as local:
        model.save_pretrained(local, max_shard_size="20KB")  # shards + index + config.json
        tokenizer.save_pretrained(local)
        torch.save(optimizer.state_dict(), local / "optimizer.pt")
        torch.save(scheduler.state_dict(), local / "scheduler.pt")
        torch.save({"python": 0, "torch": torch.get_rng_state()}, local / "rng_state.pth")
        (local / "trainer_state.json").write_text(json.dumps({"global_step": step}))

    latest = safestage.latest_complete(run)  # the newest complete checkpoint, or None
    transformers = need("transformers", "transformers")
    restored = transformers.AutoModelForCausalLM.from_pretrained(latest)
    optimizer.load_state_dict(torch.load(latest / "optimizer.pt"))
    # -------------------------------------------------------------------------------------

    assert latest == run / "checkpoint-1000"
    assert_complete(latest)
    assert len(list(latest.glob("model-*.safetensors"))) > 1  # sharded: many files, one commit
    for name, tensor in model.state_dict().items():
        assert torch.equal(restored.state_dict()[name], tensor), name
    assert transformers.AutoTokenizer.from_pretrained(latest)("w1 w5")["input_ids"] == [3, 7]
    assert os.listdir(scratch) == []


def test_recipe_transformers_trainer(kit_mounts: dict[str, Any], tmp_path: Path) -> None:
    """Trainer writes each checkpoint to local disk (output_dir); a callback commits it to the
    remote run directory; training resumes from latest_complete."""
    transformers = need("transformers", "transformers")
    remote = fresh_dir(kit_mounts["hdfs"], "run42")
    scratch = tmp_path / "scratch"  # the staging root
    scratch.mkdir()
    output_dir = tmp_path / "output"  # on the staging root's filesystem: a rename, no copy

    # -- recipe ---------------------------------------------------------------------------
    class CommitCheckpoints(transformers.TrainerCallback):
        """Publish each checkpoint the Trainer has just written locally as one commit."""

        def __init__(self, remote: Path, scratch: Path) -> None:
            self.remote, self.scratch = Path(remote), Path(scratch)

        def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if not state.is_world_process_zero:
                return
            name = f"checkpoint-{state.global_step}"
            with safestage.staged_dir(self.remote / name, self.scratch) as local:
                os.replace(Path(args.output_dir) / name, local)  # same filesystem: no copy
                # else: shutil.copytree(Path(args.output_dir) / name, local, dirs_exist_ok=True)
    # -------------------------------------------------------------------------------------

    def trainer(max_steps: int) -> Any:
        torch.manual_seed(0)
        model = tiny_llama()
        data = [{"input_ids": torch.tensor([2 + i % 7, 3, 4, 5]), "labels": torch.tensor([2 + i % 7, 3, 4, 5])} for i in range(16)]
        args = transformers.TrainingArguments(
            output_dir=str(output_dir), max_steps=max_steps, save_steps=2, per_device_train_batch_size=4,
            report_to=[], use_cpu=True, logging_strategy="no", seed=0,
        )  # fmt: skip
        return transformers.Trainer(
            model=model, args=args, train_dataset=data, callbacks=[CommitCheckpoints(remote, scratch)]
        )

    trainer(4).train()
    # -- recipe: resume -------------------------------------------------------------------
    latest = safestage.latest_complete(remote)
    resumed = trainer(6)
    resumed.train(resume_from_checkpoint=str(latest) if latest else None)
    # -------------------------------------------------------------------------------------
    assert latest == remote / "checkpoint-4"
    assert resumed.state.global_step == 6
    assert sorted(os.listdir(remote)) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    for name in os.listdir(remote):
        assert_complete(remote / name)
        assert {"model.safetensors", "optimizer.pt", "trainer_state.json"} <= set(os.listdir(remote / name))
    assert safestage.latest_complete(remote) == remote / "checkpoint-6"
    assert os.listdir(scratch) == []
    shutil.rmtree(output_dir)


@pytest.mark.parametrize("mode", ["hdfs", "mountpoint"])
def test_recipe_accelerate_save_state(mode: str, kit_mounts: dict[str, Any], tmp_path: Path) -> None:
    client = CLIENTS["accelerate-save_state"]
    trained = client.build(tmp_path)
    accelerator, model = trained.accelerator, trained.model
    run = fresh_dir(kit_mounts[mode], "run42")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optimizer_state = trained.optimizer.state_dict()

    # -- recipe ---------------------------------------------------------------------------
    with safestage.staged_dir(run / "checkpoint-500", scratch) as local:
        accelerator.save_state(str(local))  # model.safetensors, optimizer.bin, random_states_0.pkl
    # ... later, or in the next job:
    latest = safestage.latest_complete(run)
    if latest is not None:
        accelerator.load_state(str(latest))
    # -------------------------------------------------------------------------------------

    assert latest == run / "checkpoint-500"
    assert_complete(latest)
    assert sorted(os.listdir(latest)) == sorted(
        ["model.safetensors", "optimizer.bin", "random_states_0.pkl", safestage.COMMIT_NAME]
    )
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved[name]), name
    assert_nested_equal(trained.optimizer.state_dict(), optimizer_state, "optimizer")
    with torch.no_grad():  # load_state really restores: perturb, load again
        for parameter in model.parameters():
            parameter.add_(1.0)
    accelerator.load_state(str(latest))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, saved[name]), name


@pytest.mark.parametrize("mode", ["hdfs", "mountpoint"])
def test_recipe_torch_distributed_checkpoint(mode: str, kit_mounts: dict[str, Any], tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    run = fresh_dir(kit_mounts[mode], "run42")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 16)).sum().backward()
    optimizer.step()
    state_dict = {"model": model.state_dict(), "step": torch.tensor(7)}
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    # -- recipe ---------------------------------------------------------------------------
    with safestage.staged_dir(run / "step-7", scratch) as local:
        dcp.save(state_dict, checkpoint_id=local)  # .metadata + __0_0.distcp, written locally
    latest = safestage.latest_complete(run, "step-*")
    dcp.load(state_dict, checkpoint_id=latest)  # in place, into the tensors of state_dict
    # -------------------------------------------------------------------------------------

    assert latest == run / "step-7"
    assert_complete(latest)
    assert ".metadata" in os.listdir(latest)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
    dcp.load(state_dict, checkpoint_id=latest)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name


def test_recipe_resume_from_the_command_line(kit_mounts: dict[str, Any], tmp_path: Path) -> None:
    import subprocess
    import sys

    run = fresh_dir(kit_mounts["hdfs"], "run42")
    for step in (100, 200):
        with safestage.staged_dir(run / f"checkpoint-{step}", tmp_path) as local:
            (local / "weights.bin").write_bytes(os.urandom(1000))
    (run / "checkpoint-300").mkdir()  # a job preempted while writing it: never committed
    (run / "checkpoint-300" / "weights.bin").write_bytes(b"partial")

    # -- recipe: CKPT=$(safestage latest /mnt/hdfs/run42) && python train.py --resume "$CKPT"
    done = subprocess.run([sys.executable, "-m", "safestage", "latest", str(run)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == str(run / "checkpoint-200"), done
    done = subprocess.run([sys.executable, "-m", "safestage", "verify", str(run / "checkpoint-300")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "no-commit" in done.stdout, done
