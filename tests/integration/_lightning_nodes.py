"""One rank of a Lightning DDP job (CPU, gloo) launched by torchrun as one of two "nodes"
(``tests/_two_nodes.py``): what test_many_ranks.py runs. ``StagedCheckpointIO`` on every
rank, ModelCheckpoint saving every 2 steps; then a second fit resumes from the newest one.

    torchrun ... _lightning_nodes.py CHECKPOINT_DIR

Reports (``rank-<R>.json``): what this rank's plugin published, and the step the resumed fit
started from.
"""

from __future__ import annotations

import os
import sys

import lightning as L
import torch

from safestage.lightning import StagedCheckpointIO
from tests._two_nodes import report


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(64, 64)
        self.resumed_at = -1

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        return self.layer(batch[0]).pow(2).mean()

    def on_train_start(self) -> None:
        self.resumed_at = self.global_step

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def trainer(directory: str, max_steps: int, plugin: StagedCheckpointIO) -> L.Trainer:
    every = L.pytorch.callbacks.ModelCheckpoint(dirpath=directory, every_n_train_steps=2, save_top_k=-1)
    return L.Trainer(
        accelerator="cpu", strategy="ddp", devices=int(os.environ["LOCAL_WORLD_SIZE"]), num_nodes=2,
        max_steps=max_steps, plugins=[plugin], callbacks=[every], logger=False,
        enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip


def main() -> None:
    directory = sys.argv[1]
    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(256, 64)), batch_size=4)
    plugin = StagedCheckpointIO()  # the root: this node's SAFESTAGE_DIR
    model = Tiny()
    trainer(directory, 4, plugin).fit(model, data)
    first = [os.path.basename(record.destination) for record in plugin.records]
    newest = max((os.path.join(directory, name) for name in os.listdir(directory)), key=os.path.getmtime)
    resumed = Tiny()
    trainer(directory, 6, plugin).fit(resumed, data, ckpt_path=newest)
    report(
        published=first, published_after_resume=[os.path.basename(r.destination) for r in plugin.records][len(first):],
        resumed_from=os.path.basename(newest), resumed_at=resumed.resumed_at, root=os.environ["SAFESTAGE_DIR"],
    )


if __name__ == "__main__":
    main()
