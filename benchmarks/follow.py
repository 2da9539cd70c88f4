"""Issue 13: one big file as fast as its slowest half ("follow the writer").

    PYTHONPATH=. /work/main/.venv/bin/python benchmarks/follow.py [--repeats N] [--quick]
        [--st07-python PATH] [--only hdfs slow disk] [--out STEM]

One 1 GiB file (16 x 64 MiB tensors, built before the clock) onto kit ``hdfs`` and kit
``slow`` (200 MB/s), with the staging root on /dev/shm and on local disk (/tmp):

- ``ser-shm`` / ``ser-disk``: serializing alone (plain safetensors 0.8 into the root's fs);
- ``ceiling`` / ``ceiling-fsync``: ``dd bs=16M`` (``conv=fsync``) of the same bytes from /dev/shm;
- ``seq-*``: safestage as today (serialize, then copy); ``follow-*``: ``follow=True``;
  suffix ``-nofsync`` = ``fsync=False``;
- ``st07``: safetensors 0.7 straight onto the mount (needs ``--st07-python``, a python with
  safetensors 0.7 and torch, e.g. benchmarks/.venv-st07 made by run.py).

Plus the fsync cost on plain disk (``dd`` vs ``dd conv=fsync``, safestage rename path with
and without fsync) and the per-save bookkeeping of a 1 KiB save (_child.run_overhead, with
follow). Every run is its own process (run.py's zygotes), interleaved in a shuffled order
per repeat. Ratios are against max(serialize alone into the same root, the copy ceiling
with the same fsync) in the same run: the 1.15x goal of issue 13.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import run as _run  # noqa: E402  (Zygote, run_ceiling, make_source, sync)

MiB = 1 << 20
SINGLE = {"workload": "single", "tensors": 16, "tensor_bytes": 64 * MiB}
QUICK = {"workload": "single", "tensors": 4, "tensor_bytes": 16 * MiB}

ROOTS = ("shm", "disk")


def contenders(dest: str, with_st07: bool) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    if dest == "disk":  # the fsync cost on plain disk: rename path (root on /tmp) and dd
        out["ceiling"] = {"kind": "ceiling", "fsync": False}
        out["ceiling-fsync"] = {"kind": "ceiling", "fsync": True}
        out["st08"] = {"kind": "plain", "venv": "main", "dest": "dest"}
        out["ss-rename"] = {"kind": "safestage", "root": "disk", "options": {}}
        out["ss-rename-nofsync"] = {"kind": "safestage", "root": "disk", "options": {"fsync": False}}
        out["ss-xdev-shm"] = {"kind": "safestage", "root": "shm", "options": {}}
        out["ss-xdev-shm-nofsync"] = {"kind": "safestage", "root": "shm", "options": {"fsync": False}}
        out["ss-xdev-shm-follow"] = {"kind": "safestage", "root": "shm", "options": {"follow": True}}
        return out
    out["ceiling"] = {"kind": "ceiling", "fsync": False}
    out["ceiling-fsync"] = {"kind": "ceiling", "fsync": True}
    for root in ROOTS:
        out[f"ser-{root}"] = {"kind": "plain", "venv": "main", "dest": root}
        out[f"seq-{root}"] = {"kind": "safestage", "root": root, "options": {}}
        out[f"follow-{root}"] = {"kind": "safestage", "root": root, "options": {"follow": True}}
    out["seq-shm-nofsync"] = {"kind": "safestage", "root": "shm", "options": {"fsync": False}}
    out["follow-shm-nofsync"] = {
        "kind": "safestage", "root": "shm", "options": {"follow": True, "fsync": False}
    }
    if with_st07:
        out["st07"] = {"kind": "plain", "venv": "st07", "dest": "dest"}
    return out


def run_one(
    name: str,
    contender: dict[str, Any],
    dest_dir: Path,
    roots: dict[str, Path],
    source: Path,
    spec: dict[str, Any],
    zygotes: dict[str, Any],
    server_pids: list[int],
) -> dict[str, Any]:
    run_dir = dest_dir / f"run-{name}"
    run_dir.mkdir()
    plain_dir: Optional[Path] = None
    try:
        _run.sync_and_maybe_drop(False)
        server_before = _run.process_cpu_seconds(server_pids)
        if contender["kind"] == "ceiling":
            sizes = {"single": {"tensors": spec["tensors"], "tensor_bytes": spec["tensor_bytes"]}}
            result = _run.run_ceiling(source, run_dir, "single", sizes, contender["fsync"])
        else:
            target = run_dir
            if contender["kind"] == "plain" and contender["dest"] in roots:
                plain_dir = roots[contender["dest"]] / f"serialize-{name}"
                plain_dir.mkdir()
                target = plain_dir
            child = {"kind": contender["kind"], "dest": str(target), **spec}
            if contender["kind"] == "safestage":
                child["root"] = str(roots[contender["root"]])
                child["options"] = contender["options"]
            result = zygotes[contender.get("venv", "main")].run(child)
        result["server_cpu_s"] = _run.process_cpu_seconds(server_pids) - server_before
        return result
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        if plain_dir is not None:
            shutil.rmtree(plain_dir, ignore_errors=True)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    oks = [r for r in runs if r.get("ok")]
    out: dict[str, Any] = {"n": len(runs), "n_ok": len(oks)}
    if not oks:
        out["error"] = runs[0].get("error") if runs else "no runs"
        return out
    secs = [r["seconds"] for r in oks]
    out.update(median=statistics.median(secs), min=min(secs), max=max(secs), runs=secs)
    for key in ("serialize_seconds", "publish_seconds", "client_cpu_s", "server_cpu_s", "peak_rss_kib"):
        values = [r[key] for r in oks if key in r]
        if values:
            out[key] = statistics.median(values)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--st07-python", type=Path, default=None)
    parser.add_argument("--only", nargs="*", default=["hdfs", "slow", "disk"])
    parser.add_argument("--out", default=None)
    parser.add_argument("--seed", type=int, default=13)
    args = parser.parse_args(argv)
    spec = QUICK if args.quick else SINGLE
    nbytes = spec["tensors"] * spec["tensor_bytes"]

    from safestage.testing import hostile_mount

    base_shm = Path("/dev/shm") / f"safestage-follow-bench-{os.getpid()}"
    base_disk = Path("/tmp") / f"safestage-follow-bench-{os.getpid()}"
    base_shm.mkdir()
    base_disk.mkdir()
    roots = {"shm": base_shm / "root", "disk": base_disk / "root"}
    for root in roots.values():
        root.mkdir()
    source = base_shm / "source.bin"
    _run.make_source(source, nbytes)
    log_path = base_disk / "zygote.log"
    zygotes: dict[str, Any] = {"main": _run.Zygote(Path(sys.executable), log_path)}
    if args.st07_python is not None:
        zygotes["st07"] = _run.Zygote(args.st07_python, log_path)
    rng = random.Random(args.seed)
    results: dict[str, Any] = {}
    started = time.time()
    try:
        overhead_dir = base_disk / "overhead"
        overhead_dir.mkdir()
        overhead = zygotes["main"].run({
            "kind": "overhead", "dest": str(overhead_dir), "root": str(roots["disk"]),
            "xdev_root": str(roots["shm"]), "iterations": 20_000 if args.quick else 200_000,
            "follow_too": True,
        })  # fmt: skip
        results["overhead"] = overhead.get("overhead", overhead)
        for dest in args.only:
            names = contenders(dest, "st07" in zygotes)
            runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
            if dest == "disk":
                dest_dir = base_disk / "dest"
                dest_dir.mkdir()
                ctx: Any = None
                pids: list[int] = []
            else:
                backing = base_shm / f"backing-{dest}"
                ctx = hostile_mount(dest, None, mbps=200.0 if dest == "slow" else None, backing=backing)
                mount = ctx.__enter__()
                dest_dir, pids = Path(mount.path), [mount.server_pid]
            try:
                for repeat in range(args.repeats):
                    order = list(names)
                    rng.shuffle(order)
                    for name in order:
                        result = run_one(name, names[name], dest_dir, roots, source, spec, zygotes, pids)
                        runs[name].append(result)
                        print(f"[follow] {dest} r{repeat} {name}: {result.get('seconds', 0):.2f}s"
                              f"{'' if result.get('ok') else ' FAILED ' + str(result.get('error'))[:200]}",
                              flush=True)  # fmt: skip
            finally:
                if ctx is not None:
                    ctx.__exit__(None, None, None)
                    shutil.rmtree(base_shm / f"backing-{dest}", ignore_errors=True)
                else:
                    shutil.rmtree(dest_dir, ignore_errors=True)
            results[dest] = {n: summarize(r) for n, r in runs.items()}
    finally:
        for zygote in zygotes.values():
            zygote.close()
        shutil.rmtree(base_shm, ignore_errors=True)
        shutil.rmtree(base_disk, ignore_errors=True)
    results["meta"] = {
        "bytes": nbytes,
        "repeats": args.repeats,
        "wall_s": time.time() - started,
        "load_average": os.getloadavg(),
        "git": os.popen(f"git -C {HERE} rev-parse --short HEAD").read().strip(),
        "zygotes": {k: z.versions for k, z in zygotes.items()},
    }
    stem = args.out or f"{_dt.date.today().isoformat()}-follow{'-quick' if args.quick else ''}"
    out = _run.RESULTS / f"{stem}.json"
    out.write_text(json.dumps(results, indent=1))
    print(render(results))
    print(f"[follow] wrote {out}")
    return 0


def ratio_rows(results: dict[str, Any]) -> list[str]:
    rows = []
    for dest in ("hdfs", "slow"):
        cell = results.get(dest)
        if not cell:
            continue
        for root in ROOTS:
            ser = cell[f"ser-{root}"].get("median")
            for fsync, ceiling_name, seq, fol in (
                (True, "ceiling-fsync", f"seq-{root}", f"follow-{root}"),
                (False, "ceiling", f"seq-{root}-nofsync", f"follow-{root}-nofsync"),
            ):
                if fol not in cell or seq not in cell:
                    continue
                ceiling = cell[ceiling_name].get("median")
                if ser is None or ceiling is None:
                    continue
                bound = max(ser, ceiling)
                s, f = cell[seq].get("median"), cell[fol].get("median")
                verdict = "met" if f is not None and f / bound <= 1.15 else "**missed**"
                rows.append(
                    f"| {dest} | {root} | {'on' if fsync else 'off'} | {ser:.2f} | {ceiling:.2f} | "
                    f"{s:.2f} (x{s / bound:.2f}) | {f:.2f} (x{f / bound:.2f}) | {verdict} |"
                )
    return rows


def render(results: dict[str, Any]) -> str:
    lines = [
        "| dest | root | fsync | serialize alone | copy ceiling (dd) | sequential (x bound) | follow (x bound) | follow <= 1.15x |",
        "|---|---|---|---|---|---|---|---|",
        *ratio_rows(results),
        "",
    ]
    for dest in ("hdfs", "slow", "disk"):
        cell = results.get(dest)
        if not cell:
            continue
        lines.append(f"**{dest}** (seconds, median (min-max); serialize / publish split for safestage)")
        lines.append("")
        for name, s in sorted(cell.items()):
            if "median" not in s:
                lines.append(f"- `{name}`: fails: {s.get('error')}")
                continue
            split = (
                f"; serialize {s['serialize_seconds']:.2f} + publish {s['publish_seconds']:.2f}"
                if "serialize_seconds" in s
                else ""
            )
            cpu = f"; cpu {s.get('client_cpu_s', 0):.2f} + server {s.get('server_cpu_s', 0):.2f}"
            lines.append(f"- `{name}`: {s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f}){split}{cpu}")
        lines.append("")
    overhead = results.get("overhead", {})
    if overhead:
        lines.append("**1 KiB save, microseconds per save (median of batches)**")
        lines.append("")
        for key, value in overhead.items():
            if isinstance(value, dict) and "median" in value:
                lines.append(f"- `{key}`: {value['median'] / 1000:.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
