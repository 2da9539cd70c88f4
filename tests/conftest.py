"""Shared fixtures: real destinations (disk, /dev/shm across devices, hostile FUSE mounts,
real rclone and s3fs mounts).

Nothing here skips: CI must fail loudly when FUSE, rclone, s3fs, moto or a client library is
missing.
"""

from __future__ import annotations

import inspect
import os
import re
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _support
import pytest
import torch
from _support import SMALL
from safetensors.torch import save_file

import safestage
from safestage import _patch
from safestage.testing import hostile_mount
from safestage.testing._stores import STORE_KINDS

SHM = Path("/dev/shm")

pytest_plugins = ["pytester"]

# The suite's own knobs, not safestage settings: kept (for the `suite_settings` fixture) when
# the SAFESTAGE_* variables are cleared from the environment.
SUITE_VARIABLES = (
    "SAFESTAGE_CRASH_TRIALS",  # test_crash_trials.py: SIGKILL trials per run
    "SAFESTAGE_CKPT_CRASH_TRIALS",  # test_checkpoint_crash_trials.py: SIGKILL trials per run
    "SAFESTAGE_DIST_KILL_TRIALS",  # test_group_commit_kills.py: jobs, one rank SIGKILLed in each
    "SAFESTAGE_DIST_KILL_SEED",  # test_group_commit_kills.py: the seed of the kills
    "SAFESTAGE_LONG",  # 1: the long tier, every point of the expensive matrices (_support.long_tier)
    "SAFESTAGE_DCP_KILL_TRIALS",  # test_dcp_kills.py: jobs, one rank SIGKILLed in each DCP save
    "SAFESTAGE_DCP_KILL_SEED",  # test_dcp_kills.py: the seed of the kills
    "SAFESTAGE_SNAPSHOT_EXAMPLES",  # test_background_saves_match_sync.py: Hypothesis examples per test
    "SAFESTAGE_WING_EXAMPLES",  # test_checkpoint_wing_model.py: examples of the state machine
    "SAFESTAGE_WING_URL_EXAMPLES",  # test_checkpoint_wing_model.py: examples of it on a run URL
    "SAFESTAGE_STORE_PRUNE_EXAMPLES",  # test_object_store_checkpoints.py: Hypothesis examples of prune on a URL
)
_suite_settings = _support.SUITE_SETTINGS


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
    try:
        _support.long_tier()
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_report_header(config: pytest.Config) -> str:
    if _support.long_tier():
        return "suite tier: long (SAFESTAGE_LONG=1): every point of the expensive matrices"
    return ("suite tier: CI: the expensive matrices at their endpoints; SAFESTAGE_LONG=1 runs every "
            "point (CONTRIBUTING.md, Running tests)")


@pytest.fixture(scope="session")
def suite_settings() -> dict[str, str]:
    """The suite's own SAFESTAGE_* knobs from the caller's environment (SUITE_VARIABLES)."""
    return dict(_suite_settings)


