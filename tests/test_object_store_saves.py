"""Saves and commits straight to an object store (each kind of the kit's local servers on
127.0.0.1: moto and seaweedfs for s3://, Azurite for az://, fake-gcs for gs://): what lands is
what was saved, nothing else lands, and a scheme safestage does not serve is refused before
anything is written."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from _support import seeded_tensors
from safetensors.torch import load, save_file

import safestage
from safestage import COMMIT_NAME, _object_store
from safestage._destination import ObjectURL, UnsupportedDestination, url_of
from safestage.testing._stores import StoreBucket


@pytest.fixture
def bucket(store_bucket: StoreBucket) -> StoreBucket:
    """A fresh bucket on each kind of local store, reached through the store's standard
    environment only (tests/conftest.py)."""
    return store_bucket


def keys(bucket: StoreBucket) -> list[str]:
    return bucket.objects()


def object_url(bucket: StoreBucket, key: str) -> ObjectURL:
    return ObjectURL(bucket.server.scheme, bucket.name, key)


def fetched(url: str) -> bytes:
    data = _object_store.read(url_of(url))  # type: ignore[arg-type]
    assert data is not None, url
    return data


def test_a_save_to_a_url_lands_whole_and_alone(bucket: StoreBucket, root: Path) -> None:
    small, large = seeded_tensors(1), seeded_tensors(2, numel=6 << 20)  # 24 MiB: multipart
    with safestage.staged(root, torch_save=True):
        save_file(small, f"{bucket.url}/run/small.safetensors")
        save_file(large, f"{bucket.url}/run/large.safetensors")
        torch.save({"step": 7}, f"{bucket.url}/run/trainer_state.pt")
    assert keys(bucket) == ["run/large.safetensors", "run/small.safetensors", "run/trainer_state.pt"]
    for name, tensors in (("small", small), ("large", large)):
        back = load(fetched(f"{bucket.url}/run/{name}.safetensors"))
        assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)
    info = _object_store.head(object_url(bucket, "run/large.safetensors"))
    assert info is not None and info.etag is not None, info
    if bucket.server.scheme == "s3":  # S3's ETag of an upload in parts says how many parts (Azure's says nothing)
        assert info.etag.rstrip('"').endswith(f"-{-(-info.size // _object_store.PART_BYTES)}"), info
    assert os.listdir(root) == [] or all(not (root / entry).is_dir() or not os.listdir(root / entry) for entry in os.listdir(root))


def test_the_switch_saves_to_a_url_with_the_call_site_unmodified(bucket: StoreBucket, tmp_path: Path) -> None:
    script = (
        "import torch\nfrom safetensors.torch import save_file\n"
        f"save_file({{'w': torch.arange(4.0)}}, '{bucket.url}/switch/model.safetensors')\n"
    )
    (tmp_path / "root").mkdir()
    env = {**os.environ, "SAFESTAGE_DIR": str(tmp_path / "root"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert keys(bucket) == ["switch/model.safetensors"]
    assert torch.equal(load(fetched(f"{bucket.url}/switch/model.safetensors"))["w"], torch.arange(4.0))


@pytest.mark.parametrize("url", ["hdfs://namenode/run/model.safetensors", "gcs2://b/model.safetensors",
                                 "file:///tmp/model.safetensors"])  # fmt: skip
def test_a_scheme_not_served_is_refused_and_nothing_is_written(
    url: str, root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with safestage.staged(root), pytest.raises(UnsupportedDestination) as raised:
        save_file({"w": torch.zeros(2)}, url)
    assert url.split("://")[0] + "://" in str(raised.value) and "not served" in str(raised.value)
    assert os.listdir(tmp_path) == ["scratch"] and os.listdir(root) == []  # no "hdfs:" directory
    with pytest.raises(UnsupportedDestination):
        safestage.staged_dir(url.rsplit("/", 1)[0]).__enter__()


@pytest.mark.regression("issue 31: the checkpoint wing's model on a run URL, a near-miss name 'checkpoint-8\\n'")
def test_a_key_the_client_cannot_name_is_refused_before_anything_is_written(bucket: StoreBucket, root: Path) -> None:
    """obstore (Rust object_store) cannot name a key holding an ASCII control character, though S3
    stores one: a commit there must be refused as a URL safestage cannot serve (ConfigError), not
    fail after its staging as a store error whose advice is to retry."""
    for url in (f"{bucket.url}/run/checkpoint-8\n", f"{bucket.url}/run\t1/checkpoint-8", f"{bucket.url}/a\x7fb"):
        with pytest.raises(UnsupportedDestination, match="control character") as raised:
            safestage.staged_dir(url, root).__enter__()
        assert repr(url.split("/", 3)[3]) in str(raised.value)
        with safestage.staged(root), pytest.raises(UnsupportedDestination, match="control character"):
            save_file({"w": torch.zeros(2)}, f"{url}/model.safetensors")
    assert keys(bucket) == [] and os.listdir(root) == []


def test_a_url_naming_a_bucket_or_a_prefix_is_no_file(bucket: StoreBucket, root: Path) -> None:
    for url in (f"{bucket.url}", f"{bucket.url}/", f"{bucket.url}/run/"):
        with safestage.staged(root), pytest.raises(UnsupportedDestination, match="not an object"):
            save_file({"w": torch.zeros(2)}, url)
    with pytest.raises(safestage.PublishError, match="is a bucket"):
        with safestage.staged_dir(f"{bucket.url}"):
            pass
    assert keys(bucket) == []


def test_a_missing_bucket_keeps_the_staged_copy_and_names_the_url(bucket: StoreBucket, root: Path) -> None:
    url = f"{bucket.url}-missing/run/model.safetensors"
    with safestage.staged(root), pytest.raises(safestage.PublishError) as raised:
        save_file({"w": torch.arange(3.0)}, url)
    error = raised.value
    assert error.filename == url and error.staged_path is not None, error
    secrets = [value for name, value in bucket.environment.items() if "SECRET" in name or name.endswith("_KEY")]
    assert url in str(error) and "upload" in str(error) and not any(secret in str(error) for secret in secrets)
    assert load(Path(error.staged_path).read_bytes())["w"].tolist() == [0.0, 1.0, 2.0]


def test_a_checkpoint_committed_to_a_url_lists_every_object_with_its_etag(bucket: StoreBucket, root: Path) -> None:
    dest = f"{bucket.url}/run/checkpoint-100"
    with safestage.staged_dir(dest, root) as local:
        save_file(seeded_tensors(3), local / "model.safetensors")
        (local / "sub").mkdir()
        (local / "sub" / "config.json").write_text("{}")
    assert keys(bucket) == [f"run/checkpoint-100/{COMMIT_NAME}", "run/checkpoint-100/model.safetensors",
                            "run/checkpoint-100/sub/config.json"]  # fmt: skip
    manifest = json.loads(fetched(f"{dest}/{COMMIT_NAME}"))
    listed = {entry["path"]: entry for entry in manifest["files"]}
    assert sorted(listed) == ["model.safetensors", "sub/config.json"]
    for path, entry in listed.items():
        info = _object_store.head(object_url(bucket, f"run/checkpoint-100/{path}"))
        assert info is not None and (info.size, info.etag) == (entry["size"], entry["etag"])


def test_a_recommit_removes_the_previous_commit_object_before_any_object_changes(bucket: StoreBucket, root: Path) -> None:
    dest = f"{bucket.url}/run/checkpoint-5"
    with safestage.staged_dir(dest, root) as local:
        save_file(seeded_tensors(4), local / "model.safetensors")
    before = fetched(f"{dest}/{COMMIT_NAME}")
    seen: list[bool] = []
    with safestage.staged_dir(dest, root) as local:
        save_file(seeded_tensors(5), local / "model.safetensors")
        seen.append(_object_store.head(object_url(bucket, f"run/checkpoint-5/{COMMIT_NAME}")) is not None)
    assert seen == [True]  # the block runs before the destination is touched
    after = fetched(f"{dest}/{COMMIT_NAME}")
    assert after != before
    assert torch.equal(load(fetched(f"{dest}/model.safetensors"))["w"], seeded_tensors(5)["w"])


def test_a_second_writer_of_the_same_step_gets_eexist_and_overwrites_no_commit(bucket: StoreBucket, root: Path) -> None:
    """Two jobs commit one step at once: the one whose commit object comes second is refused
    (If-None-Match: *), and the first one's commit object stays as it wrote it. Which comes
    first is the store's timing: the second job usually commits during the first one's
    upload, but a fast store can finish that upload first (seen on seaweedfs in CI)."""
    dest = f"{bucket.url}/run/checkpoint-9"
    big = seeded_tensors(6, numel=8 << 20)  # 32 MiB: its upload is long enough to commit beside
    errors: list[BaseException] = []

    def slow_writer() -> None:
        try:
            with safestage.staged_dir(dest, root) as local:
                save_file(big, local / "model.safetensors")
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            errors.append(exc)

    writer = threading.Thread(target=slow_writer)
    writer.start()
    deadline = time.monotonic() + 60
    while not _uploading(bucket) and writer.is_alive() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert _uploading(bucket), "the slow writer's multipart upload was never seen in flight"
    (root / "other").mkdir()
    try:
        with safestage.staged_dir(dest, root / "other") as local:
            (local / "config.json").write_text('{"winner": true}')
    except safestage.PublishError as exc:
        errors.append(exc)  # the slow writer's commit object came first
    quick_won = not errors
    first = fetched(f"{dest}/{COMMIT_NAME}")  # the first commit object, whoever's it is
    writer.join(120)
    assert not writer.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], safestage.PublishError), errors
    assert errors[0].errno == errno.EEXIST and "another writer" in str(errors[0])
    assert fetched(f"{dest}/{COMMIT_NAME}") == first  # overwritten by nobody
    winner_files = ["config.json"] if quick_won else ["model.safetensors"]
    assert [entry["path"] for entry in json.loads(first)["files"]] == winner_files


def _uploading(bucket: StoreBucket) -> bool:
    """Whether an upload in parts is in flight in ``bucket`` (S3 ListMultipartUploads)."""
    return bool(bucket.server.uploads_in_flight(bucket.name))


@pytest.mark.regression("issue 31: Azurite showed Azure listing ETags without their quotes")
def test_a_listing_gives_each_object_the_etag_its_upload_returned(bucket: StoreBucket, tmp_path: Path) -> None:
    """latest_complete and verify match a commit's ETags against a LIST: the two must agree on
    every store (Azure lists an ETag without the quotes its PUT answers with)."""
    staged = tmp_path / "model.bin"
    staged.write_bytes(os.urandom(1000))
    uploaded = _object_store.upload(staged, object_url(bucket, "run/model.bin"))
    created = _object_store.put_bytes(object_url(bucket, "run/commit.json"), b"{}", create=True)
    listed = {info.key: info.etag for info in _object_store.listing(object_url(bucket, "run"))}
    assert listed == {"run/model.bin": uploaded.etag, "run/commit.json": created}
    assert _object_store.head(object_url(bucket, "run/model.bin")).etag == uploaded.etag  # type: ignore[union-attr]


@pytest.mark.stores("moto", why="the options spelled here are S3's (one S3 server shows the mechanism)")
def test_explicit_storage_options_reach_a_bucket_with_no_environment(
    bucket: StoreBucket, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """configure_store: the endpoint and keys given in code, none in the environment; an error
    names the URL and the operation, never the secret."""
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_ALLOW_HTTP"):
        monkeypatch.delenv(key)
    _object_store.after_fork_in_child()  # no client made from the environment
    secret = f"secret-{os.urandom(8).hex()}"
    options = {"endpoint": endpoint, "access_key_id": "key", "secret_access_key": secret, "region": "us-east-1",
               "client_options": {"allow_http": True}}  # fmt: skip
    try:
        safestage.configure_store(bucket.url, options)
        with safestage.staged(root):
            save_file({"w": torch.arange(5.0)}, f"{bucket.url}/configured/model.safetensors")
        assert keys(bucket) == ["configured/model.safetensors"]
        safestage.configure_store(bucket.url, {**options, "endpoint": "http://127.0.0.1:9"})  # nobody there
        with safestage.staged(root), pytest.raises(safestage.PublishError) as raised:
            save_file({"w": torch.arange(5.0)}, f"{bucket.url}/configured/other.safetensors")
        message = str(raised.value)
        assert f"{bucket.url}/configured/other.safetensors" in message and secret not in message, message
        with pytest.raises(safestage.ConfigError, match="not an object-store URL"):
            safestage.configure_store("/mnt/bucket", options)
    finally:
        safestage.configure_store(bucket.url, None)


@pytest.mark.regression("issue 31: on GCS a delete stopped at the first missing object and left the rest")
def test_a_delete_removes_every_object_named_even_past_missing_ones(bucket: StoreBucket) -> None:
    """GCS has no batched delete: obstore deletes one object a request and stops at the first
    404. A missing object is no error, and every other object named is gone."""
    named = [object_url(bucket, f"run/checkpoint-1/{i:02d}.bin") for i in range(24)]
    for url in named[4:]:
        _object_store.put_bytes(url, b"x")
    _object_store.delete(named)
    assert keys(bucket) == []
