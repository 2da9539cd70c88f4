"""The object-store family of destinations: S3, GCS and Azure Blob, with no mount, on obstore.

What a checkpoint needs from a bucket, and nothing more: stream a staged file to its key
(multipart, in parallel, memory bounded by ``PART_BYTES * PARTS_AT_ONCE``), put a small object
only if it does not exist (the commit object: ``If-None-Match: *`` on S3 and Azure,
``ifGenerationMatch=0`` on GCS), read one, list a prefix page by page, and delete in batches.
obstore (Rust's object_store) is imported here and only here, at first use: the package keeps
Python 3.9 and no dependency for users of paths.

An object PUT is atomic on all three stores: a reader sees the old object or the new one,
never part of one. A failed multipart upload is aborted by obstore and publishes nothing of
itself; one cut short by a kill is invisible to a LIST and costs storage until it is aborted:
on S3, retention aborts those below a checkpoint it removes (``uploads_in_flight``, sent by
``_s3_uploads``: obstore has no request for it); elsewhere, and on S3 without static keys, the
bucket's lifecycle rule for incomplete multipart uploads removes them (docs/object-stores.md).

Credentials and endpoints come from each store's standard environment (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, ``AWS_ALLOW_HTTP``; the
GCS and Azure equivalents), or from ``storage_options`` given for a bucket (``configure``).
Errors name the URL, the operation and the store's answer, never a secret.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import threading
import time
import zlib
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from . import _s3_uploads
from ._destination import SCHEMES, ObjectURL, url_of
from ._errors import ConfigError, PublishError
from ._s3_uploads import InFlight

log = logging.getLogger("safestage")

# A multipart upload's part, and how many go at once: the client holds at most about
# PART_BYTES * PARTS_AT_ONCE of a file (benchmarks/object_stores.py), and one multipart upload
# runs at a time in a process (_one_multipart), so that a commit publishing several large files
# at once holds that much in all, not that much per file. S3 allows 10,000 parts: a file larger
# than PART_BYTES * MAX_PARTS gets larger parts.
PART_BYTES = 8 << 20
PARTS_AT_ONCE = 8
MAX_PARTS = 9_000
# A download's ranged GETs, how many are in flight, and the pieces each is streamed in: the
# client holds about PIECE_BYTES * RANGES_AT_ONCE of an object (benchmarks/fetch_memory.py).
RANGE_BYTES = PART_BYTES
RANGES_AT_ONCE = PARTS_AT_ONCE
PIECE_BYTES = 1 << 20
# Objects obstore hands back at a time while listing. Not the size of a LIST request's page: the
# store pages as it pages (S3 and GCS 1,000 keys a request, Azure 5,000), obstore sends no
# max-keys, and a listing costs one request per page of the store's.
PAGE = 1000


@dataclass(frozen=True)
class ObjectInfo:
    """One object of a listing: its key, size and ETag (or GCS generation), as the store says."""

    key: str
    size: int
    etag: Optional[str]
    modified: float


@dataclass(frozen=True)
class Uploaded:
    nbytes: int
    seconds: float
    digest: Optional[str]
    etag: Optional[str]


class StoreError(PublishError):
    """An object store refused or failed a request: names the URL, the operation and the
    store's answer (an OSError, with errno: ENOENT, EACCES, EEXIST, EIO)."""


# -- stores ------------------------------------------------------------------------------------------

_options: dict[tuple[str, str], dict[str, Any]] = {}
_stores: dict[tuple[str, str], Any] = {}
_lock = threading.Lock()
_one_multipart = threading.Lock()
# The process that made the first client. obstore runs every request on one tokio runtime per
# process, started then and never restarted: in a child forked after that, the runtime's
# threads are gone and any request waits forever (tokio#4301; obstore is not fork-safe,
# developmentseed/obstore#441). By pid, so that a grandchild is refused too.
_client_pid: Optional[int] = None


