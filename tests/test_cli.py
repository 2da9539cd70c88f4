"""The `safestage` command: doctor, run, status, clean, as a user runs them.

Real `python -m safestage` processes (the tree on PYTHONPATH) against real destinations: the
local disk, /dev/shm and every hostile FUSE mode of safestage.testing (mounted once per
session by conftest's kit_mounts; a machine without FUSE fails these tests, never skips).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import pytest
from _support import PY, REAL, SHM, entries

import safestage
from safestage import cli as _cli
from safestage._names import _HOST, doctor_dir_name, parse_doctor_dir
from safestage.testing import hostile_mount

REPO = Path(__file__).resolve().parents[1]


def clean_env(**overrides: str) -> dict[str, str]:
    """The test's environment without SAFESTAGE_* variables, importing this tree."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(overrides)
    return env


def safestage_cli(
    *args: str, env: Optional[dict[str, str]] = None, cwd: Optional[Path] = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "safestage", *args],
        env=clean_env() if env is None else env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def doctor_json(
    path: Path, root: Path, env: Optional[dict[str, str]] = None
) -> tuple[int, dict[str, Any]]:
    result = safestage_cli("doctor", str(path), "--dir", str(root), "--json", env=env)
    assert result.stdout.strip(), result.stderr
    return result.returncode, json.loads(result.stdout)


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every entry of ``directory`` with its bytes: what "never touch other files" means."""
    return {
        str(p.relative_to(directory)): (p.read_bytes() if p.is_file() else b"<dir>")
        for p in sorted(directory.rglob("*"))
    }


@pytest.fixture
def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.fixture
def live_pid() -> Iterator[int]:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield child.pid
    child.kill()
    child.wait()


@pytest.fixture(scope="session")
def doctor_mounts(kit_mounts: dict[str, Any]) -> dict[str, Any]:
    """Every kit mode, mounted once per session (conftest's kit_mounts: FUSE missing fails)."""
    return kit_mounts


# -- doctor: the expected answers per destination ----------------------------------------------

OK_STEPS = {step: "ok" for step in ("create", "write", "ftruncate", "fsync", "close", "rename",
                                    "replace", "chmod", "o_trunc", "out_of_order", "read_back")}  # fmt: skip

# destination -> (steps that are not "ok", plain save, staged save, recommended publish or None,
#                 verdict, exit status, kit faults that must have fired)
EXPECTED: dict[str, dict[str, Any]] = {
    "hdfs": dict(
        steps={"ftruncate": "ENOSYS"},  # safetensors#787
        plain=("failed", "ENOSYS"), staged=("ok", "replace"), publish="auto",
        verdict="needs-staging", status=1, faults={"ftruncate"},
    ),
    "eopnotsupp": dict(
        steps={"ftruncate": "EOPNOTSUPP"},  # safetensors#842
        plain=("failed", "EOPNOTSUPP"), staged=("ok", "replace"), publish="auto",
        verdict="needs-staging", status=1, faults={"ftruncate"},
    ),
    "objectstore": dict(
        steps={"ftruncate": "EPERM", "out_of_order": "EPERM"},
        plain=("failed", "EPERM"), staged=("ok", "replace"), publish="auto",
        verdict="needs-staging", status=1, faults={"ftruncate", "write"},
    ),
    "mountpoint": dict(
        steps={"ftruncate": "EPERM", "rename": "ENOSYS", "replace": "ENOSYS", "chmod": "EPERM",
               "out_of_order": "EINVAL"},  # safetensors#792
        plain=("failed", "EPERM"), staged=("ok", "direct"), publish="direct",
        verdict="needs-staging", status=1, faults={"ftruncate", "rename", "chmod", "write"},
    ),
    "close-eio": dict(
        # even the empty files the rename, replace and chmod steps start from fail at close
        steps={"fsync": "EIO", "close": "EIO", "read_back": "ENOENT", "o_trunc": "skipped",
               "rename": "skipped", "replace": "skipped", "chmod": "skipped"},
        plain=("data-loss", None), staged=("failed", None), publish=None,
        verdict="unsafe", status=1, faults={"fsync", "flush"},
    ),
    "slow": dict(steps={}, plain=("ok", None), staged=("ok", "replace"), publish=None,
                 verdict="plain-ok", status=0, faults=set()),
    "passthrough": dict(steps={}, plain=("ok", None), staged=("ok", "replace"), publish=None,
                        verdict="plain-ok", status=0, faults=set()),
    # the staging root on the same disk: publishing is a rename, no copy
    "disk": dict(steps={}, plain=("ok", None), staged=("ok", "rename"), publish=None,
                 verdict="plain-ok", status=0, faults=set()),
    # /dev/shm is another device than the staging root on disk: publishing copies
    "shm": dict(steps={}, plain=("ok", None), staged=("ok", "replace"), publish=None,
                verdict="plain-ok", status=0, faults=set()),
    # The real mounts (safestage.testing.real_mount; rclone 1.60.1 --vfs-cache-mode off, s3fs
    # 1.90, a local S3 server). rclone: no resize without a write cache, writes only at the
    # end of the file (a gap is waited for 1 s, then ESPIPE). Its "chmod ok" is only what the
    # call returned: rclone ignores it, every file stays 0644 (test_real_mounts).
    "rclone-local": dict(
        steps={"ftruncate": "EPERM", "out_of_order": "ESPIPE"},
        plain=("failed", "EPERM"), staged=("ok", "replace"), publish="auto",
        verdict="needs-staging", status=1, faults=set(),
    ),
    "rclone-s3": dict(
        steps={"ftruncate": "EPERM", "out_of_order": "ESPIPE"},
        plain=("failed", "EPERM"), staged=("ok", "replace"), publish="auto",
        verdict="needs-staging", status=1, faults=set(),
    ),
    # s3fs keeps a local copy of every open file: every probe works, and so does a plain save,
    # with its 0600 mode (#782).
    "s3fs": dict(steps={}, plain=("ok", None), staged=("ok", "replace"), publish=None,
                 verdict="plain-ok", status=0, faults=set()),
}  # fmt: skip


@pytest.fixture
def destination(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, Path, Any]]:
    """A fresh directory on the destination named by the test parameter, with a file of the
    user's in it; yields (name, directory, kit or real mount, or None)."""
    name = request.param
    if name == "disk":
        directory, mount = tmp_path / "dest", None
    elif name == "shm":
        directory, mount = SHM / f"safestage-test-{uuid.uuid4().hex[:8]}", None
    else:
        mounts = request.getfixturevalue("real_mounts" if name in REAL else "doctor_mounts")
        mount = mounts[name]
        directory = Path(mount.path) / f"doctor-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    if name != "close-eio":  # close-eio discards every written file: leave it empty
        (directory / "model.safetensors").write_bytes(b"the user's file, not the doctor's")
    yield name, directory, mount
    if name == "shm":
        import shutil

        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.mounts