@pytest.fixture(scope="session")
def safestage_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This tree built as a wheel, once per session: the packaging, start-up hook and
    safetensors-release tests all install the same one (a build takes ~10 s)."""
    out = tmp_path_factory.mktemp("wheel")
    project = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SAFESTAGE", "PYTHON"))}
    build = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "-o", str(out), str(project)],
        env=env, cwd=out, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    (wheel,) = out.glob(f"safestage-{safestage.__version__}-*.whl")
    return wheel


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


# -- object stores: a real local server per kind (safestage.testing._stores), reached through
# the store's standard environment only, as a user's job reaches a real bucket.


def point_obstore_at(monkeypatch: pytest.MonkeyPatch, bucket: Any, endpoint: str | None = None) -> None:
    """Set ``bucket``'s environment (through ``endpoint``, a FaultProxy's, when given), with
    none of the caller's other variables of that store's family, and drop the clients made
    for the previous environment."""
    from safestage import _object_store
    from safestage.testing._stores import ENV_PREFIXES

    for name in list(os.environ):
        if name.startswith(ENV_PREFIXES[bucket.server.scheme]):
            monkeypatch.delenv(name)
    for name, value in bucket.server.environment(bucket.name, endpoint=endpoint).items():
        monkeypatch.setenv(name, value)
    _object_store.after_fork_in_child()  # cached clients hold the previous endpoint


def _store_bucket(kind: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from safestage import _object_store
    from safestage.testing import new_bucket

    bucket = new_bucket(kind)
    point_obstore_at(monkeypatch, bucket)
    yield bucket
    _object_store.after_fork_in_child()
    bucket.delete()  # straight to the server, never through a test's proxy


# The kinds obstore can save to: every kind (fake-gcs through the kit's XML front,
# safestage/testing/_gcs_front.py).
SAVING_KINDS = STORE_KINDS


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """``store_bucket`` runs on every kind of local store obstore saves to, or on those a
    ``stores`` marker names (the marker's ``why=`` says why the others are left out)."""
    if "store_bucket" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("stores")
        kinds = marker.args if marker is not None else SAVING_KINDS
        if marker is not None and not set(SAVING_KINDS) <= set(kinds) and not marker.kwargs.get("why"):
            raise pytest.UsageError(f"{metafunc.definition.nodeid}: a `stores` marker that leaves a kind out says why (why=...)")
        metafunc.parametrize("store_bucket", kinds, indirect=True)


@pytest.fixture
def store_bucket(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A fresh bucket on each kind of local object store obstore saves to (moto, seaweedfs,
    Azurite, fake-gcs), the store's environment set for obstore: ``bucket.url`` is where to save."""
    yield from _store_bucket(request.param, monkeypatch)


@pytest.fixture
def store_proxy(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A FaultProxy in front of the test's ``store_bucket``'s server, obstore's environment
    pointed at the proxy."""
    from safestage.testing._fault_proxy import FaultProxy

    bucket = request.getfixturevalue("store_bucket")
    with FaultProxy(bucket.server.endpoint) as proxy:
        point_obstore_at(monkeypatch, bucket, proxy.endpoint)
        yield proxy


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 2 MiB tmpfs: writes past that fail with a real ENOSPC."""
    target = tmp_path / "tiny"
    target.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0755", "tmpfs", str(target)], check=True)
    yield target
    subprocess.run(["umount", "-l", str(target)], check=False)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "scratch"
    path.mkdir()
    return path


def originals() -> dict[str, object]:
    import safetensors
    import safetensors.numpy
    import safetensors.torch

    return {
        "safetensors": safetensors.serialize_file,
        "safetensors.torch": safetensors.torch.serialize_file,
        "safetensors.numpy": safetensors.numpy.serialize_file,
    }


@pytest.fixture
def restored() -> Iterator[None]:
    """Every test here must end with the very same serialize_file objects it started with."""
    before = originals()
    yield
    after = originals()
    assert all(after[name] is before[name] for name in before), "serialize_file not restored"
    assert not safestage.is_active() and _patch.installed_modules() == []


@pytest.fixture
def ro_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real tmpfs holding an old checkpoint, then remounted read-only (root ignores mode bits,
    so chmod 0555 would prove nothing)."""
    target = tmp_path / "ro"
    target.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m,mode=0755", "tmpfs", str(target)], check=True
    )
    try:
        save_file(SMALL, str(target / "model.safetensors"))
        subprocess.run(["mount", "-o", "remount,ro", str(target)], check=True)
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)


@pytest.fixture
def mount_dir(kit_mounts: dict[str, Any]) -> Iterator[Any]:
    """mount_dir("slow") -> a fresh directory on that kit mount (and its backing twin)."""
    made: list[tuple[Path, Path]] = []

    def make(mode: str) -> tuple[Path, Path]:
        mount = kit_mounts[mode]
        name = f"h-{uuid.uuid4().hex[:10]}"
        directory = Path(mount.path) / name
        directory.mkdir()
        made.append((directory, Path(mount.backing) / name))
        return directory, Path(mount.backing) / name

    yield make
    for _, backing in made:
        shutil.rmtree(backing, ignore_errors=True)


@pytest.fixture
def two_tensors() -> dict[str, torch.Tensor]:
    return {
        "w": torch.arange(1000, dtype=torch.float32),
        "b": torch.tensor([1, 2, 3], dtype=torch.int8),
    }


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    directory = SHM / f"safestage-review2-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def eio_mount() -> Iterator[Any]:
    with hostile_mount("close-eio") as mount:
        yield mount


# -- the fast tier: markers from fixtures, and no FUSE without `mounts`
# Fixtures that mount FUSE (the kit's hostile mounts, the real rclone/s3fs mounts, the plugin's),
# and any other fixture whose code mounts or asks for one of them by name.
MOUNT_FIXTURES = frozenset({"kit_mounts", "kit_dir", "real_mounts", "real_dir", "_safestage_mounts"})
_MOUNTING_CODE = re.compile(
    r"\b(hostile_mount|real_mount|HostileMount|RealMount)\(|getfixturevalue\(\s*.(kit_mounts|real_mounts|kit_dir|real_dir)"
)
_running: list[pytest.Item] = []


def _fixture_mounts(fixturedef: Any) -> bool:
    if fixturedef.argname in MOUNT_FIXTURES:
        return True
    try:
        return bool(_MOUNTING_CODE.search(inspect.getsource(fixturedef.func)))
    except (OSError, TypeError):
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    verdicts: dict[int, bool] = {}
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = [d for name in getattr(item, "fixturenames", ()) for d in (info.name2fixturedefs.get(name, ()) if info else ())]
        if MOUNT_FIXTURES.intersection(getattr(item, "fixturenames", ())) or any(
            verdicts.setdefault(id(d), _fixture_mounts(d)) for d in defs
        ):
            item.add_marker(pytest.mark.mounts)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _running.append(item)
    try:
        yield
    finally:
        _running.pop()


def pytest_sessionstart(session: pytest.Session) -> None:
    """The fast tier (-m "not mounts") needs no FUSE: a test without the `mounts` marker that
    mounts anyway fails, in every tier, so the marker stays true."""
    import functools

    from safestage.testing import _mount, _real

    for cls in (_mount.HostileMount, _real.RealMount):
        if getattr(cls.start, "_suite_guard", False):
            continue
        start = cls.start  # what hostile_mount(), real_mount() and `with HostileMount(...)` call

        @functools.wraps(start)
        def guarded(self: Any, *args: Any, _start: Any = start, **kwargs: Any) -> Any:
            item = _running[-1] if _running else None
            if item is not None and item.get_closest_marker("mounts") is None:
                pytest.fail(f"{item.nodeid}: this test mounts FUSE: mark it `mounts`", pytrace=False)
            return _start(self, *args, **kwargs)

        guarded._suite_guard = True  # type: ignore[attr-defined]
        cls.start = guarded  # type: ignore[method-assign]
