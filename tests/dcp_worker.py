"""A rank of a two-node DCP job (tests/test_dcp.py): runs the cases of a JSON plan in order,
each a dcp.save / async_save onto one destination, and reports what each did.

    dcp_worker.py PLAN.json

PLAN: [{"name": ..., "kind": ..., "dest": ...}, ...] (tests/_dcp_job.py). Kinds with safestage's writer passed
explicitly: "save", "async", "async-process", "resave-fail", "hf". Kinds with DCP's own
writers, staged by the switch alone (SAFESTAGE_DIR, set by the launcher; the worker never
names safestage): "switch-id" (``checkpoint_id=``), "switch-writer" (``FileSystemWriter``),
"switch-async" and "switch-async-process" (``async_save`` with each checkpointer type),
"switch-hf" (``HuggingFaceStorageWriter`` consolidating), "switch-hf-rank0" (rank 0's full
state dict in two shard files and the index), "switch-resave-fail", "switch-subclass" (a
subclass of FileSystemWriter: not staged); "stock": ``safestage.dcp.unstaged`` around DCP's
writer (the switch's off switch for one call), the baseline. Frameworks on DCP, the switch on:
"lightning-strategy", "lightning-fit", "accelerate" (``FRAMEWORKS`` below).

Every rank's state dict holds a tensor of its own ("own.<rank>"), one replicated on every
rank ("shared", which DCP's planner gives to one rank), a DTensor sharded over the ranks
("sharded") and the step (an int, pickled bytes).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _two_nodes import report
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import safestage
from safestage.dcp import StagedHuggingFaceWriter, StagedWriter, unstaged

STEP = 7


class SubclassWriter(dcp.FileSystemWriter):
    """A writer of the user's own: the switch leaves it alone."""


def full_sharded() -> torch.Tensor:
    return torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)


def state_dict(rank: int, mesh: Any, *, hf: bool = False) -> dict[str, Any]:
    state: dict[str, Any] = {
        f"own.{rank}": torch.full((16, 4), float(rank)) + torch.arange(4),
        "shared": torch.linspace(0, 1, 33),
        "sharded": distribute_tensor(full_sharded(), mesh, [Shard(0)]),
    }
    if not hf:  # the HuggingFace writer stores tensors only
        state["step"] = STEP
    return state


def outcome(exc: BaseException) -> dict[str, Any]:
    """What a rank saw: the exception's type and text (DCP's CheckpointException carries each
    failed rank's own exception in ``failures``)."""
    failures = getattr(exc, "failures", None) or {}
    return {
        "ok": False,
        "type": type(exc).__name__,
        "text": str(exc),
        "failed_ranks": sorted(failures),
        "causes": {str(rank): [type(pair[0]).__name__, str(pair[0])] for rank, pair in failures.items()},
    }


