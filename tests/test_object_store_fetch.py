"""Resume from an object store: ``safestage.fetch`` (and ``safestage fetch``) downloads a checkpoint
committed to s3:// (moto's real S3 server) or gs:// (fake-gcs-server through the kit's XML
front), on 127.0.0.1, into a local directory that is itself a
complete checkpoint, or refuses, leaving no commit file, when an object is not the one committed."""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch
from _support import seeded_tensors
from safetensors.torch import load_file, save_file

import safestage
from safestage import COMMIT_NAME, _object_store
from safestage._destination import ObjectURL, url_of
from safestage.checkpoint._fetch import fetch_checkpoint
from safestage.cli import _main as cli
from safestage.testing import StoreBucket

# S3 and GCS (a multipart upload, ranged GETs with If-Match on an ETag); each kind costs CI time.
pytestmark = pytest.mark.stores("moto", "fake-gcs", why="S3 and GCS show the reading side; each kind costs CI time")


@pytest.fixture
def bucket(store_bucket: StoreBucket) -> StoreBucket:
    """A fresh bucket, reached through the store's standard environment only (tests/conftest.py)."""
    return store_bucket


def url(text: str) -> ObjectURL:
    found = url_of(text)
    assert found is not None, text
    return found


def commit(dest: str, root: Path, seed: int, *, numel: int = 4096) -> dict[str, bytes]:
    """Commit a Trainer-like checkpoint to ``dest`` with staged_dir; its files' bytes."""
    with safestage.staged_dir(dest, root) as local:
        save_file(seeded_tensors(seed, numel=numel), local / "model.safetensors")
        torch.save({"step": seed, "lr": 0.1}, local / "optimizer.pt")
        (local / "tokenizer").mkdir()
        (local / "tokenizer" / "config.json").write_text(json.dumps({"seed": seed}))
        (local / "empty").mkdir()
        return {str(path.relative_to(local)): path.read_bytes() for path in local.rglob("*") if path.is_file()}


def local_files(directory: Path) -> dict[str, bytes]:
    return {str(path.relative_to(directory)): path.read_bytes()
            for path in directory.rglob("*") if path.is_file() and path.name != COMMIT_NAME}  # fmt: skip


def test_a_fetched_checkpoint_is_the_committed_one_and_complete_locally(bucket: StoreBucket, root: Path, tmp_path: Path) -> None:
    dest = f"{bucket.url}/run/checkpoint-100"
    saved = commit(dest, root, seed=1)
    fetched = safestage.fetch(dest, tmp_path / "resume")
    assert fetched == tmp_path / "resume" / "checkpoint-100"
    assert local_files(fetched) == saved
    assert (fetched / "empty").is_dir()
    assert (fetched / COMMIT_NAME).read_bytes() == _object_store.read(url(f"{dest}/{COMMIT_NAME}"))
    result = safestage.verify(fetched, deep=True)
    assert result.complete and result.extra == [], result.problems
    assert safestage.latest_complete(tmp_path / "resume") == fetched
    weights = load_file(fetched / "model.safetensors")
    assert all(torch.equal(weights[k], v) for k, v in seeded_tensors(1).items())
    assert torch.load(fetched / "optimizer.pt") == {"step": 1, "lr": 0.1}
    assert [name for name in os.listdir(fetched) if name.startswith(".")] == []  # no temp left


def test_an_object_larger_than_a_range_comes_back_whole(bucket: StoreBucket, root: Path, tmp_path: Path) -> None:
    dest = f"{bucket.url}/run/checkpoint-7"
    saved = commit(dest, root, seed=2, numel=5 << 20)  # 20 MiB of weights: multipart, 3 ranges
    assert len(saved["model.safetensors"]) > 2 * _object_store.RANGE_BYTES
    info = _object_store.head(url(f"{dest}/model.safetensors"))
    assert info is not None and info.etag is not None
    if bucket.server.scheme == "s3":
        assert "-" in info.etag  # S3's ETag of an upload in parts says it (the front's is an MD5)
    fetched = safestage.fetch(dest, tmp_path)
    assert local_files(fetched) == saved and safestage.verify(fetched).complete


def test_ranges_land_in_place_with_the_crc32_of_the_whole(bucket: StoreBucket, tmp_path: Path) -> None:
    """More ranges than are in flight at once, the last one short: the file is the object, and
    the CRC-32 combined from the ranges' is the whole object's."""
    data = os.urandom(5 * 1000 + 17)
    target = url(f"{bucket.url}/blob")
    etag = _object_store.put_bytes(target, data)
    fd = os.open(tmp_path / "blob", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        crc = _object_store.download(target, fd, size=len(data), etag=etag, chunk=1000, at_once=2)
    finally:
        os.close(fd)
    assert (tmp_path / "blob").read_bytes() == data and crc == zlib.crc32(data)


def test_crc32_combine_is_the_crc32_of_the_concatenation() -> None:
    generator = random.Random(31)
    sizes = [0, 1, 3, 255, 256, 4097, 1 << 20, (8 << 20) + 17]
    for first in sizes:
        for second in sizes:
            a, b = generator.randbytes(first), generator.randbytes(second)
            assert _object_store.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b), (first, second)