def configure(url: ObjectURL, options: Optional[Mapping[str, Any]]) -> None:
    """Use ``options`` (obstore's config keys, plus ``client_options`` and ``retry_config``)
    for every request to ``url``'s bucket from now on, in this process. None: the environment
    only. Never logged: they may hold secrets."""
    key = (url.scheme, url.bucket)
    with _lock:
        wanted = dict(options or {})
        if _options.get(key, {}) != wanted:
            _options[key] = wanted
            _stores.pop(key, None)


def configure_store(url: str, storage_options: Optional[Mapping[str, Any]]) -> None:
    """Explicit options for every request of this process to ``url``'s bucket, on top of the
    store's standard environment (``AWS_*``, ``GOOGLE_*``, ``AZURE_STORAGE_*``): obstore's
    config keys for the store (``endpoint``, ``region``, ``access_key_id``...), plus
    ``client_options`` (timeouts, proxies) and ``retry_config``. None: the environment only.
    They are never logged, and never in an error's message."""
    parsed = url_of(url)
    if parsed is None:
        raise ConfigError(errno.EINVAL, f"safestage.configure_store: {url!r} is not an object-store URL "
                          f"(one of {', '.join(s + '://' for s in SCHEMES)})", str(url))  # fmt: skip
    configure(parsed, storage_options)


def _obstore(url: ObjectURL) -> None:
    """Import obstore (here, at first use), or raise a StoreError saying what to install: before
    anything is sent, so that a save keeps its staged copy and says what to do."""
    try:
        import obstore.store  # noqa: F401 - the check
    except ImportError as exc:
        raise StoreError(
            errno.ENOPKG if hasattr(errno, "ENOPKG") else errno.ENOENT,
            f"safestage cannot reach {url}: obstore is not installed. Install it with "
            f"pip install 'safestage[{SCHEMES[url.scheme]}]' (Python 3.11 or newer).",
            str(url),
        ) from exc


def _store(url: ObjectURL) -> Any:
    global _client_pid
    if _client_pid is not None and _client_pid != os.getpid():
        raise StoreError(
            errno.EOPNOTSUPP,
            f"safestage cannot reach {url} from this process: it was forked from one that had "
            "already used an object store, and obstore's requests never return in such a child "
            "(its runtime's threads are not forked). Save to a URL from the parent, or start the "
            "worker with multiprocessing's 'spawn' or 'forkserver' start method.",
            str(url),
        )
    key = (url.scheme, url.bucket)
    with _lock:
        _client_pid = os.getpid()
        store = _stores.get(key)
        if store is not None:
            return store
        options = dict(_options.get(key, {}))
    _obstore(url)
    from obstore.store import from_url
    client_options = options.pop("client_options", None)
    retry_config = options.pop("retry_config", None)
    try:
        store = from_url(f"{url.scheme}://{url.bucket}", config=options or None,  # type: ignore[arg-type]
                         client_options=client_options, retry_config=retry_config)  # fmt: skip
    except Exception as exc:  # obstore's configuration errors
        raise _error(exc, url, "configure the client for") from exc
    with _lock:
        return _stores.setdefault(key, store)


def after_fork_in_child() -> None:
    """A forked child makes its own clients: a parent's connection pool is not the child's."""
    global _lock, _one_multipart
    _lock = threading.Lock()  # a parent thread may have held them at fork()
    _one_multipart = threading.Lock()
    _stores.clear()


# -- requests ----------------------------------------------------------------------------------------


