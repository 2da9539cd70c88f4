"""A new user's install works: a fresh virtualenv (no system site-packages) with
`pip install torch` and then the built wheel can save onto a hostile mount.

safetensors' torch API imports numpy to save but declares it only in its [torch] extra, so
the wheel must bring numpy itself. And `safestage doctor` on a Python that cannot save at all
blames the missing module, not the destination.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import safestage

pytestmark = pytest.mark.mounts

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / ".ci" / "constraints.txt"


def user_env(**extra: str) -> dict[str, str]:
    """What a user's shell has: none of the suite's PYTHONPATH or SAFESTAGE_* variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SAFESTAGE", "PYTHON"))}
    env.update(extra)
    return env


def run(args: list[str], cwd: Path, timeout: float = 900, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, env=user_env(**extra), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory: pytest.TempPathFactory, safestage_wheel: Path) -> Iterator[Path]:
    """A venv holding only `pip install torch==2.13.0` and `pip install <the wheel>`."""
    base = tmp_path_factory.mktemp("fresh")
    wheel = safestage_wheel
    assert wheel.name.startswith(f"safestage-{safestage.__version__}-"), wheel
    venv = base / "venv"
    created = run([sys.executable, "-m", "venv", str(venv)], base)
    assert created.returncode == 0, created.stderr
    python = venv / "bin" / "python"
    no_site = run([str(python), "-c", "import sys; print(sys.prefix != sys.base_prefix)"], base)
    assert no_site.stdout.strip() == "True"
    for what in (["torch==2.13.0"], [str(wheel)]):
        # --no-compile: byte-compiling torch's sources is most of an install's time, and no part
        # of what a user's install must do for the save to work
        install = run([str(python), "-m", "pip", "install", "-q", "--no-compile", "-c", str(CONSTRAINTS), *what], base)
        assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    yield venv


@pytest.fixture
def hdfs_dir(kit_mounts: dict[str, object]) -> Path:
    directory = Path(kit_mounts["hdfs"].path) / f"pkg-{os.urandom(4).hex()}"  # type: ignore[attr-defined]
    directory.mkdir()
    return directory


SAVE = textwrap.dedent(
    """
    import os, sys
    import torch
    from safetensors.torch import load_file, save_file
    import safestage

    target = sys.argv[1]
    tensors = {"weight": torch.arange(4096, dtype=torch.float32).reshape(64, 64)}
    with safestage.staged() as stage:
        save_file(tensors, target)
    assert torch.equal(load_file(target)["weight"], tensors["weight"])
    print(safestage.__version__, safestage.__file__, oct(os.stat(target).st_mode & 0o777), len(stage.records))
    """
)


def test_fresh_venv_with_torch_and_the_wheel_saves_onto_hdfs(fresh_venv, hdfs_dir, tmp_path):
    python = fresh_venv / "bin" / "python"
    script = tmp_path / "save.py"
    script.write_text(SAVE)
    target = hdfs_dir / "model.safetensors"
    result = run([str(python), str(script), str(target)], tmp_path, timeout=300, TMPDIR=str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    version, location, mode, records = result.stdout.split()
    assert version == safestage.__version__ and location.startswith(str(fresh_venv))
    assert mode == "0o644" and records == "1"
    assert os.listdir(hdfs_dir) == ["model.safetensors"]


@pytest.fixture
def venv_without_numpy(fresh_venv: Path, tmp_path: Path) -> Iterator[Path]:
    """The fresh venv after `pip uninstall numpy`: what `pip install safestage` gave before 0.2."""
    python = str(fresh_venv / "bin" / "python")
    removed = run([python, "-m", "pip", "uninstall", "-y", "-q", "numpy"], tmp_path)
    assert removed.returncode == 0, removed.stderr
    yield fresh_venv
    back = run([python, "-m", "pip", "install", "-q", "--no-compile", "-c", str(CONSTRAINTS), "numpy"], tmp_path)
    assert back.returncode == 0, back.stderr


def test_doctor_without_numpy_names_the_module_not_the_destination(venv_without_numpy, hdfs_dir, tmp_path):
    safestage = venv_without_numpy / "bin" / "safestage"
    result = run([str(safestage), "doctor", str(hdfs_dir)], tmp_path, timeout=300, TMPDIR=str(tmp_path))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "No module named 'numpy'" in result.stdout and "pip install numpy" in result.stdout
    assert "verdict" in result.stdout and "unknown" in result.stdout
    assert "unsafe" not in result.stdout and "staging is not possible" not in result.stdout
    assert "Traceback" not in result.stderr
    assert os.listdir(hdfs_dir) == []  # the probe directory is gone


SAVE_TO_BUCKET = textwrap.dedent(
    """
    import sys
    import torch
    from safetensors.torch import load, save_file
    import safestage
    from safestage import _object_store, _destination

    url = sys.argv[1]
    with safestage.staged():
        save_file({"weight": torch.arange(16.0)}, url)
    back = load(_object_store.read(_destination.url_of(url)))
    assert torch.equal(back["weight"], torch.arange(16.0))
    print("landed", url)
    """
)


def test_the_s3_extra_and_the_aws_variables_are_all_a_fresh_venv_needs_to_save_to_a_bucket(
    fresh_venv, safestage_wheel, tmp_path, monkeypatch
):
    """Without the extra, a URL save says what to install; with `pip install 'safestage[s3]'`
    and the standard AWS variables (a local S3 server here), it lands."""
    from _stores import new_bucket

    bucket = new_bucket(monkeypatch, "fresh")
    python = fresh_venv / "bin" / "python"
    script = tmp_path / "save.py"
    script.write_text(SAVE_TO_BUCKET)
    url = f"s3://{bucket}/run/model.safetensors"
    aws = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    before = run([str(python), str(script), url], tmp_path, timeout=300, TMPDIR=str(tmp_path), **aws)
    assert before.returncode != 0 and "pip install 'safestage[s3]'" in before.stderr, before.stderr[-2000:]
    install = run([str(python), "-m", "pip", "install", "-q", "--no-compile", "-c", str(CONSTRAINTS),
                   "-c", str(ROOT / ".ci" / "constraints-stores.txt"), f"{safestage_wheel}[s3]"], tmp_path)  # fmt: skip
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    after = run([str(python), str(script), url], tmp_path, timeout=300, TMPDIR=str(tmp_path), **aws)
    assert after.returncode == 0, after.stdout + after.stderr
    assert after.stdout.split() == ["landed", url]
