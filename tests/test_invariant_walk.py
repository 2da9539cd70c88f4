"""The invariant walk (issue 9): the whole life of a save, with a fault at every step.

The life is ``activate -> save_file -> close`` (tests/walk_child.py). A dry run through a
tap (tests/_tap.py) lists every system call safestage itself makes in it: root checks, the
sweep, the private directory and its lock, the rename probe, each step of the publish, the
clean-up. Then, for every step N and each action, the life is lived again with the action
at step N:

- ``oserror``: the call fails with the errno that call gets from a failing filesystem;
- ``interrupt``: KeyboardInterrupt there (what Ctrl-C does);
- ``kill``: SIGKILL there (a fork server starts each saver), then ``safestage clean``;
- ``fork``: the process forks there, and the child saves a file of its own;
- ``clean``: ``safestage clean`` of the destination directory and of the staging root runs
  there from another process and from another PID namespace (``unshare --pid --fork``).

After each: the destination holds the old or the new complete file (``direct`` on a POSIX
disk may instead hold nothing, as README says; after a SIGKILL also a file safetensors
refuses to load), never one that loads with other data; no temp file of ours is left unless
the error names it; every staging directory left holds a complete copy of the new data and
the error says where; no descriptor leaked; an error is safestage's own (or the injected
KeyboardInterrupt) and names the injected errno; a save under a concurrent clean succeeds.

Five destinations: disk with the root on the same disk (rename), disk with the root on
/dev/shm (replace), the same with publish="direct", the kit's hdfs (auto: probe, replace)
and the kit's mountpoint (auto: probe, direct), plus replace with background=True.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from _support import SHM, open_fds, tiered
from _tap import ERRNO, Tap
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from walk_child import life, new_tensors, old_tensors

import safestage
from safestage import PublishError, StagingError, _save
from safestage._clean import clean
from safestage._mounts import capabilities
from safestage._names import KEPT_RECORD, parse_stage_dir, parse_temp_name
from safestage._publish import RENAME_PROBE

HERE = Path(__file__).parent
# Where a save is walked: a rename on disk, replace (sync and background), direct, the kit's hdfs
# and mountpoint mounts.
PLACE_NAMES = ["rename", "replace", "replace-bg", "direct", "hdfs", "mountpoint"]


ACTIONS = ("oserror", "interrupt", "fork", "clean", "kill")


@dataclass
class Place:
    name: str
    directory: Path  # where the user saves
    backing: Path  # the same directory, bypassing FUSE
    root: Path
    publish: str
    background: bool
    atomic: bool  # rename/replace: old or new only

    @property
    def dest(self) -> Path:
        return self.directory / "model.safetensors"

    def reset(self) -> None:
        for directory in (self.backing, self.root):
            for entry in os.listdir(directory):
                path = directory / entry
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        save_file(old_tensors(), str(self.backing / "model.safetensors"))
        capabilities.clear()  # every life probes again: the probe is walked too
        _save._roots.clear()  # every life is a process's first use of its root: checked, swept


@pytest.fixture(scope="module")
def places(tmp_path_factory: pytest.TempPathFactory, kit_mounts: dict[str, Any]) -> Iterator[dict[str, Place]]:
    base = tmp_path_factory.mktemp("walk")
    shm = SHM / f"safestage-walk-{uuid.uuid4().hex[:8]}"
    made: dict[str, Place] = {}

    def make(name: str, directory: Path, backing: Path, root: Path, publish: str = "auto",
             background: bool = False, atomic: bool = True) -> None:  # fmt: skip
        for path in (backing, root):
            path.mkdir(parents=True, exist_ok=True)
        made[name] = Place(name, directory, backing, root, publish, background, atomic)

    make("rename", base / "rename", base / "rename", base / "rename-root")
    make("replace", base / "replace", base / "replace", shm / "replace-root")
    make("replace-bg", base / "replace-bg", base / "replace-bg", shm / "bg-root", background=True)
    make("direct", base / "direct", base / "direct", shm / "direct-root", publish="direct", atomic=False)
    for mode in ("hdfs", "mountpoint"):
        mount = kit_mounts[mode]
        name = f"walk-{uuid.uuid4().hex[:8]}"
        make(mode, Path(mount.path) / name, Path(mount.backing) / name, base / f"{mode}-root",
             atomic=mode != "mountpoint")  # fmt: skip
    yield made
    shutil.rmtree(shm, ignore_errors=True)


def steps_of(place: Place) -> list[Any]:
    place.reset()
    with Tap() as tap:
        life(place.dest, place.root, place.publish, place.background)
    assert load_equal(place.dest, new_tensors()), "the dry run must save"
    return tap.steps


def load_equal(path: Path, expected: dict[str, torch.Tensor]) -> bool:
    loaded = load_file(str(path))
    return sorted(loaded) == sorted(expected) and all(torch.equal(loaded[k], v) for k, v in expected.items())


def state_of(path: Path) -> str:
    """"old", "new", "absent", "refused" (safetensors will not load it) or "wrong"."""
    if not path.exists():
        return "absent"
    try:
        loaded = load_file(str(path))
    except SafetensorError:
        return "refused"
    for name, expected in (("old", old_tensors()), ("new", new_tensors())):
        if sorted(loaded) == sorted(expected) and all(torch.equal(loaded[k], v) for k, v in expected.items()):
            return name
    return "wrong"


def leftovers(place: Place) -> tuple[list[str], list[Path]]:
    """(our temp names beside the destination, private directories in the root)."""
    temps = [n for n in os.listdir(place.directory) if parse_temp_name(n) is not None]
    private = [place.root / n for n in os.listdir(place.root) if parse_stage_dir(n) is not None]
    return temps, private


def check_after(place: Place, outcome: Optional[BaseException], label: str, *, allowed: set[str],
                step: Any = None, said: Optional[Warnings] = None) -> None:  # fmt: skip
    state = state_of(place.dest)
    if outcome is None:
        assert state == "new", f"{label}: the save returned but the destination is {state}"
    else:
        assert state in allowed, f"{label}: {state} after {outcome!r}"
    assert sorted(n for n in os.listdir(place.directory) if parse_temp_name(n) is None) in (
        ["model.safetensors"], [] if "absent" in allowed else ["model.safetensors"],
    ), f"{label}: {os.listdir(place.directory)}"  # fmt: skip
    temps, private = leftovers(place)
    told = " ".join([_text(outcome) if outcome is not None else "", *(said.lines if said else [])])
    for name in temps:
        assert name in told, f"{label}: temp {name} left, and neither the error nor a WARNING names it"
    for directory in private:
        files = [p for p in directory.rglob("*") if p.is_file() and p.name != KEPT_RECORD]
        if files and isinstance(outcome, PublishError):
            # The copy of a failed publish says what it is for (clean shows it; a recover reads it).
            record = json.loads((directory / KEPT_RECORD).read_text())
            assert record["destination"] == str(place.dest), f"{label}: {record}"
        if not files and step is not None and directory.name in step.arg:
            continue  # removing this very directory failed: empty, swept once we are gone
        assert files, f"{label}: an empty staging directory {directory.name} was left"
        for file in files:
            assert load_equal(file, new_tensors()), f"{label}: {file} is kept but not complete"
            assert str(file) in told or str(directory) in told, (
                f"{label}: {file} is kept, and neither the error nor a WARNING says where"
            )


def _text(exc: BaseException) -> str:
    return " ".join([str(exc), *getattr(exc, "__notes__", [])])


def check_error(outcome: BaseException, action: str, step: Any, label: str) -> None:
    if action == "interrupt":
        assert isinstance(outcome, KeyboardInterrupt), f"{label}: {outcome!r}"
        return
    assert isinstance(outcome, (PublishError, StagingError)), f"{label}: not safestage's own error: {outcome!r}"
    code = ERRNO[step.name]
    assert outcome.errno == code or errno.errorcode[code] in str(outcome) or f"[Errno {code}]" in str(outcome), (
        f"{label}: the error does not name the injected {errno.errorcode[code]}: {outcome}"
    )
    assert "\n" not in str(outcome)


class Warnings(logging.Handler):
    """safestage's WARNING and ERROR lines during one life: where a leftover may be named."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def live_once(place: Place, tap: Tap, said: Optional[Warnings] = None) -> Optional[BaseException]:
    logger = logging.getLogger("safestage")
    handler = said or Warnings()
    logger.addHandler(handler)
    try:
        with tap:
            life(place.dest, place.root, place.publish, place.background)
    except BaseException as exc:  # noqa: BLE001 - the outcome is what we check
        return exc
    finally:
        logger.removeHandler(handler)
    return None


