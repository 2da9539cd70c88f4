"""A differential test of background saves (issue 30, section 3): generated states (dtypes,
views and shared storages, non-contiguous tensors, by-value objects, numpy arrays, metadata),
saved in the background through ``staged(background=..., torch_save=True)`` and through
``staged_dir(background=True)`` under budgets 0 / tiny / exact / default, from one or several
threads, every argument changed or freed as soon as each call returns, and Ctrl-C (a real
SIGINT) at generated points: every call returns, every file is byte for byte what a
synchronous save of the state at the call writes (or, after a Ctrl-C, what it held before or
that), and no budget is left reserved.

Examples: ``SAFESTAGE_SNAPSHOT_EXAMPLES`` (conftest.SUITE_VARIABLES), 14 per test in CI and
200 in the long tier (``SAFESTAGE_LONG=1``)."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import pickle
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Optional

import numpy as np
import pytest
import safetensors.torch
import torch
from _support import SUITE_SETTINGS, long_tier
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import safestage
from safestage import _snapshot

EXAMPLES_VARIABLE = "SAFESTAGE_SNAPSHOT_EXAMPLES"


def _examples() -> int:
    text = SUITE_SETTINGS.get(EXAMPLES_VARIABLE, "").strip()
    if text:
        return int(text)
    return 200 if long_tier() else 14


EXAMPLES = _examples()
WATCHDOG_S = 60.0  # one example: every call returns well within it, or the test fails

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.uint8,
          torch.int16, torch.int32, torch.int64, torch.bool]  # fmt: skip
DTYPES += [getattr(torch, name) for name in ("uint16", "uint32", "float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)]


# -- generated states ----------------------------------------------------------------------


@dataclass
class Leaf:
    """A tensor of the state: its own storage, or a view of an earlier leaf's."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    view: Optional[str]  # None: its own; "slice" / "transpose" / "alias" of the previous leaf
    seed: int


@dataclass
class Save:
    writer: str  # "safetensors" / "torch"
    name: str  # the file's name (several saves of one name in one thread: the last lands)
    leaves: list[Leaf]
    objects: list[Any]  # by value: lists, dicts, strings, bytes, numpy arrays (torch.save)
    metadata: Optional[dict[str, str]]  # safetensors
    keyword: bool  # metadata / pickle_protocol as keywords
    protocol: int  # torch.save's pickle_protocol
    legacy: bool  # torch.save's _use_new_zipfile_serialization=False
    free: bool  # after the call: the tensors' memory freed (else overwritten)


@dataclass
class Plan:
    threads: list[list[Save]] = field(default_factory=list)
    budget: str = "default"  # "0" / "tiny" / "exact" / "default"
    background: int = 2


leaves = st.builds(
    Leaf,
    dtype=st.sampled_from(DTYPES),
    shape=st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple),
    view=st.sampled_from([None, None, "slice", "transpose", "alias"]),
    seed=st.integers(0, 2**31 - 1),
)
texts = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=8)
by_value = st.recursive(
    st.one_of(st.integers(), st.floats(allow_nan=False), texts, st.binary(max_size=16), st.none(),
              st.lists(st.integers(0, 255), max_size=20).map(lambda xs: np.array(xs, dtype=np.uint8)),
              st.lists(st.floats(width=32, allow_nan=False), max_size=6).map(lambda xs: np.array(xs, dtype=np.float32))),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(texts, inner, max_size=4)),
    max_leaves=8,
)  # fmt: skip


@st.composite
def saves(draw: st.DrawFn, index: int) -> Save:
    writer = draw(st.sampled_from(["safetensors", "torch"]))
    name = draw(st.sampled_from(["a", "b", f"t{index}"]))
    drawn = draw(st.lists(leaves, min_size=0 if writer == "torch" else 1, max_size=5))
    if writer == "safetensors":  # safetensors refuses views of one storage and non-contiguous tensors
        drawn = [Leaf(leaf.dtype, leaf.shape, None, leaf.seed) for leaf in drawn]
    return Save(
        writer=writer,
        name=f"{name}.{'safetensors' if writer == 'safetensors' else 'pt'}",
        leaves=drawn,
        objects=draw(st.lists(by_value, max_size=3)) if writer == "torch" else [],
        metadata=draw(st.none() | st.dictionaries(texts, texts, max_size=3)) if writer == "safetensors" else None,
        keyword=draw(st.booleans()),
        protocol=draw(st.sampled_from([2, 4, pickle.HIGHEST_PROTOCOL])),
        legacy=False,  # the legacy format names storages by address: two sync saves differ
        free=draw(st.booleans()),
    )


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    count = draw(st.integers(1, 3))
    return Plan(
        threads=[draw(st.lists(saves(index), min_size=1, max_size=3)) for index in range(count)],
        budget=draw(st.sampled_from(["0", "tiny", "exact", "default"])),
        background=draw(st.integers(1, 3)),
    )


