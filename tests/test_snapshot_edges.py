"""Background saves that return after a copy, at their edges: forked workers, a failure seen
early, dtypes torch pickles its own way, errors a synchronous save raises at the call, exit,
memory shared between tensors, the budget, Ctrl-C at exit (issue 26)."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch
from _support import PY, listing
from safetensors.torch import save_file

import safestage
from safestage import _snapshot


@pytest.fixture(autouse=True)
def _empty_pool() -> None:
    _snapshot.clear_pool()


class HeldWriter:
    """safetensors' serialize_file, waiting for ``release`` first (the deferred write)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.original = safetensors.torch.serialize_file
        self.go = threading.Event()
        monkeypatch.setattr(safetensors.torch, "serialize_file", self)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            assert self.go.wait(60), "the test never released the writer"
        return self.original(*args, **kwargs)


# -- fork ----------------------------------------------------------------------------------


def _save_shard(local: str) -> None:
    # Small: a forked child's first parallel torch op may hang in OpenMP (torch's, not ours).
    save_file({"w": torch.ones(64)}, str(Path(local) / "shard-1.safetensors"))


def test_a_forked_childs_save_into_a_background_staged_dir_lands_in_the_commit(
    tmp_path: Path, stage_root: Path
) -> None:
    """Shards written by forked workers (multiprocessing, fork) into the block's directory.
    A synchronous staged_dir commits both; the background one inherits _patch._deferring in
    the child, defers the child's write to a daemon thread that the child's os._exit kills,
    and the parent's commit (which waits only for its own deferred jobs) commits without it."""
    commit = safestage.staged_dir(tmp_path / "checkpoint-1", stage_root, background=True)
    with commit as local:
        save_file({"w": torch.zeros(16)}, str(local / "shard-0.safetensors"))
        child = multiprocessing.get_context("fork").Process(target=_save_shard, args=(str(local),))
        child.start()
        child.join(60)
        assert child.exitcode == 0
    manifest = commit.wait()
    assert sorted(entry.path for entry in manifest.files) == ["shard-0.safetensors", "shard-1.safetensors"]


# -- staged_dir(background=True) -----------------------------------------------------------


def test_a_failed_deferred_save_fails_the_commit_even_once_safestage_wait_raised_it(
    tmp_path: Path, small_tmpfs: Path
) -> None:
    """safestage.wait() inside the block (or from any other thread while it runs) marks the
    deferred save's error seen; Deferred.wait() (failures(deferred)) then finds no error and the
    checkpoint is committed without its weights: latest_complete names it."""
    (tmp_path / "run").mkdir()
    commit = safestage.staged_dir(tmp_path / "run" / "checkpoint-1", small_tmpfs, background=True)
    with commit as local:
        save_file({"weight": torch.ones(1024, 1024)}, str(local / "model.safetensors"))  # 4 MiB > 2 MiB root
        (local / "trainer_state.json").write_text("{}")
        with pytest.raises(safestage.StagingError):
            safestage.wait()  # e.g. a callback that waits for every background save
    with pytest.raises(safestage.StagingError):
        commit.wait()
    assert safestage.latest_complete(tmp_path / "run") is None


@pytest.mark.parametrize("way", ["safestage.wait", "no snapshot budget"])
def test_a_file_saved_in_a_background_block_is_there_after_safestage_wait_or_with_no_budget(
    tmp_path: Path, stage_root: Path, monkeypatch: pytest.MonkeyPatch, way: str
) -> None:
    """In a background block a save returns before its file is written (docs/asynchronous.md,
    pitfalls): code that renames or reads back what it saved calls safestage.wait() first, or
    runs with SAFESTAGE_SNAPSHOT_BUDGET=0 (each save written before it returns)."""
    if way == "no snapshot budget":
        monkeypatch.setenv("SAFESTAGE_SNAPSHOT_BUDGET", "0")
    commit = safestage.staged_dir(tmp_path / "checkpoint-1", stage_root, background=True)
    with commit as local:
        save_file({"w": torch.ones(64)}, str(local / "model.safetensors.tmp"))
        if way == "safestage.wait":
            safestage.wait()
        os.replace(local / "model.safetensors.tmp", local / "model.safetensors")
    assert [entry.path for entry in commit.wait().files] == ["model.safetensors"]


