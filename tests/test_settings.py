"""Options and staging roots: clear errors that name the option, the path and what to do."""

from __future__ import annotations

import errno
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Callable

import pytest
from _support import StrPath
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import safestage
from safestage import ConfigError, PublishError, StagingError
from safestage._config import PUBLISH_CHOICES, Settings, resolve, switched_on


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


def test_staged_dir_background_is_the_count_of_commits_in_flight_and_never_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SAFESTAGE_BACKGROUND", "5")  # for the saves staging intercepts, not commits
    assert safestage.staged_dir(tmp_path / "c").settings.background == 0  # no file saves of its own
    assert safestage.staged_dir(tmp_path / "c").background == 0  # synchronous unless told
    assert safestage.staged_dir(tmp_path / "c", background=True).background == 1
    assert safestage.staged_dir(tmp_path / "c", background=3).background == 3
    with pytest.raises(ConfigError, match="background='many'"):
        safestage.staged_dir(tmp_path / "c", background="many")  # type: ignore[arg-type]


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


def test_the_public_options_and_variables_are_these():
    """What the v0.2 consolidation promised (issue 17): the options of staged() and the
    variables that are read; 0.4 added one of each, the snapshot budget (issue 26)."""
    import inspect

    from safestage import _config

    options = [p for p in inspect.signature(safestage.staged).parameters.values() if p.kind is not p.VAR_KEYWORD]
    assert [p.name for p in options] == [
        "root", "publish", "fsync", "background", "skip_local_disk", "torch_save", "snapshot_budget"
    ]  # fmt: skip
    assert [p.name for p in inspect.signature(safestage.activate).parameters.values()] == [
        p.name for p in inspect.signature(safestage.staged).parameters.values()
    ]
    variables = sorted(v for k, v in vars(_config).items() if k.startswith("ENV_"))
    assert variables == sorted(
        ["SAFESTAGE", "SAFESTAGE_DIR", "SAFESTAGE_PUBLISH", "SAFESTAGE_BACKGROUND",
         "SAFESTAGE_SKIP_LOCAL_DISK", "SAFESTAGE_TORCH_SAVE", "SAFESTAGE_LOG_LEVEL", "SAFESTAGE_SNAPSHOT_BUDGET"]
    )  # fmt: skip


def test_staged_rejects_bad_option_before_anything_happens():
    with pytest.raises(ConfigError, match="auto, replace, direct"):
        safestage.staged(publish="sideways")
    assert not safestage.is_active()


def test_errors_pickle_and_are_builtin_subclasses():
    error = PublishError(errno.EIO, "msg", "/d", staged_path="/s", step="close")
    clone = pickle.loads(pickle.dumps(error))
    assert isinstance(clone, OSError) and clone.errno == errno.EIO and clone.filename == "/d"
    assert (clone.staged_path, clone.step, str(clone)) == ("/s", "close", "msg")
    staging = pickle.loads(pickle.dumps(StagingError(errno.ENOSPC, "full", "/r")))
    assert isinstance(staging, OSError) and staging.errno == errno.ENOSPC
    assert isinstance(pickle.loads(pickle.dumps(ConfigError("bad"))), ValueError)


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


VARIABLES = (
    "SAFESTAGE",
    "SAFESTAGE_DIR",
    "SAFESTAGE_PUBLISH",
    "SAFESTAGE_LOG_LEVEL",
    "SAFESTAGE_BACKGROUND",
    "SAFESTAGE_SKIP_LOCAL_DISK",
    "SAFESTAGE_TORCH_SAVE",
    # removed in 0.2: a clean ConfigError naming the replacement
    "SAFESTAGE_FSYNC",
    "SAFESTAGE_MAX_PENDING",
    "SAFESTAGE_WHEN",
    "SAFESTAGE_FOLLOW",
)


def _variants(words: tuple[str, ...]) -> st.SearchStrategy[str]:
    """Valid words in any case, padded with white space: what a launcher script writes."""
    return st.builds(
        lambda word, upper, left, right: left + (word.upper() if upper else word) + right,
        st.sampled_from(words),
        st.booleans(),
        st.sampled_from(["", " ", "\t", "\n"]),
        st.sampled_from(["", " ", "\n"]),
    )


def _known_int_bug(value: object) -> bool:
    """Strings int() rejects although str.isdigit() accepts them: they must still be ConfigErrors."""
    if not isinstance(value, str):
        return False
    text = value.strip()
    return text.isdigit() and (not text.isdecimal() or len(text) > 4000)


ANYTHING = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
    st.binary(max_size=20),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.builds(object),
    st.builds(StrPath, st.text(max_size=20)),
    st.builds(StrPath, st.binary(max_size=20)),
)


ROOTS = st.one_of(
    ANYTHING,
    st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40),
    st.builds(
        Path,
        st.text(
            alphabet=st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)),
            max_size=20,
        ),
    ),
    st.sampled_from(["", " ", "\x00", "a\x00b", "/tmp", ".", "~", "relative/root"]),
)


