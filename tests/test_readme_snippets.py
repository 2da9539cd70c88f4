"""README's snippets run as written, against real hostile FUSE mounts of the kit.

Each snippet is the fenced block after a ``<!-- snippet: NAME -->`` marker in README.md. Only
the example paths are substituted (``/mnt/hdfs/run42``: a fresh directory on a kit mount,
``/local/scratch``: a local staging root); each runs in a subprocess of its own, and the test
checks what a user would: the bytes load back equal, the listing holds no temp file, and
``latest_complete`` names the newest checkpoint.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.mounts

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DEST = "/mnt/hdfs/run42"
SCRATCH = "/local/scratch"
_SNIPPET = re.compile(r"<!-- snippet: (\S+) -->\n```(\w+)\n(.*?)\n```", re.S)


def snippets() -> dict[str, str]:
    return {name: body for name, _lang, body in _SNIPPET.findall(README.read_text())}


def substituted(name: str, dest: Path | None = None, scratch: Path | None = None) -> str:
    body = snippets()[name]
    if dest is not None:
        assert DEST in body, f"README snippet {name!r} no longer writes to the example path {DEST}"
        body = body.replace(DEST, str(dest))
    if scratch is not None:
        assert SCRATCH in body, f"README snippet {name!r} no longer names {SCRATCH}"
        body = body.replace(SCRATCH, str(scratch))
    return body


def environment(tmp_path: Path) -> dict[str, str]:
    """A user's environment: no SAFESTAGE_* variable, this tree importable, ``python`` on
    PATH being the interpreter of the test run, a private TMPDIR (the default staging root)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    bin_dir = Path(sys.executable).parent  # a venv's bin/ has its `python`
    assert (bin_dir / "python").exists(), f"no `python` beside {sys.executable}"
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    env["TMPDIR"] = str(tmp)
    return env


def run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        args, cwd=tmp_path, env=environment(tmp_path), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def fresh_dir(kit_mounts: dict[str, object], mode: str, name: str) -> Path:
    directory = Path(kit_mounts[mode].path) / name  # type: ignore[attr-defined]
    directory.mkdir()
    return directory


def assert_loads_back(path: Path, expected: dict[str, object]) -> None:
    import torch
    from safetensors.torch import load_file

    back = load_file(str(path))
    assert sorted(back) == sorted(expected)
    for key, value in expected.items():
        assert torch.equal(back[key], value)  # type: ignore[arg-type]
    assert oct(os.stat(path).st_mode & 0o777) == "0o644"


def test_readme_starts_with_the_two_setup_commands_that_ci_runs():
    text = README.read_text()
    assert text.startswith("```bash\nbash .ci/dev demo\nbash .ci/dev test\n```\n")
    assert "bash .ci/dev test" in (ROOT / ".ci" / "run").read_text()
    assert set(snippets()) == {"save_file", "train.py", "shell", "staged_dir"}
    assert len(text.splitlines()) <= 200


@pytest.mark.parametrize("mode", ["hdfs", "mountpoint"])
def test_readme_with_block_around_save_file_lands_on_the_mount(kit_mounts, tmp_path, mode):
    dest = fresh_dir(kit_mounts, mode, f"readme-{os.urandom(4).hex()}")
    script = tmp_path / "snippet.py"
    script.write_text(substituted("save_file", dest))
    run([sys.executable, str(script)], tmp_path)
    assert os.listdir(dest) == ["model.safetensors"]  # no temp file of anyone's
    import torch
    from safetensors.torch import load_file

    back = load_file(str(dest / "model.safetensors"))
    assert sorted(back) == ["embed.weight", "norm.weight"]
    assert back["embed.weight"].shape == (1024, 256) and torch.equal(back["norm.weight"], torch.ones(256))
    assert oct(os.stat(dest / "model.safetensors").st_mode & 0o777) == "0o644"


def test_readme_train_py_is_staged_by_safestage_dir_alone(kit_mounts, tmp_path):
    import torch

    dest = fresh_dir(kit_mounts, "hdfs", f"readme-{os.urandom(4).hex()}")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (tmp_path / "train.py").write_text(substituted("train.py", dest))
    shell = substituted("shell", scratch=scratch)
    assert "SAFESTAGE_DIR=" in shell and "python train.py" in shell
    result = run(["bash", "-euo", "pipefail", "-c", shell], tmp_path)
    assert result.stdout.strip() == "saved"
    assert os.listdir(dest) == ["model.safetensors"]
    assert_loads_back(dest / "model.safetensors", {"weight": torch.zeros(256, 256)})
    # The plain save of the same script fails on this mount (safetensors#787): staging did it.
    plain = subprocess.run(
        [sys.executable, "train.py"], cwd=tmp_path, env=environment(tmp_path),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert plain.returncode != 0 and "os error 38" in plain.stderr


@pytest.mark.parametrize("mode", ["hdfs", "mountpoint"])
def test_readme_staged_dir_then_latest_complete_finds_the_newest(kit_mounts, tmp_path, mode):
    import torch

    import safestage

    dest = fresh_dir(kit_mounts, mode, f"readme-{os.urandom(4).hex()}")
    script = tmp_path / "snippet.py"
    script.write_text(substituted("staged_dir", dest))
    result = run([sys.executable, str(script)], tmp_path)
    assert result.stdout.strip() == str(dest / "checkpoint-2000")
    assert sorted(os.listdir(dest)) == ["checkpoint-1000", "checkpoint-2000"]
    for step in (1000, 2000):
        checkpoint = dest / f"checkpoint-{step}"
        assert sorted(os.listdir(checkpoint)) == sorted(
            ["model.safetensors", "trainer_state.json", safestage.COMMIT_NAME]
        )
        assert_loads_back(checkpoint / "model.safetensors", {"weight": torch.full((256, 256), step)})
        assert safestage.verify(checkpoint, deep=True).complete
    assert safestage.latest_complete(dest) == dest / "checkpoint-2000"
    # The staging root (TMPDIR's default) keeps nothing once the commits returned.
    leftovers = [p for p in (tmp_path / "tmp").rglob("*") if p.is_file()]
    assert leftovers == []
