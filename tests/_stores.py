"""Object-store test support: a fresh bucket on the shared moto server, reached through the
standard AWS environment only (children inherit it), and reading what landed there."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from safestage import _object_store
from safestage._destination import ObjectURL, url_of
from safestage.testing._s3 import shared_s3_server


def s3_environment() -> dict[str, str]:
    """What obstore (and a child process) needs to reach the shared moto server."""
    return {
        "AWS_ENDPOINT_URL": shared_s3_server().endpoint, "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1", "AWS_ALLOW_HTTP": "true",
    }  # fmt: skip


def new_bucket(monkeypatch: pytest.MonkeyPatch, prefix: str = "ckpt") -> str:
    """A fresh bucket, the AWS environment set for this test (and its children)."""
    name = f"{prefix}-{uuid.uuid4().hex[:10]}"
    shared_s3_server().create_bucket(name)
    for key, value in s3_environment().items():
        monkeypatch.setenv(key, value)
    _object_store.after_fork_in_child()  # clients made for another test's environment
    return name


def keys(bucket: str, prefix: str = "") -> list[str]:
    return [key for key in shared_s3_server().list_objects(bucket) if key.startswith(prefix)]


def download(url: str, local: Path) -> Path:
    """Every object below ``url`` into ``local`` (made), laid out by key: a plain copy for a
    stock reader (``dcp.load``, ``torch.load``)."""
    prefix = url_of(url)
    assert prefix is not None, url
    for info in _object_store.listing(prefix):
        data = _object_store.read(ObjectURL(prefix.scheme, prefix.bucket, info.key))
        assert data is not None, info.key
        target = local / info.key[len(prefix.prefix):]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return local
