"""staged_file(): any writer (torch.save, a copy, a symlink) into a local path, published like a safetensors save."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

import pytest
import torch
from _support import filled_tensors, loads_as
from safetensors.torch import save_file

import safestage
from safestage import PublishError, StagingError


def test_staged_file_torch_save_onto_mountpoint(kit_mounts, stage_root):
    directory = Path(kit_mounts["mountpoint"].path) / f"sf-{os.getpid()}"
    directory.mkdir()
    state = {"step": 7, "momentum": torch.randn(100)}
    with safestage.staged_file(directory / "optimizer.pt", stage_root) as local:
        assert local.parent.parent == stage_root
        torch.save(state, local)
    back = torch.load(directory / "optimizer.pt")
    assert back["step"] == 7 and torch.equal(back["momentum"], state["momentum"])
    assert "optimizer.pt" in os.listdir(directory)
    assert os.listdir(stage_root) == []


def test_staged_file_across_devices(tmp_path, shm_root):
    dest = tmp_path / "tokenizer.json"
    with safestage.staged_file(dest, shm_root) as local:
        local.write_text('{"vocab": 3}')
    assert dest.read_text() == '{"vocab": 3}'
    assert stat.S_IMODE(os.stat(dest).st_mode) == 0o644
    assert os.listdir(shm_root) == []


def test_staged_file_failure_publishes_nothing(tmp_path, shm_root):
    dest = tmp_path / "x.bin"
    with pytest.raises(ZeroDivisionError), safestage.staged_file(dest, shm_root) as local:
        local.write_bytes(b"partial")
        1 / 0  # noqa: B018
    assert not dest.exists() and os.listdir(shm_root) == []
    with pytest.raises(StagingError, match="nothing was written"), safestage.staged_file(dest, shm_root):
        pass
    with pytest.raises(PublishError, match="does not exist"), safestage.staged_file(tmp_path / "no" / "x", shm_root):
        pass


@pytest.mark.regression("0.1 hostile review 1: staged file around a safetensors save in a background stage")
def test_staged_file_around_a_safetensors_save_in_a_background_stage_publishes_that_save(shm_root, tmp_path):
    """SAFESTAGE_BACKGROUND=1 for the job, and a helper that publishes every artifact with
    `staged_file` (README: "any other writer ... with the same strategies and guarantees").
    The save_file into the yielded local path is itself staged and goes to the background,
    so `staged_file` finds nothing there yet, deletes the private directory and raises
    StagingError "nothing was written to ..." - false: something was written, and is still
    being published into the directory just deleted, which then fails a second time at close.
    What the user loses: the file, with an error that blames the wrong thing."""
    dest = tmp_path / "model.safetensors"
    job_root = tmp_path / "job-root"  # the job's staging root, on another device than `root`
    job_root.mkdir()
    stage = safestage.activate(job_root, background=True)
    try:
        with safestage.staged_file(dest, shm_root) as local:
            save_file(filled_tensors(3, numel=16 << 20), str(local))  # 64 MiB: its publish takes a while
    finally:
        with contextlib.suppress(Exception):
            stage.close()
    assert loads_as(dest, 3.0)


@pytest.mark.regression("0.1 hostile review 1: staged file under a regular file reports enoent not enotdir")
def test_staged_file_under_a_regular_file_reports_enotdir_like_a_plain_open(shm_root, tmp_path):
    """_save.destination promises "the error a plain open would give"; open() of
    `afile/x` where afile is a regular file fails with ENOTDIR. staged_file raises
    PublishError(ENOENT, "the directory of ... does not exist (or is not a directory): create
    it"), advice that makes the user try `mkdir -p` over an existing file. Cosmetic."""
    (tmp_path / "afile").write_bytes(b"not a directory")
    with pytest.raises(OSError) as plain:
        open(tmp_path / "afile" / "x.bin", "wb")  # noqa: SIM115
    with pytest.raises(OSError) as staged, safestage.staged_file(tmp_path / "afile" / "x.bin", shm_root) as local:
        local.write_bytes(b"data")
    assert staged.value.errno == plain.value.errno == errno.ENOTDIR, str(staged.value)


@pytest.mark.regression("0.1 hostile review 1: staged file with rename publishes the writers symlink and chmods its target")
def test_staged_file_publishes_a_writers_symlink_as_a_file_and_leaves_its_target_mode(tmp_path):
    """A writer that links instead of copying (shutil.copy2(..., follow_symlinks=False) of a
    cached file, a hub download into local_dir) leaves a symlink at the path staged_file
    yielded. With the staging root on the destination's filesystem (`rename`), publish
    chmods the link's TARGET to the destination's mode and renames the link itself into
    place: the "published" checkpoint is a symlink into the cache, not a file (`replace`
    copies the bytes instead). What the user loses: the checkpoint, as soon as the cache is
    cleaned; and the cache file's mode is changed behind their back (0444 -> 0644)."""
    shm_root = tmp_path / "scratch"
    shm_root.mkdir()
    cache = tmp_path / "cache" / "blob"
    cache.parent.mkdir()
    cache.write_bytes(b"weights" * 1000)
    cache.chmod(0o444)
    dest = tmp_path / "ckpt" / "optimizer.bin"
    dest.parent.mkdir()
    with safestage.staged_file(dest, shm_root) as local:
        os.symlink(cache, local)
    assert oct(cache.stat().st_mode & 0o777) == "0o444", "publish chmod'ed the cache file"
    cache.unlink()  # the cache is cleaned
    assert not dest.is_symlink() and dest.read_bytes() == b"weights" * 1000


@pytest.mark.regression("0.1 hostile review 1: staged file deletes a directory the writer made and says nothing was written")
def test_staged_file_keeps_a_directory_the_writer_made(shm_root, tmp_path):
    """A writer that makes a directory at the path it is given (save_pretrained,
    accelerator.save_state, torch.distributed.checkpoint - the very writers README sends to
    staged_file) inside `with staged_file(dest) as local:`. Afterwards staged_file sees no
    regular file, removes the private directory with everything written into it, and raises
    "nothing was written to <local>". What the user loses: the whole local save (hours of
    a save_state, say), with an error that says it never happened instead of "a directory
    was written where a file was expected; it is kept at ...\""""
    dest = tmp_path / "state"
    message = ""
    try:
        with safestage.staged_file(dest, shm_root) as local:
            local.mkdir()
            (local / "model.safetensors").write_bytes(b"weights" * 1000)
            (local / "optimizer.bin").write_bytes(b"state" * 1000)
    except OSError as exc:
        message = str(exc)
    kept = list(shm_root.rglob("optimizer.bin"))
    assert "nothing was written" not in message, message
    assert kept or dest.exists(), f"the writer's directory was deleted: {message}"
