"""Kill trials of distributed commits: a DDP job of four ranks on two torchrun "nodes"
checkpoints every few steps through staged_dir(group=WORLD) onto the kit's hdfs and
mountpoint mounts and the real s3fs and rclone-S3 mounts; a random rank SIGKILLs itself at a
random moment of a random checkpoint. After every job:

- no rank hangs (the job ends well within its timeout) and every rank that was not killed
  (torchrun's agent stops the killed rank's node-mate itself, with SIGTERM) reports an error;
- ``latest_complete`` never names a checkpoint whose files do not all match its commit file
  or whose state is not the reference run's state at that step (0 wrong answers);
- the next job resumes from ``latest_complete`` with the reference state at that step and,
  once it reaches the last step, ends with the reference run's final parameters.

SAFESTAGE_DIST_KILL_TRIALS sets the number of jobs (each is one kill; CI runs a few, 100 and
more were run for the record: see CHANGELOG.md); SAFESTAGE_DIST_KILL_SEED the seed.

The same job commits to an object-store URL (s3:// on the local moto server, reached through
the AWS environment the launch passes on), a rank killed at a step of a commit seen from
outside: once an object of it is in the store. Then no rank hangs, and every checkpoint under
the run has no commit object or a complete one: listing exactly the objects there, with their
sizes and ETags, holding the state of its step.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from _support import tiered
from safetensors.torch import load_file

import safestage
from safestage import COMMIT_NAME, _object_store
from safestage._destination import ObjectURL, url_of
from tests._stores import download, new_bucket, s3_environment
from tests._two_nodes import launch

WORKER = Path(__file__).with_name("ddp_kill_worker.py")
RANKS, TOTAL, EVERY = 4, 12, 2
MODES = ("hdfs", "mountpoint", "s3fs", "rclone-s3")
JOB_TIMEOUT = 240.0  # a job takes about 20 s here; a hang shows as this timeout


def _state_matches(checkpoint: Path, reference: Path) -> bool:
    """Every file of ``checkpoint`` is of its step: the model (its step, and its parameters
    close to the reference run's at that step: a resumed DDP run rounds differently, see
    ddp_kill_worker._final_equal), each rank's optimizer state and shard."""
    step = int(checkpoint.name.split("-")[1])
    expected = load_file(str(reference / f"step-{step}.safetensors"))
    model = load_file(str(checkpoint / "model.safetensors"))
    if model.pop("_step").item() != step or model.keys() != expected.keys():
        return False
    if not all(torch.allclose(model[key], expected[key], rtol=1e-4, atol=1e-6) for key in model):
        return False
    for rank in range(RANKS):
        own = torch.load(checkpoint / "optim" / f"rank{rank}.pt", weights_only=False)
        shard = load_file(str(checkpoint / f"shard-rank{rank}.safetensors"))["shard"]
        if own["step"] != step or not torch.all(shard == step * 10 + rank):
            return False
    return True


