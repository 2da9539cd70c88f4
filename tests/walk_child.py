"""The life of a save that test_invariant_walk walks, and a fork server that SIGKILLs it at step N.

``life()`` is the whole life of a save: activate (root checks and the sweep), serialize,
stage, publish (every step), close. As a script this is a fork server: it imports torch
once, then per JSON request on stdin forks a saver that installs a Tap killing itself at
the requested step and lives the life; it answers how the saver ended. Every process here
dies with its parent (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

PR_SET_PDEATHSIG = 1


def old_tensors() -> dict[str, Any]:
    import torch

    return {"w": torch.arange(3000, dtype=torch.float32)}


def new_tensors(tag: int = 1) -> dict[str, Any]:
    import torch

    return {"w": torch.arange(70_000, dtype=torch.float32) * tag, "b": torch.full((9,), float(tag))}


def life(dest: Path, root: Path, publish: str, background: bool, tensors: Any = None) -> Any:
    """activate -> save -> close; returns the Stage (its records). ``tensors`` default to
    new_tensors(); a forked child passes tensors built before the fork (torch's thread pool
    does not survive a fork)."""
    from safetensors.torch import save_file

    import safestage

    data = new_tensors() if tensors is None else tensors
    stage = safestage.activate(root, publish=publish, background=background)
    try:
        save_file(data, str(dest))
    finally:
        stage.close()
    return stage


def _die_with_parent(expected_parent: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != expected_parent:
        os._exit(5)


def _saver(request: dict[str, Any], server: int) -> None:
    code = 1
    try:
        _die_with_parent(server)
        from _tap import Tap

        from safestage._mounts import capabilities

        capabilities.clear()  # walk the probe too
        with Tap(at=int(request["at"]), action="kill"):
            life(Path(request["dest"]), Path(request["root"]), request["publish"], bool(request["background"]))
        code = 0
    except BaseException:  # noqa: BLE001 - the test reads the outcome from the filesystem
        code = 1
    finally:
        os._exit(code)


def main() -> int:
    _die_with_parent(int(sys.argv[1]))
    import torch

    torch.set_num_threads(1)
    import safetensors.torch  # noqa: F401

    import safestage  # noqa: F401

    me = os.getpid()
    os.write(1, (json.dumps({"server": me}) + "\n").encode())
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _saver(request, me)
        _, status = os.waitpid(pid, 0)
        answer = {
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0,
            "status": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        }
        os.write(1, (json.dumps(answer) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
