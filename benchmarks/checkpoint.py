"""Whole-checkpoint benchmarks (issue 11): staged_dir's commit against a plain parallel copy,
the cost of the digest, the digest candidates, and latest_complete over 1000 checkpoints.

    PYTHONPATH=. /work/main/.venv/bin/python benchmarks/checkpoint.py            # ~6 min
    PYTHONPATH=. /work/main/.venv/bin/python benchmarks/checkpoint.py --quick    # ~1 min

Writes benchmarks/results/<date>-checkpoint.{json,md}. What is measured:

1. Digest candidates (stdlib only): MB/s of each over a 256 MiB buffer in the 4 MiB chunks
   the copy loop uses, one thread and two threads at once (they release the GIL).
2. Publishing a checkpoint (8 x 128 MiB shards + 6 small files; s3fs: 8 x 8 MiB, moto
   serves ~47 MB/s) onto kit ``slow`` (200 MB/s), kit ``hdfs`` and the real ``s3fs`` mount,
   with the same number of parallel streams (2, as a staged_dir commit) for:
   - ``commit``: the time staged_dir's block end takes (publish every file + commit file);
   - ``commit-nodigest``: the same with a no-op digest (the cost of CRC-32 is the difference);
   - ``copy-loop``: a plain read/write loop in 4 MiB chunks + fsync per file, 2 threads;
   - ``dd``: ``dd bs=4M conv=fsync`` per file, 2 at a time.
   All read the same files from /dev/shm (the staging root), warm. Each contender runs
   ``--repeats`` times in a fresh random order per repeat; medians, min-max, ratios within
   the run.
3. ``rename`` (staging root on the destination's filesystem, /tmp): no copy, so the digest
   is one extra read of each file: commit with and without it.
4. latest_complete over a parent holding 1000 checkpoint directories (the newest 20 never
   committed) on kit hdfs and rclone-local: first call and median of 5.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
MiB = 1 << 20
CHUNK = 4 * MiB
STREAMS = 2  # files a staged_dir commit publishes at once
SMALL = {
    "config.json": 2_000,
    "generation_config.json": 300,
    "model.safetensors.index.json": 40_000,
    "tokenizer.json": 2 * MiB,
    "trainer_state.json": 8_000,
    "rng_state.pth": 15_000,
}

sys.path.insert(0, str(HERE.parent))
import safestage  # noqa: E402
from safestage.checkpoint import _sequence as _commit  # noqa: E402

# -- 1. digest candidates -------------------------------------------------------------------------


class _Crc:
    def __init__(self, fn: Callable[[Any, int], int], start: int) -> None:
        self.fn, self.value = fn, start

    def update(self, data: memoryview) -> None:
        self.value = self.fn(data, self.value)


CANDIDATES: dict[str, Callable[[], Any]] = {
    "zlib.crc32": lambda: _Crc(zlib.crc32, 0),
    "zlib.adler32": lambda: _Crc(zlib.adler32, 1),
    "hashlib.sha1": hashlib.sha1,
    "hashlib.sha256": hashlib.sha256,
    "hashlib.md5": hashlib.md5,
    "hashlib.blake2b": hashlib.blake2b,
    "hashlib.blake2s": hashlib.blake2s,
    "hashlib.sha512": hashlib.sha512,
    "hashlib.sha3_256": hashlib.sha3_256,
}


def digest_speeds(total: int) -> dict[str, dict[str, float]]:
    buffer = os.urandom(CHUNK)
    view = memoryview(buffer)
    chunks = total // CHUNK

    def one(make: Callable[[], Any]) -> None:
        hasher = make()
        for _ in range(chunks):
            hasher.update(view)

    out = {}
    for name, make in CANDIDATES.items():
        single, double = [], []
        for _ in range(3):
            started = time.perf_counter()
            one(make)
            single.append(time.perf_counter() - started)
            threads = [threading.Thread(target=one, args=(make,)) for _ in range(2)]
            started = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            double.append(time.perf_counter() - started)
        out[name] = {
            "mbps_1_thread": chunks * CHUNK / min(single) / 1e6,
            "mbps_2_threads": 2 * chunks * CHUNK / min(double) / 1e6,
        }
    return out


# -- 2. publishing a checkpoint -------------------------------------------------------------------


def make_source(directory: Path, shards: int, shard_bytes: int) -> dict[str, int]:
    """The checkpoint's files in /dev/shm: random bytes (no compressible shortcut)."""
    directory.mkdir(parents=True)
    sizes = {f"model-{i:05d}-of-{shards:05d}.safetensors": shard_bytes for i in range(1, shards + 1)}
    sizes.update(SMALL)
    block = os.urandom(CHUNK)
    for name, size in sizes.items():
        with open(directory / name, "wb") as out:
            left = size
            while left:
                out.write(block[: min(left, CHUNK)])
                left -= min(left, CHUNK)
    return sizes


