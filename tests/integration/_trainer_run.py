"""One rank of a tiny transformers Trainer run: what test_trainer_commit.py launches twice.

    RANK=.. LOCAL_RANK=.. WORLD_SIZE=2 MASTER_ADDR=.. MASTER_PORT=.. SAFESTAGE_DIR=.. \
        SAFESTAGE_TORCH_SAVE=1 python _trainer_run.py OUTPUT_DIR REPORT_DIR MAX_STEPS

An ordinary training script plus ``CommitCallback`` (the recipe of docs/checkpoints.md): it
resumes from ``safestage.latest_complete(output_dir)`` when there is one. Staging comes from
the environment only. The ``_Report`` callback is the test's probe: the step each rank starts
from, and that it finished.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import transformers

import safestage
from safestage.transformers import CommitCallback


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = (torch.arange(index, index + 16) * 7) % 512
        return {"input_ids": ids, "labels": ids.clone()}


class _Report(transformers.TrainerCallback):
    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, f"rank-{os.environ['RANK']}.json")
        self.report: dict[str, object] = {}

    def _write(self) -> None:
        with open(self.path, "w") as handle:
            json.dump(self.report, handle)

    def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.report["start_step"] = state.global_step
        self._write()

    def on_train_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.report["end_step"] = state.global_step
        self._write()


def main() -> None:
    output_dir, report_dir, max_steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    args = transformers.TrainingArguments(
        output_dir=output_dir, max_steps=max_steps, save_steps=2, save_total_limit=2,
        per_device_train_batch_size=2, learning_rate=1e-3, use_cpu=True, ddp_backend="gloo",
        report_to=[], logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(), callbacks=[CommitCallback(), _Report(report_dir)]
    )
    latest = safestage.latest_complete(output_dir)  # None on the first run
    trainer.train(resume_from_checkpoint=str(latest) if latest else None)


if __name__ == "__main__":
    main()