COUNTS = st.one_of(
    ANYTHING, st.integers(-3, 70), st.from_regex(r"\s*[0-9]{1,3}\s*", fullmatch=True)
)


def _check_settings(result: Settings) -> None:
    assert isinstance(result, Settings)
    assert result.root is None or (isinstance(result.root, Path) and result.root.is_absolute())
    assert result.publish in PUBLISH_CHOICES
    assert type(result.fsync) is bool and type(result.skip_local_disk) is bool
    assert type(result.torch_save) is bool
    assert type(result.background) is int and 0 <= result.background <= 64


def _settings_or_config_error(make: Callable[[], Settings]) -> None:
    try:
        result = make()
    except ConfigError as exc:
        message = str(exc)
        assert message and "\n" not in message, message  # one clean line naming the option
        assert "from " in message or " is removed" in message, (
            f"the message must say where the value came from: {message}"
        )
        return
    _check_settings(result)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    root=ROOTS,
    publish=st.one_of(ANYTHING, _variants(PUBLISH_CHOICES)),
    fsync=ANYTHING,
    background=COUNTS,
    skip_local_disk=ANYTHING,
)
@example(root=None, publish="auto", fsync=True, background=False, skip_local_disk=False)
@example(root=b"\xff\xfe", publish=" DIRECT\n", fsync=False, background="64", skip_local_disk=True)
def test_fuzzed_staged_arguments_give_settings_or_a_config_error(
    root, publish, fsync, background, skip_local_disk
):
    if _known_int_bug(background):
        return
    _settings_or_config_error(
        lambda: (
            safestage.staged(
                root,
                publish=publish,
                fsync=fsync,
                background=background,
                skip_local_disk=skip_local_disk,
            ).settings
        )
    )


ENV_TEXT = st.one_of(
    st.text(
        alphabet=st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",)),
        max_size=20,
    ),
    st.sampled_from(
        ["", " ", "0", "1", "true", "off", "YES", "2", "64", "65", "-1", "1.5", "\t1\n"]
    ),
    _variants((*PUBLISH_CHOICES, "always", "auto", "DEBUG", "INFO", "WARNING", "1", "0", "yes", "no")),
)


ENVIRONMENTS = st.dictionaries(st.sampled_from(VARIABLES), ENV_TEXT, max_size=len(VARIABLES))


@settings(max_examples=400, deadline=None)
@given(environ=ENVIRONMENTS)
@example(
    environ={"SAFESTAGE_BACKGROUND": " 7 ", "SAFESTAGE_PUBLISH": "Direct", "SAFESTAGE_SKIP_LOCAL_DISK": "no"}
)
@example(environ={"SAFESTAGE": "yes", "SAFESTAGE_DIR": "   "})
def test_fuzzed_environment_gives_settings_or_a_config_error(environ):
    if _known_int_bug(environ.get("SAFESTAGE_BACKGROUND")):
        return
    _settings_or_config_error(lambda: resolve(environ=environ))
    try:
        on = switched_on(environ)
    except ConfigError as exc:
        assert "SAFESTAGE" in str(exc)
    else:
        assert type(on) is bool
        if environ.get("SAFESTAGE", "").strip() == "0":
            assert on is False  # SAFESTAGE=0 wins over SAFESTAGE_DIR


@pytest.mark.parametrize("text", ["²", "9" * 5000])
def test_digit_like_counts_are_config_errors(text):
    for make in (
        lambda: resolve(environ={"SAFESTAGE_BACKGROUND": text}),
        lambda: resolve(background=text, environ={}),
    ):
        try:
            make()
        except ConfigError:
            continue
        except Exception as exc:  # the bug: anything else escapes
            raise AssertionError(f"{type(exc).__name__}: {exc}") from exc
        raise AssertionError("accepted")


PROGRAM = textwrap.dedent(
    """
    import numpy as np
    from safetensors.numpy import load_file, save_file
    import safestage
    arrays = {"x": np.arange(12, dtype=np.float32).reshape(3, 4)}
    save_file(arrays, "out.safetensors")
    safestage.wait()  # SAFESTAGE_BACKGROUND=1: the save returned once staged; publishing goes on
    assert (load_file("out.safetensors")["x"] == arrays["x"]).all()
    print("saved", "staged" if safestage.is_active() else "unstaged")
    """
)


