"""Following (issue 13; forced on here with safestage._api.force_follow): the publish copies the staged file while the writer writes it.

The property that matters: the copy never contains a byte the writer has not written yet.
The writers here imitate safetensors 0.8 (a sibling .tmpXXXXXX preallocated to its full size
with ftruncate, so the unwritten part reads as zeros, one write() per chunk, then a rename)
and 0.7 (the final name, in place), slowly, with a pattern that has no zero byte: a copied
zero is a copied unwritten byte.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch
from safetensors.torch import load_file, save_file

import safestage
from safestage import _follow, _stage
from safestage._follow import Follower, WriterFailed

CHUNK = 1 << 20
CHUNKS = 12
TEMP_OF_OURS = re.compile(r"^\..*\.safestage-.*\.tmp$")


def pattern(index: int) -> bytes:
    return bytes([index % 251 + 1]) * CHUNK  # never 0: preallocated, unwritten bytes are 0


def expected_bytes(chunks: int = CHUNKS) -> bytes:
    return b"".join(pattern(i) for i in range(chunks))


def slow_writer(
    *,
    temp: bool = True,
    delay: float = 0.02,
    fail_after: Optional[int] = None,
    rewrite_first: bool = False,
    on_chunk: Optional[Callable[[int], None]] = None,
) -> Callable[[str], None]:
    """A writer like safetensors 0.8 (temp + set_len + sequential writes + rename), or with
    ``temp=False`` like 0.7 (in place). ``fail_after``: raise after that many chunks.
    ``rewrite_first``: at the end, overwrite the first chunk in place (pwrite), which breaks
    the append-only assumption: the digest check must catch it."""

    def write(path: str) -> None:
        target = os.path.join(os.path.dirname(path), ".tmpAbC123") if temp else path
        fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, CHUNK * CHUNKS)
            for index in range(CHUNKS):
                if fail_after is not None and index == fail_after:
                    raise ValueError("writer failed mid-file")
                time.sleep(delay)
                os.write(fd, pattern(index))
                if on_chunk is not None:
                    on_chunk(index)
            if rewrite_first:
                time.sleep(0.2)  # the follower has copied chunk 0 by now
                os.pwrite(fd, b"\xee" * CHUNK, 0)
        except BaseException:
            os.close(fd)
            os.unlink(target)
            raise
        os.close(fd)
        if temp:
            os.replace(target, path)

    return write


def follow_into_memory(private: Path, write: Callable[[str], None]) -> tuple[list[tuple[int, bytes]], Follower]:
    """Run ``write`` in a thread and a Follower's reader here; return every chunk the reader
    produced (offset, bytes) as it produced it."""
    staged = private / "model.safetensors"
    follower = Follower(private, staged, poll=0.001)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            write(str(staged))
        except BaseException as exc:
            errors.append(exc)
            follower.fail()
        else:
            follower.finish()
            follower.check_final()  # what write_following does once the writer returned

    thread = threading.Thread(target=run)
    reader = follower.open()
    thread.start()
    pieces: list[tuple[int, bytes]] = []
    offset = 0
    buffer = bytearray(3 * CHUNK // 2)  # not a multiple of the writer's chunk
    try:
        while count := reader.readinto(buffer):
            pieces.append((offset, bytes(buffer[:count])))
            offset += count
    finally:
        reader.close()
        thread.join()
    assert not errors, errors
    return pieces, follower


def unwritten_bytes_copied(pieces: list[tuple[int, bytes]]) -> int:
    whole = expected_bytes()
    return sum(
        1 for offset, data in pieces for i, byte in enumerate(data) if byte != whole[offset + i]
    )


def test_follower_copies_only_written_bytes(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    pieces, follower = follow_into_memory(private, slow_writer())
    assert b"".join(data for _, data in pieces) == expected_bytes()
    assert unwritten_bytes_copied(pieces) == 0
    # It really followed: most bytes were read while the writer was still writing.
    assert follower.followed
    assert follower.bytes_while_writing >= CHUNK * (CHUNKS - 2)


def test_the_harness_catches_a_follower_that_reads_unwritten_bytes(tmp_path, monkeypatch):
    """The test above would fail for a follower trusting the file size (set_len makes it the
    final size at once): here that broken follower copies zeros, and the harness sees them
    (the CRC check then refuses the copy, which is the second line of defence)."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)

    def by_size(self: _follow._FollowReader) -> int:
        assert self._fd is not None
        return os.fstat(self._fd).st_size

    monkeypatch.setattr(_follow._FollowReader, "_writer_position", by_size)
    with pytest.raises(_follow.FollowMismatch, match="CRC-32"):
        pieces, _ = follow_into_memory(private, slow_writer(delay=0.05))
    # Re-run, collecting the pieces before the final check: the zeros are there.
    seen: list[bytes] = []
    monkeypatch.setattr(_follow._FollowReader, "_verify", lambda self: seen.append(b"checked"))
    private2 = tmp_path / "private2"
    private2.mkdir(mode=0o700)
    pieces, _ = follow_into_memory(private2, slow_writer(delay=0.05))
    assert unwritten_bytes_copied(pieces) > 0
    assert seen == [b"checked"]


