"""Shared fixtures: real destinations (disk, /dev/shm across devices, hostile FUSE mounts,
real rclone and s3fs mounts).

Nothing here skips: CI must fail loudly when FUSE, rclone, s3fs, moto or a client library is
missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

SHM = Path("/dev/shm")

pytest_plugins = ["pytester"]

# The suite's own knobs, not safestage settings: kept (for the `suite_settings` fixture) when
# the SAFESTAGE_* variables are cleared from the environment.
SUITE_VARIABLES = (
    "SAFESTAGE_CRASH_TRIALS",  # test_crash.py: SIGKILL trials per run
    "SAFESTAGE_CKPT_CRASH_TRIALS",  # test_checkpoint_crash.py: SIGKILL trials per run
)
_suite_settings: dict[str, str] = {}


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # The suite checks activation itself: a SAFESTAGE_* variable in the caller's environment
    # would switch staging on in this process (start-up hook) and in every child it starts.
    for name in [n for n in os.environ if n.startswith("SAFESTAGE")]:
        value = os.environ.pop(name)
        if name in SUITE_VARIABLES:
            _suite_settings[name] = value
    from safestage import _autoload

    if _autoload._stage is not None:
        _autoload._stage.close()


@pytest.fixture(scope="session")
def suite_settings() -> dict[str, str]:
    """The suite's own SAFESTAGE_* knobs from the caller's environment (SUITE_VARIABLES)."""
    return dict(_suite_settings)


@pytest.fixture(autouse=True)
def _umask_022() -> Iterator[None]:
    previous = os.umask(0o022)
    yield
    os.umask(previous)


@pytest.fixture
def tensors() -> dict[str, object]:
    """fp32, bf16, int8, a scalar and an empty tensor: what the core issue asks to round-trip."""
    import torch

    generator = torch.Generator().manual_seed(0)
    return {
        "weight": torch.randn(64, 33, generator=generator),
        "bias.bf16": torch.randn(257, generator=generator).to(torch.bfloat16),
        "codes.int8": torch.randint(-128, 127, (31, 7), dtype=torch.int8, generator=generator),
        "scale": torch.tensor(0.125),
        "empty": torch.zeros(0, 4),
    }


@pytest.fixture
def stage_root(tmp_path: Path) -> Path:
    """A staging root on the local disk (same device as tmp_path destinations)."""
    root = tmp_path / "stage-root"
    root.mkdir()
    return root


@pytest.fixture
def shm_root() -> Iterator[Path]:
    """A staging root on /dev/shm: a different device from the disk, so renames would be EXDEV."""
    root = SHM / f"safestage-test-{uuid.uuid4().hex[:8]}"
    root.mkdir()
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _require_fuse() -> None:
    from safestage.testing import fuse_available

    ok, reason = fuse_available()
    if not ok:
        pytest.fail(f"FUSE is required for this test and is unavailable: {reason}", pytrace=False)


@pytest.fixture(scope="session")
def kit_mounts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """One real hostile FUSE mount per kit mode, shared by the session (mounting costs ~1 s)."""
    _require_fuse()
    from contextlib import ExitStack

    from safestage.testing import MODES, hostile_mount

    base = tmp_path_factory.mktemp("kit")
    with ExitStack() as stack:
        mounts = {}
        for mode in MODES:
            mounts[mode] = stack.enter_context(
                hostile_mount(mode, base / f"mnt-{mode}", mbps=400 if mode == "slow" else None)
            )
        yield mounts


@pytest.fixture
def kit_dir(request: pytest.FixtureRequest, kit_mounts: dict[str, object]) -> Iterator[Path]:
    """A fresh directory inside the kit mount named by the test's ``mode`` parameter."""
    mode = request.param
    mount = kit_mounts[mode]
    directory = Path(mount.path) / f"t-{uuid.uuid4().hex[:10]}"  # type: ignore[attr-defined]
    directory.mkdir()
    yield directory
    shutil.rmtree(Path(mount.backing) / directory.name, ignore_errors=True)  # type: ignore[attr-defined]


def _require_real(mode: str) -> None:
    from safestage.testing import real_available

    ok, reason = real_available(mode)
    if not ok:
        pytest.fail(f"the real mount {mode!r} is required for this test and unavailable: {reason}", pytrace=False)


@pytest.fixture(scope="session")
def real_mounts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    """One real third-party mount per REAL_MODE (rclone-local, rclone-s3, s3fs), shared by the
    session; the S3 modes share one local moto server, stopped after the mounts."""
    from contextlib import ExitStack

    from safestage.testing import REAL_MODES, real_mount, stop_shared_s3_server

    for mode in REAL_MODES:
        _require_real(mode)
    base = tmp_path_factory.mktemp("real")
    with ExitStack() as stack:
        stack.callback(stop_shared_s3_server)
        yield {mode: stack.enter_context(real_mount(mode, base / f"mnt-{mode}")) for mode in REAL_MODES}


@pytest.fixture
def real_dir(request: pytest.FixtureRequest, real_mounts: dict[str, object]) -> Iterator[Path]:
    """A fresh directory inside the real mount named by the test's ``mode`` parameter."""
    mount = real_mounts[request.param]
    directory = Path(mount.path) / f"t-{uuid.uuid4().hex[:10]}"  # type: ignore[attr-defined]
    directory.mkdir()
    yield directory
    shutil.rmtree(directory, ignore_errors=True)  # through the mount: S3 modes have no backing dir


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 2 MiB tmpfs: writes past that fail with a real ENOSPC."""
    target = tmp_path / "tiny"
    target.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0755", "tmpfs", str(target)], check=True)
    yield target
    subprocess.run(["umount", "-l", str(target)], check=False)
