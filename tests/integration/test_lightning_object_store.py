"""Lightning checkpoints straight to an object store (s3:// on moto, 127.0.0.1) through
``StagedCheckpointIO``, with no fsspec filesystem for s3 (s3fs is not installed): a tiny
Trainer whose checkpoints land in the bucket, each one object uploaded from its staged copy,
the bytes Lightning's own ``torch.save`` would write; the plugin removes one there too."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from safestage import _object_store
from safestage._destination import url_of
from tests._stores import keys, new_bucket

pytestmark = pytest.mark.integration


def _tiny_module() -> Any:
    import lightning as L

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    return Tiny()


def _loader() -> Any:
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4, generator=generator), torch.randn(16, 1, generator=generator))
    return torch.utils.data.DataLoader(data, batch_size=4)


def _saving_to(run: str) -> Any:
    """A callback that saves the Trainer's checkpoint to ``run/step=N.ckpt`` after each step,
    and removes the one before (the Trainer's strategy asks the plugin), as top-1 would."""
    from lightning.pytorch.callbacks import Callback

    class SaveEveryStep(Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            trainer.save_checkpoint(f"{run}/step={trainer.global_step}.ckpt")
            if trainer.global_step > 1:
                trainer.strategy.remove_checkpoint(f"{run}/step={trainer.global_step - 1}.ckpt")

    return SaveEveryStep()


def _object(url: str) -> dict[str, Any]:
    found = url_of(url)
    assert found is not None
    data = _object_store.read(found)
    assert data is not None, url
    loaded: dict[str, Any] = torch.load(io.BytesIO(data), weights_only=True)
    return loaded


@pytest.mark.parametrize("background", [False, True])
def test_a_trainers_checkpoints_land_in_the_bucket_through_the_plugin(
    background: bool, monkeypatch: pytest.MonkeyPatch, shm_root: Path
) -> None:
    import lightning as L

    from safestage.lightning import StagedCheckpointIO

    bucket = new_bucket(monkeypatch, "lightning")
    run = f"s3://{bucket}/run"
    plugin = StagedCheckpointIO(shm_root, background=background)
    module = _tiny_module()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=3, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, plugins=[plugin], callbacks=[_saving_to(run)],
    )  # fmt: skip
    trainer.fit(module, _loader())
    assert keys(bucket) == ["run/step=3.ckpt"]  # each older one removed once the newer one landed
    saved = _object(f"{run}/step=3.ckpt")
    assert saved["global_step"] == 3
    assert saved["state_dict"].keys() == module.state_dict().keys()
    assert all(torch.equal(saved["state_dict"][k], v) for k, v in module.state_dict().items())
    assert [record.publish for record in plugin.records] == ["upload"] * 3
    assert sorted(str(record.destination) for record in plugin.records) == [f"{run}/step={n}.ckpt" for n in (1, 2, 3)]  # in background: as they land
    assert os.listdir(shm_root) == []  # no staged copy outlives its upload
    assert not Path("s3:").exists()  # nothing written to a local directory named s3:


def test_another_fsspec_scheme_is_left_to_the_wrapped_plugin(tmp_path: Path, shm_root: Path) -> None:
    """A URL safestage does not serve is saved by the wrapped plugin as before, never refused
    (``memory://``: fsspec's in-process filesystem)."""
    import fsspec

    from safestage.lightning import StagedCheckpointIO

    plugin = StagedCheckpointIO(shm_root)
    plugin.save_checkpoint({"w": torch.arange(3.0)}, "memory://run/x.ckpt")
    with fsspec.open("memory://run/x.ckpt", "rb") as handle:
        assert torch.equal(torch.load(handle, weights_only=True)["w"], torch.arange(3.0))
    assert plugin.records == []
