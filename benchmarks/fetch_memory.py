"""Client memory of ``safestage.fetch``: the peak RSS of a process fetching a checkpoint of one
large object from the local S3 server (moto, 127.0.0.1), against the bound the design promises
(``RANGE_BYTES * RANGES_AT_ONCE``, 64 MiB) and against one plain GET of the whole object.

    python benchmarks/fetch_memory.py [--mib 256] [--endpoint http://127.0.0.1:PORT]

``--endpoint``: another S3 server already running, that creates a bucket on its first PUT
(seaweedfs: ``weed server -s3 -s3.autoCreateBucket=true``). moto reads a whole object to answer
each ranged GET, so that its times of a ranged download grow with the object: its figures of
memory hold, its times do not.

Each measurement runs in a fresh child process: its VmRSS once safestage, obstore and a client
are loaded (the baseline), then its VmHWM after the download. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

_CHILD = r"""
import json, os, sys, time
from pathlib import Path

def status(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) // 1024
    raise KeyError(field)

import safestage, obstore
from safestage import _object_store
from safestage._destination import url_of
mode, url, local = sys.argv[1:4]
_object_store.head(url_of(url + "/_SAFESTAGE_COMMIT.json"))  # the client, its pool, its runtime
baseline = status("VmRSS")
started = time.perf_counter()
if mode == "fetch":
    path = safestage.fetch(url, local)
    assert safestage.verify(path).complete
else:  # one GET of the whole object, as a client that reads into memory does
    target = url_of(url + "/model.bin")
    data = obstore.get(_object_store._store(target), target.key).bytes()
    Path(local, "model.bin").write_bytes(data)
seconds = time.perf_counter() - started
print(json.dumps({"mode": mode, "baseline_mib": baseline, "peak_mib": status("VmHWM"), "seconds": seconds}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="size of the object (MiB)")
    parser.add_argument("--endpoint", help="an S3 server already running (default: moto, started here)")
    args = parser.parse_args()

    import safestage
    from safestage import _object_store
    from safestage.testing._s3 import shared_s3_server

    bucket = f"fetch-bench-{uuid.uuid4().hex[:8]}"
    if args.endpoint:
        endpoint, name = args.endpoint, args.endpoint
    else:
        server = shared_s3_server()
        server.create_bucket(bucket)
        endpoint, name = server.endpoint, "moto, 127.0.0.1"
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
           "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true"}  # fmt: skip
    os.environ.update(env)
    url = f"s3://{bucket}/run/checkpoint-1"
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch, "root")
        root.mkdir()
        started = time.perf_counter()
        with safestage.staged_dir(url, root) as local, open(local / "model.bin", "wb") as handle:
            for _ in range(args.mib):
                handle.write(os.urandom(1 << 20))
        upload_s = time.perf_counter() - started
        results = []
        for mode in ("fetch", "whole-get"):
            target = Path(scratch, mode)
            target.mkdir()
            done = subprocess.run([sys.executable, "-c", _CHILD, mode, url, str(target)], env={**os.environ, **env},
                                  capture_output=True, text=True, check=True)  # fmt: skip
            result = json.loads(done.stdout.strip().splitlines()[-1])
            result["above_baseline_mib"] = result["peak_mib"] - result["baseline_mib"]
            result["mib_per_s"] = round(args.mib / result["seconds"], 1)
            results.append(result)
    bound = _object_store.RANGE_BYTES * _object_store.RANGES_AT_ONCE >> 20
    print(json.dumps({"object_mib": args.mib, "bound_mib": bound, "upload_s": round(upload_s, 2),
                      "server": name, "results": results}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
