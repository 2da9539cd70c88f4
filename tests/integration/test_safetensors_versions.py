"""safestage against the newest release of every safetensors minor from 0.4 to 0.8: in CI the
endpoints of the range pyproject.toml declares (0.8.0, and 0.4.5 with the 0.4-0.7 dict specs),
every release in the long tier (SAFESTAGE_LONG=1; CONTRIBUTING.md).

0.8.0 runs in the dev venv; each older release gets a side venv cached under
<project>/.venv-matrix/<version> holding safetensors==<version> and packaging; torch, wrapt and
numpy (the pinned versions of .ci/constraints.txt) come from the dev venv through a path entry
placed after the side venv's own site-packages, so that a fresh clone installs no torch per
release (four torch installs took most of this file's time). safestage itself is built as a
wheel from this tree once per session and reinstalled into each side venv on every run, so
the cache never tests stale code.
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
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest
from _helpers import HERE, PROJECT, clean_env, fresh_dir
from _support import tiered

pytestmark = pytest.mark.integration

# Newest release of each minor (pip index versions safetensors); all ship cp311 or abi3
# manylinux x86_64 wheels.
OLDER = ["0.7.0", "0.6.2", "0.5.3", "0.4.5"]
MAIN = "0.8.0"  # the dev venv's, pinned in .ci/constraints.txt
MATRIX = PROJECT / ".venv-matrix"
# safetensors < 0.8 imports packaging (0.6, 0.7) and numpy (0.4, 0.5) without requiring them.
# torch, wrapt and numpy are borrowed from the dev venv (its purelib as a path entry: the pinned
# versions, asserted below); packaging is installed in the side venv.
BORROWED_PINS = ("torch", "wrapt", "numpy")
EXTRA_PINS = {"packaging": ".ci/constraints-clients.txt"}
DEV_PURELIB = sysconfig.get_paths()["purelib"]
BORROWED = "aa_dev_venv.pth"  # torch, wrapt, numpy of the dev venv; its own .pth files are not run


def _read_pins(path: str) -> dict[str, str]:
    lines = (PROJECT / path).read_text().splitlines()
    return {x.split("==")[0].strip().lower(): x.strip() for x in lines if "==" in x and not x.startswith("#")}


def pins() -> list[str]:
    """What the side venv installs itself: safetensors' undeclared packaging."""
    assert _read_pins(".ci/constraints.txt")["safetensors"] == f"safetensors=={MAIN}"
    return [_read_pins(path)[name] for name, path in EXTRA_PINS.items()]


def borrowed_pins() -> list[str]:
    main = _read_pins(".ci/constraints.txt")
    return [main[name] for name in BORROWED_PINS]


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
    recipe = hashlib.sha256("\n".join([sys.version, *requirements, DEV_PURELIB]).encode()).hexdigest()
    MATRIX.mkdir(exist_ok=True)
    with open(MATRIX / f".{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stamp = venv / ".safestage-matrix-stamp"
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        if not (python.exists() and stamp.exists() and stamp.read_text() == recipe):
            run([sys.executable, "-m", "venv", "--clear", str(venv)])
            run([*pip, "--no-deps", *requirements])
            purelib = subprocess.check_output(
                [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True, timeout=120
            ).strip()
            (Path(purelib) / BORROWED).write_text(DEV_PURELIB + "\n")
            stamp.write_text(recipe)
        run([*pip, "--no-deps", "--force-reinstall", str(wheel)])
        check = subprocess.run(
            [str(python), "-c", "import numpy, safetensors, torch, wrapt, safestage; "
             "print(safetensors.__version__, safetensors.__file__, safestage.__file__, "
             "f'torch=={torch.__version__}', f'wrapt=={wrapt.__version__}', f'numpy=={numpy.__version__}')"],
            env=clean_env(), capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        got = check.stdout.split()
        assert len(got) == 6, check.stdout + check.stderr
        # the release under test and the wheel come from the side venv, not the dev venv's
        assert got[0] == version and got[1].startswith(str(venv)), got
        assert got[3:] == [pin.replace("torch==2.13.0", "torch==2.13.0+cpu") for pin in borrowed_pins()], got
        yield python


@pytest.mark.parametrize("version", tiered([MAIN, *OLDER], ci=[MAIN, OLDER[-1]]))
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
