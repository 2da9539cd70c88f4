"""torch_save=True with the real clients that call ``torch.save(...)`` as an attribute at call
time (issue 12): accelerate's ``save_state`` (optimizer.bin, random_states_0.pkl) and the
transformers Trainer's checkpoint (optimizer.pt, scheduler.pt, rng_state.pth,
training_args.bin). Without torch_save these pickles land directly, non-atomically
(test_accelerate_state.py); with it every one of them is staged and published like the
model's safetensors files.
"""

from __future__ import annotations

import os
import stat

import pytest
import torch
from _clients import CLIENTS, tiny_llama
from _helpers import assert_checkpoint, fresh_dir, stray_files

import safestage

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(("mode", "strategy"), [("mountpoint", "direct"), ("hdfs", "replace")])
def test_accelerate_save_state_is_staged_whole(mode, strategy, kit_mounts, shm_root, tmp_path):
    client = CLIENTS["accelerate-save_state"]
    trained = client.build(tmp_path)
    dest = fresh_dir(kit_mounts[mode], "state")
    with safestage.staged(shm_root, torch_save=True) as stage:
        trained.accelerator.save_state(str(dest))
    published = sorted((r.destination.name, r.publish) for r in stage.records)
    assert published == [(n, strategy) for n in ("model.safetensors", "optimizer.bin", "random_states_0.pkl")]
    assert sorted(os.listdir(dest)) == ["model.safetensors", "optimizer.bin", "random_states_0.pkl"]
    assert_checkpoint(dest, client, client.reference(trained))  # loads equal, 0644, no temp files
    assert os.listdir(shm_root) == []


class _Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.arange(index, index + 16) % 128
        return {"input_ids": ids, "labels": ids.clone()}


def test_transformers_trainer_checkpoint_is_staged_whole(kit_mounts, shm_root, tmp_path):
    import transformers

    dest = fresh_dir(kit_mounts["mountpoint"], "trainer")
    args = transformers.TrainingArguments(
        output_dir=str(dest), max_steps=1, save_steps=1, per_device_train_batch_size=2,
        use_cpu=True, report_to=[], logging_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    model = tiny_llama()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens())
    with safestage.staged(shm_root, torch_save=True) as stage:
        trainer.train()
    checkpoint = dest / "checkpoint-1"
    names = sorted(os.listdir(checkpoint))
    torch_files = {"optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin"}
    assert torch_files <= set(names) and "model.safetensors" in names, names
    staged = {r.destination.name for r in stage.records if r.destination.parent == checkpoint}
    assert staged >= torch_files | {"model.safetensors"}, staged
    assert {r.publish for r in stage.records} == {"direct"}
    assert not stray_files(checkpoint)
    for name in torch_files | {"model.safetensors"}:
        assert stat.S_IMODE(os.stat(checkpoint / name).st_mode) == 0o644, name
    optimizer = torch.load(checkpoint / "optimizer.pt", weights_only=False)
    assert optimizer["state"], "optimizer state round-trips"
    for key, value in trainer.optimizer.state_dict()["state"][0].items():
        assert torch.equal(optimizer["state"][0][key], value), key
    assert os.listdir(shm_root) == []
