"""Retention aborts the S3 multipart uploads a killed save left in flight, and only those of the
checkpoints it removes.

A save killed during a large file's upload leaves a multipart upload open: invisible to a LIST,
billed for its parts until it is aborted. ``prune`` (and ``keep=``) counts a checkpoint's uploads
in flight as part of it: one that is nothing but uploads is an incomplete checkpoint, and a
removal aborts every upload below the removed checkpoint. An upload below a checkpoint that
stays, or below a name the pattern does not take, is never aborted. Run on moto and seaweedfs
(which checks the SigV4 signatures of the requests obstore has no call for).
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from _support import SUITE_SETTINGS, long_tier
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import safestage
from safestage import COMMIT_NAME, _object_store, _s3_uploads
from safestage._destination import ObjectURL, url_of
from safestage.checkpoint._verify import matcher
from safestage.testing import FaultProxy, StoreBucket

pytestmark = pytest.mark.stores("moto", "seaweedfs", why="multipart uploads in flight are listed and aborted on S3 only "
                                "(GCS and Azure: the lifecycle rule, docs/object-stores.md)")  # fmt: skip


def url(text: str) -> ObjectURL:
    found = url_of(text)
    assert found is not None
    return found


def commit(checkpoint: str, root: Path, step: int, *, keep: int | None = None) -> None:
    with safestage.staged_dir(checkpoint, root, keep=keep) as local:
        (local / "state.json").write_text(json.dumps({"step": step}))


KILLED_DURING_ITS_UPLOAD = """\
import sys
import safestage
checkpoint, root = sys.argv[1], sys.argv[2]
with safestage.staged_dir(checkpoint, root) as local:
    (local / "model.bin").write_bytes(b"w" * (64 << 20))  # 8 parts: still uploading at the kill
