"""What a one-file commit costs beside the run's earlier checkpoints (issue 30, item 13).

    PYTHONPATH=. /work/main/.venv/bin/python benchmarks/commit_siblings.py [--repeats 7]
        [--only hdfs s3fs] [--siblings 1 100] [--json out.json]

On each destination (the kit's ``hdfs`` FUSE mount; the real ``s3fs`` mount on a local moto S3
server, if s3fs and moto are installed) a run directory holds N committed checkpoints
(``checkpoint-1`` ... ``checkpoint-N``, 5 files each, as a commit leaves them), and the clock
covers one ``staged_dir`` commit of a one-file ``checkpoint-<N+1>`` (the staging root on the
local disk), removed again after each repeat so that N stays N. Prints the median seconds for
each N and the ratio of the largest N to the smallest, in the same run.

A commit looks at a sibling only where the timeline needs it (a higher step: a rollback), and
then at its commit file only (safestage/checkpoint/_timeline.py): the ratio should be about 1.
Before 0.5 it read the commit file and stat'ed every file of every same-series sibling.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import safestage

FILES = 5  # files of each earlier checkpoint


@contextlib.contextmanager
def destination(name: str) -> Iterator[Path]:
    if name == "s3fs":
        from safestage.testing import real_mount

        with real_mount("s3fs") as mount:
            yield Path(mount.path)
    else:
        from safestage.testing import hostile_mount

        with hostile_mount(name) as mount:
            yield Path(mount.path)


def make_run(run: Path, root: Path, siblings: int) -> None:
    run.mkdir()
    first = run / "checkpoint-1"
    with safestage.staged_dir(first, root) as local:
        for index in range(FILES):
            (local / f"shard-{index}.bin").write_bytes(os.urandom(256))
    for step in range(2, siblings + 1):
        shutil.copytree(first, run / f"checkpoint-{step}")


def time_commits(run: Path, root: Path, siblings: int, repeats: int) -> list[float]:
    times = []
    dest = run / f"checkpoint-{siblings + 1}"
    for _ in range(repeats):
        started = time.perf_counter()
        with safestage.staged_dir(dest, root) as local:
            (local / "model.bin").write_bytes(b"x" * 4096)
        times.append(time.perf_counter() - started)
        shutil.rmtree(dest)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--only", nargs="*", default=["hdfs", "s3fs"])
    parser.add_argument("--siblings", nargs="*", type=int, default=[1, 100])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results: dict[str, Any] = {}
    for name in args.only:
        with tempfile.TemporaryDirectory(prefix="commit-siblings-") as scratch, destination(name) as mount:
            root = Path(scratch)
            medians = {}
            for siblings in args.siblings:
                run = mount / f"run-{siblings}"
                make_run(run, root, siblings)
                times = time_commits(run, root, siblings, args.repeats)
                medians[siblings] = statistics.median(times)
                print(f"{name}: beside {siblings:4d} earlier checkpoints: median {medians[siblings]:.4f} s "
                      f"(min {min(times):.4f}, max {max(times):.4f}, {args.repeats} commits)", flush=True)  # fmt: skip
                shutil.rmtree(run)
            low, high = min(args.siblings), max(args.siblings)
            ratio = medians[high] / medians[low]
            print(f"{name}: {high} siblings / {low}: {ratio:.2f}x", flush=True)
            results[name] = {"medians": medians, "ratio": ratio}
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    sys.exit(main())