class _NoDigest:
    def update(self, data: memoryview, /) -> None:
        pass

    def hexdigest(self) -> str:
        return "00000000"


@contextlib.contextmanager
def digest_off() -> Iterator[None]:
    original = _commit._digest_factory
    _commit._digest_factory = lambda cancel: _NoDigest  # type: ignore[assignment,return-value]
    try:
        yield
    finally:
        _commit._digest_factory = original


def run_commit(source: Path, dest: Path, root: Path, *, digest: bool, publish: str = "auto") -> float:
    """staged_dir into ``dest``: the block links the source files in (instant: same
    tmpfs); the clock covers the block's end, i.e. the commit."""
    with contextlib.ExitStack() as stack:
        if not digest:
            stack.enter_context(digest_off())
        with safestage.staged_dir(dest, root, publish=publish) as local:
            for path in source.iterdir():
                os.link(path, local / path.name)
            started = time.perf_counter()
        return time.perf_counter() - started


def _copy_one(source: Path, target: Path) -> None:
    with open(source, "rb", buffering=0) as src:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            buffer = bytearray(CHUNK)
            view = memoryview(buffer)
            while count := src.readinto(buffer):
                written = 0
                while written < count:
                    written += os.write(fd, view[written:count])
            os.fsync(fd)
        finally:
            os.close(fd)


def run_copy_loop(source: Path, dest: Path) -> float:
    dest.mkdir()
    files = sorted(source.iterdir(), key=lambda p: -p.stat().st_size)
    started = time.perf_counter()
    with ThreadPoolExecutor(STREAMS) as pool:
        list(pool.map(lambda p: _copy_one(p, dest / p.name), files))
    return time.perf_counter() - started


def run_dd(source: Path, dest: Path) -> float:
    dest.mkdir()
    files = sorted(source.iterdir(), key=lambda p: -p.stat().st_size)

    def dd(path: Path) -> None:
        subprocess.run(
            ["dd", f"if={path}", f"of={dest / path.name}", "bs=4M", "conv=fsync", "status=none"],
            check=True,
        )

    started = time.perf_counter()
    with ThreadPoolExecutor(STREAMS) as pool:
        list(pool.map(dd, files))
    return time.perf_counter() - started


CONTENDERS = ("commit", "commit-nodigest", "copy-loop", "dd")


