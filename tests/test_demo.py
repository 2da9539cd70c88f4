"""README's first command: the demo really fails plain saves and fixes them through safestage."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from safestage.testing._demo import run_demo


@pytest.mark.mounts
def test_demo_rows_show_plain_failures_and_staged_successes():
    rows = {row.destination.split()[0]: row for row in run_demo()}
    assert "os error 38" in rows["hdfs"].plain and not rows["hdfs"].plain_ok
    assert "os error 95" in rows["eopnotsupp"].plain
    assert "os error 1" in rows["objectstore"].plain
    assert rows["mountpoint"].staged == "direct: loads back equal, mode 0o644"
    assert rows["close-eio"].plain == "returned success: file missing"  # silent data loss
    assert rows["close-eio"].verdict == "made loud"
    assert "mode 0o600" in rows["local"].plain
    assert rows["local"].staged == "rename: loads back equal, mode 0o644"
    # Real tools on a local S3 bucket: rclone refuses the ftruncate and keeps the empty temp;
    # s3fs takes the plain save, mode 0600 (#782).
    assert "os error 1" in rows["rclone-s3"].plain and "; left .tmp" in rows["rclone-s3"].plain
    assert rows["rclone-s3"].staged == "replace: loads back equal, mode 0o644"
    assert rows["s3fs"].plain == "returned success: loads back equal, mode 0o600"
    assert rows["s3fs"].staged == "replace: loads back equal, mode 0o644"
    assert [row.verdict for row in rows.values()].count("fixed") == 7


@pytest.mark.mounts
def test_demo_command_exits_zero_and_prints_the_table(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    result = subprocess.run(
        [sys.executable, "-m", "safestage", "demo"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "safetensors alone" in result.stdout and "through safestage" in result.stdout
    assert "    with safestage.staged():\n        save_file(tensors, path)\n" in result.stdout
    verdicts = [line.split()[-1] for line in result.stdout.splitlines() if line.rstrip().endswith(("fixed", "loud"))]
    assert verdicts == ["fixed"] * 4 + ["loud"] + ["fixed"] * 3


def test_demo_without_moto_shows_the_rows_it_could_mount_and_names_what_to_install(tmp_path):
    """Outside the dev venv moto is often missing: the demo still shows the kit's mounts and
    the local disk, and says what to install for the real S3 mounts."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    code = (
        "import sys\n"
        "sys.modules['moto'] = None  # as if not installed: find_spec('moto') is None\n"
        "from safestage.cli import main\n"
        "sys.exit(main(['demo']))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    shown = [line.split()[0] for line in result.stdout.splitlines() if line.rstrip().endswith(("fixed", "loud"))]
    assert shown == ["hdfs", "eopnotsupp", "objectstore", "mountpoint", "close-eio", "local"]
    assert "starting a local S3 server" not in result.stderr
    for mode in ("rclone-s3 (real)", "s3fs (real)"):
        line = next(line for line in result.stderr.splitlines() if line.strip().startswith(mode))
        assert "moto is not installed" in line and "pip install" in line, line
