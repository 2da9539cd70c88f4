"""A second hostile review, of the new features (staged_dir and the commit file, verify /
latest_complete, torch.save staging, safestage.lightning): one failing test per defect.

Every test runs on real filesystems (disk, /dev/shm, a real tmpfs, the kit's FUSE mounts)
and real processes; no mocks. Each asserts what a user checks: the bytes that load back,
the listing, the error's errno and path, what verify / latest_complete answer.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import safestage
from safestage import COMMIT_NAME, PublishError

PY = sys.executable
SHM = Path("/dev/shm")
HERE = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    env["PYTHONPATH"] = str(HERE)
    env["HF_HUB_OFFLINE"] = "1"
    return env


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    directory = SHM / f"safestage-review2-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def _commit_one(dest: Path, root: Path, data: bytes = b"weights") -> None:
    with safestage.staged_dir(dest, root) as local:
        (local / "model.bin").write_bytes(data)


# -- 1. verify / latest_complete hang on a FIFO named like the commit file ----------------------


def test_verify_and_latest_do_not_hang_on_a_fifo_commit_file(tmp_path: Path) -> None:
    """read_commit opens _SAFESTAGE_COMMIT.json with O_RDONLY and no O_NONBLOCK: a FIFO of
    that name (a hostile or broken directory) blocks open() forever. verify "never raises for
    what it finds" and should say bad-commit; `safestage latest` must not hang a resume script."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint-7").mkdir()
    os.mkfifo(run / "checkpoint-7" / COMMIT_NAME)
    code = (
        "import sys, safestage\n"
        "r = safestage.verify(sys.argv[1] + '/checkpoint-7')\n"
        "print(r.complete, [p.kind for p in r.problems])\n"
        "print(safestage.latest_complete(sys.argv[1]))\n"
    )
    try:
        done = subprocess.run(
            [PY, "-c", code, str(run)], env=_env(), capture_output=True, text=True, timeout=10
        )
    except subprocess.TimeoutExpired:
        pytest.fail("safestage.verify() hung opening a FIFO named _SAFESTAGE_COMMIT.json")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["False ['bad-commit']", "None"]


# -- 2. a deeply nested commit file crashes verify and latest_complete --------------------------


def test_a_deeply_nested_commit_file_is_bad_commit_not_recursion_error(tmp_path: Path, stage_root: Path) -> None:
    """parse() catches ValueError only; json.loads of 200 kB of '[' raises RecursionError,
    which escapes verify (documented: never raises for what it finds) and latest_complete,
    so one garbage commit file in a run directory hides every complete checkpoint."""
    run = tmp_path / "run"
    run.mkdir()
    _commit_one(run / "checkpoint-1", stage_root)
    (run / "checkpoint-2").mkdir()
    (run / "checkpoint-2" / COMMIT_NAME).write_bytes(b"[" * 200_000)
    result = safestage.verify(run / "checkpoint-2")
    assert not result.complete
    assert [p.kind for p in result.problems] == ["bad-commit"]
    assert safestage.latest_complete(run) == run / "checkpoint-1"
    cli = subprocess.run(
        [PY, "-m", "safestage", "latest", str(run)], env=_env(), capture_output=True, text=True, timeout=60
    )
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.strip() == str(run / "checkpoint-1")


# -- 3. unsafe "directories" entries are trusted ------------------------------------------------


def test_a_commit_file_with_unsafe_directories_is_bad_commit(tmp_path: Path, stage_root: Path) -> None:
    """docs/checkpoints.md: paths in the commit file are relative, never '..', absolute or
    empty, and "a commit file that breaks this is bad-commit as a whole". parse() checks the
    "files" paths only; "directories" may say anything and verify calls it complete."""
    dest = tmp_path / "checkpoint-1"
    _commit_one(dest, stage_root)
    document = json.loads((dest / COMMIT_NAME).read_bytes())
    document["directories"] = ["../../etc", "/abs", ""]
    (dest / COMMIT_NAME).write_text(json.dumps(document))
    result = safestage.verify(dest)
    assert not result.complete
    assert [p.kind for p in result.problems] == ["bad-commit"]