@pytest.mark.parametrize("destination", list(EXPECTED), indirect=True)
def test_doctor_answers_per_destination(destination, stage_root):
    name, directory, mount = destination
    expected = EXPECTED[name]
    before = snapshot(directory)
    faults_before = mount.faults() if mount else {}

    status, report = doctor_json(directory, stage_root)

    assert report["probe"]["steps"] == {**OK_STEPS, **expected["steps"]}, report["probe"]["details"]
    plain_result, plain_errno = expected["plain"]
    assert (report["plain_save"]["result"], report["plain_save"]["errno"]) == (
        plain_result,
        plain_errno,
    ), report["plain_save"]
    staged_result, strategy = expected["staged"]
    assert report["staged_save"]["result"] == staged_result, report["staged_save"]
    if staged_result == "ok":
        assert report["staged_save"]["strategy"] == strategy
        assert report["staged_save"]["mode"] == "0644"  # 0o666 & ~umask 022, not 0600 (#782)
    if plain_result == "ok":
        assert report["plain_save"]["mode"] == "0600"  # safetensors#782, reported as such
        assert "safetensors#782" in report["recommendation"]["text"]
    if expected["publish"] is None:
        assert report["recommendation"]["env"] == {}
    else:
        assert report["recommendation"]["env"] == {
            "SAFESTAGE_DIR": str(stage_root),
            "SAFESTAGE_PUBLISH": expected["publish"],
        }
    assert report["verdict"] == expected["verdict"]
    assert status == expected["status"]
    assert bool(report["problems"]) == bool(status)
    assert report["mount"]["is_fuse"] == (mount is not None)
    assert report["staging"]["usable"] and report["staging"]["same_device"] == (
        expected["staged"][1] == "rename"
    )

    # It cleaned up completely and touched nothing else: not in PATH, not in the staging root.
    assert report["cleanup"] == {"removed": True, "error": None}
    assert not Path(report["probe"]["dir"]).exists()
    assert snapshot(directory) == before
    assert os.listdir(stage_root) == []
    if mount is not None:
        fired = {
            name for name, count in mount.faults().items() if count > faults_before.get(name, 0)
        }
        assert expected["faults"] <= fired, mount.faults()
    if name in REAL:
        # What the store holds, not the mount's view: rclone uploads an empty file at the
        # kernel's FUSE RELEASE, after close() returned, so a removed one could come back.
        time.sleep(1.0)
        assert snapshot(directory) == before
        prefix = f"{directory.relative_to(mount.path).as_posix()}/"
        assert [o for o in mount.objects() if o.startswith(prefix) and o != prefix] == [
            f"{prefix}model.safetensors"
        ]
    elif mount is not None:
        assert not list(Path(mount.backing).glob(f"{directory.name}/.safestage-doctor-*"))


def test_doctor_close_eio_says_the_destination_loses_data(doctor_mounts, stage_root):
    directory = Path(doctor_mounts["close-eio"].path) / f"doctor-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    result = safestage_cli("doctor", str(directory), "--dir", str(stage_root))
    assert result.returncode == 1
    assert "DATA LOSS" in result.stdout  # the plain save "succeeded"
    assert "loses data at close" in result.stdout
    assert "PublishError" in result.stdout
    _, report = doctor_json(directory, stage_root)
    assert (report["staged_save"]["errno"], report["staged_save"]["step"]) == ("EIO", "fsync")
    assert os.listdir(directory) == [] and os.listdir(stage_root) == []