def test_an_object_overwritten_after_the_commit_is_refused_and_no_commit_file_is_left(
    bucket: StoreBucket, root: Path, tmp_path: Path
) -> None:
    dest = f"{bucket.url}/run/checkpoint-100"
    commit(dest, root, seed=3)
    fetched = safestage.fetch(dest, tmp_path)  # a complete local copy, then the store changes
    _object_store.put_bytes(url(f"{dest}/optimizer.pt"), b"a stale writer's bytes")
    (fetched / "optimizer.pt").unlink()  # so that the fetch must download it again
    with pytest.raises(safestage.FetchError) as raised:
        safestage.fetch(dest, tmp_path)
    error = raised.value
    assert error.errno == errno.ESTALE and error.filename == f"{dest}/optimizer.pt", error
    assert "overwritten after the commit" in str(error) and str(fetched) in str(error)
    assert not (fetched / COMMIT_NAME).exists() and not safestage.verify(fetched).complete
    assert sorted(os.listdir(fetched)) == ["empty", "model.safetensors", "tokenizer"]  # no temp, no stranger


def test_an_object_that_does_not_match_its_crc32_is_refused(bucket: StoreBucket, root: Path, tmp_path: Path) -> None:
    """A commit written with no ETags (a checkpoint committed through a FUSE mount of the
    bucket, read back by URL): an object replaced by one of the same size is caught by its
    CRC-32."""
    (tmp_path / "mounted").mkdir()
    local = tmp_path / "mounted" / "checkpoint-9"
    commit(str(local), root, seed=4)
    dest = url(f"{bucket.url}/run/checkpoint-9")
    for path in sorted(local.rglob("*"), key=lambda path: path.name == COMMIT_NAME):  # commit last
        if path.is_file():
            _object_store.upload(path, dest / str(path.relative_to(local)))
    manifest = json.loads((local / COMMIT_NAME).read_bytes())
    assert all("etag" not in entry for entry in manifest["files"])
    size = len((local / "optimizer.pt").read_bytes())
    _object_store.put_bytes(dest / "optimizer.pt", b"x" * size)  # same size, other bytes
    with pytest.raises(safestage.FetchError) as raised:
        safestage.fetch(str(dest), tmp_path / "resume")
    assert raised.value.errno == errno.EBADMSG and "CRC-32" in str(raised.value), raised.value
    assert not (tmp_path / "resume" / "checkpoint-9" / COMMIT_NAME).exists()
    assert not (tmp_path / "resume" / "checkpoint-9" / "optimizer.pt").exists()


def test_a_missing_object_is_refused_and_a_rerun_resumes_once_it_is_back(bucket: StoreBucket, root: Path, tmp_path: Path) -> None:
    dest = f"{bucket.url}/run/checkpoint-100"
    commit(dest, root, seed=5)
    kept = _object_store.read(url(f"{dest}/tokenizer/config.json"))
    assert kept is not None
    _object_store.delete([url(f"{dest}/tokenizer/config.json")])
    with pytest.raises(safestage.FetchError) as raised:
        safestage.fetch(dest, tmp_path)
    error, target = raised.value, tmp_path / "checkpoint-100"
    assert error.errno == errno.ENOENT and error.filename == f"{dest}/tokenizer/config.json", error
    assert "missing" in str(error) and not (target / COMMIT_NAME).exists()
    assert safestage.latest_complete(tmp_path) is None
    # The object is put back (another ETag: the commit no longer matches it) and the commit is redone.
    manifest = json.loads(_object_store.read(url(f"{dest}/{COMMIT_NAME}")) or b"")
    etag = _object_store.put_bytes(url(f"{dest}/tokenizer/config.json"), kept)
    for entry in manifest["files"]:
        if entry["path"] == "tokenizer/config.json":
            entry["etag"] = etag
    _object_store.delete([url(f"{dest}/{COMMIT_NAME}")])
    _object_store.put_bytes(url(f"{dest}/{COMMIT_NAME}"), json.dumps(manifest).encode(), create=True)
    before = {name: os.stat(target / name).st_ino for name in ("model.safetensors", "optimizer.pt")}
    fetched = fetch_checkpoint(dest, tmp_path)
    assert fetched.kept == 2 and fetched.nbytes == len(kept), fetched  # only the missing one moved
    assert {name: os.stat(target / name).st_ino for name in before} == before
    assert safestage.verify(target, deep=True).complete


