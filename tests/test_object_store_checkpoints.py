"""Reading, pruning and recovering checkpoints committed to an object store (s3:// on moto's
real S3 server, gs:// on fake-gcs-server through the kit's XML front, 127.0.0.1), with the
promises they keep on paths: ``latest_complete`` is one paginated LIST plus one GET and never names a step whose objects no longer match its commit
object; ``verify`` (deep too) says why a checkpoint is not complete; retention never removes the
resume point nor a name its pattern does not take; ``recover`` re-uploads a kept copy."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _support import SUITE_SETTINGS, long_tier
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import load, save_file

import safestage
from safestage import COMMIT_NAME, _object_store
from safestage import cli as _cli
from safestage._destination import ObjectURL
from safestage.checkpoint._verify import matcher
from safestage.testing import FaultProxy, StoreBucket

# S3 and GCS: batched deletes and one DELETE an object. seaweedfs and Azure are shown saving by
# test_object_store_saves.py; each kind more here costs CI time.
pytestmark = pytest.mark.stores("moto", "fake-gcs", why="S3 and GCS show the reading side; each kind costs CI time")


@pytest.fixture
def bucket(store_bucket: StoreBucket) -> StoreBucket:
    """A fresh bucket, reached through the store's standard environment only (tests/conftest.py)."""
    return store_bucket


def commit(url: str, root: Path, step: int, *, size: int = 64) -> None:
    with safestage.staged_dir(url, root) as local:
        save_file({"w": np.full(size, step, dtype=np.float32)}, str(local / "model.safetensors"))
        (local / "trainer_state.json").write_text(json.dumps({"step": step}))


def run_of(bucket: StoreBucket, root: Path, steps: tuple[int, ...] = (1, 2, 3)) -> str:
    run = f"{bucket.url}/run"
    for step in steps:
        commit(f"{run}/checkpoint-{step}", root, step)
    return run


def keys(bucket: StoreBucket) -> list[str]:
    return bucket.objects()


def lists_and_gets(proxy: FaultProxy) -> tuple[list[Any], list[str]]:
    """The LISTs (their queries) and the GETs (their paths) the store was sent since the log was cleared."""
    made = proxy.requests(method="GET")
    return [r.query for r in made if "list-type" in r.query], [r.path for r in made if "list-type" not in r.query]


def url(text: str) -> ObjectURL:
    found = safestage._destination.url_of(text)
    assert found is not None
    return found


def test_latest_of_a_run_url_is_one_list_and_one_get_of_the_newest_commit_object(
    bucket: StoreBucket, store_proxy: FaultProxy, root: Path
) -> None:
    run = run_of(bucket, root)
    store_proxy.clear_log()
    found = safestage.latest_complete(run)
    assert found == url(f"{run}/checkpoint-3")
    lists, gets = lists_and_gets(store_proxy)
    assert len(lists) == 1 and gets == [f"/{bucket.name}/run/checkpoint-3/{COMMIT_NAME}"], store_proxy.requests()
    assert store_proxy.count() == 2, store_proxy.requests()


def test_a_second_page_of_the_listing_is_one_more_list_and_latest_is_still_right(
    bucket: StoreBucket, store_proxy: FaultProxy, root: Path
) -> None:
    run = run_of(bucket, root, (1, 2))
    # 1,001 objects sorting before the checkpoints: S3 and GCS list 1,000 keys a page, so every
    # checkpoint's key is on the second page.
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: _object_store.put_bytes(url(f"{run}/aaa-logs/{i:04d}.txt"), b"x"), range(1001)))
    store_proxy.clear_log()
    found = safestage.latest_complete(run)
    assert found == url(f"{run}/checkpoint-2")
    lists, gets = lists_and_gets(store_proxy)
    assert len(lists) == 2 and "continuation-token" in lists[1], store_proxy.requests()
    assert gets == [f"/{bucket.name}/run/checkpoint-2/{COMMIT_NAME}"]