def test_doctor_human_table_for_mountpoint(doctor_mounts, stage_root):
    directory = Path(doctor_mounts["mountpoint"].path) / f"doctor-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    result = safestage_cli("doctor", str(directory), "--dir", str(stage_root))
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"safestage doctor {directory}"
    column = next(line for line in lines if line.startswith("  create")).index("ok")
    rows = {
        line[:column].strip(): line[column:]
        for line in lines[1:]
        if line.startswith("  ") and line[:column].strip()
    }
    assert {"mount", "staging root", "plain save", "staged save", "verdict", "recommended"} <= set(
        rows
    )
    assert all(not value.startswith(" ") for value in rows.values())  # one aligned value column
    assert rows["rename"].startswith("ENOSYS") and rows["chmod"].startswith("EPERM")
    assert rows["out-of-order"].startswith("EINVAL") and rows["ftruncate"].startswith("EPERM")
    assert "fuse.safestage" in rows["mount"] and "safestage-mountpoint" in rows["mount"]
    assert rows["staged save"].startswith("ok  (direct,")
    assert rows["recommended"] == f"SAFESTAGE_DIR={stage_root} SAFESTAGE_PUBLISH=direct"
    assert os.listdir(directory) == []


def test_doctor_json_keys_are_stable(tmp_path, stage_root, capsys):
    assert _cli.main(["doctor", str(tmp_path), "--dir", str(stage_root), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report) == [
        "schema", "path", "mount", "staging", "probe", "plain_save", "staged_save", "cleanup",
        "verdict", "problems", "recommendation",
    ]  # fmt: skip
    assert report["schema"] == 1 and report["path"] == str(tmp_path)
    assert set(report["mount"]) == {"mount_point", "fs_type", "source", "is_fuse", "is_network"}
    assert set(report["staging"]) == {
        "root",
        "source",
        "usable",
        "error",
        "fs_type",
        "same_device",
        "publish",
        "fsync",
    }
    assert set(report["probe"]) == {"dir", "error", "steps", "details"}
    for save in ("plain_save", "staged_save"):
        assert set(report[save]) == {"result", "error", "errno", "step", "mode", "strategy"}
    assert set(report["recommendation"]) == {"env", "text"}
    assert report["staging"]["source"] == "--dir"
    assert parse_doctor_dir(Path(report["probe"]["dir"]).name) is not None  # `clean` knows it


def test_doctor_reports_an_unusable_staging_root(tmp_path, doctor_mounts):
    dest = tmp_path / "dest"
    dest.mkdir()
    for root, needle in (
        (tmp_path / "missing", "does not exist"),
        (Path(doctor_mounts["passthrough"].path), "fuse"),
    ):
        status, report = doctor_json(dest, root)
        assert status == 1
        assert not report["staging"]["usable"] and needle in report["staging"]["error"]
        assert report["staged_save"]["result"] == "not-run"
        assert report["plain_save"]["result"] == "ok" and report["verdict"] == "plain-ok"
        assert any("staging is not possible" in problem for problem in report["problems"])
        assert os.listdir(dest) == []
    assert not (tmp_path / "missing").exists()  # an explicit root is never created


@pytest.mark.slow
def test_doctor_uses_safestage_dir_and_reports_a_bad_variable(tmp_path, stage_root):
    dest = tmp_path / "dest"
    dest.mkdir()
    env = clean_env(SAFESTAGE_DIR=str(stage_root), SAFESTAGE_PUBLISH="sideways")
    result = safestage_cli("doctor", str(dest), "--json", env=env)
    report = json.loads(result.stdout)
    assert result.returncode == 1
    assert (report["staging"]["root"], report["staging"]["source"]) == (
        str(stage_root),
        "SAFESTAGE_DIR",
    )
    assert any("SAFESTAGE_PUBLISH" in problem for problem in report["problems"])
    assert report["staged_save"]["result"] == "ok"  # probed with the default publish instead


@pytest.mark.slow
def test_doctor_plain_save_is_unstaged_even_when_staging_is_on(tmp_path, stage_root):
    """SAFESTAGE=1 activates staging in the doctor's own process: its plain save must not be
    staged anyway, or it would hide the failure it is there to show."""
    dest = tmp_path / "dest"
    dest.mkdir()
    env = clean_env(SAFESTAGE="1", SAFESTAGE_DIR=str(stage_root))
    status, report = doctor_json(dest, stage_root, env=env)
    assert report["plain_save"]["mode"] == "0600"  # the raw safetensors 0.8 writer ran
    assert report["staged_save"]["mode"] == "0644"
    assert status == 0


def test_doctor_on_a_read_only_destination(tmp_path, stage_root):
    target = tmp_path / "ro"
    target.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(target)], check=True)
    try:
        status, report = doctor_json(target, stage_root)
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)
    assert status == 1 and report["verdict"] == "unknown"
    assert "EROFS" in report["probe"]["error"]
    assert report["plain_save"]["result"] == "not-run"


