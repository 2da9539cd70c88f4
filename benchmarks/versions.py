"""Two safestage checkouts against each other, in one run: the same saves, interleaved.

    .venv/bin/python benchmarks/versions.py --before /tmp/safestage-0.1.0 [--repeats 3]

Each save is a process of its own with the checkout's directory first on PYTHONPATH, so the two
versions share the machine, the mounts, the tensors' shape and the moment (A B A B ...). The
parent mounts the kit's destinations once; each child builds a 1 GiB state dict (16 x 64 MiB
fp32) and times only `save_file` inside `safestage.staged(root)` with the default settings,
then removes the file. Medians per destination and version, and the ratio after/before.
Make the "before" checkout with `git worktree add /tmp/safestage-0.1.0 <commit>`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, os, sys, time
import torch
from safetensors.torch import save_file
import safestage
dest, root = sys.argv[1], sys.argv[2]
tensors = {f"t{i}": torch.full((16 << 20,), float(i)) for i in range(16)}  # 16 x 64 MiB
started = time.perf_counter()
with safestage.staged(root):
    save_file(tensors, dest)
seconds = time.perf_counter() - started
os.unlink(dest)
print(json.dumps({"seconds": seconds, "version": safestage.__version__, "file": safestage.__file__}))
"""


def one_save(checkout: Path, dest: Path, root: Path) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    env["PYTHONPATH"] = str(checkout)  # and cwd: `python -c` puts the cwd first on sys.path
    subprocess.run(["sync"], check=False)
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(dest), str(root)],
        env=env, cwd=checkout, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"a save with {checkout} failed:\n{done.stderr[-3000:]}")
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    if not str(result["file"]).startswith(str(checkout)):
        raise SystemExit(f"the child imported {result['file']}, not the checkout {checkout}")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the older checkout")
    parser.add_argument("--after", type=Path, default=REPO, help="the newer checkout (default: this one)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table here too")
    args = parser.parse_args()

    from safestage.testing import hostile_mount

    base = Path(tempfile.mkdtemp(prefix="safestage-versions-"))
    versions = {"before": args.before.resolve(), "after": args.after.resolve()}
    seconds: dict[tuple[str, str], list[float]] = {}
    labels: dict[str, str] = {}
    try:
        disk_root = base / "root"
        shm_root = Path(tempfile.mkdtemp(prefix="safestage-versions-", dir="/dev/shm"))
        disk_root.mkdir()
        with hostile_mount("hdfs") as hdfs, hostile_mount("mountpoint") as mountpoint, \
                hostile_mount("slow", mbps=200) as slow:  # fmt: skip
            (base / "disk").mkdir()
            destinations = {
                "disk, root on the same disk (rename)": (base / "disk", disk_root),
                "disk, root on /dev/shm (replace)": (base / "disk", shm_root),
                "kit hdfs (replace, followed)": (hdfs.path, disk_root),
                "kit slow 200 MB/s (replace, followed)": (slow.path, disk_root),
                "kit mountpoint, a new file (direct)": (mountpoint.path, disk_root),
            }
            for repeat in range(args.repeats):
                for name, (directory, root) in destinations.items():
                    order = ["before", "after"] if repeat % 2 == 0 else ["after", "before"]
                    for version in order:
                        result = one_save(versions[version], Path(directory) / "model.safetensors", root)
                        seconds.setdefault((name, version), []).append(float(result["seconds"]))  # type: ignore[arg-type]
                        labels[version] = str(result["version"])
                        print(f"{name:<42} {version:<6} {result['seconds']:.2f} s", file=sys.stderr)
        shutil.rmtree(shm_root, ignore_errors=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    lines = [
        f"One 1 GiB safetensors file (16 x 64 MiB fp32), `safestage.staged(root)` defaults, "
        f"{args.repeats} interleaved runs each; median seconds.",
        "",
        f"| destination | before ({labels['before']}) | after ({labels['after']}) | after / before |",
        "|---|---|---|---|",
    ]
    for name in destinations:
        before = statistics.median(seconds[(name, "before")])
        after = statistics.median(seconds[(name, "after")])
        lines.append(f"| {name} | {before:.2f} | {after:.2f} | {after / before:.3f}x |")
    table = "\n".join(lines)
    print(table)
    if args.out is not None:
        args.out.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
