"""A rank of tests/test_collective_interrupts.py: a Ctrl-C at every step of a collective commit.

argv: the run directory, a JSON list of the sweeps ({"name", "background", "stride",
"every_rank"}). For each
sweep: a dry run records every rank's steps in its main thread (tests/_tap.py: the system calls
safestage makes, and its gloo exchanges, between the two collectives of each too); then, for
each rank R and each of its steps K (every ``stride``-th), commit A in which rank R does what a
Ctrl-C does at step K (SIGINT's handler runs there: KeyboardInterrupt, or noted where safestage
defers it), then commit B with no interrupt. Each rank reports, per case, what A and B returned
or raised on it (and ``wait()`` of a background A), and at which step its interrupt fired.
``points``: real SIGINTs instead, each sent by a timer a while after the block: at that many
points across the length of a commit measured first, and once after it (``mib``: a file of that
many MiB on every rank, so that the copies run across several heartbeats).
``handler``: "flag", a SIGINT handler of the program's own that only notes the signal (a
training loop that stops at its next step); "raise", one that raises an Exception (``Stop``);
"swap", one that notes a first Ctrl-C and sets Python's default for a second (``again``: the
second, that many steps after the first).
``behind_background`` (with ``points``): each commit A right after a background commit, the
SIGINT timed from A's start, while A waits for that one. ``every_rank``: every rank interrupted in each case, each at its own K-th step (a Ctrl-C in the
terminal reaches every process of the job).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from safetensors.torch import save_file

import safestage
from safestage import _patch, _work
from safestage.checkpoint import _collective
from tests._tap import Tap
from tests._two_nodes import report

# Steps with no system call of Python's: the exchanges (and between the two collectives of one),
# the end of step 1 (carry) and the block's end (remove_unstaged_dir: __exit__'s first call).
EXCHANGES = ((_collective, "_gather"), (_collective, "_broadcast"), (_collective, "_hold"),
             (_collective.Collective, "carry"), (_patch, "remove_unstaged_dir"))  # fmt: skip


class Stop(Exception):
    """What a program's own SIGINT handler may raise: an Exception, not a KeyboardInterrupt."""
TIMEOUT = 30.0  # a rank left behind waits this long, then the case fails (no case should)


def write(local: Path, rank: int, mib: int = 0) -> None:
    save_file({"w": torch.full((4096,), float(rank))}, str(local / f"model-rank{rank}.safetensors"))
    if mib:  # copies that take a while: several heartbeats while they run
        save_file({"big": torch.full((mib << 18,), float(rank))}, str(local / f"big-rank{rank}.safetensors"))
    torch.save({"rank": rank}, local / f"optim-rank{rank}.pt")
    if rank == 0:
        (local / "config.json").write_text("{}")
        torch.save({"step": 1}, local / "meta.pt")  # a trust file: published in phase 2


def outcome(call: Any) -> dict[str, Any]:
    try:
        manifest = call()
    except BaseException as exc:  # reported: the test judges it
        return {"ok": False, "type": type(exc).__name__, "errno": getattr(exc, "errno", None),
                "error": str(exc)[:400]}  # fmt: skip
    return {"ok": True, "files": len(manifest.files) if manifest is not None else None}


def commit(dest: Path, rank: int, background: bool, tap: Tap, *, mib: int = 0,
           sigint_after: Optional[float] = None, from_start: bool = False) -> dict[str, Any]:  # fmt: skip
    """One collective commit; ``sigint_after``: a real SIGINT to this process that many seconds
    after its block (a timer thread's kill: the kernel hands it to the main thread, wherever
    that is, a gloo wait included), unless the commit has returned by then; ``from_start``:
    from when __enter__ begins to wait for earlier background commits instead."""
    handle = safestage.staged_dir(dest, group=dist.group.WORLD, timeout=TIMEOUT, background=background)
    lock, running, sent, block_end = threading.Lock(), [True], [], [0.0]

    def interrupt() -> None:
        with lock:
            if running[0]:
                sent.append(True)
                os.kill(os.getpid(), signal.SIGINT)

    def block() -> Any:
        try:
            if from_start and sigint_after is not None:  # once __enter__ waits for the earlier one
                make_room = _work.make_room

                def timed(*args: Any) -> None:
                    _work.make_room = make_room
                    threading.Timer(sigint_after, interrupt).start()
                    make_room(*args)

                _work.make_room = timed
            with tap, handle as local:
                write(local, rank, mib)
                block_end[0] = time.monotonic()
                if sigint_after is not None and not from_start:
                    threading.Timer(sigint_after, interrupt).start()
            return handle.wait() if not background else None
        finally:
            with lock:  # no SIGINT after this
                running[0] = False

    result = outcome(block)
    result["wait"] = outcome(handle.wait)  # what the handle says of the commit, raised or not
    result["landing"] = time.monotonic() - block_end[0]  # seconds from the block's end to landed
    if sigint_after is not None:
        result["sent"] = bool(sent)
    return result


