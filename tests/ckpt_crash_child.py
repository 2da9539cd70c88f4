"""One checkpoint commit, for tests/test_checkpoint_crash_trials.py to SIGKILL at a random moment.

    python ckpt_crash_child.py PARENT_PID DEST ROOT SEED PUBLISH

Imports safestage (no torch: the checkpoint is built from bytes, so a process starts in
~0.1 s), prints ``{"ready": pid}`` and waits for SIGUSR1: the test's kill window covers the
commit alone. Then writes generation SEED of the checkpoint into ``staged_dir(DEST, ROOT)``
and commits it; prints ``{"done": pid, "block": s, "commit": s}`` and exits 0. Dies with
its parent (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import signal
import struct
import sys
import time
from pathlib import Path

SHARD_BYTES = 96 * 1024


def safetensors_bytes(data: bytes) -> bytes:
    """A real safetensors file holding ``data`` as one U8 tensor (safetensors' layout)."""
    header = json.dumps({"w": {"dtype": "U8", "shape": [len(data)], "data_offsets": [0, len(data)]}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + data


def generation(seed: int, shard_bytes: int = SHARD_BYTES) -> dict[str, bytes]:
    """Generation ``seed`` of the checkpoint: {relative path: bytes}. Every generation has the
    same files of the same sizes (only the bytes differ): sizes cannot tell two apart."""
    rng = random.Random(seed)
    files = {
        f"model-0000{i}-of-00003.safetensors": safetensors_bytes(rng.randbytes(shard_bytes))
        for i in range(1, 4)
    }
    files["model.safetensors.index.json"] = json.dumps({"seed": f"{seed:012d}"}).encode()
    files["config.json"] = json.dumps({"hidden": 8, "seed": f"{seed:012d}"}).encode()
    files["state/optimizer.pt"] = rng.randbytes(shard_bytes // 2)
    files[".metadata"] = rng.randbytes(512)
    return files


def _die_with_parent(parent: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(5)


def _emit(message: dict[str, object]) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


def main() -> int:
    parent, dest, root, seed, publish = sys.argv[1:6]
    _die_with_parent(int(parent))
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    import safestage

    files = generation(int(seed))
    _emit({"ready": os.getpid()})
    if signal.sigtimedwait({signal.SIGUSR1}, 60) is None:
        return 3
    started = time.perf_counter()
    commit = safestage.staged_dir(dest, root, publish=publish)
    with commit as local:
        for relative, data in files.items():
            (local / relative).parent.mkdir(parents=True, exist_ok=True)
            Path(local / relative).write_bytes(data)
        block = time.perf_counter() - started
    _emit({"done": os.getpid(), "block": block, "commit": time.perf_counter() - started - block})
    return 0


if __name__ == "__main__":
    sys.exit(main())
