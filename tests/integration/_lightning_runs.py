"""Child of test_lightning.py: ModelCheckpoint runs whose file names repeat, with and without
StagedCheckpointIO, in a process whose fsspec the parent chose (PYTHONPATH). Prints one JSON
line: the facts per case.

argv: a JSON list of cases {"run": "top_k" | "rerun" | "link", "dir": checkpoint directory,
"plugin": "none" | "sync" | "background", "root": staging root}.

- ``top_k``: a metric that gets worse every step, ``filename="{epoch}"`` saved every step
  (one epoch: every name is ``epoch=0`` plus Lightning's version counter), ``save_top_k=3``.
- ``rerun``: one Trainer fitted twice, a fixed file name, ``STARTING_VERSION = 9``, every
  epoch kept: what Lightning's ``test_ckpt_version_after_rerun_same_trainer`` checks.
- ``link``: ``save_last="link"``, ``save_top_k=1``, saved every step.

Each checkpoint holds 8 MiB of weights (and as much momentum), so that a background publish
onto a FUSE mount is still running when the next step asks for the next name.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


def module() -> Any:
    import lightning as L
    import torch

    class Worse(L.LightningModule):
        """Logs ``worse`` = its global step: the first checkpoint is the best one."""

        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(1024, 2048)

        def training_step(self, batch: Any, index: int) -> Any:
            self.log("worse", float(self.global_step + 1), on_step=True, on_epoch=False)
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x)[:, :1], y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    return Worse()


def loader(batches: int) -> Any:
    import torch

    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(4 * batches, 1024, generator=generator), torch.randn(4 * batches, 1, generator=generator)
    )
    return torch.utils.data.DataLoader(data, batch_size=4)


def run(case: dict[str, Any]) -> dict[str, Any]:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from safestage.lightning import StagedCheckpointIO

    directory = case["dir"]
    plugins = []
    if case["plugin"] != "none":
        plugins = [StagedCheckpointIO(case["root"], background=case["plugin"] == "background")]
    if case["run"] == "top_k":
        callback = ModelCheckpoint(dirpath=directory, filename="{epoch}", monitor="worse", mode="min",
                                   save_top_k=3, every_n_train_steps=1)  # fmt: skip
        stop = {"max_steps": 5}
    elif case["run"] == "rerun":
        callback = ModelCheckpoint(dirpath=directory, filename="ckpt", monitor="epoch", save_top_k=-1)
        callback.STARTING_VERSION = 9
        stop = {"max_epochs": 2, "limit_train_batches": 1}
    else:
        callback = ModelCheckpoint(dirpath=directory, save_last="link", save_top_k=1, every_n_train_steps=1)
        stop = {"max_steps": 3}
    trainer = L.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=True, default_root_dir=directory, plugins=plugins, callbacks=[callback], **stop,
    )  # fmt: skip
    threads_before = set(threading.enumerate())
    out: dict[str, Any] = {key: case[key] for key in ("run", "dir", "plugin")}
    try:
        trainer.fit(module(), loader(8))
        if case["run"] == "rerun":
            trainer.fit_loop.max_epochs = 4
            trainer.fit(module(), loader(8))
        out["error"] = None
    except BaseException as error:  # the fact to report
        out["error"] = describe(error)
    out["leaked_threads"] = sorted(t.name for t in set(threading.enumerate()) - threads_before)
    out["listing"] = sorted(os.listdir(directory))
    out["steps"] = {
        name: torch.load(os.path.join(directory, name), weights_only=True)["global_step"]
        for name in out["listing"]
        if name.endswith(".ckpt")
    }
    out["best_k"] = sorted(os.path.basename(p) for p in callback.best_k_models)
    out["best_model_path"] = os.path.basename(callback.best_model_path)
    score = callback.best_model_score
    out["best_model_score"] = None if score is None else float(score)
    out["last_is_link"] = os.path.islink(os.path.join(directory, "last.ckpt"))
    return out


def main() -> None:
    import fsspec

    results = [run(case) for case in json.loads(sys.argv[1])]
    print(json.dumps({"fsspec": fsspec.__version__, "cases": results}))


if __name__ == "__main__":
    main()
