"""Options and staging roots: clear errors that name the option, the path and what to do."""

from __future__ import annotations

import errno
import os
import pickle
import re
from pathlib import Path
from typing import Callable

import pytest

import safestage
from safestage import ConfigError, PublishError, StagingError
from safestage._config import Settings, resolve


def test_argument_beats_environment_beats_default(tmp_path):
    env = {
        "SAFESTAGE_DIR": str(tmp_path),
        "SAFESTAGE_PUBLISH": "direct",
        "SAFESTAGE_BACKGROUND": "5",
        "SAFESTAGE_SKIP_LOCAL_DISK": "1",
        "SAFESTAGE_TORCH_SAVE": "yes",
    }
    from_env = resolve(environ=env)
    assert (from_env.root, from_env.publish, from_env.fsync) == (tmp_path, "direct", True)
    assert (from_env.background, from_env.skip_local_disk, from_env.torch_save) == (5, True, True)
    explicit = resolve(
        root=tmp_path / "x", publish="replace", fsync=False, background=False,
        skip_local_disk=False, torch_save=False, environ=env,
    )  # fmt: skip
    assert (explicit.root, explicit.publish, explicit.fsync) == (tmp_path / "x", "replace", False)
    assert (explicit.background, explicit.skip_local_disk, explicit.torch_save) == (0, False, False)
    default = resolve(environ={"SAFESTAGE_DIR": "  ", "SAFESTAGE_PUBLISH": "", "SAFESTAGE_BACKGROUND": " "})
    assert (default.root, default.publish, default.fsync) == (None, "auto", True)
    assert (default.background, default.skip_local_disk, default.torch_save) == (0, False, False)
    assert default == safestage.Stage(default).settings == Settings()  # the defaults, in one place


@pytest.mark.parametrize(
    ("argument", "variable", "at_once"),
    [
        (True, "1", 2),  # on: 2 files publishing at once (the benchmarked default)
        (False, "0", 0),  # off: each save publishes before it returns
        (4, "4", 4),  # at most N
        (0, "no", 0),
        (1, "64", None),  # background=1: one at a time (a variable's "1" means on)
    ],
)
def test_background_folds_the_count_of_files_publishing_at_once(argument, variable, at_once):
    assert resolve(background=argument, environ={}).background == (argument if at_once is None else at_once)
    assert resolve(environ={"SAFESTAGE_BACKGROUND": variable}).background == (64 if at_once is None else at_once)
    assert safestage.staged(background=argument).settings.background == resolve(background=argument).background


def test_staged_dir_commits_two_files_at_once_unless_told(tmp_path):
    assert safestage.staged_dir(tmp_path / "c").settings.background == 2
    assert safestage.staged_dir(tmp_path / "c", background=5).settings.background == 5
    assert safestage.staged_dir(tmp_path / "c", background=False).settings.background == 0  # one thread


@pytest.mark.parametrize(
    ("kwargs", "env", "needle"),
    [
        ({"publish": "bogus"}, {}, "the publish argument"),
        ({}, {"SAFESTAGE_PUBLISH": "bogus"}, "SAFESTAGE_PUBLISH"),
        ({}, {"SAFESTAGE_BACKGROUND": "maybe"}, "SAFESTAGE_BACKGROUND"),
        ({}, {"SAFESTAGE_BACKGROUND": "65"}, "SAFESTAGE_BACKGROUND"),
        ({"background": -1}, {}, "the background argument"),
        ({"background": 1.5}, {}, "the background argument"),
        ({}, {"SAFESTAGE_SKIP_LOCAL_DISK": "sometimes"}, "SAFESTAGE_SKIP_LOCAL_DISK"),
        ({"skip_local_disk": "yes"}, {}, "the skip_local_disk argument"),
        ({}, {"SAFESTAGE_TORCH_SAVE": "2"}, "SAFESTAGE_TORCH_SAVE"),
        ({"fsync": "yes"}, {}, "the fsync argument"),
        ({"root": 42}, {}, "the root argument"),
    ],
)
def test_bad_options_name_their_source(kwargs, env, needle):
    with pytest.raises(ConfigError, match=needle) as info:
        resolve(environ=env, **kwargs)
    assert isinstance(info.value, ValueError)


# -- names removed in 0.2 ------------------------------------------------------------------------


def _entries(tmp_path: Path) -> dict[str, Callable[..., object]]:
    """Every public entry that took a removed option in 0.1, with its required arguments."""
    entries: dict[str, Callable[..., object]] = {
        "staged": safestage.staged,
        "activate": safestage.activate,
        "staged_dir": lambda **kw: safestage.staged_dir(tmp_path / "ckpt", **kw),
    }
    try:
        from safestage.lightning import StagedCheckpointIO
    except ImportError:  # lightning is a dev dependency; the three above always run
        pass
    else:
        entries["StagedCheckpointIO"] = StagedCheckpointIO
    return entries