def run_case(case: dict[str, Any], rank: int, mesh: Any) -> dict[str, Any]:
    kind, dest = case["kind"], case["dest"]
    if kind == "save":
        dcp.save(state_dict(rank, mesh), storage_writer=StagedWriter(dest))
    elif kind == "async":
        dcp.async_save(state_dict(rank, mesh), storage_writer=StagedWriter(dest)).result()
    elif kind == "async-process":
        future = dcp.async_save(
            state_dict(rank, mesh), storage_writer=StagedWriter(dest),
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        )  # fmt: skip
        future.result()
    elif kind == "hf":
        dcp.save(state_dict(rank, mesh, hf=True), storage_writer=StagedHuggingFaceWriter(dest, save_distributed=True))
    elif kind == "stock":  # DCP's own writer, straight onto the destination: the baseline
        dcp.save(state_dict(rank, mesh), storage_writer=unstaged(dcp.FileSystemWriter(dest)))
    elif kind in ("resave-fail", "switch-resave-fail"):
        # A good checkpoint first; then rank 2's file is made a directory, so that its publish
        # of the second save fails while the other ranks' land.
        def save() -> None:
            if kind == "resave-fail":
                dcp.save(state_dict(rank, mesh), storage_writer=StagedWriter(dest))
            else:
                dcp.save(state_dict(rank, mesh), checkpoint_id=dest)

        save()
        dist.barrier()
        if rank == 0:
            blocker = Path(dest) / "__2_0.distcp"
            blocker.unlink()
            blocker.mkdir()
        dist.barrier()
        save()
    elif kind == "switch-id":
        dcp.save(state_dict(rank, mesh), checkpoint_id=dest)
    elif kind == "switch-writer":
        dcp.save(state_dict(rank, mesh), storage_writer=dcp.FileSystemWriter(dest))
    elif kind == "switch-async":
        dcp.async_save(state_dict(rank, mesh), checkpoint_id=dest).result()
    elif kind == "switch-async-process":
        dcp.async_save(
            state_dict(rank, mesh), checkpoint_id=dest, async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        ).result()  # fmt: skip
    elif kind == "switch-hf":
        writer = dcp.HuggingFaceStorageWriter(dest, save_distributed=True, enable_consolidation=True)
        dcp.save(state_dict(rank, mesh, hf=True), storage_writer=writer)
    elif kind == "switch-hf-rank0":
        full = {key: value.full_tensor() if hasattr(value, "full_tensor") else value
                for key, value in state_dict(rank, mesh, hf=True).items()}  # fmt: skip
        mapping = {key: 1 if key.startswith("own.") else 2 for key in [*(f"own.{r}" for r in range(4)), "shared", "sharded"]}
        full.update({f"own.{r}": torch.full((16, 4), float(r)) + torch.arange(4) for r in range(4)})
        writer = dcp.HuggingFaceStorageWriter(dest, fqn_to_index_mapping=mapping)
        dcp.save(full if rank == 0 else {}, storage_writer=writer)
    elif kind == "switch-subclass":
        dcp.save(state_dict(rank, mesh), storage_writer=SubclassWriter(dest))
    elif kind in FRAMEWORKS:
        return {"ok": True, "seen": FRAMEWORKS[kind](dest)}
    else:
        raise ValueError(f"unknown case kind {kind!r}")
    return {"ok": True}


# -- frameworks on DCP (their imports cost ~30 s of CPU per rank: made only if a case asks) ----


def lightning_strategy(dest: str) -> dict[str, Any]:
    """Lightning's FSDPStrategy (sharded) ``save_checkpoint`` on every rank, below the Trainer
    (which refuses FSDP on CPU): the fabric function it calls (``_distributed_checkpoint_save``),
    then rank 0's ``meta.pt``."""
    from lightning.fabric.plugins.environments import TorchElasticEnvironment
    from lightning.pytorch.strategies import FSDPStrategy

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    strategy = FSDPStrategy(state_dict_type="sharded", cluster_environment=TorchElasticEnvironment())
    checkpoint = {"state_dict": model.state_dict(), "optimizer_states": [optimizer.state_dict()], "epoch": 3,
                  "global_step": 7}  # fmt: skip
    strategy.save_checkpoint(checkpoint, dest)
    return {"weight": model.weight.tolist(), "bias": model.bias.tolist()}


