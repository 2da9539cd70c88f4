"""Crash consistency: a saver SIGKILLed at random moments leaves the old file or the new one.

Each trial: the destination holds an OLD complete file (other size, other content); a real
interpreter process saves NEW tensors over it through safestage and is SIGKILLed at a random
moment of that save. Then, from what is on disk only:

- rename/replace destinations: the final name loads as the old tensors or the new ones, never
  a torn file (the point of the sibling temp + os.replace that HDFS FUSE needs, safetensors#787);
- ``direct`` (mountpoint-s3 cannot rename, safestage's answer to safetensors#792): old, new, or
  a file safetensors *refuses* to load; never one that loads with wrong data;
- every leftover beside the destination and in the staging root carries a safestage name
  (``_names`` parses it) owned by the killed pid, and ``python -m safestage clean`` removes
  exactly those of dead processes, keeping a staging directory only when it holds a complete
  copy of the new data, and nothing else (a planted file survives).

The phase each kill landed in is read from the leftovers (e.g. a partial temp file = killed
during the copy) and counted, so the table shows the kills really spread over the save.

Destinations: local disk (rename), /dev/shm -> disk (replace), the kit's hdfs (replace) and
mountpoint (direct; and direct of a new name each trial, followed: the final name is written
while the writer writes, so old = "missing"), and the real rclone-s3 and s3fs mounts (replace onto a local S3 server:
rclone uploads while it is written and renames by server-side copy + delete, s3fs uploads at
fsync/close). The run's trials (``SAFESTAGE_CRASH_TRIALS``, default 250: about 3 minutes on 2
shared cores) are shared by weight: a trial onto a real mount costs much more.

Speed: one fork server (tests/crash_child.py, started with sys.executable) imports torch once
and forks a saver per trial; the saver activates staging, reports ready, and starts the save
on SIGUSR1, so the kill window covers the save only.
"""

from __future__ import annotations

import errno
import json
import os
import random
import select
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pytest
import torch
from _support import CALIBRATION_RUNS, EXTRA_TRIALS
from crash_child import make_tensors
from safetensors import SafetensorError
from safetensors.torch import load_file, save, save_file

from safestage._names import _HOST, parse_stage_dir, parse_temp_name
from safestage._publish import RENAME_PROBE

CHILD = Path(__file__).with_name("crash_child.py")


BATCH = 13  # trials between two `safestage clean` runs (bounds disk use)


PLANTED = "notes-not-safestage.txt"


NEAR_MISS = ".m000.safetensors.safestage-host-1-XYZ.tmp"  # safestage-like, but no hex token


# Leftover-shaped entries whose owner (this test process) is alive: clean must keep them.
LIVE_TEMP = f".m000.safetensors.safestage-{_HOST}-{os.getpid()}-0123abcd.tmp"


LIVE_DIR = f"safestage-{_HOST}-{os.getpid()}-0123abcd"


OUTCOMES = ("old", "new", "refused", "wrong", "missing")


PHASES = (
    "before-staging",
    "serializing",
    "staged",
    "copying",
    "copied-before-replace",
    "published-cleanup",
    "completed",
)


class ForkServer:
    """Drives tests/crash_child.py over pipes, with a timeout on every read."""

    def __init__(self, log_path: Path) -> None:
        self._log = open(log_path, "wb")  # noqa: SIM115  (closed in close())
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            bufsize=0,
            env={k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")},
        )
        self._buffer = b""
        self.log_path = log_path
        self.expect("server", timeout=120)

    def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(message) + "\n").encode())

    def read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise AssertionError(
                    f"fork server silent for {timeout} s; log:\n{self.log_path.read_text()}"
                )
            chunk = os.read(fd, 65536)
            if not chunk:
                raise AssertionError(f"fork server exited; log:\n{self.log_path.read_text()}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def expect(self, key: str, timeout: float = 60) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Read until a message carrying ``key``; return it and the messages before it."""
        before = []
        while True:
            message = self.read(timeout)
            if "error" in message:
                raise AssertionError(f"saver failed: {message['error']}")
            if key in message:
                return message, before
            before.append(message)

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.send({"op": "quit"})
                self.proc.stdin.close()  # type: ignore[union-attr]
                self.proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(timeout=10)
        finally:
            self._log.close()


@pytest.fixture(scope="module")
def fork_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ForkServer]:
    server = ForkServer(tmp_path_factory.mktemp("crash-log") / "server.log")
    yield server
    server.close()


