"""Lightning's real FSDPStrategy (sharded checkpoints) on one GPU, a world of one, with the switch
on (issue 25): every checkpoint ModelCheckpoint saves lands under one commit file, ``meta.pt``
included, and a fit resumes from ``latest_complete`` and from ``ckpt_path="last"``.

    OUT=/tmp/out SAFESTAGE_DIR=/tmp/root PYTHONPATH=. python3 benchmarks/gpu_lightning_fsdp.py
    ... --accelerator cpu     # the same with ModelParallelStrategy (FSDP2) on CPU: FSDPStrategy refuses CPU

Run by ``benchmarks/gpu_lightning_fsdp.sh`` (which sets the variables). The start-up hook is not
installed where safestage comes from PYTHONPATH alone, so this calls its body
(``start_from_environment``) first, as the hook would at interpreter start. Checkpoints go to
``--dir`` (a local directory; their names hold '=', which $OUT does not carry back);
``$OUT/report.json`` and ``$OUT/report.txt`` say what landed and whether each check held. Exit
status 0 when every check held.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu-fsdp-out-"))
    parser.add_argument("--dir", default=None, help="where the checkpoints go (default: a fresh local directory)")
    parser.add_argument("--accelerator", choices=["gpu", "cpu"], default="gpu")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    directory = Path(args.dir or tempfile.mkdtemp(prefix="gpu-fsdp-")) / "ckpts"

    from safestage import _autoload

    stage = _autoload.start_from_environment()  # what the start-up hook does where it is installed

    import lightning as L
    import torch
    import torch.distributed.checkpoint as dcp
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    import safestage

    warnings.filterwarnings("ignore", category=UserWarning)

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
            self.started_at = -1

        def configure_model(self) -> None:
            if isinstance(self.trainer.strategy, ModelParallelStrategy):
                from torch.distributed.fsdp import fully_shard

                fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch: Any, index: int) -> Any:
            self.log("progress", float(self.global_step))  # better every step: top-k evicts the oldest
            return self.net(batch).pow(2).mean()

        def on_train_start(self) -> None:
            self.started_at = self.global_step

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(torch.randn(256, 256, generator=torch.Generator().manual_seed(1)), batch_size=8)

    def trainer(max_steps: int) -> tuple[Any, Any]:
        every = ModelCheckpoint(dirpath=directory, monitor="progress", mode="max", save_top_k=2, save_last=True,
                                every_n_train_steps=1)  # fmt: skip
        strategy = (FSDPStrategy(state_dict_type="sharded") if args.accelerator == "gpu"
                    else ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1))  # fmt: skip
        fit = L.Trainer(accelerator=args.accelerator, devices=1, strategy=strategy, max_steps=max_steps,
                        callbacks=[every], logger=False, enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
        return fit, every

    report: dict[str, Any] = {
        "torch": torch.__version__, "lightning": L.__version__, "accelerator": args.accelerator,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "staging": repr(stage), "staging_root": os.environ.get("SAFESTAGE_DIR"), "directory": str(directory),
    }  # fmt: skip
    checks: dict[str, bool] = {"staging is on (SAFESTAGE_DIR)": stage is not None}
    started = time.monotonic()
    first, every = trainer(4)
    first.fit(Model())
    report["strategy"] = type(first.strategy).__name__
    report["best_k"] = sorted(Path(p).name for p in every.best_k_models)
    latest = safestage.latest_complete(directory, "epoch=*-step=*.ckpt")
    report["latest_complete"] = latest.name if latest else None
    listing: dict[str, Any] = {}
    for checkpoint in sorted(directory.iterdir()):
        result = safestage.verify(checkpoint, deep=True)
        files = sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file())
        listed = sorted(entry.path for entry in result.manifest.files) if result.manifest else []
        listing[checkpoint.name] = {"files": files, "complete": result.complete, "commit_lists": listed}
        checks[f"{checkpoint.name}: commit file present, every file listed, verify --deep complete"] = (
            result.complete and safestage.COMMIT_NAME in files and "meta.pt" in listed and ".metadata" in listed
            and sorted([*listed, safestage.COMMIT_NAME]) == files
        )  # fmt: skip
    report["after_first_fit"] = listing
    checks["top-2 and last.ckpt kept, the older removed"] = sorted(listing) == sorted([*report["best_k"], "last.ckpt"])
    checks["latest_complete names step 4"] = report["latest_complete"] == "epoch=0-step=4.ckpt"
    if latest is not None:
        key = "model" if args.accelerator == "gpu" else "state_dict"  # FSDPStrategy's, ModelParallelStrategy's
        template = {key: {f"net.{name}": torch.zeros_like(value) for name, value in Model().net.state_dict().items()}}
        try:  # stock DCP reads it
            dcp.load(template, checkpoint_id=latest)
            checks["stock dcp.load reads the newest checkpoint"] = True
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            report["stock_load_error"] = repr(exc)[:2000]
            checks["stock dcp.load reads the newest checkpoint"] = False
    resumed, _ = trainer(5)
    model = Model()
    resumed.fit(model, ckpt_path=str(latest) if latest else None)
    checks["a fit resumed from latest_complete starts at step 4"] = model.started_at == 4
    again, _ = trainer(6)
    model = Model()
    again.fit(model, ckpt_path="last")
    checks['a fit resumed from ckpt_path="last" starts at step 5'] = model.started_at == 5
    final = safestage.latest_complete(directory, "epoch=*-step=*.ckpt")
    checks["after both resumes latest_complete names step 6"] = final is not None and final.name == "epoch=0-step=6.ckpt"
    root = Path(os.environ.get("SAFESTAGE_DIR", "/nonexistent"))
    checks["no kept copy in the staging root"] = not list(root.rglob("safestage-kept.json"))
    report["seconds"] = round(time.monotonic() - started, 1)
    report["checks"] = checks
    report["ok"] = all(checks.values())
    (out / "report.json").write_text(json.dumps(report, indent=2))
    lines = [f"{key}: {value}" for key, value in report.items() if key not in ("checks", "after_first_fit")]
    for name, entry in listing.items():
        lines.append(f"{name}: {entry['files']} complete={entry['complete']}")
    lines += [f"[{'ok' if held else 'FAILED'}] {name}" for name, held in checks.items()]
    lines.append("ALL CHECKS HELD" if report["ok"] else "SOME CHECK FAILED")
    (out / "report.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