def test_an_object_overwritten_after_its_commit_is_not_complete_and_latest_falls_back(
    bucket: StoreBucket, root: Path, caplog: Any
) -> None:
    """A stale writer of step 3 uploads its model.safetensors after step 3 was committed (same
    size, other bytes): the listing's ETag is not the commit object's."""
    run = run_of(bucket, root)
    stale = url(f"{run}/checkpoint-3/model.safetensors")
    before = _object_store.head(stale)
    with root.joinpath("stale.safetensors").open("wb"):
        pass
    save_file({"w": np.full(64, 99, dtype=np.float32)}, str(root / "stale.safetensors"))
    _object_store.upload(root / "stale.safetensors", stale)
    after = _object_store.head(stale)
    assert before is not None and after is not None and before.size == after.size and before.etag != after.etag

    with caplog.at_level(logging.INFO, logger="safestage"):
        assert safestage.latest_complete(run) == url(f"{run}/checkpoint-2")
    assert "checkpoint-3" in caplog.text and "changed" in caplog.text
    result = safestage.verify(f"{run}/checkpoint-3")
    assert not result.complete and [(p.path, p.kind) for p in result.problems] == [("model.safetensors", "changed")]
    assert safestage.verify(f"{run}/checkpoint-2").complete


def test_a_missing_object_or_a_deleted_commit_object_makes_latest_fall_back(
    bucket: StoreBucket, store_proxy: FaultProxy, root: Path
) -> None:
    run = run_of(bucket, root)
    _object_store.delete([url(f"{run}/checkpoint-3/trainer_state.json")])
    assert safestage.latest_complete(run) == url(f"{run}/checkpoint-2")
    problems = safestage.verify(f"{run}/checkpoint-3").problems
    assert [(p.path, p.kind) for p in problems] == [("trainer_state.json", "missing")]

    _object_store.delete([url(f"{run}/checkpoint-2/{COMMIT_NAME}")])
    store_proxy.clear_log()
    assert safestage.latest_complete(run) == url(f"{run}/checkpoint-1")
    # checkpoint-2 has no commit object in the listing: it costs no request.
    lists, gets = lists_and_gets(store_proxy)
    assert len(lists) == 1 and [g.split("/")[3] for g in gets] == ["checkpoint-3", "checkpoint-1"]
    assert [p.kind for p in safestage.verify(f"{run}/checkpoint-2").problems] == ["no-commit"]
    assert [p.kind for p in safestage.verify(f"{run}/checkpoint-9").problems] == ["not-a-directory"]


def test_deep_verify_streams_every_object_back_and_checks_its_crc(bucket: StoreBucket, root: Path) -> None:
    run = run_of(bucket, root, (1,))
    ckpt = f"{run}/checkpoint-1"
    result = safestage.verify(ckpt, deep=True)
    assert result.complete and result.bytes_read == result.manifest.total_bytes > 0, result  # type: ignore[union-attr]
    # A commit object recording another CRC-32 for the same size and ETag: only the bytes can say.
    manifest = json.loads(_object_store.read(url(f"{ckpt}/{COMMIT_NAME}")) or b"")
    for entry in manifest["files"]:
        if entry["path"] == "model.safetensors":
            entry["digest"] = "00000000" if entry["digest"] != "00000000" else "00000001"
    _object_store.delete([url(f"{ckpt}/{COMMIT_NAME}")])
    _object_store.put_bytes(url(f"{ckpt}/{COMMIT_NAME}"), json.dumps(manifest).encode(), create=True)
    assert safestage.verify(ckpt).complete
    deep = safestage.verify(ckpt, deep=True)
    assert [(p.path, p.kind) for p in deep.problems] == [("model.safetensors", "digest")]
    _object_store.put_bytes(url(f"{ckpt}/extra.txt"), b"not committed")
    assert safestage.verify(ckpt, deep=True).extra == ["extra.txt"]


def test_the_commands_take_a_url_and_name_it_when_the_store_refuses(bucket: StoreBucket, root: Path, capsys: Any) -> None:
    run = run_of(bucket, root, (1, 2))
    assert _cli.main(["latest", run]) == 0
    assert capsys.readouterr().out.strip() == f"{run}/checkpoint-2"
    assert _cli.main(["verify", f"{run}/checkpoint-2", "--deep"]) == 0
    assert "complete: 2 files" in capsys.readouterr().out
    _object_store.delete([url(f"{run}/checkpoint-2/model.safetensors")])
    assert _cli.main(["verify", f"{run}/checkpoint-2"]) == 1
    assert "model.safetensors: missing" in capsys.readouterr().out
    assert _cli.main(["latest", run, "--pattern", "step-*"]) == 1
    assert "checkpoint-1" in capsys.readouterr().err  # what the pattern does not take is named

    missing = f"{bucket.url}-missing/run"
    assert _cli.main(["latest", missing]) == 3
    err = capsys.readouterr().err
    assert missing.replace("/run", "") in err and "list" in err and "testing" not in err, err  # no secret
    assert _cli.main(["verify", f"{missing}/checkpoint-1"]) == 1
    assert "list" in capsys.readouterr().out


