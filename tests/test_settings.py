"""Options and staging roots: clear errors that name the option, the path and what to do."""

from __future__ import annotations

import errno
import os
import pickle
from pathlib import Path

import pytest

import safestage
from safestage import ConfigError, PublishError, StagingError
from safestage._config import resolve


def test_argument_beats_environment_beats_default(tmp_path):
    env = {"SAFESTAGE_DIR": str(tmp_path), "SAFESTAGE_PUBLISH": "direct", "SAFESTAGE_FSYNC": "0"}
    from_env = resolve(environ=env)
    assert (from_env.root, from_env.publish, from_env.fsync) == (tmp_path, "direct", False)
    explicit = resolve(root=tmp_path / "x", publish="replace", fsync=True, environ=env)
    assert (explicit.root, explicit.publish, explicit.fsync) == (tmp_path / "x", "replace", True)
    default = resolve(environ={"SAFESTAGE_DIR": "  ", "SAFESTAGE_PUBLISH": ""})
    assert (default.root, default.publish, default.fsync) == (None, "auto", True)


@pytest.mark.parametrize(
    ("kwargs", "env", "needle"),
    [
        ({"publish": "bogus"}, {}, "the publish argument"),
        ({}, {"SAFESTAGE_PUBLISH": "bogus"}, "SAFESTAGE_PUBLISH"),
        ({}, {"SAFESTAGE_FSYNC": "maybe"}, "SAFESTAGE_FSYNC"),
        ({"fsync": "yes"}, {}, "the fsync argument"),
        ({"root": 42}, {}, "the root argument"),
    ],
)
def test_bad_options_name_their_source(kwargs, env, needle):
    with pytest.raises(ConfigError, match=needle) as info:
        resolve(environ=env, **kwargs)
    assert isinstance(info.value, ValueError)


def test_staged_rejects_bad_option_before_anything_happens():
    with pytest.raises(ConfigError, match="auto, replace, direct"):
        safestage.staged(publish="sideways")
    assert not safestage.is_active()


def test_missing_root(tmp_path):
    with pytest.raises(StagingError) as info, safestage.staged(tmp_path / "nope"):
        pass
    assert info.value.errno == errno.ENOENT and str(tmp_path / "nope") in str(info.value)
    assert "mkdir" in str(info.value)
    assert not safestage.is_active()


def test_root_that_is_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(StagingError) as info, safestage.staged(tmp_path / "file"):
        pass
    assert info.value.errno == errno.ENOTDIR


def test_read_only_root(tmp_path):
    import subprocess

    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], check=True)
    try:
        with pytest.raises(StagingError) as info, safestage.staged(ro):
            pass
        assert info.value.errno == errno.EROFS
        assert "read-only" in str(info.value)
    finally:
        subprocess.run(["umount", "-l", str(ro)], check=False)


def test_root_on_a_fuse_mount_is_refused(kit_mounts):
    root = Path(kit_mounts["passthrough"].path)
    with pytest.raises(StagingError, match="local POSIX filesystem") as info, safestage.staged(root):
        pass
    assert "fuse" in str(info.value)


def test_default_root_is_private_and_checked(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.delenv("SAFESTAGE_DIR", raising=False)
    with safestage.staged() as stage:
        pass
    root = tmp_path / f"safestage-{os.getuid()}"
    assert stage.staging_root == root
    assert root.is_dir() and (root.stat().st_mode & 0o777) == 0o700


def test_planted_default_root_symlink_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.delenv("SAFESTAGE_DIR", raising=False)
    elsewhere = tmp_path / "attacker"
    elsewhere.mkdir()
    (tmp_path / f"safestage-{os.getuid()}").symlink_to(elsewhere)
    with pytest.raises(StagingError, match="planted"), safestage.staged():
        pass


def test_errors_pickle_and_are_builtin_subclasses():
    error = PublishError(errno.EIO, "msg", "/d", staged_path="/s", step="close")
    clone = pickle.loads(pickle.dumps(error))
    assert isinstance(clone, OSError) and clone.errno == errno.EIO and clone.filename == "/d"
    assert (clone.staged_path, clone.step, str(clone)) == ("/s", "close", "msg")
    staging = pickle.loads(pickle.dumps(StagingError(errno.ENOSPC, "full", "/r")))
    assert isinstance(staging, OSError) and staging.errno == errno.ENOSPC
    assert isinstance(pickle.loads(pickle.dumps(ConfigError("bad"))), ValueError)


def test_used_stage_cannot_be_reentered(tmp_path):
    stage = safestage.staged(tmp_path)
    with stage:
        pass
    with pytest.raises(RuntimeError, match="already used"), stage:
        pass


def test_activation_sweeps_dead_processes_staging_dirs(tmp_path, caplog):
    import logging
    import subprocess

    from safestage._names import _HOST

    child = subprocess.Popen(["true"])
    child.wait()
    torn = tmp_path / f"safestage-{_HOST}-{child.pid}-0badc0de"
    torn.mkdir()
    (torn / ".tmpAbC123").write_bytes(b"half a shard")
    finished = tmp_path / f"safestage-{_HOST}-{child.pid}-0000beef"
    finished.mkdir()
    (finished / "model.safetensors").write_bytes(b"complete copy of a failed publish")
    live = tmp_path / f"safestage-{_HOST}-{os.getpid()}-12345678"
    live.mkdir()
    (tmp_path / "notes.txt").write_text("not ours")
    with caplog.at_level(logging.WARNING, logger="safestage"), safestage.staged(tmp_path):
        pass
    assert sorted(os.listdir(tmp_path)) == sorted([finished.name, live.name, "notes.txt"])
    assert any(finished.name in record.getMessage() for record in caplog.records)
