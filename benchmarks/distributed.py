"""Distributed commits (issue 19, "Speed"): 4 ranks committing one checkpoint onto kit ``slow``
and kit ``hdfs``, against 4 plain parallel copiers of the same files (the ceiling).

    PYTHONPATH=. /work/main/.venv/bin/python benchmarks/distributed.py             # ~7-9 min
    PYTHONPATH=. /work/main/.venv/bin/python benchmarks/distributed.py --quick     # ~1 min

Writes benchmarks/results/<date>-distributed.{json,md} (``--quick``: -distributed-quick).

One job runs everything: two torchrun launches with ``--nnodes 2`` on 127.0.0.1 (the launcher
of tests/_two_nodes.py), 2 ranks each, node ``i`` staging under its own root in /dev/shm
(SAFESTAGE_DIR); gloo on CPU. A launch costs ~14 s, so all ways and repeats run inside it,
separated by barriers. Every rank holds its 4 shards of 64 MiB (4 tensors of 16 MiB each,
random values) in memory before any clock starts; the kit mounts (one FUSE server each,
backing in /dev/shm) are shared by both nodes. Ways, per destination and repeat:

- ``write``: each rank ``save_file``s its 4 shards into a fresh local directory (the local
  write alone, for reference);
- ``copy`` (the ceiling): each rank copies its 4 shard files, written beforehand to /dev/shm
  (warm), to the destination: a plain read/write loop in 4 MiB chunks, fsync per file
  (``checkpoint.py``'s ``_copy_one``), one file after the other; the 4 ranks at once;
- ``write+copy``: ``write`` then ``copy`` on every rank: the ceiling from tensors in memory;
- ``staged_dir``: ``with staged_dir(dest, group=WORLD) as local: save_file(...) x 4``, defaults
  (publish auto, fsync, 2 files at once per rank, CRC-32); its clock runs from entering the
  block on the first rank to the last rank returning, and its publish part from the last
  rank's block end (nothing is published before every block ended) to the last return;
- ``dcp-local``: the same ``dcp.save`` through DCP's ``FileSystemWriter`` into /dev/shm (no
  destination): DCP's own local write, the part of ``StagedWriter`` before it publishes;
- ``StagedWriter``: ``dcp.save`` of the same tensors (one key each) through
  ``safestage.dcp.StagedWriter(dest)``; skipped, saying so, where ``safestage.dcp`` is missing;
- ``switch``: the same ``dcp.save`` through DCP's own ``FileSystemWriter`` with the switch on
  (the ranks run with SAFESTAGE_DIR: safestage wraps it in a StagedWriter, issue 25);
- ``FileSystemWriter``: the same ``dcp.save`` through DCP's own writer, straight onto the
  destination (``safestage.dcp.unstaged``: the switch is on in the ranks); where it raises,
  the error is reported instead of a time.

The clock of a way is the first rank's start (after a barrier) to the last rank's end: the
ranks share one host, so their ``time.monotonic()`` is one clock. Ways run in one order in
even repeats and in the reverse order in odd ones, so a drift of the shared machine cancels.
Each destination is removed through its backing directory (outside the clock) and ``sync``
runs before every way.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
MiB = 1 << 20
SHARDS = 4  # per rank
TENSORS_PER_SHARD = 4
SLOW_MBPS = 100.0  # the kit slow mount of issue 20's stall benchmark (the kit's default is 200)

for _path in (str(HERE), str(REPO)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

WAYS = (
    "write",
    "copy",
    "write+copy",
    "staged_dir",
    "dcp-local",
    "StagedWriter",
    "switch",
    "FileSystemWriter",
)
WHAT = {
    "write": "each rank save_file's its 4 shards into a local dir in /dev/shm (no destination)",
    "copy": "the ceiling: 4 plain copiers (one per rank, files one after the other, 4 MiB read/write loop, fsync per file) of the pre-written shard files",
    "write+copy": "write, then copy, on every rank: the ceiling from tensors in memory",
    "staged_dir": "collective staged_dir(dest, group=WORLD): save_file x 4 in the block; defaults (auto, fsync, 2 files at once per rank, CRC-32)",
    "dcp-local": "dcp.save(state_dict, storage_writer=FileSystemWriter(dir in /dev/shm)): DCP's local write alone (no destination), to read StagedWriter's row",
    "StagedWriter": "dcp.save(state_dict, storage_writer=safestage.dcp.StagedWriter(dest)), defaults",
    "switch": "dcp.save(state_dict, storage_writer=FileSystemWriter(dest)) with the switch on (SAFESTAGE_DIR): DCP's own writer, wrapped in a StagedWriter by safestage",
    "FileSystemWriter": "dcp.save(state_dict, storage_writer=safestage.dcp.unstaged(FileSystemWriter(dest))): DCP's own, straight onto the destination",
}


# -- the ranks (run under torchrun) -----------------------------------------------------------


class Rank:
    """One rank's side of the job: its tensors, its pre-written files, and how it times a way."""

    def __init__(self, plan: dict[str, Any]) -> None:
        import torch
        import torch.distributed as dist

        self.plan, self.dist, self.torch = plan, dist, torch
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.root = Path(os.environ["SAFESTAGE_DIR"])
        generator = torch.Generator().manual_seed(1234 + self.rank)
        each = plan["shard_bytes"] // TENSORS_PER_SHARD // 4
        self.shards = [
            {
                f"rank{self.rank}.shard{i}.w{j}": torch.randn(each, generator=generator)
                for j in range(TENSORS_PER_SHARD)
            }
            for i in range(SHARDS)
        ]
        self.source = self.root / f"bench-source-rank{self.rank}"
        self.source.mkdir(parents=True, exist_ok=True)
        self._write(self.source)  # the copiers' files, written once, warm in /dev/shm

    def name(self, index: int) -> str:
        return f"model-rank{self.rank}-{index + 1:05d}-of-{SHARDS:05d}.safetensors"

    def _write(self, directory: Path) -> None:
        from safetensors.torch import save_file

        for index, tensors in enumerate(self.shards):
            save_file(tensors, str(directory / self.name(index)))

    def _copy(self, target: Path) -> None:
        from checkpoint import _copy_one

        for index in range(SHARDS):
            _copy_one(self.source / self.name(index), target / self.name(index))

    def state_dict(self) -> dict[str, Any]:
        return {key: tensor for tensors in self.shards for key, tensor in tensors.items()}

    def gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        self.dist.all_gather_object(out, value)
        return out

    def run(self, way: str, dest: Path, backing: Path, repeat: int) -> dict[str, Any]:
        """Every rank runs ``way`` onto ``dest`` at once; returns the merged timings (on every rank)."""
        target = dest / f"{way.replace('+', '-')}-{repeat}"
        if way == "dcp-local":  # one path for every rank, as DCP expects (one host: /dev/shm)
            dest = backing = Path(self.plan["scratch"])
            target = dest / f"{way}-{repeat}"
        local = self.root / f"bench-local-rank{self.rank}-{way.replace('+', '-')}-{repeat}"
        if self.rank == 0 and way in ("copy", "write+copy"):
            target.mkdir()
        os.sync()
        self.dist.barrier()
        marks: dict[str, float] = {}
        error: Optional[str] = None
        started = time.monotonic()
        try:
            if way == "write":
                local.mkdir()
                self._write(local)
            elif way == "copy":
                self._copy(target)
            elif way == "write+copy":
                local.mkdir()
                self._write(local)
                marks["written"] = time.monotonic()
                self._copy(target)
            elif way == "staged_dir":
                import safestage

                with safestage.staged_dir(target, group=self.dist.group.WORLD) as staged:
                    self._write(staged)
                    marks["block_end"] = time.monotonic()
            elif way == "StagedWriter":
                staged_writer_save(self.state_dict(), target)
            elif way == "switch":  # the ranks run with SAFESTAGE_DIR set: staging is on
                from torch.distributed.checkpoint import FileSystemWriter
                from torch.distributed.checkpoint import save as dcp_save

                dcp_save(self.state_dict(), storage_writer=FileSystemWriter(target))
            elif way in ("FileSystemWriter", "dcp-local"):
                dcp_plain_save(self.state_dict(), target)
        except Exception as exc:  # reported instead of a time
            error = f"{type(exc).__name__}: {exc}"
        ended = time.monotonic()
        states = self.gather((started, ended, marks, error))
        result: dict[str, Any] = {"seconds": max(s[1] for s in states) - min(s[0] for s in states)}
        errors = [(rank, s[3]) for rank, s in enumerate(states) if s[3]]
        if errors:
            result = {"error": errors[0][1], "error_ranks": [rank for rank, _ in errors]}
        elif way == "staged_dir":
            last_block = max(s[2]["block_end"] for s in states)
            result["block_s"] = last_block - min(s[0] for s in states)
            result["publish_s"] = max(s[1] for s in states) - last_block
        elif way == "write+copy":
            result["write_s"] = max(s[2]["written"] for s in states) - min(s[0] for s in states)
        if self.rank == 0:
            result.update(self._check(way, target, error is None))
        self.dist.barrier()
        shutil.rmtree(local, ignore_errors=True)
        if self.rank == 0:
            shutil.rmtree(backing / target.relative_to(dest), ignore_errors=True)
        self.dist.barrier()
        return result

    def _check(self, way: str, target: Path, ok: bool) -> dict[str, Any]:
        """Outside the clock: the checkpoint is there and whole (bytes that landed)."""
        if not ok or way in ("write", "dcp-local"):
            return {}
        import safestage

        files = [p for p in target.rglob("*") if p.is_file()]
        found: dict[str, Any] = {"files": len(files), "bytes": sum(p.stat().st_size for p in files)}
        if way in ("staged_dir", "StagedWriter", "switch"):
            found["verified"] = safestage.verify(target).complete
        return found


