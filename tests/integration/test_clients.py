"""Each real client, saving a tiny model onto real hdfs and mountpoint kit mounts.

- plain (no safestage): the save fails there, so the other two prove something;
- inside ``safestage.staged()`` in this process;
- as an unmodified script in a fresh interpreter with only SAFESTAGE_DIR set.
"""

from __future__ import annotations

import os
import shutil
import sys
import uuid
from pathlib import Path

import pytest
import torch
from _clients import CLIENTS
from _helpers import (
    PLAIN_ERROR,
    STRATEGY,
    assert_checkpoint,
    clean_env,
    exception_text,
    fresh_dir,
    run_client_scripts,
    stray_files,
)

import safestage

pytestmark = pytest.mark.integration

MODES = ["hdfs", "mountpoint"]
SHM = Path("/dev/shm")
NAMES = list(CLIENTS)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", NAMES)
def test_plain_save_fails(name, mode, kit_mounts, tmp_path):
    client, mount = CLIENTS[name], kit_mounts[mode]
    built = client.build(tmp_path)
    dest = fresh_dir(mount, f"plain-{name}")
    faults = sum(mount.faults().values())
    with pytest.raises(Exception) as info:
        client.save(built, dest)
    assert PLAIN_ERROR[mode] in exception_text(info.value), exception_text(info.value)
    assert sum(mount.faults().values()) > faults, "the kit's fault never fired"
    assert not any(f.endswith(".safetensors") for f in os.listdir(dest))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", NAMES)
def test_staged_in_process(name, mode, kit_mounts, shm_root, tmp_path):
    client = CLIENTS[name]
    built = client.build(tmp_path)
    dest = fresh_dir(kit_mounts[mode], f"staged-{name}")
    with safestage.staged(shm_root) as stage:
        client.save(built, dest)
    shards = assert_checkpoint(dest, client, client.reference(built))
    assert sorted(r.destination for r in stage.records) == sorted(shards)
    assert {r.publish for r in stage.records} == {STRATEGY[mode]}
    assert os.listdir(shm_root) == [], "the staging root must be left empty"


@pytest.fixture(scope="module")
def by_environment(kit_mounts, tmp_path_factory):
    """One fresh interpreter, staged by SAFESTAGE_DIR alone, saves every client to both mounts
    (a start-up with torch and a client costs 5 to 20 s here: one, not one per client)."""
    base = tmp_path_factory.mktemp("by-environment")
    root = SHM / f"safestage-test-{uuid.uuid4().hex[:8]}"
    root.mkdir()
    plan = {
        name: (base / f"reference-{name}.pt", [fresh_dir(kit_mounts[mode], f"env-{name}") for mode in MODES])
        for name in NAMES
    }
    try:
        errors = run_client_scripts(plan, clean_env(SAFESTAGE_DIR=str(root)), base)
        yield {"plan": plan, "errors": errors, "left": os.listdir(root)}
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("name", NAMES)
def test_staged_by_environment_only(name, by_environment):
    client = CLIENTS[name]
    assert by_environment["errors"][name] is None, by_environment["errors"][name]
    reference, destinations = by_environment["plan"][name]
    expected = torch.load(reference, weights_only=False)
    for mode, dest in zip(MODES, destinations):
        assert not stray_files(dest), (mode, stray_files(dest))
        assert_checkpoint(dest, client, expected)
    assert by_environment["left"] == [], "the staging root must be left empty"


def test_megatron_state_loads_without_the_package_init():
    from _clients import megatron_state_module

    module = megatron_state_module()
    assert hasattr(module.SafeTensorsStateSource, "save_generator")
    # The package __init__ (AutoBridge -> megatron-core -> transformer-engine) never ran.
    assert "megatron.bridge" not in sys.modules and "megatron" not in sys.modules
    assert Path(module.__file__).parts[-4:] == ("bridge", "models", "hf_pretrained", "state.py")


@pytest.mark.parametrize("mode", MODES)
def test_transformers_saves_again_over_its_checkpoint(mode, kit_mounts, shm_root, tmp_path):
    """A second save_pretrained into the same folder: every shard, the index and config.json are
    overwritten (mountpoint: only with O_TRUNC) and the stale shards are deleted by transformers."""
    client = CLIENTS["transformers"]
    model = client.build(tmp_path)
    dest = fresh_dir(kit_mounts[mode], "resave")
    with safestage.staged(shm_root):
        client.save(model, dest)
        first = sorted(os.listdir(dest))
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(1)
        model.save_pretrained(dest, max_shard_size="40KB")  # fewer, larger shards this time
    shards = assert_checkpoint(dest, client, client.reference(model))
    assert len(shards) < len([f for f in first if f.endswith(".safetensors")])
