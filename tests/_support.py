"""Helpers that tests of several files use (each defined once here, imported where used): tensors to save and compare, listings, child-process scripts and their environment."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
import textwrap
import threading
import zlib
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file, save_model

import safestage
from safestage import COMMIT_NAME

CALIBRATION_RUNS = 3

# The suite's own SAFESTAGE_* knobs (conftest.SUITE_VARIABLES), filled by conftest's
# pytest_configure from the caller's environment before it clears SAFESTAGE_* there.
SUITE_SETTINGS: dict[str, str] = {}
LONG_VARIABLE = "SAFESTAGE_LONG"


def long_tier() -> bool:
    """Whether this run is the long tier (SAFESTAGE_LONG=1): every release, version, client and
    mount of the expensive matrices. CI (unset or 0) runs each promise at the endpoints of its
    matrix; what it leaves out is not collected, never skipped."""
    text = SUITE_SETTINGS.get(LONG_VARIABLE, "").strip()
    if text not in ("", "0", "1"):
        raise ValueError(f"{LONG_VARIABLE}={text!r}: expected 1 (the long tier) or 0")
    return text == "1"


def tiered(every: list[Any], *, ci: list[Any]) -> list[Any]:
    """The parameters of a matrix: ``every`` one in the long tier, the ``ci`` ones otherwise."""
    assert ci and all(value in every for value in ci), (ci, every)
    return list(every) if long_tier() else [value for value in every if value in ci]


EXTRA_TRIALS = 24


def files_at_once(stage: safestage.StagedDir, count: int) -> safestage.StagedDir:
    """``stage`` with ``count`` files publishing at once (two in the library): a test seam for
    the order of a failure (one at a time) or the suite's time (more)."""
    stage._commit.copies = count
    return stage


def seeded_tensors(seed: int, numel: int = 4096) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(numel, generator=generator),
        "b16": torch.randn(257, generator=generator).to(torch.bfloat16),
        "i8": torch.randint(-128, 127, (33,), dtype=torch.int8, generator=generator),
    }