@pytest.mark.parametrize(
    ("option", "value", "replacement"),
    [
        ("follow", True, "drop it; following is internal"),
        ("follow", None, "drop it; following is internal"),
        ("max_pending", 4, "background=4"),
        ("max_pending", "x", "background=N"),
        ("when", "auto", "skip_local_disk=True"),
        ("when", "always", "drop it (staging every save is the default)"),
    ],
)
def test_each_removed_option_raises_config_error_naming_its_replacement(tmp_path, option, value, replacement):
    for name, entry in _entries(tmp_path).items():
        with pytest.raises(ConfigError, match=rf"{option}= is removed: .*{re.escape(replacement)}") as info:
            entry(**{option: value})
        assert isinstance(info.value, ValueError), name
    assert not safestage.is_active()


def test_an_unknown_option_is_the_type_error_python_gives():
    with pytest.raises(TypeError, match="unexpected keyword argument 'publsh'"):
        safestage.staged(publsh="direct")


@pytest.mark.parametrize(
    ("variable", "value", "replacement"),
    [
        ("SAFESTAGE_FOLLOW", "1", "unset it; following is internal"),
        ("SAFESTAGE_MAX_PENDING", "4", "write SAFESTAGE_BACKGROUND=4 instead"),
        ("SAFESTAGE_MAX_PENDING", "1", "one file at a time is background=1 in code"),
        ("SAFESTAGE_WHEN", "auto", "write SAFESTAGE_SKIP_LOCAL_DISK=1 instead"),
        ("SAFESTAGE_WHEN", "always", "unset it (staging every save is the default)"),
        ("SAFESTAGE_FSYNC", "0", "pass fsync=False in code"),
        ("SAFESTAGE_FSYNC", "1", "unset it"),
    ],
)
def test_each_removed_variable_raises_config_error_naming_its_replacement(monkeypatch, variable, value, replacement):
    expected = rf"{variable}='{value}' is removed in safestage 0.2: .*{re.escape(replacement)}"
    with pytest.raises(ConfigError, match=expected):
        resolve(environ={variable: value})
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError, match=expected):
        safestage.staged(publish="replace")  # also when every other option is given
    monkeypatch.setenv(variable, "  ")
    safestage.staged()  # blank counts as unset


def test_following_is_automatic_and_forced_only_through_the_internal_seam(tmp_path):
    """follow is internal: in no public signature; the default ("auto", None) follows the
    synchronous replace saves of safetensors files known to be big. Tests force it with
    safestage._api.force_follow (a new Stage with dataclasses.replace(settings, follow=...))."""
    import inspect

    from safestage._api import force_follow

    stage = safestage.staged(tmp_path, publish="replace")
    assert stage.settings.follow is None
    forced = force_follow(stage)
    assert forced.settings.follow is True and forced is not stage
    assert force_follow(stage, False).settings.follow is False
    assert (forced.settings.publish, forced.settings.root) == ("replace", tmp_path)
    for entry in (safestage.staged, safestage.activate, safestage.staged_dir, safestage.staged_file):
        assert "follow" not in inspect.signature(entry).parameters
    assert "follow=" not in repr(stage.settings)


def test_the_public_options_are_six_and_the_variables_seven():
    """What the v0.2 consolidation promised (issue 17): the options of staged() and the
    variables that are read."""
    import inspect

    from safestage import _config

    options = [p for p in inspect.signature(safestage.staged).parameters.values() if p.kind is not p.VAR_KEYWORD]
    assert [p.name for p in options] == ["root", "publish", "fsync", "background", "skip_local_disk", "torch_save"]
    assert [p.name for p in inspect.signature(safestage.activate).parameters.values()] == [
        p.name for p in inspect.signature(safestage.staged).parameters.values()
    ]
    variables = sorted(v for k, v in vars(_config).items() if k.startswith("ENV_"))
    assert variables == sorted(
        ["SAFESTAGE", "SAFESTAGE_DIR", "SAFESTAGE_PUBLISH", "SAFESTAGE_BACKGROUND",
         "SAFESTAGE_SKIP_LOCAL_DISK", "SAFESTAGE_TORCH_SAVE", "SAFESTAGE_LOG_LEVEL"]
    )  # fmt: skip


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


def test_mypy_sees_the_allowed_values(tmp_path):
    """The options are typed (Literal, bool | int), so a type checker and an IDE say what is
    allowed; a removed or misspelt keyword is an error there too (``**removed: NoReturn``)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    snippet = tmp_path / "snippet.py"
    snippet.write_text(
        "import safestage\n"
        "safestage.staged(publish='replace', background=4, skip_local_disk=True)\n"
        "safestage.staged(publish='bogus')\n"
        "safestage.activate(max_pending=2)\n"
        "safestage.staged_dir('/x', background='many')\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-error-summary", "--hide-error-context", str(snippet)],
        cwd=root, env={**os.environ, "MYPYPATH": str(root)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    errors = sorted(line.split(":")[1] for line in result.stdout.splitlines() if ": error:" in line)
    assert errors == ["3", "4", "5"], result.stdout + result.stderr
    assert "Literal['auto', 'replace', 'direct'] | None" in result.stdout
    assert 'Argument "max_pending" to "activate"' in result.stdout
