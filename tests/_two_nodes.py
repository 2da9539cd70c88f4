"""Real multi-node jobs for the distributed tests: two torchrun launches on 127.0.0.1, each a
"node" with its own staging root (SAFESTAGE_DIR), gloo on CPU, several ranks per node.

A worker script reports through files: ``report(result_dir, ...)`` writes
``rank-<R>.json`` (what that rank returned or raised). A rank that never writes one was
killed, or hung and was stopped by the launcher's timeout (``Job.timed_out`` says which).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Job:
    """What two torchrun "nodes" did: their exit codes, output, and each rank's report."""

    returncodes: list[Optional[int]]
    outputs: list[str]
    reports: dict[int, dict[str, Any]] = field(default_factory=dict)
    timed_out: bool = False
    seconds: float = 0.0

    def output(self) -> str:
        return "\n".join(f"--- node {index} ---\n{text}" for index, text in enumerate(self.outputs))


def launch(
    script: Path,
    args: list[str],
    *,
    roots: tuple[Path, Path],
    result_dir: Path,
    nproc_per_node: int = 2,
    env: Optional[dict[str, str]] = None,
    timeout: float = 180.0,
) -> Job:
    """Run ``script args`` on 2 x ``nproc_per_node`` ranks: two torchrun launches with
    ``--nnodes 2`` on 127.0.0.1, node ``i`` staging under ``roots[i]``. Waits at most
    ``timeout`` seconds, then kills both launches (their process groups) and says so
    (``timed_out``); once every rank has reported or its node's launch has ended, an agent
    still waiting in torchrun's exit barrier is stopped after 10 s once the other launch has ended (not a hang of a rank)."""
    result_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    base["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), *filter(None, [base.get("PYTHONPATH")])]
    )
    procs = []
    started = time.monotonic()
    for node in (0, 1):
        command = [
            *TORCHRUN,
            "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", str(nproc_per_node),
            "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", "0",
            "--monitor-interval", "0.2",
            str(script), *args,
        ]  # fmt: skip
        node_env = {**base, "SAFESTAGE_DIR": str(roots[node]), "SAFESTAGE_TEST_RESULTS": str(result_dir)}
        proc = subprocess.Popen(
            command, env=node_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
        )  # fmt: skip
        procs.append(proc)
    # Each launch's output, read on threads (a full pipe would stall the agent).
    outputs: list[str] = ["", ""]
    readers = [threading.Thread(target=_drain, args=(proc, outputs, index), daemon=True) for index, proc in enumerate(procs)]
    for reader in readers:
        reader.start()
    timed_out, settled_at = False, None
    while any(proc.poll() is None for proc in procs):
        now = time.monotonic()
        if now - started > timeout:
            timed_out = True
            break
        # A node is settled once its agent is gone or all its ranks reported. torchrun's agent
        # whose workers succeeded waits in its exit barrier for the other node's agent, which
        # is gone if one of its ranks was killed: that wait is the launcher's, not a rank's.
        settled = all(
            proc.poll() is not None
            or all((result_dir / f"rank-{node * nproc_per_node + local}.json").exists() for local in range(nproc_per_node))
            for node, proc in enumerate(procs)
        )  # fmt: skip
        if settled and any(proc.poll() is not None for proc in procs):  # the other node's agent is gone
            settled_at = settled_at or now
            if now - settled_at > 10.0:
                break
        time.sleep(0.2)
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for reader in readers:
        reader.join(timeout=10)
    job = Job([proc.returncode for proc in procs], outputs, timed_out=timed_out)
    job.seconds = time.monotonic() - started
    for path in result_dir.glob("rank-*.json"):
        job.reports[int(path.stem.split("-")[1])] = json.loads(path.read_text())
    return job


def _drain(proc: subprocess.Popen[str], outputs: list[str], index: int) -> None:
    assert proc.stdout is not None
    outputs[index] = proc.stdout.read()


def report(**fields: Any) -> None:
    """Called by a worker: write this rank's report (atomically, so a kill leaves none or all)."""
    directory = Path(os.environ["SAFESTAGE_TEST_RESULTS"])
    rank = int(os.environ["RANK"])
    part = directory / f".rank-{rank}.json.part"
    part.write_text(json.dumps({"rank": rank, **fields}))
    os.replace(part, directory / f"rank-{rank}.json")
