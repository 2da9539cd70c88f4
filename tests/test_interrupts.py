"""Ctrl-C (SIGINT) at any moment of a save or a publish: the old file or the new one, nothing leaked, and the message says where the data is."""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from _support import (
    PY,
    arange_tensors,
    entries,
    filled_tensors,
    listing,
    loads_as,
    loads_equal,
    open_fds,
)
from safetensors.torch import load_file, save_file

import safestage
from safestage.testing import hostile_mount


def _interrupt_when_growing(path_of: Any, stop: threading.Event) -> threading.Thread:
    """SIGINT to this process once the file ``path_of()`` holds bytes: what Ctrl-C does to a
    process copying a checkpoint. A real signal, not _thread.interrupt_main(): the kernel
    gives a process-directed signal to the main thread, whose blocking waits (the saving
    thread waiting for a followed copy) it interrupts; interrupt_main() only sets a flag
    that a thread blocked in a lock never looks at until the wait ends."""

    def watch() -> None:
        while not stop.is_set():
            target = path_of()
            if target is not None and target.exists() and target.stat().st_size > 0:
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.001)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


@pytest.mark.regression("0.1 hostile review of the hardening (issue 9): ctrl c mid copy keeps the old file and leaks nothing")
@pytest.mark.parametrize(
    ("publish", "follow"), [("replace", False), ("direct", False), ("replace", None)]
)
def test_ctrl_c_mid_copy_keeps_the_old_file_and_leaks_nothing(mount_dir, stage_root, publish, follow):
    """follow=None (the default) follows this 128 MiB save: the copy starts while the writer
    writes, so the interrupt may come before there is a complete staged file to keep."""
    directory, backing = mount_dir("slow")
    dest = directory / "model.safetensors"
    save_file(arange_tensors(0), str(backing / "model.safetensors"))  # the previous checkpoint
    old_size = (backing / "model.safetensors").stat().st_size
    new = arange_tensors(1, numel=32 << 20)  # 128 MiB: ~0.3 s at 400 MB/s

    def being_written() -> Path | None:
        if publish == "direct":  # the final name itself, once it no longer holds the old file
            target = backing / "model.safetensors"
            with contextlib.suppress(FileNotFoundError):
                if target.stat().st_size not in (0, old_size):
                    return target
            return None
        temps = [n for n in os.listdir(backing) if n.endswith(".tmp")]
        return backing / temps[0] if temps else None

    fds = open_fds()
    stop = threading.Event()
    finished = False
    with safestage._api.force_follow(safestage.staged(stage_root, publish=publish), follow) as stage:
        watcher = _interrupt_when_growing(being_written, stop)
        with pytest.raises(KeyboardInterrupt):
            save_file(new, str(dest))
            finished = True
            time.sleep(5)
        stop.set()
        watcher.join()
    assert not finished, "the interrupt came after the save: the copy was too fast to hit"
    assert open_fds() == fds, "a destination fd leaked"
    names = listing(directory)
    assert not [n for n in names if n.endswith(".tmp")], f"our temp was left: {names}"
    if publish == "replace":
        assert names == ["model.safetensors"] and loads_equal(dest, arange_tensors(0))
    else:  # direct on POSIX: the documented state is "old file, or no file", never torn
        assert names in (["model.safetensors"], []), names
        if names:
            assert loads_equal(dest, arange_tensors(0))
    kept = list(stage_root.rglob("model.safetensors"))
    if follow is None and not kept:  # interrupted while the writer wrote: nothing complete
        assert [p for p in stage_root.rglob("*") if p.is_file()] == [], "a partial file was kept"
    else:
        assert len(kept) == 1 and loads_equal(kept[0], new), "the complete staged copy must be kept"
    assert stage.records == []


def _descriptors_into(directory: Path) -> list[str]:
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(str(directory)):
                found.append(target)
    return found


