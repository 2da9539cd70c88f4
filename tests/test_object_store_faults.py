"""A store that fails mid-save: a 503 on one part is retried and the file lands; a network that
cuts every part leaves nothing under the key and no upload in flight, and keeps the staged copy;
a commit object refused (412) or failing (500) leaves no commit object and says so.

Each fault is real HTTP from a FaultProxy between obstore and a real local server, and each test
asserts that its fault fired.
"""

from __future__ import annotations

import datetime
import time
import errno
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from _support import seeded_tensors
from safetensors.torch import load, save_file

import safestage
from safestage import COMMIT_NAME, _object_store
from safestage._destination import ObjectURL
from safestage.testing import FaultProxy, StoreBucket

# A part of an upload in parts: S3's and GCS's UploadPart (PUT ?partNumber=&uploadId=), Azure's Put Block.
PARTS = {"s3": {"method": "PUT", "query": "partNumber"}, "gs": {"method": "PUT", "query": "partNumber"},
         "az": {"method": "PUT", "query": "comp=block"}}  # fmt: skip
# The header of a conditional create: If-None-Match: * on S3 and Azure, generation 0 on GCS.
CREATE_IF = {"s3": "if-none-match", "az": "if-none-match", "gs": "x-goog-if-generation-match"}
BIG = 3 << 20  # float32 elements: 12 MiB, two parts of PART_BYTES


@pytest.fixture
def few_retries(store_bucket: StoreBucket) -> Iterator[None]:
    """obstore's retries, short: a fault that persists fails in a second, not in obstore's
    default 10 retries over up to 3 minutes (storage_options' retry_config, as a user sets it)."""
    bucket = ObjectURL(store_bucket.server.scheme, store_bucket.name, "")
    quick = {"max_retries": 2, "retry_timeout": datetime.timedelta(seconds=20),
             "backoff": {"init_backoff": datetime.timedelta(milliseconds=10),
                         "max_backoff": datetime.timedelta(milliseconds=100), "base": 2.0}}  # fmt: skip
    _object_store.configure(bucket, {"retry_config": quick})
    yield
    _object_store.configure(bucket, None)


def test_a_503_on_a_part_is_retried_and_the_file_lands(store_bucket: StoreBucket, store_proxy: FaultProxy, root: Path) -> None:
    tensors = seeded_tensors(1, numel=BIG)
    PART = PARTS[store_bucket.server.scheme]
    fault = store_proxy.fail(503, **PART)
    url = f"{store_bucket.url}/run/model.safetensors"
    with safestage.staged(root):
        save_file(tensors, url)
    assert fault.fired == 1
    parts = store_proxy.requests(**PART)
    assert [r.status for r in parts].count(503) == 1 and len(parts) == 3  # two parts, one again
    assert store_bucket.objects() == ["run/model.safetensors"]
    back = load(_object_store.read(ObjectURL(store_bucket.server.scheme, store_bucket.name, "run/model.safetensors")) or b"")
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)


@pytest.mark.usefixtures("few_retries")
def test_a_connection_cut_mid_part_aborts_the_upload_and_keeps_the_staged_copy(
    store_bucket: StoreBucket, store_proxy: FaultProxy, root: Path
) -> None:
    tensors = seeded_tensors(2, numel=BIG)
    PART = PARTS[store_bucket.server.scheme]
    fault = store_proxy.reset(after_bytes=1 << 20, times=None, **PART)
    url = f"{store_bucket.url}/run/model.safetensors"
    with safestage.staged(root), pytest.raises(safestage.PublishError) as raised:
        save_file(tensors, url)
    error = raised.value
    assert fault.fired >= 3  # every try of a part was cut (2 retries each)
    assert all(r.status is None for r in store_proxy.requests(**PART))
    assert error.filename == url and url in str(error), error
    if store_bucket.server.scheme != "az":  # Azure has no abort: uncommitted blocks expire unseen
        assert store_proxy.count(method="DELETE", query="uploadId") == 1  # AbortMultipartUpload
    assert store_bucket.server.uploads_in_flight(store_bucket.name) == []
    assert store_bucket.objects() == []
    assert error.staged_path is not None
    kept = load(Path(error.staged_path).read_bytes())
    assert all(torch.equal(kept[k], tensors[k]) for k in tensors)


