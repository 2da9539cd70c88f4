"""Following (issue 13; forced on here with safestage._api.force_follow): the publish copies the staged file while the writer writes it.

The property that matters: the copy never contains a byte the writer has not written yet.
The writers here imitate safetensors 0.8 (a sibling .tmpXXXXXX preallocated to its full size
with ftruncate, so the unwritten part reads as zeros, one write() per chunk, then a rename)
and 0.7 (the final name, in place), slowly, with a pattern that has no zero byte: a copied
zero is a copied unwritten byte.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Callable, Optional

import pytest
import torch
from _support import CHUNK, CHUNKS
from safetensors.torch import load_file, save_file

import safestage
from safestage import _follow, _stage
from safestage._follow import Follower, WriterFailed
from safestage._names import KEPT_RECORD

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


@pytest.mark.slow
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


@pytest.mark.mounts
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


@pytest.mark.mounts
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


def other_bytes() -> bytes:
    return b"".join(bytes([(i + 7) % 251 + 1]) * CHUNK for i in range(CHUNKS))


def fast_writer(data: bytes):
    def write(path: str) -> None:
        with open(path, "wb") as handle:
            handle.write(data)

    return write


@pytest.mark.regression("0.1 hostile review 4: failed followed direct save never deletes a file another save just published")
def test_failed_followed_direct_save_never_deletes_a_file_another_save_just_published(tmp_path, shm_root, monkeypatch):
    """Two threads save the same new file with publish='direct' and follow. Both decide
    'new file: follow' before either publisher created it. A's save succeeds and returns;
    B's writer fails mid-file. The README promises that a failing writer never costs an
    existing file its bytes; here B follows a direct write *over A's published file*
    (O_TRUNC) and, when its writer fails, unlinks it: A's successful save is gone."""
    dest = tmp_path / "model.safetensors"
    both_decided = threading.Barrier(2, timeout=5)
    real = _stage.follow_strategy

    def decide(settings, d, area, needs=None):
        strategy = real(settings, d, area, needs)
        both_decided.wait()
        if threading.current_thread().name == "saver-b":
            time.sleep(0.3)  # A's publisher takes the file's direct lock first
        return strategy

    monkeypatch.setattr(safestage._save, "follow_strategy", decide)
    errors: dict[str, BaseException] = {}
    a_done = threading.Event()

    with safestage._api.force_follow(safestage.staged(shm_root, publish="direct")) as stage:

        def a() -> None:
            try:
                save_with(stage, fast_writer(other_bytes()), dest)
            except BaseException as exc:  # noqa: BLE001
                errors["a"] = exc
            a_done.set()

        def b() -> None:
            def write(path: str) -> None:
                a_done.wait(5)  # B's writer is still writing when A has published
                slow_writer(delay=0.03, fail_after=6)(path)

            try:
                save_with(stage, write, dest)
            except BaseException as exc:  # noqa: BLE001
                errors["b"] = exc

        threads = [threading.Thread(target=a, name="saver-a"), threading.Thread(target=b, name="saver-b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
    assert "a" not in errors, errors
    assert isinstance(errors.get("b"), ValueError), errors
    assert dest.exists(), "A's save returned successfully, B's failed: A's file was deleted"
    assert dest.read_bytes() == other_bytes()


@pytest.mark.regression("0.1 hostile review 4: ctrl c while the followed copy commits does not claim the save unpublished")
def test_ctrl_c_while_the_followed_copy_commits_does_not_claim_the_save_unpublished(tmp_path, shm_root, monkeypatch, caplog):
    """Ctrl-C reaches the saving thread while the publisher thread is past its CRC check
    (fsync'ing our temp on a slow destination). follower.fail() cannot stop it any more: the
    destination is replaced with the new file, yet the save reports 'interrupted while
    publishing; the complete staged copy is kept' and leaves that copy in the staging root
    (which no sweep removes). Old-and-kept or new-and-clean: never new-and-kept."""
    dest = tmp_path / "model.safetensors"
    dest.write_bytes(b"previous")
    real_fsync = os.fsync
    main = threading.main_thread().ident

    def slow_fsync(fd: int) -> None:
        if threading.current_thread().name == "safestage-follow":
            signal.pthread_kill(main, signal.SIGINT)  # Ctrl-C while the commit is under way
            time.sleep(0.3)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    with safestage._api.force_follow(safestage.staged(shm_root)) as stage:
        with pytest.raises(KeyboardInterrupt) as info:
            save_with(stage, slow_writer(delay=0.005), dest)
    kept = [p for p in shm_root.rglob("*") if p.is_file()]
    published = dest.read_bytes() == expected_bytes()
    notes = getattr(info.value, "__notes__", [])
    assert not (published and kept), (
        f"{dest} holds the new bytes, but the interrupt says {notes} and leaves {kept}"
    )
    assert not (published and any("kept" in n for n in notes)), notes


@pytest.mark.regression("0.1 hostile review 4: ctrl c right after the writer returned does not leak the follow thread")
def test_ctrl_c_right_after_the_writer_returned_does_not_leak_the_follow_thread(tmp_path, shm_root, monkeypatch):
    """Ctrl-C arrives after the writer returned but before write_following tells the follower
    so (between `write()` and `follower.finish()`: simulated at the LocalCopy record). The
    publisher thread is never told, never joined: it polls forever, holds its reader and
    (direct) the half-written destination open and the per-file direct lock, so the next
    save of that file hangs."""
    dest = tmp_path / "model.safetensors"
    real_staged_file = _stage.LocalCopy
    fired: list[bool] = []

    def interrupted(*args, **kwargs):
        if not fired:
            fired.append(True)
            raise KeyboardInterrupt
        return real_staged_file(*args, **kwargs)

    before = threading.active_count()
    with safestage._api.force_follow(safestage.staged(shm_root, publish="direct")) as stage:
        monkeypatch.setattr(_stage, "LocalCopy", interrupted)
        with pytest.raises(KeyboardInterrupt):
            save_with(stage, slow_writer(delay=0.005), dest)
        monkeypatch.setattr(_stage, "LocalCopy", real_staged_file)
        time.sleep(0.2)
        leaked = [t.name for t in threading.enumerate() if t.name == "safestage-follow"]
        second: list[BaseException] = []

        def again() -> None:
            try:
                save_with(stage, fast_writer(other_bytes()), dest)
            except BaseException as exc:  # noqa: BLE001
                second.append(exc)

        t = threading.Thread(target=again, daemon=True)
        t.start()
        t.join(5)
        hung = t.is_alive()
    assert not hung, (
        f"the next save of the same file hangs (the leaked follower {leaked} holds its direct lock)"
    )
    assert not leaked, f"follow thread still running after the save raised: {leaked}"
    assert threading.active_count() <= before


@pytest.mark.regression("0.1 hostile review 4: followed save to a destination failing at close is attempted once")
@pytest.mark.parametrize("kit_dir", ["close-eio"], indirect=True)
def test_followed_save_to_a_destination_failing_at_close_is_attempted_once(kit_dir, shm_root, caplog):
    """A destination whose close() fails with EIO: the followed copy fails with a real
    destination error, and write_following treats it like a follow mismatch ('could not be
    used ... publishing the complete staged file'), so the whole file is written to the
    failing destination a second time before the error reaches the caller."""
    dest = kit_dir / "model.safetensors"
    attempts: list[str] = []
    real_open = os.open

    def counting_open(path, flags, *args, **kwargs):
        if str(path).startswith(str(kit_dir)) and "model.safetensors" in str(path) and flags & os.O_CREAT:
            attempts.append(str(path))
        return real_open(path, flags, *args, **kwargs)

    with safestage._api.force_follow(safestage.staged(shm_root)) as stage:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(os, "open", counting_open)
            with pytest.raises(safestage.PublishError) as info:
                save_with(stage, slow_writer(delay=0.002), dest)
    assert "EIO" in str(info.value) and str(dest) in str(info.value)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(attempts) == 1, f"the failing destination was written {len(attempts)} times: {attempts}; {warnings}"


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


@pytest.mark.regression("0.1 hostile review 6: a destination failing while the writer writes names the kept copy")
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
    left = sorted(p for p in stage_root.rglob("*") if p.is_file() and p.name != KEPT_RECORD)
    if error.staged_path is None:
        assert left == [], (
            f"the error says {str(error)[-60:]!r} (staged_path=None), yet the staging root keeps "
            f"{[str(p) for p in left]}"
        )
    else:
        assert left == [Path(error.staged_path)], (error.staged_path, left)
        assert same(load_file(error.staged_path), tensors)
        record = json.loads((Path(error.staged_path).parent / KEPT_RECORD).read_text())
        assert record["destination"] == str(dest), record  # what the kept copy is for
        assert "No staged copy could be kept" not in str(error)


_NO_THREADS_CHILD = r'''
import json, os, resource, sys, threading
from pathlib import Path
import encodings.ascii, zlib, logging
import torch
from safetensors.torch import save_file
import safestage
root, dest_dir, warm = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
big = {f"w{j}": torch.full((1 << 18,), float(j + 1)) for j in range(64)}  # 64 MiB
with safestage.staged(warm):  # every lazy import done before the limits (a followed save)
    save_file(big, str(dest_dir / "warm.safetensors"))
os.unlink(dest_dir / "warm.safetensors")
os.setgid(65534); os.setuid(65534)  # RLIMIT_NPROC binds only non-root users
count = len(os.listdir("/proc/self/task"))
resource.setrlimit(resource.RLIMIT_NPROC, (count, count))  # like a full pids cgroup
report = {}
try:
    threading.Thread(target=lambda: None).start()
    report["thread"] = "started"
except RuntimeError as exc:
    report["thread"] = str(exc)
for name, follow in (("plain.safetensors", False), ("default.safetensors", None)):
    try:
        with safestage._api.force_follow(safestage.staged(root), follow):
            save_file(big, str(dest_dir / name))
        report[name] = "saved"
    except BaseException as exc:
        report[name] = f"{type(exc).__name__}: {exc}"
print(json.dumps(report))
'''


@pytest.mark.slow
@pytest.mark.regression("0.1 hostile review 6: a default save works where no new thread can start")
def test_a_default_save_works_where_no_new_thread_can_start():
    """Following needs a second thread; a plain save does not. In a process that cannot
    start one (a container at its pids limit, RLIMIT_NPROC, or an atexit handler on Python
    3.12, which refuses every new thread at interpreter shutdown: "can't create new thread
    at interpreter shutdown"), a big save that worked before follow became the default now
    raises RuntimeError("can't start new thread") from publisher.start(), the checkpoint is
    not saved at all, and an empty private directory is left in the staging root. Real
    limits here: uid 65534 with RLIMIT_NPROC at its current thread count; the same save
    with follow=False in the same process succeeds. What the user loses: the checkpoint
    (often the final one, saved at exit). Expected: fall back to the plain publish."""
    tag = uuid.uuid4().hex[:8]
    # Directories uid 65534 can reach: the root on /dev/shm, the destination on the disk
    # (another device: replace, the strategy that is followed).
    root, warm, dest_dir = Path(f"/dev/shm/r6-root-{tag}"), Path(f"/dev/shm/r6-warm-{tag}"), Path(f"/tmp/r6-dest-{tag}")
    for directory in (root, warm, dest_dir):
        directory.mkdir()
        os.chmod(directory, 0o777)
    script = dest_dir.with_name(f"r6-child-{tag}.py")
    script.write_text(_NO_THREADS_CHILD)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), OMP_NUM_THREADS="1")
    try:
        run = subprocess.run(
            [sys.executable, str(script), str(root), str(dest_dir), str(warm)],
            env=env, capture_output=True, text=True, timeout=240,
        )
        report = json.loads(run.stdout.strip().splitlines()[-1]) if run.returncode == 0 else run.stderr[-2000:]
        left_in_root = os.listdir(root)
        left_in_dest = sorted(os.listdir(dest_dir))
        loaded = {name: load_file(str(dest_dir / name)) for name in left_in_dest}
    finally:
        subprocess.run(["rm", "-rf", str(root), str(warm), str(dest_dir), str(script)], check=False)
    assert isinstance(report, dict), report
    assert report["thread"] != "started", report  # the limit is real: no new thread
    assert report["plain.safetensors"] == "saved", report  # a plain save works there
    wanted = {f"w{j}": torch.full((1 << 18,), float(j + 1)) for j in range(64)}
    assert same(loaded["plain.safetensors"], wanted)
    assert report["default.safetensors"] == "saved", report
    assert left_in_dest == ["default.safetensors", "plain.safetensors"]
    assert same(loaded["default.safetensors"], wanted)
    assert left_in_root == []