def bench_destination(
    name: str,
    parent: Path,
    remove: Callable[[Path], None],
    source: Path,
    root: Path,
    repeats: int,
    seed: int,
    extra: tuple[str, ...] = (),
) -> dict[str, Any]:
    rng = random.Random(seed)
    contenders = CONTENDERS + extra
    runs: dict[str, list[float]] = {c: [] for c in contenders}
    cpu: dict[str, list[float]] = {c: [] for c in contenders}  # this process + dd children
    nbytes = sum(p.stat().st_size for p in source.iterdir())
    run_commit(source, parent / "warmup", root, digest=True)  # rename probe, first mkdir
    remove(parent / "warmup")
    for repeat in range(repeats):
        order = list(contenders)
        rng.shuffle(order)
        for contender in order:
            dest = parent / f"{contender}-{repeat}"
            subprocess.run(["sync"], check=True)
            cpu_before = _cpu_seconds()
            if contender == "commit":
                seconds = run_commit(source, dest, root, digest=True)
                assert safestage.verify(dest).complete
            elif contender == "commit-nodigest":
                seconds = run_commit(source, dest, root, digest=False)
            elif contender == "commit-direct":
                seconds = run_commit(source, dest, root, digest=True, publish="direct")
                assert safestage.verify(dest).complete
            elif contender == "copy-loop":
                seconds = run_copy_loop(source, dest)
            else:
                seconds = run_dd(source, dest)
            runs[contender].append(seconds)
            cpu[contender].append(_cpu_seconds() - cpu_before)
            remove(dest)
            print(f"  {name} {contender:<16} {seconds:7.3f} s", flush=True)
    summary = {
        c: {
            "median_s": statistics.median(v),
            "min_s": min(v),
            "max_s": max(v),
            "median_mbps": nbytes / statistics.median(v) / 1e6,
            "runs": v,
            "cpu_s": statistics.median(cpu[c]),
        }
        for c, v in runs.items()
    }
    commit = summary["commit"]["median_s"]
    summary["ratios"] = {
        "commit_vs_copy_loop": commit / summary["copy-loop"]["median_s"],
        "commit_vs_dd": commit / summary["dd"]["median_s"],
        "commit_vs_best_copy": commit / min(summary["copy-loop"]["median_s"], summary["dd"]["median_s"]),
        "digest_share": (commit - summary["commit-nodigest"]["median_s"]) / commit,
        "digest_share_best_of_runs": (min(runs["commit"]) - min(runs["commit-nodigest"])) / min(runs["commit"]),
    }
    if "commit-direct" in summary:
        summary["ratios"]["commit_direct_vs_best_copy"] = summary["commit-direct"]["median_s"] / min(
            summary["copy-loop"]["median_s"], summary["dd"]["median_s"]
        )
    summary["ratios"]["digest_cpu_s_per_gib"] = (
        (summary["commit"]["cpu_s"] - summary["commit-nodigest"]["cpu_s"]) * (1 << 30) / nbytes
    )
    summary["bytes"] = nbytes
    return summary


def _cpu_seconds() -> float:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


# -- 3. rename: the digest is an extra read -------------------------------------------------------


def bench_rename(source: Path, base: Path, repeats: int) -> dict[str, Any]:
    """Staging root and destination on /tmp (one filesystem): files are renamed, never
    copied; with the digest each is read once. The block copies the files in (not timed)."""
    root = base / "root"
    root.mkdir()
    runs: dict[str, list[float]] = {"commit": [], "commit-nodigest": []}
    for repeat in range(repeats):
        for contender in random.Random(repeat).sample(list(runs), 2):
            dest = base / f"{contender}-{repeat}"
            with contextlib.ExitStack() as stack:
                if contender == "commit-nodigest":
                    stack.enter_context(digest_off())
                with safestage.staged_dir(dest, root, fsync=False) as local:
                    for path in source.iterdir():
                        shutil.copyfile(path, local / path.name)
                    started = time.perf_counter()
                runs[contender].append(time.perf_counter() - started)
            shutil.rmtree(dest)
    nbytes = sum(p.stat().st_size for p in source.iterdir())
    with_digest, without = statistics.median(runs["commit"]), statistics.median(runs["commit-nodigest"])
    return {
        "runs": runs,
        "median_s": {"commit": with_digest, "commit-nodigest": without},
        "digest_read_mbps": nbytes / max(with_digest - without, 1e-9) / 1e6,
        "bytes": nbytes,
    }


# -- 4. latest_complete over 1000 checkpoints -----------------------------------------------------


def make_many(mount_path: Path, backing: Path, count: int) -> Path:
    name = f"many-{uuid.uuid4().hex[:8]}"
    (mount_path / name).mkdir()  # through the mount: rclone caches the listings it made
    files = {f"model-0000{i}-of-00004.safetensors": b"s" * (100 + i) for i in range(1, 5)}
    files["config.json"] = b"{}"
    manifest = {
        "format": "safestage.commit", "version": 1, "digest": "crc32", "directories": [],
        "files": [{"path": k, "size": len(v), "digest": f"{zlib.crc32(v):08x}"} for k, v in sorted(files.items())],
    }  # fmt: skip
    for step in range(count):
        directory = backing / name / f"checkpoint-{step * 50}"
        directory.mkdir()
        for file_name, data in files.items():
            (directory / file_name).write_bytes(data)
        if step < count - 20:
            (directory / safestage.COMMIT_NAME).write_text(json.dumps(manifest))
    return mount_path / name


