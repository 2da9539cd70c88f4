"""The hostile-filesystem kit: real FUSE mounts that fail the way checkpoint destinations do.

Each mode is a passthrough filesystem over a backing directory that refuses, with real errnos
seen through ordinary syscalls, what a real hostile destination refuses::

    from safestage.testing import hostile_mount

    with hostile_mount("hdfs") as m:
        save_checkpoint(m.path / "model.safetensors")   # your code, against a real FUSE mount
        assert m.faults()["ftruncate"] == 0              # or: the fault fired, and you coped

Modes (``MODES``):

- ``passthrough``: no faults (the baseline).
- ``hdfs``: HDFS FUSE (safetensors#787): ``ftruncate(fd, n)`` and ``truncate(path, n > 0)``
  fail with ENOSYS; ``open(O_TRUNC)``, ``truncate(path, 0)`` and rename work.
- ``eopnotsupp``: the same with EOPNOTSUPP (safetensors#842); fallocate too.
- ``objectstore``: an object store without a write cache: truncation fails with EPERM, and so
  does any write that is not at the current end of the file.
- ``mountpoint``: mountpoint-s3 semantics: rename ENOSYS, chmod/chown EPERM, truncation EPERM,
  out-of-order writes EINVAL, overwrite only with O_TRUNC, a new file cannot be read or
  deleted until its writer closes it, no links.
- ``close-eio``: a file created or written through a handle fails ``close()`` and ``fsync()`` with
  EIO and is discarded, like an object store whose upload failed: ignoring close() loses data silently.
- ``slow``: passthrough with writes paced to ``mbps`` MB/s (default 200).

Real third-party mounts (``REAL_MODES``), for what no model captures, same shape::

    from safestage.testing import real_mount

    with real_mount("rclone-s3") as m:         # also "rclone-local", "s3fs"
        save_checkpoint(m.path / "model.safetensors")
        assert m.objects() == ["model.safetensors"]  # the bucket's keys, not the mount's view

``rclone-local`` is ``rclone mount`` of a local directory, ``rclone-s3`` of a bucket on a local
moto S3 server (127.0.0.1 only), both with ``--vfs-cache-mode off``; ``s3fs`` is s3fs-fuse on
such a bucket. They need rclone, s3fs and ``moto[server]`` installed; a missing tool fails at
mount time with :class:`RealMountUnavailable` naming it.

The FUSE server runs in a separate process (never in the caller's); :meth:`HostileMount.faults`
reads the fault counts it publishes. Importing this package imports neither torch, safetensors
nor mfusepy: a machine without FUSE fails at mount time with :class:`FuseUnavailable`.

Local object stores (``STORE_KINDS``: moto and seaweedfs for ``s3://``, Azurite for ``az://``,
fake-gcs-server for ``gs://``), each a real server on 127.0.0.1, and a :class:`FaultProxy` that
fails, resets or delays chosen requests in front of one and logs every request::

    from safestage.testing import FaultProxy, new_bucket

    bucket = new_bucket("seaweedfs")                 # a fresh bucket on the shared server
    with FaultProxy(bucket.server.endpoint) as proxy:
        os.environ.update(bucket.server.environment(bucket.name, endpoint=proxy.endpoint))
        proxy.fail(503, method="PUT", query="partNumber")
        save_to(bucket.url + "/run")                 # s3://test-.../run
        assert proxy.count(method="PUT", query="partNumber") >= 2

A server that cannot run here raises :class:`ObjectStoreUnavailable` naming what to install
(docs/testing-kit.md).
"""

from __future__ import annotations

from ._fault_proxy import FaultProxy
from ._mount import (
    MODES,
    FuseUnavailable,
    HostileMount,
    RealMountUnavailable,
    fuse_available,
    hostile_mount,
)
from ._real import REAL_MODES, RealMount, real_available, real_mount
from ._s3 import S3Server, shared_s3_server, stop_shared_s3_server
from ._store_kinds import new_bucket, shared_object_store
from ._stores import (
    STORE_KINDS,
    ObjectStoreServer,
    ObjectStoreUnavailable,
    StoreBucket,
    stop_shared_object_stores,
)

__all__ = [
    "MODES",
    "REAL_MODES",
    "STORE_KINDS",
    "FaultProxy",
    "FuseUnavailable",
    "HostileMount",
    "ObjectStoreServer",
    "ObjectStoreUnavailable",
    "RealMount",
    "RealMountUnavailable",
    "S3Server",
    "StoreBucket",
    "fuse_available",
    "hostile_mount",
    "new_bucket",
    "real_available",
    "real_mount",
    "shared_object_store",
    "shared_s3_server",
    "stop_shared_object_stores",
    "stop_shared_s3_server",
]