@pytest.mark.parametrize("place_name", ["rename", "replace", "replace-bg", "direct", "hdfs", "mountpoint"])
@pytest.mark.parametrize("action", ["oserror", "interrupt"])
def test_fault_at_every_step(places, place_name, action):
    place = places[place_name]
    steps = steps_of(place)
    fired = Counter()
    for step in steps:
        if action == "oserror" and step.module == "safestage._paths":
            # A destination the kernel will not resolve is handed to the original writer,
            # which raises its own error, as a plain save does (test_paths covers it).
            continue
        place.reset()
        fds = open_fds()
        tap = Tap(at=step.index, action=action)
        said = Warnings()
        outcome = live_once(place, tap, said)
        assert not safestage.is_active(), "an activation outlived its block"
        label = f"{place.name} {action} at step {step.index} ({step.name} {step.arg})"
        if tap.fired is None:
            assert outcome is None, f"{label}: failed though nothing was injected: {outcome!r}"
            continue
        fired[step.name] += 1
        assert open_fds() == fds, f"{label}: a descriptor leaked"
        if outcome is not None:
            check_error(outcome, action, tap.fired, label)
        allowed = {"old", "new"} | (set() if place.atomic else {"absent"})
        check_after(place, outcome, label, allowed=allowed, step=tap.fired, said=said)
    reachable = [s for s in steps if action != "interrupt" or s.thread == "MainThread"]
    assert sum(fired.values()) >= len(reachable) // 2, f"too few injections fired: {fired}"