def test_doctor_usage_errors(tmp_path):
    missing = safestage_cli("doctor", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    a_file = tmp_path / "f"
    a_file.write_text("x")
    assert safestage_cli("doctor", str(a_file)).returncode == 2
    assert safestage_cli("doctor").returncode == 2
    assert safestage_cli("doctor", str(tmp_path), "--dir", "").returncode == 2


def test_doctor_cleanup_failure_is_reported(tmp_path):
    """Some mounts refuse unlink: the report says what is left and how to remove it."""
    from safestage.cli._doctor import _remove_probe

    probe = tmp_path / doctor_dir_name()
    probe.mkdir()
    stuck = probe / "stuck"
    stuck.write_text("x")
    subprocess.run(["chattr", "+i", str(stuck)], check=True)  # unlink -> EPERM, even for root
    try:
        report = _remove_probe(probe, [])
    finally:
        subprocess.run(["chattr", "-i", str(stuck)], check=True)
    assert not report.removed
    assert (
        "EPERM" in report.error and "safestage clean" in report.error and str(probe) in report.error
    )


def test_doctor_step_timeout():
    from safestage.cli._doctor import ProbeReport, _Recorder

    probe = ProbeReport(dir="-")
    started = time.monotonic()
    assert not _Recorder(probe, timeout=0.2).run("write", lambda: time.sleep(10))
    assert time.monotonic() - started < 5
    assert probe.steps["write"] == "timeout"
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


# -- run ---------------------------------------------------------------------------------------

PRINT_ENV = "import os, json; print(json.dumps({k: v for k, v in os.environ.items() if k.startswith('SAFESTAGE')}))"


def test_run_sets_the_environment(tmp_path):
    (tmp_path / "stage").mkdir()
    result = safestage_cli(
        "run",
        "--dir",
        "stage",
        "--publish",
        "DIRECT",
        "--background",
        "4",
        "--skip-local-disk",
        "--torch-save",
        "--",
        sys.executable,
        "-c",
        PRINT_ENV,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen == {
        "SAFESTAGE": "1",
        "SAFESTAGE_DIR": str(tmp_path / "stage"),  # absolute: the child may chdir
        "SAFESTAGE_PUBLISH": "direct",
        "SAFESTAGE_BACKGROUND": "4",
        "SAFESTAGE_SKIP_LOCAL_DISK": "1",
        "SAFESTAGE_TORCH_SAVE": "1",
    }


def test_run_without_dir_switches_on_the_default_root():
    result = safestage_cli("run", sys.executable, "-c", PRINT_ENV, env=clean_env(SAFESTAGE="0"))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"SAFESTAGE": "1"}  # an inherited SAFESTAGE=0 is overridden


def test_run_passes_exit_status_and_signals():
    assert safestage_cli("run", "--", sys.executable, "-c", "raise SystemExit(7)").returncode == 7
    killed = safestage_cli(
        "run", "--", sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"
    )
    # `safestage run` execs CMD: a signal that kills CMD kills "it", as if CMD ran alone
    # (a shell shows 128 + N). main() called in-process returns 128 + N (next test).
    assert killed.returncode == -signal.SIGTERM
    missing = safestage_cli("run", "--", "no-such-command-safestage")
    assert missing.returncode == 127 and "command not found" in missing.stderr


def test_run_in_process_returns_the_status():
    assert _cli.main(["run", "--", sys.executable, "-c", "import sys; sys.exit(3)"]) == 3


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["run", "--publish", "sideways", "--", "true"], {}, "--publish"),
        (["run"], {}, "no command"),
        (["run", "--"], {}, "no command"),
        (["run", "--background", "many", "--", "true"], {}, "--background"),
        (["run", "--", "true"], {"SAFESTAGE_BACKGROUND": "maybe"}, "SAFESTAGE_BACKGROUND"),
        (["run", "--", "true"], {"SAFESTAGE_FSYNC": "0"}, "SAFESTAGE_FSYNC='0' is removed"),
        (["run", "--no-fsync", "--", "true"], {}, "--no-fsync is removed in safestage 0.2"),
    ],
)
def test_run_usage_errors(args, env, needle):
    result = safestage_cli(*args, env=clean_env(**env))
    assert result.returncode == 2
    assert needle in result.stderr


def test_run_stages_a_real_save_on_hdfs(doctor_mounts, stage_root):
    """End to end: the start-up hook of the child's Python reads what `run` set."""
    directory = Path(doctor_mounts["hdfs"].path) / f"run-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    dest = directory / "model.safetensors"
    child = (
        "import torch, safestage; from safetensors.torch import save_file; "
        f"save_file({{'w': torch.arange(6.0)}}, {str(dest)!r}); print(safestage.is_active())"
    )
    result = safestage_cli("run", "--dir", str(stage_root), "--", sys.executable, "-c", child)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"
    from safetensors.torch import load_file

    assert load_file(str(dest))["w"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert os.listdir(directory) == ["model.safetensors"] and os.listdir(stage_root) == []


# -- status ------------------------------------------------------------------------------------


def status_json(**env: str) -> tuple[int, dict[str, Any]]:
    result = safestage_cli("status", "--json", env=clean_env(**env))
    return result.returncode, json.loads(result.stdout)


def test_status_reports_version_hook_and_settings(tmp_path):
    code, report = status_json()
    assert code == 0 and report["error"] is None
    assert report["version"] == safestage.__version__
    assert report["would_activate"] is False and report["active_in_this_process"] is False
    assert report["settings"]["root_source"] == "default"
    for path in report["hook"]["files"]:
        assert Path(path).name in ("safestage.pth", "safestage.start") and Path(path).is_file()
    assert report["hook"]["installed"] == bool(report["hook"]["files"])

    code, report = status_json(SAFESTAGE_DIR=str(tmp_path), SAFESTAGE_PUBLISH="direct")
    assert code == 0 and report["would_activate"] is True
    assert report["environment"] == {"SAFESTAGE_DIR": str(tmp_path), "SAFESTAGE_PUBLISH": "direct"}
    settings = report["settings"]
    assert (settings["root"], settings["root_source"], settings["publish"], settings["fsync"]) == (
        str(tmp_path),
        "SAFESTAGE_DIR",
        "direct",
        True,
    )
    # the hook, where installed, really activated staging in the status process itself
    assert report["active_in_this_process"] == report["hook"]["installed"]

    assert status_json(SAFESTAGE="0", SAFESTAGE_DIR=str(tmp_path))[1]["would_activate"] is False
    assert status_json(SAFESTAGE="1")[1]["would_activate"] is True


@pytest.mark.parametrize(
    ("variable", "value"),
    [("SAFESTAGE_PUBLISH", "sideways"), ("SAFESTAGE", "maybe"), ("SAFESTAGE_BACKGROUND", "65"), ("SAFESTAGE_FSYNC", "0")],
)
def test_status_config_error_exits_1(variable, value):
    code, report = status_json(**{variable: value})
    assert code == 1 and variable in report["error"]
    human = safestage_cli("status", env=clean_env(**{variable: value}))
    assert human.returncode == 1 and variable in human.stdout


def test_status_is_fast_and_imports_no_torch():
    probe = "import sys; from safestage.cli import main; main(['status']); print('torch' in sys.modules, 'safetensors' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", probe], env=clean_env(), capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "False False"
    assert "version" in result.stdout


