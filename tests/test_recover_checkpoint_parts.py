"""`safestage recover` commits a kept copy only when it is a whole checkpoint: never one
rank's part of a DCP save (DCP's ``.metadata`` is written later, by the coordinator, in
``finish``), whatever the world size; and always a ``staged_dir(group=WORLD)`` copy of a world
of one rank, which is the whole checkpoint.

Kept copies are made the way users get them: a real ``dcp.save`` through
``safestage.dcp.StagedWriter`` whose publish fails with a real ENOSPC on a 2 MiB tmpfs, from
one process or from the two ranks of a real gloo world; a real ``staged_dir(group=WORLD)`` in a
gloo world of one rank failing the same way. The tmpfs is then grown, so that nothing but the
nature of the copy can stop recover.

The ranks are processes forked from this one (``run_ranks``): torch is imported once, not once
per rank (an import of torch costs ~10 s on a loaded 2-core machine); they meet through a file
store, as a torchrun job's ranks meet through its rendezvous.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import safestage
import safestage.dcp
from safestage import COMMIT_NAME
from safestage._names import KEPT_RECORD, parse_stage_dir

BIG = 768 * 1024  # float32 values: 3 MiB, more than the 2 MiB tmpfs holds


def kept_save_dirs(root: Path) -> list[Path]:
    return sorted(root / name for name in os.listdir(root) if parse_stage_dir(name) is not None)


def tree(path: Path) -> dict[str, tuple[int, int]]:
    """Every entry below ``path`` with (size, mtime_ns): what "touched nothing" compares."""
    found = {}
    for directory, names, files in os.walk(path):
        for name in names + files:
            info = os.lstat(os.path.join(directory, name))
            found[os.path.relpath(os.path.join(directory, name), path)] = (info.st_size, info.st_mtime_ns)
    return found


def remount(target: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(target)], check=True)


def run_ranks(body: Callable[[int, int], dict[str, Any]], world: int, store: Path, timeout: float = 120) -> dict[int, Any]:
    """Run ``body(rank, world)`` in ``world`` forked processes joined in one gloo world (a file
    store); returns {rank: what body returned, or the exception it raised, as text}. Each rank
    ends with os._exit (multiprocessing's): nothing of this process's exit runs there."""
    import torch.distributed as dist

    context = multiprocessing.get_context("fork")
    results = context.Queue()

    def rank_main(rank: int) -> None:
        # This process's OpenMP pool does not survive the fork: a parallel op in the child
        # would wait forever for its threads. One intra-op thread, as a torchrun rank of a
        # 2-core machine gets anyway.
        torch.set_num_threads(1)
        warnings.simplefilter("ignore")
        try:
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
            try:
                results.put((rank, body(rank, world)))
            finally:
                dist.destroy_process_group()
        except BaseException as exc:  # reported: the test says what went wrong
            results.put((rank, f"rank {rank} raised {type(exc).__name__}: {exc}"))

    ranks = [context.Process(target=rank_main, args=(rank,), daemon=True) for rank in range(world)]
    for process in ranks:
        process.start()
    try:
        seen = dict(results.get(timeout=timeout) for _ in range(world))
        for process in ranks:
            process.join(30)
        assert [process.exitcode for process in ranks] == [0] * world, seen
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
                process.join()
    return seen


def failed_save(body: Callable[[], None]) -> dict[str, Any]:
    """What a rank's save raised (DCP's CheckpointException is a BaseException)."""
    try:
        body()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:
        return {"raised": type(exc).__name__, "text": str(exc), "errno": getattr(exc, "errno", None),
                "failed_ranks": sorted(getattr(exc, "failures", None) or {})}  # fmt: skip
    return {"raised": None}


def dcp_save(state: dict[str, Any], dest: Path, root: Path) -> None:
    """A single-process ``dcp.save`` (no process group) through safestage's writer."""
    from safestage.dcp import StagedWriter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is ... uninitialized": one process
        dcp.save(state, storage_writer=StagedWriter(dest, root))


def failed_dcp_save(state: dict[str, Any], dest: Path, root: Path) -> Path:
    """A ``dcp.save`` whose publish fails with ENOSPC; returns the kept save directory, after
    checking that the fault fired (ENOSPC recorded) and that DCP never wrote ``.metadata``."""
    with pytest.raises(BaseException) as raised:  # DCP's CheckpointException is a BaseException
        dcp_save(state, dest, root)
    assert "No space left on device" in str(raised.value) or "Errno 28" in str(raised.value), raised.value
    (save_dir,) = kept_save_dirs(root)
    record = json.loads((save_dir / KEPT_RECORD).read_bytes())
    assert record["destination"] == str(dest) and record["left"] == ["__0_0.distcp"], record
    assert "No space left" in (record["error"] or ""), record  # the fault fired: a real ENOSPC
    assert not (dest / ".metadata").exists() and not (dest / COMMIT_NAME).exists()
    return save_dir


# -- one rank's part of a DCP save -------------------------------------------------------------


