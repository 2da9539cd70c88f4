"""The Trainer callback and the Lightning plugin on many ranks: 4 ranks launched as two torchrun
"nodes" on 127.0.0.1 (``tests/_two_nodes.py``), each node staging under its own root, gloo on
CPU, checkpoints onto the kit's hdfs FUSE mount (no rename over an existing file, no
ftruncate, close-to-open visibility): what docs/integrations.md says for many ranks.

- transformers: every rank writes its own files of ``checkpoint-N`` (rank 0 the model,
  optimizer, scheduler and trainer state, every rank ``rng_state_<rank>.pth``), staged on its
  own node; ``CommitCallback`` commits each checkpoint once every rank is done. A resume from
  ``latest_complete`` continues from that step on every rank, in the same state.
- Lightning DDP (one rank per node): rank 0 writes each checkpoint through ``StagedCheckpointIO`` (the other ranks'
  plugins are never asked), and a fit resumed from it starts at its step on every rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _helpers import files_under, fresh_dir, stray_files
from safetensors.torch import load_file

import safestage
from tests._two_nodes import Job, launch

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
RANKS = 4  # 2 nodes x 2
ENV = {
    "SAFESTAGE_TORCH_SAVE": "1",  # optimizer.pt, scheduler.pt, rng_state_*.pth staged too
    "GLOO_SOCKET_IFNAME": "lo",
    "TRANSFORMERS_VERBOSITY": "error",
    "SAFESTAGE_LOG_LEVEL": "INFO",
}


def _roots(tmp_path: Path) -> tuple[Path, Path]:
    roots = (tmp_path / "node-0-nvme", tmp_path / "node-1-nvme")
    for root in roots:
        root.mkdir()
    return roots


def _ran(job: Job, ranks: int = RANKS) -> dict[int, dict]:
    assert not job.timed_out, "the job hung:\n" + job.output()
    assert job.returncodes == [0, 0], job.output()
    assert sorted(job.reports) == list(range(ranks)), job.output()
    return job.reports


def _nothing_kept(roots: tuple[Path, Path]) -> None:
    for root in roots:
        assert not list(root.rglob("safestage-kept.json")), f"a kept copy under {root}: {files_under(root)}"


def _complete(checkpoint: Path) -> list[str]:
    """The checkpoint is complete to its bytes; its files, as its commit file lists them."""
    result = safestage.verify(checkpoint, deep=True)
    assert result.complete, (checkpoint, result.problems)
    assert result.extra == []
    names = sorted(entry.path for entry in result.manifest.files)
    assert sorted(files_under(checkpoint)) == sorted([*names, safestage.COMMIT_NAME])
    return names


def test_trainer_on_two_nodes_commits_every_checkpoint_and_resumes_from_latest_complete(kit_mounts, tmp_path):
    output_dir = fresh_dir(kit_mounts["hdfs"], "run")
    roots = _roots(tmp_path)
    script = HERE / "_trainer_nodes.py"

    # -- run 1: 8 steps, a checkpoint every 2 -------------------------------------------------
    job = launch(script, [str(output_dir), "8"], roots=roots, result_dir=tmp_path / "run-1",
                 env=ENV, timeout=400)  # fmt: skip
    reports = _ran(job)
    steps = ["checkpoint-2", "checkpoint-4", "checkpoint-6", "checkpoint-8"]
    assert [(r["start_step"], r["end_step"]) for _, r in sorted(reports.items())] == [(0, 8)] * RANKS
    assert [r["should_save"] for _, r in sorted(reports.items())] == [True, False, False, False]
    assert [name for name, *_ in reports[0]["committed"]] == steps
    assert all(r["committed"] == [] for rank, r in reports.items() if rank != 0)
    assert [reports[rank]["root"] for rank in range(RANKS)] == [str(roots[0])] * 2 + [str(roots[1])] * 2
    assert sorted(p.name for p in output_dir.iterdir()) == steps
    expected = {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json",
                "training_args.bin", "config.json", *(f"rng_state_{rank}.pth" for rank in range(RANKS))}  # fmt: skip
    for name in steps:
        assert expected <= set(_complete(output_dir / name))
    assert not stray_files(output_dir)
    _nothing_kept(roots)
    uninterrupted = {name: load_file(str(output_dir / name / "model.safetensors")) for name in steps}

    # -- what a job killed at step 8 would leave: 8 never committed, 6 missing rank 3's file -----
    for name in ("checkpoint-6", "checkpoint-8"):
        (output_dir / name / safestage.COMMIT_NAME).unlink()
    (output_dir / "checkpoint-6" / "rng_state_3.pth").unlink()
    assert safestage.latest_complete(output_dir) == output_dir / "checkpoint-4"

    # -- run 2, the same job: resumes from latest_complete on every rank, rewrites 6 and 8 -------
    job = launch(script, [str(output_dir), "8"], roots=roots, result_dir=tmp_path / "run-2",
                 env=ENV, timeout=400)  # fmt: skip
    reports = _ran(job)
    assert [(r["start_step"], r["end_step"]) for _, r in sorted(reports.items())] == [(4, 8)] * RANKS
    assert {r["resumed_from"] for r in reports.values()} == {str(output_dir / "checkpoint-4")}
    assert [name for name, *_ in reports[0]["committed"]] == ["checkpoint-6", "checkpoint-8"]
    for name in steps:
        assert expected <= set(_complete(output_dir / name))
    assert safestage.latest_complete(output_dir) == output_dir / "checkpoint-8"
    # Resumed in the same state (parameters, optimizer, scheduler, data order): steps 6 and 8
    # again, to float rounding, and far from step 4, where it resumed.
    drift = moved = 0.0
    for name in ("checkpoint-6", "checkpoint-8"):
        again = load_file(str(output_dir / name / "model.safetensors"))
        assert sorted(again) == sorted(uninterrupted[name])
        for key, tensor in again.items():
            drift = max(drift, (tensor - uninterrupted[name][key]).abs().max().item())
            moved = max(moved, (uninterrupted["checkpoint-4"][key] - uninterrupted[name][key]).abs().max().item())
    assert drift <= 1e-6 < moved / 100, (drift, moved)
    assert not stray_files(output_dir)
    _nothing_kept(roots)
    seconds = [round(s, 3) for _, _, s, _ in reports[0]["committed"]]
    sizes = sorted({size for *_, size in reports[0]["committed"]})
    print(f"\ntrainer on 2 nodes x 2 ranks: run 2 took {job.seconds:.1f} s; commits (read back by rank 0) "
          f"{seconds} s of {sizes} bytes; steps 6, 8 resumed vs uninterrupted: {drift:.2e} (steps 4 to 8 moved {moved:.2e})")


def test_lightning_ddp_on_two_nodes_writes_from_rank_0_and_resumes(kit_mounts, tmp_path):
    directory = fresh_dir(kit_mounts["hdfs"], "ddp")
    roots = _roots(tmp_path)
    # One rank per node: DDP's saving rank is the same with 2 ranks as with 4, at half the cost.
    job = launch(HERE / "_lightning_nodes.py", [str(directory)], roots=roots, result_dir=tmp_path / "reports",
                 nproc_per_node=1, env=ENV, timeout=400)  # fmt: skip
    reports = _ran(job, ranks=2)
    names = ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    assert reports[0]["published"] == names
    assert reports[0]["published_after_resume"] == ["epoch=0-step=6.ckpt"]
    assert reports[1]["root"] == str(roots[1])
    for rank in (1,):  # DDP: the other ranks' plugins are never asked to save
        assert reports[rank]["published"] == reports[rank]["published_after_resume"] == []
    assert {r["resumed_from"] for r in reports.values()} == {"epoch=0-step=4.ckpt"}
    assert [reports[rank]["resumed_at"] for rank in (0, 1)] == [4, 4]
    assert sorted(files_under(directory)) == [*names, "epoch=0-step=6.ckpt"]
    for name in sorted(files_under(directory)):
        checkpoint = torch.load(directory / name, weights_only=False)
        assert checkpoint["global_step"] == int(name.split("step=")[1].split(".")[0])
    _nothing_kept(roots)
    print(f"\nlightning ddp on 2 nodes x 1 rank: {job.seconds:.1f} s")
