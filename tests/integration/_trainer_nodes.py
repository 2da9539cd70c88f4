"""One rank of a tiny transformers Trainer job launched by torchrun as one of two "nodes"
(``tests/_two_nodes.py``): what test_many_ranks.py runs. The recipe of docs/integrations.md
for many ranks: staging from the environment only (SAFESTAGE_DIR, this node's own root;
SAFESTAGE_TORCH_SAVE=1), ``CommitCallback``, and a resume from ``safestage.latest_complete``.

    torchrun ... _trainer_nodes.py OUTPUT_DIR MAX_STEPS

Reports (``rank-<R>.json``): the step it started from and ended at, and on the saving rank
what CommitCallback committed (checkpoint, files, seconds).
"""

from __future__ import annotations

import os
import sys

import torch
import transformers

import safestage
from safestage.transformers import CommitCallback
from tests._two_nodes import report


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 64  # 8 steps of 4 ranks x 2: one epoch

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = (torch.arange(index, index + 16) * 7) % 512
        return {"input_ids": ids, "labels": ids.clone()}


class Steps(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.start = self.end = -1

    def on_train_begin(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.start = state.global_step

    def on_train_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        self.end = state.global_step


def main() -> None:
    output_dir, max_steps = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    args = transformers.TrainingArguments(
        output_dir=output_dir, max_steps=max_steps, save_steps=2, save_total_limit=None,
        per_device_train_batch_size=2, learning_rate=1e-3, use_cpu=True, ddp_backend="gloo",
        report_to=[], logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0,
    )  # fmt: skip
    commit, steps = CommitCallback(), Steps()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[commit, steps])
    latest = safestage.latest_complete(output_dir)  # None on the first run
    trainer.train(resume_from_checkpoint=str(latest) if latest else None)
    report(
        start_step=steps.start, end_step=steps.end, resumed_from=str(latest) if latest else None,
        should_save=args.should_save, root=os.environ["SAFESTAGE_DIR"],
        committed=[[path.name, len(manifest.files), seconds, manifest.total_bytes] for path, manifest, seconds in commit.committed],
    )


if __name__ == "__main__":
    main()
