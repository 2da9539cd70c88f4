"""`safestage verify --deep` shows progress on a terminal (tqdm on stderr) and stays quiet in
a pipe: a script capturing its output gets only the verdict."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def env() -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), base.get("PYTHONPATH")]))
    return base


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    import safestage

    dest = tmp_path / "run" / "checkpoint-1"
    dest.parent.mkdir()
    root = tmp_path / "root"
    root.mkdir()
    with safestage.staged_dir(dest, root) as local:
        for shard in range(2):
            save_file({"w": torch.ones(4 << 20)}, local / f"model-{shard}.safetensors")  # 16 MiB each
    return dest


def read_all(fd: int, process: subprocess.Popen[bytes]) -> str:
    chunks = []
    while True:
        ready, _, _ = select.select([fd], [], [], 60)
        if not ready:
            break
        try:
            data = os.read(fd, 65536)
        except OSError:  # EIO: the child closed its side of the terminal
            break
        if not data:
            break
        chunks.append(data)
    process.wait(timeout=60)
    return b"".join(chunks).decode(errors="replace")


def test_verify_deep_shows_progress_on_a_terminal(checkpoint):
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a real size
    process = subprocess.Popen(
        [sys.executable, "-m", "safestage", "verify", "--deep", str(checkpoint)],
        stdin=subprocess.DEVNULL, stdout=follower, stderr=follower, env=env(),
    )  # fmt: skip
    os.close(follower)
    try:
        screen = read_all(leader, process)
    finally:
        os.close(leader)
    assert process.returncode == 0, screen
    assert "reading:" in screen and "/32.0M" in screen and "B/s" in screen, screen
    assert "complete: 2 files" in screen


def test_verify_deep_in_a_pipe_prints_only_the_verdict(checkpoint):
    result = subprocess.run(
        [sys.executable, "-m", "safestage", "verify", "--deep", str(checkpoint)],
        capture_output=True, text=True, env=env(), timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    assert result.stdout.count("\n") == 1 and "complete: 2 files" in result.stdout