def test_a_local_file_that_differs_is_fetched_again(bucket: StoreBucket, root: Path, tmp_path: Path) -> None:
    dest = f"{bucket.url}/run/checkpoint-3"
    saved = commit(dest, root, seed=6)
    target = safestage.fetch(dest, tmp_path)
    size = len(saved["optimizer.pt"])
    (target / "optimizer.pt").write_bytes(b"\0" * size)  # same size, other bytes
    assert safestage.fetch(dest, tmp_path) == target
    assert local_files(target) == saved and safestage.verify(target, deep=True).complete


def test_a_fetch_killed_mid_download_leaves_no_commit_file_and_a_rerun_finishes_it(
    bucket: StoreBucket, root: Path, tmp_path: Path
) -> None:
    dest = f"{bucket.url}/run/checkpoint-100"
    saved = commit(dest, root, seed=11, numel=16 << 20)  # 64 MiB: 8 ranges, long enough to be caught
    target = tmp_path / "checkpoint-100"
    script = f"import safestage; safestage.fetch({dest!r}, {str(tmp_path)!r})"
    child = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 60
        while not (target.is_dir() and [name for name in os.listdir(target) if name.endswith(".tmp")]):
            assert child.poll() is None and time.monotonic() < deadline, "the fetch ended before it was caught"
            time.sleep(0.002)
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait()
    assert child.returncode == -signal.SIGKILL  # the kill fired, mid-download
    temps = [name for name in os.listdir(target) if name.endswith(".tmp")]
    assert temps and not (target / COMMIT_NAME).exists() and safestage.latest_complete(tmp_path) is None
    fetched = fetch_checkpoint(dest, tmp_path)
    assert fetched.path == target and local_files(target) == saved
    assert not [name for name in os.listdir(target) if name.endswith(".tmp")]  # the dead fetch's temp went
    assert safestage.verify(target, deep=True).complete


def test_a_run_url_fetches_the_newest_complete_checkpoint(bucket: StoreBucket, root: Path, tmp_path: Path) -> None:
    run = f"{bucket.url}/run"
    commit(f"{run}/checkpoint-100", root, seed=7)
    saved = commit(f"{run}/checkpoint-200", root, seed=8)
    _object_store.put_bytes(url(f"{run}/checkpoint-300/model.safetensors"), b"torn")  # never committed
    fetched = safestage.fetch(run, tmp_path / "resume")
    assert fetched == tmp_path / "resume" / "checkpoint-200" and local_files(fetched) == saved
    assert os.listdir(tmp_path / "resume") == ["checkpoint-200"]


def test_nothing_committed_there_is_said_and_nothing_is_written(
    bucket: StoreBucket, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _object_store.put_bytes(url(f"{bucket.url}/run/checkpoint-1/model.safetensors"), b"torn")  # never committed
    with pytest.raises(safestage.FetchError) as raised:
        safestage.fetch(f"{bucket.url}/run/checkpoint-1", tmp_path / "resume")
    assert raised.value.errno == errno.ENOENT and COMMIT_NAME in str(raised.value)
    assert not (tmp_path / "resume").exists()
    for where in (f"{bucket.url}/run", f"{bucket.url}/nothing-here"):
        assert cli.main(["fetch", where, str(tmp_path / "resume")]) == 1
        assert "no complete checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "resume").exists()
    with pytest.raises(safestage.ConfigError, match="object-store URL"):
        safestage.fetch(str(tmp_path), tmp_path / "resume")
    with pytest.raises(safestage.ConfigError, match="local directory"):
        safestage.fetch(f"{bucket.url}/run", f"{bucket.url}/copy")


def test_the_cli_prints_the_local_checkpoint_and_says_why_it_refused(
    bucket: StoreBucket, root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = f"{bucket.url}/run/checkpoint-100"
    commit(dest, root, seed=9)
    assert cli.main(["fetch", dest, str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert out == f"{tmp_path / 'checkpoint-100'}\n" and "3 files" in err and "0 already there" in err
    assert cli.main(["fetch", dest, str(tmp_path)]) == 0
    assert "3 already there" in capsys.readouterr().err
    _object_store.put_bytes(url(f"{dest}/model.safetensors"), b"stale")
    (tmp_path / "checkpoint-100" / "model.safetensors").unlink()
    assert cli.main(["fetch", dest, str(tmp_path)]) == cli.FETCH_FAILED
    out, err = capsys.readouterr()
    assert out == "" and f"{dest}/model.safetensors" in err and "overwritten after the commit" in err
    assert "testing" not in err  # no secret