FOREIGN = ("checkpoint-1-merged/model.safetensors", "checkpoint-final/model.safetensors", "checkpoint-2",
           "notes.txt", "checkpoint-0x10/x")  # fmt: skip


def test_prune_of_a_run_url_removes_commit_object_first_and_never_a_foreign_key(
    bucket: StoreBucket, store_proxy: FaultProxy, root: Path
) -> None:
    run = run_of(bucket, root, (1, 2, 3, 4))
    for key in FOREIGN:
        _object_store.put_bytes(url(f"{run}/{key}"), b"not a checkpoint of this pattern")
    _object_store.put_bytes(url(f"{run}/checkpoint-0/model.safetensors"), b"a killed save's leftover")
    assert safestage.prune(run, keep=2, dry_run=True) == [url(f"{run}/checkpoint-{n}") for n in (0, 1, 2)]
    store_proxy.clear_log()
    removed = safestage.prune(run, keep=2)
    assert removed == [url(f"{run}/checkpoint-{n}") for n in (0, 1, 2)]
    assert sorted(keys(bucket)) == sorted([f"run/{key}" for key in FOREIGN] + [
        f"run/checkpoint-{n}/{name}" for n in (3, 4) for name in (COMMIT_NAME, "model.safetensors", "trainer_state.json")])
    # Oldest first, each removal (on S3, its multipart uploads in flight listed first: there are
    # none) its own LIST of its prefix, then, where there is a commit object, a delete of it
    # alone before the delete of the rest.
    removal = []
    for r in store_proxy.requests():
        if r.method == "GET" and "uploads" in r.query:
            if r.query.get("prefix", "").startswith("run/checkpoint-"):
                removal.append(("UPLOADS", r.query["prefix"]))
        elif r.method == "GET" and r.query.get("prefix", "").startswith("run/checkpoint-"):
            removal.append(("LIST", r.query["prefix"]))
        elif (r.method == "POST" and "delete" in r.query) or r.method == "DELETE":
            removal.append(("DELETE", COMMIT_NAME if r.path.endswith(COMMIT_NAME) else "data"))
    data, commit_object = ("DELETE", "data"), ("DELETE", COMMIT_NAME)
    if bucket.server.scheme == "s3":  # batched deletes (POST ?delete): the commit object's alone, then the rest
        assert removal == [("UPLOADS", "run/checkpoint-0/"), ("LIST", "run/checkpoint-0/"), data,
                           ("UPLOADS", "run/checkpoint-1/"), ("LIST", "run/checkpoint-1/"), data, data,
                           ("UPLOADS", "run/checkpoint-2/"), ("LIST", "run/checkpoint-2/"), data, data], removal  # fmt: skip
    else:  # GCS has no batched delete: one DELETE an object
        assert removal == [("LIST", "run/checkpoint-0/"), data, ("LIST", "run/checkpoint-1/"), commit_object, data, data,
                           ("LIST", "run/checkpoint-2/"), commit_object, data, data], removal  # fmt: skip


def test_prune_never_removes_the_resume_point_when_newer_steps_are_not_complete(bucket: StoreBucket, root: Path) -> None:
    run = run_of(bucket, root, (1, 2, 3))
    _object_store.delete([url(f"{run}/checkpoint-3/model.safetensors")])  # 3: not complete
    assert safestage.latest_complete(run) == url(f"{run}/checkpoint-2")
    assert safestage.prune(run, keep=1) == [url(f"{run}/checkpoint-1")]
    assert safestage.latest_complete(run) == url(f"{run}/checkpoint-2")  # the resume point stays
    assert any(key.startswith("run/checkpoint-3/") for key in keys(bucket))  # as new as it: a save in progress


