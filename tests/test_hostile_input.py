"""Hostile input: fuzzed options and SAFESTAGE_* variables, odd paths, tensors safetensors rejects.

- Every option and variable gives a Settings or a clean ConfigError (a ValueError naming the
  option and its source), never another exception; a program started with fuzzed variables
  runs on with at most one warning and no traceback.
- Paths: relative, PathLike, bytes, a directory, symlinks (dangling, to a file, a symlinked
  directory), a missing directory: safestage behaves as a plain safetensors 0.8 save does, or
  raises its very error.
- Tensors safetensors rejects: its own error, unchanged, and nothing left in the staging root.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

import safestage
from safestage import ConfigError
from safestage._autoload import switched_on
from safestage._config import PUBLISH_CHOICES, Settings, resolve

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


@pytest.fixture(scope="module", autouse=True)
def _no_safestage_environment() -> Iterator[None]:
    """staged() reads SAFESTAGE_*: the fuzzed arguments alone must decide here."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("SAFESTAGE")}
    yield
    os.environ.update(saved)


class StrPath:
    """A user's own os.PathLike (not pathlib)."""

    def __init__(self, path: Any) -> None:
        self.path = path

    def __fspath__(self) -> Any:
        return self.path

    def __repr__(self) -> str:
        return f"StrPath({self.path!r})"


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


# -- paths --------------------------------------------------------------------------------------


@pytest.fixture
def tensors() -> dict[str, torch.Tensor]:
    return {
        "w": torch.arange(1000, dtype=torch.float32),
        "b": torch.tensor([1, 2, 3], dtype=torch.int8),
    }


def newer(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v + 1 for k, v in tensors.items()}


def loads_equal(path: Path, expected: dict[str, torch.Tensor]) -> bool:
    loaded = load_file(str(path))
    return sorted(loaded) == sorted(expected) and all(
        torch.equal(loaded[k], v) for k, v in expected.items()
    )


def outcome(action: Callable[[], None]) -> str:
    """What a user sees: 'ok' or the exception's type and text (minus safetensors' random
    .tmpXXXXXX name after ' at path')."""
    try:
        action()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}".split(" at path")[0]
    return "ok"


def test_relative_destination_and_root(tmp_path, tensors, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "scratch").mkdir()
    (tmp_path / "ckpt").mkdir()
    with safestage.staged("scratch") as stage:
        save_file(tensors, "model.safetensors")
        save_file(tensors, "ckpt/../ckpt/shard.safetensors")
        monkeypatch.chdir(tmp_path / "ckpt")  # the root was resolved when the stage was made
        save_file(newer(tensors), "other.safetensors")
    assert stage.staging_root == tmp_path / "scratch"
    assert loads_equal(tmp_path / "model.safetensors", tensors)
    assert loads_equal(tmp_path / "ckpt" / "shard.safetensors", tensors)
    assert loads_equal(tmp_path / "ckpt" / "other.safetensors", newer(tensors))
    assert [r.destination for r in stage.records] == [
        tmp_path / "model.safetensors",
        tmp_path / "ckpt" / "shard.safetensors",
        tmp_path / "ckpt" / "other.safetensors",
    ]
    assert list((tmp_path / "scratch").iterdir()) == []


@pytest.mark.parametrize("wrap", [Path, StrPath], ids=["pathlib", "custom-PathLike"])
def test_pathlike_destination_and_root(tmp_path, shm_root, tensors, wrap):
    dest = tmp_path / "model.safetensors"
    with safestage.staged(wrap(str(shm_root))) as stage:
        save_file(tensors, wrap(str(dest)))
    assert loads_equal(dest, tensors)
    assert [r.destination for r in stage.records] == [dest]
    assert stage.records[0].publish == "replace"


@pytest.mark.parametrize(
    "wrap", [os.fsencode, lambda p: StrPath(os.fsencode(p))], ids=["bytes", "PathLike-to-bytes"]
)
def test_bytes_filename_raises_safetensors_own_error_unchanged(tmp_path, shm_root, tensors, wrap):
    dest = wrap(str(tmp_path / "model.safetensors"))
    plain = outcome(lambda: save_file(tensors, dest))
    assert plain.startswith("TypeError"), plain  # safetensors 0.8 takes no bytes paths
    with safestage.staged(shm_root) as stage:
        staged = outcome(lambda: save_file(tensors, dest))
    assert staged == plain
    assert stage.records == [] and os.listdir(shm_root) == [] and os.listdir(tmp_path) == []


@pytest.mark.regression("v0.2 hostile review: staged_file with a bytes path died inside _paths with "
                        "an internal TypeError naming nothing")
def test_staged_file_takes_a_bytes_path_as_staged_dir_and_open_do(tmp_path, shm_root):
    for name in (b"weights.bin", b"w\xff.bin"):  # the second is not UTF-8
        dest = os.fsencode(tmp_path) + b"/" + name
        with safestage.staged_file(dest, shm_root) as local:
            local.write_bytes(b"payload")
        with open(dest, "rb") as published:
            assert published.read() == b"payload"
    assert sorted(os.listdir(os.fsencode(tmp_path))) == [b"weights.bin", b"w\xff.bin"]
    assert os.listdir(shm_root) == []