def test_no_command_and_version():
    assert safestage_cli().returncode == 2
    version = safestage_cli("--version")
    assert version.returncode == 0 and safestage.__version__ in version.stdout


# -- clean -------------------------------------------------------------------------------------


def temp(
    pid: int, host: str = _HOST, token: str = "abcdef12", name: str = "model.safetensors"
) -> str:
    return f".{name}.safestage-{host}-{pid}-{token}.tmp"


def clean_json(path: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    result = safestage_cli("clean", str(path), "--json", *extra)
    return result.returncode, json.loads(result.stdout)


@pytest.fixture
def planted(tmp_path: Path, dead_pid: int, live_pid: int) -> dict[str, set[str]]:
    """Leftovers of every kind next to look-alikes that are not ours; returns the names
    clean must remove and the names it must leave alone."""
    d = tmp_path
    remove = {
        temp(dead_pid),
        f"safestage-{_HOST}-{dead_pid}-0123abcd",  # staging dir with only a torn writer temp
        f".safestage-doctor-{_HOST}-{dead_pid}-deadbeef",
    }
    (d / temp(dead_pid)).write_bytes(b"torn")
    (d / f"safestage-{_HOST}-{dead_pid}-0123abcd").mkdir()
    (d / f"safestage-{_HOST}-{dead_pid}-0123abcd" / ".tmpAb12Cd").write_bytes(b"torn")
    doctor = d / f".safestage-doctor-{_HOST}-{dead_pid}-deadbeef"
    doctor.mkdir()
    (doctor / "probe").write_bytes(b"x")
    (doctor / "sub").mkdir()

    keep = {
        temp(live_pid),  # its writer is still running
        temp(os.getpid(), token="0badc0de"),
        temp(dead_pid, host="otherhost"),  # cannot tell from here
        f"safestage-{_HOST}-{dead_pid}-4567cdef",  # holds a finished file: maybe the only copy
        temp(dead_pid, token="5ca1ab1e", name="link"),  # a symlink: safestage never makes one
        temp(dead_pid, token="d1d1d1d1", name="dir"),  # a directory named like a temp file
    }
    for name in (
        temp(live_pid),
        temp(os.getpid(), token="0badc0de"),
        temp(dead_pid, host="otherhost"),
    ):
        (d / name).write_bytes(b"in progress")
    (d / f"safestage-{_HOST}-{dead_pid}-4567cdef").mkdir()
    (d / f"safestage-{_HOST}-{dead_pid}-4567cdef" / "model.safetensors").write_bytes(b"complete")
    victim = d / "victim.txt"
    (d / temp(dead_pid, token="5ca1ab1e", name="link")).symlink_to(victim)
    (d / temp(dead_pid, token="d1d1d1d1", name="dir")).mkdir()

    not_ours = {
        ".x.safestage-host-123-zzzz.tmp",  # bad token
        f".x.safestage-{_HOST}-{dead_pid}-abcdef12.tmp.bak",
        f".x.safestage-{_HOST}-{dead_pid}-ABCDEF12.tmp",  # upper-case token
        "safestage-notes.txt",
        f"safestage-{_HOST}-{dead_pid}",  # no token
        f"safestage-{_HOST}-{dead_pid}-0123abcd.old",
        ".tmpQx81Za",  # safetensors' own temp: not ours to judge
        "model.safetensors",
        "victim.txt",
    }
    for name in not_ours:
        (d / name).write_bytes(b"user data")
    return {"remove": remove, "keep": keep, "not_ours": not_ours}


def test_clean_removes_only_dead_leftovers(tmp_path, planted, dead_pid, live_pid):
    before = snapshot(tmp_path)
    code, dry = clean_json(tmp_path, "--dry-run")
    assert code == 0 and snapshot(tmp_path) == before  # a dry run touches nothing
    assert {e["name"] for e in dry["entries"] if e["action"] == "would-remove"} == planted["remove"]

    code, report = clean_json(tmp_path)
    assert code == 0
    actions = {e["name"]: e["action"] for e in report["entries"]}
    assert {n for n, a in actions.items() if a == "removed"} == planted["remove"]
    assert {n for n, a in actions.items() if a == "kept"} == planted["keep"]
    assert not set(actions) & planted["not_ours"]  # not even reported
    assert (report["removed"], report["kept"], report["failed"]) == (3, 6, 0)
    left = set(os.listdir(tmp_path))
    assert left == planted["keep"] | planted["not_ours"]
    for name in planted["not_ours"]:
        assert (tmp_path / name).read_bytes() == b"user data"
    reasons = {e["name"]: e["reason"] for e in report["entries"]}
    assert f"pid {live_pid}, is running" in reasons[temp(live_pid)]
    assert f"pid {dead_pid}, is gone" in reasons[temp(dead_pid)]
    assert "--older-than" in reasons[temp(dead_pid, host="otherhost")]
    assert "only complete copy" in reasons[f"safestage-{_HOST}-{dead_pid}-4567cdef"]
    assert "did not make it" in reasons[temp(dead_pid, token="5ca1ab1e", name="link")]


def test_clean_older_than_removes_other_hosts_old_leftovers(tmp_path, dead_pid):
    old, young = tmp_path / temp(1, host="farhost"), tmp_path / temp(2, host="farhost")
    old.write_bytes(b"x")
    young.write_bytes(b"x")
    an_hour_ago = time.time() - 3600
    os.utime(old, (an_hour_ago, an_hour_ago))
    code, report = clean_json(tmp_path, "--older-than", "600")
    assert code == 0
    assert {e["name"]: e["action"] for e in report["entries"]} == {
        old.name: "removed",
        young.name: "kept",
    }
    assert os.listdir(tmp_path) == [young.name]
    assert safestage_cli("clean", str(tmp_path), "--older-than", "-1").returncode == 2


def test_clean_removes_a_real_crashed_writers_temp(tmp_path):
    """A temp made by safestage's own naming in a process that then died."""
    child = "import os, sys; from safestage._names import temp_name; open(temp_name('model.safetensors'), 'w').write('torn'); os._exit(0)"
    subprocess.run([sys.executable, "-c", child], cwd=tmp_path, env=clean_env(), check=True)
    (name,) = os.listdir(tmp_path)
    result = safestage_cli("clean", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("removed") and name in result.stdout
    assert "1 removed, 0 kept" in result.stdout
    assert os.listdir(tmp_path) == []


def test_clean_keeps_the_copy_a_failed_publish_kept(doctor_mounts, stage_root):
    """close-eio: the staged copy is all that is left of the save: clean must not delete it."""
    directory = Path(doctor_mounts["close-eio"].path) / f"clean-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    child = (
        "import torch, safestage; from safetensors.torch import save_file\n"
        f"with safestage.staged({str(stage_root)!r}):\n"
        f"    try: save_file({{'w': torch.ones(3)}}, {str(directory / 'model.safetensors')!r})\n"
        "    except safestage.PublishError as e: print(e.staged_path)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", child], env=clean_env(), capture_output=True, text=True, timeout=120
    )
    kept = Path(result.stdout.strip())
    assert kept.is_file(), result.stderr
    code, report = clean_json(stage_root)
    assert code == 0
    (entry,) = report["entries"]
    assert (entry["name"], entry["kind"], entry["action"]) == (
        kept.parent.name,
        "staging-dir",
        "kept",
    )
    assert kept.is_file()
    assert clean_json(directory)[1]["entries"] == []  # the failed temp was already removed


