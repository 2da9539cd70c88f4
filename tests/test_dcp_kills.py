"""Kill trials of DCP saves under the switch: a job of four ranks on two torchrun "nodes" (each
its own SAFESTAGE_DIR) ``dcp.save``s a checkpoint every few steps with DCP's own writer
(``checkpoint_id=``), onto the kit's hdfs and mountpoint mounts and the real s3fs mount; a
random rank SIGKILLs itself at a random moment of a random save. After every job:

- no rank hangs (the job ends well within its timeout), and every rank that reported and was
  not killed raised (or had finished: the kill came after its last save);
- ``latest_complete`` never names a checkpoint that stock ``dcp.load`` cannot read, or that
  holds another state than the one saved at its step; nor is any other checkpoint complete
  that does not (0 wrong answers);
- the next job on that mount resumes from ``latest_complete`` with exactly that state.

SAFESTAGE_DCP_KILL_TRIALS sets the number of jobs (each is one kill; CI runs 3, about a minute
on an idle 2-core machine; the record: CHANGELOG.md), SAFESTAGE_DCP_KILL_SEED the seed.
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import safestage
from tests._two_nodes import launch

WORKER = Path(__file__).with_name("dcp_kill_worker.py")
RANKS, TOTAL, EVERY = 4, 12, 2
MODES = ("hdfs", "mountpoint", "s3fs")
JOB_TIMEOUT = 240.0  # a job takes about 20 s on an idle machine; a hang shows as this timeout
SHARD = 256 * 1024  # dcp_kill_worker.SHARD


def expected_at(step: int) -> dict[str, Any]:
    """What every rank saved together at ``step`` (dcp_kill_worker.state_at), as plain tensors."""
    state: dict[str, Any] = {f"own.{rank}": torch.full((64, 64), float(step * 10 + rank)) for rank in range(RANKS)}
    state["shared"] = torch.linspace(0, 1, 257) * step
    state["sharded"] = torch.arange(RANKS * SHARD, dtype=torch.float32) + step * 1000
    state["step"] = step
    return state


def readable_and_right(checkpoint: Path) -> bool:
    """Stock dcp.load reads ``checkpoint`` and it holds the state of its step, exactly."""
    step = int(checkpoint.name.split("-")[1])
    expected = expected_at(step)
    loaded = {key: torch.zeros_like(value) if isinstance(value, torch.Tensor) else 0 for key, value in expected.items()}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a single reader, no process group
            dcp.load(loaded, checkpoint_id=checkpoint)
    except BaseException:  # DCP's CheckpointException is a BaseException
        return False
    return all(torch.equal(loaded[key], value) if isinstance(value, torch.Tensor) else loaded[key] == value
               for key, value in expected.items())  # fmt: skip


@pytest.mark.slow
def test_a_rank_killed_at_any_moment_of_a_dcp_save_never_leaves_a_latest_dcp_cannot_read(
    tmp_path: Path, kit_mounts: dict[str, Any], real_mounts: dict[str, Any], suite_settings: dict[str, str]
) -> None:
    trials = int(suite_settings.get("SAFESTAGE_DCP_KILL_TRIALS", "3"))
    seed = int(suite_settings.get("SAFESTAGE_DCP_KILL_SEED", "20261205"))
    roots = (tmp_path / "node0", tmp_path / "node1")
    for root in roots:
        root.mkdir()
    mounts = {mode: (kit_mounts if mode in ("hdfs", "mountpoint") else real_mounts)[mode] for mode in MODES}
    rng = random.Random(seed)
    chains: dict[str, int] = {}
    fired = resumed = 0
    wrong: list[str] = []
    trial = 0
    # `trials` jobs, then (kills that came between saves test less) up to as many again, aimed
    # earlier in a save, until half the asked-for kills came during one and a job resumed.
    while trial < trials or ((fired < (trials + 1) // 2 or (trials > 1 and not resumed)) and trial < 2 * trials):
        mode = MODES[(trial // 2) % len(MODES)]  # two jobs in a row per mount: the second resumes
        run_dir = Path(mounts[mode].path) / f"run-{tmp_path.name}-{chains.setdefault(mode, 0)}"
        run_dir.mkdir(exist_ok=True)
        latest = safestage.latest_complete(run_dir, "step-*")
        done = int(latest.name.split("-")[1]) if latest is not None else 0
        remaining = (TOTAL - done) // EVERY
        # A run's first job is killed from its second save on, so that the next job has one to resume.
        first = 1 if latest is None and remaining > 1 else 0
        # A run's first job is killed before its last save: a kill timed after the last one
        # can come after the job has ended, and then there is nothing to resume.
        last = remaining - 1 if latest is None and remaining > 2 else remaining
        kill = {"rank": rng.randrange(RANKS), "checkpoint": rng.randrange(first, last),
                "delay": rng.uniform(0.0, 0.8 if trial < trials else 0.2)}  # fmt: skip
        job = launch(WORKER, [str(run_dir), str(TOTAL), str(EVERY)], roots=roots,
                     result_dir=tmp_path / f"results-{trial}", timeout=JOB_TIMEOUT,
                     env={"SAFESTAGE_TEST_KILL": f'{{"rank": {kill["rank"]}, "checkpoint": {kill["checkpoint"]}, '
                                                 f'"delay": {kill["delay"]}}}', "GLOO_SOCKET_IFNAME": "lo"})  # fmt: skip
        where = f"trial {trial} on {mode}, kill {kill}, {job.seconds:.1f} s"
        assert not job.timed_out, f"{where}: a rank hung\n{job.output()}"
        assert all(seen["staging_on"] for seen in job.reports.values()), job.output()
        if kill["rank"] not in job.reports:
            phases = set()
            for rank, seen in job.reports.items():
                if seen["error"] is None:  # the kill came after its last save had landed
                    landed = safestage.latest_complete(run_dir, "step-*")
                    assert seen["step"] == TOTAL and landed is not None and landed.name == f"step-{TOTAL}", (
                        f"{where}: rank {rank} returned after rank {kill['rank']} died, but its last save is "
                        f"not complete: {seen}"
                    )
                    continue
                phases.add(seen["error"]["phase"])
            fired += "checkpoint" in phases
        for seen in job.reports.values():
            assert seen["resumed_equal"] in (None, True), f"{where}: resumed a different state: {seen}"
            resumed += seen["resumed_equal"] is True
        latest = safestage.latest_complete(run_dir, "step-*")
        if latest is not None and not (safestage.verify(latest, deep=True).complete and readable_and_right(latest)):
            wrong.append(f"{where}: latest_complete named {latest}, which stock dcp.load cannot read as saved")
        for checkpoint in sorted(run_dir.glob("step-*")):  # not only the newest
            if checkpoint != latest and safestage.verify(checkpoint).complete and not readable_and_right(checkpoint):
                wrong.append(f"{where}: {checkpoint} is complete but stock dcp.load cannot read it as saved")
        print(f"{where}: killed={kill['rank'] not in job.reports} wrong_so_far={len(wrong)} "
              f"latest={latest.name if latest else None}", flush=True)  # a long run's record, job by job
        if latest is not None and latest.name == f"step-{TOTAL}":
            chains[mode] += 1  # this run is over: the next trial on this mount starts a new one
        trial += 1
    print(f"{trial} jobs, {fired} kills during a save, {len(wrong)} wrong answers, {resumed} ranks resumed equal")
    assert wrong == [], "\n".join(wrong)
    if trials > 1:
        assert resumed > 0, "no job resumed from latest_complete: the trials did not test resuming"
    assert fired >= (trials + 1) // 2, f"only {fired} of {trial} kills came during a save: the trials did not test them"