"""


def test_a_save_killed_during_its_upload_leaves_uploads_that_the_next_keep_aborts(
    store_bucket: StoreBucket, root: Path
) -> None:
    run = f"{store_bucket.url}/run"
    commit(f"{run}/checkpoint-1", root, 1, keep=1)
    child = subprocess.Popen([sys.executable, "-c", KILLED_DURING_ITS_UPLOAD, f"{run}/checkpoint-2", str(root)])
    try:
        deadline = time.monotonic() + 60
        while not store_bucket.server.uploads_in_flight(store_bucket.name):
            assert child.poll() is None and time.monotonic() < deadline, "the upload was never seen in flight"
            time.sleep(0.005)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert store_bucket.server.uploads_in_flight(store_bucket.name) == ["run/checkpoint-2/model.bin"]
    assert not [key for key in store_bucket.objects() if key.startswith("run/checkpoint-2/")]  # nothing but the upload
    assert safestage.prune(run, keep=1, dry_run=True) == []  # the newest complete is 1: 2 is a save in progress
    commit(f"{run}/checkpoint-3", root, 3, keep=1)
    assert store_bucket.server.uploads_in_flight(store_bucket.name) == []
    assert store_bucket.objects() == [f"run/checkpoint-3/{COMMIT_NAME}", "run/checkpoint-3/state.json"]
    assert safestage.latest_complete(run) == url(f"{run}/checkpoint-3")


def upload_examples() -> int:
    text = SUITE_SETTINGS.get("SAFESTAGE_STORE_UPLOAD_EXAMPLES", "").strip()
    return int(text) if text else (100 if long_tier() else 8)


# A checkpoint of the run, as a step leaves it: committed (its files and commit object), killed
# before its commit (files, no commit object), or killed during its first large file (nothing but
# an upload in flight); and whether an upload in flight lies below it too (an earlier try's).
_STATE = st.sampled_from(["committed", "files only", "upload only", "absent"])
_FOREIGN = st.sampled_from(["checkpoint-2-merged/a.bin", "checkpoint-/a.bin", "export/model.bin", "checkpoint-3",
                            "checkpointx-1/a.bin", "checkpoint-4.tmp/a.bin", "ü ñ/checkpoint-1/a.bin"])  # fmt: skip


@settings(max_examples=upload_examples(), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])  # fmt: skip
@given(
    states=st.lists(_STATE, min_size=4, max_size=4),
    extra_upload=st.lists(st.booleans(), min_size=4, max_size=4),
    foreign=st.lists(_FOREIGN, max_size=3, unique=True),
    keep=st.integers(1, 2),
)
def test_prune_aborts_exactly_the_uploads_below_the_checkpoints_it_removes(
    store_bucket: StoreBucket, root: Path, monkeypatch: pytest.MonkeyPatch,
    states: list[str], extra_upload: list[bool], foreign: list[str], keep: int,
) -> None:  # fmt: skip
    # Pages of 2 uploads: seaweedfs pages by upload id alone (moto sends every upload at once).
    monkeypatch.setattr(_s3_uploads, "PAGE_UPLOADS", 2)
    run = f"{store_bucket.url}/run-{uuid.uuid4().hex[:8]}"
    server, prefix = store_bucket.server, url(run).prefix
    for step, (state, extra) in enumerate(zip(states, extra_upload), start=1):
        name = f"checkpoint-{step}"
        if state == "committed":
            commit(f"{run}/{name}", root, step)
        elif state == "files only":
            _object_store.put_bytes(url(f"{run}/{name}/state.json"), b"a killed save's file")
        if state == "upload only" or extra:
            server.begin_upload(store_bucket.name, f"{prefix}{name}/model.bin")
    for key in foreign:
        server.begin_upload(store_bucket.name, f"{prefix}{key}")
    placed = [key for key in server.uploads_in_flight(store_bucket.name) if key.startswith(prefix)]

    removed = safestage.prune(run, keep=keep)

    # The reference model: prune's rules over checkpoints that are files, commits and uploads.
    present = {step: state for step, state in enumerate(states, start=1)
               if state != "absent" or extra_upload[step - 1]}  # fmt: skip
    complete = sorted((step for step, state in present.items() if state == "committed"), reverse=True)
    expected: list[int] = []
    if complete:
        expected = [step for step in present if step in complete[keep:] or
                    (step not in complete and step < complete[0])]  # fmt: skip
    assert removed == [url(f"{run}/checkpoint-{step}") for step in sorted(expected)]
    gone = {f"checkpoint-{step}" for step in expected}
    left = [key for key in server.uploads_in_flight(store_bucket.name) if key.startswith(prefix)]
    # An upload is a checkpoint's if its key is below the checkpoint's name and a "/" (a plain
    # "run/checkpoint-3" is none, as an object of that name is none).
    assert left == [key for key in placed if key[len(prefix):].partition("/")[0] not in gone or "/" not in key[len(prefix):]]
    assert all(f"{prefix}{key}" in left for key in foreign)  # a name the pattern does not take: never touched
    assert not [key for key in store_bucket.objects() if key.startswith(prefix) and key[len(prefix):].split("/")[0] in gone]
    if complete:
        assert safestage.latest_complete(run) == url(f"{run}/checkpoint-{complete[0]}")
    assert all(matcher("checkpoint-*")(key.split("/")[0]) is None for key in foreign if "/" in key)


@pytest.mark.stores("moto", why="the refusal is the proxy's, the same for every S3 server")
def test_a_store_that_refuses_to_list_uploads_still_gets_its_checkpoints_pruned_and_a_warning_once(
    store_bucket: StoreBucket, store_proxy: FaultProxy, root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A policy without s3:ListBucketMultipartUploads: the uploads cost storage, never a
    checkpoint, so retention removes what it removes and says once what to do."""
    run = f"{store_bucket.url}/run-{uuid.uuid4().hex[:8]}"
    for step in (1, 2, 3):
        commit(f"{run}/checkpoint-{step}", root, step)
    store_bucket.server.begin_upload(store_bucket.name, f"{url(run).prefix}checkpoint-1/model.bin")
    fault = store_proxy.fail(403, method="GET", query="uploads", times=None)
    _object_store._said.clear()
    with caplog.at_level(logging.WARNING, logger="safestage"):
        assert safestage.prune(run, keep=2) == [url(f"{run}/checkpoint-1")]
        commit(f"{run}/checkpoint-4", root, 4, keep=2)
    assert fault.fired >= 3  # the run's listing, then one for each removal
    said = [r.getMessage() for r in caplog.records if "multipart" in r.getMessage()]
    assert len(said) == 1, said
    assert "lifecycle rule" in said[0] and "s3:ListBucketMultipartUploads" in said[0] and store_bucket.name in said[0]
    assert store_bucket.server.uploads_in_flight(store_bucket.name) == [f"{url(run).prefix}checkpoint-1/model.bin"]
    assert sorted({key.split("/")[1] for key in store_bucket.objects()}) == ["checkpoint-3", "checkpoint-4"]


