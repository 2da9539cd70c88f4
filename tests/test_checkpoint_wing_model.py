"""A model-based test of the checkpoint wing: a run directory lives through generated commits
(synchronous, background, ``keep=N``), rollbacks (a lower step committed after higher ones),
commits SIGKILLed at a generated system call, blocks that raise, prunes in-process and from
another process (`python -m safestage prune`), recovers, and hand-made entries with generated
names (near misses of the pattern, complete checkpoints of other names, stray files, symlinks).
After every step the run directory is compared with a reference model of what must exist, and
``latest_complete`` with what the model says it must name.

Invariants: a name the pattern does not take (and a symlink, a file) is never touched; the resume
point (the newest complete checkpoint) is never removed; ``latest_complete`` never names an
incomplete, empty, set-aside or non-candidate directory; retention and the timeline
(docs/retention.md) remove and set aside exactly what the model says.

The same machine runs on an object-store run URL (``s3://bucket/run-…``, a bucket on the kit's
local server), through a destination family (``Family``: the run's names, the entries it lists,
hand-made objects, the CLI's argument), never a second copy of the machine. What a bucket cannot
hold is adapted there: a symlink named like a candidate becomes a plain object of that name (the
pattern takes the name; it is no checkpoint prefix); a stray file, a plain object directly in
the run; and a run's foreign neighbours are added (a complete checkpoint under a sibling prefix
``<run>-old/``, a plain object ``<run>checkpoint-N`` whose key only begins like the run's, an
S3 console "folder" object ``<run>/<name>/``), each never touched, never named. A commit killed
at a system call is killed at a system call or at a store request (``Tap(requests=True)``):
the requests run in obstore's runtime, out of Python's sight, so a step before each request is
where a commit dies between its data objects and its commit object.

Examples: SAFESTAGE_WING_EXAMPLES (CI 30, about 20 s on 2 cores; the long tier 300, about 5 minutes),
each up to 30 steps; on a URL, SAFESTAGE_WING_URL_EXAMPLES (CI 4, about 13 s on 2 busy cores; the long tier 100,
on every kind of local store that saves).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import pytest
from _support import SUITE_SETTINGS, long_tier, tiered
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import safestage
from safestage import COMMIT_NAME, _object_store
from safestage._destination import Destination, ObjectURL, UnsupportedDestination, url_of
from safestage.checkpoint._manifest import SET_ASIDE_NAME
from safestage.checkpoint._verify import matcher

EXAMPLES_VARIABLE = "SAFESTAGE_WING_EXAMPLES"
URL_EXAMPLES_VARIABLE = "SAFESTAGE_WING_URL_EXAMPLES"
TESTS = Path(__file__).resolve().parent
PATTERN = "checkpoint-*"
TAKES = matcher(PATTERN)
STEPS = st.integers(min_value=1, max_value=9)  # what commits use: checkpoint-<step>

# Names checkpoint-* does not take, each of its own series (the timeline never links two).
NEAR_MISSES = (
    "checkpoint-500-epoch-2", "checkpoint-final-v2", "checkpoint-1e3", "checkpoint-best",
    "checkpoint-7-merged", "checkpoint-", "checkpoint--3", "checkpoint-2.5", "Checkpoint-5",
    "checkpoint-٣", "checkpoint-4 ", "checkpoint-0x10", "epoch=1-step=5-v1.ckpt", "checkpoint-8\n",
)  # fmt: skip

# A commit SIGKILLed at its AT-th system call (tests/_tap.py), or store request, in a process
# of its own.
KILLED_COMMIT = """
import sys
from pathlib import Path
from _tap import Tap
import safestage
dest, root, token, at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
dest = dest if "://" in dest else Path(dest)
with Tap(at=at, action="kill", requests=True):
    with safestage.staged_dir(dest, root) as local:
        (local / "model.bin").write_text(token)
        (local / "state").mkdir()
        (local / "state" / "optimizer.pt").write_text(token * 3)
