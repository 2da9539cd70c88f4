"""torch.save staging (issue 12): ``staged(torch_save=True)`` / SAFESTAGE_TORCH_SAVE=1.

Real torch.save calls onto real mounts: what a plain torch.save does there (measured, asserted),
and what it does staged: the same bytes as a plain save on local disk, 0644, nothing else in
the directory, a PublishError (an OSError, and a RuntimeError like torch's own) naming the
file when the upload fails at close, with the complete staged copy kept. File objects and
buffers pass through; the original function comes back; torch_save=False never touches it.
"""

from __future__ import annotations

import io
import os
import pickle
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

import safestage
from safestage import ConfigError, PublishError, StagingError, _patch
from safestage._config import resolve

ORIGINAL = torch.save


def state() -> dict[str, object]:
    generator = torch.Generator().manual_seed(1)
    return {
        "step": 7,
        "weights": torch.randn(300, 17, generator=generator),
        "half": torch.randn(33, generator=generator).to(torch.bfloat16),
        "nested": [torch.arange(5), {"lr": 0.1}],
    }


def assert_equal(loaded: object, expected: object) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(loaded, torch.Tensor) and loaded.dtype == expected.dtype
        assert torch.equal(loaded, expected)
    elif isinstance(expected, dict):
        assert isinstance(loaded, dict) and loaded.keys() == expected.keys()
        for key in expected:
            assert_equal(loaded[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert type(loaded) is type(expected) and len(loaded) == len(expected)
        for a, b in zip(loaded, expected):
            assert_equal(a, b)
    else:
        assert loaded == expected


def plain_bytes(tmp_path: Path, name: str, obj: object, **kwargs: object) -> bytes:
    """What a plain torch.save of ``obj`` under ``name`` writes on local disk (the archive
    inside the zip is named after the file, so the name must match)."""
    reference = tmp_path / f"reference-{uuid.uuid4().hex[:6]}"
    reference.mkdir()
    ORIGINAL(obj, reference / name, **kwargs)
    return (reference / name).read_bytes()


def fresh(mount: object, label: str) -> Path:
    directory = Path(mount.path) / f"{label}-{uuid.uuid4().hex[:8]}"  # type: ignore[attr-defined]
    directory.mkdir()
    return directory


@pytest.fixture(autouse=True)
def _torch_save_restored():
    yield
    assert torch.save is ORIGINAL and torch.serialization.save is ORIGINAL
    assert not safestage.is_active()


# -- onto real mounts ------------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "strategy"), [("hdfs", "replace"), ("mountpoint", "direct")])
def test_torch_save_onto_kit_mounts(mode, strategy, kit_mounts, shm_root, tmp_path):
    dest = fresh(kit_mounts[mode], "ts")
    obj = state()
    with safestage.staged(shm_root, torch_save=True) as stage:
        torch.save(obj, dest / "optimizer.pt")  # attribute lookup at call time, as Trainer does
        torch.serialization.save(obj, str(dest / "scheduler.pt"))
    assert [(r.destination.name, r.publish) for r in stage.records] == [
        ("optimizer.pt", strategy), ("scheduler.pt", strategy),
    ]
    assert sorted(os.listdir(dest)) == ["optimizer.pt", "scheduler.pt"]  # exact: no temp, no probe
    for name in ("optimizer.pt", "scheduler.pt"):
        assert_equal(torch.load(dest / name), obj)
        assert stat.S_IMODE(os.stat(dest / name).st_mode) == 0o644
        assert (dest / name).read_bytes() == plain_bytes(tmp_path, name, obj)  # byte for byte
    assert os.listdir(shm_root) == []


def test_plain_torch_save_onto_the_kit_mounts(kit_mounts, tmp_path):
    """What staging changes: plainly, torch.save writes in place (no ftruncate, no rename), so it
    lands on hdfs and mountpoint, non-atomically; on an upload failing at close it raises an
    error that names no file, and nothing is kept."""
    obj = state()
    for mode in ("hdfs", "mountpoint"):
        dest = fresh(kit_mounts[mode], "plain")
        torch.save(obj, dest / "optimizer.pt")
        assert_equal(torch.load(dest / "optimizer.pt"), obj)
    dest = fresh(kit_mounts["close-eio"], "plain")
    with pytest.raises(RuntimeError, match="iostream error") as info:
        torch.save(obj, dest / "optimizer.pt")
    assert "optimizer.pt" not in str(info.value) and not isinstance(info.value, OSError)
    assert os.listdir(dest) == []


def test_upload_failing_at_close_is_a_publish_error_naming_the_file(kit_mounts, shm_root):
    dest = fresh(kit_mounts["close-eio"], "ts")
    obj = state()
    with pytest.raises(PublishError) as info, safestage.staged(shm_root, torch_save=True):
        torch.save(obj, dest / "optimizer.pt")
    error = info.value
    assert isinstance(error, OSError) and isinstance(error, RuntimeError)  # what torch.save callers catch
    assert error.errno == 5 and error.filename == str(dest / "optimizer.pt")
    assert str(dest / "optimizer.pt") in str(error) and error.staged_path in str(error)
    assert_equal(torch.load(error.staged_path), obj)  # the complete copy, kept
    assert os.listdir(dest) == []
    assert pickle.loads(pickle.dumps(error)).staged_path == error.staged_path
    assert kit_mounts["close-eio"].faults()


@pytest.mark.parametrize("real_dir", ["s3fs"], indirect=True)
def test_torch_save_onto_a_real_s3fs_mount(real_dir, shm_root, tmp_path):
    obj = state()
    with safestage.staged(shm_root, torch_save=True) as stage:
        torch.save(obj, real_dir / "rng_state.pth")
    assert [r.publish for r in stage.records] == ["replace"]
    assert os.listdir(real_dir) == ["rng_state.pth"]
    assert_equal(torch.load(real_dir / "rng_state.pth"), obj)
    assert stat.S_IMODE(os.stat(real_dir / "rng_state.pth").st_mode) == 0o644
    assert (real_dir / "rng_state.pth").read_bytes() == plain_bytes(tmp_path, "rng_state.pth", obj)


def test_local_disk_across_devices_gets_0644_and_same_device_renames(tmp_path, shm_root, stage_root):
    obj = state()
    with safestage.staged(shm_root, torch_save=True) as across:
        torch.save(obj, tmp_path / "a.pt")
    with safestage.staged(stage_root, torch_save=True) as same:
        torch.save(obj, tmp_path / "b.pt")
    with safestage.staged(shm_root, torch_save=True, skip_local_disk=True) as auto:
        torch.save(obj, tmp_path / "c.pt")  # local disk: torch.save itself writes it
    assert [r.publish for r in across.records + same.records + auto.records] == ["replace", "rename", "unstaged"]
    for name in ("a.pt", "b.pt", "c.pt"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o644
        assert_equal(torch.load(tmp_path / name), obj)


# -- what is and is not staged ---------------------------------------------------------------


def test_file_objects_and_buffers_pass_through(tmp_path, shm_root):
    obj = state()
    buffer = io.BytesIO()
    with safestage.staged(shm_root, torch_save=True) as stage:
        torch.save(obj, buffer)  # Lightning's _atomic_save does exactly this
        with open(tmp_path / "handle.pt", "wb") as handle:
            torch.save(obj, handle)
    assert stage.records == []
    reference = io.BytesIO()
    ORIGINAL(obj, reference)
    assert buffer.getvalue() == reference.getvalue()
    assert_equal(torch.load(tmp_path / "handle.pt"), obj)


def test_torch_save_false_leaves_torch_save_alone(tmp_path, shm_root):
    with safestage.staged(shm_root) as stage:
        assert torch.save is ORIGINAL and torch.serialization.save is ORIGINAL
        torch.save(state(), tmp_path / "x.pt")
    assert stage.records == []
    with safestage.staged(shm_root, torch_save=True):
        assert torch.save is not ORIGINAL and torch.save.__wrapped__ is ORIGINAL
        assert _patch.installed_targets()[-2:] == ["torch.serialization.save", "torch.save"]


def test_restored_on_exit_after_an_error_and_when_nested(tmp_path, shm_root):
    with pytest.raises(ZeroDivisionError), safestage.staged(shm_root, torch_save=True):
        1 / 0  # noqa: B018
    assert torch.save is ORIGINAL
    with safestage.staged(shm_root, torch_save=True) as outer:
        with safestage.staged(shm_root) as inner:  # the stage that takes a save decides
            assert torch.save is not ORIGINAL
            torch.save([1], tmp_path / "inner.pt")
        assert torch.save is not ORIGINAL
        torch.save([2], tmp_path / "outer.pt")
    assert inner.records == [] and [r.destination.name for r in outer.records] == ["outer.pt"]
    handle = safestage.activate(shm_root, torch_save=True)
    assert torch.save is not ORIGINAL
    handle.close()
    assert torch.save is ORIGINAL


def test_a_wrapper_over_ours_is_left_alone(tmp_path, shm_root):
    import wrapt

    calls = []

    def theirs(wrapped, instance, args, kwargs):
        calls.append(args[1])
        return wrapped(*args, **kwargs)

    with safestage.staged(shm_root, torch_save=True) as stage:
        ours = torch.save
        torch.save = wrapt.FunctionWrapper(ours, theirs)
        try:
            torch.save([3], tmp_path / "x.pt")
        finally:
            mine_over = torch.save
    try:
        assert torch.save is mine_over  # theirs stays: it still calls ours, now a pass-through
        torch.save([4], tmp_path / "y.pt")
        assert [r.destination.name for r in stage.records] == ["x.pt"]
        assert len(calls) == 2
    finally:
        torch.save = ORIGINAL


@pytest.mark.slow
def test_the_wrapper_looks_like_torch_save_and_pickles(tmp_path, shm_root):
    """One wrapper for both globals (one function, as unpatched), the same signature, and it
    pickles as a reference (torch.save handed to a spawned process or a ProcessPoolExecutor)."""
    import inspect

    with safestage.staged(shm_root, torch_save=True):
        assert torch.save is torch.serialization.save
        assert inspect.signature(torch.save) == inspect.signature(ORIGINAL)
        assert torch.save.__doc__ == ORIGINAL.__doc__ and torch.save.__name__ == "save"
        assert pickle.loads(pickle.dumps(torch.save)) is torch.save
        import safetensors.torch

        assert pickle.loads(pickle.dumps(safetensors.torch.serialize_file)) is safetensors.torch.serialize_file
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        child = context.Process(target=torch.save, args=({"spawned": 1}, str(tmp_path / "spawned.pt")))
        child.start()
        child.join(120)
    assert child.exitcode == 0
    assert torch.load(tmp_path / "spawned.pt") == {"spawned": 1}


def test_a_symlink_is_followed_like_plain_torch_save(tmp_path, shm_root):
    """torch.save opens the path, so it writes the file a symlink points to; staged, the same."""
    for kind in ("plain", "staged"):
        directory = tmp_path / kind
        directory.mkdir()
        ORIGINAL({"old": 1}, directory / "step-100.pt")
        (directory / "last.pt").symlink_to("step-100.pt")
        (directory / "dangling.pt").symlink_to("new.pt")
        (directory / "loop.pt").symlink_to("loop.pt")
        with safestage.staged(shm_root, torch_save=kind == "staged") as stage:
            save = torch.save  # looked up inside the block, as callers do
            save({"new": 2}, directory / "last.pt")
            save({"new": 3}, directory / "dangling.pt")
            with pytest.raises(RuntimeError) as loop:
                save({"new": 4}, directory / "loop.pt")
        assert (directory / "last.pt").is_symlink() and (directory / "dangling.pt").is_symlink()
        assert torch.load(directory / "step-100.pt") == {"new": 2}
        assert torch.load(directory / "new.pt") == {"new": 3}
        assert "loop.pt" in str(loop.value) or "symbolic links" in str(loop.value)
        assert [r.destination.name for r in stage.records] == ([] if kind == "plain" else ["step-100.pt", "new.pt"])


def test_non_ascii_names_go_through_torch_s_python_stream(tmp_path, shm_root):
    obj = state()
    with safestage.staged(shm_root, torch_save=True) as stage:
        torch.save(obj, tmp_path / "état-ü.pt")
    assert [r.destination.name for r in stage.records] == ["état-ü.pt"]
    assert (tmp_path / "état-ü.pt").read_bytes() == plain_bytes(tmp_path, "état-ü.pt", obj)


def test_bound_before_activation_is_not_caught(tmp_path, shm_root):
    """The documented limit: ``from torch import save`` holds the original function."""
    from torch import save as bound

    with safestage.staged(shm_root, torch_save=True) as stage:
        bound([1], tmp_path / "bound.pt")
    assert stage.records == []


# -- arguments and errors as plain torch.save ----------------------------------------------


def test_arguments_pass_through(tmp_path, shm_root):
    obj = state()
    with safestage.staged(shm_root, torch_save=True) as stage:
        torch.save(obj, f=tmp_path / "kw.pt")
        torch.save(obj, str(tmp_path / "p4.pt"), pickle_protocol=4)
        torch.save(obj, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
        torch.save(obj, tmp_path / "module.pt", pickle_module=pickle, pickle_protocol=5)
    assert len(stage.records) == 4
    assert (tmp_path / "kw.pt").read_bytes() == plain_bytes(tmp_path, "kw.pt", obj)
    assert (tmp_path / "p4.pt").read_bytes() == plain_bytes(tmp_path, "p4.pt", obj, pickle_protocol=4)
    assert (tmp_path / "p4.pt").read_bytes() != plain_bytes(tmp_path, "p4.pt", obj)  # protocol really differs
    legacy = (tmp_path / "legacy.pt").read_bytes()
    assert legacy[:2] != b"PK"  # not a zip: the legacy format really was used
    assert_equal(torch.load(tmp_path / "legacy.pt"), obj)
    assert (tmp_path / "module.pt").read_bytes() == plain_bytes(
        tmp_path, "module.pt", obj, pickle_module=pickle, pickle_protocol=5
    )
    assert_equal(torch.load(tmp_path / "module.pt", weights_only=False), obj)


def _outcome(call):
    try:
        call()
    except BaseException as exc:
        return type(exc), str(exc)
    return None


def test_bad_destinations_fail_exactly_like_plain_torch_save(tmp_path, shm_root):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "a-dir").mkdir()
    cases = [
        tmp_path / "missing" / "x.pt",  # directory missing
        tmp_path / "a-file" / "x.pt",  # "directory" is a file
        str(tmp_path / "trailing") + "/",  # trailing slash
        tmp_path / "a-dir",  # an existing directory
        str(tmp_path / "missing") + "/../x.pt",  # the kernel resolves .. after missing: ENOENT
    ]
    for target in cases:
        plain = _outcome(lambda t=target: ORIGINAL([1], t))
        with safestage.staged(shm_root, torch_save=True) as stage:
            staged = _outcome(lambda t=target: torch.save([1], t))
        assert plain is not None, target
        assert staged == plain, target
        assert stage.records == []
    assert sorted(os.listdir(tmp_path)) == ["a-dir", "a-file"]
    assert os.listdir(shm_root) == []


def test_an_object_that_cannot_be_pickled_leaves_the_old_file(tmp_path, shm_root):
    ORIGINAL({"old": 1}, tmp_path / "x.pt")
    with pytest.raises((AttributeError, pickle.PicklingError)), safestage.staged(shm_root, torch_save=True):
        torch.save({"new": lambda: 0}, tmp_path / "x.pt")
    assert torch.load(tmp_path / "x.pt") == {"old": 1}  # a plain save would have left a torn zip
    assert os.listdir(tmp_path) == ["x.pt"] and os.listdir(shm_root) == []


class _Interrupting:
    def __reduce__(self):
        raise KeyboardInterrupt


def test_ctrl_c_while_serializing_leaves_the_old_file(tmp_path, shm_root):
    ORIGINAL({"old": 1}, tmp_path / "x.pt")
    with pytest.raises(KeyboardInterrupt), safestage.staged(shm_root, torch_save=True):
        torch.save({"w": torch.ones(1000), "bad": _Interrupting()}, tmp_path / "x.pt")
    assert torch.load(tmp_path / "x.pt") == {"old": 1}
    assert os.listdir(tmp_path) == ["x.pt"] and os.listdir(shm_root) == []


def test_ctrl_c_while_publishing_keeps_the_staged_copy(kit_mounts, shm_root):
    """SIGINT as soon as our temp appears on the slow mount (mid-copy): no temp left beside
    the destination, nothing under the final name, the complete copy kept and named."""
    mount = kit_mounts["slow"]
    dest = fresh(mount, "ctrlc")
    backing = Path(mount.backing) / dest.name
    obj = {"big": torch.zeros(48 << 20, dtype=torch.uint8)}  # 48 MiB at 400 MB/s: ~120 ms of copy
    fired = threading.Event()

    def interrupt_when_copying() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not fired.is_set():
            if any(".safestage-" in name for name in os.listdir(backing)):
                fired.set()
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.002)

    watcher = threading.Thread(target=interrupt_when_copying)
    with pytest.raises(KeyboardInterrupt) as info, safestage.staged(shm_root, torch_save=True):
        watcher.start()
        torch.save(obj, dest / "big.pt")
    watcher.join()
    assert fired.is_set()
    notes = getattr(info.value, "__notes__", [])
    assert any("complete staged copy is kept" in note for note in notes), notes
    kept = notes[-1].rsplit(" ", 1)[-1]
    assert torch.equal(torch.load(kept)["big"], obj["big"])
    assert os.listdir(dest) == []
    Path(kept).unlink()


def test_staging_root_full_is_a_staging_error(small_tmpfs, tmp_path):
    obj = {"w": torch.zeros(4 << 20, dtype=torch.uint8)}  # 4 MiB into a 2 MiB root
    ORIGINAL({"old": 1}, tmp_path / "x.pt")
    with pytest.raises(StagingError) as info, safestage.staged(small_tmpfs, torch_save=True):
        torch.save(obj, tmp_path / "x.pt")
    assert info.value.errno == 28 and isinstance(info.value, RuntimeError)
    assert "staging root is full" in str(info.value)
    assert torch.load(tmp_path / "x.pt") == {"old": 1}
    assert os.listdir(small_tmpfs) == []


# -- no double staging ------------------------------------------------------------------------


def test_torch_save_inside_a_safetensors_save_is_not_staged_twice(tmp_path, shm_root, tensors):
    """A serialize_file wrapper (installed before activation, so ours wraps it) that also
    torch.saves a sidecar: the sidecar is written once, plainly, where it was asked to go."""
    import safetensors.torch
    import wrapt
    from safetensors.torch import load_file, save_file

    original = safetensors.torch.serialize_file
    sidecars = []

    def with_sidecar(wrapped, instance, args, kwargs):
        result = wrapped(*args, **kwargs)
        sidecars.append(tmp_path / "sidecar.pt")
        torch.save({"keys": sorted(args[0])}, tmp_path / "sidecar.pt")
        return result

    safetensors.torch.serialize_file = wrapt.FunctionWrapper(original, with_sidecar)
    try:
        with safestage.staged(shm_root, torch_save=True) as stage:
            save_file(tensors, str(tmp_path / "model.safetensors"))
    finally:
        safetensors.torch.serialize_file = original
    assert [r.destination.name for r in stage.records] == ["model.safetensors"]
    assert torch.load(tmp_path / "sidecar.pt") == {"keys": sorted(tensors)}
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors", "sidecar.pt"]
    assert load_file(str(tmp_path / "model.safetensors")).keys() == tensors.keys()
    assert os.listdir(shm_root) == []


def test_the_path_staged_file_yields_is_not_staged_again(kit_mounts, shm_root, tensors):
    """README's recipe, `with staged_file(dest) as local: torch.save(obj, local)`, inside a
    stage that stages torch.save (or safetensors): written once into the private directory,
    published once by staged_file."""
    from safetensors.torch import load_file, save_file

    dest = fresh(kit_mounts["mountpoint"], "sf")
    with safestage.staged(shm_root, torch_save=True) as stage:
        with safestage.staged_file(dest / "optimizer.pt", shm_root) as local:
            torch.save({"step": 1}, local)
        with safestage.staged_file(dest / "extra.safetensors", shm_root) as local:
            save_file(tensors, str(local))
    assert stage.records == []
    assert torch.load(dest / "optimizer.pt") == {"step": 1}
    assert load_file(str(dest / "extra.safetensors")).keys() == tensors.keys()
    assert sorted(os.listdir(dest)) == ["extra.safetensors", "optimizer.pt"]
    assert os.listdir(shm_root) == []


# -- fork, background, settings, environment ---------------------------------------------------


def test_forked_child_publishes_before_it_exits(kit_mounts, shm_root):
    dest = fresh(kit_mounts["hdfs"], "fork")
    with safestage.staged(shm_root, torch_save=True, background=True):
        pid = os.fork()
        if pid == 0:  # the child: publish must be done when torch.save returns
            try:
                torch.save({"child": 1}, dest / "child.pt")
                os._exit(0 if (dest / "child.pt").exists() else 3)
            except BaseException:
                os._exit(4)
        torch.save({"parent": 1}, dest / "parent.pt")
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert torch.load(dest / "child.pt") == {"child": 1}
    assert torch.load(dest / "parent.pt") == {"parent": 1}
    assert sorted(os.listdir(dest)) == ["child.pt", "parent.pt"]


def test_threads_saving_at_once_onto_hdfs(kit_mounts, shm_root):
    dest = fresh(kit_mounts["hdfs"], "threads")
    errors: list[BaseException] = []

    def save(index: int) -> None:
        try:
            for round_ in range(3):  # the same file again and again: the last replace wins, always whole
                torch.save({"i": index, "round": round_, "w": torch.full((1000,), index)}, dest / f"t{index}.pt")
        except BaseException as exc:
            errors.append(exc)

    with safestage.staged(shm_root, torch_save=True) as stage:
        threads = [threading.Thread(target=save, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert errors == [] and len(stage.records) == 12
    assert sorted(os.listdir(dest)) == [f"t{i}.pt" for i in range(4)]
    for i in range(4):
        loaded = torch.load(dest / f"t{i}.pt")
        assert loaded["round"] == 2 and torch.equal(loaded["w"], torch.full((1000,), i))


def test_background_publish_error_is_raised_at_the_end_of_the_block(kit_mounts, shm_root):
    dest = fresh(kit_mounts["close-eio"], "bg")
    with pytest.raises(PublishError) as info, safestage.staged(shm_root, torch_save=True, background=True):
        torch.save({"x": 1}, dest / "x.pt")  # returns once staged
    assert isinstance(info.value, RuntimeError) and info.value.errno == 5
    assert torch.load(info.value.staged_path) == {"x": 1}


def test_setting_precedence_and_errors_name_the_source():
    assert resolve(environ={}).torch_save is False
    assert resolve(environ={"SAFESTAGE_TORCH_SAVE": "1"}).torch_save is True
    assert resolve(environ={"SAFESTAGE_TORCH_SAVE": " "}).torch_save is False
    assert resolve(torch_save=False, environ={"SAFESTAGE_TORCH_SAVE": "yes"}).torch_save is False
    assert resolve(torch_save=True, environ={"SAFESTAGE_TORCH_SAVE": "0"}).torch_save is True
    with pytest.raises(ConfigError, match="from SAFESTAGE_TORCH_SAVE"):
        resolve(environ={"SAFESTAGE_TORCH_SAVE": "maybe"})
    with pytest.raises(ConfigError, match="from the torch_save argument"):
        safestage.staged(torch_save="yes")


SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import safestage                      # no staging code: the start-up hook did it
    import torch                          # imported after activation: the post-import hook patches it
    from safestage import _autoload
    dest = sys.argv[1]
    torch.save({"step": 3}, os.path.join(dest, "optimizer.pt"))
    stage = _autoload._stage
    print(json.dumps({
        "active": safestage.is_active(),
        "records": [[r.destination.name, r.publish] for r in (stage.records if stage else [])],
    }))
    """
)


def test_environment_activation_in_a_subprocess(kit_mounts, shm_root, tmp_path):
    dest = fresh(kit_mounts["mountpoint"], "env")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    env.update(SAFESTAGE_DIR=str(shm_root), SAFESTAGE_TORCH_SAVE="1")
    done = subprocess.run([sys.executable, str(script), str(dest)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == '{"active": true, "records": [["optimizer.pt", "direct"]]}'
    assert torch.load(dest / "optimizer.pt") == {"step": 3}
    assert os.listdir(dest) == ["optimizer.pt"]
    # Without the variable the same script leaves torch.save alone; a bad value warns and runs on.
    for value, records in (("0", "[]"), ("maybe", "[]")):
        env["SAFESTAGE_TORCH_SAVE"] = value
        done = subprocess.run([sys.executable, str(script), str(dest)], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert f'"records": {records}' in done.stdout
        if value == "maybe":
            assert "SAFESTAGE_TORCH_SAVE" in done.stderr and "not a boolean" in done.stderr


def test_safestage_run_torch_save_and_status(kit_mounts, shm_root, tmp_path):
    dest = fresh(kit_mounts["hdfs"], "run")
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    done = subprocess.run(
        [sys.executable, "-m", "safestage", "run", "--dir", str(shm_root), "--torch-save", "--",
         sys.executable, str(script), str(dest)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert '"records": [["optimizer.pt", "replace"]]' in done.stdout
    env.update(SAFESTAGE_DIR=str(shm_root), SAFESTAGE_TORCH_SAVE="1")
    status = subprocess.run([sys.executable, "-m", "safestage", "status"], env=env, capture_output=True, text=True, timeout=120)
    assert "torch.save staged" in status.stdout
    env["SAFESTAGE_TORCH_SAVE"] = "0"
    status = subprocess.run([sys.executable, "-m", "safestage", "status"], env=env, capture_output=True, text=True, timeout=120)
    assert "torch.save not staged" in status.stdout


@pytest.mark.regression("0.1 hostile review 2: torch save to a character device does not replace it")
def test_torch_save_to_a_character_device_does_not_replace_it(tmp_path: Path, shm_dir: Path) -> None:
    """torch.save(obj, "/dev/null") is a common way to measure or exercise serialization.
    With torch_save=True the wrapper stages it and publishes with `replace`, which renames a
    regular file over the device node (as root: /dev/null becomes a 1 kB regular file;
    otherwise EACCES where a plain torch.save works). Shown on a null
    device node made in tmp_path, never the real /dev/null."""
    null = tmp_path / "null"
    os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    with safestage.staged(shm_dir, torch_save=True):
        torch.save({"a": torch.ones(3)}, null)
    info = os.lstat(null)
    assert stat.S_ISCHR(info.st_mode), "the device node was replaced by a regular file"
    assert info.st_rdev == os.makedev(1, 3)
