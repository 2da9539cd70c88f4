"""Fourth review: defects of follow mode (follow=True / SAFESTAGE_FOLLOW=1), each a failing test."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest

import safestage
from safestage import _stage

from test_follow import CHUNK, CHUNKS, TEMP_OF_OURS, expected_bytes, pattern, save_with, slow_writer


def other_bytes() -> bytes:
    return b"".join(bytes([(i + 7) % 251 + 1]) * CHUNK for i in range(CHUNKS))


def fast_writer(data: bytes):
    def write(path: str) -> None:
        with open(path, "wb") as handle:
            handle.write(data)

    return write


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