"""


def examples(variable: str = EXAMPLES_VARIABLE, ci: int = 30, long: int = 300) -> int:
    text = SUITE_SETTINGS.get(variable, "").strip()
    return int(text) if text else (long if long_tier() else ci)


@dataclass
class Checkpoint:
    """A directory the pattern takes, as the model knows it."""

    step: int
    complete: bool
    started: int = -1  # the order in which its save began (complete ones)
    set_aside: bool = False
    token: str = ""  # what its model.bin holds (complete ones)


@dataclass
class Copy:
    """A copy a killed commit may have kept in the staging root."""

    step: int
    started: int
    token: str
    refused: bool = False


def fingerprint(path: Path) -> object:
    """What a never-touched entry must still be: a link's target, a file's bytes, a tree."""
    if path.is_symlink():
        return ("link", os.readlink(path))
    if path.is_file():
        return ("file", path.read_bytes())
    return ("dir", sorted((str(p.relative_to(path)), p.read_bytes() if p.is_file() else None)
                          for p in path.rglob("*")))  # fmt: skip


class Family:
    """The run's destination family, as the machine sees it: where a checkpoint of a name is, the
    names the run holds, what a hand-made entry is there, and what it reads back."""

    run: Union[Path, str]  # what staged_dir's parent, latest_complete, prune and the CLI take
    kinds: tuple[str, ...]  # the hand-made entries this family can hold
    kill_steps: int  # a killed commit's step is drawn below this (past the last: it finishes)

    def checkpoint(self, name: str) -> Destination:
        raise NotImplementedError

    def names(self) -> set[str]:
        """The names of the run's entries (directories, files, links; prefixes, objects)."""
        raise NotImplementedError

    def is_checkpoint(self, name: str) -> bool:
        """Whether the entry ``name`` is checkpoint-shaped: a directory (no link); a prefix (no object)."""
        raise NotImplementedError

    def exists(self, name: str) -> bool:
        raise NotImplementedError

    def read(self, name: str, relative: str) -> Optional[bytes]:
        """A checkpoint's file, None if it has none of that name."""
        raise NotImplementedError

    def fingerprint(self, name: str) -> object:
        raise NotImplementedError

    def make(self, name: str, kind: str, data: st.DataObject, model: list[str], root: Path) -> bool:
        """Make a hand-made entry of ``kind`` named ``name`` (the other kinds than "committed" and
        "taken-directory", which the machine makes the same way in every family): False if
        ``kind`` names no entry in the run (it made it outside the run, or made nothing)."""
        raise NotImplementedError

    def refuses(self, name: str) -> bool:
        """Whether a checkpoint cannot be named ``name`` in this family (a save is refused)."""
        return False

    def outside(self) -> object:
        """What lies outside the run (never touched by anything done to the run)."""
        return None

    def still(self) -> contextlib.AbstractContextManager[object]:
        """A block that changes nothing in the run (an invariant's): the family may list it once."""
        return contextlib.nullcontext()

    def teardown(self) -> None:
        pass


class PathFamily(Family):
    """A run directory on the local disk."""

    kinds = ("directory", "committed", "file", "symlink", "taken-directory")
    kill_steps = 140

    def __init__(self, base: Path) -> None:
        self.run = self.path = base / "run"
        self.path.mkdir()

    def checkpoint(self, name: str) -> Path:
        return self.path / name

    def names(self) -> set[str]:
        return set(os.listdir(self.path))

    def is_checkpoint(self, name: str) -> bool:
        path = self.path / name
        return path.is_dir() and not path.is_symlink()

    def exists(self, name: str) -> bool:
        return os.path.lexists(self.path / name)

    def read(self, name: str, relative: str) -> Optional[bytes]:
        path = self.path / name / relative
        return path.read_bytes() if path.is_file() else None

    def fingerprint(self, name: str) -> object:
        return fingerprint(self.path / name)

    def make(self, name: str, kind: str, data: st.DataObject, model: list[str], root: Path) -> bool:
        path = self.path / name
        if kind == "directory":
            path.mkdir()
            (path / "notes.txt").write_text(name)
        elif kind == "file":
            path.write_text(name)
        else:
            assert kind == "symlink", kind
            path.symlink_to(data.draw(st.sampled_from([*sorted(model), "checkpoint-1", "../elsewhere"])))
        return True