# -- torch.save of nested state ------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "float8_e8m0fnu"])
def test_a_background_torch_save_of_these_dtypes_writes_a_synchronous_saves_bytes(
    tmp_path: Path, stage_root: Path, dtype: str
) -> None:
    """torch pickles tensors of dtypes with no TypedStorage class (float8, uint16/32/64) through
    _rebuild_tensor_v3 with an UntypedStorage; copy_state's persistent_load hands that back as
    an UntypedStorage, torch.load wraps it: the save raises AttributeError at the call."""
    state = {"w": torch.ones(8).to(getattr(torch, dtype)), "step": 3}
    (tmp_path / "ref").mkdir()
    (tmp_path / "out").mkdir()
    torch.save(state, tmp_path / "ref" / "x.pt")
    with safestage.staged(stage_root, background=True, torch_save=True):
        torch.save(state, tmp_path / "out" / "x.pt")
    assert (tmp_path / "out" / "x.pt").read_bytes() == (tmp_path / "ref" / "x.pt").read_bytes()


def test_a_torch_save_that_torch_refuses_raises_at_the_call(tmp_path: Path, stage_root: Path) -> None:
    """torch.save refuses one storage viewed as two dtypes; copy_state does not check it, so the
    refusal comes from the worker (at close / wait / exit status 1) instead of the call."""
    flat = torch.arange(40.0)
    state = {"f": flat, "i": flat.view(torch.int32)}
    with pytest.raises(RuntimeError, match="view the same data as different types"):
        torch.save(state, tmp_path / "ref.pt")
    stage = safestage.activate(stage_root, background=True, torch_save=True)
    try:
        with pytest.raises(RuntimeError, match="view the same data as different types"):
            torch.save(state, tmp_path / "x.pt")
    finally:
        with contextlib.suppress(RuntimeError):
            stage.close()


# -- where failures are raised ---------------------------------------------------------------


def test_a_save_file_argument_error_raises_at_the_call(tmp_path: Path, stage_root: Path) -> None:
    """metadata={"step": 5} (an int): safetensors raises TypeError in serialize_file. Before
    issue 26 a background save serialized in the call and raised it there; now the call
    returns and the TypeError comes at close / wait / the commit / exit."""
    with pytest.raises(TypeError):
        save_file({"x": torch.ones(3)}, str(tmp_path / "ref.safetensors"), metadata={"step": 5})  # type: ignore[dict-item]
    stage = safestage.activate(stage_root, background=True)
    try:
        with pytest.raises(TypeError):
            save_file({"x": torch.ones(3)}, str(tmp_path / "x.safetensors"), metadata={"step": 5})  # type: ignore[dict-item]
    finally:
        with contextlib.suppress(TypeError):
            stage.close()


_EXIT_CHILD = """
import sys, torch, safestage
from pathlib import Path
base = Path(sys.argv[1])
safestage.activate(base / "root", background=True, torch_save=True)
torch.save({"w": torch.ones(1024, 256)}, base / "x.pt")
"""


def test_a_job_whose_last_act_is_a_background_torch_save_exits_0(tmp_path: Path) -> None:
    """Exit waits for safestage's workers to be gone, not only for their jobs: a worker frees
    the copy's storages a moment after its job finished, and an interpreter that finalized
    torch under it ended with SIGABRT ('terminate called without an active exception', 134)."""
    (tmp_path / "root").mkdir()
    codes = []
    for _ in range(8):
        child = subprocess.run([PY, "-c", _EXIT_CHILD, str(tmp_path)], capture_output=True, text=True, timeout=120)
        codes.append((child.returncode, child.stderr.strip()[-80:]))
        assert torch.equal(torch.load(tmp_path / "x.pt")["w"], torch.ones(1024, 256))
        if child.returncode:
            break
    assert all(code == 0 for code, _ in codes), codes


# -- the budget ------------------------------------------------------------------------------

_threads: list[str] = []


class Probe:
    """Records the thread that pickles it."""

    def __reduce__(self) -> Any:
        _threads.append(threading.current_thread().name)
        return (Probe, ())


@pytest.mark.parametrize("budget", [0, "1KiB"])
def test_a_torch_save_over_the_budget_is_serialized_in_the_call(
    tmp_path: Path, stage_root: Path, budget: Any
) -> None:
    """snapshot_budget=0 ("no copies") or a budget far smaller than the state: a torch.save
    whose state holds no tensor storage (numpy arrays, lists, bytes) counts what it pickles
    against the budget too, and is serialized in the call."""
    _threads.clear()
    state = {"probe": Probe(), "big": np.zeros(1 << 18)}  # 2 MiB of numpy > 1 KiB
    with safestage.staged(stage_root, background=True, torch_save=True, snapshot_budget=budget):
        torch.save(state, tmp_path / "x.pt")
    # Serialized in the call; with a budget its objects are pickled once more to size them.
    assert set(_threads) == {"MainThread"} and len(_threads) == (1 if budget == 0 else 2), _threads


