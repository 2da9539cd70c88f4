"""Crash consistency of whole checkpoints: a process committing one with staged_dir is
SIGKILLed at random moments; afterwards latest_complete must never name a directory whose
files do not all match its commit file.

Each trial: the parent holds ``checkpoint-1`` (complete, generation A) and, in the re-commit
half of the trials, ``checkpoint-2`` (complete, generation B). A fresh interpreter
(tests/ckpt_crash_child.py) commits generation C to ``checkpoint-2`` and is SIGKILLed at a
random moment: while writing the local directory, removing the old commit file, publishing
files, writing the commit file, removing its staging directory. Every generation has the
same files with the same sizes, so only the invalidation and the digests can tell them apart.
Then, from what is on disk only:

- ``latest_complete(parent)`` is checkpoint-2 or checkpoint-1 (never None: checkpoint-1 is
  untouched), and the directory it names holds exactly one generation, the one its commit
  file lists (every file's bytes compared with the generation's, CRC-32s computed here):
  otherwise it is a WRONG answer, and the test fails;
- checkpoint-2 is either complete with generation C (the kill came after the commit file),
  complete with generation B (before the old commit file was removed), or not complete;
- the staging root holds nothing, or one directory that ``safestage clean`` keeps because
  it holds the files that had not landed (each with generation C's bytes), or removes
  because it is marked disposable; the destination holds no temp file after a clean.

Trials come from SAFESTAGE_CKPT_CRASH_TRIALS (default 240, about 3 minutes on 2 cores),
shared by weight by the six destinations: disk (staging root on the same filesystem:
rename), kit hdfs (replace), kit mountpoint (direct), the real s3fs and rclone-s3 mounts (replace, moto
S3; a commit there takes ~2 s, so it gets a smaller share) and an s3:// URL with no mount (upload,
moto S3: objects, then the commit object created last; "latest" there is one LIST and one GET).
"""

from __future__ import annotations

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
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
from _stores import new_bucket
from _support import CALIBRATION_RUNS, EXTRA_TRIALS
from ckpt_crash_child import generation

import safestage
from safestage import COMMIT_NAME, _object_store
from safestage._clean import clean
from safestage._destination import ObjectURL, url_of
from safestage._names import DISPOSABLE_MARKER, parse_stage_dir, parse_temp_name
from safestage.checkpoint._manifest import FileEntry, new_manifest

CHILD = Path(__file__).with_name("ckpt_crash_child.py")


# Trials are shared by weight: a commit onto s3fs or rclone (moto) takes ~2 s, elsewhere ~0.2 s.
WEIGHTS = {
    "disk-rename": 3,
    "hdfs-replace": 3,
    "mountpoint-direct": 3,
    "s3fs-replace": 1,
    "rclone-s3-replace": 1,
    "s3-url-upload": 2,
}


DESTINATIONS = tuple(WEIGHTS)


DEFAULT_TRIALS = 240  # about 3 minutes on 2 shared cores


MIN_TRIALS = 12  # per destination: enough to see every outcome


TRIALS_VARIABLE = "SAFESTAGE_CKPT_CRASH_TRIALS"  # kept from conftest's purge of SAFESTAGE_*


GEN_A, GEN_B = 1, 2  # checkpoint-1, and checkpoint-2 before a re-commit


OUTCOMES = ("new", "old-kept", "fell-back", "wrong")


PHASES = ("before-staging", "writing", "publishing", "committed-cleanup", "completed")