@dataclass
class Result:
    pid: int
    done: Optional[dict[str, Any]]
    signal: int


def run_save(
    server: ForkServer,
    dest: Path,
    root: Path,
    publish: str,
    numel: int,
    seed: int,
    delay: Optional[float],
    follow: Optional[bool] = None,
) -> Result:
    """One saver process: save NEW over ``dest``; SIGKILL it ``delay`` s after the start."""
    server.send(
        {
            "op": "trial",
            "dest": str(dest),
            "root": str(root),
            "publish": publish,
            "numel": numel,
            "seed": seed,
            "follow": follow,
        }
    )
    ready, _ = server.expect("ready")
    pid = int(ready["ready"])
    os.kill(pid, signal.SIGUSR1)  # go: the save starts now
    if delay is not None:
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)  # a zombie until reaped: never another process's pid
    server.send({"op": "reap", "pid": pid})
    reaped, before = server.expect("reaped", timeout=120)
    done = next((m for m in before if m.get("done") == pid), None)
    return Result(pid, done, int(reaped["signal"]))


@dataclass
class Destination:
    name: str
    directory: Path  # where the user saves (a mount path for kit modes)
    backing: Path  # the same directory, bypassing the FUSE mount (to plant OLD files fast)
    root: Path  # the staging root
    publish: str
    strategy: str  # what safestage must choose here
    numel: int  # float32 elements of the NEW file's main tensor
    atomic: bool  # rename/replace: torn files are never visible
    real: bool = False  # a real rclone/s3fs mount: old files are planted through it
    # A new name each trial, no old file, and follow=True asked for: a direct save of a new
    # file is still published only after the writer (direct saves are never followed).
    fresh: bool = False


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)
    phases: Counter = field(default_factory=Counter)
    kept_dirs: int = 0
    cleaned: int = 0
    timing: str = ""


SUMMARY: dict[str, Tally] = {}


def summary_table() -> str:
    header = f"{'destination':<24}{'trials':>7}" + "".join(f"{o:>9}" for o in OUTCOMES)
    lines = [header, "-" * len(header)]
    for name, tally in SUMMARY.items():
        total = sum(tally.outcomes.values())
        lines.append(f"{name:<24}{total:>7}" + "".join(f"{tally.outcomes[o]:>9}" for o in OUTCOMES))
    lines.append("")
    header = f"{'kill landed in (from leftovers)':<32}" + "".join(f"{n[:22]:>24}" for n in SUMMARY)
    lines += [header, "-" * len(header)]
    for phase in PHASES:
        lines.append(f"{phase:<32}" + "".join(f"{t.phases[phase]:>24}" for t in SUMMARY.values()))
    lines.append("")
    for name, tally in SUMMARY.items():
        lines.append(
            f"{name}: {tally.timing}; clean removed {tally.cleaned} leftovers, kept "
            f"{tally.kept_dirs} staging dirs holding a complete copy"
        )
    return "\n".join(lines)


# rclone-local is left out: its replace is the same code path as rclone-s3's, without an S3
# server behind it.
KINDS = [
    "disk-rename",
    "shm-to-disk-replace",
    "hdfs-replace",
    "mountpoint-direct",
    "mountpoint-followed-new",
    "rclone-s3-replace",
    "s3fs-replace",
]


