"""Fork server for test_crash_trials.py: one real interpreter that imports torch once, then forks a
fresh saver per trial, so 200+ SIGKILLs cost milliseconds each instead of a torch import.

Started with ``sys.executable tests/crash_child.py``. Protocol: JSON lines on stdin, JSON lines
on stdout (each written with a single write(2) below PIPE_BUF, so the forked savers' lines and
the server's never interleave):

- ``{"op": "trial", "dest", "root", "publish", "numel", "seed", "follow"}``: fork a saver. It builds its
  tensors, activates staging (root probe included) and only then prints
  ``{"ready": pid}`` and blocks SIGUSR1: the test's kill window covers the save alone.
  On SIGUSR1 it saves once through safestage, prints ``{"done": pid, ...timings}`` and exits.
  The timings include ``marks``: when (since the start) the last fsync before the rename
  over the final name began, and when that rename began. Between the two, a complete temp
  (or staged file) waits under its own name: the window a kill "copied-before-replace" needs,
  which on an s3fs mount is a few ms at the end of a ~130 ms publish.
- ``{"op": "reap", "pid"}``: waitpid the saver, print ``{"reaped": pid, "signal", "status"}``.
- ``{"op": "quit"}`` or end of stdin: exit.

Every process here dies with its parent (PR_SET_PDEATHSIG): a crashed test leaks nothing.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time

PR_SET_PDEATHSIG = 1
READY_TIMEOUT_S = 60  # a saver nobody starts or kills gives up on its own


def _die_with_parent(expected_parent: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != expected_parent:  # the parent died before prctl took effect
        os._exit(5)


def _emit(message: dict[str, object]) -> None:
    data = (json.dumps(message) + "\n").encode()
    assert len(data) < 4096, "must stay one atomic pipe write"
    os.write(1, data)


def make_tensors(numel: int, seed: int) -> dict[str, object]:
    """Deterministic content for (numel, seed): the test rebuilds it to compare."""
    import torch

    base = torch.arange(numel, dtype=torch.float32)
    return {
        "weight": base.mul(1.0 / (seed + 1)).add(float(seed)),
        "codes": (torch.arange(4096, dtype=torch.int64) * (seed + 7)).to(torch.int32),
        "seed": torch.tensor([seed], dtype=torch.int64),
    }


def _mark_publish_steps(dest: str, started: list[float], marks: dict[str, float]) -> None:
    """Wrap os.fsync and os.replace (looked up at each call by safestage) to time the publish's
    last steps; the marks are read only, never change what the save does."""
    fsync, replace = os.fsync, os.replace

    def timed_fsync(fd):  # type: ignore[no-untyped-def]
        if started and "replace" not in marks:  # not the root probe's, nor the dir fsync after
            marks["fsync"] = time.perf_counter() - started[0]
        return fsync(fd)

    def timed_replace(src, dst, **kwargs):  # type: ignore[no-untyped-def]
        if started and os.fspath(dst) == dest and "replace" not in marks:
            marks["replace"] = time.perf_counter() - started[0]
        return replace(src, dst, **kwargs)

    os.fsync, os.replace = timed_fsync, timed_replace  # type: ignore[assignment]


def _saver(request: dict[str, object], server_pid: int) -> None:
    """The forked child: never returns."""
    code = 1
    try:
        _die_with_parent(server_pid)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        from safetensors.torch import save_file

        import safestage

        tensors = make_tensors(int(request["numel"]), int(request["seed"]))  # type: ignore[arg-type]
        stage = safestage._api.force_follow(
            safestage.staged(str(request["root"]), publish=request["publish"], fsync=True), request.get("follow")
        )._open()
        started: list[float] = []
        marks: dict[str, float] = {}
        _mark_publish_steps(str(request["dest"]), started, marks)
        _emit({"ready": os.getpid()})
        if signal.sigtimedwait({signal.SIGUSR1}, READY_TIMEOUT_S) is None:
            os._exit(3)
        started.append(time.perf_counter())
        save_file(tensors, str(request["dest"]))
        seconds = time.perf_counter() - started[0]
        record = stage.records[-1]
        _emit(
            {
                "done": os.getpid(),
                "seconds": seconds,
                "serialize": record.serialize_seconds,
                "publish": record.publish_seconds,
                "strategy": record.publish,
                "marks": marks,
            }
        )
        code = 0
    except BaseException as exc:  # reported to the test, which fails on it
        _emit({"error": repr(exc)[:2000], "pid": os.getpid()})
    finally:
        os._exit(code)  # a forked child must not run the server's atexit/finalizers


def main() -> int:
    _die_with_parent(int(sys.argv[1]))
    import torch

    torch.set_num_threads(1)  # no OpenMP pool before fork()
    import safetensors.torch  # noqa: F401  (imported once, inherited by every saver)

    import safestage  # noqa: F401

    me = os.getpid()
    _emit({"server": me})
    for line in sys.stdin:
        request = json.loads(line)
        op = request["op"]
        if op == "trial":
            pid = os.fork()
            if pid == 0:
                _saver(request, me)
        elif op == "reap":
            pid = int(request["pid"])
            _, status = os.waitpid(pid, 0)
            _emit(
                {
                    "reaped": pid,
                    "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0,
                    "status": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
                }
            )
        elif op == "quit":
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