@pytest.mark.mounts
@pytest.mark.regression("0.1 hostile review 1: ctrl c while waiting for a background slot orphans the staged copy")
def test_ctrl_c_while_waiting_for_a_background_slot_leaves_no_orphaned_staged_copy(shm_root):
    """background=1: the second save is serialized, then waits for the
    first publish to free the slot. A Ctrl-C there (a notebook's "interrupt kernel", a
    training loop's Ctrl-C) leaves the complete staged copy in a private directory whose
    descriptor and flock stay open for the life of the process; the KeyboardInterrupt carries
    no note saying where the copy is (README: a Ctrl-C keeps the staged copy "named in the
    traceback"), and once the process exits nothing ever sweeps it (it holds a complete
    file). What the user loses: the save, silently, plus a leaked lock and disk space."""
    with hostile_mount("slow", mbps=5) as mount:
        stage = safestage.activate(shm_root, background=1)
        try:
            save_file(filled_tensors(1, numel=1 << 20), str(Path(mount.path) / "a.safetensors"))  # ~0.8 s
            timer = threading.Timer(0.3, _thread.interrupt_main)
            timer.start()
            note: list[str] = []
            try:
                save_file(filled_tensors(2), str(Path(mount.path) / "b.safetensors"))
                pytest.fail("the Ctrl-C did not land while waiting for the slot")
            except KeyboardInterrupt as exc:
                note = list(getattr(exc, "__notes__", []))
            timer.join()
        finally:
            stage.close()
        left = [d for d in entries(shm_root) if entries(shm_root / d)]
        held = _descriptors_into(shm_root)
        assert not held, f"descriptors into the staging root still open after close(): {held}"
        assert not left or any(d in " ".join(note) for d in left), (
            f"staged copies {left} kept in {shm_root}, and the KeyboardInterrupt says nothing ({note})"
        )


@pytest.mark.regression("0.1 hostile review 1: ctrl c after the replace keeps a needless copy and says the publish was interrupted")
def test_ctrl_c_after_the_replace_keeps_no_copy_of_the_published_save(shm_root, tmp_path):
    """publish="replace" with fsync: the temp is os.replace'd over the final name, then the
    directory is fsync'ed (on HDFS FUSE or NFS that takes a while). A Ctrl-C there: the new
    file IS at its destination, but publish_local sees its staged copy still present, keeps
    it, and notes "interrupted while publishing <dest>; the complete staged copy is kept".
    The copy holds a complete file, so no sweep or clean will ever remove it. What the user
    loses: disk space in the staging root, and a note that makes them believe the
    destination is stale. (The fault is injected with tests/_tap.py: a Ctrl-C cannot be timed
    to one syscall otherwise.)"""
    sys.path.insert(0, str(Path(__file__).parent))
    from _tap import Tap

    def save(name: str, tap: Tap) -> None:
        with safestage.staged(shm_root, publish="replace"), tap:
            save_file(filled_tensors(9), str(tmp_path / name))

    save("warm.safetensors", Tap())
    dry = Tap()
    save("dry.safetensors", dry)
    replaced = next(s.index for s in dry.steps if s.name == "replace")
    fsync_dir = next(s.index for s in dry.steps[replaced:] if s.name == "open" and s.module == "safestage._publish")
    notes: list[str] = []
    tap = Tap(at=fsync_dir, action="interrupt")
    try:
        save("model.safetensors", tap)
    except KeyboardInterrupt as exc:
        notes = list(getattr(exc, "__notes__", []))
    assert tap.fired is not None and tap.fired.name == "open" and str(tmp_path) in tap.fired.arg
    assert loads_as(tmp_path / "model.safetensors", 9.0), "the publish had completed"
    kept = [(d, entries(shm_root / d)) for d in entries(shm_root)]
    assert not kept, f"a copy of an already published file is kept forever: {kept}; note: {notes}"


