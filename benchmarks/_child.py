"""One contender run, in its own process: the benchmark's measuring side.

Started by run.py as ``python benchmarks/_child.py --zygote`` in the dev virtualenv and in the
safetensors 0.7 side virtualenv. The zygote imports torch and safetensors once, then forks a
fresh child per request (one JSON line on stdin) and answers one JSON line on stdout when the
child has exited. Each run therefore has a process of its own (its own peak RSS, its own
safestage state: capability cache, background pool), without paying torch's 1.6 s import per
run. The child times only the workload; the zygote adds the child's ru_maxrss from wait4().

This file must import nothing from safestage at module level: the 0.7 side virtualenv has no
safestage.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any, Callable

MiB = 1 << 20



def _stage_for(root: Any, options: dict[str, Any]) -> Any:
    """safestage.staged(root, **options); "follow" is internal since 0.2 (no public option),
    forced through the seam the tests use."""
    import safestage
    from safestage._api import force_follow

    options = dict(options)
    follow = options.pop("follow", None)
    stage = safestage.staged(root, **options)
    return force_follow(stage, follow) if follow is not None else stage

def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


# -- workloads ----------------------------------------------------------------------------
# Each returns a list of (name, tensors) to save, or builds them inside the timed loop.


def _tensor(nbytes: int, value: float) -> Any:
    import torch

    # A fill, not randn: save_pretrained's per-shard "build" is collecting existing tensors
    # (at most a device-to-host copy, memory-bandwidth bound), not generating random numbers.
    return torch.empty(nbytes // 4, dtype=torch.float32).fill_(value)


def _build_shard(index: int, shard_bytes: int, per_shard: int) -> dict[str, Any]:
    each = shard_bytes // per_shard
    return {f"layers.{index}.w{j}": _tensor(each, index + j / 10) for j in range(per_shard)}


def _workload(
    spec: dict[str, Any], save: Callable[[dict[str, Any], str], None]
) -> tuple[Callable[[], None], int]:
    """(timed function, payload bytes). Tensors a single save needs are built before timing;
    a sharded loop builds each shard inside the timed loop, as save_pretrained does."""
    kind = spec["workload"]
    dest = spec["dest"]
    if kind == "single":
        tensors = {f"w{j}": _tensor(spec["tensor_bytes"], j) for j in range(spec["tensors"])}
        nbytes = spec["tensor_bytes"] * spec["tensors"]

        def run() -> None:
            save(tensors, os.path.join(dest, "model.safetensors"))

        return run, nbytes
    if kind == "shards":
        count, shard_bytes, per_shard = spec["shards"], spec["shard_bytes"], spec["per_shard"]

        def run() -> None:
            for index in range(count):
                tensors = _build_shard(index, shard_bytes, per_shard)
                if save is not None:
                    save(
                        tensors,
                        os.path.join(dest, f"model-{index + 1:05d}-of-{count:05d}.safetensors"),
                    )
                del tensors

        return run, count * shard_bytes
    if kind == "tiny":
        import torch

        tensors = {
            f"blocks.{j // 10}.p{j % 10}": torch.full((spec["tensor_bytes"] // 4,), float(j))
            for j in range(spec["tensors"])
        }

        def run() -> None:
            for index in range(spec["saves"]):
                save(tensors, os.path.join(dest, f"tiny-{index}.safetensors"))

        return run, spec["tensors"] * spec["tensor_bytes"] * spec["saves"]
    raise ValueError(f"unknown workload {kind!r}")


def run_contender(spec: dict[str, Any]) -> dict[str, Any]:
    from safetensors.torch import save_file

    kind = spec["kind"]  # "plain" (save_file as installed), "safestage", "build" (no save)
    baseline_kib = _status_kib("VmRSS")
    result: dict[str, Any] = {"baseline_rss_kib": baseline_kib}
    run, nbytes = _workload(spec, None if kind == "build" else save_file)  # type: ignore[arg-type]
    result["bytes"] = nbytes
    stage = None
    cpu_before = os.times()
    started = time.perf_counter()
    try:
        if kind == "safestage":
            stage = _stage_for(spec["root"], spec["options"])
            with stage:
                run()
        else:
            run()
        result["ok"] = True
    except Exception as exc:  # a contender that fails is a result ("fails"), not a crash
        result["ok"] = False
        result["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    result["seconds"] = time.perf_counter() - started
    cpu_after = os.times()
    result["client_cpu_s"] = cpu_after.user + cpu_after.system - cpu_before.user - cpu_before.system
    result["peak_rss_kib"] = _status_kib("VmHWM")
    if stage is not None:
        strategies: dict[str, int] = {}
        for record in stage.records:
            strategies[record.publish] = strategies.get(record.publish, 0) + 1
        result["strategies"] = strategies
        result["serialize_seconds"] = sum(r.serialize_seconds for r in stage.records)
        result["publish_seconds"] = sum(r.publish_seconds for r in stage.records)
    return result


# -- per-call overhead ---------------------------------------------------------------------


def _per_call_ns(func: Callable[[], Any], number: int, repeat: int = 7) -> dict[str, float]:
    import statistics
    import timeit

    samples = [t / number * 1e9 for t in timeit.repeat(func, number=number, repeat=repeat)]
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def run_overhead(spec: dict[str, Any]) -> dict[str, Any]:
    """Per-call cost of safestage's serialize_file wrapper, in nanoseconds (see README)."""
    import torch
    import wrapt
    from safetensors.torch import save_file

    import safestage
    from safestage import _patch

    dest_dir, root = spec["dest"], spec["root"]
    target = os.path.join(dest_dir, "x.safetensors")
    empty: dict[str, Any] = {}
    n = spec["iterations"]

    def noop(tensors: Any, filename: Any, metadata: Any = None) -> None:
        return None

    wrapper = wrapt.FunctionWrapper(noop, _patch._staging_wrapper)
    out: dict[str, Any] = {}
    out["noop_direct_ns"] = _per_call_ns(lambda: noop(empty, target), n)
    # 1. Installed wrapper, no stage open: what every save pays once safestage has been active
    #    and someone else's wrapper still holds ours (or a nested save): straight through.
    out["wrapper_passthrough_ns"] = _per_call_ns(lambda: wrapper(empty, target), n)
    # 2. Stage open: everything the wrapper does before it starts staging (stage lookup,
    #    filename argument, abspath, two stats of the destination), with Stage._save stubbed.
    stage = safestage.staged(root, fsync=False)
    with stage:
        stage._save = lambda serialize, dest, **options: None  # type: ignore[method-assign]
        out["wrapper_to_stage_decision_ns"] = _per_call_ns(lambda: wrapper(empty, target), n // 10)

    # 3. Opening and closing a stage (patch + unpatch serialize_file, root checks).
    def open_close() -> None:
        with safestage.staged(root, fsync=False):
            pass

    out["stage_open_close_ns"] = _per_call_ns(open_close, max(n // 1000, 20), repeat=5)
    # 4. A whole tiny save (one 1 KiB tensor): plain 0.8 vs staged (rename and replace paths).
    small = {"w": torch.zeros(256)}
    saves = max(n // 4000, 20)
    out["save_1KiB_plain_ns"] = _per_call_ns(lambda: save_file(small, target), saves, repeat=5)
    for label, options in (
        ("save_1KiB_staged_rename_nofsync_ns", {"fsync": False}),
        ("save_1KiB_staged_rename_fsync_ns", {"fsync": True}),
    ):
        with safestage.staged(root, **options):
            out[label] = _per_call_ns(lambda: save_file(small, target), saves, repeat=5)
    if spec.get("xdev_root"):
        for label, options in (
            ("save_1KiB_staged_replace_nofsync_ns", {"fsync": False}),
            ("save_1KiB_staged_replace_fsync_ns", {"fsync": True}),
        ):
            with safestage.staged(spec["xdev_root"], **options):
                out[label] = _per_call_ns(lambda: save_file(small, target), saves, repeat=5)
        if spec.get("follow_too"):  # issue 13: what following costs a tiny save (a thread, /proc scans)
            for label, options in (
                ("save_1KiB_staged_replace_follow_nofsync_ns", {"fsync": False, "follow": True}),
                ("save_1KiB_staged_replace_follow_fsync_ns", {"fsync": True, "follow": True}),
            ):
                with _stage_for(spec["xdev_root"], options):
                    out[label] = _per_call_ns(lambda: save_file(small, target), saves, repeat=5)
    os.unlink(target)
    return {"ok": True, "overhead": out}


# -- zygote ------------------------------------------------------------------------------


def _child_main(spec: dict[str, Any]) -> int:
    os.dup2(2, 1)  # the zygote's stdout is the protocol channel: keep prints off it
    try:
        result = run_overhead(spec) if spec["kind"] == "overhead" else run_contender(spec)
        code = 0
    except BaseException:
        result = {"ok": False, "error": traceback.format_exc()[-1500:]}
        code = 1
    with open(spec["result"], "w", encoding="utf-8") as handle:
        json.dump(result, handle)
    return code


def zygote() -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import safetensors
    import safetensors.torch
    import torch

    versions = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "safetensors": safetensors.__version__,
    }
    try:
        import wrapt  # noqa: F401

        import safestage

        versions["safestage"] = safestage.__version__
    except ImportError:
        pass
    print(json.dumps({"ready": True, "pid": os.getpid(), "versions": versions}), flush=True)
    for line in sys.stdin:
        spec = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _child_main(spec)
            finally:
                os._exit(code)
        _, status, usage = os.wait4(pid, 0)
        print(
            json.dumps(
                {
                    "pid": pid,
                    "status": os.waitstatus_to_exitcode(status),
                    "ru_maxrss_kib": usage.ru_maxrss,
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    if sys.argv[1:] == ["--zygote"]:
        zygote()
    else:
        print(json.dumps(_child_main(json.loads(sys.argv[1]))))