def run_program(environ: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    env.update(environ, TMPDIR=str(cwd))  # the default root lands in the example's own dir
    return subprocess.run(
        [sys.executable, "-c", PROGRAM],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _warnings(stderr: str) -> int:
    return stderr.count("safestage: WARNING") + stderr.count("safestage: ERROR")


def test_a_bad_log_level_warns_once_and_keeps_staging_on(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    completed = run_program({"SAFESTAGE_DIR": str(root), "SAFESTAGE_LOG_LEVEL": "loud"}, tmp_path)
    assert completed.returncode == 0 and "Traceback" not in completed.stderr, completed.stderr
    assert _warnings(completed.stderr) == 1 and "SAFESTAGE_LOG_LEVEL" in completed.stderr, (
        completed.stderr
    )
    assert "saved staged" in completed.stdout, completed.stderr


def test_a_digit_like_log_level_warns_once_and_keeps_staging_on(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    completed = run_program({"SAFESTAGE_DIR": str(root), "SAFESTAGE_LOG_LEVEL": "²"}, tmp_path)
    assert completed.returncode == 0 and "Traceback" not in completed.stderr, completed.stderr
    assert _warnings(completed.stderr) == 1, completed.stderr
    assert "saved staged" in completed.stdout, (
        f"a bad log level switched staging off: {completed.stderr}"
    )


# A SAFESTAGE_DIR relative to the example's cwd: blank, existing, missing, a file, odd names.
DIRS = st.one_of(
    st.sampled_from(["", "  ", "root", "missing/deeper", "a-file", "root/", "./root"]),
    st.text(
        alphabet=st.characters(blacklist_characters="\x00/.", blacklist_categories=("Cs",)),
        min_size=1,
        max_size=12,
    ),
)


@pytest.mark.slow
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    environ=st.fixed_dictionaries(
        {},
        optional={
            "SAFESTAGE": ENV_TEXT,
            "SAFESTAGE_DIR": DIRS,
            "SAFESTAGE_PUBLISH": ENV_TEXT,
            "SAFESTAGE_LOG_LEVEL": st.one_of(ENV_TEXT.filter(lambda t: not _known_int_bug(t))),
            "SAFESTAGE_BACKGROUND": ENV_TEXT.filter(lambda t: not _known_int_bug(t)),
            "SAFESTAGE_SKIP_LOCAL_DISK": ENV_TEXT,
            "SAFESTAGE_MAX_PENDING": ENV_TEXT,  # removed: one warning naming the replacement
            "SAFESTAGE_WHEN": ENV_TEXT,
        },
    )
)
@example(environ={"SAFESTAGE_DIR": "root", "SAFESTAGE_PUBLISH": "sideways"})
@example(environ={"SAFESTAGE": "1", "SAFESTAGE_LOG_LEVEL": "DEBUG"})
@example(environ={"SAFESTAGE_DIR": "missing/deeper"})
def test_a_program_with_fuzzed_variables_runs_on_with_at_most_one_warning(environ):
    cwd = Path(tempfile.mkdtemp(prefix="safestage-fuzz-"))
    try:  # not tmp_path: hypothesis runs many examples per test call
        (cwd / "root").mkdir()
        (cwd / "a-file").write_text("not a directory")
        completed = run_program(environ, cwd)
        report = f"env={environ!r}\nstdout={completed.stdout}\nstderr={completed.stderr}"
        assert completed.returncode == 0, report
        assert "Traceback" not in completed.stderr, report
        # One warning for the activation (the first bad variable, or an unusable root), and
        # one more only if SAFESTAGE_LOG_LEVEL, read before anything else, is bad as well.
        warnings = [
            line for line in completed.stderr.splitlines() if line.startswith("safestage: WARNING")
        ]
        activation = [
            w
            for w in warnings
            if "SAFESTAGE_LOG_LEVEL=" not in w.split(" is not a logging level")[0]
        ]
        assert len(activation) <= 1 and len(warnings) - len(activation) <= 1, report
        assert "saved" in completed.stdout, report
        default_root = f"safestage-{os.getuid()}"
        names = {p.name for p in cwd.iterdir()}
        assert names <= {"a-file", "out.safetensors", "root", default_root}, (
            f"created {names}: {report}"
        )
        for root in ("root", default_root):
            assert not (cwd / root).exists() or not any((cwd / root).iterdir()), (
                f"leftover in {root}: {report}"
            )
    finally:
        shutil.rmtree(cwd, ignore_errors=True)


def test_a_bad_snapshot_budget_names_where_it_came_from(monkeypatch):
    monkeypatch.setenv("SAFESTAGE_SNAPSHOT_BUDGET", "lots")
    with pytest.raises(ConfigError, match=r"snapshot_budget='lots' from SAFESTAGE_SNAPSHOT_BUDGET .* 8GiB"):
        safestage.staged()
    with pytest.raises(ConfigError, match="from the snapshot_budget argument"):
        safestage.staged(snapshot_budget=-1)
    monkeypatch.setenv("SAFESTAGE_SNAPSHOT_BUDGET", "512MiB")
    assert safestage.staged().settings.snapshot_budget == 512 << 20
    assert safestage.staged(snapshot_budget="1G").settings.snapshot_budget == 1 << 30
