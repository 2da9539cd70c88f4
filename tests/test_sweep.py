"""Clean-up of leftovers (activation sweeps and `safestage clean`): dead owners' temps and staging directories go; live ones, kept copies and other hosts' files stay."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from _support import PY, _env, arange_tensors, equal, listing, loads_equal, version
from safetensors.torch import load_file, save_file

import safestage
from safestage._names import _HOST, temp_name


@pytest.mark.regression("0.1 CI (stop 16): a private dir locked by a sweep before its owner was left behind")
def test_a_private_dir_locked_by_a_sweep_before_its_owner_is_not_left_behind(tmp_path, shm_root, monkeypatch):
    """CI of stop 16: one thread's activation swept the staging root (``_sweep_dead``) while
    another thread's save had just made its private directory and not yet locked it. The
    sweep took the lock, found the owner (this very process) alive and kept the directory;
    the save, finding it locked, moved on to a fresh name, and the first directory stayed in
    the root for good. Here the sweep's lock window is reproduced with a real flock."""
    import fcntl

    from safestage import _stage

    real_claim = _stage.claim
    swept: list[Path] = []

    def claim_after_a_sweep_looked(fd: int, path: Path) -> bool:
        if not swept:  # the first private dir only: a sweep holds its lock at that moment
            swept.append(path)
            sweeper = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                fcntl.flock(sweeper, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return real_claim(fd, path)  # Contended: the sweep holds it
            finally:
                os.close(sweeper)  # the sweep saw pid alive, kept it and let go
        return real_claim(fd, path)

    directory = tmp_path / "dest"
    directory.mkdir()
    with safestage.staged(shm_root) as stage:
        monkeypatch.setattr(_stage, "claim", claim_after_a_sweep_looked)  # after its own probe
        save_file(version(1, 4096), str(directory / "m.safetensors"))
    assert swept, "the sweep's lock window never happened"
    assert [r.destination.name for r in stage.records] == ["m.safetensors"]
    assert equal(load_file(str(directory / "m.safetensors")), version(1, 4096))
    assert os.listdir(directory) == ["m.safetensors"]
    assert os.listdir(shm_root) == [], "the private directory the sweep looked at was left behind"


LONG_PREFIX = "gpu-node-a100-80gb-llama3-70b-finetune-worker-"  # 46 characters: share 32+


def python(code: str, *, env: dict[str, str] | None = None, timeout: float = 120, prefix: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    base.update(env or {})
    return subprocess.run(
        [*(prefix or []), sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=timeout, env=base,
    )  # fmt: skip


FAILING_SAVES = """
    import json, sys, torch, safestage
    from safetensors.torch import save_file
    root, cases = sys.argv[1], json.loads(sys.argv[2])  # [[dest, via], ...]: one failing save each
    data = {"w": torch.arange(4096, dtype=torch.float32) + 7}
    reports = []
    for dest, via in cases:
        try:
            if via == "save_file":
                with safestage.staged(root):
                    save_file(data, dest)
            else:
                with safestage.staged_file(dest, root) as local:
                    save_file(data, str(local))
        except safestage.PublishError as exc:
            reports.append({"kept": exc.staged_path, "errno": exc.errno})
        else:
            reports.append(None)
    print(json.dumps(reports))
"""


KEPT_NAMES = [".ema.safetensors", ".tmpAbc123", "model.safetensors"]
KEPT_VIAS = ["save_file", "staged_file"]


@pytest.fixture(scope="module")
def kept_copies(kit_mounts: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Every kept copy of the test below, made by one process that has exited, in one staging
    root, then every sweep once: an activation's, `safestage clean`'s and `safestage doctor
    --dir`'s (each a process with torch costs seconds: one round for the six cases). Each copy
    is checked after each sweep: {(name, via): (errno, kept path, whole after each sweep)}."""
    base = tmp_path_factory.mktemp("kept-copies")
    stage_root = base / "stage-root"
    stage_root.mkdir()
    directory = Path(kit_mounts["close-eio"].path) / f"h-{uuid.uuid4().hex[:10]}"
    directory.mkdir()
    cases = [(name, via) for via in KEPT_VIAS for name in KEPT_NAMES]
    for via in KEPT_VIAS:
        (directory / via).mkdir()
    done = subprocess.run(  # one owner: its six saves fail one after another, then it exits
        [sys.executable, "-c", textwrap.dedent(FAILING_SAVES), str(stage_root),
         json.dumps([[str(directory / via / name), via] for name, via in cases])],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    reports = json.loads(done.stdout)
    assert None not in reports, f"a save onto close-eio did not fail: {reports}"
    made = {case: (report["errno"], Path(report["kept"])) for case, report in zip(cases, reports)}
    whole = {case: [loads_equal(kept, arange_tensors(7))] for case, (_, kept) in made.items()}
    safestage.activate(stage_root).close()  # the next activation's sweep
    for case, (_, kept) in made.items():
        whole[case].append(loads_equal(kept, arange_tensors(7)))
    cleaned = subprocess.run([sys.executable, "-m", "safestage", "clean", str(stage_root)], capture_output=True, text=True)
    for case, (_, kept) in made.items():
        whole[case].append(loads_equal(kept, arange_tensors(7)))
    probe_dir = base / "doctor-here"
    probe_dir.mkdir()
    subprocess.run(
        [sys.executable, "-m", "safestage", "doctor", str(probe_dir), "--dir", str(stage_root)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    for case, (_, kept) in made.items():
        whole[case].append(loads_equal(kept, arange_tensors(7)))
    return {"made": made, "whole": whole, "cleaned": cleaned.stdout}


@pytest.mark.regression("0.1 hostile review of the hardening (issue 9): a kept copy survives every sweep after its owner exited")
@pytest.mark.parametrize("name", KEPT_NAMES)
@pytest.mark.parametrize("via", KEPT_VIAS)
def test_a_kept_copy_survives_every_sweep_after_its_owner_exited(kept_copies, name, via):
    failed_with, kept = kept_copies["made"][name, via]
    assert failed_with == errno.EIO, "the close-eio fault did not fire"
    made, activated, cleaned, doctored = kept_copies["whole"][name, via]
    assert made, "the PublishError named a copy that is not complete"
    assert activated, "the activation sweep deleted the kept copy"
    assert cleaned, f"safestage clean deleted the kept copy: {kept_copies['cleaned']}"
    assert doctored, "safestage doctor --dir deleted the kept copy"
    assert "kept" in kept_copies["cleaned"] and kept.parent.name in kept_copies["cleaned"]


@pytest.mark.regression("0.1 hostile review of the hardening (issue 9): a torn writer temp of a dead owner is still swept")
def test_a_torn_writer_temp_of_a_dead_owner_is_still_swept(stage_root):
    """The other side of the rule: safetensors' own `.tmpXXXXXX` alone is a torn write."""
    code = f"""
        import os, safestage
        stage = safestage.activate({str(stage_root)!r})
        private = safestage._save.staging_root(stage.settings).new_save_dir()
        (private / ".tmpQ1w2E3").write_bytes(b"torn")
        print(private.path, flush=True)
        os._exit(0)
    """
    done = python(code)
    private = Path(done.stdout.strip())
    assert private.is_dir(), done.stderr
    safestage.activate(stage_root).close()
    assert not private.exists()


def in_namespaces(*, hostname: str | None = None, pid: bool = False) -> list[str]:
    """A command prefix running the command in new UTS (with ``hostname``) / PID namespaces:
    two pods on one node, or two containers with hostNetwork."""
    flags = []
    if hostname is not None:
        flags.append("--uts")
    if pid:
        flags += ["--pid", "--fork", "--mount-proc"]
    prefix = ["unshare", *flags]
    if hostname is not None:
        return [*prefix, "sh", "-c", f'hostname "{hostname}" && exec "$@"', "sh"]
    return prefix


SLOW_SAVE = """
    import os, sys, torch, safestage
    from safetensors.torch import save_file
    dest, root, publish = sys.argv[1], sys.argv[2], sys.argv[3]
    with safestage.staged(root, publish=publish) as stage:
        save_file({"w": torch.arange(96 << 20, dtype=torch.float32)}, dest)   # 384 MiB
    print("saved", stage.records[-1].publish, flush=True)
"""


def _clean_while_publishing(directory: Path, backing: Path, root: Path, saver_prefix: list[str], cleaner_prefix: list[str]) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    dest = directory / "model.safetensors"
    saver = subprocess.Popen(
        [*saver_prefix, sys.executable, "-c", textwrap.dedent(SLOW_SAVE), str(dest), str(root), "replace"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    temps: list[str] = []
    while not temps and time.monotonic() < deadline and saver.poll() is None:
        temps = [n for n in os.listdir(backing) if n.endswith(".tmp")]
        time.sleep(0.01)
    assert temps, "the saver never started publishing"
    cleaned = subprocess.run(
        [*cleaner_prefix, sys.executable, "-m", "safestage", "clean", str(directory), "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    out, err = saver.communicate(timeout=120)
    assert saver.returncode == 0 and out.startswith("saved replace"), f"the live save was broken: {err[-3000:]}"
    assert loads_equal(dest, {"w": torch.arange(96 << 20, dtype=torch.float32)})
    return cleaned, temps


@pytest.mark.regression("0.1 hostile review of the hardening (issue 9): hosts sharing a long prefix never clean each others live temps")
def test_hosts_sharing_a_long_prefix_never_clean_each_others_live_temps(mount_dir, shm_root):
    directory, backing = mount_dir("slow")
    cleaned, _ = _clean_while_publishing(
        directory, backing, shm_root,
        in_namespaces(hostname=LONG_PREFIX + "0"),  # pid: not visible in the cleaner's namespace
        in_namespaces(hostname=LONG_PREFIX + "1", pid=True),
    )  # fmt: skip
    report = json.loads(cleaned.stdout)
    assert report["removed"] == 0, report
    assert [e["action"] for e in report["entries"]] == ["kept"], report


@pytest.mark.regression("0.1 hostile review of the hardening (issue 9): a live temp survives clean from another pid namespace")
def test_a_live_temp_survives_clean_from_another_pid_namespace(mount_dir, shm_root):
    directory, backing = mount_dir("slow")
    cleaned, _ = _clean_while_publishing(directory, backing, shm_root, [], in_namespaces(pid=True))
    report = json.loads(cleaned.stdout)
    assert report["removed"] == 0 and report["entries"] and report["entries"][0]["action"] == "kept", report


@pytest.mark.regression("0.1 hostile review of the hardening (issue 9): a live staging directory survives a sweep from another pid namespace")
@pytest.mark.parametrize("sweeper", ["activation", "clean"])
def test_a_live_staging_directory_survives_a_sweep_from_another_pid_namespace(stage_root, sweeper):
    stage = safestage.activate(stage_root)
    try:
        private = safestage._save.staging_root(stage.settings).new_save_dir()  # what a save holds while serializing
        (private / ".tmpAaBbCc").write_bytes(b"safetensors is writing this")
        if sweeper == "activation":
            code = f"import safestage; safestage.activate({str(stage_root)!r}).close()"
            args = [sys.executable, "-c", code]
        else:
            args = [sys.executable, "-m", "safestage", "clean", str(stage_root)]
        done = subprocess.run([*in_namespaces(pid=True), *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert (private / ".tmpAaBbCc").exists(), f"a live staging directory was swept: {done.stdout}"
    finally:
        stage.close()


@pytest.mark.regression("0.1 hostile review of the hardening (issue 9): host identity in names is never truncated")
def test_host_identity_in_names_is_never_truncated():
    hostname = os.uname().nodename
    probe = subprocess.run(
        [*in_namespaces(hostname=LONG_PREFIX + "7"), sys.executable, "-c",
         "from safestage._names import temp_name, parse_temp_name; "
         "n = temp_name('model.safetensors'); print(n); print(parse_temp_name(n).host)"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    name, host = probe.stdout.split()
    assert LONG_PREFIX + "7" in name and host != _HOST
    assert os.uname().nodename == hostname


@pytest.mark.regression("0.1 hostile review of the hardening (issue 9): leftover names with newlines")
def test_clean_takes_a_dead_temp_whose_name_has_a_newline_and_leaves_a_look_alike(tmp_path, dead_pid_of_this_host):
    dead = dead_pid_of_this_host
    real_temp = temp_name("model\n.safetensors").replace(f"-{os.getpid()}-", f"-{dead}-")
    look_alike = f".m.safetensors.safestage-{_HOST}-{dead}-abcdef12.tmp\n"
    (tmp_path / real_temp).write_bytes(b"torn")
    (tmp_path / look_alike).write_bytes(b"the user's")
    done = subprocess.run([sys.executable, "-m", "safestage", "clean", str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert listing(tmp_path) == [look_alike]


@pytest.fixture
def dead_pid_of_this_host() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


_DEAD_SAVE_DIR = """
import os, sys
from safestage._names import save_dir_name
path = os.path.join(sys.argv[1], save_dir_name())
os.mkdir(path, 0o700)
open(os.path.join(path, ".tmpAbC123"), "wb").close()  # safetensors' torn temp
print(path)
"""


@pytest.mark.regression("v0.2 hostile review: 'every activation sweeps' no longer held once the root was checked once per process")
def test_a_dead_jobs_save_dir_is_swept_by_the_next_process_and_by_clean(tmp_path):
    """The first use of a root in a process sweeps it; later activations of the same process
    reuse the checked root (docs/guarantees.md, Leftovers); `safestage clean` sweeps on demand."""
    root = tmp_path / "root"
    root.mkdir()

    def dead_save_dir() -> str:
        return subprocess.run(
            [sys.executable, "-c", _DEAD_SAVE_DIR, str(root)], check=True, capture_output=True, text=True
        ).stdout.strip()

    first = dead_save_dir()
    activate = f"import safestage; safestage.activate({str(root)!r}).close()"
    subprocess.run([sys.executable, "-c", activate], check=True, timeout=120)
    assert not os.path.exists(first), "a new process's first activation left a dead job's save dir"
    second = dead_save_dir()
    done = subprocess.run(
        [sys.executable, "-m", "safestage", "clean", str(root)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done
    assert not os.path.exists(second) and os.listdir(root) == []


@pytest.mark.regression("0.1 hostile review 2: clean keeps an unpublished checkpoint named like a writer temp")
def test_clean_keeps_an_unpublished_checkpoint_named_like_a_writer_temp(
    kit_mounts: dict[str, Any], stage_root: Path
) -> None:
    """_local_name guards "", the disposable marker and the staged commit name, but not
    safetensors' temp pattern (.tmpXXXXXX), which local_name guards for single files. A
    checkpoint directory called `.tmpAbC123` whose publish failed is kept in the staging root
    (the only copy of its files); once its process is gone, `safestage clean` reads the
    private directory as "only a torn writer temp" and deletes it."""
    dest = Path(kit_mounts["close-eio"].path) / f"c-{uuid.uuid4().hex[:8]}"
    dest.mkdir()
    code = (
        "import sys, safestage\n"
        "from pathlib import Path\n"
        "try:\n"
        "    with safestage.staged_dir(sys.argv[1], sys.argv[2]) as local:\n"
        "        (local / 'model.bin').write_bytes(b'only copy' * 1000)\n"
        "except safestage.PublishError as exc:\n"
        "    print(exc.staged_path)\n"
    )
    child = subprocess.run(
        [PY, "-c", code, str(dest / ".tmpAbC123"), str(stage_root)],
        env=_env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr
    kept = Path(child.stdout.strip())
    assert (kept / "model.bin").read_bytes() == b"only copy" * 1000
    clean = subprocess.run(
        [PY, "-m", "safestage", "clean", str(stage_root)], env=_env(), capture_output=True, text=True, timeout=60
    )
    assert clean.returncode == 0, clean.stderr
    assert (kept / "model.bin").read_bytes() == b"only copy" * 1000, clean.stdout


def test_activation_sweeps_dead_processes_staging_dirs(tmp_path, caplog):
    import logging
    import subprocess

    from safestage._names import _HOST

    child = subprocess.Popen(["true"])
    child.wait()
    torn = tmp_path / f"safestage-{_HOST}-{child.pid}-0badc0de"
    torn.mkdir()
    (torn / ".tmpAbC123").write_bytes(b"half a shard")
    finished = tmp_path / f"safestage-{_HOST}-{child.pid}-0000beef"
    finished.mkdir()
    (finished / "model.safetensors").write_bytes(b"complete copy of a failed publish")
    live = tmp_path / f"safestage-{_HOST}-{os.getpid()}-12345678"
    live.mkdir()
    (tmp_path / "notes.txt").write_text("not ours")
    with caplog.at_level(logging.WARNING, logger="safestage"), safestage.staged(tmp_path):
        pass
    assert sorted(os.listdir(tmp_path)) == sorted([finished.name, live.name, "notes.txt"])
    assert any(finished.name in record.getMessage() for record in caplog.records)
