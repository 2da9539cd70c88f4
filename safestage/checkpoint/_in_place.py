"""Committing a checkpoint directory that another writer already filled at its destination
(``safestage.commit_in_place``; the transformers Trainer's checkpoint-N): the one commit
sequence with a read-back in place of the publish: remove the old commit file, read every file
back (sizes, CRC-32, safetensors headers, JSON, index weight maps), then publish the commit file
last."""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import time
from pathlib import Path
from typing import Any, Optional

from .. import _config, _work
from .._config import PathArg, Publish, Settings
from .._errors import PublishError
from .._names import is_writer_temp, parse_temp_name
from .._paths import real_directory
from .._publish import CHUNK_BYTES
from ._manifest import COMMIT_NAME, SET_ASIDE_NAME, Crc32, FileEntry, Manifest, unsafe_path
from ._sequence import Commit

log = logging.getLogger("safestage")

_MAX_JSON_CHECK = 64 << 20


def commit_in_place(
    directory: PathArg,
    root: Optional[PathArg] = None,
    *,
    publish: Optional[Publish] = None,
    fsync: bool = True,
) -> Manifest:
    """Commit a checkpoint directory that another writer has already filled at its
    destination (the transformers Trainer writing ``checkpoint-N``, one process per rank):

    1. pending background saves of files under it (this process's) land first; then the
       directory's commit file, if any, is removed (fsync'ed), so that from here until the new
       one lands the directory is not complete;
    2. temp files of safestage writers that are gone (``safestage clean``'s rules), in it and
       in its subdirectories, are removed;
    3. every file is read back from the destination: its size and CRC-32 go into the manifest;
       a ``.safetensors`` file's header must parse and its tensors cover the data exactly, a
       ``.json`` file must parse, and every file a ``*.index.json`` weight map names must be
       there. Anything wrong raises PublishError (EBADMSG, ``step="verify"``) naming it, and no
       commit file is written; so does a directory holding no file (ENOENT);
    4. the commit file is published last, as every commit's (``publish``, ``fsync``, the
       staging root ``root`` holds it for a moment).

    Returns the Manifest written. Only call it once every writer of the directory has finished
    (a barrier across ranks): the manifest vouches for what is there when it is read.
    """
    settings = _config.resolve(root=root, publish=publish, fsync=fsync)
    dest = checkpoint_directory(directory)
    with _work.running("commit", dest, None):
        return commit_written(dest, settings)


def checkpoint_directory(directory: PathArg) -> Path:
    text = os.fspath(directory)
    dest = real_directory(text)
    if dest is None:
        raise PublishError(
            errno.ENOENT,
            f"safestage.commit_in_place: {text!r} is not a directory: nothing to commit.",
            str(text),
            step="inspect",
        )
    return dest


def commit_written(dest: Path, settings: Settings, *, started: Optional[float] = None, retention: Any = None,
                   spare: Optional[dict[Path, str]] = None) -> Manifest:  # fmt: skip
    """The one commit sequence for files written in place: prepare (the previous commit file
    and dead temps go), read back instead of publish, the commit file last, then retention."""
    began = time.perf_counter()
    commit = Commit.in_place(dest, settings, started=started, retention=retention)
    try:
        staying = commit.prepare(None)
        files, empty = _scan_in_place(dest, staying)
        if not files:
            # Committed, an empty checkpoint would be the newest complete one (latest_complete
            # names it, keep= removes a real one to make room): refused, as a staged_dir block
            # that wrote nothing is.
            raise PublishError(
                errno.ENOENT,
                f"safestage will not commit {dest}: {dest} holds no file (nothing, or only empty "
                "directories): nothing to vouch for. No commit file was written: it is not complete "
                "(verify and latest_complete say so). Commit it once its writers have written it.",
                str(dest),
                step="verify",
            )
        entries, problems = _read_back(dest, files)
        if problems:
            raise PublishError(
                errno.EBADMSG,
                f"safestage will not commit {dest}: {len(problems)} problem(s) in the files at the "
                f"destination: {'; '.join(problems[:5])}{' ...' if len(problems) > 5 else ''}. No "
                f"commit file was written: {dest} is not complete (verify and latest_complete say so). "
                f"Write the checkpoint again, then commit again.",
                str(dest),
                step="verify",
            )
        manifest = commit.commit_file(entries, empty)
    finally:
        commit.finish()  # the commit file's save directory: nothing else is kept in place
    log.debug(
        "%s: committed in place, %d files, %d bytes read back in %.3fs",
        dest, len(manifest.files), manifest.total_bytes, time.perf_counter() - began,
    )  # fmt: skip
    if retention is not None:  # only now that its commit file has landed; never raises
        retention.after_commit(dest, settings.root, spare=spare)
    return manifest