def staged_writer_save(state_dict: dict[str, Any], target: Path) -> None:
    """The StagedWriter way (issue 19's ``safestage.dcp``): ImportError where it is missing."""
    from torch.distributed.checkpoint import save as dcp_save

    from safestage.dcp import StagedWriter

    dcp_save(state_dict, storage_writer=StagedWriter(target))


def dcp_plain_save(state_dict: dict[str, Any], target: Path) -> None:
    """DCP's own FileSystemWriter, in place even with the switch on (the ranks have SAFESTAGE_DIR)."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    writer = FileSystemWriter(target)
    try:
        from safestage.dcp import unstaged
    except ImportError:  # before issue 25: nothing stages DCP's own writer
        pass
    else:
        writer = unstaged(writer)
    dcp_save(state_dict, storage_writer=writer)


def staged_writer_available() -> Optional[str]:
    """None if ``safestage.dcp.StagedWriter`` imports, else why not."""
    try:
        from safestage.dcp import StagedWriter  # noqa: F401
    except ImportError as exc:
        return f"not available ({exc})"
    return None


def warm_up(rank: Rank, dest: Path, backing: Path, scratch: Path) -> None:
    """Untimed: make safestage's gloo group, probe the destination's rename, run DCP once (its
    first save in a job paid 13 s under load in a trial: imports and plan collectives)."""
    import safestage

    tiny = {f"rank{rank.rank}.warm": rank.torch.zeros(16)}
    dcp_plain_save(tiny, scratch / f"warm-up-{dest.name}")
    with safestage.staged_dir(dest / "warm-up", group=rank.dist.group.WORLD) as local:
        (local / f"rank{rank.rank}.bin").write_bytes(b"x" * 4096)
    if "StagedWriter" in rank.plan["ways"]:
        staged_writer_save(tiny, dest / "warm-up-dcp")
    rank.dist.barrier()
    if rank.rank == 0:
        for name in ("warm-up", "warm-up-dcp"):
            shutil.rmtree(backing / name, ignore_errors=True)
    rank.dist.barrier()


def worker(plan_path: Path) -> int:
    import torch.distributed as dist

    from tests._two_nodes import report

    plan = json.loads(plan_path.read_text())
    dist.init_process_group("gloo")
    rank = Rank(plan)
    ways = list(plan["ways"])
    out: dict[str, Any] = {}
    for dest_name, where in plan["destinations"].items():
        dest, backing = Path(where["path"]), Path(where["backing"])
        warm_up(rank, dest, backing, Path(plan["scratch"]))
        runs: dict[str, list[dict[str, Any]]] = {way: [] for way in ways}
        for repeat in range(plan["repeats"]):
            order = ways if repeat % 2 == 0 else ways[::-1]
            for way in order:
                previous = runs[way]
                if previous and "error" in previous[-1]:
                    continue  # fails the same way every time: once is the report
                result = rank.run(way, dest, backing, repeat)
                runs[way].append(result)
                if rank.rank == 0:
                    shown = (
                        f"{result['seconds']:7.2f} s"
                        if "seconds" in result
                        else f"fails: {result['error'][:160]}"
                    )
                    print(f"  {dest_name} #{repeat} {way:<17} {shown}", flush=True)
        out[dest_name] = runs
    report(results=out if rank.rank == 0 else {}, load_average=os.getloadavg())
    dist.barrier()
    dist.destroy_process_group()
    return 0


# -- the driver ---------------------------------------------------------------------------


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    if runs and "error" in runs[0]:
        return {"error": runs[0]["error"], "error_ranks": runs[0]["error_ranks"]}
    cell: dict[str, Any] = {"runs": runs}
    for key in ("seconds", "publish_s", "block_s", "write_s"):
        values = [run[key] for run in runs if key in run]
        if values:
            cell[key] = {
                "median": statistics.median(values),
                "min": min(values),
                "max": max(values),
            }
    cell["verified"] = all(run.get("verified", True) for run in runs)
    return cell


def ratios(cells: dict[str, Any]) -> dict[str, float]:
    """Like for like: a whole way (from tensors in memory to files on the destination) against
    write+copy; staged_dir's publish part against copy alone."""

    def median(way: str, key: str = "seconds") -> Optional[float]:
        cell = cells.get(way) or {}
        return (cell.get(key) or {}).get("median")

    out: dict[str, float] = {}
    ceiling, copy = median("write+copy"), median("copy")
    for way in ("staged_dir", "StagedWriter", "switch", "FileSystemWriter"):
        value = median(way)
        if value is not None and ceiling:
            out[f"{way}_vs_write+copy"] = value / ceiling
        if value is not None and copy:
            out[f"{way}_vs_copy"] = value / copy
    local, staged = median("dcp-local"), median("StagedWriter")
    if local is not None and copy and staged is not None:
        out["StagedWriter_vs_dcp-local+copy"] = staged / (local + copy)
    switch = median("switch")
    if switch is not None and staged is not None:
        out["switch_vs_StagedWriter"] = switch / staged
    if switch is not None and median("FileSystemWriter") is not None:
        out["switch_vs_FileSystemWriter"] = switch / median("FileSystemWriter")  # type: ignore[operator]
    publish = median("staged_dir", "publish_s")
    if publish is not None and copy:
        out["staged_dir_publish_vs_copy"] = publish / copy
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument(
        "--repeats", type=int, default=None, help="repeats of every way (default 4; --quick 1)"
    )
    parser.add_argument("--quick", action="store_true", help="8 MiB shards, 1 repeat: a smoke run")
    parser.add_argument(
        "--mbps", type=float, default=SLOW_MBPS, help=f"kit slow's pace (default {SLOW_MBPS:g})"
    )
    parser.add_argument("--only", nargs="*", default=None, help="destinations: slow hdfs")
    parser.add_argument("--ways", nargs="*", default=None, help=" ".join(WAYS))
    parser.add_argument(
        "--out", default=None, help="file stem under results/ (default <date>-distributed)"
    )
    args = parser.parse_args(argv)
    if args.worker is not None:
        return worker(args.worker)

    from run import machine_info

    from safestage.testing import hostile_mount
    from tests._two_nodes import launch

    repeats = args.repeats or (1 if args.quick else 4)
    shard_bytes = (8 if args.quick else 64) * MiB
    ways = [way for way in (args.ways or WAYS) if way in WAYS]
    missing = staged_writer_available()
    if "StagedWriter" in ways and missing is not None:
        print(f"StagedWriter: {missing}; its row is skipped", flush=True)
        ways.remove("StagedWriter")
    wanted = args.only or ["slow", "hdfs"]
    document: dict[str, Any] = {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "quick": args.quick,
        "repeats": repeats,
        "ranks": 4,
        "nodes": 2,
        "shards_per_rank": SHARDS,
        "shard_bytes": shard_bytes,
        "slow_mbps": args.mbps,
        "ways": ways,
        "what": {way: WHAT[way] for way in ways},
        "staged_writer": missing or "available",
        "load_average_at_start": os.getloadavg(),
    }
    # A SIGTERM (a shared machine's clean-up) unwinds through the finally: mounts unmounted.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    base = Path(tempfile.mkdtemp(prefix="safestage-distbench-", dir="/dev/shm"))
    started = time.monotonic()
    try:
        roots = (base / "node0", base / "node1")
        for root in (*roots, base / "scratch"):
            root.mkdir(mode=0o700)
        with contextlib.ExitStack() as stack:
            destinations = {}
            for kit in wanted:
                mount = stack.enter_context(
                    hostile_mount(kit, base / f"mnt-{kit}", mbps=args.mbps if kit == "slow" else None,
                                  backing=base / f"backing-{kit}")
                )  # fmt: skip
                destinations[kit] = {"path": str(mount.path), "backing": str(mount.backing)}
            plan = {"destinations": destinations, "repeats": repeats, "ways": ways, "shard_bytes": shard_bytes,
                    "scratch": str(base / "scratch")}  # fmt: skip
            (base / "plan.json").write_text(json.dumps(plan))
            print(
                f"one job, 4 ranks on 2 nodes: {', '.join(wanted)}; {repeats} repeats of {', '.join(ways)}",
                flush=True,
            )
            job = launch(Path(__file__).resolve(), ["--worker", str(base / "plan.json")], roots=roots,
                         result_dir=base / "results", timeout=3600.0)  # fmt: skip
        print(job.output())
        if 0 not in job.reports or any(code != 0 for code in job.returncodes):
            print(
                f"the job failed (exit codes {job.returncodes}, timed out: {job.timed_out})",
                file=sys.stderr,
            )
            return 1
        runs = job.reports[0]["results"]
        document["job_seconds"] = job.seconds
    finally:
        shutil.rmtree(base, ignore_errors=True)
    document["seconds"] = time.monotonic() - started
    document["load_average_at_end"] = os.getloadavg()
    document["machine"] = machine_info()
    document["versions"] = _versions()
    document["summary"] = {}
    for dest, per_way in runs.items():
        cells = {way: summarize(values) for way, values in per_way.items()}
        document["summary"][dest] = {"ways": cells, "ratios": ratios(cells)}
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / (
        args.out or f"{_dt.date.today().isoformat()}-distributed{'-quick' if args.quick else ''}"
    )
    stem.with_suffix(".json").write_text(json.dumps(document, indent=1) + "\n")
    text = markdown(document)
    stem.with_suffix(".md").write_text(text)
    print(text)
    print(f"written: {stem}.json, {stem}.md")
    return 0