def test_clean_failure_on_a_hostile_mount_exits_1(doctor_mounts, dead_pid, capsys):
    """mountpoint-s3 refuses to delete a file while it is being written. In process: a fork
    would close a copy of the descriptor, and that close commits the upload."""
    directory = Path(doctor_mounts["mountpoint"].path) / f"clean-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    leftover = directory / temp(dead_pid)
    fd = os.open(leftover, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, b"uploading")
        unlink_faults = doctor_mounts["mountpoint"].faults()["unlink"]
        # A file being uploaded cannot even be opened to check its lock: liveness unknown,
        # so it is kept unless --older-than says to go by age.
        assert _cli.main(["clean", str(directory), "--json"]) == 0
        (entry,) = json.loads(capsys.readouterr().out)["entries"]
        assert entry["action"] == "kept" and "cannot tell" in entry["reason"]
        assert _cli.main(["clean", str(directory), "--json", "--older-than", "0"]) == 1
        (entry,) = json.loads(capsys.readouterr().out)["entries"]
        assert entry["action"] == "failed" and "Errno 1" in entry["reason"]
        assert doctor_mounts["mountpoint"].faults()["unlink"] == unlink_faults + 1
    finally:
        os.close(fd)
    code, report = clean_json(directory)
    assert code == 0 and [e["action"] for e in report["entries"]] == ["removed"]
    assert os.listdir(directory) == []


def test_clean_usage_errors(tmp_path):
    assert safestage_cli("clean", str(tmp_path / "missing")).returncode == 2
    assert safestage_cli("clean").returncode == 2


