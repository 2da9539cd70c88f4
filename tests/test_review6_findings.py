"""Sixth review: what follow-by-default (follow=None, "auto") newly exposes, with the real
safetensors 0.8 writer and real filesystems. Each test fails on the reviewed code."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import safestage
from safestage import _follow


def big_tensors(seed: int = 0, mib: int = 64) -> dict[str, torch.Tensor]:
    """Exactly ``mib`` MiB of float32 tensors: at the default follow threshold or above."""
    assert mib << 20 >= _follow.FOLLOW_MIN_BYTES
    return {f"w{j}": torch.full((1 << 18,), float(seed * 1000 + j + 1)) for j in range(mib)}


def same(loaded: dict[str, torch.Tensor], wanted: dict[str, torch.Tensor]) -> bool:
    return set(loaded) == set(wanted) and all(torch.equal(loaded[k], wanted[k]) for k in wanted)


@pytest.fixture(params=["full", "read-only"])
def failing_destination(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Path, int]]:
    """A real tmpfs destination that refuses the publish: 1 MiB (ENOSPC in the middle of the
    copy) or read-only (EROFS at the creation of our temp)."""
    target = tmp_path / "dest"
    target.mkdir()
    if request.param == "full":
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(target)], check=True)
        code = errno.ENOSPC
    else:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m,mode=0755", "tmpfs", str(target)], check=True)
        code = errno.EROFS
    try:
        yield target, code
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)


def test_a_destination_failing_while_the_writer_writes_names_the_kept_copy(failing_destination, stage_root):
    """A default save (follow auto) of a 64 MiB model onto a destination that is full or
    read-only. The followed copy fails while safetensors is still writing the staged file,
    so the PublishError is built before the staged file exists under its name: it says "No
    staged copy could be kept." and ``staged_path`` is None. Then the writer finishes and
    write_following keeps the complete staged file anyway (keep_unpublished), in a directory
    no sweep and no `safestage clean` ever removes (it holds a complete copy). What the user
    loses: the error tells them nothing was kept, recovery code that copies
    ``exc.staged_path`` has nothing to copy, and every retry against the full destination
    silently leaves one more full-size checkpoint in the staging root until it fills.
    With follow=False the same failure names the kept copy."""
    dest_dir, code = failing_destination
    dest = dest_dir / "model.safetensors"
    tensors = big_tensors()
    with pytest.raises(safestage.PublishError) as info:
        with safestage.staged(stage_root):  # the defaults (root on local disk): follow auto
            save_file(tensors, str(dest))
    error = info.value
    assert error.errno == code, error  # the fault fired: the destination refused the publish
    assert not dest.exists() and os.listdir(dest_dir) == []  # nothing torn under the final name
    left = sorted(p for p in stage_root.rglob("*") if p.is_file())
    if error.staged_path is None:
        assert left == [], (
            f"the error says {str(error)[-60:]!r} (staged_path=None), yet the staging root keeps "
            f"{[str(p) for p in left]}"
        )
    else:
        assert left == [Path(error.staged_path)], (error.staged_path, left)
        assert same(load_file(error.staged_path), tensors)
        assert "No staged copy could be kept" not in str(error)