# A destination's share of the run's trials. A trial onto a real mount costs far more than
# one onto the kit: an upload to the local S3 server (rclone: and its write-back delay).
WEIGHTS = {
    "disk-rename": 8,
    "shm-to-disk-replace": 8,
    "hdfs-replace": 8,
    "mountpoint-direct": 8,
    "mountpoint-followed-new": 6,
    "rclone-s3-replace": 2,
    "s3fs-replace": 4,
}


DEFAULT_TRIALS = 250  # the whole test in about 3 minutes on 2 shared cores


MIN_TRIALS = 8  # per destination, whatever the total: enough to hit the required phases


TRIALS_VARIABLE = "SAFESTAGE_CRASH_TRIALS"  # kept from conftest's purge of SAFESTAGE_*


def total_trials(settings: dict[str, str]) -> int:
    """Trials per run, all destinations together: $SAFESTAGE_CRASH_TRIALS or the default."""
    text = settings.get(TRIALS_VARIABLE, "").strip()
    if not text:
        return DEFAULT_TRIALS
    try:
        value = int(text)
    except ValueError:
        raise pytest.UsageError(f"{TRIALS_VARIABLE}={text!r}: expected a whole number of trials") from None
    if value < MIN_TRIALS * len(KINDS):
        raise pytest.UsageError(f"{TRIALS_VARIABLE}={value}: at least {MIN_TRIALS * len(KINDS)} ({MIN_TRIALS} per destination)")
    return value


def trials_for(kind: str, settings: dict[str, str]) -> int:
    share = total_trials(settings) * WEIGHTS[kind] / sum(WEIGHTS.values())
    return max(MIN_TRIALS, round(share))


@pytest.fixture(scope="module", autouse=True)
def _print_summary() -> Iterator[None]:
    yield
    if SUMMARY:
        print("\n\nCRASH CONSISTENCY SUMMARY\n" + summary_table())