def test_clean_keeps_a_running_doctors_probe_directory(tmp_path, capsys):
    """(A dead doctor's probe directory is removed: see test_clean_removes_only_dead_leftovers.)"""
    probe = tmp_path / doctor_dir_name()
    probe.mkdir()
    assert _cli.main(["clean", str(tmp_path)]) == 0
    assert "is running" in capsys.readouterr().out and probe.exists()


@pytest.mark.regression("0.1 hostile review of the hardening (issue 9): status and run refuse an unusable root")
@pytest.mark.parametrize("kind", ["missing", "file"])
def test_status_and_run_refuse_an_unusable_root(tmp_path, kind):
    root = tmp_path / "root"
    if kind == "file":
        root.write_text("not a directory")
    base = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    status = subprocess.run(
        [sys.executable, "-m", "safestage", "status", "--json"],
        capture_output=True, text=True, env={**base, "SAFESTAGE_DIR": str(root)},
    )  # fmt: skip
    report = json.loads(status.stdout)
    assert status.returncode == 1 and report["would_activate"] is False and str(root) in report["error"]
    human = subprocess.run(
        [sys.executable, "-m", "safestage", "status"], capture_output=True, text=True,
        env={**base, "SAFESTAGE_DIR": str(root)},
    )  # fmt: skip
    line = next(text for text in human.stdout.splitlines() if text.startswith("would stage"))
    assert human.returncode == 1 and "yes" not in line, human.stdout
    run = subprocess.run([sys.executable, "-m", "safestage", "run", "--dir", str(root), "--", "true"], capture_output=True, text=True)
    assert run.returncode == 2 and str(root) in run.stderr


