"""The names safestage gives its temporary files and staging directories.

One place, so that `safestage clean` can recognise exactly these (and nothing else). Every
name carries the host and pid of its maker for humans and for cleaners on other hosts; on
this host liveness is decided by a lock the owner holds (``_locks``), because a pid means
nothing across PID namespaces.

Patterns end in ``\\Z`` and match newlines (``re.DOTALL``): a destination name may contain
a newline, and ``$`` would also accept a look-alike with a trailing newline.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

_MAX_NAME = 255  # NAME_MAX on Linux filesystems, HDFS and S3 keys alike


def host_identity(nodename: str) -> str:
    """An unambiguous, filename-safe identity of the host called ``nodename``.

    A host name made of letters, digits and '-' (what RFC 1123 and Kubernetes pod names
    allow, at most 64 characters on Linux) is used whole: two pods whose names share a long
    prefix stay two hosts. Anything else is cut to a readable part plus a digest of the whole
    name after '_', a character the whole names never contain, so the two kinds never collide.
    """
    if re.fullmatch(r"[A-Za-z0-9-]{1,64}", nodename):
        return nodename
    import hashlib

    readable = re.sub(r"[^A-Za-z0-9-]", "-", nodename)[:40] or "host"
    return f"{readable}_{hashlib.sha256(os.fsencode(nodename)).hexdigest()[:12]}"


HOST = host_identity(os.uname().nodename)
_HOST = HOST  # the name the tests use

_OWNER = r"(?P<host>[A-Za-z0-9_-]+)-(?P<pid>\d+)-[0-9a-f]{8}"
# .<final name>.safestage-<host>-<pid>-<token>.tmp beside the destination
_TEMP_RE = re.compile(rf"\..*\.safestage-{_OWNER}\.tmp\Z", re.DOTALL)
# safestage-<host>-<pid>-<token> directories under the staging root
_STAGE_RE = re.compile(rf"safestage-{_OWNER}\Z")
# .safestage-doctor-<host>-<pid>-<token> probe directories `safestage doctor` makes in the
# path it checks: a name of their own, because unlike a staging directory (which may hold
# the only complete copy after a failed publish) a probe directory is always disposable.
_DOCTOR_RE = re.compile(rf"\.safestage-doctor-{_OWNER}\Z")
# The temp file safetensors 0.8 writes beside its target before renaming it (Rust's tempfile
# crate: ".tmp" and six letters or digits). In a private staging directory this, and only
# this, is a torn write; every other file may be the only complete copy of a save.
_WRITER_TEMP_RE = re.compile(r"\.tmp[A-Za-z0-9]{6}\Z")


# A file safestage.staged_dir puts at the top of its private staging directory while the
# directory holds nothing anyone needs: while the with-block is still writing the checkpoint
# (a process killed then leaves an incomplete checkpoint), and again once the commit has
# landed (a process killed while removing the directory leaves a partial copy). Sweeps and
# `safestage clean` remove such a directory of a dead owner whatever else it holds.
DISPOSABLE_MARKER = "safestage-disposable"

# What a kept copy is for, beside it in its private staging directory (JSON: the destination,
# the local name, what was left to publish): `safestage clean` shows it, recover reads it.
KEPT_RECORD = "safestage-kept.json"


@dataclass(frozen=True)
class Owner:
    host: str
    pid: int

    def is_this_host(self) -> bool:
        return self.host == HOST


def _tag() -> str:
    return f"safestage-{HOST}-{os.getpid()}-{os.urandom(4).hex()}"


def temp_name(final_name: str) -> str:
    """A hidden sibling name for ``final_name``, unique per call, at most 255 bytes."""
    suffix = f".{_tag()}.tmp"
    budget = _MAX_NAME - len(suffix.encode()) - 1
    return f".{os.fsdecode(os.fsencode(final_name)[:budget])}{suffix}"


def save_dir_name() -> str:
    """A fresh name for one save's private staging directory (made with mkdir, 0700)."""
    return _tag()


def doctor_dir_name() -> str:
    """A fresh name for a `safestage doctor` probe directory (hidden, made with mkdir, 0700)."""
    return f".{_tag().replace('safestage-', 'safestage-doctor-', 1)}"


def local_name(final_name: str) -> str:
    """The name a save is staged under in its private directory: the final name, unless
    that looks like safetensors' own temp file (then a sweep would take the only complete
    copy for a torn write) or is one of the names safestage itself puts there."""
    reserved = is_writer_temp(final_name) or final_name in (DISPOSABLE_MARKER, KEPT_RECORD)
    return f"{final_name}.staged" if reserved else final_name


def is_writer_temp(name: str) -> bool:
    return _WRITER_TEMP_RE.match(name) is not None


def parse_temp_name(name: str) -> Optional[Owner]:
    match = _TEMP_RE.match(name)
    return Owner(match["host"], int(match["pid"])) if match else None


def parse_stage_dir(name: str) -> Optional[Owner]:
    match = _STAGE_RE.match(name)
    return Owner(match["host"], int(match["pid"])) if match else None


def parse_doctor_dir(name: str) -> Optional[Owner]:
    match = _DOCTOR_RE.match(name)
    return Owner(match["host"], int(match["pid"])) if match else None