def test_keep_on_a_url_prunes_after_each_commit(bucket: StoreBucket, root: Path) -> None:
    run = f"{bucket.url}/run"
    for step in (1, 2, 3, 4):
        with safestage.staged_dir(f"{run}/checkpoint-{step}", root, keep=2) as local:
            (local / "state.json").write_text(str(step))
    assert sorted({key.split("/")[1] for key in keys(bucket)}) == ["checkpoint-3", "checkpoint-4"]
    assert safestage.latest_complete(run) == url(f"{run}/checkpoint-4")


def test_the_prune_command_takes_a_run_url(bucket: StoreBucket, root: Path, capsys: Any) -> None:
    run = run_of(bucket, root, (1, 2))
    assert _cli.main(["prune", run, "--keep", "1", "--dry-run"]) == 0
    assert f"would remove  {run}/checkpoint-1" in capsys.readouterr().out
    assert _cli.main(["prune", run, "--keep", "1"]) == 0
    assert f"removed       {run}/checkpoint-1" in capsys.readouterr().out
    assert _cli.main(["prune", f"{bucket.url}-missing/run", "--keep", "1"]) == 3
    err = capsys.readouterr().err
    assert f"{bucket.url}-missing" in err and "list" in err and "testing" not in err, err


def prune_examples() -> int:
    text = SUITE_SETTINGS.get("SAFESTAGE_STORE_PRUNE_EXAMPLES", "").strip()
    return int(text) if text else (150 if long_tier() else 12)


_NAME = st.one_of(
    st.sampled_from(["checkpoint-1", "checkpoint-2", "checkpoint-3"]),  # a checkpoint's own name
    st.text(alphabet="checkpoint-_.e0123456789٣", min_size=1, max_size=16),
    st.builds("checkpoint-{}{}".format, st.integers(0, 3), st.text(alphabet="-_.xe0123456789", min_size=1, max_size=4)),
)
# Objects whose names the pattern does not take, and plain objects (no "/" after the name)
# whose names it does take: neither is a checkpoint.
_FOREIGN = st.tuples(_NAME, st.sampled_from(["", "/model.safetensors", f"/{COMMIT_NAME}", "/sub/x.bin"])).filter(
    lambda item: (matcher("checkpoint-*")(item[0]) is None or not item[1]) and item[0] not in (".", ".."))


