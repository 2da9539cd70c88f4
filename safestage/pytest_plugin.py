"""pytest plugin (entry point ``pytest11``): fixtures only, nothing autouse, no torch import.

Fixtures
    safestage_stage           staging on for one test, per-test staging root; yields the Stage
                              (its ``records`` show which files went through staging) and checks
                              at teardown that the original serialize_file is back.
    safestage_hostile_dir     factory: ``safestage_hostile_dir("hdfs")`` -> a fresh directory on
                              a real hostile FUSE mount of that mode (session-wide mounts).
    safestage_hdfs_dir, safestage_eopnotsupp_dir, safestage_objectstore_dir,
    safestage_mountpoint_dir, safestage_close_eio_dir, safestage_slow_dir
                              the same, one mode each.
    The hostile fixtures skip, with the reason, where FUSE is unavailable.
    safestage_real_mount      factory: ``safestage_real_mount("rclone-s3")`` -> a fresh directory
                              on a real third-party mount of that mode (rclone-local, rclone-s3,
                              s3fs; session-wide mounts, one local S3 server). A missing rclone,
                              s3fs or moto is an error naming what to install, not a skip: a
                              test that asks for a real tool wants it.

Options
    --safestage / ini ``safestage = true``: staging on for the whole session, for suites that
    save deep inside code they don't own. ``--safestage-dir`` / ini ``safestage_dir`` set the
    staging root (default: SAFESTAGE_DIR, else $TMPDIR/safestage-<uid>).
    Precedence: command-line option > ini setting > environment > default.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from . import _patch
from ._api import Stage, staged

_SESSION_STAGE = pytest.StashKey[Optional[Stage]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("safestage", "stage safetensors saves (safestage)")
    group.addoption(
        "--safestage",
        action="store_true",
        default=None,
        help="stage every safetensors save of the test session through a local staging root",
    )
    group.addoption(
        "--safestage-dir",
        default=None,
        metavar="DIR",
        help="staging root for --safestage (default: SAFESTAGE_DIR, else $TMPDIR/safestage-<uid>)",
    )
    parser.addini("safestage", "stage every safetensors save of the session", type="bool", default=False)
    parser.addini("safestage_dir", "staging root for the session-wide activation", default="")


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_SESSION_STAGE] = None
    wanted = config.getoption("safestage")
    if wanted is None:
        wanted = config.getini("safestage")
    if not wanted:
        return
    root = config.getoption("safestage_dir") or config.getini("safestage_dir") or None
    # Errors surface as a usage error naming the bad root, before any test runs.
    try:
        config.stash[_SESSION_STAGE] = staged(root)._open()
    except Exception as exc:
        raise pytest.UsageError(f"--safestage: {exc}") from exc


def pytest_unconfigure(config: pytest.Config) -> None:
    stage = config.stash.get(_SESSION_STAGE, None)
    if stage is not None:
        stage.close()


def pytest_report_header(config: pytest.Config) -> Optional[str]:
    stage = config.stash.get(_SESSION_STAGE, None)
    return f"safestage: staging session saves through {stage.staging_root}" if stage else None


@pytest.fixture
def safestage_stage(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stage]:
    """Staging on for this test, with a private staging root; yields the Stage."""
    root = tmp_path_factory.mktemp("safestage-root")
    with staged(root) as stage:
        yield stage
    if not _patch.is_active():
        leftover = _patch.installed_targets()
        assert not leftover, f"safestage left its wrapper on {leftover} after the test"


class _Mounts:
    """Session-wide hostile and real mounts, mounted on first use of each mode."""

    def __init__(self, base: Path) -> None:
        self._base = base
        self._stack = contextlib.ExitStack()
        self._mounts: dict[str, Any] = {}
        self._real: dict[str, Any] = {}

    def directory(self, mode: str) -> Path:
        from safestage.testing import MODES, fuse_available, hostile_mount

        if mode not in MODES:
            raise ValueError(f"unknown hostile mode {mode!r}: choose one of {', '.join(MODES)}")
        if mode not in self._mounts:
            ok, reason = fuse_available()
            if not ok:
                pytest.skip(f"safestage hostile mount {mode!r} needs FUSE: {reason}")
            self._mounts[mode] = self._stack.enter_context(hostile_mount(mode, self._base / mode))
        fresh = Path(self._mounts[mode].path) / f"test-{uuid.uuid4().hex[:12]}"
        fresh.mkdir()
        return fresh

    def real_directory(self, mode: str) -> Path:
        from safestage.testing import (
            REAL_MODES,
            RealMountUnavailable,
            real_available,
            real_mount,
            stop_shared_s3_server,
        )

        if mode not in REAL_MODES:
            raise ValueError(f"unknown real mode {mode!r}: choose one of {', '.join(REAL_MODES)}")
        if mode not in self._real:
            ok, reason = real_available(mode)
            if not ok:
                raise RealMountUnavailable(f"safestage real mount {mode!r} cannot be made here: {reason}")
            if mode != "rclone-local" and not any(m != "rclone-local" for m in self._real):
                # Registered before the first S3 mount, so it runs after every mount is gone.
                self._stack.callback(stop_shared_s3_server)
            self._real[mode] = self._stack.enter_context(real_mount(mode, self._base / f"real-{mode}"))
        fresh = Path(self._real[mode].path) / f"test-{uuid.uuid4().hex[:12]}"
        fresh.mkdir()
        return fresh

    def close(self) -> None:
        self._stack.close()


@pytest.fixture(scope="session")
def _safestage_mounts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_Mounts]:
    mounts = _Mounts(tmp_path_factory.mktemp("safestage-mounts"))
    yield mounts
    mounts.close()


@pytest.fixture
def safestage_hostile_dir(_safestage_mounts: _Mounts) -> Callable[[str], Path]:
    """Factory: ``safestage_hostile_dir("mountpoint")`` -> a fresh dir on that hostile mount."""
    return _safestage_mounts.directory


@pytest.fixture
def safestage_real_mount(_safestage_mounts: _Mounts) -> Callable[[str], Path]:
    """Factory: ``safestage_real_mount("rclone-s3")`` -> a fresh dir on that real mount."""
    return _safestage_mounts.real_directory


def _mode_fixture(mode: str) -> Any:
    def fixture(_safestage_mounts: _Mounts) -> Path:
        return _safestage_mounts.directory(mode)

    fixture.__doc__ = f"A fresh directory on a real {mode!r} hostile FUSE mount (safestage.testing)."
    return pytest.fixture(name=f"safestage_{mode.replace('-', '_')}_dir")(fixture)


safestage_hdfs_dir = _mode_fixture("hdfs")
safestage_eopnotsupp_dir = _mode_fixture("eopnotsupp")
safestage_objectstore_dir = _mode_fixture("objectstore")
safestage_mountpoint_dir = _mode_fixture("mountpoint")
safestage_close_eio_dir = _mode_fixture("close-eio")
safestage_slow_dir = _mode_fixture("slow")
