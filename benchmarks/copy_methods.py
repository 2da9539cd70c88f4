"""Which copy loop should publish use? Chunk size x copy method x destination, plus the kit's ceiling.

    /work/.venv/bin/python benchmarks/copy_methods.py [--quick] [--json out.json]

Copies a warm file from /dev/shm (another device than every destination, as a cross-device
publish is) into: plain disk (/tmp, ext4), kit ``passthrough`` and kit ``hdfs`` (FUSE, backing
in /dev/shm). Methods:

- ``read/write``: what safestage._publish does (readinto one reusable buffer, write it all);
- ``sendfile``: os.sendfile(out, in, None, chunk) until done;
- ``copy_file_range``: os.copy_file_range(in, out, chunk) until done (EXDEV = unsupported).

Times open(O_CREAT|O_EXCL) .. close(), no fsync (the copy alone); ``sync`` before each run.
Then the kit's own ceiling: coreutils dd into each mount with bs=1M and bs=16M, and two dd
streams at once (does the FUSE server scale with writers?). run.py runs this as part of the
full benchmark and embeds the results.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

MiB = 1 << 20
CHUNKS_MIB = (1, 4, 8, 16, 32)


def _readinto_loop(src: int, dst: int, chunk: int) -> int:
    # As safestage._publish.copy_to_new_file: a buffered-off file object's readinto + os.write.
    buffer = bytearray(chunk)
    view = memoryview(buffer)
    total = 0
    with open(src, "rb", buffering=0, closefd=False) as reader:
        while True:
            count = reader.readinto(buffer)
            if not count:
                return total
            part = view[:count]
            while part:
                part = part[os.write(dst, part) :]
            total += count


def copy_sendfile(src: int, dst: int, chunk: int) -> int:
    total = 0
    while True:
        sent = os.sendfile(dst, src, None, chunk)
        if sent == 0:
            return total
        total += sent


def copy_file_range(src: int, dst: int, chunk: int) -> int:
    total = 0
    while True:
        copied = os.copy_file_range(src, dst, chunk)
        if copied == 0:
            return total
        total += copied


METHODS: dict[str, Callable[[int, int, int], int]] = {
    "read/write": _readinto_loop,
    "sendfile": copy_sendfile,
    "copy_file_range": copy_file_range,
}


def one_copy(source: Path, target: Path, method: str, chunk: int) -> float:
    src = os.open(source, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.posix_fadvise(src, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        started = time.perf_counter()
        dst = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            copied = METHODS[method](src, dst, chunk)
        finally:
            os.close(dst)
        seconds = time.perf_counter() - started
    finally:
        os.close(src)
    if copied != source.stat().st_size:
        raise OSError(errno.EIO, f"copied {copied} of {source.stat().st_size} bytes")
    return seconds


def _stats(nbytes: int, seconds: list[float]) -> dict[str, Any]:
    rates = [nbytes / s / 1e6 for s in seconds]
    return {
        "median_mbps": statistics.median(rates),
        "min_mbps": min(rates),
        "max_mbps": max(rates),
        "median_s": statistics.median(seconds),
        "n": len(seconds),
    }


def _sync(drop: bool) -> None:
    os.sync()
    if drop:
        with open("/proc/sys/vm/drop_caches", "w", encoding="ascii") as handle:
            handle.write("3\n")


def dd_ceiling(source: Path, directory: Path, nbytes: int, bs: str, streams: int) -> float:
    per = nbytes // streams
    started = time.perf_counter()
    procs = [
        subprocess.Popen(
            [
                "dd",
                f"if={source}",
                f"of={directory / f'dd-{i}.bin'}",
                f"bs={bs}",
                f"count={per}",
                f"skip={i * per}",
                "iflag=count_bytes,skip_bytes",
                "status=none",
            ]
        )
        for i in range(streams)
    ]
    codes = [p.wait() for p in procs]
    seconds = time.perf_counter() - started
    for i in range(streams):
        with contextlib.suppress(OSError):
            (directory / f"dd-{i}.bin").unlink()
    if any(codes):
        raise RuntimeError(f"dd failed: {codes}")
    return seconds


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--size-mib", type=int, default=None)
    parser.add_argument("--drop-caches", action="store_true")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    nbytes = (args.size_mib or (32 if args.quick else 128)) * MiB

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from safestage.testing import hostile_mount

    results: dict[str, dict[str, dict[str, Any]]] = {}
    kit_ceiling: list[dict[str, Any]] = []
    started_wall = time.time()
    with contextlib.ExitStack() as stack:
        shm = Path(tempfile.mkdtemp(prefix="safestage-copy-", dir="/dev/shm"))
        disk = Path(tempfile.mkdtemp(prefix="safestage-copy-", dir="/tmp"))
        stack.callback(shutil.rmtree, shm, True)
        stack.callback(shutil.rmtree, disk, True)
        source = shm / "source.bin"
        block = os.urandom(16 * MiB)
        with open(source, "wb") as handle:
            for offset in range(0, nbytes, len(block)):
                handle.write(block[: min(len(block), nbytes - offset)])
        targets = {"disk (/tmp)": disk}
        for mode in ("passthrough", "hdfs"):
            mount = stack.enter_context(hostile_mount(mode, None, backing=shm / f"backing-{mode}"))
            targets[f"kit {mode}"] = mount.path
        combos = [(m, c) for m in METHODS for c in CHUNKS_MIB]
        samples: dict[tuple[str, str, int], list[float]] = {}
        unsupported: dict[tuple[str, str], str] = {}
        for rep in range(repeats):
            for dest, directory in targets.items():
                shift = (rep * 7) % len(combos)
                for method, chunk in combos[shift:] + combos[:shift]:
                    if (dest, method) in unsupported:
                        continue
                    target = directory / f"copy-{method.replace('/', '')}-{chunk}.bin"
                    _sync(args.drop_caches)
                    try:
                        seconds = one_copy(source, target, method, chunk * MiB)
                    except OSError as exc:
                        unsupported[(dest, method)] = errno.errorcode.get(exc.errno or 0, str(exc))
                        print(
                            f"[copy] {dest} {method}: unsupported ({unsupported[(dest, method)]})",
                            flush=True,
                        )
                        continue
                    finally:
                        with contextlib.suppress(OSError):
                            target.unlink()
                    samples.setdefault((dest, method, chunk), []).append(seconds)
                    print(
                        f"[copy {time.time() - started_wall:4.0f}s] {dest:16} {method:16} {chunk:2} MiB: {nbytes / seconds / 1e6:7.0f} MB/s",
                        flush=True,
                    )
        for dest in targets:
            results[dest] = {}
            for method in METHODS:
                per_chunk: dict[str, Any] = {}
                for chunk in CHUNKS_MIB:
                    if (dest, method) in unsupported:
                        per_chunk[str(chunk)] = {"unsupported": unsupported[(dest, method)]}
                    elif (dest, method, chunk) in samples:
                        per_chunk[str(chunk)] = _stats(nbytes, samples[(dest, method, chunk)])
                results[dest][method] = per_chunk

        ceiling_samples: dict[tuple[str, str], list[float]] = {}
        variants = [
            ("dd bs=1M", "1M", 1),
            ("dd bs=16M", "16M", 1),
            ("2 x dd bs=16M at once", "16M", 2),
        ]
        for _rep in range(repeats):
            for dest, directory in targets.items():
                for label, bs, streams in variants:
                    _sync(args.drop_caches)
                    seconds = dd_ceiling(source, directory, nbytes, bs, streams)
                    ceiling_samples.setdefault((dest, label), []).append(seconds)
                    print(
                        f"[copy ceiling] {dest:16} {label:22}: {nbytes / seconds / 1e6:7.0f} MB/s",
                        flush=True,
                    )
        for (dest, label), seconds in ceiling_samples.items():
            kit_ceiling.append({"dest": dest, "what": label, **_stats(nbytes, seconds)})

    document = {
        "bytes": nbytes,
        "repeats": repeats,
        "chunks_mib": list(CHUNKS_MIB),
        "source_fs": "/dev/shm (tmpfs, warm)",
        "results": results,
        "kit_ceiling": kit_ceiling,
        "wall_seconds": time.time() - started_wall,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(document, indent=1), encoding="utf-8")
    else:
        print(json.dumps(document, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