@pytest.mark.regression("issue 24: recover committed one rank's part of a DCP save (no .metadata) as a complete checkpoint")
def test_recover_never_commits_the_part_of_a_single_process_dcp_save_that_a_failed_publish_kept(
    small_tmpfs: Path, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    dest = small_tmpfs / "step-2"
    failed_dcp_save({"w": torch.arange(BIG, dtype=torch.float32)}, dest, root)
    remount(small_tmpfs, "16m")  # the destination could take it now: only its nature may stop recover
    before_dest, before_root = tree(dest), tree(root)

    results = safestage.recover(root)

    assert [r.action for r in results] == ["refused"], results
    assert "DCP" in results[0].reason, results[0].reason
    assert tree(dest) == before_dest, "recover touched the destination"
    assert tree(root) == before_root, "recover touched the kept copy"
    assert not safestage.verify(dest).complete
    assert safestage.latest_complete(small_tmpfs, "step-*") != dest


@pytest.mark.regression("issue 24: after recover committed a DCP part, prune(keep=1) would remove the previous good checkpoint")
def test_the_good_checkpoint_before_a_failed_dcp_save_survives_recover_and_prune(
    small_tmpfs: Path, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    good = small_tmpfs / "step-1"
    dcp_save({"w": torch.arange(1024, dtype=torch.float32)}, good, root)  # fits: committed
    assert safestage.verify(good, deep=True).complete
    dest = small_tmpfs / "step-2"
    failed_dcp_save({"w": torch.arange(BIG, dtype=torch.float32)}, dest, root)
    remount(small_tmpfs, "16m")

    safestage.recover(root)
    removed = safestage.prune(small_tmpfs, keep=1, pattern="step-*")

    assert good not in removed and good.is_dir(), f"prune removed the good checkpoint: {removed}"
    assert safestage.verify(good, deep=True).complete
    assert safestage.latest_complete(small_tmpfs, "step-*") == good
    state = {"w": torch.zeros(1024)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=good)  # stock DCP still reads the good one
    assert torch.equal(state["w"], torch.arange(1024, dtype=torch.float32))


@pytest.mark.regression("issue 24: a 2-rank DCP save whose publishes failed; recover committed rank 0's lone part "
                        "and refused rank 1's with a wrong reason")
def test_recover_refuses_each_ranks_part_of_a_two_rank_dcp_save_naming_the_rank(
    small_tmpfs: Path, tmp_path: Path
) -> None:
    roots = [tmp_path / f"root-rank{rank}" for rank in (0, 1)]
    for root in roots:
        root.mkdir()
    dest = small_tmpfs / "step-5"

    def save(rank: int, world: int) -> dict[str, Any]:
        state = {f"own.{rank}": torch.arange(BIG, dtype=torch.float32) + rank}  # each rank's own
        return failed_save(lambda: dcp.save(state, storage_writer=safestage.dcp.StagedWriter(dest, roots[rank])))

    seen = run_ranks(save, 2, tmp_path / "store")
    for rank, raised in seen.items():  # the fault fired on both ranks: a real ENOSPC
        assert isinstance(raised, dict) and raised["raised"] == "CheckpointException", (rank, raised)
        assert raised["failed_ranks"] == [0, 1] and "Errno 28" in raised["text"], (rank, raised)
    assert [len(kept_save_dirs(root)) for root in roots] == [1, 1]
    assert not (dest / ".metadata").exists()
    remount(small_tmpfs, "16m")
    before_dest = tree(dest)

    for rank, root in enumerate(roots):
        results = safestage.recover(root)
        assert [r.action for r in results] == ["refused"], (rank, results)
        assert "DCP" in results[0].reason and f"rank {rank} of 2" in results[0].reason, (rank, results[0].reason)
        assert tree(dest) == before_dest, f"recover on rank {rank}'s root touched the destination"

    assert not safestage.verify(dest).complete
    assert safestage.latest_complete(small_tmpfs, "step-*") != dest


# -- a collective commit in a world of one rank ------------------------------------------------


@pytest.mark.regression("issue 24: a torchrun --nproc-per-node 1 job's staged_dir(group=WORLD) copy was refused as "
                        "'rank 0's part of a distributed commit of 1 ranks'")
def test_recover_commits_the_kept_copy_of_a_collective_commit_in_a_world_of_one_rank(
    small_tmpfs: Path, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    dest = small_tmpfs / "checkpoint-3"
    data = bytes(range(256)) * (12 << 10)  # 3 MiB: more than the 2 MiB tmpfs holds

    def commit(rank: int, world: int) -> dict[str, Any]:
        import torch.distributed as dist

        def body() -> None:
            with safestage.staged_dir(dest, root, group=dist.group.WORLD) as local:
                (local / "model.bin").write_bytes(data)
                (local / "state.json").write_text('{"step": 3}')

        return failed_save(body)

    (raised,) = run_ranks(commit, 1, tmp_path / "store").values()
    assert isinstance(raised, dict) and raised["raised"] == "PublishError", raised
    assert raised["errno"] == 28, raised  # the fault fired: a real ENOSPC
    (save_dir,) = kept_save_dirs(root)
    assert json.loads((save_dir / KEPT_RECORD).read_bytes())["destination"] == str(dest)
    assert not safestage.verify(dest).complete
    remount(small_tmpfs, "16m")

    results = safestage.recover(root)

    assert [r.action for r in results] == ["committed"], results
    assert safestage.verify(dest, deep=True).complete
    assert (dest / "model.bin").read_bytes() == data
    assert json.loads((dest / "state.json").read_text()) == {"step": 3}
    assert safestage.latest_complete(small_tmpfs) == dest
    assert kept_save_dirs(root) == []