# -- byte for byte what a synchronous save does ----------------------------------------------


@pytest.mark.parametrize("case", ["tied", "view"])
def test_tensors_sharing_memory_are_refused_as_a_synchronous_save_refuses_them(
    tmp_path: Path, stage_root: Path, monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """The pinned-copy path of CUDA tensors (run on the CPU through the HOST_DEVICES hook, as
    tests/test_snapshot_saves.py does): to_host gives every tensor a storage of its own before
    safetensors' _flatten_as_ptr checks for shared memory, so tied CUDA weights saved with
    save_file (which safetensors refuses) are written twice instead. Any save_file while a
    background staged_dir is open takes that path, staged or not."""
    monkeypatch.setattr(_snapshot, "HOST_DEVICES", ("cpu",))
    weight = torch.randn(8, 8)
    tensors = {"a": weight, "b": weight} if case == "tied" else {"a": weight, "b": weight[0]}
    with pytest.raises(RuntimeError, match="share memory"):
        save_file(tensors, str(tmp_path / "ref.safetensors"))
    with safestage.staged(stage_root, background=True), pytest.raises(RuntimeError, match="share memory"):
        save_file(tensors, str(tmp_path / "x.safetensors"))


# -- kills and Ctrl-C ------------------------------------------------------------------------

_CTRL_C_CHILD = """
import sys, time, torch, safestage, safetensors.torch as st
from pathlib import Path
base = Path(sys.argv[1])
original = st.serialize_file
def slow(specs, filename, *args, **kwargs):
    if "model-2" in str(filename):
        time.sleep(8)
    return original(specs, filename, *args, **kwargs)
st.serialize_file = slow
commit = safestage.staged_dir(base / "run" / "checkpoint-1", base / "root", background=True)
with commit as local:
    st.save_file({"w": torch.ones(64)}, str(local / "model-1.safetensors"))
    st.save_file({"w": torch.ones(64)}, str(local / "model-2.safetensors"))
print("returned", flush=True)
"""


def test_ctrl_c_at_exit_never_names_an_incomplete_copy_as_complete(tmp_path: Path) -> None:
    """Ctrl-C while exit waits for a background staged_dir whose deferred save is not written
    yet: status 130 (held), but the message says 'the complete staged copy is kept at <local>'
    while model-2 is missing there and the directory is marked disposable (the commit job was
    handed off with kept=commit.local before its saves were written)."""
    (tmp_path / "root").mkdir()
    (tmp_path / "run").mkdir()
    child = subprocess.Popen([PY, "-c", _CTRL_C_CHILD, str(tmp_path)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    assert child.stdout is not None and child.stdout.readline().strip() == "returned"
    threading.Event().wait(1.0)
    child.send_signal(signal.SIGINT)
    _, stderr = child.communicate(timeout=60)
    assert child.returncode == 130, stderr
    kept = [line for line in stderr.splitlines() if "complete staged copy is kept at" in line]
    for line in kept:
        local = Path(line.rsplit(" kept at ", 1)[1].strip())
        assert sorted(listing(local)) == ["model-1.safetensors", "model-2.safetensors"], (line, listing(local))


def test_a_background_torch_save_of_the_trainers_rng_state_loads_as_a_synchronous_save(
    tmp_path: Path, stage_root: Path
) -> None:
    """The transformers Trainer's rng_state.pth: the values a synchronous save loads. (Not the
    same bytes: pickle writes a reference where it meets the same object again, and a copy
    made by pickling makes equal objects one, or the reverse; tensor state keeps its bytes,
    test_snapshot_saves.py.)"""
    import random

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    (tmp_path / "ref").mkdir()
    (tmp_path / "out").mkdir()
    torch.save(state, tmp_path / "ref" / "rng_state.pth")
    with safestage.staged(stage_root, background=True, torch_save=True):
        torch.save(state, tmp_path / "out" / "rng_state.pth")
        random.random(), np.random.random(), torch.rand(1)  # the next step moves every generator
    ref = torch.load(tmp_path / "ref" / "rng_state.pth", weights_only=False)
    out = torch.load(tmp_path / "out" / "rng_state.pth", weights_only=False)
    assert out["python"] == ref["python"] and torch.equal(out["cpu"], ref["cpu"])
    assert all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b for a, b in zip(out["numpy"], ref["numpy"]))
