"""transformers and huggingface_hub saving onto the real rclone-s3 and s3fs mounts (a local S3
server behind them), three ways, like test_clients.py does on the kit's models:

- plain (no safestage): rclone refuses safetensors 0.8's ftruncate (EPERM) at the first shard
  and keeps that shard's empty temp file; s3fs takes the save, every shard 0600 (#782);
- inside ``safestage.staged()`` in this process;
- as an unmodified script in a fresh interpreter with only SAFESTAGE_DIR set.

Besides the checkpoint checks of _helpers (loads back equal, index maps every key, 0644, no
temp), what the bucket itself holds must be exactly the files listed: rclone applies some
removals only when the kernel's FUSE RELEASE reaches it, after close() returned.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from _clients import CLIENTS
from _helpers import (
    assert_checkpoint,
    assert_tensors_match,
    clean_env,
    exception_text,
    files_under,
    fresh_dir,
    run_client_scripts,
    stray_files,
)
from safetensors.torch import load_file

import safestage

pytestmark = pytest.mark.integration

MODES = ["rclone-s3", "s3fs"]
NAMES = ["transformers", "hub-save_torch_state_dict"]
TMP_NAME = re.compile(r"^\.tmp[A-Za-z0-9]{6}$")  # safetensors 0.8's temp file (tempfile crate)
SHM = Path("/dev/shm")
SETTLE = 1.0  # seconds for a name rclone removed before its RELEASE to come back, if it does


def stored(mount: Any, directory: Path) -> list[str]:
    """The bucket's keys under ``directory``, relative to it, not through the mount."""
    prefix = directory.relative_to(mount.path).as_posix() + "/"
    return sorted(o[len(prefix) :] for o in mount.objects() if o.startswith(prefix) and o != prefix)


def assert_stored_as_listed(mount: Any, directory: Path) -> None:
    time.sleep(SETTLE)
    assert not stray_files(directory), stray_files(directory)
    assert stored(mount, directory) == files_under(directory)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", NAMES)
def test_plain_save(name, mode, real_mounts, tmp_path):
    client, mount = CLIENTS[name], real_mounts[mode]
    built = client.build(tmp_path)
    dest = fresh_dir(mount, f"plain-{name}")
    if mode == "rclone-s3":
        with pytest.raises(Exception) as info:
            client.save(built, dest)
        assert "Operation not permitted (os error 1)" in exception_text(info.value)
        time.sleep(SETTLE)  # the empty temp, unlinked while open, is uploaded at RELEASE
        temps = [f for f in files_under(dest) if TMP_NAME.match(f)]
        assert len(temps) == 1 and os.stat(dest / temps[0]).st_size == 0, files_under(dest)
        assert not any(f.endswith(".safetensors") for f in files_under(dest))
        assert stored(mount, dest) == files_under(dest)  # the bucket keeps the empty temp too
        return
    client.save(built, dest)  # s3fs: it works...
    shards = [f for f in files_under(dest) if f.endswith(".safetensors")]
    assert len(shards) >= client.min_files
    saved = {k: v for shard in shards for k, v in load_file(str(dest / shard)).items()}
    assert_tensors_match(saved, client.reference(built)["tensors"])
    modes = {f: stat.S_IMODE(os.stat(dest / f).st_mode) for f in files_under(dest)}
    # ... but every shard is 0600, the temp file's mode (#782); the JSON from open() is 0644.
    assert {m for f, m in modes.items() if f.endswith(".safetensors")} == {0o600}, modes
    assert {m for f, m in modes.items() if f.endswith(".json")} == {0o644}, modes
    assert_stored_as_listed(mount, dest)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", NAMES)
def test_staged_in_process(name, mode, real_mounts, shm_root, tmp_path):
    client, mount = CLIENTS[name], real_mounts[mode]
    built = client.build(tmp_path)
    dest = fresh_dir(mount, f"staged-{name}")
    with safestage.staged(shm_root) as stage:
        client.save(built, dest)
    shards = assert_checkpoint(dest, client, client.reference(built))
    assert sorted(r.destination for r in stage.records) == sorted(shards)
    assert {r.publish for r in stage.records} == {"replace"}
    assert os.listdir(shm_root) == [], "the staging root must be left empty"
    assert_stored_as_listed(mount, dest)


@pytest.fixture(scope="module")
def by_environment(real_mounts, tmp_path_factory):
    """One fresh interpreter, staged by SAFESTAGE_DIR alone, saves every client onto both
    mounts (one start-up with torch and the clients, not one per client)."""
    base = tmp_path_factory.mktemp("by-environment")
    root = SHM / f"safestage-test-{uuid.uuid4().hex[:8]}"
    root.mkdir()
    plan = {
        name: (base / f"reference-{name}.pt", [fresh_dir(real_mounts[mode], f"env-{name}") for mode in MODES])
        for name in NAMES
    }
    try:
        errors = run_client_scripts(plan, clean_env(SAFESTAGE_DIR=str(root)), base)
        yield {"plan": plan, "errors": errors, "left": os.listdir(root)}
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("name", NAMES)
def test_staged_by_environment_only(name, by_environment, real_mounts):
    client = CLIENTS[name]
    assert by_environment["errors"][name] is None, by_environment["errors"][name]
    reference, destinations = by_environment["plan"][name]
    expected = torch.load(reference, weights_only=False)
    for mode, dest in zip(MODES, destinations):
        assert_checkpoint(dest, client, expected)
        assert_stored_as_listed(real_mounts[mode], dest)
    assert by_environment["left"] == [], "the staging root must be left empty"


@pytest.mark.parametrize("mode", MODES)
def test_transformers_saves_again_over_its_checkpoint(mode, real_mounts, shm_root, tmp_path):
    """A second save_pretrained into the same folder: the shards are replaced through
    safestage, while transformers rewrites the index and config.json with open("w") itself
    (O_TRUNC: the one overwrite rclone allows) and deletes the shards it no longer needs."""
    client, mount = CLIENTS["transformers"], real_mounts[mode]
    model = client.build(tmp_path)
    dest = fresh_dir(mount, "resave")
    with safestage.staged(shm_root):
        client.save(model, dest)
        first = sorted(os.listdir(dest))
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(1)
        model.save_pretrained(dest, max_shard_size="40KB")  # fewer, larger shards this time
    shards = assert_checkpoint(dest, client, client.reference(model))
    assert len(shards) < len([f for f in first if f.endswith(".safetensors")])
    assert_stored_as_listed(mount, dest)
