"""A rank of the breaker's probes of staged_dir(group=...) (tests/test_breaker_findings.py):
runs the cases of a JSON plan (argv[1]) and reports what each returned or raised, and when.

SAFESTAGE_BREAK_KILL = {"rank": R, "case": NAME, "at": STEP} SIGKILLs rank R of case NAME at
STEP: "enter", "status", "prepare", "heartbeat", "outcome", "final" (just before that
exchange), "publishing" (during its second file), "commit-file-written" (the coordinator,
right after the commit file landed).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

import safestage
from safestage.checkpoint import _collective, _sequence
from tests._two_nodes import report

KILL = json.loads(os.environ.get("SAFESTAGE_BREAK_KILL", "null"))
_state = {"case": None, "calls": 0, "phase": None}


def _die(where: str) -> None:
    sys.stderr.write(f"breaker: rank {dist.get_rank()} SIGKILLs itself at {where}\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _armed(step: str) -> bool:
    return (
        KILL is not None
        and KILL["rank"] == dist.get_rank()
        and KILL["case"] == _state["case"]
        and KILL["at"] == step
    )


def _step_of(value: object) -> str:
    calls = _state["calls"]
    if calls == 1:
        return "enter"
    if calls == 2:
        return "status"
    if calls == 3:
        return "prepare"
    if isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, bool) for v in value):
        return "heartbeat"
    if isinstance(value, tuple) and value and value[0] in ("published", "failed"):
        return "outcome"
    return "final"


_exchange = _collective.Collective.exchange


def exchange(self, value):  # type: ignore[no-untyped-def]
    _state["calls"] += 1
    step = _step_of(value)
    if step != _state["phase"]:
        _state["phase"] = step
        if _armed(step):
            _die(step)
    return _exchange(self, value)


_collective.Collective.exchange = exchange  # type: ignore[method-assign]
_announce = _collective.Collective.announce


def announce(self, value):  # type: ignore[no-untyped-def]
    # The last step, the coordinator's commit-file word, is a broadcast (Collective.announce).
    _state["calls"] += 1
    if _state["phase"] != "final":
        _state["phase"] = "final"
        if _armed("final"):
            _die("final")
    return _announce(self, value)


_collective.Collective.announce = announce  # type: ignore[method-assign]

_publish_one = _sequence.Commit._publish_one
_published_count = {"n": 0}


def publish_one(self, *args):  # type: ignore[no-untyped-def]
    _published_count["n"] += 1
    if _published_count["n"] == 2 and _armed("publishing"):
        _die("publishing")
    return _publish_one(self, *args)


_sequence.Commit._publish_one = publish_one  # type: ignore[method-assign]
_commit_file = _sequence.Commit.commit_file


def commit_file(self, *args):  # type: ignore[no-untyped-def]
    manifest = _commit_file(self, *args)
    if _armed("commit-file-written"):
        _die("commit-file-written")
    return manifest


_sequence.Commit.commit_file = commit_file  # type: ignore[method-assign]


def write(local: Path, rank: int, case: dict) -> None:
    if rank not in case.get("write_ranks", [rank]):
        return  # this rank's block writes nothing
    save_file({"w": torch.full((case.get("elements", 2048),), float(rank)), "rank": torch.tensor([rank])},
              str(local / f"model-rank{rank}.safetensors"))  # fmt: skip
    (local / "optim").mkdir(exist_ok=True)
    torch.save({"rank": rank}, local / "optim" / f"rank{rank}.pt")
    if rank == 0:
        (local / "config.json").write_text(json.dumps({"case": case["name"]}))
    if case.get("raise") == rank:
        raise KeyboardInterrupt("the block of this rank was interrupted")


def main() -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = []
    subgroups = {}
    for case in plan["cases"]:
        _state.update(case=case["name"], calls=0, phase=None)
        _published_count["n"] = 0
        started = time.monotonic()
        entry = {"case": case["name"]}
        try:
            if case.get("barrier"):
                dist.barrier()
            group = None if case.get("group_none") else dist.group.WORLD
            for ranks in case.get("precreate", []):  # every rank calls new_group, in order
                subgroups.setdefault((tuple(ranks), False), dist.new_group(ranks))
            if "subgroup" in case:
                ranks = case["subgroup"]
                key = (tuple(ranks), bool(case.get("local_sync")))
                if key not in subgroups:
                    if case.get("local_sync"):
                        subgroups[key] = (
                            dist.new_group(ranks, use_local_synchronization=True)
                            if rank in ranks
                            else None
                        )
                    else:
                        subgroups[key] = dist.new_group(ranks)  # every rank calls it
                group = subgroups[key]
                if rank not in ranks and rank not in case.get("call_anyway", []):
                    entry.update(ok=True, skipped=True)
                    results.append(entry)
                    report(results=results)  # as after every case
                    continue
            if case.get("late") == rank:
                time.sleep(case["late_seconds"])
            dest = case.get("dests", {}).get(str(rank), case.get("dest"))
            kwargs = {"timeout": case["timeout"]} if "timeout" in case else {}
            handle = safestage.staged_dir(
                dest,
                group=group,
                background=case.get("background", rank in case.get("background_ranks", [])),
                **kwargs,
            )
            with handle as local:
                write(local, rank, case)
                if case.get("sigint_after") is not None and rank == case.get("sigint_rank"):
                    timer = threading.Timer(
                        case["sigint_after"], os.kill, (os.getpid(), signal.SIGINT)
                    )
                    timer.daemon = True
                    timer.start()
            manifest = handle.wait()
            entry.update(ok=True, files=len(manifest.files), dest=str(handle.dest))
        except BaseException as exc:  # reported, the next case goes on
            entry.update(ok=False, type=type(exc).__name__, error=str(exc), errno=getattr(exc, "errno", None),
                         staged_path=getattr(exc, "staged_path", None))  # fmt: skip
        entry["seconds"] = round(time.monotonic() - started, 2)
        results.append(entry)
        report(results=results)  # after every case: a later kill leaves what came before
    report(results=results, finished=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
