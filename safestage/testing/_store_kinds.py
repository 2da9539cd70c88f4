"""The kit's object stores by kind: a server of each, the process's shared one, a fresh bucket.

Above the servers' modules (``_s3``, ``_seaweedfs``, ``_azurite``, ``_fake_gcs``), which sit on
``_stores``: the kit's import graph has no circle.
"""

from __future__ import annotations

import uuid

from ._azurite import AzuriteServer
from ._fake_gcs import FakeGcsServer
from ._s3 import S3Server
from ._seaweedfs import SeaweedfsServer
from ._stores import STORE_KINDS, ObjectStoreServer, StoreBucket, shared_server

SERVERS: dict[str, type[ObjectStoreServer]] = {
    "moto": S3Server,
    "seaweedfs": SeaweedfsServer,
    "azurite": AzuriteServer,
    "fake-gcs": FakeGcsServer,
}
assert tuple(SERVERS) == STORE_KINDS


def object_store_server(kind: str) -> ObjectStoreServer:
    """A new, unstarted server of ``kind`` (one of STORE_KINDS)."""
    try:
        return SERVERS[kind]()
    except KeyError:
        raise ValueError(f"unknown object store {kind!r}: choose one of {', '.join(STORE_KINDS)}") from None


def shared_object_store(kind: str) -> ObjectStoreServer:
    """The process's server of ``kind``, started on first use (again if it died), stopped at exit.

    ``moto``'s is also the S3 server of the real mounts (:func:`shared_s3_server`).
    """
    if kind not in SERVERS:
        object_store_server(kind)  # the ValueError
    return shared_server(kind, SERVERS[kind])


def new_bucket(kind: str, *, prefix: str = "test") -> StoreBucket:
    """A new, empty bucket with a unique name on the process's shared server of ``kind``."""
    server = shared_object_store(kind)
    name = f"{prefix}-{uuid.uuid4().hex[:12]}"
    server.create_bucket(name)
    return StoreBucket(server, name)
