"""Paths as the kernel resolves them, never as text.

``os.path.abspath("link/../model.safetensors")`` drops ``link/..`` as text, but the kernel
follows ``link`` first and then goes to *its* parent; ``missing/../x`` is ENOENT to the
kernel and ``x`` to abspath; ``ckpt/`` is ENOTDIR or EISDIR to the kernel and ``ckpt`` to
pathlib. A staged save must write exactly the file a plain save would (or fail as it
would), so the destination's directory is opened and the kernel says where it is.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path
from typing import Optional

# O_PATH: resolving a directory needs search permission on the way, not read permission on
# the directory itself (a plain save works in a directory that is -wx).
_OPEN_DIRECTORY = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC


def real_directory(path: str | os.PathLike[str]) -> Optional[Path]:
    """The absolute path of the directory ``path`` names, as the kernel resolves it (symlinks
    followed before ``..``), or None if it does not resolve to a directory."""
    try:
        fd = os.open(path, _OPEN_DIRECTORY)
    except (OSError, ValueError):
        return None
    removed = False
    try:
        removed = os.fstat(fd).st_nlink == 0  # not the " (deleted)" text: a real name may end so
        real = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # no /proc: realpath agrees with the kernel once the directory exists
        real = os.path.realpath(path)
    finally:
        with contextlib.suppress(OSError):  # a read-only descriptor: nothing to report
            os.close(fd)
    if removed or not real.startswith("/"):
        return None  # removed meanwhile, or outside our root ("(unreachable)/...")
    return Path(real)


def resolve_destination(filename: str) -> Optional[Path]:
    """Where a plain save of ``filename`` puts its file: the kernel's path of its directory
    plus its last component (a symlink there is replaced, as safetensors 0.8 does).

    None when a plain save fails before writing anything (missing or non-directory parent,
    a trailing slash, a last component of ``.`` or ``..``, an existing directory): the
    caller then lets the original writer raise exactly its own error.
    """
    if not filename or filename.endswith("/"):
        return None
    head, name = os.path.split(filename)
    if name in ("", ".", ".."):
        return None
    directory = real_directory(head or ".")
    if directory is None:
        return None
    dest = directory / name
    try:
        if stat.S_ISDIR(os.stat(dest).st_mode):
            return None
    except OSError:
        pass  # missing (a new file), a dangling symlink, or unreadable: the save decides
    return dest


def absolute(path: str | os.PathLike[str]) -> Path:
    """``path`` made absolute without normalizing it: ``..`` stays for the kernel to resolve."""
    return Path(os.getcwd(), os.fspath(path)) if not os.path.isabs(path) else Path(path)