@pytest.mark.parametrize("place_name", tiered(PLACE_NAMES, ci=["replace-bg", "direct", "hdfs", "mountpoint"]))
def test_fork_at_every_step(places, place_name):
    """A child forked at any step saves a file of its own, which lands; the parent's save
    lands too; neither waits for the other's publishes."""
    place = places[place_name]
    steps = steps_of(place)
    child_tensors = new_tensors(2)  # built before any fork: no torch work in the child
    for step in steps:
        place.reset()
        child_dest = place.directory / "child.safetensors"
        tap = Tap(at=step.index, action="fork")
        tap.child = lambda: _child_save(place, child_dest, child_tensors)
        outcome = live_once(place, tap)
        label = f"{place.name} fork at step {step.index} ({step.name} {step.arg})"
        assert tap.forked is not None, label
        status = _reap(tap.forked, timeout=60)
        assert status == 0, f"{label}: the child ended with {status}"
        assert outcome is None, f"{label}: the parent's save failed: {outcome!r}"
        assert state_of(place.dest) == "new", label
        assert load_equal(child_dest, new_tensors(2)), f"{label}: the child's save did not land"
        temps, private = leftovers(place)
        assert not temps and not private, f"{label}: left {temps} {private}"


def _child_save(place: Place, dest: Path, tensors: Any) -> int:
    life(dest, place.root, place.publish, place.background, tensors)
    return 0