@dataclass
class Destination:
    name: str
    parent: Path  # through the mount
    backing: Optional[Path]  # the same directory bypassing FUSE (None on s3fs)
    root: Path
    publish: str
    strategy: str
    url: Optional[str] = None  # an object-store run URL: parent and backing are unused then

    @property
    def run(self) -> str:
        """What the child commits under and latest_complete reads: the run's path or URL."""
        return self.url or str(self.parent)

    def read(self, checkpoint: str, relative: str) -> bytes:
        """A file of a checkpoint, as the destination holds it (the server's object for a URL)."""
        if self.url is None:
            return (self.parent / checkpoint / relative).read_bytes()
        data = _object_store.read(_url(f"{self.url}/{checkpoint}/{relative}"))
        if data is None:
            raise FileNotFoundError(f"{self.url}/{checkpoint}/{relative}")
        return data

    def write(self, checkpoint: str, relative: str, data: bytes) -> None:
        """Plant a file without safestage's publish path (the backing directory; a plain PUT)."""
        if self.url is not None:
            _object_store.put_bytes(_url(f"{self.url}/{checkpoint}/{relative}"), data)
            return
        target = (self.backing or self.parent) / checkpoint / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)

    def exists(self, checkpoint: str, relative: str = "") -> bool:
        if self.url is None:
            return (self.parent / checkpoint / relative).exists()
        under = _url(f"{self.url}/{checkpoint}")
        if relative:
            return _object_store.head(under / relative) is not None
        return bool(_object_store.listing(under))

    def remove(self, checkpoint: str) -> None:
        if self.url is not None:
            under = _url(f"{self.url}/{checkpoint}")
            _object_store.delete([under / info.key[len(under.prefix):] for info in _object_store.listing(under)])
            return
        remove_checkpoint(self, checkpoint)


def _url(text: str) -> ObjectURL:
    parsed = url_of(text)
    assert isinstance(parsed, ObjectURL), text
    return parsed


@dataclass
class Tally:
    outcomes: Counter[str] = field(default_factory=Counter)
    phases: Counter[str] = field(default_factory=Counter)
    killed: int = 0  # trials whose commit the SIGKILL cut short (the rest had finished)
    kept: int = 0
    removed: int = 0
    wrong: list[str] = field(default_factory=list)
    timing: str = ""


SUMMARY: dict[str, Tally] = {}


def summary_table() -> str:
    lines = [f"{'destination':<20}{'trials':>7}{'killed':>7}" + "".join(f"{o:>11}" for o in OUTCOMES)]
    for name, tally in SUMMARY.items():
        total = sum(tally.outcomes.values())
        lines.append(
            f"{name:<20}{total:>7}{tally.killed:>7}" + "".join(f"{tally.outcomes[o]:>11}" for o in OUTCOMES)
        )
    lines.append("")
    lines.append(f"{'kill landed in':<20}" + "".join(f"{n[:18]:>20}" for n in SUMMARY))
    for phase in PHASES:
        lines.append(f"{phase:<20}" + "".join(f"{t.phases[phase]:>20}" for t in SUMMARY.values()))
    for name, tally in SUMMARY.items():
        lines.append(
            f"{name}: {tally.timing}; clean kept {tally.kept} staging dirs holding files that had "
            f"not landed, removed {tally.removed} leftovers"
        )
    return "\n".join(lines)


@pytest.fixture(scope="module", autouse=True)
def _print_summary() -> Iterator[None]:
    yield
    if SUMMARY:
        print("\n\nCHECKPOINT CRASH SUMMARY\n" + summary_table())


def trials_for(kind: str, settings: dict[str, str]) -> int:
    text = settings.get(TRIALS_VARIABLE, "").strip()
    try:
        total = int(text) if text else DEFAULT_TRIALS
    except ValueError:
        raise pytest.UsageError(f"{TRIALS_VARIABLE}={text!r}: expected a whole number of trials") from None
    return max(MIN_TRIALS, round(total * WEIGHTS[kind] / sum(WEIGHTS.values())))


@dataclass
class Run:
    pid: int
    done: Optional[dict[str, Any]]


