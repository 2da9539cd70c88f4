"""A third hostile review, of commit_in_place, safestage.transformers.CommitCallback, and
safestage.lightning's background load/remove: one failing test per defect.

Real files on disk and on the kit's FUSE mounts, real processes; no mocks. Each asserts what
a user checks: what verify / latest_complete answer, the error's type, errno and path, the
bytes that load back.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import safestage
from safestage import COMMIT_NAME, PublishError


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "scratch"
    path.mkdir()
    return path


def _committed_pair(parent: Path, root: Path) -> tuple[Path, Path]:
    """checkpoint-1 and checkpoint-2, each a committed model.safetensors of 4,000+ bytes."""
    made = []
    for step in (1, 2):
        directory = parent / f"checkpoint-{step}"
        directory.mkdir()
        save_file({"w": torch.full((1000,), float(step))}, str(directory / "model.safetensors"))
        (directory / "trainer_state.json").write_text(json.dumps({"global_step": step}))
        safestage.commit_in_place(directory, root)
        made.append(directory)
    return made[0], made[1]


def _same_size_shard(path: Path, header: bytes) -> None:
    """Overwrite ``path`` with a file of the same size whose header is ``header`` (padded
    with JSON whitespace): what bit rot, a foreign writer or a torn object can leave."""
    size = path.stat().st_size
    assert len(header) <= size - 8
    header = header + b" " * (size - 8 - len(header))
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    assert path.stat().st_size == size


_UNHASHABLE_DTYPE = json.dumps({"w": {"dtype": ["F32"], "shape": [1000], "data_offsets": [0, 4000]}}).encode()
_NESTED = b"[" * 1900 + b"]" * 1900  # valid JSON, deeper than Python's recursion limit


# -- 1. verify(deep=True) / latest_complete(deep=True) raise on a corrupt shard header ----------


@pytest.mark.parametrize("header", [_UNHASHABLE_DTYPE, _NESTED], ids=["list-dtype", "nested-header"])
def test_deep_latest_complete_falls_back_past_a_same_size_shard_with_a_hostile_header(
    tmp_path: Path, root: Path, header: bytes
) -> None:
    """README: verify "never raises for what it finds"; latest_complete(deep=True) names the
    newest checkpoint whose bytes match. A same-size shard whose header is valid JSON but
    not a safetensors header (a dtype that is a list, or nesting deeper than the recursion
    limit) makes verify(deep=True) raise TypeError / RecursionError, and latest_complete
    with it: a resumer crashes instead of falling back to checkpoint-1."""
    first, second = _committed_pair(tmp_path, root)
    _same_size_shard(second / "model.safetensors", header)
    result = safestage.verify(second, deep=True)  # raises today
    assert not result.complete
    assert {p.path for p in result.problems} == {"model.safetensors"}
    assert safestage.latest_complete(tmp_path, deep=True) == first


# -- 2. commit_in_place raises a bare TypeError / RecursionError, not PublishError EBADMSG ------


@pytest.mark.parametrize(
    "name, payload",
    [
        ("model.safetensors", struct.pack("<Q", len(_UNHASHABLE_DTYPE)) + _UNHASHABLE_DTYPE + b"\0" * 4000),
        ("model.safetensors", struct.pack("<Q", len(_NESTED)) + _NESTED),
        ("trainer_state.json", b"[" * 5000 + b"]" * 5000),
    ],
    ids=["shard-list-dtype", "shard-nested-header", "nested-json"],
)
def test_commit_in_place_refuses_a_hostile_file_with_publish_error_naming_it(
    tmp_path: Path, root: Path, name: str, payload: bytes
) -> None:
    """README: "A checkpoint whose read-back finds a problem raises PublishError (EBADMSG,
    step="verify")" naming it. These files raise TypeError / RecursionError out of
    commit_in_place (and so out of CommitCallback.on_save): no errno, no path, and a
    caller that catches PublishError (OSError) to retry the save does not catch it."""
    directory = tmp_path / "checkpoint-1"
    directory.mkdir()
    save_file({"v": torch.ones(8)}, str(directory / "other.safetensors"))
    (directory / name).write_bytes(payload)
    with pytest.raises(PublishError) as caught:
        safestage.commit_in_place(directory, root)
    assert caught.value.errno == errno.EBADMSG and caught.value.step == "verify"
    assert name in str(caught.value)
    assert not (directory / COMMIT_NAME).exists()
    assert os.listdir(root) == []


def test_commit_callback_on_save_raises_publish_error_for_a_hostile_json(tmp_path: Path, root: Path) -> None:
    """The same through the Trainer callback's hook: on_save must raise PublishError EBADMSG
    (the documented way the run stops), not RecursionError."""
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from safestage.transformers import CommitCallback

    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    state = TrainerState()
    state.global_step = 4
    checkpoint = tmp_path / "checkpoint-4"
    checkpoint.mkdir()
    save_file({"w": torch.ones(8)}, str(checkpoint / "model.safetensors"))
    (checkpoint / "trainer_state.json").write_bytes(b'{"a":' * 3000 + b"1" + b"}" * 3000)
    callback = CommitCallback(root)
    with pytest.raises(PublishError) as caught:
        callback.on_save(args, state, TrainerControl())
    assert caught.value.errno == errno.EBADMSG
    assert "trainer_state.json" in str(caught.value)
    assert safestage.latest_complete(tmp_path) is None


# -- 3. Lightning background: a load by another spelling of the path does not wait ----------------


def test_lightning_background_load_by_the_kernels_path_reads_the_new_save(tmp_path: Path, root: Path) -> None:
    """StagedCheckpointIO(background=True).load_checkpoint promises "a load right after a save
    must read that save, never the file it replaces". It looks the pending publish up by
    os.path.abspath text, while the publisher (and _paths: "paths as the kernel resolves
    them, never as text") keys by the kernel's path. A checkpoint saved through a symlinked
    run directory (~/runs -> /mnt/hdfs/runs) and loaded by its real path does not wait:
    the load returns the previous checkpoint's tensors."""
    from safestage.lightning import StagedCheckpointIO
    from safestage.testing import hostile_mount

    with hostile_mount("slow", tmp_path / "mnt", mbps=4) as mount:
        real = Path(mount.path) / "ckpts"
        real.mkdir()
        alias = tmp_path / "ckpts-link"
        alias.symlink_to(real)
        torch.save({"step": 1, "w": torch.zeros(10)}, real / "last.ckpt")  # the previous save
        plugin = StagedCheckpointIO(root, background=True)
        plugin.save_checkpoint({"step": 2, "w": torch.ones(1 << 20)}, alias / "last.ckpt")  # 4 MiB: ~1 s
        loaded = plugin.load_checkpoint(real / "last.ckpt")
        plugin.teardown()
        assert loaded["step"] == 2
