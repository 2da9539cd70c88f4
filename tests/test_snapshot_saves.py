"""Background saves return once the state is copied (issue 26): what lands is the state at the
call, byte for byte what a synchronous save writes; memory stays within the budget; failures
and kills leave what they left before."""

from __future__ import annotations

import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from _support import PY, listing, mode_of
from safetensors.torch import load_file, save_file

import safestage
from safestage import _snapshot


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "weight": torch.randn(256, 129, generator=generator),
        "bias.bf16": torch.randn(257, generator=generator).to(torch.bfloat16),
        "codes.int8": torch.randint(-128, 127, (31, 7), dtype=torch.int8, generator=generator),
        "scale": torch.tensor(0.125),
        "empty": torch.zeros(0, 4),
    }


def _scribble(tensors: dict[str, torch.Tensor]) -> None:
    """What a training step does to the state right after the save returned: in place."""
    for tensor in tensors.values():
        if tensor.numel():
            tensor.fill_(7)


class Writer:
    """safetensors' serialize_file, recording the thread each file is written on (and, when
    ``hold`` is set, waiting for it first): safestage wraps whatever the global is."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.original = safetensors.torch.serialize_file
        self.threads: list[str] = []
        self.hold = threading.Event()
        self.hold.set()
        monkeypatch.setattr(safetensors.torch, "serialize_file", self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.threads.append(threading.current_thread().name)
        assert self.hold.wait(60), "the test never released the writer"
        return self.original(*args, **kwargs)


@pytest.fixture
def writer(monkeypatch: pytest.MonkeyPatch) -> Writer:
    return Writer(monkeypatch)


@pytest.fixture(autouse=True)
def _empty_pool() -> None:
    _snapshot.clear_pool()


def test_a_background_save_returns_before_serializing_and_lands_the_state_at_the_call(
    tmp_path: Path, stage_root: Path, writer: Writer
) -> None:
    tensors = _state()
    (tmp_path / "ref").mkdir()
    save_file(tensors, str(tmp_path / "ref" / "model.safetensors"), metadata={"format": "pt"})
    dest = tmp_path / "out" / "model.safetensors"
    dest.parent.mkdir()
    with safestage.staged(stage_root, background=True):
        save_file(tensors, str(dest), metadata={"format": "pt"})
        _scribble(tensors)
        del tensors  # the caller may free its tensors as soon as the call returns
    assert writer.threads[0] == "MainThread"  # the reference, unstaged
    assert writer.threads[1].startswith("safestage-"), writer.threads  # serialized on a worker
    assert dest.read_bytes() == (tmp_path / "ref" / "model.safetensors").read_bytes()
    assert listing(dest.parent) == ["model.safetensors"] and mode_of(dest) == 0o644
    assert listing(stage_root) == []


def _training_state() -> tuple[dict[str, Any], torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    flat = torch.arange(40, dtype=torch.float32)
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "rng": torch.get_rng_state(),
        "epoch": 3,
        "note": "epoch three",
        "window": flat[10:20],  # a view: stored with its base, once
        "flat": flat,
        "history": [0.5, 0.25],
    }
    return state, optimizer


def test_a_background_torch_save_of_nested_state_writes_the_bytes_of_a_synchronous_save(
    tmp_path: Path, stage_root: Path
) -> None:
    state, optimizer = _training_state()
    (tmp_path / "ref").mkdir()
    torch.save(state, tmp_path / "ref" / "trainer.pt")  # the archive is named after the file
    dest = tmp_path / "out" / "trainer.pt"
    dest.parent.mkdir()
    with safestage.staged(stage_root, background=True, torch_save=True):
        torch.save(state, dest)
        # The next step, right away: moments and weights in place, numbers and lists too.
        optimizer.step()
        for tensor in state["model"].values():
            tensor.add_(1)
        state["flat"].fill_(-1)
        state["history"].append(0.125)
        state["optimizer"]["param_groups"][0]["lr"] = 0.5
    assert dest.read_bytes() == (tmp_path / "ref" / "trainer.pt").read_bytes()
    loaded = torch.load(dest, weights_only=False)
    assert loaded["history"] == [0.5, 0.25] and loaded["optimizer"]["param_groups"][0]["lr"] == 1e-3
    assert loaded["window"].untyped_storage().data_ptr() == loaded["flat"].untyped_storage().data_ptr()


def test_a_torch_save_of_an_object_that_cannot_be_pickled_raises_at_the_call(
    tmp_path: Path, stage_root: Path
) -> None:
    dest = tmp_path / "state.pt"
    with safestage.staged(stage_root, background=True, torch_save=True):
        with pytest.raises((AttributeError, TypeError, Exception)) as raised:
            torch.save({"weight": torch.ones(3), "hook": lambda: None}, dest)
    assert "pickle" in str(raised.value).lower() or "lambda" in str(raised.value)
    assert listing(tmp_path) == ["stage-root"] and listing(stage_root) == []


def test_the_next_save_waits_for_the_oldest_to_land_once_the_budget_is_held(
    tmp_path: Path, stage_root: Path, writer: Writer
) -> None:
    tensors = _state()
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    writer.hold.clear()  # the first save's serialization waits: its copy stays held
    finished: list[str] = []
    with safestage.staged(stage_root, background=4, snapshot_budget=size + size // 2):
        save_file(tensors, str(tmp_path / "first.safetensors"))
        in_use, _ = _snapshot.pooled_bytes()
        assert size <= in_use < size + 4096
        second = threading.Thread(
            target=lambda: (save_file(tensors, str(tmp_path / "second.safetensors")), finished.append("second"))
        )
        second.start()
        second.join(1.0)
        assert finished == [] and second.is_alive(), "a second copy would pass the budget"
        assert _snapshot.pooled_bytes()[0] == in_use
        writer.hold.set()
        second.join(60)
        assert finished == ["second"]
    assert load_file(str(tmp_path / "second.safetensors")).keys() == tensors.keys()
    in_use, free = _snapshot.pooled_bytes()
    assert in_use == 0 and free <= size + size // 2  # one buffer, reused by the second save


@pytest.mark.mounts
def test_a_root_that_holds_one_copy_at_a_time_takes_background_saves_one_after_another(
    tmp_path: Path, writer: Writer
) -> None:
    """Room is checked at the call, when no copy is written yet: the second worker finds the
    root full of the first one's copy and waits for it to be published, never ENOSPC."""
    from safestage.testing import hostile_mount

    root = tmp_path / "root"
    root.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=14m,mode=0700", "tmpfs", str(root)], check=True)
    shards = [{"w": torch.full(((9 << 20) // 4,), float(i))} for i in range(3)]
    try:
        with hostile_mount("slow", tmp_path / "mnt", mbps=40) as mount:
            dest = Path(mount.path)
            writer.hold.clear()  # the first copy is written once the second save has returned
            with safestage.staged(root, background=2) as stage:
                for i, shard in enumerate(shards):
                    save_file(shard, str(dest / f"shard-{i}.safetensors"))
                    shard["w"].fill_(-1.0)
                    if i == 1:
                        writer.hold.set()
            for i in range(3):
                assert bool(load_file(str(dest / f"shard-{i}.safetensors"))["w"].eq(float(i)).all())
            assert listing(dest) == [f"shard-{i}.safetensors" for i in range(3)] and len(stage.records) == 3
    finally:
        subprocess.run(["umount", "-l", str(root)], check=False)


def test_a_state_bigger_than_the_budget_is_serialized_before_the_call_returns(
    tmp_path: Path, stage_root: Path, writer: Writer
) -> None:
    tensors = _state()
    with safestage.staged(stage_root, background=True, snapshot_budget="1KiB"):
        save_file(tensors, str(tmp_path / "model.safetensors"))
        assert writer.threads == ["MainThread"]
        _scribble(tensors)
    assert load_file(str(tmp_path / "model.safetensors"))["weight"].ne(7).any()
    assert _snapshot.pooled_bytes() == (0, 0)


def test_buffers_are_reused_across_checkpoints(tmp_path: Path, stage_root: Path) -> None:
    tensors = _state()
    with safestage.staged(stage_root, background=True) as stage:
        for step in range(3):
            save_file(tensors, str(tmp_path / f"step-{step}.safetensors"))
            safestage.wait()
            _scribble(tensors)
        assert len(stage.records) == 3
    in_use, free = _snapshot.pooled_bytes()
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    assert in_use == 0 and size <= free < size + 4096  # one buffer for three checkpoints


def test_a_failed_background_serialization_is_raised_at_close_and_the_old_file_stays(
    tmp_path: Path, small_tmpfs: Path
) -> None:
    dest = tmp_path / "state.pt"
    torch.save({"old": torch.zeros(4)}, dest)
    big = {"weight": torch.ones(1024, 1024)}  # 4 MiB: more than the 2 MiB staging root holds
    stage = safestage.activate(small_tmpfs, background=True, torch_save=True)
    try:
        torch.save(big, dest)  # torch.save's size is unknown before it writes: it returns
    finally:
        with pytest.raises(safestage.StagingError) as raised:
            stage.close()
    assert raised.value.errno == 28 and str(small_tmpfs) in str(raised.value)
    assert torch.equal(torch.load(dest)["old"], torch.zeros(4)) and listing(tmp_path) == ["state.pt", "tiny"]


def test_a_background_staged_dir_block_returns_before_its_saves_are_written(
    tmp_path: Path, stage_root: Path, writer: Writer
) -> None:
    tensors = _state()
    expected = {name: tensor.clone() for name, tensor in tensors.items()}
    writer.hold.clear()
    commit = safestage.staged_dir(tmp_path / "checkpoint-1", stage_root, background=True)
    with commit as local:
        save_file(tensors, str(local / "model.safetensors"))
        _scribble(tensors)
    assert not commit.done()  # the save is still waiting to be written: so is the commit
    writer.hold.set()
    manifest = commit.wait()
    assert writer.threads[0].startswith("safestage-")
    assert [entry.path for entry in manifest.files] == ["model.safetensors"]
    loaded = load_file(str(tmp_path / "checkpoint-1" / "model.safetensors"))
    assert all(torch.equal(loaded[name], expected[name]) for name in expected)
    assert safestage.verify(tmp_path / "checkpoint-1", deep=True).problems == []
    assert safestage.latest_complete(tmp_path) == tmp_path / "checkpoint-1"


def test_a_deferred_save_that_fails_fails_its_commit_and_commits_nothing(
    tmp_path: Path, small_tmpfs: Path
) -> None:
    commit = safestage.staged_dir(tmp_path / "checkpoint-1", small_tmpfs, background=True)
    with commit as local:
        save_file({"weight": torch.ones(1024, 1024)}, str(local / "model.safetensors"))  # 4 MiB
    with pytest.raises(safestage.StagingError) as raised:
        commit.wait()
    assert raised.value.errno == 28 and "staging root is full" in str(raised.value), raised.value
    assert safestage.latest_complete(tmp_path) is None
    assert not (tmp_path / "checkpoint-1" / "_SAFESTAGE_COMMIT.json").exists()
    assert listing(small_tmpfs) == []


_KILLED_CHILD = """
import os, signal, sys, time, torch
import safestage
from safetensors.torch import save_file
dest, root, delay = sys.argv[1], sys.argv[2], float(sys.argv[3])
state = {"weight": torch.full((4096, 4096), 2.0)}  # 64 MiB
safestage.activate(root, background=True)
save_file(state, dest)
state["weight"].fill_(3.0)
time.sleep(delay)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.3])
def test_a_kill_during_a_background_save_leaves_the_old_file_or_the_new_one(
    tmp_path: Path, stage_root: Path, delay: float
) -> None:
    dest = tmp_path / "model.safetensors"
    save_file({"weight": torch.full((4, 4), 1.0)}, str(dest))
    child = subprocess.run([PY, "-c", _KILLED_CHILD, str(dest), str(stage_root), str(delay)],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    assert child.returncode == -signal.SIGKILL, child.stderr
    weight = load_file(str(dest))["weight"]
    assert (weight.shape == (4, 4) and bool(weight.eq(1.0).all())) or (
        weight.shape == (4096, 4096) and bool(weight.eq(2.0).all())
    )
    # Beside it at most what a kill during a publish leaves today: a hidden temp file.
    others = [name for name in listing(tmp_path) if name not in ("stage-root", "model.safetensors")]
    assert all(name.startswith(".") for name in others), others


def test_lightning_background_save_checkpoint_returns_after_the_copy(
    tmp_path: Path, stage_root: Path
) -> None:
    from safestage.lightning import StagedCheckpointIO

    state, optimizer = _training_state()
    plugin = StagedCheckpointIO(root=stage_root, background=True)
    plugin.save_checkpoint(state, tmp_path / "epoch=0.ckpt")
    optimizer.step()
    state["flat"].fill_(-1)
    state["epoch"] = 4
    plugin.teardown()
    loaded = torch.load(tmp_path / "epoch=0.ckpt", weights_only=False)
    assert loaded["epoch"] == 3 and torch.equal(loaded["flat"], torch.arange(40, dtype=torch.float32))


def test_tensors_copied_before_safetensors_flattens_them_are_the_copy_the_save_keeps(
    tmp_path: Path, stage_root: Path, writer: Writer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pinned-memory path of CUDA tensors, run with CPU tensors on a machine without a
    GPU: one copy per save (the pool holds one buffer of the state's size), the bytes of a
    synchronous save, written on a worker."""
    monkeypatch.setattr(_snapshot, "HOST_DEVICES", ("cpu",))
    tensors = _state()
    (tmp_path / "ref").mkdir()
    save_file(tensors, str(tmp_path / "ref" / "model.safetensors"))
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    with safestage.staged(stage_root, background=True):
        save_file(tensors, str(tmp_path / "model.safetensors"))
        _scribble(tensors)
    assert writer.threads[1].startswith("safestage-")
    assert (tmp_path / "model.safetensors").read_bytes() == (tmp_path / "ref" / "model.safetensors").read_bytes()
    in_use, free = _snapshot.pooled_bytes()
    assert in_use == 0 and size <= free < size + 4096, (size, free)  # one copy, not two


def test_a_background_staged_dir_defers_its_torch_saves_without_torch_save_staging(
    tmp_path: Path, stage_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The optimizer's torch.save into the block's local directory returns after the copy too
    (no torch_save stage is open), and torch.save elsewhere is untouched meanwhile."""
    import torch.serialization

    original, threads = torch.serialization.save, []

    def recording_save(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread().name)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch.serialization, "save", recording_save)
    monkeypatch.setattr(torch, "save", recording_save)
    state, optimizer = _training_state()
    (tmp_path / "ref").mkdir()
    torch.save(state, tmp_path / "ref" / "optimizer.pt")
    commit = safestage.staged_dir(tmp_path / "checkpoint-1", stage_root, background=True)
    with commit as local:
        torch.save(state, local / "optimizer.pt")
        torch.save({"elsewhere": 1}, tmp_path / "elsewhere.pt")  # not the block's: as it is
        optimizer.step()
        state["flat"].fill_(-1)
    commit.wait()
    # The reference and the save elsewhere on this thread; the block's save on a worker.
    assert threads.count("MainThread") == 2 and len(threads) == 3, threads
    assert [name for name in threads if name != "MainThread"][0].startswith("safestage-"), threads
    assert (tmp_path / "checkpoint-1" / "optimizer.pt").read_bytes() == (tmp_path / "ref" / "optimizer.pt").read_bytes()
    assert torch.load(tmp_path / "elsewhere.pt") == {"elsewhere": 1}
    assert torch.save is recording_save and torch.serialization.save is recording_save  # restored