# -- 4. a full staging root while the commit file is staged: bare OSError ----------------------


@pytest.fixture
def tiny_root(tmp_path: Path) -> Iterator[Path]:
    target = tmp_path / "tiny-root"
    target.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0755", "tmpfs", str(target)], check=True)
    yield target
    subprocess.run(["umount", "-l", str(target)], check=False)


def test_a_full_staging_root_when_the_commit_file_is_written_names_the_checkpoint(
    tmp_path: Path, tiny_root: Path
) -> None:
    """_publish_commit_file writes the staged commit file (os.open/os.write) outside its
    try: a staging root that filled up raises a bare OSError(ENOSPC) with no filename, not a
    PublishError naming the checkpoint, saying every file landed and where the copy is kept;
    and an empty safestage-commit.json is left in the private directory."""
    dest = tmp_path / "checkpoint-1"
    with pytest.raises(OSError) as caught:
        with safestage.staged_dir(dest, tiny_root) as local:
            fd = os.open(local / "fill.bin", os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                while True:
                    os.write(fd, b"x" * 4096)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
            finally:
                os.close(fd)
    error = caught.value
    assert error.errno == errno.ENOSPC
    assert isinstance(error, PublishError), repr(error)
    assert error.filename and str(dest) in str(error.filename), error.filename
    assert error.staged_path is not None and Path(error.staged_path).is_dir()
    assert error.landed == ("fill.bin",)
    assert not safestage.verify(dest).complete


# -- 5. Lightning: load right after a background save loads the previous checkpoint ------------


def test_lightning_background_save_then_load_loads_the_new_checkpoint(
    kit_mounts: dict[str, Any], stage_root: Path
) -> None:
    """StagedCheckpointIO(background=True).load_checkpoint does not wait for the pending
    publish of that path (remove_checkpoint does): fabric.save(p, v2); fabric.load(p) returns
    v1 (or FileNotFoundError for a first save). Plain Lightning would load v2."""
    from safestage.lightning import StagedCheckpointIO

    directory = Path(kit_mounts["slow"].path) / f"t-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    plugin = StagedCheckpointIO(stage_root, background=True)
    path = str(directory / "last.ckpt")
    plugin.save_checkpoint({"v": torch.full((4_000_000,), 1.0)}, path)
    safestage.wait()
    plugin.save_checkpoint({"v": torch.full((4_000_000,), 2.0)}, path)
    loaded = plugin.load_checkpoint(path)
    safestage.wait()
    assert loaded["v"][0].item() == 2.0, "load_checkpoint returned the previous checkpoint"


# -- 6. Lightning background saves into a staged_dir: commit without the checkpoint -----------


def test_lightning_background_save_inside_staged_dir_is_committed_complete(
    tmp_path: Path, stage_root: Path, shm_dir: Path
) -> None:
    """save_one / save_one_background ignore staged_dir's unstaged local directory (the
    torch.save and serialize_file wrappers honour it). With background=True the publish into
    `local` is still in flight when the block ends: the commit scans a half-written
    .model.ckpt.safestage-*.tmp, commits it, leaves model.ckpt out, and removes `local`;
    latest_complete names a checkpoint that has no model.ckpt."""
    from safestage.lightning import StagedCheckpointIO

    plugin = StagedCheckpointIO(stage_root, background=True)
    run = tmp_path / "run"
    run.mkdir()
    dest = run / "checkpoint-1"
    state = {"v": torch.arange(8_000_000, dtype=torch.float32)}
    with safestage.staged_dir(dest, shm_dir) as local:
        plugin.save_checkpoint(state, str(local / "model.ckpt"))
    try:
        safestage.wait()
        failure = None
    except PublishError as exc:  # the publish into `local`, removed by the commit meanwhile
        failure = exc
    assert sorted(os.listdir(dest)) == [COMMIT_NAME, "model.ckpt"]
    assert safestage.latest_complete(run) == dest
    assert torch.equal(torch.load(dest / "model.ckpt")["v"], state["v"])
    assert failure is None, failure


# -- 7. torch.save to a device file replaces the device ----------------------------------------


def test_torch_save_to_a_character_device_does_not_replace_it(tmp_path: Path, shm_dir: Path) -> None:
    """torch.save(obj, "/dev/null") is a common way to measure or exercise serialization.
    With torch_save=True the wrapper stages it and publishes with `replace`, which renames a
    regular file over the device node (as root: /dev/null becomes a 1 kB regular file;
    otherwise EACCES where a plain torch.save works). Shown on a null
    device node made in tmp_path, never the real /dev/null."""
    null = tmp_path / "null"
    os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    with safestage.staged(shm_dir, torch_save=True):
        torch.save({"a": torch.ones(3)}, null)
    info = os.lstat(null)
    assert stat.S_ISCHR(info.st_mode), "the device node was replaced by a regular file"
    assert info.st_rdev == os.makedev(1, 3)


# -- 6b. the same root cause with staged_file ---------------------------------------------------


def test_lightning_background_save_into_a_staged_file_path_is_published(
    tmp_path: Path, stage_root: Path, shm_dir: Path
) -> None:
    """docs/writers.md: "any save (torch or safetensors) into the path staged_file yields ...
    is already staged". StagedCheckpointIO(background=True) stages it again and publishes
    into that path later: staged_file finds nothing written (StagingError ENOENT), and the
    checkpoint never reaches its destination."""
    from safestage.lightning import StagedCheckpointIO

    plugin = StagedCheckpointIO(stage_root, background=True)
    dest = tmp_path / "last.ckpt"
    state = {"v": torch.arange(4_000_000, dtype=torch.float32)}
    with safestage.staged_file(dest, shm_dir) as local:
        plugin.save_checkpoint(state, str(local))
    safestage.wait()
    assert torch.equal(torch.load(dest)["v"], state["v"])


# -- 8. `safestage clean` deletes the kept copy of a checkpoint named like a writer temp -------


def test_clean_keeps_an_unpublished_checkpoint_named_like_a_writer_temp(
    kit_mounts: dict[str, Any], stage_root: Path
) -> None:
    """_local_name guards "", the disposable marker and the staged commit name, but not
    safetensors' temp pattern (.tmpXXXXXX), which local_name guards for single files. A
    checkpoint directory called `.tmpAbC123` whose publish failed is kept in the staging root
    (the only copy of its files); once its process is gone, `safestage clean` reads the
    private directory as "only a torn writer temp" and deletes it."""
    dest = Path(kit_mounts["close-eio"].path) / f"c-{uuid.uuid4().hex[:8]}"
    dest.mkdir()
    code = (
        "import sys, safestage\n"
        "from pathlib import Path\n"
        "try:\n"
        "    with safestage.staged_dir(sys.argv[1], sys.argv[2]) as local:\n"
        "        (local / 'model.bin').write_bytes(b'only copy' * 1000)\n"
        "except safestage.PublishError as exc:\n"
        "    print(exc.staged_path)\n"
    )
    child = subprocess.run(
        [PY, "-c", code, str(dest / ".tmpAbC123"), str(stage_root)],
        env=_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr
    kept = Path(child.stdout.strip())
    assert (kept / "model.bin").read_bytes() == b"only copy" * 1000
    clean = subprocess.run(
        [PY, "-m", "safestage", "clean", str(stage_root)], env=_env(), capture_output=True, text=True, timeout=60
    )
    assert clean.returncode == 0, clean.stderr
    assert (kept / "model.bin").read_bytes() == b"only copy" * 1000, clean.stdout