def _versions() -> dict[str, str]:
    import importlib.metadata

    import safestage

    out = {"safestage": safestage.__version__, "python": sys.version.split()[0]}
    for name in ("torch", "safetensors"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[name] = importlib.metadata.version(name)
    return out


# -- the report ---------------------------------------------------------------------------

TARGET = 1.2


def _cell(cells: dict[str, Any], way: str, key: str = "seconds") -> str:
    cell = cells.get(way)
    if cell is None:
        return "not run"
    if "error" in cell:
        return "fails"
    value = cell.get(key)
    if value is None:
        return ""
    return f"{value['median']:.2f} ({value['min']:.2f}-{value['max']:.2f})"


def markdown(document: dict[str, Any]) -> str:
    from _report import _table

    total = document["ranks"] * document["shards_per_rank"] * document["shard_bytes"]
    load = (document["load_average_at_start"][0], document["load_average_at_end"][0])
    lines = [
        f"# Distributed commits, {document['date']} ({'quick' if document['quick'] else 'full'})",
        "",
        f"{document['ranks']} ranks on {document['nodes']} torchrun nodes (127.0.0.1, gloo, own staging root per node "
        f"in /dev/shm), each rank {document['shards_per_rank']} shards of {document['shard_bytes'] / MiB:.0f} MiB: "
        f"{total / MiB:.0f} MiB per checkpoint. Kit `slow` paced at {document['slow_mbps']:g} MB/s (shared by all "
        f"writers), kit `hdfs` unpaced (a Python FUSE server on the same 2 shared cores: CPU-bound). "
        f"Medians of {document['repeats']} repeats (min-max), seconds; ways alternate in order and reverse order "
        f"across repeats, all in one job. Load average {load[0]:.1f} at start, {load[1]:.1f} at end; "
        f"the whole benchmark took {document['seconds']:.0f} s. safestage {document['versions'].get('safestage')} "
        f"(git {document['machine'].get('git', {}).get('head', '?')}), torch {document['versions'].get('torch')}, "
        f"safetensors {document['versions'].get('safetensors')}.",
        "",
    ]
    if document["staged_writer"] != "available":
        lines += [f"StagedWriter: {document['staged_writer']}; its row is missing.", ""]
    dests = list(document["summary"])
    rows = []
    for way in WAYS:
        if not any(way in document["summary"][d]["ways"] for d in dests):
            continue
        rows.append([f"`{way}`", *(_cell(document["summary"][d]["ways"], way) for d in dests)])
        if way == "staged_dir":
            rows.append(
                [
                    "  its block (enter + local write)",
                    *(_cell(document["summary"][d]["ways"], way, "block_s") for d in dests),
                ]
            )
            rows.append(
                [
                    "  its publish part (last block end to last return)",
                    *(_cell(document["summary"][d]["ways"], way, "publish_s") for d in dests),
                ]
            )
        if way == "write+copy":
            rows.append(
                [
                    "  its write part",
                    *(_cell(document["summary"][d]["ways"], way, "write_s") for d in dests),
                ]
            )
    lines += [
        "## Seconds per checkpoint",
        "",
        *_table(["way", *(f"kit {d}" for d in dests)], rows),
        "",
    ]

    labels = [
        ("staged_dir_vs_write+copy", "`staged_dir` whole / `write+copy` (target)"),
        ("staged_dir_publish_vs_copy", "`staged_dir` publish part / `copy` (target, strict)"),
        ("StagedWriter_vs_write+copy", "`StagedWriter` / `write+copy` (target)"),
        (
            "StagedWriter_vs_dcp-local+copy",
            "`StagedWriter` / (`dcp-local` + `copy`): over DCP's own local write plus the ceiling's copy",
        ),
        ("switch_vs_StagedWriter", "the switch / `StagedWriter` passed explicitly (target 1.05x: one code path)"),
        ("switch_vs_FileSystemWriter", "the switch / `FileSystemWriter` in place"),
        ("FileSystemWriter_vs_write+copy", "`FileSystemWriter` / `write+copy`"),
        (
            "staged_dir_vs_copy",
            "`staged_dir` whole / `copy` (includes the local write the copy does not)",
        ),
        ("StagedWriter_vs_copy", "`StagedWriter` / `copy`"),
        ("FileSystemWriter_vs_copy", "`FileSystemWriter` / `copy`"),
    ]
    rows = []
    for key, label in labels:
        values = [document["summary"][d]["ratios"].get(key) for d in dests]
        if all(v is None for v in values):
            continue
        cells = []
        for value in values:
            if value is None:
                cells.append("")
            elif "(target 1.05x" in label:
                cells.append(f"{value:.3f}x, {'met' if value <= 1.05 else '**missed**'}")
            elif "(target" in label:
                cells.append(f"{value:.2f}x, {'met' if value <= TARGET else '**missed**'}")
            else:
                cells.append(f"{value:.2f}x")
        rows.append([label, *cells])
    if not rows:
        rows.append(["none: the ways they compare were not run", *("" for _ in dests)])
    lines += [
        f"## Ratios of medians (target <= {TARGET}x)",
        "",
        *_table(["ratio", *(f"kit {d}" for d in dests)], rows),
        "",
    ]

    errors = [
        (d, w, c) for d in dests for w, c in document["summary"][d]["ways"].items() if "error" in c
    ]
    if errors:
        lines += ["## Failures (reported instead of a time)", ""]
        for dest, way, cell in errors:
            lines.append(
                f"- `{way}` on kit `{dest}` (ranks {cell['error_ranks']}): `{cell['error'][:600]}`"
            )
        lines.append("")
    unverified = [
        (d, w)
        for d in dests
        for w, c in document["summary"][d]["ways"].items()
        if c.get("verified") is False
    ]
    lines.append(
        "Every committed checkpoint passed `safestage.verify` (outside the clock)."
        if not unverified
        else f"**Not verified complete**: {unverified}"
    )
    lines += ["", "## What each way includes", ""]
    lines += [f"- `{way}`: {document['what'][way]}" for way in document["ways"]]
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    sys.exit(main())