def bench_latest(mount_path: Path, backing: Path, count: int) -> dict[str, Any]:
    parent = make_many(mount_path, backing, count)
    times = []
    for _ in range(6):
        started = time.perf_counter()
        found = safestage.latest_complete(parent)
        times.append(time.perf_counter() - started)
        assert found == parent / f"checkpoint-{(count - 21) * 50}", found
    shutil.rmtree(backing / parent.name)
    return {"first_s": times[0], "median_s": statistics.median(times[1:]), "checkpoints": count}


# -- main ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--only", nargs="*", default=None, help="slow hdfs s3fs rename latest digests")
    parser.add_argument("--s3-shard-mib", type=int, default=None, help="shard size on s3fs (default 8)")
    parser.add_argument("--out", default=None, help="file stem under results/ (default <date>-checkpoint)")
    args = parser.parse_args(argv)
    from safestage.testing import hostile_mount, real_mount, stop_shared_s3_server

    quick = args.quick
    repeats = args.repeats or (1 if quick else 5)
    shard = (8 if quick else 128) * MiB
    s3_shard = (args.s3_shard_mib or (2 if quick else 8)) * MiB
    wanted = set(args.only or ["digests", "slow", "hdfs", "s3fs", "rename", "latest"])
    results: dict[str, Any] = {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "quick": quick,
        "repeats": repeats,
        "streams": STREAMS,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),  # the machine is shared: how busy it was
    }
    if "digests" in wanted:
        print("digest candidates ...", flush=True)
        results["digests"] = digest_speeds((32 if quick else 256) * MiB)
        for name, speed in results["digests"].items():
            print(f"  {name:<18} {speed['mbps_1_thread']:7.0f} MB/s  (2 threads: {speed['mbps_2_threads']:.0f})")

    shm = Path(tempfile.mkdtemp(prefix="safestage-ckbench-", dir="/dev/shm"))
    disk = Path(tempfile.mkdtemp(prefix="safestage-ckbench-"))
    try:
        root = shm / "root"
        root.mkdir()
        source = shm / "source"
        make_source(source, 8, shard)
        results["checkpoint"] = {"shards": 8, "shard_bytes": shard, "small_files": SMALL}
        for kit, mbps in (("slow", 200.0), ("hdfs", None)):
            if kit not in wanted:
                continue
            print(f"kit {kit} ...", flush=True)
            with hostile_mount(kit, shm / f"mnt-{kit}", mbps=mbps, backing=shm / f"backing-{kit}") as mount:
                backing = Path(mount.backing)
                results[kit] = bench_destination(
                    kit, Path(mount.path), lambda p, b=backing: shutil.rmtree(b / p.name), source, root, repeats, 1
                )
        if "s3fs" in wanted:
            print("s3fs ...", flush=True)
            s3_source = shm / "s3-source"
            make_source(s3_source, 8, s3_shard)
            with real_mount("s3fs", shm / "mnt-s3fs") as mount:
                results["s3fs"] = bench_destination(
                    "s3fs", Path(mount.path), shutil.rmtree, s3_source, root, repeats, 2, ("commit-direct",)
                )
                results["s3fs"]["note"] = f"8 x {s3_shard // MiB} MiB: moto serves ~47 MB/s"
            stop_shared_s3_server()
        if "rename" in wanted:
            print("rename (same filesystem) ...", flush=True)
            results["rename"] = bench_rename(source, disk, repeats)
        if "latest" in wanted:
            print("latest_complete over 1000 checkpoints ...", flush=True)
            count = 200 if quick else 1000
            with hostile_mount("hdfs", shm / "mnt-latest", backing=shm / "backing-latest") as mount:
                results["latest_hdfs"] = bench_latest(Path(mount.path), Path(mount.backing), count)
            with real_mount("rclone-local", disk / "mnt-rclone", backing=disk / "backing-rclone") as mount:
                assert mount.backing is not None
                results["latest_rclone_local"] = bench_latest(mount.path, mount.backing, count)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)

    results["load_average_at_end"] = os.getloadavg()
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / (args.out or f"{_dt.date.today().isoformat()}-checkpoint{'-quick' if quick else ''}")
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    stem.with_suffix(".md").write_text(report(results))
    print(report(results))
    print(f"written: {stem}.json, {stem}.md")
    return 0


