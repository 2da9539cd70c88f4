"""The files that make a stock reader trust a checkpoint directory (Lightning's ``meta.pt``,
DCP's ``.metadata``) land only after every file of every rank: a collective re-save killed
while a rank's data is still publishing never leaves a directory that Lightning or ``dcp.load``
takes for a checkpoint over a mix of old and new data.

A real 2-rank job (gloo on CPU) saves as Lightning's FSDP strategy does under the switch
(tests/trust_files_worker.py) onto the kit's HDFS-like mount, throttled so that rank 1's
shard takes about a second to publish; the test SIGKILLs both ranks of the re-save at a fixed
point: rank 1's new shard half-way to the destination (under the order before the fix rank 0's
small files, ``meta.pt`` and ``.metadata`` with them, had landed by then)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import safestage
from safestage import COMMIT_NAME
from safestage.testing import hostile_mount
from tests._two_nodes import free_port

WORKER = Path(__file__).with_name("trust_files_worker.py")
BIG = 6 * 1024 * 1024  # floats of rank 1's shard: 24 MiB, about 1.2 s at the mount's 20 MB/s
MBPS = 20.0


def _start(dest: Path, root: Path, results: Path) -> list[subprocess.Popen[bytes]]:
    """The two ranks, each its own session (killed as a whole), its stderr in ``results``."""
    port = free_port()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}  # fmt: skip
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), *filter(None, [env.get("PYTHONPATH")])])
    procs = []
    for rank in (0, 1):
        with (results / f"stderr-{rank}").open("wb") as stderr:  # the child holds its own copy
            procs.append(subprocess.Popen([sys.executable, str(WORKER), str(dest), str(root), str(results), str(BIG)],
                                          env={**env, "RANK": str(rank)}, start_new_session=True,
                                          stdout=subprocess.DEVNULL, stderr=stderr))  # fmt: skip
    return procs


def _wait_for(condition: object, what: str, procs: list[subprocess.Popen[bytes]], results: Path,
              timeout: float = 120.0) -> None:  # fmt: skip
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        dead = [proc for proc in procs if proc.poll() is not None]
        if dead or time.monotonic() > deadline:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
            errors = "\n".join((results / f"stderr-{rank}").read_text(errors="replace") for rank in (0, 1))
            pytest.fail(f"the job never got to {what}: {errors[-3000:]}")
        time.sleep(0.01)


def _in_flight(dest: Path, before: set[str]) -> bool:
    """The big shard is at least half-way to the destination: its temp file there (a hidden
    name; the kit's hdfs can rename, so a file is published as a temp renamed into place)."""
    with os.scandir(dest) as listing:
        for entry in listing:
            if entry.name in before or not entry.name.startswith("."):
                continue
            with contextlib.suppress(FileNotFoundError):  # renamed into place meanwhile
                if entry.is_file() and entry.stat().st_size >= BIG * 4 // 2:
                    return True
    return False


@pytest.mark.slow
@pytest.mark.mounts
@pytest.mark.regression("issue 30 item 4: a Lightning re-save killed mid-publish left new meta.pt/.metadata over old data")
def test_a_collective_resave_killed_while_a_rank_publishes_leaves_nothing_a_stock_reader_trusts(tmp_path: Path) -> None:
    # What Lightning's load asks of a directory: a sharded checkpoint (meta.pt) or not.
    from lightning.fabric.strategies.fsdp import _is_sharded_checkpoint

    results = tmp_path / "results"
    results.mkdir()
    with hostile_mount("hdfs", tmp_path / "mnt", mbps=MBPS) as mount:
        dest = Path(mount.path) / "last.ckpt"
        procs = _start(dest, tmp_path / "roots", results)
        try:
            _wait_for(lambda: all((results / f"saved-1-rank{rank}").exists() for rank in (0, 1)), "step 1", procs, results)
            assert safestage.verify(dest).complete
            before = set(os.listdir(dest))
            (results / "go").write_text("")
            _wait_for(lambda: _in_flight(dest, before), "rank 1's re-save half-way", procs, results)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        assert all(proc.returncode == -signal.SIGKILL for proc in procs), "the kill did not fire"
        assert not (results / "saved-2-rank0").exists()
        names = set(os.listdir(dest))
        assert COMMIT_NAME not in names and not safestage.verify(dest).complete
        # What Lightning's ckpt_path= does with the directory: a sharded checkpoint if meta.pt is
        # there (then dcp.load and meta.pt's step), else not a checkpoint at all.
        trusted = [name for name in ("meta.pt", ".metadata") if name in names]
        assert not _is_sharded_checkpoint(dest) and not trusted, (
            f"a re-save killed while rank 1's shard was publishing left {trusted} in {sorted(names)}: "
            f"{_what_a_reader_loads(dest)}"
        )
        with pytest.raises(CheckpointException, match=r"\.metadata"):  # stock DCP: not a checkpoint
            dcp.load({"own.0": torch.zeros(64)}, checkpoint_id=str(dest))


def _what_a_reader_loads(dest: Path) -> str:
    """What a stock reader gets from the directory (for the failure message)."""
    try:
        state = {"own.0": torch.zeros(64), "own.1": torch.zeros(BIG)}
        dcp.load(state, checkpoint_id=str(dest))
        step = torch.load(dest / "meta.pt")["step"] if (dest / "meta.pt").exists() else None
        return (f"Lightning loads it as step {step}: rank 0's shard at step {state['own.0'][0].item():g}, "
                f"rank 1's at step {state['own.1'][0].item():g}")  # fmt: skip
    except (Exception, CheckpointException) as exc:
        return f"dcp.load raises {exc!r}"


@pytest.mark.mounts
@pytest.mark.regression("issue 30 item 4: the trust files were published two at a time beside the largest data file")
def test_a_single_process_commit_publishes_no_trust_file_while_its_data_is_landing(tmp_path: Path, stage_root: Path) -> None:
    """The same order in a world of one (``staged_dir`` of a DCP save and ``meta.pt``): while the
    data file is half-way to the destination, no trust file of the re-save is there."""
    import threading

    seen: list[set[str]] = []
    with hostile_mount("hdfs", tmp_path / "mnt", mbps=MBPS) as mount:
        dest = Path(mount.path) / "last.ckpt"
        for step in (1, 2):
            before = set(os.listdir(dest)) if dest.exists() else set()
            stop = threading.Event()

            def watch(before: set[str] = before, stop: threading.Event = stop) -> None:
                while not stop.is_set():
                    with contextlib.suppress(FileNotFoundError):
                        if _in_flight(dest, before):
                            seen.append(set(os.listdir(dest)))
                            return
                    time.sleep(0.005)

            watcher = threading.Thread(target=watch)
            watcher.start()
            try:
                with safestage.staged_dir(dest, stage_root) as local:
                    dcp.save({"own.1": torch.full((BIG,), float(step))}, checkpoint_id=str(local))
                    torch.save({"step": step}, local / "meta.pt")
            finally:
                stop.set()
                watcher.join()
            assert len(seen) == step, "the watcher never saw the data file half-way: it tested nothing"
            trusted = {"meta.pt", ".metadata"} & seen[-1]
            assert not trusted, f"save {step}: {sorted(trusted)} at the destination while the data was landing: {sorted(seen[-1])}"
        assert safestage.verify(dest, deep=True).complete


@pytest.mark.mounts
@pytest.mark.regression("issue 30 review: a re-save that could not remove the old meta.pt (EIO) said it could not "
                        "remove the commit file and that 'the previous commit is untouched', which was gone")
def test_a_resave_that_cannot_remove_an_old_trust_file_says_the_previous_commit_file_is_gone(
    tmp_path: Path, stage_root: Path
) -> None:
    import errno

    from safestage import PublishError

    backing = tmp_path / "backing"
    backing.mkdir()
    with safestage.staged_dir(backing / "last.ckpt", stage_root) as local:
        (local / "data.bin").write_bytes(b"1" * 100)
        torch.save({"step": 1}, local / "meta.pt")
    with hostile_mount("passthrough", tmp_path / "mnt", backing=backing,
                       lookup_errors={"meta.pt": errno.EIO}) as mount:  # fmt: skip
        dest = Path(mount.path) / "last.ckpt"
        with pytest.raises(PublishError) as raised, safestage.staged_dir(dest, stage_root) as local:
            (local / "data.bin").write_bytes(b"2" * 100)
        assert mount.faults()["lookup"] >= 1, "the EIO never fired"
    assert not (backing / "last.ckpt" / COMMIT_NAME).exists()  # the commit file went first, as it must
    error = raised.value
    assert error.errno == errno.EIO and error.step == "invalidate"
    assert "meta.pt" in str(error) and "untouched" not in str(error), str(error)
    assert "previous commit file was removed" in str(error), str(error)


@pytest.mark.mounts
@pytest.mark.regression("issue 30 review: a re-save of transformers' pytorch_model.bin.index.json (or diffusers' "
                        "index) killed mid-publish left the new index over a mix of old and new shards")
@pytest.mark.parametrize("index", ["pytorch_model.bin.index.json", "unet/diffusion_pytorch_model.safetensors.index.json"])
def test_every_huggingface_index_lands_after_the_shards_and_goes_before_them(
    tmp_path: Path, stage_root: Path, index: str
) -> None:
    """While the largest shard of a save is half-way to the destination, no index of the save is
    there, neither the re-save's nor the previous one's (transformers and diffusers load the
    shards an index names, whatever they hold)."""
    import json
    import threading

    folder = index.rpartition("/")[0]
    shard = f"{folder}/shard-00001.bin" if folder else "shard-00001.bin"
    seen: list[set[str]] = []
    with hostile_mount("hdfs", tmp_path / "mnt", mbps=MBPS) as mount:
        dest = Path(mount.path) / "checkpoint-1"
        watched = dest / folder if folder else dest
        for step in (1, 2):
            before = set(os.listdir(watched)) if watched.exists() else set()
            stop = threading.Event()

            def watch(before: set[str] = before, stop: threading.Event = stop) -> None:
                while not stop.is_set():
                    with contextlib.suppress(FileNotFoundError):
                        if _in_flight(watched, before):
                            seen.append(set(os.listdir(watched)))
                            return
                    time.sleep(0.005)

            watcher = threading.Thread(target=watch)
            watcher.start()
            try:
                with safestage.staged_dir(dest, stage_root) as local:
                    (local / shard).parent.mkdir(exist_ok=True)
                    (local / shard).write_bytes(bytes([step]) * (BIG * 4))
                    (local / index).write_text(json.dumps({"weight_map": {"w": "shard-00001.bin"}, "step": step}))
            finally:
                stop.set()
                watcher.join()
            assert len(seen) == step, "the watcher never saw the shard half-way: it tested nothing"
            name = index.rpartition("/")[2]
            assert name not in seen[-1], f"save {step}: {name} at the destination while a shard was landing"
        assert safestage.verify(dest, deep=True).complete
