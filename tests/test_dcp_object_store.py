"""DCP saves straight to an object store (s3:// on moto, 127.0.0.1), one process (a world of
one; many ranks: test_dcp_staged_writer.py's job): ``dcp.save(checkpoint_id="s3://...")`` and
``async_save`` under the switch with no fsspec writer, and ``StagedWriter("s3://...")``. What
lands is DCP's files and the commit object, created last with each object's ETag; a copy of
the prefix loads back equal with stock ``dcp.load``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, state_dict_saver
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

import safestage
from safestage import COMMIT_NAME, _object_store
from safestage._destination import ObjectURL, url_of
from safestage.dcp import StagedHuggingFaceWriter, StagedWriter
from tests._stores import download, keys, new_bucket
from tests._two_nodes import free_port

STATE = {"a": torch.arange(10, dtype=torch.float32), "b": torch.ones(3, 4), "step": 7}
ORIGINAL = state_dict_saver._save_state_dict, state_dict_saver._storage_setup


@pytest.fixture(autouse=True)
def _single_process() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        yield
    assert (state_dict_saver._save_state_dict, state_dict_saver._storage_setup) == ORIGINAL
    assert not safestage.is_active()


@pytest.fixture
def bucket(monkeypatch: pytest.MonkeyPatch) -> str:
    return new_bucket(monkeypatch, "dcp")


def loaded(url: str, local: Path) -> dict[str, Any]:
    back: dict[str, Any] = {"a": torch.zeros(10), "b": torch.zeros(3, 4), "step": 0}
    dcp.load(back, checkpoint_id=download(url, local))
    return back


def assert_committed(url: str, files: list[str]) -> None:
    """Exactly ``files`` and the commit object below ``url``, which lists each with the size
    and ETag the store has for it."""
    dest = url_of(url)
    assert dest is not None
    listed = {info.key[len(dest.prefix):]: info for info in _object_store.listing(dest)}
    assert sorted(listed) == sorted([*files, COMMIT_NAME])
    manifest = json.loads(_object_store.read(dest / COMMIT_NAME) or b"")
    entries = {entry["path"]: entry for entry in manifest["files"]}
    assert sorted(entries) == sorted(files)
    for path, entry in entries.items():
        assert (entry["size"], entry["etag"]) == (listed[path].size, listed[path].etag), path
        assert entry["etag"], path


DCP = [".metadata", "__0_0.distcp"]


@pytest.mark.parametrize("how", ["checkpoint_id", "async-thread", "staged-writer", "staged-writer-async"])
def test_a_dcp_save_to_a_url_is_committed_there_and_loads_back_equal(
    how: str, bucket: str, stage_root: Path, tmp_path: Path
) -> None:
    url = f"s3://{bucket}/run/step-7"
    if how.startswith("staged-writer"):
        writer = StagedWriter(url, stage_root, thread_count=2, single_file_per_rank=False)
        if how == "staged-writer":
            dcp.save(dict(STATE), storage_writer=writer)
        else:
            dcp.async_save(dict(STATE), storage_writer=writer).result()
        files = [".metadata", "__0_0.distcp", "__0_1.distcp", "__0_2.distcp"]
    else:
        with safestage.staged(stage_root):
            if how == "checkpoint_id":
                dcp.save(dict(STATE), checkpoint_id=url)
            else:
                dcp.async_save(dict(STATE), checkpoint_id=url,
                               async_checkpointer_type=AsyncCheckpointerType.THREAD).result()  # fmt: skip
        files = DCP
    assert_committed(url, files)
    back = loaded(url, tmp_path / "copy")
    assert back["step"] == 7 and torch.equal(back["a"], STATE["a"]) and torch.equal(back["b"], STATE["b"])
    assert os.listdir(stage_root) == []  # every local copy went once its objects landed
    assert not (Path.cwd() / "s3:").exists()  # nothing written to a local directory named s3:


def test_the_commit_object_is_the_last_object_created(bucket: str, stage_root: Path) -> None:
    """A save whose data objects are there but whose commit object is not is not complete: the
    commit object is created after every other object (its LastModified is the newest)."""
    url = f"s3://{bucket}/run/step-8"
    dcp.save(dict(STATE), storage_writer=StagedWriter(url, stage_root))
    dest = url_of(url)
    assert dest is not None
    infos = _object_store.listing(dest)
    commit = next(info for info in infos if info.key.endswith(COMMIT_NAME))
    assert all(info.modified <= commit.modified for info in infos)


def test_a_resave_removes_the_commit_object_before_any_object_changes(
    bucket: str, stage_root: Path, tmp_path: Path
) -> None:
    url = f"s3://{bucket}/run/step-9"
    dest = url_of(url)
    assert dest is not None
    dcp.save(dict(STATE), storage_writer=StagedWriter(url, stage_root))
    first = _object_store.read(dest / COMMIT_NAME)
    seen: list[Any] = []

    class Watching(StagedWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            seen.append(_object_store.head(dest / COMMIT_NAME))  # after prepare, before any upload
            seen.append(_object_store.head(dest / ".metadata"))
            return super().write_data(plan, planner)

    changed = {**STATE, "a": torch.arange(10, dtype=torch.float32) * 2}
    dcp.save(changed, storage_writer=Watching(url, stage_root))
    assert seen == [None, None]
    assert _object_store.read(dest / COMMIT_NAME) != first
    assert torch.equal(loaded(url, tmp_path / "copy")["a"], changed["a"])


def test_overwrite_false_refuses_a_checkpoint_at_a_url_as_dcp_does(bucket: str, stage_root: Path) -> None:
    url = f"s3://{bucket}/run/step-10"
    dcp.save(dict(STATE), storage_writer=StagedWriter(url, stage_root))
    before = keys(bucket)
    writer = StagedWriter(url, stage_root)
    writer._writer.overwrite = False
    with pytest.raises(BaseException, match="already exists"):
        dcp.save(dict(STATE), storage_writer=writer)
    assert keys(bucket) == before and os.listdir(stage_root) == []


def test_the_huggingface_writer_lands_its_shards_and_index_at_a_url(
    bucket: str, stage_root: Path, tmp_path: Path
) -> None:
    url = f"s3://{bucket}/run/hf-1"
    tensors = {"a": STATE["a"], "b": STATE["b"]}
    writer = StagedHuggingFaceWriter(url, stage_root, fqn_to_index_mapping={"a": 1, "b": 2})
    dcp.save(dict(tensors), storage_writer=writer)
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    assert_committed(url, files)
    back = {"a": torch.zeros(10), "b": torch.zeros(3, 4)}
    dcp.load(back, storage_reader=HuggingFaceStorageReader(str(download(url, tmp_path / "copy"))))
    assert torch.equal(back["a"], tensors["a"]) and torch.equal(back["b"], tensors["b"])


def test_consolidation_at_a_url_is_refused_before_anything_is_written(bucket: str, stage_root: Path) -> None:
    with pytest.raises(safestage.ConfigError, match="consolidat"):
        StagedHuggingFaceWriter(f"s3://{bucket}/run/hf-2", stage_root, save_distributed=True,
                                enable_consolidation=True)  # fmt: skip
    assert keys(bucket) == []


def test_the_switch_from_the_environment_saves_to_a_url_with_no_code_change(
    bucket: str, tmp_path: Path
) -> None:
    """SAFESTAGE_DIR alone; the script names neither safestage nor a writer; async_save in a
    checkpoint process too (it runs dcp.save there, under the switch of its own environment)."""
    script = (
        "import warnings; warnings.simplefilter('ignore')\n"
        "import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp\n"
        f"dist.init_process_group('gloo', init_method='tcp://127.0.0.1:{free_port()}', rank=0, world_size=1)\n"
        "from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType\n"
        "state = {'a': torch.arange(10.0), 'b': torch.ones(3, 4), 'step': 7}\n"
        f"dcp.save(dict(state), checkpoint_id='s3://{bucket}/env/step-1')\n"
        f"dcp.async_save(dict(state), checkpoint_id='s3://{bucket}/env/step-2',\n"
        "               async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()\n"
        "dist.destroy_process_group()\n"
    )
    (tmp_path / "root").mkdir()
    env = {**os.environ, "SAFESTAGE_DIR": str(tmp_path / "root")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    for step in (1, 2):
        assert_committed(f"s3://{bucket}/env/step-{step}", DCP)
        back = loaded(f"s3://{bucket}/env/step-{step}", tmp_path / f"copy-{step}")
        assert back["step"] == 7 and torch.equal(back["b"], STATE["b"])
    assert sorted(os.listdir(tmp_path)) == ["copy-1", "copy-2", "root"]  # no local "s3:" directory


def test_a_save_to_a_missing_bucket_names_the_url_and_commits_nothing(bucket: str, stage_root: Path) -> None:
    url = f"s3://{bucket}-missing/run/step-1"
    with pytest.raises(BaseException) as raised:
        dcp.save(dict(STATE), storage_writer=StagedWriter(url, stage_root))
    assert url in str(raised.value) and "testing" not in str(raised.value)
    assert isinstance(url_of(url), ObjectURL)