def _make_destination(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Destination:
    if kind == "disk-rename":
        directory = tmp_path / "dest"
        directory.mkdir()
        root = tmp_path / "root"  # same filesystem: publish by rename
        root.mkdir()
        return Destination(kind, directory, directory, root, "auto", "rename", 6 << 20, True)
    if kind == "shm-to-disk-replace":
        directory = tmp_path / "dest"
        directory.mkdir()
        root = Path("/dev/shm") / f"safestage-crash-{uuid.uuid4().hex[:8]}"
        root.mkdir()
        return Destination(kind, directory, directory, root, "auto", "replace", 6 << 20, True)
    if kind.endswith("-replace") and kind.startswith(("rclone", "s3fs")):
        # Real mounts: no backing directory to plant the old files in behind the tool's back
        # (its directory cache would not see them for minutes): everything goes through it.
        real = request.getfixturevalue("real_mounts")[kind.removesuffix("-replace")]
        directory = Path(real.path) / f"crash-{uuid.uuid4().hex[:8]}"
        directory.mkdir()
        root = tmp_path / "root"
        root.mkdir()
        return Destination(kind, directory, directory, root, "auto", "replace", 1 << 20, True, real=True)
    mount = request.getfixturevalue("kit_mounts")[kind.split("-")[0]]
    name = f"crash-{uuid.uuid4().hex[:8]}"
    directory = Path(mount.path) / name
    directory.mkdir()
    root = tmp_path / "root"
    root.mkdir()
    if kind == "hdfs-replace":
        return Destination(
            kind, directory, Path(mount.backing) / name, root, "auto", "replace", 4 << 20, True
        )
    if kind == "mountpoint-followed-new":
        return Destination(
            kind, directory, Path(mount.backing) / name, root, "direct", "direct", 4 << 20, False,
            fresh=True,
        )  # fmt: skip
    assert kind == "mountpoint-direct"
    return Destination(
        kind, directory, Path(mount.backing) / name, root, "direct", "direct", 4 << 20, False
    )


def _old_numel(numel: int) -> int:
    return numel // 2 + 1000  # another size: a half-overwritten file cannot pass as old


def _equal(loaded: dict[str, torch.Tensor], expected: dict[str, Any]) -> bool:
    return sorted(loaded) == sorted(expected) and all(
        loaded[k].dtype == expected[k].dtype and torch.equal(loaded[k], expected[k])
        for k in expected
    )


def _load_retrying(path: Path) -> dict[str, torch.Tensor]:
    # mountpoint semantics: an object is unreadable (EPERM) until the FUSE release of its killed
    # writer is processed, which the kernel sends asynchronously. Bounded wait, not a timing check.
    for _ in range(200):
        try:
            return load_file(str(path))
        except PermissionError:
            time.sleep(0.01)
        except SafetensorError as exc:
            if f"(os error {errno.EPERM})" not in str(exc):
                raise
            time.sleep(0.01)
    return load_file(str(path))


def classify_destination(path: Path, old: Optional[dict[str, Any]], new: dict[str, Any]) -> str:
    if not os.path.lexists(path):
        return "missing"
    try:
        loaded = _load_retrying(path)
    except SafetensorError:
        return "refused"  # safetensors saw the file is incomplete: not silently wrong data
    if _equal(loaded, new):
        return "new"
    if old is not None and _equal(loaded, old):
        return "old"
    return "wrong"


@dataclass
class Leftovers:
    temps: list[tuple[str, int]]  # (name, size) beside the destination
    stage_dirs: list[tuple[str, list[str]]]  # (name, its entries) in the staging root


def leftovers_of(pid: int, dest: Destination, final: str) -> Leftovers:
    """This saver's leftovers; asserts every unknown entry carries a safestage name."""
    temps = []
    for name in os.listdir(dest.directory):
        if name in (PLANTED, NEAR_MISS, LIVE_TEMP) or (
            name.endswith(".safetensors") and not name.startswith(".")
        ):
            continue  # the planted files, the final names
        owner = parse_temp_name(name)
        assert owner is not None, f"a leftover beside the destination safestage cannot name: {name}"
        assert owner.is_this_host()
        if owner.pid == pid and name.startswith(f".{RENAME_PROBE}."):
            continue  # killed during auto's one-off empty-file rename probe: also clean's to remove
        if owner.pid == pid:
            assert name.startswith(f".{final}.safestage-"), f"temp {name} is not {final}'s"
            temps.append((name, os.lstat(dest.directory / name).st_size))
    stage_dirs = []
    for name in os.listdir(dest.root):
        owner = parse_stage_dir(name)
        assert owner is not None or name == PLANTED, (
            f"a staging-root leftover safestage cannot name: {name}"
        )
        if owner is not None and owner.pid == pid:
            stage_dirs.append((name, sorted(os.listdir(dest.root / name))))
    return Leftovers(temps, stage_dirs)


def phase_of(outcome: str, left: Leftovers, final: str, new_size: int, completed: bool) -> str:
    """Which part of the save the kill interrupted, read from what it left."""
    if completed:
        return "completed"
    staged_complete = any(final in entries for _, entries in left.stage_dirs)
    if outcome == "new":
        return "published-cleanup"  # replaced; killed in the dir fsync or removing the stage dir
    if left.temps:
        ((_, size),) = left.temps
        return "copied-before-replace" if size == new_size else "copying"
    if outcome == "refused":
        return "copying"  # direct: the final name is being rewritten
    if staged_complete:
        return "staged"  # serialized; killed in chmod/fsync before rename, or before the copy
    if left.stage_dirs:
        return "serializing"  # empty, or only safetensors' own hidden .tmpXXXXXX inside
    return "before-staging"


def run_clean(directory: Path) -> dict[str, Any]:
    completed = subprocess.run(
        [sys.executable, "-m", "safestage", "clean", "--json", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")},
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    return json.loads(completed.stdout)


def clean_and_check(
    dest: Destination, seeds: dict[int, int], final_names: list[str], tally: Tally
) -> None:
    """Run the real CLI on the destination dir and the staging root, then check what is left."""
    dest_report = run_clean(dest.directory)
    root_report = run_clean(dest.root)
    for entry in dest_report["entries"] + root_report["entries"]:
        if entry["name"] in (LIVE_TEMP, LIVE_DIR):
            assert entry["action"] == "kept", f"clean touched a live process's entry: {entry}"
            continue
        assert entry["pid"] in seeds, f"clean reported an entry no killed saver made: {entry}"
        assert entry["action"] in ("removed", "kept"), entry
        if entry["action"] == "kept":
            # Only a staging dir holding a finished file, the complete copy of a save killed
            # before its publish finished (checked below). Every other owner is dead.
            assert entry["kind"] == "staging-dir", entry
    tally.cleaned += dest_report["removed"] + root_report["removed"]
    finals_there = [n for n in final_names if os.path.lexists(dest.directory / n)]  # fresh: or none
    assert sorted(os.listdir(dest.directory)) == sorted(
        [*finals_there, PLANTED, NEAR_MISS, LIVE_TEMP]
    ), "clean must remove every temp of a dead saver and nothing else"
    assert (dest.directory / PLANTED).read_text() == "keep me"
    for name in os.listdir(dest.root):
        if name in (PLANTED, LIVE_DIR):
            continue
        entries = os.listdir(dest.root / name)
        finished = [e for e in entries if not e.startswith(".")]
        assert len(finished) == 1, f"clean kept {name} holding {entries}"
        owner = parse_stage_dir(name)
        assert owner is not None and owner.pid in seeds, name
        new = make_tensors(dest.numel, seeds[owner.pid])
        assert _equal(load_file(str(dest.root / name / finished[0])), new), (
            "a kept copy must be complete"
        )
        tally.kept_dirs += 1
        shutil.rmtree(dest.root / name)  # what the user does after copying it by hand


TAIL_S = 0.3


class KillPlanner:
    """Kill times spread over the whole save: the serialization, the publish (copy, fsync),
    its last part (between fsync and replace, the directory fsync, cleanup), and anywhere.

    Phase durations come from complete saves (calibration, and trials the kill came too late
    for) and follow the machine's load. If after the planned trials a phase that has real
    duration was never hit, a few extra kills aim at it, so the coverage check below does
    not depend on how busy the machine is."""

    def __init__(self, seed: str) -> None:
        self.rng = random.Random(seed)
        self.serialize: list[float] = []
        self.publish: list[float] = []
        self.waits: list[tuple[float, float]] = []  # (last fsync, rename) since the start

    def observe(self, done: dict[str, Any]) -> None:
        self.serialize.append(done["serialize"])
        self.publish.append(done["publish"])
        marks = done.get("marks", {})
        if "fsync" in marks and "replace" in marks:
            self.waits.append((marks["fsync"], marks["replace"]))

    def estimate(self) -> tuple[float, float]:
        return statistics.median(self.serialize[-9:]), statistics.median(self.publish[-9:])

    def planned(self, index: int) -> float:
        s, p = self.estimate()
        # The publish's last part: its last 40%, or its last TAIL_S where a stall makes the
        # publish long (rclone: 5 s waiting, then the upload and the rename in ~0.3 s).
        tail = min(0.4 * p, TAIL_S)
        strata = [(0.0, s), (s, s + p), (s + p - tail, (s + p) * 1.05), (0.0, (s + p) * 1.15)]
        return self.rng.uniform(*strata[index % len(strata)])

    def aimed_at(self, phase: str, attempt: int) -> float:
        s, p = self.estimate()
        # The first aims missed: the phase may come later on a slower machine, so the window
        # widens, never moves: its start stays where the phase starts when the machine is not
        # slower (a window moved later with each miss ended after a short publish, and every
        # kill then came once the save had completed).
        stretch = 1.0 + 0.5 * attempt
        if phase == "copied-before-replace" and self.waits:
            # Timed by the saver itself: from its last fsync of the complete temp to its
            # rename. On s3fs that is ~25 ms of a ~105 ms publish, which kills spread over the
            # whole publish (aimed ones too) hit in some runs and missed all 24 in one.
            recent = self.waits[-9:]
            start = statistics.median(fsync for fsync, _ in recent)
            end = statistics.median(rename for _, rename in recent)
            return self.rng.uniform(start, max(end, start + 1e-3))
        if phase == "serializing":
            return self.rng.uniform(0.2 * s, s * stretch)
        return self.rng.uniform(s, (s + p) * stretch)


# What each strategy must show kills in: the serialization, and the publish's long part.
REQUIRED_PHASES = {
    "rename": ("serializing", "staged"),
    "replace": ("serializing", "copying"),
    "direct": ("serializing", "copying"),
}


# The real mounts get small files (4 MiB: every trial is an upload to the S3 server), whose
# serialization into the local staging root takes ~2 ms, less than the jitter of a process's
# start: kills there are covered by the kit's destinations (the same local code, bigger files).
# What the real mounts must show is kills in their publish's long part. rclone without a write
# cache streams each write to the server, so its copy is over in a few ms and the long part is
# the close (the upload completes) before the replace: a temp of full size under its own name.
# s3fs buffers the writes in its local cache (4 MiB in a few ms of a ~110 ms publish) and
# uploads at the fsync: its long part is the same, and kills in its short copy were hit in
# some runs and missed in others (aimed kills too), which said nothing about safestage.
REQUIRED_BY_DESTINATION = {
    # Followed: the copy into the final name starts with the serialization, so a kill while
    # serializing finds the final name partly written, which reads as "copying".
    "mountpoint-followed-new": ("copying",),
    "rclone-s3-replace": ("copied-before-replace",),
    "s3fs-replace": ("copied-before-replace",),
}


def _plant_old(dest: Destination, final: str, numel: int, *, seed: int) -> Optional[dict[str, Any]]:
    if dest.fresh:
        return None  # a new name: nothing there before the save
    old = make_tensors(_old_numel(numel), 1000 + seed)
    if dest.real:
        # One sequential write of a new file: what rclone takes (save_file's ftruncate it refuses).
        with open(dest.backing / final, "wb") as out:
            out.write(save(old))
    else:
        save_file(old, str(dest.backing / final))  # through the backing dir: no kit fault on the way
    return old


@pytest.mark.mounts
@pytest.mark.parametrize("kind", KINDS)
def test_a_save_killed_at_any_moment_leaves_the_old_file_or_the_new_one(kind, tmp_path, request, fork_server, suite_settings):
    dest = _make_destination(kind, tmp_path, request)
    try:
        _crash_trials(dest, fork_server, trials_for(kind, suite_settings))
    finally:
        if dest.root.is_relative_to("/dev/shm"):
            shutil.rmtree(dest.root, ignore_errors=True)
        shutil.rmtree(dest.backing, ignore_errors=True)


def _crash_trials(dest: Destination, server: ForkServer, trials: int) -> None:
    tally = SUMMARY.setdefault(dest.name, Tally())
    planner = KillPlanner(f"safestage-crash-{dest.name}")
    (dest.directory / PLANTED).write_text("keep me")
    (dest.directory / NEAR_MISS).write_text("not ours either")
    (dest.root / PLANTED).write_text("keep me")
    (dest.directory / LIVE_TEMP).write_text("a live saver's temp")
    (dest.root / LIVE_DIR).mkdir()

    # Calibration: complete saves (no kill) give the phase durations.
    for index in range(CALIBRATION_RUNS):
        final = f"calibrate{index}.safetensors"
        _plant_old(dest, final, dest.numel, seed=500 + index)
        result = run_save(
            server, dest.directory / final, dest.root, dest.publish, dest.numel, 500 + index, None,
            follow=True if dest.fresh else None,
        )  # fmt: skip
        assert result.done is not None and result.done["strategy"] == dest.strategy, result
        assert _equal(_load_retrying(dest.directory / final), make_tensors(dest.numel, 500 + index))
        planner.observe(result.done)
        (dest.backing / final).unlink()
    s, p = planner.estimate()
    tally.timing = f"a save takes ~{(s + p) * 1e3:.0f} ms (serialize {s * 1e3:.0f} ms, publish {p * 1e3:.0f} ms"
    if planner.waits:
        fsync, rename = (statistics.median(marks) for marks in zip(*planner.waits))
        tally.timing += f"; the fsync before the rename at {fsync * 1e3:.0f} ms, the rename at {rename * 1e3:.0f} ms"
    tally.timing += ")"
    probe = dest.root / "size-probe"
    save_file(make_tensors(dest.numel, 0), str(probe))
    new_size = os.stat(probe).st_size  # the same for every seed: only the values differ
    probe.unlink()

    required = REQUIRED_BY_DESTINATION.get(dest.name, REQUIRED_PHASES[dest.strategy])
    log: list[str] = []
    finals: list[str] = []
    seeds: dict[int, int] = {}
    for index in range(trials + EXTRA_TRIALS):
        if index < trials:
            delay = planner.planned(index)
        else:
            missing = [phase for phase in required if not tally.phases[phase]]
            if not missing:
                break
            delay = planner.aimed_at(missing[0], index - trials)
        final = f"m{index:03d}.safetensors"
        old = _plant_old(dest, final, dest.numel, seed=index)
        new = make_tensors(dest.numel, index)
        result = run_save(
            server, dest.directory / final, dest.root, dest.publish, dest.numel, index, delay,
            follow=True if dest.fresh else None,
        )  # fmt: skip
        completed = result.done is not None
        assert completed or result.signal == signal.SIGKILL, result
        seeds[result.pid] = index
        if result.done is not None:
            planner.observe(result.done)

        outcome = classify_destination(dest.directory / final, old, new)
        left = leftovers_of(result.pid, dest, final)
        phase = phase_of(outcome, left, final, new_size, completed)
        tally.outcomes[outcome] += 1
        tally.phases[phase] += 1
        log.append(f"trial {index}: kill at {delay * 1e3:.1f} ms -> {phase}, final name {outcome}")
        context = f"{log[-1]}\n{summary_table()}"
        allowed = {"old", "new"} if dest.atomic else {"old", "new", "refused"}
        if dest.fresh:
            allowed = {"missing", "new", "refused"}
        assert outcome in allowed, f"{dest.name}: the final name holds a {outcome} file; {context}"
        if completed:
            assert outcome == "new" and not left.temps and not left.stage_dirs, context
        if left.temps:
            assert outcome == "old", (
                f"a temp file exists but the final name was replaced; {context}"
            )
        finals.append(final)
        if len(finals) == BATCH:
            _clean_batch(dest, seeds, finals, tally)
            finals, seeds = [], {}
    if finals:
        _clean_batch(dest, seeds, finals, tally)

    table = summary_table()
    print(f"\n{dest.name}:\n{table}")
    assert sum(tally.outcomes.values()) >= trials, table
    # The kills must really have spread over the save, or this test proves little.
    for phase in required:
        assert tally.phases[phase], f"no kill landed in {phase}:\n" + "\n".join(log) + f"\n{table}"


def _clean_batch(dest: Destination, seeds: dict[int, int], finals: list[str], tally: Tally) -> None:
    clean_and_check(dest, seeds, finals, tally)
    for name in finals:
        (dest.backing / name).unlink(missing_ok=dest.fresh)
