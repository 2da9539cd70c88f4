"""Errors of the writer itself (a bytes filename, tensors safetensors rejects) pass through unchanged, and leave nothing that disturbs the next save."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from _support import StrPath, loads_equal, outcome
from safetensors.torch import save_file

import safestage


@pytest.mark.parametrize(
    "wrap", [os.fsencode, lambda p: StrPath(os.fsencode(p))], ids=["bytes", "PathLike-to-bytes"]
)
def test_bytes_filename_raises_safetensors_own_error_unchanged(tmp_path, shm_root, two_tensors, wrap):
    dest = wrap(str(tmp_path / "model.safetensors"))
    plain = outcome(lambda: save_file(two_tensors, dest))
    assert plain.startswith("TypeError"), plain  # safetensors 0.8 takes no bytes paths
    with safestage.staged(shm_root) as stage:
        staged = outcome(lambda: save_file(two_tensors, dest))
    assert staged == plain
    assert stage.records == [] and os.listdir(shm_root) == [] and os.listdir(tmp_path) == []


def _shared() -> dict[str, torch.Tensor]:
    base = torch.zeros(8)
    return {"a": base, "b": base[:4]}


REJECTED = {
    "non-contiguous": (lambda: {"t": torch.arange(10)[::2]}, None),
    "shared-storage": (_shared, None),
    "sparse": (lambda: {"s": torch.zeros(4).to_sparse()}, None),
    "meta-device": (lambda: {"m": torch.zeros(4, device="meta")}, None),
    "metadata-not-str": (
        lambda: {"w": torch.zeros(4)},
        {"step": 1},
    ),  # raised inside serialize_file
    "key-not-str": (lambda: {1: torch.zeros(4)}, None),  # raised inside serialize_file
}


@pytest.mark.parametrize("case", sorted(REJECTED))
def test_tensors_safetensors_rejects_raise_its_own_error_unchanged(
    tmp_path, shm_root, two_tensors, case
):
    make, metadata = REJECTED[case]
    dest = tmp_path / "model.safetensors"
    save_file(two_tensors, str(dest))
    before = dest.read_bytes()
    plain = outcome(lambda: save_file(make(), str(dest), metadata=metadata))
    assert plain != "ok"
    with safestage.staged(shm_root) as stage:
        staged = outcome(lambda: save_file(make(), str(dest), metadata=metadata))
    assert staged == plain
    assert dest.read_bytes() == before and os.listdir(tmp_path) == ["model.safetensors"]
    assert stage.records == [] and os.listdir(shm_root) == [], "nothing staged may be left"


def test_a_rejected_save_does_not_disturb_the_next_one(tmp_path, shm_root, two_tensors, caplog):
    with caplog.at_level(logging.WARNING, logger="safestage"), safestage.staged(shm_root) as stage:
        with pytest.raises(ValueError):
            save_file({"t": torch.arange(10)[::2]}, str(tmp_path / "bad.safetensors"))
        save_file(two_tensors, str(tmp_path / "good.safetensors"))
    assert loads_equal(tmp_path / "good.safetensors", two_tensors)
    assert [r.destination.name for r in stage.records] == ["good.safetensors"]
    assert not caplog.records, [r.getMessage() for r in caplog.records]