@pytest.mark.regression("0.1 hostile review of the hardening (issue 9): doctor with an unusable root is not called unsafe")
def test_doctor_with_an_unusable_root_is_not_called_unsafe(mount_dir, tmp_path):
    directory, _ = mount_dir("hdfs")
    missing = tmp_path / "no-such-root"
    done = subprocess.run(
        [sys.executable, "-m", "safestage", "doctor", str(directory), "--dir", str(missing), "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    report = json.loads(done.stdout)
    assert report["plain_save"]["result"] == "failed"
    assert report["verdict"] == "staging-unusable", report["verdict"]
    assert "SAFESTAGE_DIR" in report["recommendation"]["text"]


@pytest.mark.regression("0.1 hostile review 1: doctor leaves its failed staged copy when the root is given through a symlink")
def test_doctor_removes_its_failed_staged_copy_when_the_root_is_given_through_a_symlink(shm_root, tmp_path, eio_mount):
    """README: doctor "removes its probe directory and touches nothing else". On a
    destination where the staged save fails (the close-eio upload), the publish keeps its
    complete staged copy and doctor means to delete it, but only if the copy's directory is
    textually under settings.staging_root(); the StagingRoot root is the kernel's path. With
    --dir (or SAFESTAGE_DIR) given through a symlink (/scratch -> /local/nvme/scratch), the
    copy stays - a complete file, so no sweep or `safestage clean` ever removes it - while
    the report says cleanup removed=True. What the user loses: disk space in the staging
    root, one probe at a time, with nothing saying so."""
    given = tmp_path / "scratch-link"
    given.symlink_to(shm_root)
    from safestage.cli._doctor import run_doctor

    report = run_doctor(Path(eio_mount.path), root=given)
    assert report.staged_save.result == "failed" and report.cleanup.removed
    left = [(d, entries(shm_root / d)) for d in entries(shm_root)]
    assert not left, f"doctor said cleanup removed=True but left {left} in the staging root"


SLOW_DOCTOR = """
    import json, sys
    from pathlib import Path
    from safestage.cli._doctor import run_doctor
    report = run_doctor(Path(sys.argv[1]), root=Path(sys.argv[2]))
    print(json.dumps({"verdict": report.verdict, "problems": report.problems}))
"""


@pytest.mark.mounts
@pytest.mark.regression("0.1 hostile review 1: clean from another pid namespace removes a running doctors probe")
def test_clean_from_another_pid_namespace_keeps_a_running_doctors_probe(shm_root, tmp_path):
    """README: "A live owner holds a flock on its staging directory and on its temp file, so
    an entry that cannot be locked is in use, also by a process in another PID namespace".
    `safestage doctor`'s probe directory (.safestage-doctor-<host>-<pid>-<token>) is never
    locked, so a `safestage clean` of the same directory from a container (another PID
    namespace, where the doctor's pid does not exist) takes the lock nobody holds, decides
    "its owner is gone" and removes the probe mid-run. What the user loses: a correct
    diagnosis - doctor then reports ENOENT failures and calls a healthy mount "unsafe"."""
    with hostile_mount("slow", mbps=0.2) as mount:  # a slow mount: doctor runs for seconds
        target = Path(mount.path) / "ckpt"
        target.mkdir()
        base = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
        doctor = subprocess.Popen([PY, "-c", textwrap.dedent(SLOW_DOCTOR), str(target), str(shm_root)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=base)  # fmt: skip
        deadline = time.monotonic() + 15
        while not any(n.startswith(".safestage-doctor-") for n in os.listdir(target)):
            assert time.monotonic() < deadline and doctor.poll() is None, "doctor never made its probe"
            time.sleep(0.01)
        time.sleep(0.2)
        cleaned = subprocess.run(
            ["unshare", "--pid", "--fork", "--mount-proc", PY, "-m", "safestage", "clean", str(target)],
            capture_output=True, text=True, timeout=30, env=base,
        )  # fmt: skip
        out, _ = doctor.communicate(timeout=60)
    report = json.loads(out)
    assert "removed" not in cleaned.stdout.split("\n")[0], f"clean removed a live probe: {cleaned.stdout}"
    assert report["verdict"] == "plain-ok", report


@pytest.mark.regression("0.1 hostile review 1: clean on an unreadable directory is a traceback")
def test_clean_on_an_unreadable_directory_is_a_one_line_error(tmp_path):
    """`safestage clean PATH` where PATH exists but cannot be listed (another user's
    checkpoint directory, a mount that refuses readdir) dies with a Python traceback from
    os.scandir instead of the CLI's own one-line error and status; scripts that parse its
    --json output get no JSON. (Root bypasses the permission: the test drops the
    capabilities that let it.) What the user loses: a clear error; cron jobs log a crash."""
    locked = tmp_path / "theirs"
    locked.mkdir(mode=0o000)
    base = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    done = subprocess.run(
        ["setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search",
         PY, "-m", "safestage", "clean", "--json", str(locked)],
        capture_output=True, text=True, timeout=60, env=base,
    )  # fmt: skip
    locked.chmod(0o700)
    assert done.returncode in (1, 2), done
    assert "Traceback" not in done.stderr, done.stderr[-600:]


SLEEPER = """
import sys, time
try:
    print("ready", flush=True)  # inside the try: the signal may come at once
    time.sleep(4)
    print("slept through", flush=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(130)
"""


@pytest.mark.regression("0.1 hostile review 1: safestage run swallows a sigint sent to it")
def test_safestage_run_passes_a_sigint_sent_to_it_on_to_the_command(tmp_path, shm_root):
    """`safestage run -- CMD` ignores SIGINT while CMD runs, assuming Ctrl-C reaches CMD from
    the terminal's process group. A SIGINT sent to the `safestage run` process itself - docker
    stop with STOPSIGNAL SIGINT (it is PID 1), a supervisor's or scheduler's graceful stop,
    Jupyter's "interrupt kernel", `kill -INT` - is dropped: CMD never learns it should stop
    and checkpoint, and is SIGKILLed at the end of the grace period. SIGTERM and SIGHUP are
    forwarded; SIGINT is not. What the user loses: the graceful shutdown (its last checkpoint)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    runner = subprocess.Popen(
        [PY, "-m", "safestage", "run", "--dir", str(shm_root), "--", PY, "-c", SLEEPER],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=base,
        start_new_session=True,  # no terminal: the signal comes from another process
    )  # fmt: skip
    try:
        assert runner.stdout.readline().strip() == "ready"
        runner.send_signal(signal.SIGINT)
        out, err = runner.communicate(timeout=15)
    finally:
        if runner.poll() is None:
            os.killpg(runner.pid, signal.SIGKILL)
    assert "interrupted" in out, f"CMD never saw the SIGINT sent to safestage run: {out!r} {err[-300:]!r}"


@pytest.mark.regression("0.1 hostile review 1: clean output crashes on a non utf8 leftover name")
def test_clean_prints_a_non_utf8_leftover_name(tmp_path):
    """A killed save of `caf\\xe9.safetensors` (a Latin-1 name, which the hostile-destination tests stage
    fine) leaves `.caf\\xe9.safetensors.safestage-<host>-<pid>-<token>.tmp`. `safestage clean`
    removes it, then prints the name: under a UTF-8 locale other than C (en_US.UTF-8, here
    forced with PYTHONIOENCODING=utf-8) stdout is strict and the print raises
    UnicodeEncodeError: a traceback, exit 1, no summary. What the user loses: the report of
    what was removed (cron mails a crash)."""
    from safestage._names import HOST

    name = b".caf\xe9.safetensors.safestage-" + HOST.encode() + b"-999999-deadbeef.tmp"
    (Path(os.fsdecode(bytes(tmp_path))) / os.fsdecode(name)).write_bytes(b"torn")
    base = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    done = subprocess.run([PY, "-m", "safestage", "clean", str(tmp_path)], capture_output=True,
                          text=True, timeout=60, env={**base, "PYTHONIOENCODING": "utf-8"})  # fmt: skip
    assert "Traceback" not in done.stderr, done.stderr[-400:]
    assert done.returncode == 0 and "1 removed" in done.stdout


@pytest.mark.regression("0.1 hostile review 1: clean on a symlink loop says it does not exist")
def test_clean_on_a_symlink_loop_says_it_cannot_be_resolved(tmp_path):
    """`safestage clean PATH` where PATH is a symlink loop (a broken `latest` link chain)
    answers "PATH does not exist: give the directory to clean" - it exists; it cannot be
    resolved (ELOOP). The CLI tests pathlib's is_dir()/exists(), which turn every OSError
    into False. Cosmetic: the user is sent looking for a missing directory."""
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    base = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    done = subprocess.run([PY, "-m", "safestage", "clean", str(tmp_path / "a")],
                          capture_output=True, text=True, timeout=60, env=base)  # fmt: skip
    assert done.returncode == 2
    assert "does not exist" not in done.stderr, done.stderr
