"""fork() during a background commit: the commit belongs to the parent. A child (a DataLoader
worker, a logger process) that inherited the handle of ``staged_dir(background=True)`` is told
so when it asks (``done()``, ``wait()``: a RuntimeError naming the parent's pid), instead of a
false answer ("done", "nothing was committed"); the parent's commit lands undisturbed.

The commit is kept in flight by the kit's slow mount, paced at 4 MB/s (4 MiB: about a
second); the child is a real os.fork() of this process."""

from __future__ import annotations

import json
import os
import select
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import safestage
from safestage.testing import hostile_mount

MBPS = 4.0


@pytest.fixture(scope="module")
def paced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The kit's slow mode at MBPS: a 4 MiB commit stays in flight long enough to fork in."""
    with hostile_mount("slow", tmp_path_factory.mktemp("fork-paced") / "slow", mbps=MBPS) as mount:
        yield Path(mount.path)


def ask_in_child(handle: safestage.StagedDir, timeout: float = 30.0) -> dict[str, str]:
    """Fork; in the child, call ``handle.done()`` and ``handle.wait()`` and report what each
    returned or raised ("returned: ..." or "<type>: <message>"); return that report. A child
    still asking after ``timeout`` seconds is killed and reported as hung."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nothing of pytest's may run here; always os._exit
        report: dict[str, str] = {}
        try:
            os.close(read_end)
            for name in ("done", "wait"):
                try:
                    report[name] = f"returned: {getattr(handle, name)()!r}"
                except BaseException as exc:  # reported to the parent
                    report[name] = f"{type(exc).__name__}: {exc}"
        finally:
            try:
                os.write(write_end, json.dumps(report).encode())
            finally:
                os._exit(0)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], timeout)
        data = b""
        if ready:
            while chunk := os.read(read_end, 65536):
                data += chunk
    finally:
        os.close(read_end)
        if not data:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return json.loads(data) if data else {"done": "hung", "wait": "hung"}


@pytest.mark.mounts
@pytest.mark.regression("issue 24: in a child forked during a background commit, done() said True and wait() "
                        "said 'the block raised, so nothing was committed'; the parent's commit landed")
def test_a_forked_child_is_told_that_an_inherited_background_commit_is_its_parents(paced: Path, tmp_path: Path) -> None:
    run = paced / f"run-{uuid.uuid4().hex[:8]}"
    run.mkdir()
    dest = run / "checkpoint-4"
    data = bytes(range(256)) * (16 << 10)  # 4 MiB: ~1 s at 4 MB/s
    handle = safestage.staged_dir(dest, tmp_path, background=True)
    with handle as local:
        (local / "shard.bin").write_bytes(data)
        (local / "state.json").write_text('{"step": 4}')
    assert not handle.done(), "the commit landed before the fork: the test proved nothing"

    child = ask_in_child(handle)

    assert not handle.done(), "the commit landed before the child had asked: the test proved nothing"
    manifest = handle.wait()
    assert sorted(entry.path for entry in manifest.files) == ["shard.bin", "state.json"]
    assert safestage.verify(dest, deep=True).complete and safestage.latest_complete(run) == dest
    assert (dest / "shard.bin").read_bytes() == data
    parent = str(os.getpid())
    for name in ("done", "wait"):
        assert child[name].startswith("RuntimeError: "), (name, child)
        assert parent in child[name], (name, child)