def _same_as_plain(
    tmp_path: Path, shm_root: Path, prepare: Callable[[Path], Path], save: Callable[[Path], None]
) -> tuple[Path, Path]:
    """Run the same save plainly in one directory and staged in another; both must end alike."""
    plain_dir, staged_dir = tmp_path / "plain", tmp_path / "staged"
    plain_dir.mkdir()
    staged_dir.mkdir()
    plain_dest, staged_dest = prepare(plain_dir), prepare(staged_dir)
    plain = outcome(lambda: save(plain_dest))
    with safestage.staged(shm_root):
        staged = outcome(lambda: save(staged_dest))
    assert staged == plain.replace(str(plain_dir), str(staged_dir))
    assert _tree(plain_dir) == _tree(staged_dir), "the directories differ after the same save"
    assert os.listdir(shm_root) == []
    return plain_dest, staged_dest


def _tree(directory: Path) -> list[tuple[str, str]]:
    entries = []
    for path in sorted(directory.rglob("*")):
        kind = "link" if path.is_symlink() else "dir" if path.is_dir() else "file"
        entries.append((str(path.relative_to(directory)), kind))
    return entries


def test_destination_that_is_a_directory(tmp_path, shm_root, tensors):
    def prepare(directory: Path) -> Path:
        (directory / "model.safetensors").mkdir()
        return directory / "model.safetensors"

    _same_as_plain(tmp_path, shm_root, prepare, lambda dest: save_file(tensors, str(dest)))


def test_destination_directory_missing(tmp_path, shm_root, tensors):
    _same_as_plain(
        tmp_path,
        shm_root,
        lambda d: d / "missing" / "model.safetensors",
        lambda dest: save_file(tensors, str(dest)),
    )


def test_dangling_symlink_destination_becomes_a_regular_file(tmp_path, shm_root, tensors):
    def prepare(directory: Path) -> Path:
        (directory / "model.safetensors").symlink_to(directory / "nowhere.safetensors")
        return directory / "model.safetensors"

    _, staged_dest = _same_as_plain(
        tmp_path, shm_root, prepare, lambda dest: save_file(tensors, str(dest))
    )
    assert not staged_dest.is_symlink() and loads_equal(staged_dest, tensors)
    assert not (staged_dest.parent / "nowhere.safetensors").exists(), (
        "the link must not be followed"
    )


def test_symlink_to_a_file_is_replaced_and_its_target_kept(tmp_path, shm_root, tensors):
    def prepare(directory: Path) -> Path:
        target = directory / "target.safetensors"
        save_file(tensors, str(target))
        (directory / "model.safetensors").symlink_to(target.name)
        return directory / "model.safetensors"

    _, staged_dest = _same_as_plain(
        tmp_path, shm_root, prepare, lambda dest: save_file(newer(tensors), str(dest))
    )
    assert not staged_dest.is_symlink(), "replaced by a regular file, as safetensors 0.8 does"
    assert loads_equal(staged_dest, newer(tensors))
    assert loads_equal(staged_dest.parent / "target.safetensors", tensors), (
        "the link's target is untouched"
    )


def test_destination_inside_a_symlinked_directory(tmp_path, shm_root, tensors):
    def prepare(directory: Path) -> Path:
        (directory / "real").mkdir()
        (directory / "link").symlink_to("real", target_is_directory=True)
        return directory / "link" / "model.safetensors"

    _, staged_dest = _same_as_plain(
        tmp_path, shm_root, prepare, lambda dest: save_file(tensors, str(dest))
    )
    assert loads_equal(staged_dest.parent.parent / "real" / "model.safetensors", tensors)


# -- tensors safetensors rejects ----------------------------------------------------------------


def _shared() -> dict[str, torch.Tensor]:
    base = torch.zeros(8)
    return {"a": base, "b": base[:4]}


REJECTED = {
    "non-contiguous": (lambda: {"t": torch.arange(10)[::2]}, None),
    "shared-storage": (_shared, None),
    "sparse": (lambda: {"s": torch.zeros(4).to_sparse()}, None),
    "meta-device": (lambda: {"m": torch.zeros(4, device="meta")}, None),
    "metadata-not-str": (
        lambda: {"w": torch.zeros(4)},
        {"step": 1},
    ),  # raised inside serialize_file
    "key-not-str": (lambda: {1: torch.zeros(4)}, None),  # raised inside serialize_file
}


@pytest.mark.parametrize("case", sorted(REJECTED))
def test_tensors_safetensors_rejects_raise_its_own_error_unchanged(
    tmp_path, shm_root, tensors, case
):
    make, metadata = REJECTED[case]
    dest = tmp_path / "model.safetensors"
    save_file(tensors, str(dest))
    before = dest.read_bytes()
    plain = outcome(lambda: save_file(make(), str(dest), metadata=metadata))
    assert plain != "ok"
    with safestage.staged(shm_root) as stage:
        staged = outcome(lambda: save_file(make(), str(dest), metadata=metadata))
    assert staged == plain
    assert dest.read_bytes() == before and os.listdir(tmp_path) == ["model.safetensors"]
    assert stage.records == [] and os.listdir(shm_root) == [], "nothing staged may be left"


def test_a_rejected_save_does_not_disturb_the_next_one(tmp_path, shm_root, tensors, caplog):
    with caplog.at_level(logging.WARNING, logger="safestage"), safestage.staged(shm_root) as stage:
        with pytest.raises(ValueError):
            save_file({"t": torch.arange(10)[::2]}, str(tmp_path / "bad.safetensors"))
        save_file(tensors, str(tmp_path / "good.safetensors"))
    assert loads_equal(tmp_path / "good.safetensors", tensors)
    assert [r.destination.name for r in stage.records] == ["good.safetensors"]
    assert not caplog.records, [r.getMessage() for r in caplog.records]