def report(results: dict[str, Any]) -> str:
    lines = [f"# Checkpoint benchmarks, {results['date']} ({'quick' if results['quick'] else 'full'}, "
             f"{results['repeats']} repeats, {results['streams']} streams, {results['cpus']} CPUs; "
             f"load average {results['load_average_at_start'][0]:.1f} at start, "
             f"{results.get('load_average_at_end', [0.0])[0]:.1f} at end)", ""]  # fmt: skip
    if "digests" in results:
        lines += ["## Digest candidates (4 MiB chunks)", "", "| digest | MB/s, 1 thread | MB/s, 2 threads |", "|---|---|---|"]
        for name, speed in sorted(results["digests"].items(), key=lambda kv: -kv[1]["mbps_1_thread"]):
            lines.append(f"| {name} | {speed['mbps_1_thread']:.0f} | {speed['mbps_2_threads']:.0f} |")
        lines.append("")
    rows = [d for d in ("slow", "hdfs", "s3fs") if d in results]
    if rows:
        lines += [
            "## Publishing a checkpoint (median s, min-max; MB/s)",
            "",
            "| destination | commit | commit, no digest | copy loop | dd | commit / best copy | commit / copy loop | commit / dd | digest share | digest CPU |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for dest in rows:
            r = results[dest]

            def cell(c: str, r: dict[str, Any] = r) -> str:
                return f"{r[c]['median_s']:.2f} ({r[c]['min_s']:.2f}-{r[c]['max_s']:.2f}); {r[c]['median_mbps']:.0f}"

            q = r["ratios"]
            lines.append(
                f"| {dest} ({r['bytes'] / MiB:.0f} MiB) | {cell('commit')} | {cell('commit-nodigest')} | {cell('copy-loop')} | "
                f"{cell('dd')} | {q['commit_vs_best_copy']:.2f}x | {q['commit_vs_copy_loop']:.2f}x | {q['commit_vs_dd']:.2f}x | "
                f"{q['digest_share'] * 100:.1f}% (best-of-runs {q['digest_share_best_of_runs'] * 100:.1f}%) | "
                f"{q['digest_cpu_s_per_gib']:.2f} CPU-s/GiB |"
            )
        for dest in rows:
            r = results[dest]
            if "commit-direct" in r:
                lines.append(
                    f"{dest}: commit with publish='direct' {r['commit-direct']['median_s']:.2f} s "
                    f"({r['commit-direct']['min_s']:.2f}-{r['commit-direct']['max_s']:.2f}): "
                    f"{r['ratios']['commit_direct_vs_best_copy']:.2f}x the best copy"
                )
        lines.append("")
    if "rename" in results:
        r = results["rename"]
        lines += [
            "## rename (staging root on the destination's filesystem, fsync off): the digest is one extra read",
            "",
            f"commit {r['median_s']['commit']:.3f} s, without digest {r['median_s']['commit-nodigest']:.3f} s "
            f"for {r['bytes'] / MiB:.0f} MiB: the digest read costs {r['median_s']['commit'] - r['median_s']['commit-nodigest']:.3f} s "
            f"(~{r['digest_read_mbps']:.0f} MB/s)",
            "",
        ]
    for key, label in (("latest_hdfs", "kit hdfs"), ("latest_rclone_local", "rclone-local")):
        if key in results:
            r = results[key]
            lines.append(
                f"latest_complete over {r['checkpoints']} checkpoints on {label}: first call {r['first_s'] * 1e3:.0f} ms, "
                f"then median {r['median_s'] * 1e3:.0f} ms"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
