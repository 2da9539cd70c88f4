"""The demo behind ``safestage demo``: one real save per hostile destination, first with the
plain safetensors writer, then through safestage. Returns rows; the CLI prints them.

Destinations: the kit's hostile FUSE modes, the real rclone and s3fs tools mounting a bucket
of a local S3 server (moto on 127.0.0.1), and the local disk.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

# The one change between the two columns, printed under the table (and what run_demo does).
THE_DIFFERENCE = (
    "with safestage.staged():",
    "    save_file(tensors, path)",
)
DEMO_MODES = ("hdfs", "eopnotsupp", "objectstore", "mountpoint", "close-eio")
DEMO_REAL_MODES = ("rclone-s3", "s3fs")
# rclone uploads a file that was never written to at the kernel's FUSE RELEASE, after close()
# returned: the empty temp file a failed plain save deleted shows up again a moment later.
_SETTLE_S = 0.5


@dataclass(frozen=True)
class DemoRow:
    destination: str
    plain: str  # what safetensors alone did
    staged: str  # what the same save through safestage did
    plain_ok: bool
    staged_ok: bool
    staged_loud: bool = False  # the staged save raised PublishError instead of losing data
    missing: Optional[str] = None  # not shown: what this machine lacks for it, and how to install it

    @property
    def verdict(self) -> str:
        if self.missing is not None:
            return "not shown"
        if self.staged_ok:
            return "fixed" if not self.plain_ok or "0o600" in self.plain else "fine"
        return "made loud" if self.staged_loud else "BROKEN"


def _tensors() -> dict[str, Any]:
    import torch

    generator = torch.Generator().manual_seed(7)
    return {
        "embed.weight": torch.randn(512, 256, generator=generator),
        "norm.weight": torch.ones(256, dtype=torch.bfloat16),
        "step": torch.tensor(1000),
    }


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0].replace("Error while serializing: I/O error: ", "")
    return f"{type(exc).__name__}: {text[:110]}"


def _leftovers(directory: Path, keep: str) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name != keep)


def _outcome(directory: Path, name: str, tensors: dict[str, Any]) -> tuple[bool, str]:
    """Whether ``name`` loads back equal, and a description with mode and leftovers."""
    import torch
    from safetensors.torch import load_file

    path = directory / name
    extra = _leftovers(directory, name)
    tail = f", left {', '.join(extra)}" if extra else ""
    if not path.exists():
        return False, f"file missing{tail}"
    try:
        back = load_file(str(path))
    except Exception as exc:
        return False, f"unloadable ({_short(exc)}){tail}"
    equal = all(torch.equal(back[key], value) for key, value in tensors.items())
    mode = oct(stat.S_IMODE(os.stat(path).st_mode))
    return equal, f"{'loads back equal' if equal else 'WRONG DATA'}, mode {mode}{tail}"


def _not_shown(destination: str, reason: str) -> DemoRow:
    return DemoRow(destination, "", "", False, False, missing=reason)


def run_demo(
    *, root: Optional[Path] = None, progress: Optional[Callable[[str], None]] = None
) -> list[DemoRow]:
    """Mount each hostile mode, save plainly, then through safestage; report both. A
    destination this machine cannot mount (no FUSE; rclone, s3fs or moto missing) is a row
    that says what to install, and the others are still shown."""
    from safetensors.torch import save_file

    import safestage
    from safestage.testing import (
        S3Server,
        fuse_available,
        hostile_mount,
        real_available,
        real_mount,
    )

    tensors = _tensors()
    rows: list[DemoRow] = []
    with ExitStack() as stack:
        base = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="safestage-demo-")))
        staging_root = root or base / "staging"
        staging_root.mkdir(exist_ok=True)
        destinations: list[tuple[str, Path, bool]] = []
        fuse_ok, fuse_reason = fuse_available()
        for mode in DEMO_MODES:
            if not fuse_ok:
                rows.append(_not_shown(f"{mode} (FUSE)", fuse_reason))
                continue
            if progress:
                progress(f"mounting a real '{mode}' FUSE filesystem")
            mount = stack.enter_context(hostile_mount(mode, base / f"mnt-{mode}"))
            destinations.append((f"{mode} (FUSE)", Path(mount.path), False))
        available = {mode: real_available(mode) for mode in DEMO_REAL_MODES}
        server = None
        for mode in DEMO_REAL_MODES:
            ok, reason = available[mode]
            if not ok:
                rows.append(_not_shown(f"{mode} (real)", reason))
                continue
            if server is None:
                if progress:
                    progress("starting a local S3 server (moto, 127.0.0.1)")
                server = S3Server().start()
                stack.callback(server.stop)  # after the mounts on it (the stack unwinds in reverse)
            if progress:
                progress(f"mounting a bucket with the real {mode.split('-')[0]}")
            real = stack.enter_context(real_mount(mode, base / f"mnt-{mode}", server=server))
            destinations.append((f"{mode} (real)", real.path, True))
        local = base / "disk"
        local.mkdir()
        destinations.append(("local disk", local, False))
        for label, mount_path, settle in destinations:
            plain_dir, staged_dir = mount_path / "plain", mount_path / "staged"
            plain_dir.mkdir()
            staged_dir.mkdir()
            name = "model.safetensors"
            try:
                save_file(tensors, str(plain_dir / name))
            except Exception as exc:
                if settle:
                    time.sleep(_SETTLE_S)
                extra = _leftovers(plain_dir, name)
                plain_ok = False
                plain = _short(exc) + (f"; left {', '.join(extra)}" if extra else "")
            else:
                plain_ok, described = _outcome(plain_dir, name, tensors)
                plain = f"returned success: {described}"
            loud = False
            try:
                with safestage.staged(staging_root) as stage:  # THE_DIFFERENCE
                    save_file(tensors, str(staged_dir / name))
            except safestage.PublishError as exc:
                staged_ok, loud = False, True
                staged = f"raised PublishError ({errno.errorcode.get(exc.errno or 0, exc.errno)} at {exc.step}); complete copy kept in the staging root"
            else:
                staged_ok, described = _outcome(staged_dir, name, tensors)
                staged = f"{stage.records[0].publish}: {described}"
            rows.append(DemoRow(label, plain, staged, plain_ok, staged_ok, loud))
    return rows
