"""Checks shared by the integration tests: what a good checkpoint directory looks like."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import torch
from _clients import Client
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
PROJECT = HERE.parents[1]

# What the plain save (no safestage) dies of on each kit mode, with safetensors 0.8.
PLAIN_ERROR = {
    "hdfs": "Function not implemented (os error 38)",  # ftruncate -> ENOSYS, safetensors#787
    "mountpoint": "Operation not permitted (os error 1)",  # ftruncate -> EPERM (mountpoint-s3)
}
# How safestage publishes there (auto): replace via a sibling temp; direct where rename is refused.
STRATEGY = {"hdfs": "replace", "mountpoint": "direct"}


def fresh_dir(mount: Any, label: str) -> Path:
    directory = Path(mount.path) / f"{label}-{uuid.uuid4().hex[:8]}"
    directory.mkdir()
    return directory


def files_under(directory: Path) -> list[str]:
    return sorted(
        str(Path(root, name).relative_to(directory))
        for root, _, names in os.walk(directory)
        for name in names
    )


def stray_files(directory: Path) -> list[str]:
    """Temp files of safetensors (.tmpXXXXXX) or safestage (.<name>.safestage-...tmp), any hidden file."""
    return [f for f in files_under(directory) if Path(f).name.startswith(".") or ".safestage-" in f or ".tmp" in f]


def assert_tensors_match(saved: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Every saved tensor equals the model's; every model tensor is saved, or shares storage
    with one that is (tied weights that the client deduplicated)."""
    unknown = sorted(set(saved) - set(expected))
    assert not unknown, f"saved tensors that the model does not have: {unknown}"
    for name, tensor in saved.items():
        want = expected[name]
        assert tensor.dtype == want.dtype and tensor.shape == want.shape, name
        assert torch.equal(tensor, want), f"{name} differs from the model's"
    missing = [
        name for name, tensor in expected.items()
        if name not in saved
        and not any(tensor.untyped_storage().data_ptr() == expected[s].untyped_storage().data_ptr() for s in saved)
    ]
    assert not missing, f"model tensors missing from the checkpoint: {missing}"


def assert_checkpoint(directory: Path, client: Client, reference: dict[str, Any]) -> list[Path]:
    """The directory holds a complete, loadable checkpoint; returns its .safetensors files."""
    files = files_under(directory)
    assert not stray_files(directory), f"temp files left in {directory}: {stray_files(directory)}"
    modes = {f: oct(stat.S_IMODE(os.stat(directory / f).st_mode)) for f in files}
    assert set(modes.values()) == {"0o644"}, f"modes under umask 022: {modes}"
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) >= client.min_files, f"expected >= {client.min_files} .safetensors files: {files}"
    saved: dict[str, torch.Tensor] = {}
    holder: dict[str, str] = {}
    for shard in shards:
        for name, tensor in load_file(str(directory / shard)).items():
            assert name not in saved, f"{name} is in both {holder[name]} and {shard}"
            saved[name], holder[name] = tensor, shard
    assert_tensors_match(saved, reference["tensors"])
    if client.index:
        assert client.index in files, f"no {client.index} in {files}"
        weight_map = json.loads((directory / client.index).read_text())["weight_map"]
        assert weight_map == holder, "the index must map every saved key to the file holding it"
    elif len({Path(s).parent for s in shards}) < len(shards):
        raise AssertionError(f"several shards in one folder and no index: {shards}")
    for name in client.json_files:
        json.loads((directory / name).read_text())  # written by plain open(): complete JSON
    if client.extra_check is not None:
        client.extra_check(reference, directory)
    return [directory / s for s in shards]


def exception_text(error: BaseException) -> str:
    parts = []
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        parts.append(f"{type(current).__name__}: {current}")
        current = current.__cause__ or current.__context__
    return " <- ".join(parts)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    env["HF_HUB_OFFLINE"] = "1"
    env.update(extra)
    return env


def run_client_scripts(
    plan: dict[str, tuple[Path, list[Path]]], env: dict[str, str], cwd: Path
) -> dict[str, str | None]:
    """The unmodified client script, in one fresh interpreter of the dev venv, for every client
    of ``plan`` ({client: (reference, destinations)}) in turn: {client: None, or the traceback
    of what it raised}. The interpreter itself must exit 0 having reported every client."""
    path = cwd / "clients-plan.json"
    path.write_text(json.dumps([
        {"client": name, "reference": str(reference), "destinations": [str(d) for d in destinations]}
        for name, (reference, destinations) in plan.items()
    ]))  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(HERE / "_clients.py"), str(path)], env=env, cwd=cwd, capture_output=True, text=True,
        timeout=300 + 60 * len(plan),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    errors: dict[str, str | None] = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(errors) == sorted(plan), (errors, done.stderr[-4000:])
    return errors
