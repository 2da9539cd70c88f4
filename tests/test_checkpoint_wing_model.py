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

Examples: SAFESTAGE_WING_EXAMPLES (CI 40, about 25 s on 2 cores; the long tier 300, about 5 minutes),
each up to 30 steps.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
from _support import SUITE_SETTINGS, long_tier
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
from safestage import COMMIT_NAME
from safestage.checkpoint._manifest import SET_ASIDE_NAME
from safestage.checkpoint._verify import matcher

EXAMPLES_VARIABLE = "SAFESTAGE_WING_EXAMPLES"
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

# A commit SIGKILLed at its AT-th system call (tests/_tap.py), in a process of its own.
KILLED_COMMIT = """
import sys
from pathlib import Path
from _tap import Tap
import safestage
dest, root, token, at = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
with Tap(at=at, action="kill"):
    with safestage.staged_dir(dest, root) as local:
        (local / "model.bin").write_text(token)
        (local / "state").mkdir()
        (local / "state" / "optimizer.pt").write_text(token * 3)
"""


def examples() -> int:
    text = SUITE_SETTINGS.get(EXAMPLES_VARIABLE, "").strip()
    return int(text) if text else (300 if long_tier() else 40)


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


class Wing(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.base = Path(tempfile.mkdtemp(prefix="wing-"))
        self.run = self.base / "run"
        self.root = self.base / "stage"
        self.run.mkdir()
        self.root.mkdir()
        self.model: dict[str, Checkpoint] = {}
        self.untouchable: dict[str, object] = {}  # name -> fingerprint
        self.copies: dict[int, Copy] = {}
        self.order = 0
        self.tokens = 0

    def teardown(self) -> None:
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
        handle = safestage.staged_dir(self.run / name, self.root, background=background, keep=keep)
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
        handle = safestage.staged_dir(self.run / f"checkpoint-{step}", self.root, keep=1, background=background)
        with pytest.raises(safestage.StagingError if empty else ZeroDivisionError), handle as local:
            if not empty:
                (local / "model.bin").write_text("never committed")
                _ = 1 / 0

    @precondition(lambda self: len(self.copies) < 3)
    @rule(step=STEPS, at=st.integers(min_value=0, max_value=140))
    def a_commit_killed(self, step: int, at: int) -> None:
        if step in self.copies:
            return  # one copy per checkpoint at a time: recover first
        name, token = f"checkpoint-{step}", self._token()
        started = self._began()
        before = self.model.get(name)
        child = subprocess.run([sys.executable, "-c", KILLED_COMMIT, str(self.run / name), str(self.root), token,
                                str(at)], env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                    [str(TESTS), os.environ.get("PYTHONPATH", "")])},
                               capture_output=True, text=True, timeout=60)  # fmt: skip
        assert child.returncode in (0, -signal.SIGKILL), child.stderr
        dest = self.run / name
        result = safestage.verify(dest)
        landed = result.complete and (dest / "model.bin").read_text() == token
        if landed:
            self._landed(name, started, token)
        else:
            # Killed before its commit file: what it set aside before dying stays set aside.
            for other_name, other in self.model.items():
                if other.complete and other.step > step and not other.set_aside \
                        and (self.run / other_name / SET_ASIDE_NAME).exists():  # fmt: skip
                    other.set_aside = True
            if result.complete:
                assert before is not None and before.complete and (dest / "model.bin").read_text() == before.token
            elif dest.is_dir():
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
            assert safestage.verify(self.run / resume).complete, resume  # the resume point stays

    @rule(data=st.data(), kind=st.sampled_from(["directory", "committed", "file", "symlink", "taken-directory"]))
    def a_hand_made_entry(self, data: st.DataObject, kind: str) -> None:
        """A name the pattern does not take (a directory, a complete checkpoint committed by
        safestage, a file), a symlink named like a candidate, or a directory the pattern takes
        that no commit made (checkpoint-0<step>: no commit file)."""
        if kind == "symlink":
            name = f"checkpoint-{data.draw(st.integers(min_value=10, max_value=99))}"  # never a commit's
        elif kind == "taken-directory":
            name = f"checkpoint-0{data.draw(STEPS)}"  # step <step>, never a commit's name
        else:
            name = data.draw(st.sampled_from(NEAR_MISSES))
        path = self.run / name
        if os.path.lexists(path):
            return
        if kind == "taken-directory":
            path.mkdir()
            (path / "pytorch_model.bin").write_text("hand-made, never committed")
            self.model[name] = Checkpoint(TAKES(name) or 0, False)
            return
        if kind == "committed":  # complete, by safestage itself: still no checkpoint of the pattern
            with safestage.staged_dir(path, self.root) as local:
                (local / "model.bin").write_text(name)
        elif kind == "directory":
            path.mkdir()
            (path / "notes.txt").write_text(name)
        elif kind == "file":
            path.write_text(name)
        else:
            targets = [*sorted(self.model), "checkpoint-1", "../elsewhere"]
            path.symlink_to(data.draw(st.sampled_from(targets)))
        self.untouchable[name] = fingerprint(path)

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def the_run_directory_is_what_the_model_says(self) -> None:
        on_disk = {}
        for name in os.listdir(self.run):
            path = self.run / name
            if name in self.untouchable:
                assert fingerprint(path) == self.untouchable[name], f"{name!r} was touched"
                continue
            assert TAKES(name) is not None and path.is_dir() and not path.is_symlink(), name
            on_disk[name] = path
        missing = set(self.untouchable) - set(os.listdir(self.run))
        assert not missing, f"removed, though the pattern does not take them: {missing}"
        assert sorted(on_disk) == sorted(self.model), (sorted(on_disk), self.model)
        for name, known in self.model.items():
            result = safestage.verify(on_disk[name])
            assert result.complete == known.complete, (name, known, result.problems)
            assert (result.set_aside is not None) == known.set_aside, (name, known, result.set_aside)
            if known.complete:
                assert (on_disk[name] / "model.bin").read_text() == known.token, name

    @invariant()
    def latest_names_the_newest_complete_candidate_never_another(self) -> None:
        found = safestage.latest_complete(self.run)
        expected = self.expected_latest()
        assert found == (None if expected is None else self.run / expected), (found, expected, self.model)
        if found is not None:
            result = safestage.verify(found)
            assert result.complete and result.set_aside is None and not found.is_symlink()
            assert TAKES(found.name) is not None and result.manifest is not None and result.manifest.files
            assert (found / COMMIT_NAME).is_file()


@pytest.mark.slow
def test_the_checkpoint_wing_holds_to_its_model() -> None:
    run_state_machine_as_test(Wing, settings=settings(
        max_examples=examples(), stateful_step_count=30, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    ))  # fmt: skip
