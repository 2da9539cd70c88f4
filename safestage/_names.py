"""The names safestage gives its temporary files and staging directories.

One place, so that `safestage clean` can recognise exactly these (and nothing else) and
tell whether the process that made them is gone: every name carries host and pid.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

_MAX_NAME = 255  # NAME_MAX on Linux filesystems, HDFS and S3 keys alike
_HOST = re.sub(r"[^A-Za-z0-9_-]", "_", os.uname().nodename)[:32] or "host"

# .<final name>.safestage-<host>-<pid>-<token>.tmp beside the destination
_TEMP_RE = re.compile(r"^\..*\.safestage-(?P<host>[A-Za-z0-9_-]+)-(?P<pid>\d+)-[0-9a-f]{8}\.tmp$")
# safestage-<host>-<pid>-<token> directories under the staging root
_STAGE_RE = re.compile(r"^safestage-(?P<host>[A-Za-z0-9_-]+)-(?P<pid>\d+)-[0-9a-f]{8}$")
# .safestage-doctor-<host>-<pid>-<token> probe directories `safestage doctor` makes in the
# path it checks: a name of their own, because unlike a staging directory (which may hold
# the only complete copy after a failed publish) a probe directory is always disposable.
_DOCTOR_RE = re.compile(r"^\.safestage-doctor-(?P<host>[A-Za-z0-9_-]+)-(?P<pid>\d+)-[0-9a-f]{8}$")


@dataclass(frozen=True)
class Owner:
    host: str
    pid: int

    def is_this_host(self) -> bool:
        return self.host == _HOST


def _tag() -> str:
    return f"safestage-{_HOST}-{os.getpid()}-{os.urandom(4).hex()}"


def temp_name(final_name: str) -> str:
    """A hidden sibling name for ``final_name``, unique per call, at most 255 bytes."""
    suffix = f".{_tag()}.tmp"
    budget = _MAX_NAME - len(suffix.encode()) - 1
    stem = os.fsencode(final_name)[:budget].decode(errors="ignore")
    return f".{stem}{suffix}"


def stage_dir_name() -> str:
    """A fresh name for one save's private staging directory (made with mkdir, 0700)."""
    return _tag()


def doctor_dir_name() -> str:
    """A fresh name for a `safestage doctor` probe directory (hidden, made with mkdir, 0700)."""
    return f".safestage-doctor-{_HOST}-{os.getpid()}-{os.urandom(4).hex()}"


def parse_temp_name(name: str) -> Optional[Owner]:
    match = _TEMP_RE.match(name)
    return Owner(match["host"], int(match["pid"])) if match else None


def parse_stage_dir(name: str) -> Optional[Owner]:
    match = _STAGE_RE.match(name)
    return Owner(match["host"], int(match["pid"])) if match else None


def parse_doctor_dir(name: str) -> Optional[Owner]:
    match = _DOCTOR_RE.match(name)
    return Owner(match["host"], int(match["pid"])) if match else None