ENDS_WITH_A_PENDING_PUBLISH = """
    import sys, torch, safestage
    from safetensors.torch import save_file
    safestage.activate(sys.argv[2], background=True)
    save_file({"w": torch.ones(4 << 20)}, sys.argv[1])   # 16 MiB at 5 MB/s: ~3 s to publish
    print("main done", flush=True)
"""


@pytest.mark.mounts
@pytest.mark.regression("0.1 hostile review 1: ctrl c twice while exit waits for a publish exits 0 and loses it")
def test_ctrl_c_twice_while_exit_waits_for_a_publish_lands_it_or_exits_nonzero(shm_root):
    """README: "at interpreter exit pending publishes are completed, never dropped" and "a
    program that lost a checkpoint never exits 0". The program ends while a background
    publish runs; the user, seeing it hang at exit, presses Ctrl-C twice. (Once, the Ctrl-C
    landed in concurrent.futures' join (ignored), the second in safestage's own at-exit wait,
    which caught BaseException and returned quietly.) The interpreter then exits 0 and kills the
    publisher thread mid-copy. What the user loses: the checkpoint (a temp is left beside
    it, the complete copy unnamed in the staging root), with exit status 0 and no message."""
    with hostile_mount("slow", mbps=5) as mount:
        dest = Path(mount.path) / "model.safetensors"
        base = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
        program = subprocess.Popen([PY, "-c", textwrap.dedent(ENDS_WITH_A_PENDING_PUBLISH), str(dest), str(shm_root)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=base)  # fmt: skip
        assert program.stdout.readline().strip() == "main done"
        time.sleep(0.5)
        program.send_signal(signal.SIGINT)  # lands in safestage's _complete_at_exit
        time.sleep(0.5)
        program.send_signal(signal.SIGINT)  # if the process is still there
        _, err = program.communicate(timeout=60)
        time.sleep(0.5)
        landed = loads_as(dest, 1.0)
        listing = entries(Path(mount.path))
    assert landed or (program.returncode != 0 and str(dest) in err), (
        f"exit {program.returncode}, destination {listing}, stderr tail {err[-200:]!r}"
    )


@pytest.mark.mounts
@pytest.mark.regression(
    "v0.2 hostile review: the first Ctrl-C at exit landed in concurrent.futures' worker join "
    "(threading._shutdown, before atexit), was printed as 'Exception ignored', and the process "
    "exited 0 with no safestage message"
)
def test_ctrl_c_while_exit_waits_for_a_background_publish_exits_130_naming_the_staged_copy(shm_root):
    """docs/guarantees.md: "A Ctrl-C while exit waits for a publish ends the process with
    status 130 and the same message, naming where each complete staged copy is kept". The
    program ends with a background publish of 32 MiB onto kit `slow` at 10 MB/s (~3 s) still
    running; one real SIGINT a second later."""
    with hostile_mount("slow", mbps=10) as mount:
        dest = Path(mount.path) / "model.safetensors"
        base = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
        code = ENDS_WITH_A_PENDING_PUBLISH.replace("4 << 20", "8 << 20")  # 32 MiB
        program = subprocess.Popen([PY, "-c", textwrap.dedent(code), str(dest), str(shm_root)],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=base)  # fmt: skip
        assert program.stdout.readline().strip() == "main done"
        time.sleep(1.0)  # the script has ended; exit is waiting for the publish
        program.send_signal(signal.SIGINT)
        _, err = program.communicate(timeout=120)
        kept = [shm_root / d / f for d in entries(shm_root) for f in entries(shm_root / d)]
    assert program.returncode == 130, (program.returncode, err[-2000:])
    assert f"safestage: interrupted at exit while publishing {dest}" in err, err[-2000:]
    assert len(kept) == 1 and f"the complete staged copy is kept at {kept[0]}" in err, (kept, err[-2000:])
    assert torch.equal(load_file(str(kept[0]))["w"], torch.ones(8 << 20)), "the kept copy is not the save"
    assert "Exception ignored" not in err, err[-2000:]
