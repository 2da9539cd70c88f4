"""Destination paths: relative, PathLike, symlinks, symlinked directories, directories and odd names behave as with a plain save."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from _support import (
    StrPath,
    arange_tensors,
    assert_loads_equal,
    changed,
    filled_tensors,
    listing,
    loads_as,
    loads_equal,
    outcome,
)
from safetensors.torch import save_file

import safestage
from safestage.testing import hostile_mount


def test_symlink_destination_is_replaced_like_safetensors_08(tmp_path, shm_root, tensors):
    target = tmp_path / "target.safetensors"
    save_file(tensors, str(target))
    link = tmp_path / "link.safetensors"
    link.symlink_to(target.name)
    with safestage.staged(shm_root):
        save_file(changed(tensors), str(link))
    assert not link.is_symlink()
    assert_loads_equal(link, changed(tensors))
    assert_loads_equal(target, tensors)


def test_bad_destinations_fail_exactly_like_a_plain_save(tmp_path, shm_root, tensors):
    plain: list[str] = []
    for dest in (tmp_path / "missing" / "x.safetensors", tmp_path):
        with pytest.raises(Exception) as info:
            save_file(tensors, str(dest))
        plain.append(f"{type(info.value).__name__}: {info.value}".split(" at path")[0])
    staged: list[str] = []
    with safestage.staged(shm_root) as stage:
        for dest in (tmp_path / "missing" / "x.safetensors", tmp_path):
            with pytest.raises(Exception) as info:
                save_file(tensors, str(dest))
            staged.append(f"{type(info.value).__name__}: {info.value}".split(" at path")[0])
        with pytest.raises(ValueError, match="non contiguous"):
            save_file({"t": torch.arange(10)[::2]}, str(tmp_path / "nc.safetensors"))
    assert staged == plain
    assert stage.records == []
    assert listing(shm_root) == []


def _outcome(action: Any) -> tuple[str, Any]:
    try:
        action()
    except Exception as exc:
        code = exc.errno if isinstance(exc, OSError) else None
        if code is None:
            import re

            found = re.search(r"os error (\d+)", str(exc))
            code = int(found[1]) if found else None
        return "error", code
    return "ok", None


def _tree(top: Path) -> dict[str, str]:
    """Every entry under ``top``: its type, and a regular file's size and digest."""
    import hashlib

    found = {}
    for path in sorted(top.rglob("*")):
        rel = os.fsencode(path.relative_to(top)).hex() if "\n" in str(path) else str(path.relative_to(top))
        info = os.lstat(path)
        if stat.S_ISLNK(info.st_mode):
            found[rel] = "link->" + os.readlink(path)
        elif stat.S_ISDIR(info.st_mode):
            found[rel] = "dir"
        elif stat.S_ISREG(info.st_mode):
            found[rel] = f"file:{info.st_size}:{hashlib.sha256(path.read_bytes()).hexdigest()[:12]}"
        else:
            found[rel] = f"special:{stat.S_IFMT(info.st_mode):o}"
    return found