@pytest.mark.slow
def test_a_rank_killed_at_any_moment_of_a_checkpoint_never_leaves_a_wrong_latest_and_no_rank_hangs(
    tmp_path: Path, kit_mounts: dict[str, Any], real_mounts: dict[str, Any], suite_settings: dict[str, str]
) -> None:
    trials = int(suite_settings.get("SAFESTAGE_DIST_KILL_TRIALS", "4"))
    seed = int(suite_settings.get("SAFESTAGE_DIST_KILL_SEED", "20261202"))
    roots = (tmp_path / "node0", tmp_path / "node1")
    for root in roots:
        root.mkdir()
    reference = tmp_path / "reference"
    reference.mkdir()
    (tmp_path / "reference-run").mkdir()
    recorded = launch(WORKER, [str(tmp_path / "reference-run"), str(reference), str(TOTAL), str(EVERY), "record"],
                      roots=roots, result_dir=tmp_path / "results-reference", timeout=JOB_TIMEOUT)  # fmt: skip
    assert recorded.returncodes == [0, 0] and len(recorded.reports) == RANKS, recorded.output()
    mounts = {mode: (kit_mounts if mode in ("hdfs", "mountpoint") else real_mounts)[mode] for mode in MODES}
    rng = random.Random(seed)
    chains: dict[str, int] = {}
    fired = resumed = finished = 0
    wrong: list[str] = []
    trial = 0
    # `trials` jobs, then (kills that came between checkpoints test nothing here) up to as many
    # again, aimed earlier in a checkpoint, until half the asked-for kills came during one and a job resumed.
    while trial < trials or ((fired < trials // 2 or (trials > 1 and not resumed)) and trial < 2 * trials):
        mode = MODES[(trial // 2) % len(MODES)]  # two jobs in a row per mount: the second resumes
        run_dir = Path(mounts[mode].path) / f"run-{tmp_path.name}-{chains.setdefault(mode, 0)}"
        run_dir.mkdir(exist_ok=True)
        latest = safestage.latest_complete(run_dir)
        done = int(latest.name.split("-")[1]) if latest is not None else 0
        remaining = (TOTAL - done) // EVERY
        # A run's first job is killed from its second checkpoint on, so the next job has one to resume.
        first = 1 if latest is None and remaining > 1 else 0
        # A run's first job is killed before its last checkpoint: a kill timed after the last one
        # can come after the job has ended, and then there is nothing to resume.
        last = remaining - 1 if latest is None and remaining > 2 else remaining
        kill = {"rank": rng.randrange(RANKS), "checkpoint": rng.randrange(first, last),
                "delay": rng.uniform(0.0, 0.6 if trial < trials else 0.15)}
        job = launch(WORKER, [str(run_dir), str(reference), str(TOTAL), str(EVERY)], roots=roots,
                     result_dir=tmp_path / f"results-{trial}", timeout=JOB_TIMEOUT,
                     env={"SAFESTAGE_TEST_KILL": f'{{"rank": {kill["rank"]}, "checkpoint": {kill["checkpoint"]}, '
                                                 f'"delay": {kill["delay"]}}}'})  # fmt: skip
        where = f"trial {trial} on {mode}, kill {kill}, {job.seconds:.1f} s"
        assert not job.timed_out, f"{where}: a rank hung\n{job.output()}"
        if kill["rank"] not in job.reports:
            # Every rank that reported was not killed: it must have raised, not returned (unless
            # the kill came after its last checkpoint landed); one that was in a checkpoint, a
            # PublishError (the others saw DDP's own allreduce fail).
            phases = set()
            for rank, seen in job.reports.items():
                if seen["error"] is None:  # the kill came after its last checkpoint had landed
                    landed = safestage.latest_complete(run_dir)
                    assert seen["step"] == TOTAL and landed is not None and landed.name == f"checkpoint-{TOTAL}", (
                        f"{where}: rank {rank} returned after rank {kill['rank']} died, but its last "
                        f"checkpoint is not complete: {seen}"
                    )
                    continue
                phases.add(seen["error"]["phase"])
                if seen["error"]["phase"] == "checkpoint":
                    assert seen["error"]["type"] == "PublishError", f"{where}: rank {rank}: {seen['error']}"
                    assert "rank" in seen["error"]["message"], seen["error"]
            fired += "checkpoint" in phases
        for seen in job.reports.values():
            assert seen["resumed_equal"] in (None, True), f"{where}: resumed a different state: {seen}"
            resumed += seen["resumed_equal"] is True
            if seen["error"] is None and seen["step"] == TOTAL:
                assert seen["final_equal"], f"{where}: the resumed run ended with other parameters: {seen}"
                finished += 1
        latest = safestage.latest_complete(run_dir)
        if latest is not None and not (safestage.verify(latest, deep=True).complete and _state_matches(latest, reference)):
            wrong.append(f"{where}: latest_complete named {latest}")
        for checkpoint in sorted(run_dir.glob("checkpoint-*")):  # not only the newest
            if safestage.verify(checkpoint, deep=True).complete and not _state_matches(checkpoint, reference):
                wrong.append(f"{where}: {checkpoint} is complete with files of another state")
        print(f"{where}: killed={kill['rank'] not in job.reports} wrong_so_far={len(wrong)} "
              f"latest={latest.name if latest else None}", flush=True)  # a long run's record, job by job
        if latest is not None and latest.name == f"checkpoint-{TOTAL}":
            chains[mode] += 1  # this run is over: the next trial on this mount starts a new one
        trial += 1
    print(f"{trial} jobs, {fired} kills during a checkpoint, {len(wrong)} wrong answers, {resumed} ranks resumed equal, "
          f"{finished} ranks finished equal to the reference")  # fmt: skip
    assert wrong == [], "\n".join(wrong)
    if trials > 1:  # the second job on a mount resumes the run a killed job left
        assert resumed > 0, "no job resumed from latest_complete: the trials did not test resuming"
    assert fired >= trials // 2, f"only {fired} of {trial} kills came during a checkpoint: the trials did not test them"


def _of_its_step(checkpoint: Path) -> bool:
    """Every file of ``checkpoint`` (a copy of a run's checkpoint-<step>) is of its step: the
    model's step, each rank's optimizer step and its shard (ddp_kill_worker.shard_of)."""
    step = int(checkpoint.name.split("-")[1])
    if load_file(str(checkpoint / "model.safetensors"))["_step"].item() != step:
        return False
    for rank in range(RANKS):
        own = torch.load(checkpoint / "optim" / f"rank{rank}.pt", weights_only=False)
        shard = load_file(str(checkpoint / f"shard-rank{rank}.safetensors"))["shard"]
        if own["step"] != step or not torch.all(shard == step * 10 + rank):
            return False
    return True


def _files(rank: int) -> list[str]:
    return [f"shard-rank{rank}.safetensors", f"optim/rank{rank}.pt", f"rng/rank{rank}.pt"]


# (the rank killed, the object of the checkpoint whose landing kills it): a rank once one of
# its files landed, others still publishing (on the other node, on its own; the coordinator);
# the coordinator once the commit object landed, before the others heard of it.
URL_KILLS = [(2, "shard-rank2.safetensors"), (1, "optim/rank1.pt"), (0, "shard-rank0.safetensors"),
             (3, "rng/rank3.pt"), (0, COMMIT_NAME)]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("kill", tiered(URL_KILLS, ci=[URL_KILLS[0]]), ids=lambda kill: f"rank{kill[0]}-{kill[1]}")
def test_a_rank_killed_at_a_step_of_a_collective_commit_to_a_url_leaves_no_commit_object_or_a_complete_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kill: tuple[int, str]
) -> None:
    bucket = new_bucket(monkeypatch, "kill")
    run = f"s3://{bucket}/run"
    roots = (tmp_path / "node0", tmp_path / "node1")
    for root in roots:
        root.mkdir()
    rank, once = kill
    job = launch(WORKER, [run, str(tmp_path / "no-reference"), str(TOTAL), str(EVERY)], roots=roots,
                 result_dir=tmp_path / "results", timeout=JOB_TIMEOUT, env={**s3_environment(),
                 "SAFESTAGE_TEST_KILL": json.dumps({"rank": rank, "checkpoint": 1, "once": once})})  # fmt: skip
    where = f"kill of rank {rank} once {once} landed, {job.seconds:.1f} s"
    assert not job.timed_out, f"{where}: a rank hung\n{job.output()}"
    assert rank not in job.reports, f"{where}: the kill did not fire\n{job.output()}"
    for other, seen in job.reports.items():  # its node-mate may have been stopped by torchrun
        assert seen["error"] is not None, (where, other, seen)
        if once == COMMIT_NAME:  # the commit had landed: they returned from it, and training failed
            assert seen["error"]["phase"] == "training" and seen["step"] == 2 * EVERY, (where, other, seen)
        else:
            assert seen["error"]["phase"] == "checkpoint", (where, other, seen)
            assert seen["error"]["type"] == "PublishError" and "rank" in seen["error"]["message"], (where, seen)
    prefix = url_of(run)
    assert isinstance(prefix, ObjectURL)
    steps: dict[str, dict[str, Any]] = {}
    for info in _object_store.listing(prefix):
        name, _, path = info.key[len(prefix.prefix):].partition("/")
        steps.setdefault(name, {})[path] = info
    # The first checkpoint landed; the second was the one the kill came in; none after it began.
    assert sorted(steps) == [f"checkpoint-{EVERY}", f"checkpoint-{2 * EVERY}"], (where, sorted(steps))
    complete = []
    for name, objects in sorted(steps.items()):
        if COMMIT_NAME not in objects:
            continue
        document = json.loads(_object_store.read(prefix / name / COMMIT_NAME) or b"")
        listed = {entry["path"]: entry for entry in document["files"]}
        assert sorted(listed) == sorted(path for path in objects if path != COMMIT_NAME), (where, name)
        for path, entry in listed.items():
            assert (entry["size"], entry["etag"]) == (objects[path].size, objects[path].etag), (where, name, path)
        expected = {path: owner for owner in range(RANKS) for path in _files(owner)}
        assert {path: entry["rank"] for path, entry in listed.items()} == {**expected, "model.safetensors": 0}
        assert _of_its_step(download(f"{run}/{name}", tmp_path / "copies" / name)), (where, name)
        complete.append(name)
    killed = f"checkpoint-{2 * EVERY}"
    if once == COMMIT_NAME:  # the coordinator died after its commit object landed: complete
        assert complete == [f"checkpoint-{EVERY}", killed], where
    else:  # a rank died while the ranks published: no commit object
        assert complete == [f"checkpoint-{EVERY}"], where
        assert once in steps[killed], where  # the kill came once that object had landed