@pytest.mark.stores("moto", why="the keys are read as obstore reads them, before any request")
def test_uploads_are_listed_with_the_keys_obstore_would_use_or_said_to_be_unlistable(
    store_bucket: StoreBucket, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    env = {"AWS_ACCESS_KEY_ID": "env-key", "AWS_SECRET_ACCESS_KEY": "env-secret", "AWS_REGION": "eu-west-1"}
    reach = _s3_uploads.access("b", {"access_key_id": "opt-key", "aws_secret_access_key": "opt-secret",
                                     "endpoint": "http://127.0.0.1:9000/"}, env)  # fmt: skip
    assert isinstance(reach, _s3_uploads.Access)
    assert (reach.base, reach.region, reach.access_key, reach.secret_key) == \
        ("http://127.0.0.1:9000/b", "eu-west-1", "opt-key", "opt-secret")  # fmt: skip
    aws = _s3_uploads.access("b", {}, {**env, "AWS_SESSION_TOKEN": "tok", "AWS_VIRTUAL_HOSTED_STYLE_REQUEST": "true"})
    assert isinstance(aws, _s3_uploads.Access)
    assert (aws.base, aws.token) == ("https://b.s3.eu-west-1.amazonaws.com", "tok")
    why = _s3_uploads.access("b", {}, {"AWS_REGION": "eu-west-1", "AWS_WEB_IDENTITY_TOKEN_FILE": "/var/run/token"})
    assert isinstance(why, str) and "not static keys" in why
    # Through the seam: no keys, no listing, and a warning naming the bucket and the rule.
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    _object_store._said.clear()
    with caplog.at_level(logging.WARNING, logger="safestage"):
        assert _object_store.uploads_in_flight(url(f"{store_bucket.url}/run")) is None
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "not static keys" in said[0] and "lifecycle rule" in said[0], said


@pytest.mark.stores("moto", why="the cut is the proxy's, the same for every S3 server")
@pytest.mark.regression("issue 31: an uploads listing cut short raised IncompleteRead out of prune")
def test_an_uploads_listing_cut_short_is_said_and_the_prune_goes_on(
    store_bucket: StoreBucket, store_proxy: FaultProxy, root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = f"{store_bucket.url}/run-{uuid.uuid4().hex[:8]}"
    for step in (1, 2, 3):
        commit(f"{run}/checkpoint-{step}", root, step)
    fault = store_proxy.cut_answer(method="GET", query="uploads", after_bytes=60, times=None)
    _object_store._said.clear()
    with caplog.at_level(logging.WARNING, logger="safestage"):
        assert safestage.prune(run, keep=1) == [url(f"{run}/checkpoint-{n}") for n in (1, 2)]
    assert fault.fired >= 1
    said = [r.getMessage() for r in caplog.records if "multipart" in r.getMessage()]
    assert len(said) == 1 and "unreadable" in said[0] and "lifecycle rule" in said[0], said


@pytest.mark.stores("moto", why="the refusal is the proxy's, the same for every S3 server")
@pytest.mark.regression("issue 31: a checkpoint whose upload could not be aborted was reported removed")
def test_a_checkpoint_whose_upload_could_not_be_aborted_is_not_reported_removed_and_the_next_prune_does_it(
    store_bucket: StoreBucket, store_proxy: FaultProxy, root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safestage import cli

    run = f"{store_bucket.url}/run-{uuid.uuid4().hex[:8]}"
    store_bucket.server.begin_upload(store_bucket.name, f"{url(run).prefix}checkpoint-1/model.bin")  # killed mid-upload
    commit(f"{run}/checkpoint-2", root, 2)
    fault = store_proxy.fail(503, method="DELETE", query="uploadId", times=None)
    assert safestage.prune(run, keep=1) == []
    assert cli.main(["prune", run, "--keep", "1"]) == 0
    out = capsys.readouterr().out
    assert f"partly        {run}/checkpoint-1" in out and "0 removed, 1 partly removed, 1 kept" in out, out
    assert fault.fired >= 2
    assert store_bucket.server.uploads_in_flight(store_bucket.name) == [f"{url(run).prefix}checkpoint-1/model.bin"]
    store_proxy.clear_faults()
    assert safestage.prune(run, keep=1) == [url(f"{run}/checkpoint-1")]
    assert store_bucket.server.uploads_in_flight(store_bucket.name) == []


@pytest.mark.stores("fake-gcs", "azurite", why="what is said where uploads are not listed: GCS and Azure")
def test_where_uploads_are_not_listed_the_gcs_prune_says_so_once_and_azure_needs_nothing(
    store_bucket: StoreBucket, root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run = f"{store_bucket.url}/run-{uuid.uuid4().hex[:8]}"
    for step in (1, 2, 3):
        commit(f"{run}/checkpoint-{step}", root, step)
    _object_store._said.clear()
    with caplog.at_level(logging.INFO, logger="safestage"):
        assert safestage.prune(run, keep=2) == [url(f"{run}/checkpoint-1")]
        commit(f"{run}/checkpoint-4", root, 4, keep=2)
    said = [r for r in caplog.records if "multipart" in r.getMessage()]
    if store_bucket.server.scheme == "gs":
        assert len(said) == 1 and said[0].levelno == logging.INFO and "lifecycle rule" in said[0].getMessage()
    else:  # Azure discards uncommitted blocks after 7 days: nothing to say
        assert said == []