def test_follower_of_an_in_place_writer_like_safetensors_07(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    pieces, follower = follow_into_memory(private, slow_writer(temp=False))
    assert b"".join(data for _, data in pieces) == expected_bytes()
    assert unwritten_bytes_copied(pieces) == 0
    assert follower.followed


def test_follower_reader_raises_when_the_writer_fails(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    with pytest.raises(WriterFailed):  # the reader stops as soon as the writer has failed
        follow_into_memory(private, slow_writer(fail_after=4))
    follower = Follower(private, private / "x")
    follower.fail()
    with pytest.raises(WriterFailed):
        follower.open().readinto(bytearray(10))


# -- through a stage: bytes at the destination, leftovers, fall-backs --------------------


def save_with(stage: safestage.Stage, write: Callable[[str], None], dest: Path) -> None:
    stage._save(write, dest)  # what the serialize_file wrapper calls


def test_staged_follow_publishes_the_exact_bytes(tmp_path, shm_root, caplog):
    dest = tmp_path / "model.safetensors"
    caplog.set_level(logging.DEBUG, logger="safestage")
    with safestage._api.force_follow(safestage.staged(shm_root)) as stage:
        save_with(stage, slow_writer(), dest)
    assert dest.read_bytes() == expected_bytes()
    assert [r.publish for r in stage.records] == ["replace"]
    assert os.listdir(tmp_path) == ["model.safetensors"]
    assert os.listdir(shm_root) == []
    followed = [r.getMessage() for r in caplog.records if "followed" in r.getMessage()]
    assert followed, "the save was not followed"
    assert int(re.search(r"\((\d+) bytes while writing\)", followed[0])[1]) > CHUNK * (CHUNKS // 2)


def test_writer_failing_mid_file_publishes_nothing_and_removes_the_temp(tmp_path, shm_root):
    dest = tmp_path / "model.safetensors"
    temps_seen: list[str] = []

    def look(index: int) -> None:  # the fault fires while our temp is being written
        if index == 3:
            time.sleep(0.1)
            temps_seen.extend(n for n in os.listdir(tmp_path) if TEMP_OF_OURS.match(n))

    with (
        safestage._api.force_follow(safestage.staged(shm_root)) as stage,
        pytest.raises(ValueError, match="mid-file"),
    ):
        save_with(stage, slow_writer(fail_after=5, on_chunk=look), dest)
    assert temps_seen, "the follower had not started copying: the fault proves nothing"
    assert os.listdir(tmp_path) == []
    assert os.listdir(shm_root) == []
    assert stage.records == []


def test_writer_failing_keeps_the_previous_destination(tmp_path, shm_root):
    dest = tmp_path / "model.safetensors"
    dest.write_bytes(b"previous")
    with safestage._api.force_follow(safestage.staged(shm_root)) as stage, pytest.raises(ValueError):
        save_with(stage, slow_writer(fail_after=5), dest)
    assert dest.read_bytes() == b"previous"
    assert os.listdir(tmp_path) == ["model.safetensors"]


def test_writer_not_found_is_a_plain_publish_after_it(tmp_path, shm_root, caplog):
    """A writer in another process (dd here): no descriptor of ours points at the file, so
    the copy starts once the writer has returned."""
    dest = tmp_path / "model.safetensors"
    source = tmp_path / "source.bin"
    source.write_bytes(expected_bytes())

    def write(path: str) -> None:
        subprocess.run(["dd", f"if={source}", f"of={path}", "bs=1M", "status=none"], check=True)

    caplog.set_level(logging.DEBUG, logger="safestage")
    with safestage._api.force_follow(safestage.staged(shm_root)) as stage:
        save_with(stage, write, dest)
    assert dest.read_bytes() == expected_bytes()
    assert any("not seen; plain copy" in r.getMessage() for r in caplog.records)
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors", "source.bin"]
    assert os.listdir(shm_root) == []


def test_a_rewriting_writer_fails_the_crc_and_is_copied_again(tmp_path, shm_root, caplog):
    dest = tmp_path / "model.safetensors"
    with safestage._api.force_follow(safestage.staged(shm_root)) as stage:
        save_with(stage, slow_writer(rewrite_first=True), dest)
    final = b"\xee" * CHUNK + expected_bytes()[CHUNK:]
    assert dest.read_bytes() == final  # the re-copy, not the followed bytes
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("FollowMismatch" in w and "CRC-32" in w for w in warnings), warnings
    assert os.listdir(tmp_path) == ["model.safetensors"]
    assert os.listdir(shm_root) == []


def test_follow_is_not_used_for_rename_or_background(tmp_path, stage_root, shm_root, caplog):
    caplog.set_level(logging.DEBUG, logger="safestage")
    with safestage._api.force_follow(safestage.staged(stage_root)) as stage:  # same filesystem: rename
        save_with(stage, slow_writer(delay=0), tmp_path / "a.safetensors")
    with safestage._api.force_follow(safestage.staged(shm_root, background=True)) as stage2:
        save_with(stage2, slow_writer(delay=0), tmp_path / "b.safetensors")
    assert [r.publish for r in stage.records + stage2.records] == ["rename", "replace"]
    assert not any(
        "following fd" in r.getMessage() or "followed (" in r.getMessage() for r in caplog.records
    )


def test_by_default_a_big_safetensors_save_is_followed_and_a_small_one_is_not(tmp_path, shm_root, caplog):
    """The default (follow=None, "auto"), chosen from two benchmark runs: a synchronous replace
    save known to be at least FOLLOW_MIN_BYTES is followed, a smaller one is not, a torch.save
    (size unknown) is not, and follow=False turns it off."""
    big = {f"w{j}": torch.full((1 << 20,), float(j)) for j in range(_follow.FOLLOW_MIN_BYTES // (4 << 20))}
    caplog.set_level(logging.DEBUG, logger="safestage")

    def followed() -> list[str]:
        return [r.getMessage() for r in caplog.records if "followed (" in r.getMessage()]

    with safestage.staged(shm_root, torch_save=True) as stage:  # root on another device: replace
        save_file(big, str(tmp_path / "big.safetensors"))
        assert len(followed()) == 1 and "big.safetensors" in followed()[0]
        save_file({"w": torch.ones(8)}, str(tmp_path / "small.safetensors"))
        torch.save(big, str(tmp_path / "big.pt"))
        assert len(followed()) == 1
    with safestage._api.force_follow(safestage.staged(shm_root), False):
        save_file(big, str(tmp_path / "off.safetensors"))
    assert len(followed()) == 1
    assert [r.publish for r in stage.records] == ["replace"] * 3
    loaded = load_file(str(tmp_path / "big.safetensors"))
    assert all(torch.equal(loaded[k], v) for k, v in big.items())
    assert sorted(os.listdir(tmp_path)) == ["big.pt", "big.safetensors", "off.safetensors", "small.safetensors"]
    assert os.listdir(shm_root) == []


@pytest.mark.parametrize("kit_dir", ["hdfs", "mountpoint"], indirect=True)
def test_real_safetensors_saves_followed_onto_the_kit(kit_dir, shm_root, caplog):
    big = {f"w{j}": torch.full((1 << 20,), float(j + 1)) for j in range(16)}  # 64 MiB: followed
    dest = kit_dir / "model.safetensors"
    caplog.set_level(logging.DEBUG, logger="safestage")
    with safestage._api.force_follow(safestage.staged(shm_root)) as stage:
        save_file(big, str(dest))  # followed: replace (hdfs); direct (mountpoint) never is
        save_file({k: v + 1 for k, v in big.items()}, str(dest))
    loaded = load_file(str(dest))
    assert all(torch.equal(loaded[k], big[k] + 1) for k in big)
    assert os.listdir(kit_dir) == ["model.safetensors"]
    assert os.listdir(shm_root) == []
    followed = [r for r in caplog.records if "followed (" in r.getMessage()]
    expected = 2 if stage.records[0].publish == "replace" else 0
    assert len(followed) == expected, [r.getMessage() for r in followed]
    assert [r.publish for r in stage.records] == [stage.records[0].publish] * 2
    assert stage.records[0].publish == ("direct" if "mountpoint" in str(kit_dir) else "replace")


def test_follow_strategy_decisions(tmp_path, shm_root):
    area = _stage.StagingRoot(shm_root, is_default=False)
    on = safestage._api.force_follow(safestage.staged(shm_root)).settings
    off = safestage._api.force_follow(safestage.staged(shm_root), False).settings
    new = tmp_path / "new.safetensors"
    old = tmp_path / "old.safetensors"
    old.write_bytes(b"x")
    assert _stage.follow_strategy(off, new, area) is None
    assert _stage.follow_strategy(on, new, area) == "replace"
    direct = safestage._api.force_follow(safestage.staged(shm_root, publish="direct")).settings
    # direct writes the final name: never followed, it publishes after the writer.
    assert _stage.follow_strategy(direct, new, area) is None
    assert _stage.follow_strategy(direct, old, area) is None


def test_a_save_known_to_be_small_is_not_followed(tmp_path, shm_root, caplog):
    """Following costs a thread, polling and a read-back (~8.5 ms a save): a safetensors save
    whose specs say it is under FOLLOW_MIN_BYTES is published the plain way; one just at the
    threshold is followed."""
    small = {"w": torch.ones(1 << 10)}
    edge = {f"w{j}": torch.ones(1 << 20) for j in range(_follow.FOLLOW_MIN_BYTES // (4 << 20))}
    caplog.set_level(logging.DEBUG, logger="safestage")
    with safestage._api.force_follow(safestage.staged(shm_root)) as stage:
        save_file(small, str(tmp_path / "small.safetensors"))
        small_followed = [r for r in caplog.records if "followed (" in r.getMessage()]
        save_file(edge, str(tmp_path / "edge.safetensors"))
    edge_followed = [r for r in caplog.records if "followed (" in r.getMessage()]
    assert small_followed == [] and len(edge_followed) == 1, [r.getMessage() for r in edge_followed]
    assert "edge.safetensors" in edge_followed[0].getMessage()
    assert [r.publish for r in stage.records] == ["replace", "replace"]
    assert torch.equal(load_file(str(tmp_path / "small.safetensors"))["w"], small["w"])
    assert all(torch.equal(v, edge[k]) for k, v in load_file(str(tmp_path / "edge.safetensors")).items())
    assert sorted(os.listdir(tmp_path)) == ["edge.safetensors", "small.safetensors"]
    settings = safestage._api.force_follow(safestage.staged(shm_root)).settings
    area = _stage.StagingRoot(shm_root, is_default=False)
    new = tmp_path / "new.safetensors"
    assert _stage.follow_strategy(settings, new, area, _follow.FOLLOW_MIN_BYTES - 1) is None
    assert _stage.follow_strategy(settings, new, area, None) == "replace"  # size unknown: follow
    auto = safestage.staged(shm_root).settings  # the default: only what is known to be big
    assert _stage.follow_strategy(auto, new, area, None) is None
    assert _stage.follow_strategy(auto, new, area, _follow.FOLLOW_MIN_BYTES - 1) is None
    assert _stage.follow_strategy(auto, new, area, _follow.FOLLOW_MIN_BYTES) == "replace"


def test_a_failed_follow_copy_falls_back_to_a_plain_publish(tmp_path, shm_root, caplog, monkeypatch):
    """The followed copy fails mid-way (an I/O error reading the staged side): the saving
    thread must not wait for a read-back nobody needs, and the complete file is published
    the ordinary way."""
    dest = tmp_path / "model.safetensors"
    fired: list[int] = []
    real_read = _follow._FollowReader._read

    def failing(self: _follow._FollowReader, buffer: bytearray, limit: int) -> int:
        if self._copied >= 2 * CHUNK:
            fired.append(self._copied)
            raise OSError(5, "injected read error")
        return real_read(self, buffer, limit)

    monkeypatch.setattr(_follow._FollowReader, "_read", failing)
    with safestage._api.force_follow(safestage.staged(shm_root)) as stage:
        save_with(stage, slow_writer(), dest)
    assert fired, "the fault did not fire"
    assert dest.read_bytes() == expected_bytes()
    assert [r.publish for r in stage.records] == ["replace"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("injected read error" in w for w in warnings), warnings
    assert os.listdir(tmp_path) == ["model.safetensors"]
    assert os.listdir(shm_root) == []


# -- direct: published after the writer, never followed ------------------------------------------


@pytest.fixture(params=["local-direct", "kit-mountpoint"])
def direct_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A destination directory published to by ``direct``: the local disk with
    publish="direct", or the kit's mountpoint (no rename: auto picks direct)."""
    if request.param == "local-direct":
        directory = tmp_path / "dest"
        directory.mkdir()
        yield directory, "direct"
        return
    mount = request.getfixturevalue("kit_mounts")["mountpoint"]
    directory = Path(mount.path) / f"t-{uuid.uuid4().hex[:10]}"
    directory.mkdir()
    yield directory, "auto"
    shutil.rmtree(Path(mount.backing) / directory.name, ignore_errors=True)


def test_a_direct_save_is_published_after_the_writer_with_the_exact_bytes(direct_dir, shm_root, caplog):
    """follow=True asks for following, yet a direct save is never followed: the final name
    is written only once the writer has returned."""
    directory, publish = direct_dir
    dest = directory / "model.safetensors"
    seen: list[bool] = []
    caplog.set_level(logging.DEBUG, logger="safestage")
    with safestage._api.force_follow(safestage.staged(shm_root, publish=publish)) as stage:
        save_with(stage, slow_writer(on_chunk=lambda index: seen.append(os.path.lexists(dest))), dest)
    assert seen and not any(seen), f"the final name existed while the writer wrote: {seen}"
    assert dest.read_bytes() == expected_bytes()
    assert [r.publish for r in stage.records] == ["direct"]
    assert os.listdir(directory) == ["model.safetensors"]
    assert os.listdir(shm_root) == []
    assert not [r.getMessage() for r in caplog.records if "followed (" in r.getMessage()]


@pytest.mark.parametrize("fault", ["error", "ctrl-c"])
def test_a_direct_save_whose_writer_fails_leaves_nothing_under_the_new_name(direct_dir, shm_root, fault):
    """A writer raising (or a Ctrl-C) mid-file leaves no file under the final name, which
    a direct save never writes while its writer writes, and no staged copy (nothing is
    complete)."""
    directory, publish = direct_dir
    dest = directory / "model.safetensors"
    seen: list[int] = []

    def look(index: int) -> None:
        if index == 3:
            time.sleep(0.1)
            seen.append(os.stat(dest).st_size if dest.exists() else -1)
        if fault == "ctrl-c" and index == 4:
            raise KeyboardInterrupt

    raised = ValueError if fault == "error" else KeyboardInterrupt
    with safestage._api.force_follow(safestage.staged(shm_root, publish=publish)) as stage, pytest.raises(raised):
        save_with(stage, slow_writer(fail_after=5, on_chunk=look), dest)
    assert seen == [-1], f"the final name was written while the writer wrote: {seen}"
    assert os.listdir(directory) == []
    assert os.listdir(shm_root) == []
    assert stage.records == []
