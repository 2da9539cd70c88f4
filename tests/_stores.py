"""Object-store test support: a fresh bucket on the shared moto server, reached through the
standard AWS environment only (children inherit it), and reading what landed there."""

from __future__ import annotations

import re
import time
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


_REQUEST = re.compile(r'"([A-Z]+) (/[^ ]*) HTTP/')


class Requests:
    """The requests the shared server logged for ``bucket`` from now on (moto's access log, one
    line a request): ``with Requests(bucket) as seen: ...``, then ``seen.made``."""

    def __init__(self, bucket: str) -> None:
        self.bucket = bucket
        self.made: list[tuple[str, str]] = []

    def _lines(self) -> list[str]:
        return shared_s3_server().log().splitlines()

    def __enter__(self) -> Requests:
        self._start = len(self._lines())
        return self

    def __exit__(self, *exc: object) -> None:
        # The access log is written as each answer goes out: wait until it stops growing.
        count, deadline = -1, time.monotonic() + 5
        while time.monotonic() < deadline:
            lines = self._lines()
            if len(lines) == count:
                break
            count = len(lines)
            time.sleep(0.2)
        for line in self._lines()[self._start:]:
            match = _REQUEST.search(line)
            if match and match[2].startswith(f"/{self.bucket}"):
                self.made.append((match[1], match[2]))

    def lists(self) -> list[str]:
        return [target for method, target in self.made if method == "GET" and "list-type=2" in target]

    def gets(self) -> list[str]:
        return [target for method, target in self.made if method == "GET" and "list-type=2" not in target]