def _scan_in_place(dest: Path, staying: dict[str, str]) -> tuple[list[tuple[str, int]], list[str]]:
    """The files of the checkpoint at ``dest`` (relative paths, sizes) and its empty
    directories. Not part of it: the commit file, safestage's temp files (those that stay,
    logged with the reason from ``staying``) and safetensors' own temp files. Refused:
    symlinks, FIFOs, sockets, devices."""
    files: list[tuple[str, int]] = []
    empty: list[str] = []
    stack = [("", dest)]
    while stack:
        relative, directory = stack.pop()
        try:
            with os.scandir(directory) as listing:
                entries = sorted(listing, key=lambda entry: entry.name)
        except OSError as exc:
            raise PublishError(
                exc.errno,
                f"safestage will not commit {dest}: cannot list {directory}: [Errno {exc.errno}] "
                f"{exc.strerror}. No commit file was written.",
                str(directory),
                step="scan",
            ) from exc
        if relative and not entries:
            empty.append(relative)
        for entry in entries:
            path = f"{relative}/{entry.name}" if relative else entry.name
            if path in (COMMIT_NAME, SET_ASIDE_NAME):
                continue
            if parse_temp_name(entry.name) is not None or is_writer_temp(entry.name):
                why = staying.get(path, "its writer may still run")
                log.warning("%s: %s is a temp file not committed (%s)", dest, path, why)
                continue
            info = entry.stat(follow_symlinks=False)
            problem = unsafe_path(path)
            if stat.S_ISDIR(info.st_mode) and problem is None:
                stack.append((path, Path(entry.path)))
                continue
            if stat.S_ISLNK(info.st_mode):
                problem = "is a symlink (it could point outside the checkpoint)"
            elif not stat.S_ISREG(info.st_mode):
                problem = "is not a regular file or directory (a FIFO, socket or device)"
            if problem is not None:
                raise PublishError(
                    errno.EINVAL,
                    f"safestage will not commit {dest}: {entry.path} {problem}. No commit file "
                    f"was written.",
                    entry.path,
                    step="scan",
                )
            files.append((path, info.st_size))
    return files, empty


def _read_back(dest: Path, files: list[tuple[str, int]]) -> tuple[list[FileEntry], list[str]]:
    """Each file's entry (size and CRC-32 of the bytes read now) and what is wrong with them."""
    from ._verify import safetensors_problem

    entries: list[FileEntry] = []
    problems: list[str] = []
    present = {path for path, _ in files}
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    for path, _ in files:
        crc = Crc32()
        size = 0
        kept = bytearray()  # a .json file's bytes, to parse
        try:
            # O_NONBLOCK: a FIFO swapped in since the listing must not hang the commit.
            fd = os.open(dest / path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            problems.append(f"{path}: cannot open: {exc.strerror} (errno {exc.errno})")
            continue
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                problems.append(f"{path}: not a regular file any more")
                continue
            expected = info.st_size
            while count := os.readv(fd, [view]):
                crc.update(view[:count])
                size += count
                if path.endswith(".json") and size <= _MAX_JSON_CHECK:
                    kept += view[:count]
            header = safetensors_problem(fd, size) if path.endswith(".safetensors") else None
        except OSError as exc:
            problems.append(f"{path}: cannot read: {exc.strerror} (errno {exc.errno})")
            continue
        finally:
            os.close(fd)
        if size != expected:
            problems.append(
                f"{path}: {size} bytes read, {expected} announced (still being written?)"
            )
        if header is not None:
            problems.append(f"{path}: not a complete safetensors file: {header}")
        if path.endswith(".json") and size <= _MAX_JSON_CHECK:
            problems += _json_problems(path, bytes(kept), present)
        entries.append(FileEntry(path, size, crc.hexdigest()))
    return entries, problems


def _json_problems(path: str, data: bytes, present: set[str]) -> list[str]:
    """A JSON file of the checkpoint must parse (trainer_state.json and config.json are
    plain open() writes); a ``*.index.json`` must name only files that are there."""
    try:
        document = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # as _manifest.parse
        return [f"{path}: not valid JSON (torn?): {exc}"]
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not path.endswith(".index.json") or not isinstance(weight_map, dict):
        return []
    folder = path.rpartition("/")[0]
    here = (
        {p[len(folder) + 1 :] for p in present if p.startswith(f"{folder}/")} if folder else present
    )
    missing = sorted({str(name) for name in weight_map.values()} - here)
    return [f"{path} names files that are not there: {', '.join(missing[:5])}"] if missing else []


# -- the destination ----------------------------------------------------------------------------