def _tensors(save: Save) -> list[torch.Tensor]:
    made: list[torch.Tensor] = []
    for leaf in save.leaves:
        previous = made[-1] if made else None
        if leaf.view is not None and previous is not None and previous.numel() > 1:
            if leaf.view == "slice":
                made.append(previous.reshape(-1)[1:])
            elif leaf.view == "transpose" and previous.dim() >= 2:
                made.append(previous.transpose(0, 1))
            else:
                made.append(previous.view(previous.shape))
            continue
        count = 1
        for size in leaf.shape:
            count *= size
        generator = torch.Generator().manual_seed(leaf.seed)
        if leaf.dtype == torch.bool:
            made.append(torch.randint(0, 2, leaf.shape, generator=generator).bool())
            continue
        size = torch.empty(0, dtype=leaf.dtype).element_size()
        raw = torch.randint(0, 256, (count * size,), dtype=torch.uint8, generator=generator)
        made.append(raw.view(leaf.dtype).reshape(leaf.shape))
    return made


def _state(save: Save) -> tuple[Any, list[torch.Tensor]]:
    """The object a save is given, and its tensors (to change or free after the call)."""
    tensors = _tensors(save)
    if save.writer == "safetensors":
        return {f"t{index}": tensor for index, tensor in enumerate(tensors)}, tensors
    return {"model": {f"t{index}": tensor for index, tensor in enumerate(tensors)},
            "objects": pickle.loads(pickle.dumps(save.objects)), "step": len(tensors)}, tensors  # fmt: skip


def _call(save: Save, state: Any, path: Path) -> Optional[dict[str, str]]:
    """The save; returns the metadata dict it was given (changed after the call)."""
    if save.writer == "safetensors":
        metadata = dict(save.metadata) if save.metadata is not None else None
        if save.keyword:
            save_file(state, str(path), metadata=metadata)
        else:
            save_file(state, path, metadata)
        return metadata
    keywords: dict[str, Any] = {"pickle_protocol": save.protocol} if save.keyword else {}
    if save.legacy:
        keywords["_use_new_zipfile_serialization"] = False
    if save.keyword:
        torch.save(state, path, **keywords)
    else:
        torch.save(state, path, pickle, save.protocol, **keywords)
    return None


def _mutate_after_the_call(
    save: Save, state: Any, tensors: list[torch.Tensor], metadata: Optional[dict[str, str]]
) -> None:
    """What a training loop does the moment the call returns: every argument changed in
    place, or the tensors' memory freed."""
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if save.free:
            storage.resize_(0)
        elif storage.nbytes():
            torch.empty(0, dtype=torch.uint8).set_(storage).fill_(0x5A)
    if save.writer == "safetensors":
        state.clear()
        if metadata is not None:  # kohya's ss_steps: one dict, updated for the next save
            metadata["ss_steps"] = "after the call"
            for key in list(metadata)[:1]:
                metadata[key] += "!"
        return
    state["step"] = -1
    _scribble(state["objects"])


def _scribble(value: Any) -> None:
    if isinstance(value, list):
        for item in value:
            _scribble(item)
        value.append("after the call")
    elif isinstance(value, dict):
        for item in value.values():
            _scribble(item)
        value["after"] = "the call"
    elif isinstance(value, np.ndarray) and value.size:
        value.fill(7)


def _expected(plan: Plan, directory: Path) -> dict[tuple[int, str], list[bytes]]:
    """The bytes a synchronous save of each state writes, by (thread, name), in call order
    (the archive of a torch.save records its file's name: the same name, another directory)."""
    expected: dict[tuple[int, str], list[bytes]] = {}
    for thread, plan_saves in enumerate(plan.threads):
        for save in plan_saves:
            state, _ = _state(save)
            path = directory / save.name
            _call(save, state, path)
            expected.setdefault((thread, save.name), []).append(path.read_bytes())
            path.unlink()
    return expected


def _snapshot_bytes(save: Save) -> int:
    """The whole reservation a background save of ``save`` takes (0: not copied)."""
    state, _ = _state(save)
    if save.writer == "torch":
        copied = _snapshot.copy_state(state, 1 << 40) if not save.legacy else None
    else:
        keep: list[Any] = []
        copied = _snapshot.copy_specs(safetensors.torch._flatten_as_ptr(state, keep), 1 << 40)
    if copied is None:
        return 0
    nbytes = copied[1].nbytes
    copied[1].release()
    _snapshot.clear_pool()
    return nbytes