def upload(staged: Path, url: ObjectURL, digest: Optional[Any] = None) -> Uploaded:
    """Stream ``staged`` to ``url``: one PUT for a small file, a parallel multipart upload for a
    large one (aborted by obstore on any failure, so that nothing of it is published).
    ``digest``: fed every byte uploaded, in order; its ``update`` may raise to cancel."""
    _obstore(url)  # what to install, where it is missing
    import obstore

    started = time.perf_counter()
    store = _store(url)
    size = os.stat(staged).st_size
    part = max(PART_BYTES, -(-size // MAX_PARTS))
    sent = [0]

    def pieces(handle: Any) -> Iterator[bytes]:
        while True:
            piece = handle.read(part)
            if not piece:
                return
            if digest is not None:
                digest.update(memoryview(piece))
            sent[0] += len(piece)
            yield piece

    try:
        with open(staged, "rb") as handle:
            if size <= part:
                data = handle.read()
                if digest is not None:
                    digest.update(memoryview(data))
                sent[0] = len(data)
                result = obstore.put(store, url.key, data, use_multipart=False)
            else:
                with _one_multipart:
                    try:
                        result = obstore.put(store, url.key, pieces(handle), chunk_size=part,
                                             max_concurrency=PARTS_AT_ONCE)  # fmt: skip
                    finally:
                        _return_freed_memory()
    except OSError as exc:
        if _from_store(exc):
            raise _error(exc, url, "upload") from exc
        raise
    except Exception as exc:
        if not _from_store(exc):
            raise  # the digest's cancel, a bug: as it is
        raise _error(exc, url, "upload") from exc
    if sent[0] != size:
        raise StoreError(
            errno.EIO,
            f"safestage: the staged copy {staged} changed while it was uploaded to {url} "
            f"({sent[0]} bytes read, {size} expected).",
            str(url),
        )
    hexdigest = digest.hexdigest() if digest is not None else None
    return Uploaded(size, time.perf_counter() - started, hexdigest, _etag(result.get("e_tag")))


def _return_freed_memory() -> None:
    """Give the parts an upload freed back to the system. glibc keeps freed memory in the arena
    of the thread that freed it: every thread that ever ran an upload (a commit's publishers,
    obstore's runtime) kept about its parts' worth, never returned, and the client grew with
    the number of threads, not the part size (measured: four uploads of 128 MiB, one at a time
    from four threads, held 200-260 MiB after they ended; with malloc_trim, 2-7 MiB)."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False  # not glibc: its allocator's business
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None


def put_bytes(url: ObjectURL, data: bytes, *, create: bool = False) -> Optional[str]:
    """Put ``data`` at ``url`` in one request; ``create``: only if nothing is there (raises a
    StoreError with EEXIST otherwise). Returns the new object's ETag."""
    _obstore(url)  # what to install, where it is missing
    import obstore

    try:
        result = obstore.put(_store(url), url.key, data, mode="create" if create else "overwrite",
                             use_multipart=False)  # fmt: skip
    except Exception as exc:
        if not _from_store(exc):
            raise
        raise _error(exc, url, "create" if create else "put") from exc
    return _etag(result.get("e_tag"))


def read(url: ObjectURL, *, limit: Optional[int] = None) -> Optional[bytes]:
    """The bytes of ``url``, None if there is no such object. ``limit``: refuse a larger one."""
    found = get(url, limit=limit)
    return None if found is None else found[0]


def get(url: ObjectURL, *, limit: Optional[int] = None) -> Optional[tuple[bytes, ObjectInfo]]:
    """The bytes of ``url`` and what the store says of it (one GET), None if there is no such
    object. ``limit``: refuse a larger one (EFBIG)."""
    _obstore(url)  # what to install, where it is missing
    import obstore

    try:
        answer = obstore.get(_store(url), url.key)
        if limit is not None and answer.meta["size"] > limit:
            raise StoreError(errno.EFBIG, f"{url} is {answer.meta['size']} bytes, more than {limit}: "
                             "not one of safestage's objects", str(url))  # fmt: skip
        return bytes(answer.bytes()), _info(answer.meta)
    except FileNotFoundError:
        return None
    except StoreError:
        raise
    except Exception as exc:
        if not _from_store(exc):
            raise
        raise _error(exc, url, "read") from exc


def chunks(url: ObjectURL, *, etag: Optional[str] = None, chunk: int = PART_BYTES) -> Iterator[bytes]:
    """The bytes of ``url`` in order, in pieces of about ``chunk`` bytes, from one streamed GET:
    the client holds one piece at a time, never the object. ``etag``: only the object of that
    ETag (If-Match); another one there now (overwritten since it was listed) raises a
    StoreError with ESTALE, and a missing one ENOENT."""
    _obstore(url)  # what to install, where it is missing
    import obstore

    try:
        answer = obstore.get(_store(url), url.key, options={"if_match": etag} if etag else None)
        for piece in answer.stream(min_chunk_size=chunk):
            yield bytes(piece)
    except Exception as exc:
        if not _from_store(exc):
            raise
        if type(exc).__name__ == "PreconditionError":
            raise StoreError(errno.ESTALE, f"safestage: {url} changed while it was read: it is no longer "
                             f"the object of ETag {etag} ({_answer(exc)})", str(url)) from exc  # fmt: skip
        raise _error(exc, url, "read") from exc


def read_range(url: ObjectURL, start: int, length: int) -> bytes:
    """``length`` bytes of ``url`` from ``start`` (one ranged GET)."""
    _obstore(url)  # what to install, where it is missing
    import obstore

    try:
        return bytes(obstore.get_range(_store(url), url.key, start=start, length=length))
    except Exception as exc:
        if not _from_store(exc):
            raise
        raise _error(exc, url, "read") from exc


def download(
    url: ObjectURL,
    fd: int,
    *,
    size: int,
    etag: Optional[str],
    chunk: int = RANGE_BYTES,
    at_once: int = RANGES_AT_ONCE,
) -> int:
    """Write the object ``url`` into the open file ``fd`` (at its offsets, with pwrite) and
    return the CRC-32 of what was written. The object must be ``size`` bytes and, given
    ``etag``, the object of that ETag: every request is conditional on it (If-Match), so that
    the ranges all come from one object. Ranged GETs of ``chunk`` bytes, ``at_once`` of them in
    flight, each streamed in pieces of ``PIECE_BYTES``: the client holds about ``at_once``
    pieces, never a range or the object. Raises StoreError: ENOENT no such object; ESTALE
    another object is there now (overwritten since the ETag or size was recorded)."""
    _obstore(url)  # what to install, where it is missing
    import obstore

    store = _store(url)
    condition: dict[str, Any] = {"if_match": etag} if etag else {}
    stop = threading.Event()

    def get(start: int) -> tuple[int, int]:
        """One range: (its CRC-32, its length)."""
        end = min(start + chunk, size)
        options = dict(condition)
        if end > start:  # a 0-byte object has no range to ask for: one plain GET
            options["range"] = (start, end)
        crc, offset = 0, start
        try:
            answer = obstore.get(store, url.key, options=options)  # type: ignore[arg-type]
            if answer.meta["size"] != size:  # before the body: never read a stranger
                raise StoreError(errno.ESTALE, f"safestage: {url} is {answer.meta['size']} bytes, not the {size} "
                                 "recorded: another object is there now", str(url))  # fmt: skip
            for piece in answer.stream(min_chunk_size=PIECE_BYTES):
                if stop.is_set():
                    return crc, offset - start  # another range failed: its error is raised
                view = memoryview(piece)
                crc = zlib.crc32(view, crc)
                while view:
                    written = os.pwrite(fd, view, offset)
                    offset, view = offset + written, view[written:]
        except StoreError:
            raise
        except Exception as exc:
            if not _from_store(exc):
                raise
            if type(exc).__name__ == "PreconditionError":  # If-Match failed: 412
                raise StoreError(errno.ESTALE, f"safestage: {url} is no longer the object of ETag {etag}: "
                                 f"it was overwritten since ({_answer(exc)})", str(url)) from exc  # fmt: skip
            raise _error(exc, url, "read") from exc
        if offset != end:
            raise StoreError(errno.ESTALE, f"safestage: {url} answered {offset - start} bytes at {start}, not "
                             f"{end - start}: it changed while it was read", str(url))  # fmt: skip
        return crc, end - start

    starts = range(0, size, chunk) if size else range(1)
    if len(starts) == 1:
        return get(0)[0]
    pool = ThreadPoolExecutor(max_workers=max(1, at_once), thread_name_prefix="safestage-get")
    try:
        total = 0
        for future in [pool.submit(get, start) for start in starts]:  # the pool runs at_once at a time
            crc, length = future.result()
            total = crc32_combine(total, crc, length)
        return total
    finally:
        stop.set()
        pool.shutdown(wait=True, cancel_futures=True)


# CRC-32 (zlib's polynomial, reflected) of two pieces from theirs: zlib's crc32_combine, which
# Python's zlib does not expose (multmodp and x2nmodp of zlib 1.2.12's crc32.c).
_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    table, p = [1 << 30], 1 << 30  # x^1
    for _ in range(31):
        p = _multmodp(p, p)
        table.append(p)
    return table


_X2N = _x2n_table()


def crc32_combine(crc1: int, crc2: int, length2: int) -> int:
    """The CRC-32 of A + B from ``crc1`` of A, ``crc2`` of B and B's length."""
    p, k, n = 1 << 31, 3, length2  # x^0; k = 3: bytes to bits
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ (crc2 & 0xFFFFFFFF)


def head(url: ObjectURL) -> Optional[ObjectInfo]:
    """What the store says of ``url``, None if there is no such object."""
    _obstore(url)  # what to install, where it is missing
    import obstore

    try:
        meta = obstore.head(_store(url), url.key)
    except FileNotFoundError:
        return None
    except Exception as exc:
        if not _from_store(exc):
            raise
        raise _error(exc, url, "inspect") from exc
    return _info(meta)


def listing(url: ObjectURL, *, pages: Optional[list[int]] = None) -> list[ObjectInfo]:
    """Every object below ``url`` (its prefix), in key order, over as many LIST requests as the
    store pages them (S3: 1,000 keys a request). ``pages``: appended the size of each batch
    obstore hands back (``PAGE`` at most), which is not a request."""
    _obstore(url)  # what to install, where it is missing
    import obstore

    found: list[ObjectInfo] = []
    try:
        for page in obstore.list(_store(url), prefix=url.prefix or None, chunk_size=PAGE):
            if pages is not None:
                pages.append(len(page))
            # A folder marker of the prefix itself (the key "run/checkpoint-1/", made by the S3
            # console's "Create folder" or s3fs's mkdir) comes back from obstore without its
            # "/", as "run/checkpoint-1": not below the prefix, and not that object either (a
            # delete of it would remove a plain object of that name, never the marker).
            found.extend(info for info in map(_info, page) if not url.key or info.key.startswith(url.prefix))
    except Exception as exc:
        if not _from_store(exc):
            raise
        raise _error(exc, url, "list") from exc
    found.sort(key=lambda info: info.key)
    return found


def delete(urls: list[ObjectURL]) -> None:
    """Delete every object of ``urls`` (one bucket), in batched requests where the store has
    them (S3: 1,000 a request; Azure: 256; GCS has none: one a request). A missing object is
    no error."""
    if not urls:
        return
    _obstore(urls[0])  # what to install, where it is missing
    import obstore

    store = _store(urls[0])

    def one(url: ObjectURL) -> None:
        with contextlib.suppress(FileNotFoundError):
            obstore.delete(store, url.key)

    try:
        try:
            obstore.delete(store, [url.key for url in urls])
        except FileNotFoundError:
            # A store with no batched delete (GCS) is sent one DELETE an object, and obstore
            # stops at the first 404: the rest are deleted one by one, a missing one no error.
            with ThreadPoolExecutor(max_workers=PARTS_AT_ONCE, thread_name_prefix="safestage-delete") as pool:
                list(pool.map(one, urls))
    except Exception as exc:
        if not _from_store(exc):
            raise
        raise _error(exc, urls[0] if len(urls) == 1 else urls[0].parent, "delete") from exc


# -- multipart uploads a killed writer left in flight -------------------------------------------------

_said: set[tuple[str, str, str, str]] = set()  # (scheme, bucket, operation, trouble) already said


def uploads_in_flight(url: ObjectURL) -> Optional[list[InFlight]]:
    """The multipart uploads begun below ``url`` (its prefix) and neither completed nor aborted:
    a killed writer's, or a live one's. None where this process cannot list them, and then
    nothing is to be aborted here: on Azure there is nothing to abort (the service discards
    uncommitted blocks after 7 days); on GCS obstore has no request for it and its OAuth token
    is not handed out (said once, at INFO: its lifecycle rule removes them); on S3 without
    static keys, or where the store refuses or fails the request (said once, at WARNING, with
    what to do). Never raises for them: they cost storage, never a checkpoint, and must not
    stop a retention that removes data."""
    if url.scheme == "az":
        return None
    if url.scheme != "s3":
        _say_once(url, "list", "safestage does not list them on GCS (obstore has no request for it)", level=logging.INFO)
        return None
    reach = _s3_access(url)
    if isinstance(reach, str):
        _say_once(url, "list", reach)
        return None
    try:
        return list(_s3_uploads.in_flight(url, reach))
    except OSError as exc:
        _say_once(url, "list", _without_secrets(str(exc)), exc.errno)
        return None


def abort_uploads(uploads: list[InFlight]) -> list[InFlight]:
    """Abort each of ``uploads`` (S3, listed by ``uploads_in_flight``); return those aborted (or
    gone meanwhile). One the store refuses or fails is said once, at WARNING, and left."""
    aborted: list[InFlight] = []
    if not uploads:
        return aborted
    reach = _s3_access(uploads[0].url)  # one bucket: a checkpoint's
    if isinstance(reach, str):
        return aborted  # the listing said why
    for upload in uploads:
        try:
            _s3_uploads.abort(upload, reach)
        except OSError as exc:
            _say_once(upload.url, "abort", _without_secrets(str(exc)), exc.errno)
            continue
        aborted.append(upload)
    return aborted


def _s3_access(url: ObjectURL) -> Union[_s3_uploads.Access, str]:
    with _lock:
        options = dict(_options.get((url.scheme, url.bucket), {}))
    return _s3_uploads.access(url.bucket, options, os.environ)


def _say_once(url: ObjectURL, operation: str, why: str, code: Optional[int] = None, *,
              level: int = logging.WARNING) -> None:  # fmt: skip
    """Once per bucket, operation and kind of trouble, per process: a retention runs each commit."""
    advice = {
        errno.EACCES: ", or grant s3:ListBucketMultipartUploads and s3:AbortMultipartUpload on the bucket",
    }.get(code or 0, "")
    key = (url.scheme, url.bucket, operation, str(code) if code is not None else why)
    with _lock:
        if key in _said:
            return
        _said.add(key)
    log.log(
        level,
        "safestage: retention in %s://%s/ leaves the multipart uploads a killed save left in "
        "flight: %s. They cost storage until aborted, never a checkpoint: add the bucket's "
        "lifecycle rule for incomplete multipart uploads (docs/object-stores.md)%s.",
        url.scheme, url.bucket, why.rstrip("."), advice,
    )  # fmt: skip


# -- errors ------------------------------------------------------------------------------------------


def _etag(value: Optional[str]) -> Optional[str]:
    """An ETag in one form on every store: quoted, as HTTP writes it (RFC 9110 8.8.3). Azure
    lists an object's ETag without the quotes its PUT and HEAD answer with; S3 quotes both."""
    if value and not value.startswith(('"', 'W/"')):
        return f'"{value}"'
    return value


def _info(meta: Mapping[str, Any]) -> ObjectInfo:
    modified = meta.get("last_modified")
    return ObjectInfo(
        key=meta["path"],
        size=int(meta["size"]),
        etag=_etag(meta.get("e_tag")) or meta.get("version"),
        modified=modified.timestamp() if modified is not None else 0.0,
    )


def _from_store(exc: BaseException) -> bool:
    """Whether ``exc`` is obstore's answer (not the digest's cancel or a bug of ours)."""
    module = type(exc).__module__ or ""
    return module.startswith("obstore") or type(exc).__name__ in _OBSTORE_BUILTINS


# obstore raises some answers as Python builtins (a missing object is FileNotFoundError, a
# refused one PermissionError, a connection failure a plain OSError).
_OBSTORE_BUILTINS = {"FileNotFoundError", "PermissionError", "FileExistsError", "OSError",
                     "ConnectionError", "TimeoutError", "ValueError"}  # fmt: skip

_NO_BUCKET = ("NoSuchBucket", "ContainerNotFound", "The specified bucket does not exist")
# obstore reports a refused LIST (and other requests it has no error kind for) as a generic
# error carrying the HTTP status; and a client with no credentials at all (none in the
# environment or storage_options, and no instance metadata service: a host off the cloud) as a
# failed request to the credential service's well-known path (EC2's IMDS, GCE's metadata
# server, Azure's managed identity endpoint). Both are the credentials' fault, never retried.
_REFUSED = re.compile(r"non-2xx status code: 40[13]\b")
_CREDENTIAL_SERVICE = re.compile(r"Error performing \w+ \S*(/latest/api/token|/latest/meta-data/iam/|"
                                 r"/computeMetadata/|/metadata/identity/oauth2/token)")  # fmt: skip

_ERRNO_BY_NAME = {
    "NotFoundError": errno.ENOENT,
    "FileNotFoundError": errno.ENOENT,
    "AlreadyExistsError": errno.EEXIST,
    "FileExistsError": errno.EEXIST,
    "PreconditionError": errno.EEXIST,
    "PermissionDeniedError": errno.EACCES,
    "PermissionError": errno.EACCES,
    "UnauthenticatedError": errno.EACCES,
    "NotSupportedError": errno.EOPNOTSUPP,
    "UnknownConfigurationKeyError": errno.EINVAL,
    "InvalidPathError": errno.EINVAL,
}


_XML_ERROR = re.compile(r"<\?xml[^>]*\?>\s*<Error>.*?<Code>(?P<code>[^<]*)</Code>\s*<Message>(?P<message>[^<]*)</Message>.*?</Error>", re.S)


def _answer(exc: BaseException) -> str:
    """The store's answer, in one line: obstore's message without its debug dump, and with
    every configured option value blanked (a key passed in storage_options is no business of
    a log)."""
    text = str(exc).split("\n\nDebug source:")[0].strip()
    line = " ".join(text.split())
    # S3's XML error body: its code and message say it; request and host ids say nothing.
    line = _without_secrets(_XML_ERROR.sub(lambda m: f"{m['code']}: {m['message']}", line))
    return line[:600] + (" ..." if len(line) > 600 else "")


def _without_secrets(line: str) -> str:
    """``line`` with every configured option value blanked."""
    for options in list(_options.values()):
        for value in _secret_values(options):
            line = line.replace(value, "***")
    return line


def _secret_values(options: Mapping[str, Any]) -> Iterator[str]:
    for value in options.values():
        if isinstance(value, Mapping):
            yield from _secret_values(value)
        elif isinstance(value, str) and len(value) >= 4:
            yield value


def _error(exc: BaseException, url: ObjectURL, operation: str) -> StoreError:
    code = _ERRNO_BY_NAME.get(type(exc).__name__, errno.EIO)
    if code == errno.EIO and any(word in str(exc) for word in _NO_BUCKET):
        code = errno.ENOENT  # obstore reports a missing bucket as a generic error (S3: a 404)
    elif code == errno.EIO and (_REFUSED.search(str(exc)) or _CREDENTIAL_SERVICE.search(str(exc))):
        code = errno.EACCES
    advice = {
        errno.EACCES: "check the credentials (AWS_ACCESS_KEY_ID / GOOGLE_APPLICATION_CREDENTIALS / "
        "AZURE_STORAGE_ACCOUNT_KEY or storage_options) and the bucket's policy",
        errno.ENOENT: "check that the bucket exists and the URL names it",
        errno.EINVAL: "check storage_options and the store's environment variables",
    }.get(code, "the store or the network failed; the save can be retried")
    return StoreError(
        code,
        f"safestage: could not {operation} {url}: {_answer(exc)} ({advice}).",
        str(url),
    )


def is_refusal(exc: BaseException) -> bool:
    """Whether ``exc`` is a conditional create that found the object already there."""
    return isinstance(exc, StoreError) and exc.errno == errno.EEXIST
