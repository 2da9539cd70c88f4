"""Resume from an object store: ``fetch`` downloads a committed checkpoint to a local directory.

A job that commits to ``s3://b/run`` resumes on a node that has only a local disk: ``fetch``
reads the commit object first (``_manifest``: each object's size, CRC-32 and ETag), then
downloads each listed object in parallel ranged GETs, each GET conditional on the object's
ETag in the commit (If-Match), so that an object a stale writer overwrote since the commit is
refused (ESTALE), never mixed into the copy (``_object_store.download``). Each file is checked
against its size and CRC-32 (each range's, combined) while it is written, lands under a temp name (``_names``) and is
renamed into place; the commit file is written last, with the commit object's own bytes. The
local copy is then itself a complete checkpoint: ``verify`` passes on it, ``latest_complete``
of the local directory names it, and ``from_pretrained``, ``dcp.load`` or a Trainer's
``resume_from_checkpoint`` read it as they read any directory.

A fetch that fails leaves no commit file (it removes a previous one before it changes
anything), so a partial local copy never looks complete. Running it again resumes: a file
already there with the size and CRC-32 of the commit is kept, every other one is fetched
again; temp files of a fetch that was killed are removed (``safestage clean``'s rules).
Files in the local directory that the commit does not list are left alone (``verify --deep``
names them).

Memory: one file at a time, ``RANGES_AT_ONCE`` ranged GETs of ``RANGE_BYTES`` in flight, each
written where it belongs as it streams in, in pieces of ``PIECE_BYTES``: the client holds a few
pieces per range in flight, never a range or a file (benchmarks/fetch_memory.py).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

from .. import _object_store
from .._clean import remove_dead_temps
from .._config import PathArg
from .._destination import ObjectURL, url_of
from .._errors import ConfigError, FetchError
from .._interrupts import deferred
from .._locks import claim, close_quietly
from .._names import temp_name
from .._publish import CHUNK_BYTES, fsync_directory, write_all
from ._manifest import COMMIT_NAME, SET_ASIDE_NAME, Crc32, FileEntry, ManifestError, parse
from ._sequence import read_commit_bytes

log = logging.getLogger("safestage")

# The set-aside marker is a few hundred bytes; anything larger is not one of ours.
_MARKER_LIMIT = 1 << 20


class NothingCommitted(FetchError):
    """No commit object at the URL, and no complete checkpoint under it (ENOENT)."""


@dataclass(frozen=True)
class Fetched:
    """What a fetch did: the local checkpoint, where it came from, and how much it moved."""

    path: Path
    source: ObjectURL
    files: int
    nbytes: int  # bytes downloaded
    kept: int  # files already there, matching the commit: not downloaded again
    seconds: float


def fetch(url: Union[str, ObjectURL], local_dir: PathArg, *, pattern: str = "checkpoint-*") -> Path:
    """Download the committed checkpoint at ``url`` into ``local_dir/<its name>`` and return
    that path, a complete checkpoint (its commit file last) for ``from_pretrained``,
    ``dcp.load`` or ``resume_from_checkpoint``.

    ``url`` is a checkpoint (``s3://b/run/checkpoint-100``, which holds the commit object) or a
    run (``s3://b/run``): then the newest complete checkpoint under it whose name matches
    ``pattern``, as ``latest_complete`` finds it. Each object is checked against the commit
    (ETag, size, CRC-32). Raises FetchError (an OSError: ENOENT nothing complete there or an
    object missing, ESTALE an object overwritten since the commit, EBADMSG a CRC-32 mismatch,
    the store's errno otherwise) and leaves no commit file locally; running it again resumes."""
    return fetch_checkpoint(url, local_dir, pattern=pattern).path


def fetch_checkpoint(
    url: Union[str, ObjectURL], local_dir: PathArg, *, pattern: str = "checkpoint-*"
) -> Fetched:
    """``fetch``, saying what it did (the CLI prints it)."""
    source = url_of(url)
    if source is None:
        raise ConfigError(
            f"safestage.fetch takes an object-store URL (s3://bucket/run, or "
            f"s3://bucket/run/checkpoint-100), not the path {url!r}: a checkpoint on a "
            "filesystem is read where it is (safestage.latest_complete(path) names it)."
        )
    if url_of(local_dir) is not None:
        raise ConfigError(
            f"safestage.fetch downloads to a local directory, not to {local_dir!r}: to copy "
            "between buckets, use the store's own copy."
        )
    found = committed(source, pattern)
    if found is None:
        raise NothingCommitted(
            errno.ENOENT,
            f"safestage could not fetch {source}: there is no commit object {COMMIT_NAME} there, "
            f"and no complete checkpoint matching {pattern!r} under it (check the URL; `safestage "
            f"latest {source}` shows what is there). Nothing was written to {os.fspath(local_dir)}.",
            str(source),
        )
    checkpoint, data = found
    return download_checkpoint(checkpoint, data, Path(os.fspath(local_dir)))


def committed(source: ObjectURL, pattern: str) -> Optional[tuple[ObjectURL, bytes]]:
    """The checkpoint ``source`` names and its commit object's bytes: ``source`` itself if it
    holds a commit object, else the newest complete one under it; None if neither."""
    try:
        return source, read_commit_bytes(source)
    except FileNotFoundError:
        pass
    except _object_store.StoreError as exc:
        raise FetchError(
            exc.errno, f"safestage could not fetch {source}: {exc.message}", str(source)
        ) from exc
    from ._verify import latest_complete

    try:
        newest = latest_complete(str(source), pattern)
    except ConfigError:
        raise
    except OSError as exc:
        if exc.errno == errno.ENOENT:  # no such run (a prefix with no object below it)
            return None
        raise FetchError(exc.errno, f"safestage could not fetch {source}: could not look for its newest "
                         f"complete checkpoint: {exc}", str(source)) from exc  # fmt: skip
    if newest is None:
        return None
    checkpoint = newest if isinstance(newest, ObjectURL) else url_of(str(newest))
    if checkpoint is None:
        raise TypeError(f"latest_complete({str(source)!r}) named {newest!r}, not a URL")
    try:
        return checkpoint, read_commit_bytes(checkpoint)
    except FileNotFoundError as exc:  # removed since it was found (retention of a live run)
        raise FetchError(errno.ENOENT, f"safestage could not fetch {checkpoint}: its commit object was removed "
                         "after it was found (retention of a run still saving?): fetch again", str(checkpoint)) from exc  # fmt: skip
    except _object_store.StoreError as exc:
        raise FetchError(
            exc.errno, f"safestage could not fetch {checkpoint}: {exc.message}", str(checkpoint)
        ) from exc


def download_checkpoint(checkpoint: ObjectURL, data: bytes, local_dir: Path) -> Fetched:
    """Fetch every object the commit ``data`` of ``checkpoint`` lists into
    ``local_dir/<checkpoint's name>``, then write ``data`` there as the commit file, last."""
    started = time.perf_counter()
    try:
        manifest = parse(data)
    except ManifestError as exc:
        raise FetchError(errno.EBADMSG, f"safestage could not fetch {checkpoint}: its commit object "
                         f"{COMMIT_NAME} cannot be trusted: {exc}", str(checkpoint / COMMIT_NAME)) from exc  # fmt: skip
    target = local_dir / (checkpoint.name or checkpoint.bucket)
    nbytes = kept = 0
    current: Optional[str] = None
    try:
        target.mkdir(parents=True, exist_ok=True)
        # Before anything changes: a previous commit file would vouch for a mix of files.
        _unlink(target / COMMIT_NAME)
        remove_dead_temps(target)  # a killed fetch's temp files
        for entry in manifest.files:
            current = entry.path
            dest = target / entry.path
            dest.parent.mkdir(parents=True, exist_ok=True)
            if _matches(dest, entry):
                kept += 1
                continue
            _fetch_file(checkpoint / entry.path, entry, dest)
            nbytes += entry.size
        current = None
        for directory in manifest.directories:
            (target / directory).mkdir(parents=True, exist_ok=True)
        _copy_marker(checkpoint, target)
        for parent in sorted(
            {(target / entry.path).parent for entry in manifest.files}, reverse=True
        ):
            fsync_directory(parent)  # the files' names are durable before the commit file
        _write_file(target / COMMIT_NAME, data)
    except (OSError, _object_store.StoreError) as exc:
        raise _failed(exc, checkpoint, target, current) from exc
    fetched = Fetched(
        target, checkpoint, len(manifest.files), nbytes, kept, time.perf_counter() - started
    )
    log.debug("safestage.fetch: %s -> %s: %d files, %d bytes downloaded, %d kept, %.2f s",
              checkpoint, target, fetched.files, nbytes, kept, fetched.seconds)  # fmt: skip
    return fetched


def _matches(dest: Path, entry: FileEntry) -> bool:
    """Whether ``dest`` is already the file of ``entry`` (a resumed fetch): a regular file of
    its size and CRC-32."""
    try:
        fd = os.open(dest, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size != entry.size:
            return False
        crc = Crc32()
        while True:
            piece = os.read(fd, CHUNK_BYTES)
            if not piece:
                break
            crc.update(memoryview(piece))
        return crc.hexdigest() == entry.digest
    except OSError:
        return False
    finally:
        os.close(fd)


def _fetch_file(source: ObjectURL, entry: FileEntry, dest: Path) -> None:
    """Download ``source`` into a temp beside ``dest``, check its CRC-32, rename it into place."""

    def fill(fd: int, temp: Path) -> None:
        claim(fd, temp)  # locked while written: `safestage clean` leaves it alone
        crc = _object_store.download(source, fd, size=entry.size, etag=entry.etag)
        if f"{crc:08x}" != entry.digest:
            raise FetchError(
                errno.EBADMSG,
                f"{source} has CRC-32 {crc:08x}, the commit says {entry.digest}: it is not the "
                "object that was committed",
                str(source),
            )

    _land(dest, fill)


def _copy_marker(checkpoint: ObjectURL, target: Path) -> None:
    """The set-aside marker of ``checkpoint`` (a resumed run abandoned it: ``_timeline``), if it
    has one, so that ``latest_complete`` of the local directory never names it either."""
    marker = _object_store.read(checkpoint / SET_ASIDE_NAME, limit=_MARKER_LIMIT)
    if marker is None:
        _unlink(target / SET_ASIDE_NAME)
    else:
        _write_file(target / SET_ASIDE_NAME, marker)


def _write_file(dest: Path, data: bytes) -> None:
    _land(dest, lambda fd, temp: write_all(fd, memoryview(data)))
    fsync_directory(dest.parent)


def _land(dest: Path, fill: Callable[[int, Path], None]) -> None:
    """``fill(fd, temp)`` writes a new temp beside ``dest``; fsynced, then renamed into place.
    Any failure (or interrupt) removes the temp: a partial file never takes the name."""
    temp = dest.parent / temp_name(dest.name)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        fill(fd, temp)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(temp, dest)
    except BaseException:
        with deferred():
            if fd >= 0:
                close_quietly(fd)
            _unlink(temp)
        raise


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


_WHAT = {
    errno.ENOENT: "is listed in the commit but missing from the store: the checkpoint there is not "
    "complete (`safestage verify` of it says so); fetch an older one, or the run URL for the "
    "newest complete one",
    errno.ESTALE: "was overwritten after the commit (a stale writer of the same step?): the "
    "checkpoint there is no longer the one committed, and nothing of the new object was kept; "
    "fetch an older one, or the run URL for the newest complete one",
    errno.EBADMSG: "does not match its CRC-32 in the commit: the checkpoint there is no longer the "
    "one committed; fetch an older one, or the run URL for the newest complete one",
}


def _failed(
    exc: BaseException, checkpoint: ObjectURL, target: Path, current: Optional[str]
) -> FetchError:
    code = getattr(exc, "errno", None) or errno.EIO
    from_store = isinstance(exc, (FetchError, _object_store.StoreError))
    what = _WHAT.get(code) if current is not None and from_store else None
    detail = (getattr(exc, "message", None) or str(exc)).rstrip(". ")
    if not from_store and getattr(exc, "filename", None):  # the local disk's error: its path
        where = str(exc.filename)  # type: ignore[attr-defined]
    else:
        where = f"{checkpoint / current}" if current is not None else str(checkpoint)
    head = f"safestage could not fetch {checkpoint} to {target}: "
    if what is not None:
        body = f"{where} {what} ({detail}; [Errno {code}] {os.strerror(code)})."
    else:
        body = f"{detail} ([Errno {code}] {os.strerror(code)}; running the fetch again resumes it)."
    return FetchError(
        code,
        f"{head}{body} {target} has no commit file, so nothing takes it for a complete checkpoint; "
        "files already fetched that match the commit are kept for the next fetch.",
        where,
    )