def _budget(plan: Plan) -> Optional[str]:
    if plan.budget == "default":
        return None
    if plan.budget == "exact":  # each save fits alone: the next waits for the one before
        return str(max([_snapshot_bytes(save) for saves in plan.threads for save in saves] + [1]))
    return {"0": "0", "tiny": "64"}[plan.budget]


# -- running a plan ------------------------------------------------------------------------


class Hung(Exception):
    pass


@contextlib.contextmanager
def _watchdog(seconds: float) -> Iterator[None]:
    """Fail (raise Hung in the main thread) rather than hang: a lock wait is interrupted by a
    signal whose handler raises; again every ``seconds`` until the block is left (a stage's
    close waiting for the hung save must not hang the suite either)."""

    def hung(signum: int, frame: Optional[FrameType]) -> None:
        raise Hung(f"a background save plan did not return in {seconds} s")

    previous = signal.signal(signal.SIGUSR1, hung)
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(seconds):
            os.kill(os.getpid(), signal.SIGUSR1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()
        signal.signal(signal.SIGUSR1, previous)


def _run_thread(plan_saves: list[Save], directory: Path, errors: list[BaseException]) -> None:
    try:
        for save in plan_saves:
            state, tensors = _state(save)
            metadata = _call(save, state, directory / save.name)
            _mutate_after_the_call(save, state, tensors, metadata)
            del state, tensors, metadata
    except BaseException as exc:
        errors.append(exc)


def _saving(plan: Plan, directory: Path, interrupt: Optional[float]) -> bool:
    """Run the plan's threads (the first in this, the main, thread); a SIGINT after
    ``interrupt`` seconds. Returns whether a KeyboardInterrupt ended the main thread's saves."""
    errors: list[BaseException] = []
    others = [threading.Thread(target=_run_thread, args=(saves_, directory, errors), daemon=True)
              for saves_ in plan.threads[1:]]  # fmt: skip
    for thread in others:
        thread.start()
    interrupted = False
    fired: list[bool] = []

    def ctrl_c() -> None:
        fired.append(True)
        os.kill(os.getpid(), signal.SIGINT)

    timer = threading.Timer(interrupt, ctrl_c) if interrupt is not None else None
    try:
        try:
            if timer is not None:
                timer.start()
            _run_thread(plan.threads[0], directory, errors)
            for error in errors:
                if isinstance(error, KeyboardInterrupt):
                    raise error
        finally:
            if timer is not None:
                timer.cancel()
                timer.join()
    except KeyboardInterrupt:
        interrupted = True
    # The fault fired where it was sent, and was never swallowed: a Ctrl-C sent while the
    # saves ran ends them with KeyboardInterrupt.
    assert interrupted == bool(fired), "a Ctrl-C was sent but no KeyboardInterrupt reached the caller"
    for thread in others:
        thread.join(WATCHDOG_S)
        assert not thread.is_alive(), "a saving thread did not return"
    for error in errors:
        if not isinstance(error, KeyboardInterrupt):
            raise error
    return interrupted


def _settle() -> None:
    """Every background save of the process has landed or failed (its error seen)."""
    for _ in range(10):
        try:
            safestage.wait()
            return
        except KeyboardInterrupt:
            continue
        except Exception:
            continue


def _check(plan: Plan, landed: Path, expected: dict[tuple[int, str], list[bytes]], *, interrupted: bool) -> None:
    names = {name for (_, name) in expected}
    assert {path.name for path in landed.iterdir()} <= names | {safestage.COMMIT_NAME}
    for (_thread, name), versions in expected.items():
        path = landed / name
        shared = [key for key in expected if key[1] == name]
        if len(shared) > 1:  # two threads saved one name: either order
            candidates = [data for key in shared for data in expected[key]]
        else:
            candidates = versions if interrupted else versions[-1:]
        if not path.exists():
            assert interrupted, f"{name} was never written"
            continue
        data = _canonical(path.read_bytes(), name)
        assert data in [_canonical(each, name) for each in candidates], (
            f"{name}: not what a synchronous save of the state at any call wrote"
        )


def _canonical(data: bytes, name: str) -> Any:
    """A file's bytes, but for the order of a safetensors header's ``__metadata__`` keys:
    safetensors 0.8 writes them in hash order, so that two synchronous saves of one state
    differ there (every other byte, the header's length included, is compared)."""
    if not name.endswith(".safetensors"):
        return data
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + size])
    return size, header, data[8 + size :]


