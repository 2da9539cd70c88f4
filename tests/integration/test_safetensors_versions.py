"""safestage against the newest release of every safetensors minor from 0.4 to 0.8.

0.8.0 runs in the dev venv; each older release gets a side venv cached under
<project>/.venv-matrix/<version> (safetensors==<version>, the pinned torch/wrapt/numpy of
.ci/constraints.txt, packaging). safestage itself is built as a wheel from this tree once per
session and reinstalled into each side venv on every run, so the cache never tests stale code.
The parent test mounts the kit (the side venvs have no mfusepy) and runs _versions_smoke.py in
the side interpreter.

What the releases do plainly (measured, asserted below): up to 0.7 safetensors writes the
final name in place, without ftruncate, so a plain save on the hdfs kit *succeeds*; 0.8 (temp
file + ftruncate + rename) fails there with ENOSYS. Every release returns success from a
save onto the close-eio mount and the file is gone (close() unchecked): silent data loss,
which safestage turns into a PublishError that keeps the complete staged copy.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _helpers import HERE, PROJECT, clean_env, fresh_dir

pytestmark = pytest.mark.integration

# Newest release of each minor (pip index versions safetensors); all ship cp311 or abi3
# manylinux x86_64 wheels.
OLDER = ["0.7.0", "0.6.2", "0.5.3", "0.4.5"]
MAIN = "0.8.0"  # the dev venv's, pinned in .ci/constraints.txt
MATRIX = PROJECT / ".venv-matrix"
# safetensors < 0.8 imports packaging (0.6, 0.7) and numpy (0.4, 0.5) without requiring them.
BORROWED_PINS = ("torch", "wrapt", "numpy")
EXTRA_PINS = {"packaging": ".ci/constraints-clients.txt"}


def pins() -> list[str]:
    def read(path: str) -> dict[str, str]:
        lines = (PROJECT / path).read_text().splitlines()
        return {x.split("==")[0].strip().lower(): x.strip() for x in lines if "==" in x and not x.startswith("#")}

    main = read(".ci/constraints.txt")
    wanted = [main[name] for name in BORROWED_PINS]
    wanted += [read(path)[name] for name, path in EXTRA_PINS.items()]
    assert read(".ci/constraints.txt")["safetensors"] == f"safetensors=={MAIN}"
    return wanted


@pytest.fixture(scope="session")
def safestage_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    build = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "-o", str(out), str(PROJECT)],
        capture_output=True, text=True, timeout=600,
    )
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = out.glob("safestage-*.whl")
    return wheel


def run(step: list[str]) -> None:
    done = subprocess.run(step, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"building the side venv failed: {step}\n{done.stderr[-3000:]}"


@contextlib.contextmanager
def side_python(version: str, wheel: Path) -> Iterator[Path]:
    """The cached side venv for one safetensors release, (re)built when its recipe changed,
    with this tree's safestage. Held locked while in use: another engineer's run in the same
    tree may be reinstalling safestage into it."""
    venv = MATRIX / version
    python = venv / "bin" / "python"
    requirements = [f"safetensors=={version}", *pins()]
    recipe = hashlib.sha256("\n".join([sys.version, *requirements]).encode()).hexdigest()
    MATRIX.mkdir(exist_ok=True)
    with open(MATRIX / f".{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = venv / ".safestage-matrix-stamp"
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        if not (python.exists() and stamp.exists() and stamp.read_text() == recipe):
            run([sys.executable, "-m", "venv", "--clear", str(venv)])
            run([*pip, *requirements])
            stamp.write_text(recipe)
        run([*pip, "--no-deps", "--force-reinstall", str(wheel)])
        check = subprocess.run(
            [str(python), "-c", "import safetensors, torch, safestage; print(safetensors.__version__, torch.__version__)"],
            capture_output=True, text=True, timeout=300,
        )
        assert check.stdout.split() == [version, "2.13.0+cpu"], check.stdout + check.stderr
        yield python


@pytest.mark.parametrize("version", [MAIN, *OLDER])
def test_release(version, kit_mounts, shm_root, safestage_wheel):
    hdfs = fresh_dir(kit_mounts["hdfs"], f"st-{version}")
    close_eio = fresh_dir(kit_mounts["close-eio"], f"st-{version}")
    with contextlib.ExitStack() as stack:
        python = Path(sys.executable) if version == MAIN else stack.enter_context(side_python(version, safestage_wheel))
        smoke = subprocess.run(
            [str(python), str(HERE / "_versions_smoke.py"), str(hdfs), str(close_eio), str(shm_root)],
            env=clean_env(), cwd=shm_root, capture_output=True, text=True, timeout=300,
        )
    assert smoke.returncode == 0, smoke.stderr[-4000:]
    result = json.loads(smoke.stdout.strip().splitlines()[-1])
    assert result["version"] == version and result["torch"] == "2.13.0+cpu"

    staged = result["staged"]
    assert staged["strategies"] == ["replace"] * 3
    assert staged["file_equal"] and staged["model_equal"] and staged["numpy_equal"], staged
    assert staged["modes"] == ["0o644"]
    assert staged["listing"] == ["file.safetensors", "model.safetensors", "numpy.safetensors"]
    assert staged["root_left"] == []

    plain = result["plain_hdfs"]
    if version == MAIN:
        assert "os error 38" in plain["error"], plain  # ftruncate ENOSYS, safetensors#787
    else:
        assert plain == {"error": None, "equal": True, "mode": "0o644"}, plain  # in place, no ftruncate

    assert result["plain_close_eio"] == {"error": None, "exists": False}  # success reported, file lost
    loud = result["staged_close_eio"]
    assert loud["errno"] == 5 and "PublishError" in loud["error"] and loud["kept_equal"], loud
    assert os.listdir(close_eio) == []