def _reap(pid: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return -999  # hung


class Cleaner:
    """tests/_cleaner.py in its own process: clean(path) -> what it did."""

    def __init__(self, prefix: list[str]) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, str(HERE / "_cleaner.py")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, bufsize=1,
        )  # fmt: skip
        assert json.loads(self.proc.stdout.readline())["ready"]  # type: ignore[union-attr]

    def clean(self, path: Path) -> list[dict[str, Any]]:
        self.proc.stdin.write(f"{path}\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return json.loads(self.proc.stdout.readline())["entries"]  # type: ignore[union-attr]

    def close(self) -> None:
        self.proc.stdin.close()  # type: ignore[union-attr]
        self.proc.wait(10)


@pytest.fixture(scope="module")
def cleaners() -> Iterator[list[Cleaner]]:
    made = [Cleaner([]), Cleaner(["unshare", "--pid", "--fork", "--mount-proc"])]
    yield made
    for cleaner in made:
        cleaner.close()


@pytest.mark.parametrize("place_name", ["rename", "replace", "replace-bg", "direct", "hdfs", "mountpoint"])
def test_concurrent_clean_at_every_step(places, cleaners, place_name):
    place = places[place_name]
    steps = steps_of(place)
    removed: list[Any] = []

    def clean_now() -> None:
        for cleaner in cleaners:
            for path in (place.directory, place.root):
                removed.extend(e for e in cleaner.clean(path) if e.get("action") == "removed")

    for step in steps:
        place.reset()
        removed.clear()
        tap = Tap(at=step.index, action="callback", callback=clean_now)
        outcome = live_once(place, tap)
        label = f"{place.name} clean at step {step.index} ({step.name} {step.arg})"
        assert outcome is None, f"{label}: a concurrent clean broke the save: {outcome!r}"
        unclaimed = _being_claimed(tap.steps, step.index)
        assert all(
            entry["name"] == unclaimed
            or (unclaimed == "the probe's renamed file" and RENAME_PROBE in entry["name"])
            for entry in removed
        ), (
            f"{label}: a cleaner removed live entries: {removed}"
        )
        assert state_of(place.dest) == "new", label
        temps, private = leftovers(place)
        assert not temps and not private, f"{label}: left {temps} {private}"


def _being_claimed(steps: list[Any], index: int) -> Optional[str]:
    """The entry a cleaner may take at step ``index`` by the protocol's design, the owner
    losing nothing: a staging directory or temp file made at most four steps before and not
    locked yet (its owner then finds it gone or locked and makes another), or a temp between
    the checked close of its writing descriptor (which held its lock) and its rename (the
    rename then finds it gone, and the owner copies again from its staged copy)."""
    step = steps[index]
    if step.name in ("stat", "replace") and parse_temp_name(_base(step.arg)) is not None:
        return _base(step.arg)  # the size check after close, and the rename
    renamed_probe = [s for s in steps[:index] if s.name == "replace" and RENAME_PROBE in s.arg]
    if renamed_probe and step.name == "unlink" and RENAME_PROBE in step.arg:
        return "the probe's renamed file"  # ours to delete right now: whoever does it is fine
    for earlier in reversed(steps[max(0, index - 4) : index + 1]):
        if earlier.name == "flock" and earlier.index < index:
            return None
        if earlier.name in ("mkdir", "open") and _base(earlier.arg).startswith(("safestage-", ".")):
            return _base(earlier.arg)
    return None


def _base(arg: str) -> str:
    return arg.rstrip("')").rsplit("/", 1)[-1]


class KillServer:
    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "walk_child.py"), str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, bufsize=1,
        )  # fmt: skip
        assert "server" in json.loads(self.proc.stdout.readline())  # type: ignore[union-attr]

    def trial(self, place: Place, at: int) -> dict[str, Any]:
        request = {"dest": str(place.dest), "root": str(place.root), "publish": place.publish,
                   "background": place.background, "at": at}  # fmt: skip
        self.proc.stdin.write(json.dumps(request) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        return json.loads(self.proc.stdout.readline())  # type: ignore[union-attr]

    def close(self) -> None:
        self.proc.stdin.close()  # type: ignore[union-attr]
        self.proc.wait(10)


@pytest.fixture(scope="module")
def kill_server() -> Iterator[KillServer]:
    server = KillServer()
    yield server
    server.close()


@pytest.mark.parametrize("place_name", ["rename", "replace", "replace-bg", "direct", "hdfs", "mountpoint"])
def test_sigkill_at_every_step_then_clean(places, kill_server, place_name):
    place = places[place_name]
    steps = steps_of(place)
    for step in steps:
        place.reset()
        answer = kill_server.trial(place, step.index)
        label = f"{place.name} SIGKILL at step {step.index} ({step.name} {step.arg})"
        assert answer["signal"] == signal.SIGKILL, f"{label}: the saver was not killed: {answer}"
        allowed = {"old", "new"} | (set() if place.atomic else {"absent", "refused"})
        state = state_of(place.dest)
        assert state in allowed, f"{label}: {state}"
        for directory in (place.directory, place.root):
            for entry in clean(directory):
                assert entry.action in ("removed", "kept"), f"{label}: {entry}"
                if entry.action == "kept":
                    assert entry.kind == "staging-dir" and "complete copy" in entry.reason, f"{label}: {entry}"
        temps, private = leftovers(place)
        assert not temps, f"{label}: clean left {temps}"
        for directory in private:  # kept: it holds the only complete copy of the new data
            files = [p for p in directory.rglob("*") if p.is_file() and p.name != KEPT_RECORD]
            assert files and all(load_equal(f, new_tensors()) for f in files), f"{label}: {directory}"
        assert state_of(place.dest) == state, f"{label}: clean changed the destination"
