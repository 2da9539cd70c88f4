"""Integration tests: real client libraries saving onto real hostile FUSE mounts.

Fixtures come from tests/conftest.py (kit_mounts, shm_root, the umask 022). Every test module
here carries the ``integration`` marker; a missing client fails its tests, never skips them.
"""

from __future__ import annotations

import importlib.metadata

import pytest

CLIENT_DISTRIBUTIONS = (
    "transformers", "huggingface_hub", "accelerate", "peft", "diffusers",
    "sentence-transformers", "megatron-bridge", "lightning", "fsspec", "safetensors", "torch",
)


def pytest_report_header(config: pytest.Config) -> str:
    versions = []
    for name in CLIENT_DISTRIBUTIONS:
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{name} MISSING")
    return "integration clients: " + ", ".join(versions)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Each module sets pytestmark; this guards against a new module forgetting it.
    for item in items:
        if "/tests/integration/" in str(item.path) and item.get_closest_marker("integration") is None:
            raise pytest.UsageError(f"{item.nodeid}: integration tests must be marked 'integration'")