def lightning_fit(dest: str) -> dict[str, Any]:
    """A ModelParallelStrategy (FSDP2, data parallel over every rank) fit of 4 steps with
    ModelCheckpoint(save_top_k=2, save_last=True) saving a sharded checkpoint every step; then
    a fit resumed from the newest complete checkpoint (``latest_complete``, asked by rank 0, as
    a resuming job would) to step 5, then one resumed with ``ckpt_path="last"`` to step 6."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy

    class Sharded(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(8, 8)
            self.started_at = -1

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.layer, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
            self.log("better", float(self.global_step))  # improves every step: top-k evicts the oldest
            return self.layer(batch).pow(2).mean()

        def on_train_start(self) -> None:
            self.started_at = self.global_step

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=0.1)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(torch.randn(64, 8, generator=torch.Generator().manual_seed(1)), batch_size=2)

    def trainer(max_steps: int) -> tuple[Any, Any]:
        every = ModelCheckpoint(dirpath=dest, monitor="better", mode="max", save_top_k=2, save_last=True,
                                every_n_train_steps=1)  # fmt: skip
        fit = L.Trainer(
            accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), num_nodes=2, max_steps=max_steps,
            strategy=ModelParallelStrategy(data_parallel_size=dist.get_world_size(), tensor_parallel_size=1),
            callbacks=[every], logger=False, enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        return fit, every

    first, every = trainer(4)
    first.fit(Sharded())
    seen: dict[str, Any] = {"best_k": sorted(Path(p).name for p in every.best_k_models), "last": Path(every.last_model_path).name}
    latest = [str(found) if dist.get_rank() == 0 and (found := safestage.latest_complete(dest, "epoch=*-step=*.ckpt")) else None]
    dist.broadcast_object_list(latest, src=0)  # every rank resumes from rank 0's answer
    resumed, _ = trainer(5)
    model = Sharded()
    resumed.fit(model, ckpt_path=latest[0])
    seen.update(latest=Path(latest[0]).name if latest[0] else None, resumed_at=model.started_at)
    again, every = trainer(6)
    model = Sharded()
    again.fit(model, ckpt_path="last")
    seen.update(last_resumed_at=model.started_at, final_best_k=sorted(Path(p).name for p in every.best_k_models))
    return seen


def accelerate_state(dest: str) -> dict[str, Any]:
    """docs/integrations.md's recipe: accelerate's ``save_state`` of every rank into the local
    directory of one ``staged_dir(group=WORLD, keep=2)`` per step, with the DCP subdirectories
    its FSDP save writes (accelerate's own ``save_fsdp_model`` / ``save_fsdp_optimizer``, what
    ``save_state`` calls under FSDP, which accelerate enables on GPUs only); three steps, then
    ``load_state`` of the newest complete one on every rank."""
    from types import SimpleNamespace

    from accelerate import Accelerator
    from accelerate.utils.fsdp_utils import save_fsdp_model, save_fsdp_optimizer
    from torch.distributed.fsdp import StateDictType, fully_shard

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    sharded = torch.nn.Linear(8, 8)
    fully_shard(sharded, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    sharded_optimizer = torch.optim.Adam(sharded.parameters(), lr=0.1)
    plugin = SimpleNamespace(fsdp_version=2, state_dict_type=StateDictType.SHARDED_STATE_DICT,
                             state_dict_config=SimpleNamespace(), optim_state_dict_config=None)  # fmt: skip
    parent = Path(dest)
    parent.mkdir(exist_ok=True)
    for step in (1, 2, 3):
        accelerator.backward(model(torch.ones(2, 8)).sum())
        optimizer.step()
        sharded(torch.ones(2, 8)).sum().backward()
        sharded_optimizer.step()
        with safestage.staged_dir(parent / f"checkpoint_{step}", group=dist.group.WORLD, keep=2) as local:
            accelerator.save_state(str(local))
            save_fsdp_model(plugin, accelerator, sharded, str(local))
            save_fsdp_optimizer(plugin, accelerator, sharded_optimizer, sharded, str(local))
    saved = [value.detach().clone() for value in model.parameters()]
    with torch.no_grad():
        for value in model.parameters():
            value.zero_()
    latest = safestage.latest_complete(parent, "checkpoint_*")
    assert latest is not None
    accelerator.load_state(str(latest))
    return {"latest": latest.name, "loaded_equal": all(torch.equal(a, b) for a, b in zip(saved, model.parameters())),
            "weight": sharded.weight.full_tensor().tolist()}  # fmt: skip


FRAMEWORKS = {"lightning-strategy": lightning_strategy, "lightning-fit": lightning_fit, "accelerate": accelerate_state}


def main() -> None:
    warnings.simplefilter("ignore")  # DCP warns about the overwrite default
    plan = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results: dict[str, Any] = {}
    for case in plan:
        try:
            results[case["name"]] = run_case(case, rank, mesh)
        except BaseException as exc:  # DCP's CheckpointException is a BaseException
            results[case["name"]] = outcome(exc)
            if not isinstance(exc, Exception) and type(exc).__name__ != "CheckpointException":
                raise
        dist.barrier()  # every case starts with every rank done with the one before
    root = Path(os.environ["SAFESTAGE_DIR"])
    report(results=results, node_root=str(root), local_rank=int(os.environ["LOCAL_RANK"]),
           staging_on=safestage.is_active())  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