def test_a_commit_object_refused_with_412_is_another_writer(
    store_bucket: StoreBucket, store_proxy: FaultProxy, root: Path
) -> None:
    dest = f"{store_bucket.url}/run/checkpoint-3"
    fault = store_proxy.fail(412, method="PUT", path=COMMIT_NAME, header=CREATE_IF[store_bucket.server.scheme])
    with pytest.raises(safestage.PublishError) as raised, safestage.staged_dir(dest, root) as local:
        (local / "config.json").write_text("{}")
    assert fault.fired == 1
    assert raised.value.errno == errno.EEXIST and "another writer" in str(raised.value)
    assert store_bucket.objects() == ["run/checkpoint-3/config.json"]  # no commit object


@pytest.mark.usefixtures("few_retries")
def test_a_commit_object_failing_with_500_is_absent_and_said(
    store_bucket: StoreBucket, store_proxy: FaultProxy, root: Path
) -> None:
    dest = f"{store_bucket.url}/run/checkpoint-4"
    fault = store_proxy.fail(500, method="PUT", path=COMMIT_NAME, times=None)
    with pytest.raises(safestage.PublishError) as raised, safestage.staged_dir(dest, root) as local:
        (local / "config.json").write_text("{}")
    assert fault.fired == 3  # the first try and obstore's 2 retries
    error = raised.value
    assert error.errno == errno.EIO and COMMIT_NAME in str(error) and "not complete" in str(error), error
    assert store_bucket.objects() == ["run/checkpoint-4/config.json"]


@pytest.mark.regression("issue 31: a created commit object whose answer is lost was taken for another writer's")
def test_a_commit_object_that_landed_but_whose_answer_was_lost_is_a_commit(
    store_bucket: StoreBucket, store_proxy: FaultProxy, root: Path
) -> None:
    """The store creates the commit object, the network loses its answer: obstore's retry meets
    the object (412), or the save sees the lost answer. It is this commit's own object, so the
    checkpoint is committed and complete, never refused as "another writer"."""
    dest = f"{store_bucket.url}/run/checkpoint-5"
    fault = store_proxy.lose_answer(method="PUT", path=COMMIT_NAME)
    with safestage.staged_dir(dest, root) as local:
        (local / "config.json").write_text('{"mine": true}')
    assert fault.fired == 1
    puts = store_proxy.requests(method="PUT", path=COMMIT_NAME)
    assert puts[0].fault == "answer lost", puts
    assert store_bucket.objects() == ["run/checkpoint-5/_SAFESTAGE_COMMIT.json", "run/checkpoint-5/config.json"]
    result = safestage.verify(dest)
    assert result.complete, result
    assert str(safestage.latest_complete(f"{store_bucket.url}/run")) == dest


@pytest.mark.stores("moto", why="the client's timeout against one store's slow answer shows it; the message is the store's family's")
def test_a_commit_object_put_that_times_out_says_its_outcome_is_the_stores_to_tell(
    store_bucket: StoreBucket, store_proxy: FaultProxy, root: Path
) -> None:
    """The store holds the commit object's PUT past the client's timeout, then completes it: the
    error must not claim the checkpoint is not complete; it says verify tells, and verify does."""
    dest = f"{store_bucket.url}/run/checkpoint-6"
    bucket = ObjectURL(store_bucket.server.scheme, store_bucket.name, "")
    _object_store.configure(bucket, {"client_options": {"timeout": "1s", "allow_http": True},
                                     "retry_config": {"max_retries": 0}})  # fmt: skip
    slow = store_proxy.delay(1.6, method="PUT", path=COMMIT_NAME, times=1)
    try:
        with pytest.raises(safestage.PublishError) as raised, safestage.staged_dir(dest, root) as local:
            (local / "config.json").write_text("{}")
    finally:
        _object_store.configure(bucket, None)
    assert slow.fired == 1
    message = str(raised.value)
    assert "verify says which" in message and "is therefore not complete" not in message, message
    deadline = time.monotonic() + 10
    while not safestage.verify(dest).complete and time.monotonic() < deadline:
        time.sleep(0.1)
    assert safestage.verify(dest).complete  # the store did complete it