def judged(*dests: Path) -> dict[str, bool]:
    """Whether each of ``dests`` is complete, said by rank 0 once every rank is past them (the
    commit after them is collective), then removed: the cases' copies would fill /dev/shm."""
    said: dict[str, bool] = {}
    if dist.get_rank() == 0:
        for dest in dests:
            said[dest.name] = dest.exists() and safestage.verify(dest).complete
            shutil.rmtree(dest, ignore_errors=True)
    return said


def main() -> None:
    run, sweeps = Path(sys.argv[1]), json.loads(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results: list[dict[str, Any]] = []
    steps_of: dict[str, list[str]] = {}
    handled: list[int] = []  # the signals the program's own handler got, this case
    for sweep in sweeps:
        name, background = sweep["name"], sweep["background"]
        if "points" in sweep:  # real signals, at times after the block across a commit's length
            behind = sweep.get("behind_background", False)  # each case behind a background commit
            dry_run = commit(run / f"{name}-dry", rank, background or behind, Tap(), mib=sweep["mib"])
            lengths: list[Any] = [None] * world
            dist.all_gather_object(lengths, dry_run["landing"])
            points = sweep["points"]
            for delay in [max(lengths) * step / points for step in range(points + 1)]:
                for who in range(world):
                    index = len([r for r in results if r["sweep"] == name])
                    started = time.monotonic()
                    before = None
                    if behind:  # A waits for it before its block: a Ctrl-C meanwhile
                        before = commit(run / f"{name}-{index}-before", rank, True, Tap(), mib=sweep["mib"])
                    a = commit(run / f"{name}-{index}-a", rank, background, Tap(), mib=0 if behind else sweep["mib"],
                               sigint_after=delay if who == rank else None, from_start=behind)  # fmt: skip
                    b = commit(run / f"{name}-{index}-b", rank, False, Tap())
                    dist.barrier()  # every rank past B before rank 0 removes it
                    complete = judged(run / f"{name}-{index}-a", run / f"{name}-{index}-b", run / f"{name}-{index}-before")
                    results.append({"sweep": name, "case": index, "interrupted": who, "delay": round(delay, 3), "a": a, "b": b,
                                    "before": before, "complete": complete,
                                    "fired": "signal" if a.get("sent") else None,
                                    "seconds": round(time.monotonic() - started, 2)})  # fmt: skip
            report(results=results, steps=steps_of)
            continue
        handled.clear()
        if sweep.get("handler") == "flag":  # the program's own handler: it asks for a stop, raises nothing
            signal.signal(signal.SIGINT, lambda signum, frame: handled.append(signum))
        if sweep.get("handler") == "raise":  # the program's own handler raising an Exception

            def stop(signum: int, frame: Any) -> None:
                raise Stop("stopped by the program's SIGINT handler")

            signal.signal(signal.SIGINT, stop)

        def graceful(signum: int, frame: Any) -> None:  # a first Ctrl-C asks; a second is the default's
            handled.append(signum)
            signal.signal(signal.SIGINT, signal.default_int_handler)

        if sweep.get("handler") == "swap":
            signal.signal(signal.SIGINT, graceful)
        dry = Tap(calls=EXCHANGES, main_only=True)
        commit(run / f"{name}-dry", rank, background, dry)
        counts: list[Any] = [None] * world
        dist.all_gather_object(counts, len(dry.steps))
        steps = steps_of[name] = [step.name for step in dry.steps]
        if sweep.get("every_rank"):  # a Ctrl-C in the terminal reaches every rank: each at its K-th step
            cases = [(-1, at) for at in range(0, min(counts), sweep["stride"])]
        else:
            cases = [(who, at) for who in range(world) for at in range(0, counts[who], sweep["stride"])]
        for index, (who, at) in enumerate(cases):
            started = time.monotonic()
            again = at + sweep["again"] if "again" in sweep else None
            tap = Tap(at=at if who in (rank, -1) else None, action="interrupt", calls=EXCHANGES, main_only=True,
                      again=again if who in (rank, -1) else None)  # fmt: skip
            a = commit(run / f"{name}-{index}-a", rank, background, tap)
            b = commit(run / f"{name}-{index}-b", rank, False, Tap())
            dist.barrier()  # every rank past B before rank 0 removes it
            complete = judged(run / f"{name}-{index}-a", run / f"{name}-{index}-b")
            results.append({"sweep": name, "case": index, "interrupted": who, "at": at, "a": a, "b": b,
                            "complete": complete,
                            "fired": tap.fired.name if tap.fired is not None else None,
                            "dry_step": steps[at] if who in (rank, -1) and at < len(steps) else None,
                            "fired_again": tap.fired_again.name if tap.fired_again is not None else None,
                            "default_after": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                            "handled": len(handled), "seconds": round(time.monotonic() - started, 2)})  # fmt: skip
            handled.clear()
            if sweep.get("handler") == "swap":
                signal.signal(signal.SIGINT, graceful)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        report(results=results, steps=steps_of)
    report(results=results, steps=steps_of, finished=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
