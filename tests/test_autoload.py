"""Zero-code activation: real interpreters started with SAFESTAGE_* in their environment.

The start-up hook is the installed safestage.pth (editable install in the dev venv; a built
wheel in a fresh venv in the last test).
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest
from _support import run_code

SAVE_SCRIPT = textwrap.dedent(
    """
    import os, stat, sys
    import torch
    from safetensors.torch import save_file, load_file
    dest = sys.argv[1]
    tensors = {"w": torch.arange(1000, dtype=torch.float32).reshape(10, 100), "i": torch.arange(7)}
    save_file(tensors, dest)
    back = load_file(dest)
    assert all(torch.equal(back[k], v) for k, v in tensors.items())
    import safestage
    print("active", safestage.is_active(), "mode", oct(stat.S_IMODE(os.stat(dest).st_mode)))
    """
)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    env.update(extra)
    return env


def run_python(args: list[str], env: dict[str, str], cwd: Path, python: str = sys.executable) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=180)


@pytest.fixture
def hdfs_dir(kit_mounts) -> Path:
    directory = Path(kit_mounts["hdfs"].path) / f"auto-{os.urandom(4).hex()}"
    directory.mkdir()
    return directory


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(SAVE_SCRIPT)
    return path


def test_unmodified_script_fails_without_and_succeeds_with_the_variable(script, hdfs_dir, shm_root, kit_mounts):
    dest = hdfs_dir / "model.safetensors"
    faults = sum(kit_mounts["hdfs"].faults().values())
    plain = run_python([str(script), str(dest)], clean_env(), script.parent)
    assert plain.returncode != 0
    assert "os error 38" in plain.stderr  # ENOSYS from ftruncate, safetensors#787
    assert sum(kit_mounts["hdfs"].faults().values()) > faults, "the ENOSYS fault never fired"

    staged = run_python([str(script), str(dest)], clean_env(SAFESTAGE_DIR=str(shm_root)), script.parent)
    assert staged.returncode == 0, staged.stderr
    assert "active True mode 0o644" in staged.stdout
    assert [name for name in os.listdir(hdfs_dir) if not name.startswith(".tmp")] == ["model.safetensors"]
    assert os.listdir(shm_root) == []


def test_spawned_child_is_staged_too(tmp_path, hdfs_dir, shm_root):
    program = tmp_path / "spawn.py"
    program.write_text(
        textwrap.dedent(
            f"""
            import multiprocessing as mp, runpy, sys
            def child(dest):
                sys.argv = ["train.py", dest]
                runpy.run_path({str(tmp_path / "train.py")!r}, run_name="__main__")
            if __name__ == "__main__":
                ctx = mp.get_context("spawn")
                proc = ctx.Process(target=child, args=(sys.argv[1],))
                proc.start(); proc.join()
                sys.exit(proc.exitcode)
            """
        )
    )
    (tmp_path / "train.py").write_text(SAVE_SCRIPT)
    dest = hdfs_dir / "spawned.safetensors"
    result = run_python([str(program), str(dest)], clean_env(SAFESTAGE_DIR=str(shm_root)), tmp_path)
    assert result.returncode == 0, result.stderr
    assert "active True mode 0o644" in result.stdout
    assert dest.exists()


def _importtime(env: dict[str, str], code: str, cwd: Path) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    result = run_python(["-X", "importtime", "-c", code], env, cwd)
    modules = [line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")]
    return result, modules


def test_unset_costs_no_import(tmp_path):
    result, modules = _importtime(clean_env(), "pass", tmp_path)
    assert result.returncode == 0
    assert modules, "importtime printed nothing: the check would prove nothing"
    assert not [m for m in modules if "safestage" in m or m in ("wrapt", "torch", "safetensors")]


def test_set_imports_no_torch_until_the_program_does(tmp_path, shm_root):
    code = "import sys; print(sorted(m for m in ('torch', 'safetensors', 'safetensors.torch') if m in sys.modules))"
    result, modules = _importtime(clean_env(SAFESTAGE_DIR=str(shm_root)), code, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    assert "safestage._autoload" in modules  # the hook did run
    assert "torch" not in modules and "safetensors" not in modules


@pytest.mark.slow
@pytest.mark.parametrize(
    ("variables", "needle"),
    [
        ({"SAFESTAGE": "1", "SAFESTAGE_PUBLISH": "bogus"}, "SAFESTAGE_PUBLISH"),
        ({"SAFESTAGE_DIR": "{file}"}, "SAFESTAGE_DIR"),
        ({"SAFESTAGE_DIR": "{readonly}"}, "SAFESTAGE_DIR"),
        ({"SAFESTAGE_DIR": "{missing}"}, "SAFESTAGE_DIR"),
        ({"SAFESTAGE": "maybe"}, "SAFESTAGE"),
        ({"SAFESTAGE_DIR": "{shm}", "SAFESTAGE_BACKGROUND": "sometimes"}, "background='sometimes' from SAFESTAGE_BACKGROUND"),
        ({"SAFESTAGE_DIR": "{shm}", "SAFESTAGE_SKIP_LOCAL_DISK": "2"}, "skip_local_disk='2' from SAFESTAGE_SKIP_LOCAL_DISK"),
        # removed in 0.2: the line names the variable, its value and what to write instead
        ({"SAFESTAGE_DIR": "{shm}", "SAFESTAGE_MAX_PENDING": "4"}, "SAFESTAGE_MAX_PENDING='4' is removed in safestage 0.2: write SAFESTAGE_BACKGROUND=4 instead"),
        ({"SAFESTAGE_DIR": "{shm}", "SAFESTAGE_WHEN": "auto"}, "SAFESTAGE_WHEN='auto' is removed in safestage 0.2: write SAFESTAGE_SKIP_LOCAL_DISK=1 instead"),
        ({"SAFESTAGE_DIR": "{shm}", "SAFESTAGE_FSYNC": "0"}, "SAFESTAGE_FSYNC='0' is removed in safestage 0.2: unset it; to turn durability off, pass fsync=False"),
        ({"SAFESTAGE": "1", "SAFESTAGE_FOLLOW": "1"}, "SAFESTAGE_FOLLOW='1' is removed in safestage 0.2: unset it"),
    ],
)
def test_bad_values_warn_once_and_run_on(tmp_path, shm_root, variables, needle):
    """A bad or removed variable: ONE line on stderr (whether or not the program configures
    logging), the script runs on, unstaged. Running unstaged onto a hostile mount is a lost
    save: the line must be seen."""
    (tmp_path / "file").write_text("not a directory")
    readonly = tmp_path / "ro"
    readonly.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(readonly)], check=True)
    try:
        values = {
            k: v.format(file=tmp_path / "file", readonly=readonly, missing=tmp_path / "nope", shm=shm_root)
            for k, v in variables.items()
        }
        (tmp_path / "train.py").write_text(SAVE_SCRIPT)
        result = run_python([str(tmp_path / "train.py"), str(tmp_path / "out.safetensors")], clean_env(**values), tmp_path)
    finally:
        subprocess.run(["umount", "-l", str(readonly)], check=False)
    assert result.returncode == 0, result.stderr
    assert "active False" in result.stdout  # saves unstaged, program ran on
    lines = [line for line in result.stderr.splitlines() if line.startswith("safestage:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert lines[0].startswith("safestage: WARNING: ") and needle in lines[0], lines[0]
    assert lines[0].endswith("safetensors saves in this process are not staged"), lines[0]


def test_the_line_is_printed_also_when_the_program_configured_logging(tmp_path, shm_root):
    """Not only a log record: a program whose logging goes elsewhere (a file, a collector)
    still shows the one line on stderr; its own handler gets the record, once."""
    code = textwrap.dedent(
        f"""
        import io, logging
        buffer = io.StringIO()
        logging.basicConfig(stream=buffer)
        from safestage._autoload import start_from_environment
        print(start_from_environment({{"SAFESTAGE_DIR": {str(shm_root)!r}, "SAFESTAGE_MAX_PENDING": "3"}}))
        print(buffer.getvalue().count("SAFESTAGE_MAX_PENDING"))
        """
    )
    result = run_python(["-c", code], clean_env(), tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["None", "1"]
    (line,) = result.stderr.splitlines()
    assert "SAFESTAGE_MAX_PENDING='3' is removed" in line and "SAFESTAGE_BACKGROUND=3" in line, line


@pytest.mark.slow
def test_switch_off_wins_and_switch_on_uses_default_root(tmp_path, shm_root):
    (tmp_path / "train.py").write_text(SAVE_SCRIPT)
    args = [str(tmp_path / "train.py"), str(tmp_path / "out.safetensors")]
    off = run_python(args, clean_env(SAFESTAGE="0", SAFESTAGE_DIR=str(shm_root)), tmp_path)
    assert "active False" in off.stdout and off.stderr == ""
    on = run_python(args, clean_env(SAFESTAGE="1", TMPDIR=str(shm_root)), tmp_path)
    assert "active True" in on.stdout, on.stderr
    assert (shm_root / f"safestage-{os.getuid()}").is_dir()
    blank = run_python(args, clean_env(SAFESTAGE_DIR="   "), tmp_path)
    assert "active False" in blank.stdout and blank.stderr == ""


def test_hook_is_idempotent(tmp_path, shm_root):
    code = textwrap.dedent(
        """
        import site, sysconfig, _safestage_startup
        from safestage import _patch
        _safestage_startup.start()
        site.addsitedir(sysconfig.get_paths()["purelib"])  # runs safestage.pth again
        print(len(_patch._active))
        """
    )
    result = run_python(["-c", code], clean_env(SAFESTAGE_DIR=str(shm_root)), tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "1"


def test_built_wheel_in_a_fresh_venv(tmp_path, hdfs_dir, shm_root, safestage_wheel):
    """Not only the editable install: the wheel must place the hook in site-packages."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    wheel = safestage_wheel
    install = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
        capture_output=True, text=True, timeout=300,
    )
    assert install.returncode == 0, install.stderr
    # torch, safetensors and wrapt come from the dev venv as a plain path entry (its own .pth
    # files, including the editable safestage, are not processed from there).
    purelib = Path(subprocess.check_output([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    assert (purelib / "safestage.pth").exists() and (purelib / "safestage.start").exists()
    # named to sort before safestage.pth: .pth files run in name order
    (purelib / "aa_dev_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    (tmp_path / "train.py").write_text(SAVE_SCRIPT + "\nprint('from', safestage.__file__)\n")
    dest = hdfs_dir / "wheel.safetensors"
    env = {k: v for k, v in clean_env(SAFESTAGE_DIR=str(shm_root)).items() if k != "PYTHONPATH"}  # else safestage comes from there
    result = run_python([str(tmp_path / "train.py"), str(dest)], env, tmp_path, python=python)
    assert result.returncode == 0, result.stderr
    assert "active True mode 0o644" in result.stdout
    assert f"from {purelib}" in result.stdout


@pytest.mark.regression("0.1 hostile review 1: the start up hook imports wrapt eagerly")
def test_the_start_up_hook_imports_no_wrapt_until_the_program_imports_safetensors(shm_root):
    """README (Environment): with a SAFESTAGE variable set the hook "imports no torch,
    safetensors or wrapt eagerly but patches when the program first imports
    safetensors.torch". Activation registers the post-import hooks through wrapt, so every
    Python process of the job imports wrapt - and with it asyncio - at start-up (~80 ms of
    the ~0.3 s the hook adds to `python -c pass` here), including the many processes that
    never save. Documentation promises more than the code does."""
    done = run_code("import sys; print('wrapt' in sys.modules, 'asyncio' in sys.modules)",
                      env={"SAFESTAGE_DIR": str(shm_root)})  # fmt: skip
    assert done.stdout.split() == ["False", "False"], (done.stdout, done.stderr[-300:])
