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

The FUSE server runs in a separate process (never in the caller's); :meth:`HostileMount.faults`
reads the fault counts it publishes. Importing this package imports neither torch, safetensors
nor mfusepy: a machine without FUSE fails at mount time with :class:`FuseUnavailable`.
"""

from __future__ import annotations

from ._mount import MODES, FuseUnavailable, HostileMount, fuse_available, hostile_mount

__all__ = ["MODES", "FuseUnavailable", "HostileMount", "fuse_available", "hostile_mount"]
