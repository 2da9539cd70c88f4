"""Kept copies made the way users get them, and the command a user then runs: helpers for the
tests of what safestage tells a user about a kept copy and lets them do with it.

A kept copy here is always a real one: a ``staged_dir`` commit in a process of its own (a
script file, so that its command line names it) that fails with a real ENOSPC on a small
tmpfs and exits; nothing is written into a staging root by hand.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent

# A training script's checkpoint save: argv DEST ROOT SIZE. Prints {"kept": path, "pid": pid}.
FAILING_SAVE = """\
import json, os, sys
import safestage
dest, root, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
try:
    with safestage.staged_dir(dest, root) as local:
        (local / "model.bin").write_bytes(bytes(range(256)) * (size // 256))
        (local / "trainer_state.json").write_text('{"global_step": 1}')
except safestage.PublishError as exc:
    print(json.dumps({"kept": exc.staged_path, "errno": exc.errno, "pid": os.getpid()}))
else:
    print(json.dumps({"kept": None, "pid": os.getpid()}))
"""


@dataclass(frozen=True)
class Kept:
    local: Path  # the kept checkpoint directory (what PublishError.staged_path names)
    save_dir: Path  # the save directory holding it and its record
    pid: int  # the process that kept it (exited since)
    script: Path  # its command line's script


def user_env(tmp: Path, **overrides: str) -> dict[str, str]:
    """A user's shell: no SAFESTAGE_* variable, this tree importable, a private TMPDIR (so the
    default staging root is not the one a concurrent test run uses)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["HF_HUB_OFFLINE"] = "1"
    private = tmp / "user-tmp"
    private.mkdir(exist_ok=True)
    env["TMPDIR"] = str(private)
    env.update(overrides)
    return env


def failed_commit(dest: Path, root: Path, tmp: Path, *, size: int = 3 << 20, script: str = "train_job.py") -> Kept:
    """Run ``script`` (FAILING_SAVE) committing ``size`` bytes to ``dest`` with staging root
    ``root``; the commit must fail with ENOSPC (the fault fired) and keep its copy."""
    path = tmp / script
    path.write_text(FAILING_SAVE)
    child = subprocess.run(
        [sys.executable, str(path), str(dest), str(root), str(size)],
        env=user_env(tmp), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert child.returncode == 0, child.stdout + child.stderr
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report["kept"] is not None and report["errno"] == 28, report  # a real ENOSPC
    local = Path(report["kept"])
    assert local.is_dir() and (local.parent / "safestage-kept.json").is_file(), local
    return Kept(local, local.parent, int(report["pid"]), path)


def remount(target: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(target)], check=True)


def cli(*args: str, env: dict[str, str], cwd: Optional[Path] = None) -> subprocess.CompletedProcess[str]:
    """``python -m safestage ARGS`` as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "safestage", *args],
        env=env, cwd=cwd, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
