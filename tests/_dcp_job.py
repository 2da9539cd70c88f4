"""The one two-node job of the DCP tests (a job costs ~15 s of start-up on 2 cores, plus ~30 s
of CPU per rank to import Lightning): 4 ranks as two torchrun "nodes", each its own staging
root (SAFESTAGE_DIR: the switch is on in every rank), gloo on CPU. The worker (dcp_worker.py)
runs every case in order, each onto its destination, and each rank reports what each case did.
The test files that read it (test_dcp_staged_writer.py, integration/test_lightning_sharded.py,
integration/test_accelerate_state.py) share it: it runs once per session, when the first of
them asks.

Import it as ``tests._dcp_job`` everywhere: one module, one job.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from safestage.testing._s3 import shared_s3_server
from tests._stores import s3_environment
from tests._two_nodes import Job, launch

WORKER = Path(__file__).with_name("dcp_worker.py")
RANKS = 4
BUCKET = f"dcp-{uuid.uuid4().hex[:10]}"  # the url: cases' bucket

# (case name, kind, mount): dcp_worker.py says what each kind does.
CASES = [
    # safestage.dcp's writers, passed explicitly: every destination we serve, async_save, a
    # re-save whose one rank fails, the HuggingFace writer; DCP's own writer as the baseline
    ("hdfs", "save", "kit:hdfs"),
    ("mountpoint", "save", "kit:mountpoint"),
    ("s3fs", "save", "real:s3fs"),
    ("rclone-s3", "save", "real:rclone-s3"),
    ("async-thread", "async", "kit:hdfs"),
    ("async-process", "async-process", "kit:mountpoint"),
    ("stock-mountpoint", "stock", "kit:mountpoint"),
    ("resave-fail", "resave-fail", "kit:hdfs"),
    ("hf", "hf", "kit:mountpoint"),
    # DCP's own writers, the switch (SAFESTAGE_DIR) alone staging them
    ("switch-id-mountpoint", "switch-id", "kit:mountpoint"),
    ("switch-id-hdfs", "switch-id", "kit:hdfs"),
    ("switch-id-s3fs", "switch-id", "real:s3fs"),
    ("switch-id-url", "switch-id", "url:s3"),  # checkpoint_id="s3://...": no mount, no fsspec
    ("switch-writer", "switch-writer", "kit:mountpoint"),
    ("switch-async", "switch-async", "kit:hdfs"),
    ("switch-async-process", "switch-async-process", "kit:mountpoint"),
    ("switch-hf", "switch-hf", "kit:mountpoint"),
    ("switch-hf-rank0", "switch-hf-rank0", "real:s3fs"),
    ("switch-resave-fail", "switch-resave-fail", "kit:mountpoint"),
    ("switch-subclass", "switch-subclass", "kit:hdfs"),
    # frameworks on DCP, the switch on
    ("lightning-strategy-hdfs", "lightning-strategy", "kit:hdfs"),
    ("lightning-strategy-s3fs", "lightning-strategy", "real:s3fs"),
    ("lightning-fit", "lightning-fit", "kit:mountpoint"),
    ("accelerate", "accelerate", "kit:hdfs"),
]

_ran: dict[str, tuple[Job, dict[str, Any], tuple[Path, Path]]] = {}


def shared(
    tmp_path_factory: pytest.TempPathFactory, kit_mounts: dict[str, Any], real_mounts: dict[str, Any]
) -> tuple[Job, dict[str, Any], tuple[Path, Path]]:
    """(the job, each case's destination, the two nodes' staging roots), run on first use.
    Each destination is ``step-7`` in a fresh directory of its mount (``ckpts`` for the fit,
    ``checkpoints`` for accelerate): made by the save, whose parent must exist; a "url:s3"
    case's is the URL ``s3://<BUCKET>/t-<id>/step-7`` (a str), on the local moto server, whose
    AWS environment the launch passes on (``s3_environment``: a test reading it sets it too)."""
    if "job" not in _ran:
        base = tmp_path_factory.mktemp("dcp")
        roots = (base / "node0", base / "node1")
        for root in roots:
            root.mkdir()
        dests, plan = {}, []
        shared_s3_server().create_bucket(BUCKET)
        for name, kind, where in CASES:
            family, mode = where.split(":")
            if family == "url":
                dests[name] = f"s3://{BUCKET}/t-{uuid.uuid4().hex[:10]}/step-7"
                plan.append({"name": name, "kind": kind, "dest": dests[name]})
                continue
            mount = (kit_mounts if family == "kit" else real_mounts)[mode]
            parent = Path(mount.path) / f"t-{uuid.uuid4().hex[:10]}"
            parent.mkdir()
            dests[name] = parent / {"lightning-fit": "ckpts", "accelerate": "checkpoints"}.get(kind, "step-7")
            plan.append({"name": name, "kind": kind, "dest": str(dests[name])})
        (base / "plan.json").write_text(json.dumps(plan))
        job = launch(WORKER, [str(base / "plan.json")], roots=roots, result_dir=base / "results", timeout=900,
                     env={"GLOO_SOCKET_IFNAME": "lo", **s3_environment()})  # fmt: skip
        _ran["job"] = (job, dests, roots)
    return _ran["job"]


def outcomes(job: Job, case: str) -> dict[int, dict[str, Any]]:
    """Each rank's outcome of ``case``: {"ok": True} (and "seen": what a framework case saw),
    or the exception it raised."""
    assert not job.timed_out, "the job hung:\n" + job.output()
    assert job.returncodes == [0, 0], job.output()
    assert sorted(job.reports) == list(range(RANKS)), job.output()
    return {rank: report["results"][case] for rank, report in job.reports.items()}


def seen(job: Job, case: str) -> dict[str, Any]:
    """What a framework case saw, the same on every rank (asserted)."""
    every = outcomes(job, case)
    assert all(outcome["ok"] for outcome in every.values()), every
    assert all(outcome["seen"] == every[0]["seen"] for outcome in every.values()), every
    result: dict[str, Any] = every[0]["seen"]
    return result