def _no_budget_held() -> None:
    gc.collect()
    in_use, _ = _snapshot.pooled_bytes()
    assert in_use == 0, f"{in_use} bytes of the snapshot budget are still reserved"


def _run_plan(plan: Plan, base: Path, entry: str, interrupt: Optional[float]) -> None:
    _snapshot.clear_pool()
    if entry == "staged_dir":  # a block's files are the caller's: one thread writes each name
        plan = dataclasses.replace(plan, threads=[
            [dataclasses.replace(save, name=f"r{thread}-{save.name}") for save in saves_]
            for thread, saves_ in enumerate(plan.threads)
        ])  # fmt: skip
    work = Path(tempfile.mkdtemp(dir=base))
    try:
        reference = work / "reference"
        reference.mkdir()
        expected = _expected(plan, reference)
        budget = _budget(plan)
        root = work / "stage-root"
        root.mkdir()
        with _watchdog(WATCHDOG_S):
            if entry == "staged":
                out = work / "out"
                out.mkdir()
                interrupted = False
                try:
                    with safestage.staged(root, background=plan.background, torch_save=True, snapshot_budget=budget):
                        interrupted = _saving(plan, out, interrupt)
                except KeyboardInterrupt:  # landed in the stage's close: its saves go on
                    interrupted = True
                _settle()
                landed = out
            else:
                dest = work / "checkpoint-1"
                previous = os.environ.get("SAFESTAGE_SNAPSHOT_BUDGET")
                if budget is not None:
                    os.environ["SAFESTAGE_SNAPSHOT_BUDGET"] = budget
                interrupted = False
                try:
                    commit = safestage.staged_dir(dest, root, background=True)
                    try:
                        with commit as local:
                            interrupted = _saving(plan, local, interrupt)
                            if interrupted:
                                raise KeyboardInterrupt  # the block ends as a Ctrl-C ends it
                        commit.wait()
                    except KeyboardInterrupt:
                        interrupted = True
                finally:
                    if previous is None:
                        os.environ.pop("SAFESTAGE_SNAPSHOT_BUDGET", None)
                    else:
                        os.environ["SAFESTAGE_SNAPSHOT_BUDGET"] = previous
                _settle()
                if interrupted:
                    # Nothing or everything: a block that a Ctrl-C ended is not committed.
                    assert not dest.exists() or (dest / safestage.COMMIT_NAME).exists()
                    if not dest.exists():
                        event("a Ctrl-C ended the block: nothing committed")
                        _no_budget_held()
                        return
                landed = dest
        if interrupt is not None:
            event("a Ctrl-C ended the saves" if interrupted else "the saves ended before the Ctrl-C")
        _check(plan, landed, expected, interrupted=interrupted)
        _no_budget_held()
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -- the tests -----------------------------------------------------------------------------

SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                           HealthCheck.data_too_large])  # fmt: skip


@pytest.mark.parametrize("entry", ["staged", "staged_dir"])
@SETTINGS
@given(plan=plans())
def test_background_saves_land_what_synchronous_saves_write_at_the_call(
    tmp_path: Path, entry: str, plan: Plan
) -> None:
    _run_plan(plan, tmp_path, entry, None)


@pytest.mark.parametrize("entry", ["staged", "staged_dir"])
@SETTINGS
@given(plan=plans(), interrupt=st.floats(0.0, 0.15))
def test_a_ctrl_c_at_any_point_of_background_saves_leaks_no_budget_and_tears_no_file(
    tmp_path: Path, entry: str, plan: Plan, interrupt: float
) -> None:
    _run_plan(plan, tmp_path, entry, interrupt)


def test_the_differential_test_sees_a_metadata_dict_changed_after_the_call(tmp_path: Path) -> None:
    """The test's own check fires: a save whose metadata is changed before a synchronous save
    reads it differs from the save of the state at the call."""
    plan = Plan(threads=[[Save("safetensors", "a.safetensors", [Leaf(torch.float32, (3,), None, 1)], [],
                                {"k": "v"}, True, 2, False, False)]])  # fmt: skip
    expected = _expected(plan, tmp_path)
    state, _ = _state(plan.threads[0][0])
    save_file(state, str(tmp_path / "a.safetensors"), metadata={"k": "changed"})
    with pytest.raises(AssertionError, match="not what a synchronous save"):
        _check(plan, tmp_path, expected, interrupted=False)