def _make_paths_world(top: Path) -> None:
    (top / "elsewhere" / "deep").mkdir(parents=True)
    (top / "work").mkdir()
    (top / "work" / "link").symlink_to("../elsewhere/deep")
    (top / "work" / "ckpt").mkdir()
    (top / "work" / "afile.safetensors").write_bytes(b"not a directory")
    os.mkfifo(top / "work" / "fifo.safetensors")
    os.mknod(top / "work" / "dev.safetensors", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    (top / "work" / "dangling.safetensors").symlink_to("nowhere/x.safetensors")
    (top / "work" / "tofile.safetensors").symlink_to("afile.safetensors")


PATH_CASES = [
    "link/../model.safetensors",  # the kernel: elsewhere/model.safetensors
    "missing/../model.safetensors",  # ENOENT
    "ckpt/",  # a directory with a trailing slash
    "afile.safetensors/",  # a file with a trailing slash: ENOTDIR
    "new.safetensors/",  # a missing name with a trailing slash
    "ckpt/.",
    "ckpt/..",
    "./ckpt/../ckpt//model.safetensors",
    "link/model.safetensors",
    "afile.safetensors/x.safetensors",
    "fifo.safetensors",  # a FIFO at the final name: replaced by a regular file
    "dev.safetensors",  # a character device there: the same
    "dangling.safetensors",  # a dangling symlink: replaced by a regular file
    "tofile.safetensors",  # a symlink to a file: replaced, its target kept
    ".hidden.safetensors",
    ".tmpAbc123",  # named like safetensors' own temp file
    "new\nline.safetensors",
    "trailing-newline.safetensors\n",
    "caf\udce9.safetensors",  # not UTF-8 (surrogateescape), as on a Latin-1 filesystem
    "x" * 255,  # NAME_MAX exactly
    "y" * 256,  # one more: ENAMETOOLONG
    "ckpt/" + "z" * 240 + ".safetensors",
]


@pytest.mark.regression("0.1 hostile review of the hardening (issue 9): a staged save writes what a plain save writes")
@pytest.mark.parametrize("case", PATH_CASES)
def test_a_staged_save_writes_what_a_plain_save_writes(tmp_path, shm_root, case, monkeypatch):
    plain_top, staged_top = tmp_path / "plain", tmp_path / "staged"
    for top in (plain_top, staged_top):
        top.mkdir()
        _make_paths_world(top)
    monkeypatch.chdir(plain_top / "work")
    plain = _outcome(lambda: save_file(arange_tensors(4), case))
    monkeypatch.chdir(staged_top / "work")
    with safestage.staged(shm_root):
        staged = _outcome(lambda: save_file(arange_tensors(4), case))
    assert staged == plain, f"{case!r}: plain {plain}, staged {staged}"
    assert _tree(staged_top) == _tree(plain_top)


@pytest.fixture(scope="module", autouse=True)
def _no_safestage_environment() -> Iterator[None]:
    """staged() reads SAFESTAGE_*: the fuzzed arguments alone must decide here."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("SAFESTAGE")}
    yield
    os.environ.update(saved)


def newer(two_tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v + 1 for k, v in two_tensors.items()}


def test_relative_destination_and_root_are_saved_like_absolute_ones(tmp_path, two_tensors, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "scratch").mkdir()
    (tmp_path / "ckpt").mkdir()
    with safestage.staged("scratch") as stage:
        save_file(two_tensors, "model.safetensors")
        save_file(two_tensors, "ckpt/../ckpt/shard.safetensors")
        monkeypatch.chdir(tmp_path / "ckpt")  # the root was resolved when the stage was made
        save_file(newer(two_tensors), "other.safetensors")
    assert stage.staging_root == tmp_path / "scratch"
    assert loads_equal(tmp_path / "model.safetensors", two_tensors)
    assert loads_equal(tmp_path / "ckpt" / "shard.safetensors", two_tensors)
    assert loads_equal(tmp_path / "ckpt" / "other.safetensors", newer(two_tensors))
    assert [r.destination for r in stage.records] == [
        tmp_path / "model.safetensors",
        tmp_path / "ckpt" / "shard.safetensors",
        tmp_path / "ckpt" / "other.safetensors",
    ]
    assert list((tmp_path / "scratch").iterdir()) == []


@pytest.mark.parametrize("wrap", [Path, StrPath], ids=["pathlib", "custom-PathLike"])
def test_pathlike_destination_and_root_are_accepted(tmp_path, shm_root, two_tensors, wrap):
    dest = tmp_path / "model.safetensors"
    with safestage.staged(wrap(str(shm_root))) as stage:
        save_file(two_tensors, wrap(str(dest)))
    assert loads_equal(dest, two_tensors)
    assert [r.destination for r in stage.records] == [dest]
    assert stage.records[0].publish == "replace"


@pytest.mark.regression("v0.2 hostile review: staged_file with a bytes path died inside _paths with "
                        "an internal TypeError naming nothing")
def test_staged_file_takes_a_bytes_path_as_staged_dir_and_open_do(tmp_path, shm_root):
    for name in (b"weights.bin", b"w\xff.bin"):  # the second is not UTF-8
        dest = os.fsencode(tmp_path) + b"/" + name
        with safestage.staged_file(dest, shm_root) as local:
            local.write_bytes(b"payload")
        with open(dest, "rb") as published:
            assert published.read() == b"payload"
    assert sorted(os.listdir(os.fsencode(tmp_path))) == [b"weights.bin", b"w\xff.bin"]
    assert os.listdir(shm_root) == []


def _same_as_plain(
    tmp_path: Path, shm_root: Path, prepare: Callable[[Path], Path], save: Callable[[Path], None]
) -> tuple[Path, Path]:
    """Run the same save plainly in one directory and staged in another; both must end alike."""
    plain_dir, staged_dir = tmp_path / "plain", tmp_path / "staged"
    plain_dir.mkdir()
    staged_dir.mkdir()
    plain_dest, staged_dest = prepare(plain_dir), prepare(staged_dir)
    plain = outcome(lambda: save(plain_dest))
    with safestage.staged(shm_root):
        staged = outcome(lambda: save(staged_dest))
    assert staged == plain.replace(str(plain_dir), str(staged_dir))
    assert entry_kinds(plain_dir) == entry_kinds(staged_dir), "the directories differ after the same save"
    assert os.listdir(shm_root) == []
    return plain_dest, staged_dest


def entry_kinds(directory: Path) -> list[tuple[str, str]]:
    entries = []
    for path in sorted(directory.rglob("*")):
        kind = "link" if path.is_symlink() else "dir" if path.is_dir() else "file"
        entries.append((str(path.relative_to(directory)), kind))
    return entries


def test_a_destination_that_is_a_directory_fails_like_a_plain_save(tmp_path, shm_root, two_tensors):
    def prepare(directory: Path) -> Path:
        (directory / "model.safetensors").mkdir()
        return directory / "model.safetensors"

    _same_as_plain(tmp_path, shm_root, prepare, lambda dest: save_file(two_tensors, str(dest)))


def test_a_missing_destination_directory_fails_like_a_plain_save(tmp_path, shm_root, two_tensors):
    _same_as_plain(
        tmp_path,
        shm_root,
        lambda d: d / "missing" / "model.safetensors",
        lambda dest: save_file(two_tensors, str(dest)),
    )


def test_dangling_symlink_destination_becomes_a_regular_file(tmp_path, shm_root, two_tensors):
    def prepare(directory: Path) -> Path:
        (directory / "model.safetensors").symlink_to(directory / "nowhere.safetensors")
        return directory / "model.safetensors"

    _, staged_dest = _same_as_plain(
        tmp_path, shm_root, prepare, lambda dest: save_file(two_tensors, str(dest))
    )
    assert not staged_dest.is_symlink() and loads_equal(staged_dest, two_tensors)
    assert not (staged_dest.parent / "nowhere.safetensors").exists(), (
        "the link must not be followed"
    )


def test_symlink_to_a_file_is_replaced_and_its_target_kept(tmp_path, shm_root, two_tensors):
    def prepare(directory: Path) -> Path:
        target = directory / "target.safetensors"
        save_file(two_tensors, str(target))
        (directory / "model.safetensors").symlink_to(target.name)
        return directory / "model.safetensors"

    _, staged_dest = _same_as_plain(
        tmp_path, shm_root, prepare, lambda dest: save_file(newer(two_tensors), str(dest))
    )
    assert not staged_dest.is_symlink(), "replaced by a regular file, as safetensors 0.8 does"
    assert loads_equal(staged_dest, newer(two_tensors))
    assert loads_equal(staged_dest.parent / "target.safetensors", two_tensors), (
        "the link's target is untouched"
    )


def test_a_destination_inside_a_symlinked_directory_lands_in_its_target(tmp_path, shm_root, two_tensors):
    def prepare(directory: Path) -> Path:
        (directory / "real").mkdir()
        (directory / "link").symlink_to("real", target_is_directory=True)
        return directory / "link" / "model.safetensors"

    _, staged_dest = _same_as_plain(
        tmp_path, shm_root, prepare, lambda dest: save_file(two_tensors, str(dest))
    )
    assert loads_equal(staged_dest.parent.parent / "real" / "model.safetensors", two_tensors)


@pytest.mark.mounts
@pytest.mark.regression("0.1 hostile review 1: a directory named like a deleted one is saved unstaged")
def test_a_directory_named_like_a_deleted_one_is_staged(shm_root):
    """_paths.real_directory reads /proc/self/fd/N and treats a path ending in " (deleted)"
    as a removed directory, so resolve_destination returns None and the save goes to the
    original writer, unstaged. A real directory can have that name ("run 7 (deleted)",
    a restored folder). On HDFS FUSE the plain writer then fails with ENOSYS; on an object
    store that fails at close it loses the file silently. What the user loses: staging, for
    every save into that directory, without a word (the check could fstat the descriptor:
    st_nlink == 0 means removed)."""
    with hostile_mount("hdfs") as mount:
        directory = Path(mount.path) / "run 7 (deleted)"
        directory.mkdir()
        with safestage.staged(shm_root) as stage:
            save_file(filled_tensors(7), str(directory / "model.safetensors"))  # ENOSYS: unstaged
        assert [r.publish for r in stage.records] == ["replace"]
        assert loads_as(directory / "model.safetensors", 7.0)
