"""Where a save or a checkpoint lands: a path on a filesystem, or an object in a bucket.

Two families, and this module is the only one that reads a URL's scheme:

- POSIX paths (local disks, NFS, every FUSE mount: HDFS, mountpoint-s3, rclone, s3fs): a
  ``pathlib.Path``, resolved by the kernel (``_paths``);
- object stores, reached with no mount (``s3://bucket/key``, ``gs://``, ``az://``): an
  ``ObjectURL``, written through ``_object_store``.

An ``ObjectURL`` joins and names like a path (``url / "model.safetensors"``, ``.name``,
``.parent``), so that the code that only names a destination (messages, records, the registry
of work in flight) serves both families; the code that touches one asks ``is_store`` and calls
its family. It has no ``__fspath__``: no ``open()`` can ever take ``s3://b/x`` for the relative
local path ``s3:/b/x``.

Any other ``scheme://`` is refused with a clear error, never written without the guarantees
(a plain ``save_file`` would write it into a local directory named ``s3:``). hdfs:// is not
served: HDFS FUSE is (docs/object-stores.md).
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from ._errors import ConfigError

# The schemes served, each with the obstore extra a user installs for it.
SCHEMES = {"s3": "s3", "gs": "gcs", "az": "azure"}
# What a URL looks like: a scheme of letters, digits, + - . and "://" (RFC 3986). A path that
# merely contains "://" further on ("ckpt/a://b") is a path.
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# What object_store's path parts refuse (a key a store holds, the client cannot name): the ASCII
# control characters, U+0000-U+001F and U+007F.
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class UnsupportedDestination(ConfigError):
    """A ``scheme://`` destination safestage does not serve."""


@dataclass(frozen=True)
class ObjectURL:
    """``scheme://bucket/key``: an object (a file) or a prefix (a checkpoint directory, a run).
    ``key`` has no leading or trailing ``/``; ``""`` is the bucket itself."""

    scheme: str
    bucket: str
    key: str = ""

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}"

    def __truediv__(self, name: Union[str, os.PathLike[str]]) -> ObjectURL:
        tail = os.fspath(name).strip("/")
        if not tail:
            return self
        return ObjectURL(self.scheme, self.bucket, f"{self.key}/{tail}" if self.key else tail)

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def parent(self) -> ObjectURL:
        return ObjectURL(self.scheme, self.bucket, self.key.rsplit("/", 1)[0] if "/" in self.key else "")

    @property
    def parents(self) -> tuple[ObjectURL, ...]:
        """Every prefix above this URL, nearest first, down to the bucket (as Path.parents)."""
        found, url = [], self
        while url.key:
            url = url.parent
            found.append(url)
        return tuple(found)

    @property
    def prefix(self) -> str:
        """The listing prefix of what lies below this URL (``"run/"``; ``""`` for the bucket)."""
        return f"{self.key}/" if self.key else ""

    def is_relative_to(self, other: object) -> bool:
        if not isinstance(other, ObjectURL):
            return False
        if (self.scheme, self.bucket) != (other.scheme, other.bucket):
            return False
        return not other.key or self.key == other.key or self.key.startswith(other.prefix)

    def relative_to(self, other: ObjectURL) -> str:
        if not self.is_relative_to(other):
            raise ValueError(f"{self} is not below {other}")
        return self.key[len(other.prefix):] if self.key != other.key else ""


Destination = Union[Path, ObjectURL]


def is_store(destination: object) -> bool:
    """Whether ``destination`` is in the object-store family."""
    return isinstance(destination, ObjectURL)


def url_of(argument: Any) -> Optional[ObjectURL]:
    """The ObjectURL that ``argument`` names, None when it is a path (or not a name at all).
    Raises UnsupportedDestination for a URL of a scheme not served."""
    if isinstance(argument, ObjectURL):
        return argument
    if not isinstance(argument, str):  # PathLike and bytes are paths: Path("s3://x") is "s3:/x"
        return None
    match = _URL.match(argument)
    if match is None:
        return None
    scheme = match.group(1).lower()
    if scheme not in SCHEMES:
        raise UnsupportedDestination(
            f"safestage cannot save to {argument!r}: the scheme {scheme}:// is not served "
            f"(served: {', '.join(f'{name}://' for name in SCHEMES)}, and paths, FUSE mounts "
            "included). Nothing was written: a plain save would have written into a local "
            f"directory named {scheme}:. For HDFS, mount it with HDFS FUSE and pass the path."
        )
    rest = argument[match.end():]
    bucket, _, key = rest.partition("/")
    key = key.strip("/")
    if not bucket or any(part in (".", "..") for part in key.split("/") if key) or "//" in key:
        raise UnsupportedDestination(
            f"safestage cannot save to {argument!r}: name a bucket and a key "
            f"({scheme}://bucket/run/checkpoint-100), with no empty, '.' or '..' part."
        )
    control = _CONTROL.search(key)
    if control is not None:
        raise UnsupportedDestination(
            f"safestage cannot save to {argument!r}: its key {key!r} holds the control character "
            f"{control.group()!r}, which the store client (obstore, Rust object_store) cannot name, "
            "though a store may hold such a key: rename it without control characters."
        )
    return ObjectURL(scheme, bucket, key)


def file_url(argument: Any) -> Optional[ObjectURL]:
    """The ObjectURL of a file save (``save_file(t, "s3://b/model.safetensors")``), None for a
    path; a URL naming a bucket or ending in ``/`` names no file and is refused."""
    url = url_of(argument)
    if url is None:
        return None
    if not url.key or (isinstance(argument, str) and argument.endswith("/")):
        raise UnsupportedDestination(
            f"safestage cannot save to {argument!r}: it names a bucket or a prefix, not an "
            "object: name the file (s3://bucket/run/model.safetensors)."
        )
    return url


def not_found(url: ObjectURL) -> FileNotFoundError:
    return FileNotFoundError(errno.ENOENT, f"{url}: no such object", str(url))