def run_commit(dest: Destination, seed: int, delay: Optional[float]) -> Run:
    """One child commits generation ``seed`` to checkpoint-2; SIGKILL it ``delay`` s in."""
    child = subprocess.Popen(
        [sys.executable, str(CHILD), str(os.getpid()), f"{dest.run}/checkpoint-2",
         str(dest.root), str(seed), dest.publish],
        stdout=subprocess.PIPE,
        env={k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")},
    )  # fmt: skip
    assert child.stdout is not None
    lines = _read_lines(child, 1, timeout=60)
    pid = json.loads(lines[0])["ready"]
    os.kill(pid, signal.SIGUSR1)
    if delay is not None:
        time.sleep(delay)
        child.send_signal(signal.SIGKILL)
    code = child.wait(timeout=120)
    rest = lines[1:] + child.stdout.read().decode().splitlines()
    done = next((json.loads(line) for line in rest if '"done"' in line), None)
    # done: it finished (a kill may still land before it exits); else the kill took it
    assert code in ((0, -signal.SIGKILL) if done else (-signal.SIGKILL,)), (code, rest)
    return Run(pid, done)


def _read_lines(child: subprocess.Popen[bytes], count: int, timeout: float) -> list[str]:
    assert child.stdout is not None
    fd = child.stdout.fileno()
    buffer = b""
    deadline = time.monotonic() + timeout
    while buffer.count(b"\n") < count:
        left = deadline - time.monotonic()
        assert left > 0 and select.select([fd], [], [], left)[0], "the child never got ready"
        chunk = os.read(fd, 4096)
        assert chunk, f"the child exited before it was ready (status {child.wait()})"
        buffer += chunk
    return buffer.decode().splitlines()


def make_destination(
    kind: str, tmp_path: Path, kit_mounts: dict[str, Any], real_mounts: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> Destination:
    name = f"ckpt-crash-{uuid.uuid4().hex[:8]}"
    root = tmp_path / "root"
    root.mkdir()
    if kind == "s3-url-upload":
        bucket = new_bucket(monkeypatch, prefix="ckpt-crash")
        return Destination(kind, tmp_path / "unused", None, root, "auto", "upload", url=f"s3://{bucket}/run")
    if kind == "disk-rename":
        parent = tmp_path / name
        parent.mkdir()
        return Destination(kind, parent, parent, root, "auto", "rename")
    if kind in ("s3fs-replace", "rclone-s3-replace"):
        parent = Path(real_mounts[kind.removesuffix("-replace")].path) / name
        parent.mkdir()
        return Destination(kind, parent, None, root, "auto", "replace")
    mount = kit_mounts[kind.split("-")[0]]
    parent = Path(mount.path) / name
    parent.mkdir()
    publish, strategy = ("direct", "direct") if kind == "mountpoint-direct" else ("auto", "replace")
    return Destination(kind, parent, Path(mount.backing) / name, root, publish, strategy)


def plant(dest: Destination, checkpoint: str, seed: int) -> None:
    """A complete checkpoint of generation ``seed``, planted without safestage's publish path
    (through the backing directory where there is one): files, then a commit file whose
    digests are computed here."""
    files = generation(seed)
    for relative, data in files.items():
        dest.write(checkpoint, relative, data)
    entries = [FileEntry(path, len(data), f"{zlib.crc32(data):08x}") for path, data in files.items()]
    dest.write(checkpoint, COMMIT_NAME, new_manifest(entries, [], "test").encode())


def remove_checkpoint(dest: Destination, checkpoint: str) -> None:
    base = (dest.backing or dest.parent) / checkpoint
    for _ in range(200):  # mountpoint: a killed writer's object is undeletable until released
        try:
            shutil.rmtree(base)
            return
        except FileNotFoundError:
            return
        except PermissionError:
            time.sleep(0.01)
    shutil.rmtree(base)


def retrying(read: Callable[[], Any]) -> Any:
    """mountpoint semantics: a killed writer's object is unreadable (EPERM) until the kernel's
    asynchronous FUSE release of its handle is processed. Bounded wait, not a timing check."""
    for _ in range(300):
        try:
            return read()
        except PermissionError:
            time.sleep(0.01)
    return read()


def generation_of(dest: Destination, checkpoint: str) -> Optional[int]:
    """Which generation ``checkpoint`` holds, judged by this test alone: its commit file's
    list must be exactly one generation's files, each file's bytes equal to it and each
    listed CRC-32 equal to the one computed here. None: not one generation (WRONG if a
    complete checkpoint was claimed)."""
    document = json.loads(retrying(lambda: dest.read(checkpoint, COMMIT_NAME)))
    listed = {entry["path"]: entry for entry in document["files"]}
    if sorted(listed) != sorted(generation(GEN_A)):
        return None
    held = {path: retrying(lambda p=path: dest.read(checkpoint, p)) for path in listed}
    # Every generation's config.json names its seed: the candidate, checked in full below.
    seed = int(json.loads(held["config.json"])["seed"])
    files = generation(seed)
    if held != files:
        return None
    if any(listed[p]["digest"] != f"{zlib.crc32(d):08x}" or listed[p]["size"] != len(d) for p, d in files.items()):
        return None
    return seed


def judge(dest: Destination, new_seed: int, old_seed: Optional[int], tally: Tally, trial: str) -> str:
    latest = retrying(lambda: safestage.latest_complete(dest.run))
    if latest is None:
        tally.wrong.append(f"{trial}: latest_complete found nothing; checkpoint-1 is complete")
        return "wrong"
    name = str(latest).rstrip("/").rsplit("/", 1)[-1]
    held = generation_of(dest, name)
    if name == "checkpoint-2" and held == new_seed:
        return "new"
    if name == "checkpoint-2" and old_seed is not None and held == old_seed:
        return "old-kept"
    if name == "checkpoint-1" and held == GEN_A:
        return "fell-back"
    tally.wrong.append(f"{trial}: latest_complete named {name}, which holds generation {held}")
    return "wrong"


def check_leftovers(dest: Destination, run: Run, new_seed: int, tally: Tally) -> str:
    """Clean the staging root and the checkpoint's directories (the code of `safestage
    clean`); return the phase the kill landed in, read from what it left."""
    checkpoint = dest.parent / "checkpoint-2"
    landed_bytes = lambda relative: retrying(lambda: dest.read("checkpoint-2", relative))  # noqa: E731
    files = generation(new_seed)
    phase = "completed" if run.done else "before-staging"
    for name in os.listdir(dest.root):
        owner = parse_stage_dir(name)
        assert owner is not None and owner.pid == run.pid, f"a staging-root entry nobody made: {name}"
        assert not run.done, "a completed commit left its staging directory"
        disposable = (dest.root / name / DISPOSABLE_MARKER).exists()
        contents = sorted(os.listdir(dest.root / name))
        if disposable:
            committed = dest.exists("checkpoint-2", COMMIT_NAME) and generation_of(dest, "checkpoint-2") == new_seed
            phase = "committed-cleanup" if committed else "writing"
        elif contents:
            phase = "publishing"
            local = dest.root / name / "checkpoint-2"
            for relative, data in files.items():  # every file landed, or is kept, complete
                kept = local / relative
                assert (kept.exists() and kept.read_bytes() == data) or landed_bytes(relative) == data, relative
        else:
            phase = "before-staging"  # killed between mkdir and the marker
    report = clean(dest.root)
    for entry in report:
        assert entry.action in ("removed", "kept"), entry
        if entry.action == "kept":
            assert phase == "publishing" and "complete copy" in entry.reason, (phase, entry)
            tally.kept += 1
            shutil.rmtree(dest.root / entry.name)  # what the user does once the copy is safe
        else:
            tally.removed += 1
    assert os.listdir(dest.root) == []
    if dest.url is None and checkpoint.exists():  # `safestage clean RUN`: into every checkpoint, subdirectories too
        for entry in retrying(lambda: clean(dest.parent, recursive=True)):
            assert entry.kind == "temp" and entry.action == "removed", entry
            tally.removed += 1
        strays = [p for p in checkpoint.rglob("*") if parse_temp_name(p.name) or p.name.startswith(".tmp")]
        assert not strays, strays
    return phase


class KillPlanner:
    """Kill times spread over the block (writing the local copy) and the commit (publishing),
    from the durations of complete runs; strata as in test_crash_trials."""

    def __init__(self, seed: str) -> None:
        self.rng = random.Random(seed)
        self.block: list[float] = []
        self.commit: list[float] = []

    def observe(self, done: dict[str, Any]) -> None:
        self.block.append(done["block"])
        self.commit.append(done["commit"])

    def durations(self) -> tuple[float, float]:
        return statistics.median(self.block[-9:]), statistics.median(self.commit[-9:])

    def planned(self, index: int) -> float:
        b, c = self.durations()
        strata = [(0.0, b), (b, b + c), (b, b + c), (b + 0.7 * c, (b + c) * 1.05), (0.0, (b + c) * 1.1)]
        return self.rng.uniform(*strata[index % len(strata)])

    def aimed_at(self, outcome: str, attempt: int) -> float:
        """For an outcome the planned kills missed (the machine's load moves the phases)."""
        b, c = self.durations()
        stretch = 1.0 + 0.25 * attempt
        if outcome == "new":  # after the commit file: the very end, or later
            return self.rng.uniform((b + 0.9 * c), (b + c) * 1.2 * stretch)
        if outcome == "old-kept":  # a re-commit killed before it removed the old commit file
            return self.rng.uniform(0.0, b * stretch)
        return self.rng.uniform(b, b + 0.8 * c * stretch)  # fell-back: during the publishing


# Every destination must show each outcome: the kills really spread over the commit.
REQUIRED = ("new", "old-kept", "fell-back")


@pytest.mark.parametrize("kind", DESTINATIONS)
def test_sigkill_during_a_commit_never_misleads_latest_complete(
    kind: str,
    tmp_path: Path,
    kit_mounts: dict[str, Any],
    real_mounts: dict[str, Any],
    suite_settings: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trials = trials_for(kind, suite_settings)
    dest = make_destination(kind, tmp_path, kit_mounts, real_mounts, monkeypatch)
    tally = SUMMARY.setdefault(kind, Tally())
    planner = KillPlanner(f"ckpt-crash-{kind}")
    try:
        plant(dest, "checkpoint-1", GEN_A)
        for index in range(CALIBRATION_RUNS):
            run = run_commit(dest, 100 + index, None)
            assert run.done is not None
            planner.observe(run.done)
            assert judge(dest, 100 + index, None, tally, "calibration") == "new", tally.wrong
            dest.remove("checkpoint-2")
        b, c = statistics.median(planner.block), statistics.median(planner.commit)
        tally.timing = f"a run takes ~{(b + c) * 1e3:.0f} ms (block {b * 1e3:.0f} ms, commit {c * 1e3:.0f} ms)"
        for index in range(trials + EXTRA_TRIALS):
            if index < trials:
                recommit = index % 2 == 1
                delay = planner.planned(index)
            else:
                missing = [outcome for outcome in REQUIRED if not tally.outcomes[outcome]]
                if not missing:
                    break
                recommit = missing[0] == "old-kept" or index % 2 == 1
                delay = planner.aimed_at(missing[0], index - trials)
            new_seed = 100 + CALIBRATION_RUNS + index
            old_seed = GEN_B if recommit else None
            if recommit:
                plant(dest, "checkpoint-2", GEN_B)
            run = run_commit(dest, new_seed, delay)
            if run.done is not None:
                planner.observe(run.done)
            else:
                tally.killed += 1
            trial = f"{kind} trial {index} ({'re-commit' if recommit else 'commit'}, kill at {delay * 1e3:.1f} ms)"
            outcome = judge(dest, new_seed, old_seed, tally, trial)
            tally.outcomes[outcome] += 1
            tally.phases[check_leftovers(dest, run, new_seed, tally)] += 1
            dest.remove("checkpoint-2")
    finally:
        print(f"\n{kind}:\n{summary_table()}")
        if dest.url is None:
            shutil.rmtree(dest.backing or dest.parent, ignore_errors=True)
    assert not tally.wrong, "\n".join(tally.wrong)
    assert sum(tally.outcomes.values()) >= trials
    # The kills must have spread over the commit, or this proves little.
    assert tally.phases["publishing"] and tally.phases["before-staging"] + tally.phases["writing"], summary_table()
    assert all(tally.outcomes[outcome] for outcome in REQUIRED), summary_table()