@settings(max_examples=prune_examples(), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
@given(foreign=st.lists(_FOREIGN, min_size=1, max_size=5, unique_by=lambda item: item[0]), keep=st.integers(1, 2),
       markers=st.booleans())  # fmt: skip
def test_prune_on_a_url_never_touches_a_name_its_pattern_does_not_take(
    bucket: StoreBucket, root: Path, foreign: list[tuple[str, str]], keep: int, markers: bool
) -> None:
    run = f"{bucket.url}/run-{uuid.uuid4().hex[:8]}"
    prefix = url(run).prefix
    for step in (1, 2, 3):
        commit(f"{run}/checkpoint-{step}", root, step, size=4)
    placed = {}
    for name, tail in foreign:
        placed[f"{name}{tail}"] = f"{name}{tail}".encode()
        _object_store.put_bytes(url(f"{run}/{name}{tail}"), placed[f"{name}{tail}"])
    put_marker = getattr(bucket.server, "put_object", None)  # S3's kit: folder markers (the console's, s3fs's)
    if markers and put_marker is not None:
        for name in [name for name, _ in foreign] + [f"checkpoint-{n}" for n in (1, 2, 3)]:
            put_marker(bucket.name, f"{prefix}{name}/")
    safestage.prune(run, keep=keep)
    assert {key: _object_store.read(url(f"{run}/{key}")) for key in placed} == placed  # every foreign object, as it was
    assert safestage.latest_complete(run) == url(f"{run}/checkpoint-3")
    left = [key[len(prefix):] for key in keys(bucket) if key.startswith(prefix)]
    assert {key.split("/")[0] for key in left if "/" in key.rstrip("/") and matcher("checkpoint-*")(key.split("/")[0]) is not None} \
        == {f"checkpoint-{n}" for n in range(4 - keep, 4)}


KEPT_BY_A_FAILED_JOB = """\
import json, sys
import numpy as np
from safetensors.numpy import load, save_file
import safestage
run, root = sys.argv[1], sys.argv[2]
kept = []
try:
    with safestage.staged_dir(f"{run}/checkpoint-7", root) as local:
        save_file({"w": np.arange(16, dtype=np.float32)}, str(local / "model.safetensors"))
        (local / "trainer_state.json").write_text('{"global_step": 7}')
except safestage.PublishError as exc:
    kept.append(exc.staged_path)
try:
    with safestage.staged(root):
        save_file({"w": np.arange(4, dtype=np.float32)}, f"{run}/export/model.safetensors")
except safestage.PublishError as exc:
    kept.append(exc.staged_path)
print(json.dumps(kept))
"""


@pytest.mark.regression("issue 31: `safestage recover` of a copy kept for a URL crashed in _verify.as_path")
def test_recover_uploads_the_copies_a_failed_job_kept_for_a_url(bucket: StoreBucket, tmp_path: Path, capsys: Any) -> None:
    """A job whose bucket did not exist yet keeps its checkpoint and its file; once the bucket
    exists, recover commits the checkpoint (commit object last) and uploads the file."""
    gone = f"{bucket.name}-later"
    run, root = f"{bucket.server.scheme}://{gone}/run", tmp_path / "stage"
    root.mkdir()
    job = subprocess.run([sys.executable, "-c", KEPT_BY_A_FAILED_JOB, run, str(root)], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    assert job.returncode == 0, job.stderr
    kept = json.loads(job.stdout)
    assert len(kept) == 2 and all(path is not None and Path(path).exists() for path in kept), kept  # the fault fired

    assert _cli.main(["recover", str(root), "--dry-run"]) == 1  # the bucket is still missing
    out = capsys.readouterr().out
    assert f"-> {run}/checkpoint-7: {run}/checkpoint-7 cannot be inspected" in out and "NoSuchBucket" in out, out
    assert "create the bucket" in out and "testing" not in out, out  # what to do; no secret
    bucket.server.create_bucket(gone)
    assert _cli.main(["recover", str(root), "--dest", run]) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert f"-> {run}/checkpoint-7: committed" in out and f"-> {run}/export/model.safetensors: published" in out, out
    assert safestage.latest_complete(run) == url(f"{run}/checkpoint-7")
    assert safestage.verify(f"{run}/checkpoint-7", deep=True).complete
    assert load(_object_store.read(url(f"{run}/export/model.safetensors")) or b"")["w"].tolist() == [0, 1, 2, 3]
    assert not any(Path(path).exists() for path in kept)
    assert _cli.main(["recover", str(root)]) == 0 and "no kept copy" in capsys.readouterr().out


def test_a_run_resumed_from_an_older_step_sets_the_abandoned_ones_aside_on_a_url(bucket: StoreBucket, root: Path) -> None:
    """The timeline on a bucket: checkpoint-3 committed after checkpoint-5 and -7 began from an
    older step (a resumed run). Both are set aside by a marker object: latest names checkpoint-3,
    verify says what set them aside, keep= neither counts nor removes them, and a fetch of the
    run brings checkpoint-3 back."""
    run = run_of(bucket, root, (1, 5, 7))
    commit(f"{run}/checkpoint-3", root, 3)
    assert str(safestage.latest_complete(run)) == f"{run}/checkpoint-3"
    for step in (5, 7):
        result = safestage.verify(f"{run}/checkpoint-{step}")
        assert result.complete and result.set_aside is not None and result.set_aside.by == "checkpoint-3", result
        assert f"run/checkpoint-{step}/_SAFESTAGE_SET_ASIDE.json" in keys(bucket)
    assert safestage.verify(f"{run}/checkpoint-1").set_aside is None
    with safestage.staged_dir(f"{run}/checkpoint-4", root, keep=1) as local:
        (local / "trainer_state.json").write_text("{}")
    left = {key.split("/")[1] for key in keys(bucket)}
    assert left == {"checkpoint-4", "checkpoint-5", "checkpoint-7"}, left  # 1 and 3 pruned, the aside kept
    commit(f"{run}/checkpoint-7", root, 7)  # the new timeline reaches step 7: replaced, marker gone
    assert safestage.verify(f"{run}/checkpoint-7").set_aside is None
    assert str(safestage.latest_complete(run)) == f"{run}/checkpoint-7"
