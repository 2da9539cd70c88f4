"""Promises of the object-store family under conditions a job meets and a happy path never does:
a child forked after the parent reached a bucket, a store that refuses a listing (403), no
credentials at all.

Each test runs against a real local server (``store_bucket``), faults through the kit's
FaultProxy, and asserts that its fault fired.
"""

from __future__ import annotations

import errno
import json
import os
import select
from pathlib import Path

import pytest

import safestage
from safestage import COMMIT_NAME, _object_store
from safestage.testing import FaultProxy, StoreBucket


def commit(url: str, root: Path, files: dict[str, bytes]) -> None:
    with safestage.staged_dir(url, root) as local:
        for name, data in files.items():
            (local / name).write_bytes(data)


@pytest.mark.stores("moto", why="the fork is the client's (obstore's runtime), the same for every store")
@pytest.mark.regression("issue 31: a child forked after a URL save hung forever in obstore")
def test_a_save_to_a_url_in_a_child_forked_during_a_background_save_fails_at_once_and_says_why(
    store_bucket: StoreBucket, root: Path
) -> None:
    run = f"{store_bucket.url}/run"
    commit(f"{run}/checkpoint-1", root, {"a.bin": b"1"})
    reader, writer = os.pipe()
    with safestage.staged_dir(f"{run}/checkpoint-2", root, background=True) as local:
        (local / "a.bin").write_bytes(b"2" * (24 << 20))  # three parts: still uploading at fork()
    pid = os.fork()
    if pid == 0:  # the child: a save of its own, to the same run
        os.close(reader)
        try:
            commit(f"{run}/checkpoint-3", root, {"c.bin": b"3"})
            said = {"errno": None, "message": "committed"}
        except OSError as exc:
            said = {"errno": exc.errno, "message": str(exc)}
        except BaseException as exc:
            said = {"errno": None, "message": repr(exc)}
        os.write(writer, json.dumps(said).encode())
        os._exit(0)
    os.close(writer)
    try:
        ready, _, _ = select.select([reader], [], [], 30)
        hung = not ready
        said = json.loads(os.read(reader, 1 << 16) or b"{}") if ready else {}
    finally:
        os.close(reader)
        if hung:
            os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert not hung, "the forked child's save to a URL never returned"
    assert said["errno"] == errno.EOPNOTSUPP and "fork" in said["message"], said
    safestage.wait()  # the parent's background save lands, untouched by the child
    assert str(safestage.latest_complete(run)) == f"{run}/checkpoint-2"
    assert not [key for key in store_bucket.objects() if "checkpoint-3" in key]


@pytest.mark.regression("issue 31: a refused LIST was EIO, 'the save can be retried'")
def test_a_listing_the_store_refuses_is_eacces_and_says_to_check_the_credentials(
    store_bucket: StoreBucket, store_proxy: FaultProxy, root: Path
) -> None:
    run = f"{store_bucket.url}/run"
    fault = store_proxy.fail(403, method="GET", times=None)
    with pytest.raises(_object_store.StoreError) as raised:
        safestage.latest_complete(run)
    assert fault.fired >= 1
    error = raised.value
    assert error.errno == errno.EACCES and "credentials" in str(error) and run in str(error), error


@pytest.mark.stores("moto", "seaweedfs", why="the instance metadata service is S3's (AWS_METADATA_ENDPOINT)")
@pytest.mark.regression("issue 31: no credentials at all was EIO, 'the save can be retried'")
def test_no_credentials_at_all_is_eacces_and_says_which_variables_to_set(
    store_bucket: StoreBucket, store_proxy: FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No key in the environment: obstore asks the instance metadata service (EC2's), here the
    # proxy, which has none to give (a host that is not on EC2).
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_METADATA_ENDPOINT", store_proxy.endpoint)
    fault = store_proxy.fail(404, path="/latest/", times=None)
    with pytest.raises(_object_store.StoreError) as raised:
        safestage.latest_complete(f"{store_bucket.url}/run")
    assert fault.fired >= 1
    error = raised.value
    assert error.errno == errno.EACCES and "AWS_ACCESS_KEY_ID" in str(error), error


@pytest.mark.regression("issue 31: a retried commit object refused by its own first try was 'another writer'")
def test_a_commit_object_whose_first_put_landed_unanswered_is_this_writers_and_the_commit_succeeds(
    store_bucket: StoreBucket, store_proxy: FaultProxy, root: Path
) -> None:
    # The store creates the commit object and answers 500 (S3's InternalError may come after
    # the write): obstore retries the PUT, whose If-None-Match: * now finds it there.
    run = f"{store_bucket.url}/run"
    fault = store_proxy.fail(500, method="PUT", path=COMMIT_NAME, forward=True)
    commit(f"{run}/checkpoint-1", root, {"a.bin": b"a"})
    assert fault.fired == 1
    first, again = [r.status for r in store_proxy.requests(method="PUT", path=COMMIT_NAME)]
    assert first == 500 and again in (409, 412), (first, again)  # Azure: 409 BlobAlreadyExists
    assert safestage.verify(f"{run}/checkpoint-1").complete


@pytest.mark.stores("moto", "seaweedfs", why="the folder markers are put by the kit's S3 requests (obstore cannot name a key ending in '/')")
@pytest.mark.regression("issue 31: a folder marker made prune delete a plain object of the checkpoint's name")
def test_folder_markers_are_no_objects_and_prune_never_removes_a_plain_object_of_a_checkpoints_name(
    store_bucket: StoreBucket, root: Path, tmp_path: Path
) -> None:
    """The S3 console's "Create folder" and s3fs's mkdir leave zero-byte keys ending in "/";
    obstore lists "run/checkpoint-1/" as "run/checkpoint-1", the name of a plain object."""
    run, server = f"{store_bucket.url}/run", store_bucket.server
    for step in (1, 2):
        with safestage.staged_dir(f"{run}/checkpoint-{step}", root) as local:
            (local / "a.bin").write_bytes(bytes([step]) * 10)
            (local / "sub").mkdir()
            (local / "sub" / "b.bin").write_bytes(b"b")
    markers = ["run/", "run/checkpoint-1/", "run/checkpoint-2/", "run/checkpoint-2/sub/", "run/checkpoint-3/"]
    for marker in markers:
        server.put_object(store_bucket.name, marker)
    server.put_object(store_bucket.name, "run/checkpoint-1", b"notes on step 1: no checkpoint")
    assert str(safestage.latest_complete(run)) == f"{run}/checkpoint-2"
    checked = safestage.verify(f"{run}/checkpoint-2")
    assert checked.complete and checked.extra == [], checked
    assert [str(path) for path in safestage.prune(run, keep=1)] == [f"{run}/checkpoint-1"]
    second = [f"run/checkpoint-2/{name}" for name in (COMMIT_NAME, "a.bin", "sub/b.bin")]
    # Every other marker stays (obstore cannot name them); the removed checkpoint's own stays on
    # S3 and goes on seaweedfs, whose filer drops a directory left empty.
    left = [key for key in store_bucket.objects() if key != "run/checkpoint-1/"]
    assert left == sorted([m for m in markers if m != "run/checkpoint-1/"] + ["run/checkpoint-1"] + second)
    assert _object_store.read(_object_store.url_of(f"{run}/checkpoint-1")) == b"notes on step 1: no checkpoint"  # type: ignore[arg-type]
    fetched = safestage.fetch(run, tmp_path / "resume")
    assert (fetched / "a.bin").read_bytes() == b"\x02" * 10 and (fetched / "sub" / "b.bin").read_bytes() == b"b"
