"""Security: private staging, no symlink games in shared directories, modes no wider than asked.

- Each save's staging directory is 0700 (observed mid-save), whatever the umask.
- A world-writable (1777) staging root full of planted symlinks named like staging
  directories: a save neither follows one nor writes outside the root; `safestage clean`
  leaves them alone.
- The default root ($TMPDIR/safestage-<uid>) under a world-writable parent: a planted symlink,
  a directory of another uid or a plain file in its place is refused with StagingError.
- A new published file gets exactly 0o666 & ~umask (safetensors 0.8 alone gives 0600 whatever
  the umask, safetensors#782); an existing file keeps its mode; the temp beside a 0600
  destination is never wider than 0600, even for a moment.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import wrapt
from _support import changed, loads_equal, mode_of
from safetensors.torch import save_file

import safestage
from safestage import StagingError
from safestage._names import _HOST, parse_stage_dir

NOBODY = 65534


def tensors(tag: int = 0, numel: int = 4096) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(numel, dtype=torch.float32) + tag}


@contextlib.contextmanager
def observe_staged_path(seen: list[tuple[Path, int, int, int]]) -> Iterator[None]:
    """A wrapper *under* safestage's (installed before activation): it sees the staged path
    the real writer is asked to fill and records the private directory's mode and owner."""
    import safetensors.torch as st

    original = st.serialize_file

    def hook(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        staged = Path(args[1] if len(args) > 1 else kwargs["filename"])
        info = os.lstat(staged.parent)
        seen.append(
            (staged, stat.S_IMODE(info.st_mode), info.st_uid, int(stat.S_ISDIR(info.st_mode)))
        )
        return wrapped(*args, **kwargs)

    st.serialize_file = wrapt.FunctionWrapper(original, hook)
    try:
        yield
    finally:
        st.serialize_file = original


# -- private staging directories ----------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_staging_directory_is_0700_mid_save(tmp_path, umask):
    root = tmp_path / "scratch"
    root.mkdir(mode=0o777)
    os.chmod(root, 0o1777)  # a shared scratch directory
    os.umask(umask)
    seen: list[tuple[Path, int, int, int]] = []
    with observe_staged_path(seen), safestage.staged(root):
        save_file(tensors(), str(tmp_path / "model.safetensors"))
    ((staged, mode, uid, is_dir),) = seen
    assert staged.parent.parent == root and parse_stage_dir(staged.parent.name) is not None
    assert is_dir and mode == 0o700 and uid == os.getuid(), oct(mode)
    assert mode_of(root) == 0o1777, "the shared root's own mode is not ours to change"

    # Any writer, through staged_file: the same private directory, seen from inside the block.
    with safestage.staged_file(tmp_path / "other.bin", root) as local:
        assert mode_of(local.parent) == 0o700 and os.lstat(local.parent).st_uid == os.getuid()
        local.write_bytes(b"x" * 10)
    assert list(root.iterdir()) == []


# -- a world-writable staging root with planted symlinks ----------------------------------------


def test_planted_symlinks_in_a_world_writable_root_are_never_followed(tmp_path, shm_root):
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o1777)
    elsewhere = tmp_path / "victim-dir"
    elsewhere.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    # What a local attacker can plant: names of safestage's shape, for this host and pid, to a
    # directory and to a file; dangling ones too. (Real names carry 32 random bits.)
    planted = {}
    for index in range(48):
        name = f"safestage-{_HOST}-{os.getpid()}-{index:08x}"
        target = [elsewhere, victim, tmp_path / "nothing-here"][index % 3]
        (root / name).symlink_to(target)
        planted[name] = str(target)
    dests = [tmp_path / "ckpt", Path(shm_root)]  # rename (same fs as root) and replace
    (tmp_path / "ckpt").mkdir()
    with safestage.staged(root) as stage:
        for index in range(12):
            save_file(tensors(index), str(dests[index % 2] / f"m{index}.safetensors"))
    assert {r.publish for r in stage.records} == {"rename", "replace"}
    for index in range(12):
        assert loads_equal(dests[index % 2] / f"m{index}.safetensors", tensors(index))
    assert list(elsewhere.iterdir()) == [] and victim.read_text() == "precious"
    assert not (tmp_path / "nothing-here").exists(), "a dangling link was followed"
    assert {p.name: os.readlink(p) for p in root.iterdir()} == planted, (
        "the root must hold only the plants"
    )
    # `safestage clean` is no tool to delete through symlinks either.
    completed = subprocess.run(
        [sys.executable, "-m", "safestage", "clean", "--json", str(root)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert completed.returncode == 0, completed.stderr
    report = json.loads(completed.stdout)
    assert report["removed"] == 0 and {e["action"] for e in report["entries"]} == {"kept"}
    assert {p.name for p in root.iterdir()} == set(planted) and victim.read_text() == "precious"


def test_planted_symlinks_beside_the_destination_are_never_followed(tmp_path, shm_root):
    """A world-writable checkpoint folder with symlinks named like our temp files: the temp is
    created O_EXCL under a fresh random name, so none is followed or replaced."""
    folder = tmp_path / "shared-ckpt"
    folder.mkdir()
    os.chmod(folder, 0o1777)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    planted = {}
    for index in range(32):
        name = f".model.safetensors.safestage-{_HOST}-{os.getpid()}-{index:08x}.tmp"
        (folder / name).symlink_to(victim)
        planted[name] = str(victim)
    with safestage.staged(shm_root):
        for tag in range(6):
            save_file(tensors(tag), str(folder / "model.safetensors"))
    assert loads_equal(folder / "model.safetensors", tensors(5))
    assert victim.read_text() == "precious"
    links = {p.name: os.readlink(p) for p in folder.iterdir() if p.is_symlink()}
    assert links == planted
    assert sorted(p.name for p in folder.iterdir() if not p.is_symlink()) == ["model.safetensors"]


# -- the default root under a world-writable parent ---------------------------------------------


@pytest.fixture
def public_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A world-writable $TMPDIR, like /tmp, for the default staging root."""
    public = tmp_path / "public-tmp"
    public.mkdir()
    os.chmod(public, 0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(public))  # what gettempdir() answers
    for name in [k for k in os.environ if k.startswith("SAFESTAGE")]:
        monkeypatch.delenv(name)
    return public


def _plant_symlink(public: Path, tmp_path: Path) -> Path:
    own = tmp_path / "attackers-dir"
    own.mkdir(mode=0o777)
    (public / f"safestage-{os.getuid()}").symlink_to(own)
    return own


def _plant_foreign_dir(public: Path, tmp_path: Path) -> Path:
    foreign = public / f"safestage-{os.getuid()}"
    foreign.mkdir()
    os.chmod(foreign, 0o777)
    os.chown(foreign, NOBODY, NOBODY)
    return foreign


def _plant_file(public: Path, tmp_path: Path) -> Path:
    path = public / f"safestage-{os.getuid()}"
    path.write_text("not a directory")
    return path


PLANTS: dict[str, Callable[[Path, Path], Path]] = {
    "symlink": _plant_symlink,
    "other-uid-dir": _plant_foreign_dir,
    "file": _plant_file,
}


@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_planted_default_root_is_refused(public_tmp, tmp_path, plant):
    watched = PLANTS[plant](public_tmp, tmp_path)
    before = sorted(os.listdir(watched)) if watched.is_dir() else None
    dest = tmp_path / "model.safetensors"
    stage = safestage.staged()
    assert stage.staging_root == public_tmp / f"safestage-{os.getuid()}"
    with pytest.raises(StagingError) as info, stage:
        pytest.fail("a planted default root must be refused when the block starts")
    error = info.value
    assert isinstance(error, OSError) and error.errno in (errno.EPERM, errno.ENOTDIR, errno.EEXIST)
    assert error.filename == str(public_tmp / f"safestage-{os.getuid()}")
    message = str(error)
    assert str(public_tmp) in message and "SAFESTAGE_DIR" in message, message
    assert not safestage.is_active()
    assert not dest.exists()
    if before is not None:
        assert sorted(os.listdir(watched)) == before, (
            "something was written into the planted directory"
        )
    if plant == "other-uid-dir":
        assert os.lstat(watched).st_uid == NOBODY and mode_of(watched) == 0o777, "not ours to chmod"


@pytest.mark.slow
def test_planted_default_root_from_the_environment_warns_and_runs_unstaged(public_tmp, tmp_path):
    own = _plant_symlink(public_tmp, tmp_path)
    program = (
        "import torch, safestage\nfrom safetensors.torch import save_file\n"
        "save_file({'w': torch.zeros(3)}, 'out.safetensors')\nprint('active', safestage.is_active())\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    env.update(SAFESTAGE="1", TMPDIR=str(public_tmp))
    completed = subprocess.run(
        [sys.executable, "-c", program],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert completed.returncode == 0 and "Traceback" not in completed.stderr, completed.stderr
    assert completed.stdout.strip() == "active False"
    assert completed.stderr.count("safestage: WARNING") == 1 and "refuses" in completed.stderr, (
        completed.stderr
    )
    assert list(own.iterdir()) == [] and (tmp_path / "out.safetensors").exists()


def test_default_root_is_created_private_and_a_loose_one_of_ours_is_tightened(public_tmp, tmp_path):
    os.umask(0o000)
    with safestage.staged() as stage:
        save_file(tensors(), str(tmp_path / "a.safetensors"))
    root = public_tmp / f"safestage-{os.getuid()}"
    assert stage.staging_root == root and mode_of(root) == 0o700 and not root.is_symlink()
    os.chmod(root, 0o777)  # ours, but loosened (an old version, a careless chmod -R)
    with safestage.staged():
        save_file(tensors(1), str(tmp_path / "b.safetensors"))
    assert mode_of(root) == 0o700
    assert loads_equal(tmp_path / "b.safetensors", tensors(1)) and list(root.iterdir()) == []


# -- published modes ----------------------------------------------------------------------------


def _destination(
    kind: str, tmp_path: Path, shm_root: Path, kit_mounts: dict[str, Any]
) -> tuple[Path, Path, str]:
    """(destination directory, staging root, publish) for each strategy."""
    if kind == "rename":
        root = tmp_path / "root"
        root.mkdir(exist_ok=True)
        directory = tmp_path / "dest-rename"
    elif kind in ("replace", "direct"):
        root, directory = shm_root, tmp_path / f"dest-{kind}"
    else:  # a hostile mount: replace through FUSE
        root = tmp_path / "root"
        root.mkdir(exist_ok=True)
        directory = Path(kit_mounts["hdfs"].path) / f"modes-{os.urandom(4).hex()}"
    directory.mkdir(exist_ok=True)
    return directory, root, "direct" if kind == "direct" else "auto"


STRATEGIES = ["rename", "replace", "direct", "hdfs"]


@pytest.mark.parametrize("kind", STRATEGIES)
@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002, 0o027])
def test_new_file_mode_is_0666_minus_umask(tmp_path, shm_root, kit_mounts, kind, umask):
    directory, root, publish = _destination(kind, tmp_path, shm_root, kit_mounts)
    os.umask(umask)
    wanted = 0o666 & ~umask
    with safestage.staged(root, publish=publish) as stage:
        save_file(tensors(), str(directory / "model.safetensors"))
    with safestage.staged_file(directory / "extra.bin", root, publish=publish) as local:
        local.write_bytes(b"x" * 100)
    expected_strategy = {
        "rename": "rename",
        "replace": "replace",
        "direct": "direct",
        "hdfs": "replace",
    }[kind]
    assert [r.publish for r in stage.records] == [expected_strategy]
    for name in ("model.safetensors", "extra.bin"):
        mode = mode_of(directory / name)
        assert mode & ~wanted == 0, f"{name}: {oct(mode)} is wider than {oct(wanted)}"
        assert mode == wanted, f"{name}: {oct(mode)}, expected {oct(wanted)} (umask {oct(umask)})"


@pytest.mark.parametrize("kind", STRATEGIES)
@pytest.mark.parametrize("existing", [0o600, 0o640, 0o604, 0o666])
def test_an_existing_file_keeps_its_mode(tmp_path, shm_root, kit_mounts, kind, existing):
    directory, root, publish = _destination(kind, tmp_path, shm_root, kit_mounts)
    dest = directory / "model.safetensors"
    with safestage.staged(root, publish=publish):
        save_file(tensors(), str(dest))
    os.chmod(dest, existing)
    os.umask(0o077)  # a stricter umask now must not change an existing file's mode either way
    with safestage.staged(root, publish=publish):
        save_file(tensors(1), str(dest))
    assert mode_of(dest) == existing, oct(mode_of(dest))
    assert loads_equal(dest, tensors(1))


@pytest.mark.mounts
def test_the_temp_beside_a_0600_file_is_never_wider(tmp_path, shm_root):
    """A secret checkpoint (0600) replaced on a slow mount: a watcher stat()ing our temp while
    it is written sees 0600 at most, every time, under umask 022."""
    from safestage.testing import hostile_mount

    with hostile_mount("slow", None, mbps=20) as slow:
        dest = Path(slow.path) / "secret.safetensors"
        with safestage.staged(shm_root):
            save_file(tensors(0, 16), str(dest))
        os.chmod(dest, 0o600)
        modes: list[int] = []
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                for name in os.listdir(slow.path):
                    if name.startswith(".secret.safetensors.safestage-"):
                        with contextlib.suppress(FileNotFoundError):
                            modes.append(mode_of(Path(slow.path) / name))

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            with safestage.staged(shm_root):
                save_file(tensors(1, 1 << 20), str(dest))  # 4 MiB at 20 MB/s: ~0.2 s of temp
        finally:
            done.set()
            watcher.join(30)
        assert modes, "the watcher never saw the temp file"
        assert all(mode & ~0o600 == 0 for mode in modes), sorted({oct(m) for m in modes})
        assert mode_of(dest) == 0o600 and loads_equal(dest, tensors(1, 1 << 20))


def test_an_existing_destination_keeps_its_mode(tmp_path, shm_root, tensors):
    dest = tmp_path / "model.safetensors"
    save_file(tensors, str(dest))
    os.chmod(dest, 0o640)
    with safestage.staged(shm_root):
        save_file(changed(tensors), str(dest))
    assert mode_of(dest) == 0o640
    os.chmod(dest, 0o666)  # wider than the umask allows at create: still kept
    with safestage.staged(shm_root):
        save_file(tensors, str(dest))
    assert mode_of(dest) == 0o666


def test_new_file_mode_follows_umask(tmp_path, shm_root, tensors):
    os.umask(0o027)
    with safestage.staged(shm_root):
        save_file(tensors, str(tmp_path / "a.safetensors"))
    with safestage.staged(tmp_path.parent):
        save_file(tensors, str(tmp_path / "b.safetensors"))  # rename path
    assert mode_of(tmp_path / "a.safetensors") == 0o640
    assert mode_of(tmp_path / "b.safetensors") == 0o640