def write_checkpoint(local: Path, seed: int = 0, *, numel: int = 4096, newline: bool = True) -> dict[str, bytes]:
    """A Trainer-like tree: two safetensors shards, an index, JSON, a torch.save pickle and an
    empty file in a subdirectory, DCP's hidden .metadata, an empty directory, a name with a
    newline.
    Returns {relative path: bytes}."""
    save_file(seeded_tensors(seed, numel), str(local / "model-00001-of-00002.safetensors"))
    save_file(seeded_tensors(seed + 1000, numel // 2), str(local / "model-00002-of-00002.safetensors"))
    (local / "model.safetensors.index.json").write_text(json.dumps({"seed": seed}))
    (local / "config.json").write_text(json.dumps({"hidden": 8, "seed": seed}))
    (local / "state").mkdir()
    torch.save({"step": seed, "lr": torch.tensor([0.1 * seed])}, local / "state" / "optimizer.pt")
    (local / ".metadata").write_bytes(b"dcp" * (seed + 1))
    (local / "state" / "scaler.pt").write_bytes(b"")  # empty files: rclone uploads them late
    (local / "empty").mkdir()
    if newline:
        (local / "notes\nwith newline.txt").write_text(f"seed {seed}")
    return {
        str(path.relative_to(local)): path.read_bytes()
        for path in sorted(local.rglob("*"))
        if path.is_file()
    }


def assert_committed(dest: Path, expected: dict[str, bytes]) -> dict[str, Any]:
    """dest holds exactly ``expected`` plus the commit file, whose entries match digests and
    sizes computed here; every file 0644 (umask 022); no temp file. Returns the commit JSON."""
    found = sorted(
        str(path.relative_to(dest)) for path in dest.rglob("*") if path.is_file()
    )
    assert found == sorted([*expected, COMMIT_NAME]), found
    for relative, data in expected.items():
        assert (dest / relative).read_bytes() == data, relative
        assert stat.S_IMODE(os.stat(dest / relative).st_mode) == 0o644, relative
    document = json.loads((dest / COMMIT_NAME).read_bytes())
    assert document["format"] == "safestage.commit" and document["version"] == 1
    assert document["digest"] == "crc32"
    assert [entry["path"] for entry in document["files"]] == sorted(expected)
    for entry in document["files"]:
        data = expected[entry["path"]]
        assert entry["size"] == len(data), entry
        assert entry["digest"] == f"{zlib.crc32(data):08x}", entry  # computed while copying
    result = safestage.verify(dest, deep=True)
    assert result.complete and result.problems == [] and result.extra == [], result
    assert result.bytes_read == sum(len(data) for data in expected.values())
    assert safestage.verify(dest).complete
    return document


SHM = Path("/dev/shm")


REAL = ("rclone-local", "rclone-s3", "s3fs")


def version(tag: int, numel: int = 256 * 1024) -> dict[str, torch.Tensor]:
    """Distinct, deterministic content per writer (1 MiB by default: saves overlap)."""
    return {
        "w": torch.arange(numel, dtype=torch.float32) + tag,
        "tag": torch.tensor([tag], dtype=torch.int64),
    }


def equal(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> bool:
    return sorted(loaded) == sorted(expected) and all(
        torch.equal(loaded[k], v) for k, v in expected.items()
    )


RCLONE = ("rclone-local", "rclone-s3")


def run_threads(targets: list[Any]) -> None:
    errors: list[BaseException] = []

    def guarded(target: Any) -> None:
        try:
            target()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(t.is_alive() for t in threads), "a saver thread hung"
    assert not errors, errors


TMP_NAME = re.compile(r"^\.tmp[A-Za-z0-9]{6}$")  # the tempfile crate's names, as safetensors uses


def assert_loads_equal(path: Path, expected: dict[str, torch.Tensor]) -> None:
    loaded = load_file(str(path))
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype, name
        assert torch.equal(loaded[name], tensor), name


def listing(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def changed(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: tensor + 1 if tensor.numel() else tensor for name, tensor in tensors.items()}


class TinyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 4)
        self.tied = self.proj  # shared weights: save_model must dedupe them


def _roundtrip(directory: Path, root: Path, tensors: dict[str, torch.Tensor]) -> list[str]:
    dest = directory / "model.safetensors"
    with safestage.staged(root) as stage:
        save_file(tensors, dest)  # new file
        assert_loads_equal(dest, tensors)
        newer = changed(tensors)
        save_file(newer, str(dest), metadata={"format": "pt"})  # over an existing one
        model = TinyModel()
        save_model(model, str(directory / "tiny.safetensors"))
    assert_loads_equal(dest, newer)
    loaded = load_file(str(directory / "tiny.safetensors"))
    assert torch.equal(loaded["proj.weight"], model.proj.weight.detach())
    assert mode_of(dest) == 0o644
    assert mode_of(directory / "tiny.safetensors") == 0o644
    assert listing(directory) == ["model.safetensors", "tiny.safetensors"]
    assert listing(root) == [], "staging root must be empty after the saves"
    assert [r.destination for r in stage.records] == [dest, dest, directory / "tiny.safetensors"]
    assert all(r.bytes == os.stat(r.destination).st_size for r in stage.records[1:])
    return [r.publish for r in stage.records]


SMALL = {"w": torch.arange(64 * 1024, dtype=torch.float32)}  # 256 KiB


BIG = {"w": torch.arange(700 * 1024, dtype=torch.float32)}  # 2.7 MiB > a 2 MiB tmpfs


class Snapshot:
    """An existing file's identity and bytes: 'intact' means the very same inode and bytes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        info = os.stat(path)
        self.identity = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
        self.data = path.read_bytes()

    def assert_intact(self) -> None:
        info = os.stat(self.path)
        assert (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns) == self.identity, (
            "replaced or modified"
        )
        assert self.path.read_bytes() == self.data


def assert_one_line_message(error: BaseException, *needles: str) -> str:
    """A message a user reads without a debugger: one line, no traceback, the needed facts."""
    message = str(error)
    assert "\n" not in message and "Traceback" not in message, message
    for needle in needles:
        assert needle in message, f"{needle!r} missing from: {message}"
    return message


CHUNK = 1 << 20


CHUNKS = 12


def arange_tensors(tag: float = 0.0, numel: int = 4096) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(numel, dtype=torch.float32) + tag}


def loads_equal(path: Path, expected: dict[str, torch.Tensor]) -> bool:
    loaded = load_file(str(path))
    return sorted(loaded) == sorted(expected) and all(
        torch.equal(loaded[k], v) for k, v in expected.items()
    )


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


class StrPath:
    """A user's own os.PathLike (not pathlib)."""

    def __init__(self, path: Any) -> None:
        self.path = path

    def __fspath__(self) -> Any:
        return self.path

    def __repr__(self) -> str:
        return f"StrPath({self.path!r})"


def outcome(action: Callable[[], None]) -> str:
    """What a user sees: 'ok' or the exception's type and text (minus safetensors' random
    .tmpXXXXXX name after ' at path')."""
    try:
        action()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}".split(" at path")[0]
    return "ok"


def shard(index: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((2 * 1024 * 1024,), float(index))}  # 8 MiB


PY = sys.executable


REPO = Path(__file__).resolve().parent.parent


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    env["PYTHONPATH"] = str(REPO)
    env["HF_HUB_OFFLINE"] = "1"
    return env


_UNHASHABLE_DTYPE = json.dumps({"w": {"dtype": ["F32"], "shape": [1000], "data_offsets": [0, 4000]}}).encode()


_NESTED = b"[" * 1900 + b"]" * 1900  # valid JSON, deeper than Python's recursion limit


def _save_in_thread(save, timeout: float) -> tuple[threading.Thread, list[object]]:
    """Run ``save()`` in a daemon thread; return it (alive = still hanging) and its outcome."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(save())
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    return thread, outcome


def _write_file(path: str, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)


def filled_tensors(tag: float = 0.0, numel: int = 4096) -> dict[str, torch.Tensor]:
    return {"w": torch.full((numel,), float(tag))}


def loads_as(path: Path, tag: float) -> bool:
    """The file loads, and every value is ``tag`` (no mix of two saves)."""
    try:
        values = torch.unique(load_file(str(path))["w"]).tolist()
    except Exception:
        return False
    return values == [float(tag)]


def entries(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def run_code(code: str, *args: str, env: dict[str, str] | None = None, timeout: float = 60,
               prefix: list[str] | None = None) -> subprocess.CompletedProcess[str]:  # fmt: skip
    base = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    base.update(env or {})
    return subprocess.run(
        [*(prefix or []), PY, "-c", textwrap.dedent(code), *args],
        capture_output=True, text=True, timeout=timeout, env=base,
    )  # fmt: skip


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)
