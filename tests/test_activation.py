"""Activation: staged()/activate() patch safetensors' writer process-wide, for every thread, and restore the original exactly (nesting, overlapping, decorators, wrappers on top)."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _support import (
    arange_tensors,
    assert_loads_equal,
    equal,
    filled_tensors,
    listing,
    loads_as,
    run_threads,
    version,
)
from safetensors.torch import load_file, save_file

import safestage
from safestage import _patch
from safestage.testing import hostile_mount


def test_activations_entered_and_exited_in_overlapping_order(tmp_path, shm_root, restored):
    """Four threads open and close their own stages in random overlapping order, saving inside;
    a fifth saves all the while without opening any. Each stage gets exactly its own thread's
    saves; every file is complete; at the end everything is unpatched."""
    directory = tmp_path / "dest"
    directory.mkdir()
    rounds = 6
    mine: dict[int, list[list[str]]] = {t: [] for t in range(4)}
    stop_free = threading.Event()
    free_saves: list[str] = []

    def activator(thread: int) -> Any:
        rng = random.Random(thread)

        def run() -> None:
            for round_ in range(rounds):
                with safestage.staged(shm_root) as stage:
                    threading.Event().wait(rng.uniform(0, 0.004))  # let the others overlap
                    name = f"a{thread}-{round_}.safetensors"
                    save_file(version(10 * thread + round_, 4096), str(directory / name))
                    threading.Event().wait(rng.uniform(0, 0.004))
                received = [r.destination.name for r in stage.records]
                mine[thread].append(received)
                # Its own save, plus any the free saver made while this was the innermost stage.
                assert received.count(name) == 1, received
                assert all(n == name or n.startswith("free-") for n in received), (
                    f"a stage received another activating thread's save: {received}"
                )

        return run

    def free_saver() -> None:
        index = 0
        while not stop_free.is_set():
            name = f"free-{index}.safetensors"
            save_file(version(5000 + index, 4096), str(directory / name))
            free_saves.append(name)
            index += 1

    free = threading.Thread(target=lambda: run_threads([free_saver]))
    free.start()
    try:
        run_threads([activator(t) for t in range(4)])
    finally:
        stop_free.set()
        free.join(60)
    assert not free.is_alive()
    for thread in range(4):
        for round_ in range(rounds):
            loaded = load_file(str(directory / f"a{thread}-{round_}.safetensors"))
            assert equal(loaded, version(10 * thread + round_, 4096))
    for index, name in enumerate(free_saves):
        assert equal(load_file(str(directory / name)), version(5000 + index, 4096))
    assert sorted(os.listdir(directory)) == sorted(
        [f"a{t}-{r}.safetensors" for t in range(4) for r in range(rounds)] + free_saves
    ), "a lost file or a leftover temp"
    staged_free = [
        n
        for records in mine.values()
        for received in records
        for n in received
        if n.startswith("free-")
    ]
    assert len(staged_free) == len(set(staged_free)), "a save was recorded twice"
    assert os.listdir(shm_root) == []
    assert _patch._active == []


@pytest.mark.mounts
def test_a_stage_closed_by_another_thread_mid_save_still_publishes_completely(
    tmp_path, shm_root, restored
):
    """Thread A's stage ends (the last one: the patch is removed) while thread B is inside a
    save staged through it: B's file must still land complete, and A's records say so."""
    from safestage.testing import hostile_mount

    with hostile_mount("slow", None, mbps=20) as slow:
        dest = Path(slow.path) / "model.safetensors"
        handle = safestage.activate(shm_root)
        saving = threading.Thread(target=save_file, args=(version(3, 1 << 20), str(dest)))
        saving.start()
        for _ in range(2000):  # until B's copy to the slow mount has begun
            if any(n.startswith(".model.safetensors.") for n in os.listdir(slow.path)):
                break
            threading.Event().wait(0.001)
        handle.close()  # from this thread, while B publishes
        assert not safestage.is_active()
        saving.join(60)
        assert equal(load_file(str(dest)), version(3, 1 << 20))
        assert [r.destination for r in handle.records] == [dest]
        assert os.listdir(slow.path) == ["model.safetensors"]
    assert os.listdir(shm_root) == []


def test_module_that_bound_save_file_before_activation_is_staged(tmp_path, shm_root, tensors):
    namespace: dict[str, object] = {}
    exec("from safetensors.torch import save_file as bound_save", namespace)  # like megatron-bridge
    with safestage.staged(shm_root) as stage:
        namespace["bound_save"](tensors, str(tmp_path / "m.safetensors"))  # type: ignore[operator]
    assert [r.destination for r in stage.records] == [tmp_path / "m.safetensors"]
    assert_loads_equal(tmp_path / "m.safetensors", tensors)


def test_numpy_and_package_level_serialize_file_are_staged(tmp_path, shm_root):
    import numpy as np
    import safetensors
    import safetensors.numpy

    arrays = {"x": np.arange(12, dtype=np.float32).reshape(3, 4)}
    with safestage.staged(shm_root) as stage:
        safetensors.numpy.save_file(arrays, tmp_path / "n.safetensors")
        spec = {"y": safetensors.TensorSpec(dtype="float32", shape=[3, 4], data_ptr=arrays["x"].ctypes.data, data_len=48)} if hasattr(safetensors, "TensorSpec") else None
        if spec is not None:
            safetensors.serialize_file(spec, str(tmp_path / "p.safetensors"))
    assert [r.destination.name for r in stage.records][0] == "n.safetensors"
    np.testing.assert_array_equal(safetensors.numpy.load_file(str(tmp_path / "n.safetensors"))["x"], arrays["x"])
    if spec is not None:
        assert len(stage.records) == 2
        np.testing.assert_array_equal(safetensors.numpy.load_file(str(tmp_path / "p.safetensors"))["y"], arrays["x"])


def _originals() -> dict[str, object]:
    import safetensors
    import safetensors.numpy
    import safetensors.torch

    return {
        "safetensors": safetensors.serialize_file,
        "torch": safetensors.torch.serialize_file,
        "numpy": safetensors.numpy.serialize_file,
    }


def test_original_restored_after_exception_and_nesting(tmp_path, shm_root, tensors):
    before = _originals()
    with pytest.raises(KeyError):
        with safestage.staged(shm_root):
            assert safestage.is_active()
            assert _originals()["torch"] is not before["torch"]
            with safestage.staged(shm_root) as inner:
                save_file(tensors, str(tmp_path / "inner.safetensors"))
            assert safestage.is_active()
            raise KeyError("boom")
    assert not safestage.is_active()
    assert inner.records and inner.records[0].destination == tmp_path / "inner.safetensors"
    after = _originals()
    assert all(after[name] is before[name] for name in before)


def test_activations_from_two_threads_overlapping(tmp_path, shm_root, tensors):
    before = _originals()
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def first() -> None:
        try:
            with safestage.staged(shm_root) as stage:
                first_in.set()
                second_in.wait(5)
                save_file(tensors, str(tmp_path / "first.safetensors"))
            assert len(stage.records) == 1
            first_out.set()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def second() -> None:
        try:
            first_in.wait(5)
            with safestage.staged(shm_root):
                second_in.set()
                first_out.wait(5)  # the first activation ended while this one is open
                save_file(tensors, str(tmp_path / "second.safetensors"))
                assert safestage.is_active()
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    assert not safestage.is_active()
    after = _originals()
    assert all(after[name] is before[name] for name in before)
    assert_loads_equal(tmp_path / "second.safetensors", tensors)


def test_saves_from_other_threads_are_staged(tmp_path, shm_root, tensors):
    with safestage.staged(shm_root) as stage:
        workers = [
            threading.Thread(target=save_file, args=(tensors, str(tmp_path / f"t{i}.safetensors")))
            for i in range(4)
        ]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    assert sorted(r.destination.name for r in stage.records) == [f"t{i}.safetensors" for i in range(4)]


def test_someone_wrapping_on_top_is_left_intact(tmp_path, shm_root, tensors):
    import safetensors.torch as st
    import wrapt

    original = st.serialize_file
    calls: list[str] = []

    def theirs(wrapped, instance, args, kwargs):
        calls.append(str(args[1]))
        return wrapped(*args, **kwargs)

    try:
        with safestage.staged(shm_root):
            wrapt.wrap_function_wrapper(st, "serialize_file", theirs)
            on_top = st.serialize_file
        assert st.serialize_file is on_top, "safestage must not remove a wrapper it does not own"
        save_file(tensors, str(tmp_path / "after.safetensors"))  # our inner wrapper passes through
        assert calls == [str(tmp_path / "after.safetensors")]
        assert_loads_equal(tmp_path / "after.safetensors", tensors)
    finally:
        st.serialize_file = original


def test_decorator_and_activate_handle(tmp_path, shm_root, tensors):
    @safestage.staged(shm_root)
    def export(name: str) -> bool:
        save_file(tensors, str(tmp_path / name))
        return safestage.is_active()

    assert export("a.safetensors") and export("b.safetensors")
    assert not safestage.is_active()
    handle = safestage.activate(shm_root, fsync=False)
    try:
        save_file(tensors, str(tmp_path / "c.safetensors"))
    finally:
        handle.close()
        handle.close()  # idempotent
    assert not safestage.is_active()
    assert [r.destination.name for r in handle.records] == ["c.safetensors"]
    assert listing(tmp_path) == ["a.safetensors", "b.safetensors", "c.safetensors"]


@pytest.mark.regression("0.1 hostile review of the hardening (issue 9): close waits for a save running in another thread")
def test_close_waits_for_a_save_running_in_another_thread(mount_dir, stage_root):
    directory, _ = mount_dir("slow")
    dest = directory / "model.safetensors"
    big = arange_tensors(5, numel=48 << 20)  # 192 MiB: ~0.5 s to publish at 400 MB/s
    stage = safestage.activate(stage_root)
    errors: list[BaseException] = []

    def save() -> None:
        try:
            save_file(big, str(dest))
        except BaseException as exc:
            errors.append(exc)

    worker = threading.Thread(target=save)
    worker.start()
    deadline = time.monotonic() + 30
    while not list(stage_root.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.001)  # until the worker's save is under way
    stage.close()
    closed_at_publish = [r.destination for r in stage.records]
    worker.join()
    assert not errors, errors
    assert closed_at_publish == [dest], "close() returned before the accepted save was published"


@pytest.mark.mounts
@pytest.mark.regression("0.1 hostile review 1: staged as a decorator on a generator function stages nothing")
def test_staged_as_a_decorator_on_a_generator_function_stages_its_saves(shm_root):
    """README: "As a decorator: @safestage.staged(...) stages every call of the function."
    ContextDecorator closes the stage when the call returns - for a generator function (a
    training loop yielding metrics, a checkpoint iterator) or an `async def`, that is before
    its body runs, so every save inside it is unstaged. On HDFS FUSE the plain writer fails
    (ENOSYS); on an object store whose upload fails at close it reports success and loses
    the file. What the user loses: every checkpoint the decorated loop writes."""
    with hostile_mount("hdfs") as mount:
        dest = Path(mount.path) / "model.safetensors"

        @safestage.staged(shm_root)
        def train() -> Iterator[int]:
            for step in range(1):
                save_file(filled_tensors(step + 1), str(dest))
                yield step

        list(train())  # safetensors raises ENOSYS from ftruncate: the save was not staged
        assert loads_as(dest, 1.0)


def test_used_stage_cannot_be_reentered(tmp_path):
    stage = safestage.staged(tmp_path)
    with stage:
        pass
    with pytest.raises(RuntimeError, match="already used"), stage:
        pass


def test_closing_restores_every_hook_point_including_lightning_strategy_methods(tmp_path, shm_root, tensors):
    """Lightning's strategies' ``save_checkpoint`` (hooked for sharded checkpoints) is a method:
    reading it through the class must not stand in for the function in the class's own
    ``__dict__``, or each activation wraps the last one's wrapper and close restores nothing
    (every save then ran through a growing chain of stale wrappers)."""
    import inspect
    import sys

    import lightning.fabric.strategies.fsdp  # noqa: F401 - the hook points must be loaded
    import lightning.pytorch.strategies.fsdp  # noqa: F401

    def hook_points() -> dict[str, object]:
        points = {}
        for target in _patch.TARGETS:
            module = sys.modules.get(target.module)
            if module is None:
                continue
            owner_name, _, name = target.attribute.rpartition(".")
            owner = getattr(module, owner_name) if owner_name else module
            points[f"{target.module}.{target.attribute}"] = inspect.getattr_static(owner, name)
        return points

    before = hook_points()
    assert any("FSDPStrategy.save_checkpoint" in point for point in before)
    for round in range(3):
        with safestage.staged(shm_root):
            save_file(tensors, str(tmp_path / f"{round}.safetensors"))
        after = hook_points()
        changed = [point for point in before if after[point] is not before[point]]
        assert changed == [], f"round {round}: not restored: {changed}"


def test_a_hooked_strategy_method_pickles_as_it_does_unhooked(shm_root):
    """With staging on (the switch: the whole process), Lightning's strategies'
    ``save_checkpoint`` read through an instance or its class pickles as plain Python pickles
    it: the bound method as the instance's attribute, the function as the class's."""
    import pickle

    from lightning.fabric.strategies import FSDPStrategy

    strategy = FSDPStrategy(state_dict_type="sharded")
    with safestage.staged(shm_root):
        bound = pickle.loads(pickle.dumps(strategy.save_checkpoint))
        function = pickle.loads(pickle.dumps(FSDPStrategy.save_checkpoint))
        assert bound.__self__ is not strategy and type(bound.__self__) is FSDPStrategy
        assert bound.__name__ == "save_checkpoint"
        assert function is FSDPStrategy.__dict__["save_checkpoint"]  # the wrapper, while staging
    assert pickle.loads(pickle.dumps(FSDPStrategy.save_checkpoint)) is FSDPStrategy.save_checkpoint