class StoreFamily(Family):
    """A run URL (``<bucket>/run-<id>``) in a bucket of the kit's local store: its entries are
    the first parts of the keys below ``run/``, read from the server's own listing. A bucket has
    no symlink; "object" is its counterpart (a plain object named like a candidate), "foreign"
    the neighbours whose keys begin like the run's and lie outside it, "folder" an S3 console
    folder object (``<run>/<name>/``, no bytes)."""

    kinds = ("directory", "committed", "file", "object", "taken-directory", "foreign", "folder")
    kill_steps = 60  # a URL commit in a fresh process makes ~42 tapped calls, requests included

    def __init__(self, bucket: Any) -> None:
        self.bucket = bucket
        self.key = f"run-{uuid.uuid4().hex[:8]}"  # one bucket for every example: a run each
        self.run = f"{bucket.url}/{self.key}"
        url = url_of(self.run)
        assert url is not None
        self.url = url
        self._listed: Optional[list[str]] = None

    def _at(self, key: str) -> ObjectURL:
        return ObjectURL(self.url.scheme, self.url.bucket, key)

    def _keys(self) -> list[str]:
        return self._listed if self._listed is not None else self.bucket.objects()

    @contextlib.contextmanager
    def still(self) -> Iterator[object]:
        self._listed = self.bucket.objects()
        try:
            yield self._listed
        finally:
            self._listed = None

    def _below(self) -> list[str]:
        """The keys below the run, relative to it."""
        start = len(self.key) + 1
        return [key[start:] for key in self._keys() if key.startswith(self.key + "/")]

    def checkpoint(self, name: str) -> ObjectURL:
        url = url_of(f"{self.run}/{name}")  # through the seam, as a user's string is
        assert url is not None
        return url

    def refuses(self, name: str) -> bool:
        # "checkpoint-8\n": obstore cannot name a key holding a control character (_destination)
        return any(ord(c) < 32 or ord(c) == 127 for c in name)

    def names(self) -> set[str]:
        return {relative.partition("/")[0] for relative in self._below()}

    def is_checkpoint(self, name: str) -> bool:
        below = [relative for relative in self._below() if relative.partition("/")[0] == name]
        return bool(below) and name not in below  # objects below name/, none named name itself

    def exists(self, name: str) -> bool:
        return name in self.names()

    def read(self, name: str, relative: str) -> Optional[bytes]:
        return _object_store.read(self.url / name / relative)

    def _put(self, key: str, data: bytes) -> None:
        _object_store.put_bytes(self._at(key), data)

    def fingerprint(self, name: str) -> object:
        keys = [key for key in self._keys() if key == f"{self.key}/{name}" or key.startswith(f"{self.key}/{name}/")]
        return sorted((key, _object_store.read(self._at(key))) for key in keys)

    def make(self, name: str, kind: str, data: st.DataObject, model: list[str], root: Path) -> bool:
        if kind == "directory":
            self._put(f"{self.key}/{name}/notes.txt", name.encode())
        elif kind in ("file", "object"):
            self._put(f"{self.key}/{name}", name.encode())
        elif kind == "folder":
            self._put(f"{self.key}/{name}/", b"")
        else:
            assert kind == "foreign", kind
            step = data.draw(st.integers(min_value=10, max_value=99))  # newer than any commit's
            if data.draw(st.booleans()):
                with safestage.staged_dir(f"{self.run}-old/checkpoint-{step}", root) as local:
                    (local / "model.bin").write_text("a neighbouring run's")
            else:
                self._put(f"{self.key}checkpoint-{step}", b"a key that only begins like the run's")
            return False
        return True

    def outside(self) -> object:
        keys = [key for key in self._keys() if key.startswith(self.key) and not key.startswith(self.key + "/")]
        return sorted((key, _object_store.read(self._at(key))) for key in keys)

    def teardown(self) -> None:
        _object_store.delete([self._at(key) for key in self._keys() if key.startswith(self.key)])


