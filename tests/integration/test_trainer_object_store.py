"""safestage.transformers.CommitCallback(destination="s3://...") with the real Trainer (a tiny
Llama from a config, one process, CPU) against moto: each local ``checkpoint-N`` is committed to
the bucket (the commit object created last, with every object's ETag), in the background too;
``keep=`` prunes the bucket."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load

from safestage import COMMIT_NAME, _object_store
from safestage._destination import url_of
from safestage.transformers import CommitCallback
from tests._stores import keys, new_bucket

pytestmark = pytest.mark.integration


class _Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.arange(index, index + 16) % 128
        return {"input_ids": ids, "labels": ids.clone()}


def _train(output_dir: Path, commit: CommitCallback) -> Any:
    from _clients import tiny_llama

    args = transformers.TrainingArguments(
        output_dir=str(output_dir), max_steps=3, save_steps=1, per_device_train_batch_size=2, use_cpu=True,
        report_to=[], logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = transformers.Trainer(model=tiny_llama(), args=args, train_dataset=_Tokens(), callbacks=[commit])
    trainer.train()
    return trainer


def _assert_committed_from(bucket: str, name: str, local: Path) -> None:
    """``run/<name>`` holds exactly the local checkpoint's files and the commit object, which
    lists each with the size and ETag the store has."""
    dest = url_of(f"s3://{bucket}/run/{name}")
    assert dest is not None
    listed = {info.key[len(dest.prefix):]: info for info in _object_store.listing(dest)}
    files = sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file())
    assert sorted(listed) == sorted([*files, COMMIT_NAME])
    entries = {e["path"]: e for e in json.loads(_object_store.read(dest / COMMIT_NAME) or b"")["files"]}
    assert sorted(entries) == files
    assert all((entries[p]["size"], entries[p]["etag"]) == (listed[p].size, listed[p].etag) for p in files)
    remote = load(_object_store.read(dest / "model.safetensors") or b"")
    assert remote.keys() == load((local / "model.safetensors").read_bytes()).keys()


@pytest.mark.parametrize("background", [False, True])
def test_each_checkpoint_is_committed_to_the_bucket(
    background: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, root: Path
) -> None:
    bucket = new_bucket(monkeypatch, "trainer")
    commit = CommitCallback(root, destination=f"s3://{bucket}/run", background=background)
    _train(tmp_path / "out", commit)
    assert [path.name for path, _, _ in commit.committed] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    for name in ("checkpoint-1", "checkpoint-2", "checkpoint-3"):
        _assert_committed_from(bucket, name, tmp_path / "out" / name)
    assert not any((tmp_path / "out" / name / COMMIT_NAME).exists() for name in ("checkpoint-1", "checkpoint-3"))
    assert list(root.iterdir()) == []  # every local copy went once it landed


def test_keep_prunes_the_bucket_not_output_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, root: Path) -> None:
    bucket = new_bucket(monkeypatch, "trainer")
    commit = CommitCallback(root, destination=f"s3://{bucket}/run", keep=2, background=True)
    _train(tmp_path / "out", commit)
    assert sorted({key.split("/")[1] for key in keys(bucket)}) == ["checkpoint-2", "checkpoint-3"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