class Wing(RuleBasedStateMachine):
    """The machine on a run directory; ``on(family)`` makes it run on another family's run."""

    make_family: Callable[[Path], Family] = PathFamily

    @classmethod
    def on(cls, name: str, make_family: Callable[[Path], Family]) -> type[Wing]:
        return type(name, (cls,), {"make_family": staticmethod(make_family)})

    def __init__(self) -> None:
        super().__init__()
        self.base = Path(tempfile.mkdtemp(prefix="wing-"))
        self.root = self.base / "stage"
        self.root.mkdir()
        self.family = self.make_family(self.base)
        self.run = self.family.run
        self.model: dict[str, Checkpoint] = {}
        self.untouchable: dict[str, object] = {}  # name -> fingerprint
        self.copies: dict[int, Copy] = {}
        self.outside = self.family.outside()  # what lies outside the run, never touched
        self.order = 0
        self.tokens = 0

    def teardown(self) -> None:
        self.family.teardown()
        shutil.rmtree(self.base, ignore_errors=True)

    # -- the model -----------------------------------------------------------------------------

    def _token(self) -> str:
        self.tokens += 1
        return f"save-{self.tokens}"

    def _began(self) -> int:
        self.order += 1
        return self.order

    def expected_latest(self) -> Optional[str]:
        complete = [(c.step, name) for name, c in self.model.items() if c.complete and not c.set_aside]
        return max(complete)[1] if complete else None

    def _landed(self, name: str, started: int, token: str, *, resumed: bool = False) -> None:
        """The timeline just before ``name``'s commit file lands (docs/retention.md), then it."""
        step = TAKES(name)
        assert step is not None
        aside = False
        for other_name, other in self.model.items():
            if other_name == name or not other.complete:
                continue
            if other.step > step and other.started < started and not other.set_aside:
                other.set_aside = True
            elif other.step < step and resumed and other.started > started:
                aside = True
        self.model[name] = Checkpoint(step, True, started, aside, token)

    def _retention(self, keep: int, protect: Optional[str] = None) -> None:
        complete = sorted(((c.step, name) for name, c in self.model.items() if c.complete and not c.set_aside),
                          reverse=True)  # fmt: skip
        if not complete:
            return
        newest = complete[0][0]
        going = {name for _, name in complete[keep:]}
        going |= {name for name, c in self.model.items() if not c.complete and c.step < newest}
        for name in going - {protect}:
            del self.model[name]

    # -- rules ---------------------------------------------------------------------------------

    @rule(step=STEPS, background=st.booleans(), keep=st.sampled_from([None, None, 1, 2, 3]))
    def commit(self, step: int, background: bool, keep: Optional[int]) -> None:
        self._commit(step, background, keep)

    @precondition(lambda self: self.expected_latest() is not None)
    @rule(data=st.data(), background=st.booleans(), keep=st.sampled_from([None, 1, 2, 3]))
    def a_rollback(self, data: st.DataObject, background: bool, keep: Optional[int]) -> None:
        """A run resumed from an older checkpoint commits a lower step than the newest."""
        newest = self.model[self.expected_latest() or ""].step
        if newest > 1:
            self._commit(data.draw(st.integers(min_value=1, max_value=newest - 1)), background, keep)

    def _commit(self, step: int, background: bool, keep: Optional[int]) -> None:
        name, token = f"checkpoint-{step}", self._token()
        started = self._began()
        handle = safestage.staged_dir(self.family.checkpoint(name), self.root, background=background, keep=keep)
        with handle as local:
            (local / "model.bin").write_text(token)
            (local / "state").mkdir()
            (local / "state" / "optimizer.pt").write_text(token * 3)
        handle.wait()
        self._landed(name, started, token)
        if keep is not None:
            self._retention(keep, protect=name)

    @rule(step=STEPS, empty=st.booleans(), background=st.booleans())
    def a_block_that_raises_or_writes_nothing(self, step: int, empty: bool, background: bool) -> None:
        self._began()
        handle = safestage.staged_dir(self.family.checkpoint(f"checkpoint-{step}"), self.root, keep=1,
                                      background=background)  # fmt: skip
        with pytest.raises(safestage.StagingError if empty else ZeroDivisionError), handle as local:
            if not empty:
                (local / "model.bin").write_text("never committed")
                _ = 1 / 0

    @precondition(lambda self: len(self.copies) < 3)
    @rule(step=STEPS, data=st.data())
    def a_commit_killed(self, step: int, data: st.DataObject) -> None:
        at = data.draw(st.integers(min_value=0, max_value=self.family.kill_steps), label="at")
        if step in self.copies:
            return  # one copy per checkpoint at a time: recover first
        name, token = f"checkpoint-{step}", self._token()
        started = self._began()
        before = self.model.get(name)
        child = subprocess.run([sys.executable, "-c", KILLED_COMMIT, str(self.family.checkpoint(name)), str(self.root), token,
                                str(at)], env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                    [str(TESTS), os.environ.get("PYTHONPATH", "")])},
                               capture_output=True, text=True, timeout=60)  # fmt: skip
        assert child.returncode in (0, -signal.SIGKILL), child.stderr
        result = safestage.verify(self.family.checkpoint(name))
        landed = result.complete and self.family.read(name, "model.bin") == token.encode()
        if landed:
            self._landed(name, started, token)
        else:
            # Killed before its commit file: what it set aside before dying stays set aside.
            for other_name, other in self.model.items():
                if other.complete and other.step > step and not other.set_aside \
                        and self.family.read(other_name, SET_ASIDE_NAME) is not None:  # fmt: skip
                    other.set_aside = True
            if result.complete:
                assert before is not None and before.complete and self.family.read(name, "model.bin") == before.token.encode()
            elif self.family.exists(name):
                self.model[name] = Checkpoint(step, False)  # an old commit file goes first
            else:
                assert before is None, (name, before)
        if child.returncode != 0:
            self.copies[step] = Copy(step, started, token)

    @precondition(lambda self: bool(self.copies))
    @rule()
    def recover(self) -> None:
        results = safestage.recover(self.root)
        for result in results:
            assert result.action in ("committed", "removed", "refused"), result
            step = TAKES(result.destination.name) if result.destination is not None else None
            assert step is not None and step in self.copies, (result, self.copies)
            copy = self.copies[step]
            name = f"checkpoint-{step}"
            here = self.model.get(name)
            if result.action == "committed":
                assert not (here is not None and here.complete and here.started > copy.started), result
                self._landed(name, copy.started, copy.token, resumed=True)
            elif result.action == "removed":
                assert here is not None and here.complete and here.token == copy.token, result
            else:
                assert here is not None and here.complete and here.started > copy.started, result
                copy.refused = True
        seen = {TAKES(r.destination.name) for r in results if r.destination is not None}
        self.copies = {step: c for step, c in self.copies.items() if c.refused and step in seen}

    @rule(keep=st.integers(min_value=1, max_value=3), another_process=st.booleans())
    def prune(self, keep: int, another_process: bool) -> None:
        resume = self.expected_latest()
        if another_process:
            done = subprocess.run([sys.executable, "-m", "safestage", "prune", str(self.run), "--keep", str(keep)],
                                  capture_output=True, text=True, timeout=60)  # fmt: skip
            assert done.returncode == 0, done.stdout + done.stderr
        else:
            safestage.prune(self.run, keep)
        self._retention(keep)
        if resume is not None:
            assert safestage.verify(self.family.checkpoint(resume)).complete, resume  # the resume point stays

    @rule(data=st.data())
    def a_hand_made_entry(self, data: st.DataObject) -> None:
        """A name the pattern does not take (a directory, a complete checkpoint committed by
        safestage, a file), a symlink named like a candidate, or a directory the pattern takes
        that no commit made (checkpoint-0<step>: no commit file); on a URL, their counterparts
        (``StoreFamily``) and the run's foreign neighbours."""
        kind = data.draw(st.sampled_from(self.family.kinds), label="kind")
        if kind in ("symlink", "object"):
            name = f"checkpoint-{data.draw(st.integers(min_value=10, max_value=99))}"  # never a commit's
        elif kind == "taken-directory":
            name = f"checkpoint-0{data.draw(STEPS)}"  # step <step>, never a commit's name
        elif kind == "folder":  # a folder object alone is no checkpoint, whatever its name
            name = data.draw(st.sampled_from([*NEAR_MISSES, *(f"checkpoint-0{step}" for step in range(1, 10))]))
        else:
            name = data.draw(st.sampled_from(NEAR_MISSES))
        if self.family.refuses(name):
            with pytest.raises(UnsupportedDestination, match="control character"):
                safestage.staged_dir(f"{self.run}/{name}", self.root).__enter__()
            return
        if self.family.exists(name):
            return
        if kind == "taken-directory":
            self.family.make(name, "directory", data, sorted(self.model), self.root)
            self.model[name] = Checkpoint(TAKES(name) or 0, False)
            return
        if kind == "committed":  # complete, by safestage itself: still no checkpoint of the pattern
            with safestage.staged_dir(self.family.checkpoint(name), self.root) as local:
                (local / "model.bin").write_text(name)
        elif not self.family.make(name, kind, data, sorted(self.model), self.root):
            self.outside = self.family.outside()
            return
        self.untouchable[name] = self.family.fingerprint(name)

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def the_run_directory_is_what_the_model_says(self) -> None:
        with self.family.still():
            self._the_run_directory_is_what_the_model_says()

    def _the_run_directory_is_what_the_model_says(self) -> None:
        names = self.family.names()
        on_disk = set()
        for name in names:
            if name in self.untouchable:
                assert self.family.fingerprint(name) == self.untouchable[name], f"{name!r} was touched"
                continue
            assert TAKES(name) is not None and self.family.is_checkpoint(name), name
            on_disk.add(name)
        missing = set(self.untouchable) - names
        assert not missing, f"removed, though the pattern does not take them: {missing}"
        assert self.family.outside() == self.outside, "something outside the run was touched"
        assert sorted(on_disk) == sorted(self.model), (sorted(on_disk), self.model)
        for name, known in self.model.items():
            result = safestage.verify(self.family.checkpoint(name))
            assert result.complete == known.complete, (name, known, result.problems)
            assert (result.set_aside is not None) == known.set_aside, (name, known, result.set_aside)
            if known.complete:
                assert self.family.read(name, "model.bin") == known.token.encode(), name

    @invariant()
    def latest_names_the_newest_complete_candidate_never_another(self) -> None:
        with self.family.still():
            self._latest_names_the_newest_complete_candidate_never_another()

    def _latest_names_the_newest_complete_candidate_never_another(self) -> None:
        found = safestage.latest_complete(self.run)
        expected = self.expected_latest()
        assert found == (None if expected is None else self.family.checkpoint(expected)), (found, expected, self.model)
        if found is not None:
            result = safestage.verify(found)
            assert result.complete and result.set_aside is None
            assert TAKES(found.name) is not None and result.manifest is not None and result.manifest.files
            assert self.family.is_checkpoint(found.name) and self.family.read(found.name, COMMIT_NAME) is not None


def run_the_machine(machine: type[Wing], count: int) -> None:
    run_state_machine_as_test(machine, settings=settings(
        max_examples=count, stateful_step_count=30, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    ))  # fmt: skip


@pytest.mark.slow
def test_the_checkpoint_wing_holds_to_its_model() -> None:
    run_the_machine(Wing, examples())


# One kind in CI (moto: the S3 the other URL tests use most); every kind that saves in the long tier.
@pytest.mark.slow
@pytest.mark.stores(*tiered(["moto", "seaweedfs", "azurite"], ci=["moto"]),
                    why="CI time: the machine's steps are the same on every store; the long tier runs them all")
def test_the_checkpoint_wing_holds_to_its_model_on_a_run_url(store_bucket: Any) -> None:
    run_the_machine(Wing.on("WingOnARunURL", lambda base: StoreFamily(store_bucket)),
                    examples(URL_EXAMPLES_VARIABLE, ci=4, long=100))  # fmt: skip
