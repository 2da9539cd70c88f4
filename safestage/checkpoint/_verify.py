"""Reading checkpoints back: ``verify`` (``verify(p).complete``), ``latest_complete``.

A checkpoint directory is complete when its commit file (``_manifest``) parses and every
file it lists is a regular file of the listed size; ``deep`` also reads every file for its
CRC-32 and checks that each ``.safetensors`` header parses and its data ends exactly at the
end of the file. Nothing here writes, and nothing follows a symlink inside the checkpoint.

Reads only what is needed, so that resuming from a parent holding a thousand checkpoints on
a FUSE mount stays fast: ``latest_complete`` lists the parent once, orders the candidates by
the step number in their names, and reads commit files newest first, stat()ing files only
until the first complete checkpoint.

An object-store URL (``s3://bucket/run/checkpoint-100``; ``_destination.url_of``) is read the
same way with what a bucket offers: the checkpoint (or the run) is one paginated LIST of its
prefix, and each commit object read is one GET, checked against that listing: every object it
lists must be listed with its size and its ETag (a late overwrite by a stale writer changes the
ETag: the checkpoint is then not complete, and ``latest_complete`` falls back to the next newest
one). ``latest_complete`` of a run costs one LIST per 1,000 objects plus one GET of the newest
commit object when that one is complete; ``deep`` streams each object back (one GET each,
If-Match its ETag) for its CRC-32.
"""

from __future__ import annotations

import errno
import fnmatch
import functools
import itertools
import json
import logging
import os
import re
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union, overload

from .. import _object_store
from .._config import PathArg
from .._destination import Destination, ObjectURL, url_of
from .._errors import ConfigError, SafestageError
from .._publish import CHUNK_BYTES
from ._manifest import (
    COMMIT_NAME,
    MAX_COMMIT_BYTES,
    SET_ASIDE_NAME,
    Crc32,
    Manifest,
    ManifestError,
    NewerFormatError,
    parse,
)

log = logging.getLogger("safestage")

# safetensors refuses headers above 100 MB (MAX_HEADER_SIZE in safetensors/src/tensor.rs).
_MAX_HEADER = 100_000_000
# Bits per element of each safetensors dtype (safetensors 0.6: F4 and F6 are sub-byte).
_DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "I64": 64, "U64": 64, "F64": 64, "C64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}  # fmt: skip
_DIGITS = re.compile(r"[0-9]+")  # ASCII: int() also reads other scripts' digits
# ``progress(bytes_read, total_bytes)`` after each chunk a deep verify reads (the CLI's bar).
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class Problem:
    """One reason a checkpoint is not complete. ``path`` is relative to the checkpoint ("" for
    the checkpoint itself); ``kind`` is one of not-a-directory, no-commit, bad-commit,
    unsafe-path, missing, not-a-file, unreadable (EACCES, EIO, or a newer format version),
    size, digest, safetensors, empty (a commit file listing no file), changed (an object
    whose ETag is not the one its commit object recorded: overwritten after the commit)."""

    path: str
    kind: str
    message: str


@dataclass
class VerifyResult:
    """What ``verify`` found. ``complete`` is the answer; ``problems`` say why not."""

    path: Destination
    deep: bool
    manifest: Optional[Manifest] = None
    problems: list[Problem] = field(default_factory=list)
    files_checked: int = 0
    bytes_read: int = 0  # deep: bytes read to check digests and headers
    extra: list[str] = field(default_factory=list)  # deep: files the manifest does not list
    # Complete, but a resumed run abandoned it (_timeline): latest_complete never names it.
    set_aside: Optional[SetAside] = None

    @property
    def complete(self) -> bool:
        return self.manifest is not None and not self.problems

    def to_json(self) -> dict[str, Any]:
        manifest = self.manifest
        return {
            "path": str(self.path),
            "complete": self.complete,
            "deep": self.deep,
            "problems": [vars(problem) for problem in self.problems],
            "files": len(manifest.files) if manifest else None,
            "bytes": manifest.total_bytes if manifest else None,
            "committed_at": manifest.committed_at if manifest else None,
            "writer": manifest.writer if manifest else None,
            "files_checked": self.files_checked,
            "bytes_read": self.bytes_read,
            "extra": self.extra,
            "set_aside": None
            if self.set_aside is None
            else {"by": self.set_aside.by, "at": self.set_aside.at},
        }


def verify(
    path: Union[PathArg, ObjectURL], *, deep: bool = False, progress: Optional[Progress] = None
) -> VerifyResult:
    """Check the checkpoint directory ``path`` (or object-store URL) against its commit file;
    never raises for what it finds (missing files, a torn commit file, a missing directory, a
    store that refuses or fails a request: all problems). ``progress(bytes_read,
    total_bytes)`` is called as a deep verify reads."""
    url = url_of(path)
    if url is not None:
        return _verify_url(url, deep=deep, progress=progress)
    assert not isinstance(path, ObjectURL)
    directory = as_path(path)
    manifest, problem, _ = read_commit(directory)
    if manifest is None:
        assert problem is not None
        if problem.kind == "no-commit" and not directory.is_dir():
            what = "does not exist" if not os.path.lexists(directory) else "is not a directory"
            problem = Problem("", "not-a-directory", f"{directory} {what}")
        return VerifyResult(directory, deep, problems=[problem])
    result = check(directory, manifest, deep=deep, progress=progress)
    try:
        result.set_aside = set_aside_by(directory)
    except OSError as exc:
        result.problems.append(marker_problem(exc))
    return result


@overload
def latest_complete(
    parent: ObjectURL, pattern: str = ..., *, deep: bool = ...
) -> Optional[ObjectURL]: ...
@overload
def latest_complete(
    parent: os.PathLike[str], pattern: str = ..., *, deep: bool = ...
) -> Optional[Path]: ...
@overload
def latest_complete(
    parent: str, pattern: str = ..., *, deep: bool = ...
) -> Optional[Destination]: ...
def latest_complete(
    parent: Union[PathArg, ObjectURL], pattern: str = "checkpoint-*", *, deep: bool = False
) -> Optional[Destination]:
    """The newest complete checkpoint directory in ``parent`` whose name matches ``pattern``:
    the highest step number, then the latest commit (the commit file's mtime). None if no
    directory there is complete. ``pattern`` is an fnmatch pattern (case-sensitive) whose last
    ``*`` stands for the step number: ``checkpoint-*`` matches ``checkpoint-500`` (step 500),
    never ``checkpoint-500-merged`` (transformers' own ``get_last_checkpoint`` rule). A
    checkpoint a resumed run set aside (``_timeline``: it abandoned that timeline) is never
    named.

    Never silently older: every newer candidate skipped because it could not be read (its
    commit file or one of its files gives EACCES or EIO, or it was written by a newer
    safestage) is logged as a WARNING naming it. A ``parent`` that cannot be listed (missing,
    EACCES, EIO from a FUSE readdir) raises the OSError: a mistyped, unmounted or unreadable
    run directory must not look like a run with no checkpoint yet; a ``pattern`` with a directory
    part (or empty) raises ConfigError, as for ``prune``: it would take no name.

    ``parent`` may be a run URL (``s3://bucket/run``): the answer is then an ObjectURL, from one
    paginated LIST of the run and one GET of the newest commit object, checked against the
    listing (the module docstring). A store that cannot be listed (a missing bucket, refused
    credentials) raises its StoreError (an OSError naming the URL, the request and the store's
    answer); a run prefix holding no object is a run with no checkpoint yet (None)."""
    check_pattern(pattern, "safestage.latest_complete")
    found, skipped = find_latest(parent, pattern, deep=deep)
    for path, why in skipped:
        log.warning(
            "safestage.latest_complete: skipped %s, which could not be read (%s)", path, why
        )
    return found


def check_pattern(pattern: object, where: str) -> str:
    """``pattern`` if it can take names of a directory's entries, else ConfigError."""
    if not isinstance(pattern, str) or not pattern or "/" in pattern:
        raise ConfigError(
            f"{where}: pattern={pattern!r}: expected an fnmatch pattern of checkpoint names "
            "in the parent directory whose last '*' stands for the step number, such as "
            "'checkpoint-*' (not empty, no '/')"
        )
    return pattern


def candidate_steps(base: Path, pattern: str) -> dict[str, int]:
    """{name: step} of the entries of the run directory ``base`` that ``pattern`` takes, a
    symlink never: ``checkpoint-9 -> checkpoint-1`` is a second name of checkpoint-1, judged under
    its own name only (counting the link would make checkpoint-1 the newest, and a prune would
    then remove the target of what it kept). An OSError that says what to check when ``base``
    cannot be listed (a mistyped, unmounted or unreadable run directory must not look like one
    with no checkpoint)."""
    takes = matcher(pattern)
    found = {}
    try:
        with os.scandir(base) as listing:
            for entry in listing:
                step = takes(entry.name)
                if step is not None and not _is_symlink(entry):
                    found[entry.name] = step
    except OSError as exc:
        raise type(exc)(
            exc.errno,
            f"cannot list the checkpoints in {base}: {describe_error(exc)}: check that it is the run "
            "directory, that it is mounted and that this user may read it",
            str(base),
        ) from exc
    return found


def _is_symlink(entry: os.DirEntry[str]) -> bool:
    """From readdir's type where the filesystem gives one, else one lstat; an entry that cannot
    be inspected is no symlink here (reading it then says why it cannot be read)."""
    try:
        return entry.is_symlink()
    except OSError:
        return False


def find_latest(
    parent: Union[PathArg, ObjectURL], pattern: str = "checkpoint-*", *, deep: bool = False
) -> tuple[Optional[Destination], list[tuple[Destination, str]]]:
    """``latest_complete`` and the newer candidates it skipped as unreadable, with why."""
    run = url_of(parent)
    if run is not None:
        return _find_latest_url(run, pattern, deep=deep)
    assert not isinstance(parent, ObjectURL)
    base = as_path(parent)
    steps = candidate_steps(base, pattern)
    names = sorted(steps, key=lambda name: steps[name], reverse=True)
    skipped: list[tuple[Destination, str]] = []
    for _, group in itertools.groupby(names, key=lambda name: steps[name]):
        committed = []
        for name in group:
            manifest, problem, mtime = read_commit(base / name)
            if manifest is not None:
                committed.append((mtime, name, manifest))
            elif problem is not None and problem.kind == "unreadable":
                skipped.append((base / name, problem.message))
        committed.sort(key=lambda item: (item[0], item[1]), reverse=True)
        for _, name, manifest in committed:
            result = check(base / name, manifest, deep=deep)
            try:
                aside = set_aside_by(base / name) if result.complete else None
            except OSError as exc:
                aside = None
                result.problems.append(marker_problem(exc))
            if aside is not None:
                log.info(
                    "safestage.latest_complete: passed over %s: %s", base / name, aside.describe()
                )
            elif result.complete:
                return base / name, skipped
            unreadable = [p for p in result.problems if p.kind == "unreadable"]
            if unreadable:
                first = unreadable[0]
                skipped.append((base / name, f"{first.path}: {first.message}"))
    return None, skipped


def as_path(path: PathArg) -> Path:
    """``path`` as a Path; bytes paths (which staged_dir accepts) are decoded as the OS does."""
    text = os.fspath(path)
    return Path(os.fsdecode(text) if isinstance(text, bytes) else text)


def step_of(name: str) -> int:
    """The step number in a checkpoint's name: its last run of digits (-1 if none)."""
    found = _DIGITS.findall(name)
    return int(found[-1]) if found else -1


@functools.lru_cache(maxsize=64)
def matcher(pattern: str) -> Callable[[str], Optional[int]]:
    """For an fnmatch ``pattern``, a function giving the step of a name it takes (None: not a
    candidate). The pattern's last run of wildcards (its last ``*`` with any ``?`` or ``[...]``
    just before it) stands for the step number and must match ASCII digits only, the whole of
    what it matches; what follows it matches itself. ``checkpoint-*`` takes ``checkpoint-500``
    (500), never ``checkpoint-500-merged`` (transformers' own ``get_last_checkpoint`` rule),
    ``checkpoint-500-epoch-2``, ``checkpoint-1e3`` or ``checkpoint-final-v2``;
    ``epoch=*-step=*.ckpt`` takes ``epoch=3-step=500.ckpt`` (500), never Lightning's re-save
    ``epoch=3-step=500-v1.ckpt``; ``checkpoint-[0-9]*`` and ``step-?`` work as they read. The
    step is the whole run of digits the wildcard's match is in: digits the pattern spells next
    to it are part of it (``ckpt-1*`` takes ``ckpt-100`` as step 100, never 0, as the timeline
    and ``keep=`` read that name). A bracket of one character (``[*]``, ``[[]``) is that
    character, fnmatch's escape, never a wildcard. A pattern without a wildcard names one
    checkpoint, whose step is its last run of digits."""
    tokens = _fnmatch_tokens(pattern)
    wild = [index for index, (_, is_wild) in enumerate(tokens) if is_wild]
    if not wild:
        return lambda name: step_of(name) if fnmatch.fnmatchcase(name, pattern) else None
    last = first = wild[-1]
    while first > 0 and tokens[first - 1][1]:
        first -= 1
    lead, trail = first, last + 1  # the digits the pattern spells around the wildcards
    while lead > 0 and _is_digit(tokens[lead - 1]):
        lead -= 1
    while trail < len(tokens) and _is_digit(tokens[trail]):
        trail += 1

    def regex(part: list[tuple[str, bool]]) -> str:
        return "".join(text for text, _ in part)

    head, ending = regex(tokens[:lead]), regex(tokens[trail:])
    # The lookbehind: the step starts a run of digits (a wildcard of the head never takes
    # some of its digits). The lookahead makes what the wildcards match all digits: from its
    # start, digits, the spelled digits after it, then the ending, then the end of the name.
    whole = re.compile(
        f"{head}(?<![0-9])({regex(tokens[lead:first])}(?=[0-9]+{regex(tokens[last + 1 : trail])}"
        f"{ending}\\Z){regex(tokens[first:trail])}){ending}\\Z",
        re.S,
    )

    def step(name: str) -> Optional[int]:
        if not fnmatch.fnmatchcase(name, pattern):
            return None
        match = whole.match(name)
        return int(match[1]) if match else None

    return step


def _is_digit(token: tuple[str, bool]) -> bool:
    text, is_wild = token
    return not is_wild and text in "0123456789" and len(text) == 1


def _fnmatch_tokens(pattern: str) -> list[tuple[str, bool]]:
    """``pattern`` as (regex, is a wildcard) tokens, with fnmatch's meaning: ``*``, ``?``,
    ``[...]`` (a ``[`` without its ``]`` is itself; a bracket of one character, ``[*]``, is that
    character, as fnmatch's documentation escapes one), any other character itself."""
    tokens: list[tuple[str, bool]] = []
    i, n = 0, len(pattern)
    while i < n:
        char = pattern[i]
        i += 1
        if char == "*":
            if not tokens or tokens[-1][0] != ".*":
                tokens.append((".*", True))
        elif char == "?":
            tokens.append((".", True))
        elif char == "[":
            j = i + (i < n and pattern[i] == "!")
            j += j < n and pattern[j] == "]"
            while j < n and pattern[j] != "]":
                j += 1
            if j >= n:
                tokens.append((re.escape(char), False))
                continue
            if j == i + 1 and pattern[i] != "!":
                tokens.append((re.escape(pattern[i]), False))  # [*]: the character itself
                i = j + 1
                continue
            # fnmatch's own translation of one bracket expression, "(?s:[...])\\Z" (ranges,
            # negation and escapes exactly as fnmatch reads them), without its wrapper.
            translated = fnmatch.translate(pattern[i - 1 : j + 1])
            wrapped = translated.startswith("(?s:") and translated.endswith(")\\Z")
            tokens.append((translated[len("(?s:") : -len(")\\Z")] if wrapped else ".", True))
            i = j + 1
        else:
            tokens.append((re.escape(char), False))
    return tokens


def read_commit(directory: Path) -> tuple[Optional[Manifest], Optional[Problem], float]:
    """(manifest, None, commit file mtime), or (None, the problem, 0.0)."""
    target = directory / COMMIT_NAME
    try:
        # O_NONBLOCK: a FIFO put there must not hang a resumer (it is refused just below).
        fd = os.open(target, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        return (
            None,
            Problem(
                "",
                "no-commit",
                f"no commit file {COMMIT_NAME} (never committed, or a commit was interrupted)",
            ),
            0.0,
        )
    except OSError as exc:
        kind = "bad-commit" if exc.errno == errno.ELOOP else "unreadable"
        return (
            None,
            Problem(COMMIT_NAME, kind, f"cannot open the commit file: {describe_error(exc)}"),
            0.0,
        )
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_COMMIT_BYTES:
            return (
                None,
                Problem(
                    COMMIT_NAME, "bad-commit", "the commit file is not a regular file of sane size"
                ),
                0.0,
            )
        data = _read_to_end(fd, MAX_COMMIT_BYTES + 1)
    except OSError as exc:
        return (
            None,
            Problem(
                COMMIT_NAME, "unreadable", f"cannot read the commit file: {describe_error(exc)}"
            ),
            0.0,
        )
    finally:
        os.close(fd)
    try:
        manifest = parse(data)
    except NewerFormatError as exc:
        return None, Problem(COMMIT_NAME, "unreadable", f"cannot read the commit file: {exc}"), 0.0
    except ManifestError as exc:
        return (
            None,
            Problem(COMMIT_NAME, "bad-commit", f"the commit file cannot be trusted: {exc}"),
            0.0,
        )
    return manifest, None, info.st_mtime


def _started(
    checkpoint: Destination, deep: bool, manifest: Manifest, progress: Optional[Progress], commit: str
) -> tuple[VerifyResult, Optional[Callable[[int], None]]]:
    """A check's result, and its byte counter for ``progress`` (deep only). A commit of nothing
    vouches for nothing: 0.4 committed a staged_dir block that saved no file (or saved it
    elsewhere), and latest named it, retention counted it."""
    result = VerifyResult(checkpoint, deep, manifest)
    report = None
    if deep and progress is not None:
        total = manifest.total_bytes

        def report(count: int) -> None:
            result.bytes_read += count
            progress(result.bytes_read, total)

    if not manifest.files:
        why = f"the {commit} lists no file: nothing was saved into this checkpoint; delete it, or save it again"
        result.problems.append(Problem("", "empty", why))
    return result, report

def check(
    directory: Path, manifest: Manifest, *, deep: bool, progress: Optional[Progress] = None
) -> VerifyResult:
    """Every file of ``manifest`` against ``directory``: type and size; deep, content too."""
    result, report = _started(directory, deep, manifest, progress, "commit file")
    safe_dirs: dict[str, Optional[tuple[str, str]]] = {}  # parent -> (kind, why); None: fine
    for entry in manifest.files:
        result.files_checked += 1
        parent_problem = _parents_problem(directory, entry.path, safe_dirs)
        if parent_problem is not None:
            result.problems.append(Problem(entry.path, *parent_problem))
            continue
        target = directory / entry.path
        try:
            info = os.lstat(target)
        except FileNotFoundError:
            result.problems.append(
                Problem(entry.path, "missing", "listed in the commit file, not there")
            )
            continue
        except OSError as exc:
            result.problems.append(Problem(entry.path, "unreadable", describe_error(exc)))
            continue
        if not stat.S_ISREG(info.st_mode):
            result.problems.append(
                Problem(entry.path, "not-a-file", "not a regular file (a symlink, a directory?)")
            )
        elif info.st_size != entry.size:
            result.problems.append(
                Problem(
                    entry.path, "size", f"{info.st_size} bytes, the commit file says {entry.size}"
                )
            )
        elif deep:
            result.problems += _deep_problems(
                target, entry.path, entry.digest, entry.size, result, report
            )
    if deep:
        result.extra = _extra_files(directory, manifest)
    return result


def _parents_problem(
    directory: Path, path: str, safe: dict[str, Optional[tuple[str, str]]]
) -> Optional[tuple[str, str]]:
    """(kind, why) when a parent directory of ``path`` inside the checkpoint is gone
    ("missing"), cannot be inspected ("unreadable") or cannot be trusted, a symlink could lead
    outside it ("unsafe-path"); each checked once per verify; None when all are real
    directories."""
    parts = path.split("/")[:-1]
    for depth in range(1, len(parts) + 1):
        parent = "/".join(parts[:depth])
        if parent not in safe:
            try:
                info = os.lstat(directory / parent)
            except (FileNotFoundError, NotADirectoryError):
                safe[parent] = (
                    "missing",
                    f"listed in the commit file; its directory {parent} is not there",
                )
            except OSError as exc:
                safe[parent] = (
                    "unreadable",
                    f"its directory {parent} cannot be inspected: {describe_error(exc)}",
                )
            else:
                safe[parent] = (
                    None
                    if stat.S_ISDIR(info.st_mode)
                    else ("unsafe-path", f"its directory {parent} is not a directory (a symlink?)")
                )
        if safe[parent] is not None:
            return safe[parent]
    return None


def _deep_problems(
    target: Path,
    path: str,
    digest: str,
    size: int,
    result: VerifyResult,
    report: Optional[Callable[[int], None]] = None,
) -> list[Problem]:
    problems = []
    try:
        # O_NONBLOCK: a FIFO put there must not hang a resumer (it is refused just below).
        fd = os.open(target, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        return [Problem(path, "unreadable", describe_error(exc))]
    try:
        if path.endswith(".safetensors"):
            header = safetensors_problem(fd, size)
            if header is not None:
                problems.append(Problem(path, "safetensors", header))
        crc = Crc32()
        buffer = bytearray(CHUNK_BYTES)
        view = memoryview(buffer)
        with os.fdopen(os.dup(fd), "rb", buffering=0) as source:
            while count := source.readinto(buffer):
                crc.update(view[:count])
                if report is None:
                    result.bytes_read += count
                else:
                    report(count)
    except OSError as exc:
        problems.append(Problem(path, "unreadable", describe_error(exc)))
        return problems
    finally:
        os.close(fd)
    if crc.hexdigest() != digest:
        problems.append(
            Problem(
                path,
                "digest",
                f"CRC-32 {crc.hexdigest()}, the commit file says {digest} (other content of the same size)",
            )
        )
    return problems


def safetensors_problem(fd: int, size: int) -> Optional[str]:
    """Why the safetensors file open at ``fd`` (``size`` bytes) is not one, or None: its
    header must parse and its tensors must cover the data that follows exactly."""
    return header_problem(lambda count, offset: _pread_exactly(fd, count, offset), size)


def header_problem(pread: Callable[[int, int], bytes], size: int) -> Optional[str]:
    """``safetensors_problem`` of a file (or object) of ``size`` bytes read by ``pread(count,
    offset)`` (which returns exactly ``count`` bytes or raises OSError)."""
    if size < 8:
        return f"{size} bytes: shorter than the 8-byte header length"
    (length,) = struct.unpack("<Q", pread(8, 0))
    if length > size - 8:
        return f"the header announces {length} bytes, the file has {size - 8} after the length"
    if length > _MAX_HEADER:
        return f"a {length}-byte header (safetensors refuses more than {_MAX_HEADER})"
    try:
        header = json.loads(pread(length, 8))
    except (ValueError, RecursionError) as exc:  # RecursionError: "[[[[..." nested headers
        return f"the header is not valid JSON: {exc}"
    if not isinstance(header, dict):
        return "the header is not a JSON object"
    data_bytes = size - 8 - length
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            return f"tensor {name!r} has bad data_offsets {offsets!r}"
        dtype = info.get("dtype")
        if not isinstance(dtype, str):
            return f"tensor {name!r} has a bad dtype {dtype!r}"
        bits = _DTYPE_BITS.get(dtype)
        shape = info.get("shape")
        if bits is not None and isinstance(shape, list) and all(isinstance(d, int) for d in shape):
            elements = 1
            for dim in shape:
                elements *= dim
            if elements * bits != (offsets[1] - offsets[0]) * 8:
                return f"tensor {name!r}: {info.get('dtype')} {shape} does not fill data_offsets {offsets}"
        spans.append((offsets[0], offsets[1], name))
    spans.sort()
    position = 0
    for begin, end, name in spans:
        if begin != position:
            return f"tensor {name!r} starts at {begin}, expected {position} (a gap or an overlap)"
        position = end
    if position != data_bytes:
        return f"the tensors hold {position} bytes of data, the file has {data_bytes}"
    return None


def _extra_files(directory: Path, manifest: Manifest) -> list[str]:
    """Files under ``directory`` the manifest does not list (informational: a shard of an
    older save with more shards, a leftover temp). Symlinks are not followed."""
    listed = {entry.path for entry in manifest.files} | {COMMIT_NAME, SET_ASIDE_NAME}
    extra = []
    for root, dirs, files in os.walk(directory):
        relative = os.path.relpath(root, directory)
        for name in files:
            path = name if relative == "." else f"{relative}/{name}"
            if path not in listed:
                extra.append(path)
        dirs.sort()
    return sorted(extra)


def _pread_exactly(fd: int, count: int, offset: int) -> bytes:
    chunks = []
    while count:
        chunk = os.pread(fd, min(count, CHUNK_BYTES), offset)
        if not chunk:
            raise OSError(errno.EIO, "the file ended early while reading its header")
        chunks.append(chunk)
        count -= len(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _read_to_end(fd: int, limit: int) -> bytes:
    chunks = []
    total = 0
    while total < limit:
        chunk = os.read(fd, min(CHUNK_BYTES, limit - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def describe_error(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, "?")
    return f"[Errno {exc.errno}] {name}: {exc.strerror or exc}"


# -- a checkpoint a resumed run set aside (_timeline writes the marker) --------------------------


@dataclass(frozen=True)
class SetAside:
    """Why a checkpoint was set aside: ``by`` (the name of the checkpoint whose save began
    after this one was complete, with a lower step), ``at`` (ISO time)."""

    by: str
    at: str

    def describe(self) -> str:
        return (f"set aside by {self.by} (committed {self.at}): a run resumed from an older "
                "checkpoint than this one and went on from there")  # fmt: skip


def set_aside_by(directory: Path) -> Optional[SetAside]:
    """The marker in the checkpoint ``directory``, if a resumed run set it aside. Only a marker
    that is there sets aside: one that opens but cannot be read or parsed still marks it; an
    open that fails otherwise than "not there" (EIO, or EACCES from a FUSE lookup: the marker may
    or may not be there) raises the OSError, naming the marker and the errno, and the caller
    treats the checkpoint as it treats any it cannot read: ``latest_complete`` skips it with a
    WARNING, retention keeps it without counting it, ``verify`` reports it ``unreadable``."""
    marker = directory / SET_ASIDE_NAME
    try:
        # O_NONBLOCK: a FIFO put there must not hang a resumer.
        fd = os.open(marker, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise type(exc)(
            exc.errno,
            f"cannot tell whether a resumed run set it aside: cannot open {marker}: {describe_error(exc)}",
            str(marker),
        ) from exc
    try:
        with os.fdopen(fd, "rb") as handle:
            data = handle.read(_MARKER_BYTES)
    except OSError:
        return SetAside("?", "?")  # a marker that is there but cannot be read still marks it
    return _parse_marker(data)


_MARKER_BYTES = 1 << 16


def _parse_marker(data: bytes) -> SetAside:
    try:
        document = json.loads(data)
    except (ValueError, RecursionError):
        return SetAside("?", "?")
    if not isinstance(document, dict):
        return SetAside("?", "?")
    return SetAside(str(document.get("by", "?")), str(document.get("at", "?")))


def marker_problem(exc: OSError) -> Problem:
    """What ``verify`` and the readers say of a checkpoint ``set_aside_by`` could not tell."""
    said = str(exc) if isinstance(exc, SafestageError) else exc.strerror  # a StoreError says it all
    return Problem(SET_ASIDE_NAME, "unreadable", said or str(exc))


# -- the object-store family: one LIST of a prefix, one GET per commit object -------------------

# What one LIST of a checkpoint's prefix found: {path relative to the checkpoint: the object}.
Listed = dict[str, _object_store.ObjectInfo]


def listed_below(url: ObjectURL) -> Listed:
    """Every object below ``url`` by its path relative to it (one paginated LIST). Raises the
    StoreError of a LIST the store refuses or fails."""
    start = len(url.prefix)
    return {info.key[start:]: info for info in _object_store.listing(url)}


def run_listing(run: ObjectURL, pattern: str) -> tuple[dict[str, int], dict[str, Listed]]:
    """``candidate_steps`` of a run URL: ({name: step}, {name: its objects}) of the checkpoint
    prefixes below ``run`` whose names ``pattern`` takes, from one paginated LIST. An object
    directly in the run (no ``/`` after its name) is no checkpoint, as a file is none on a path;
    a name the pattern does not take is not read and not returned."""
    takes = matcher(pattern)
    steps: dict[str, int] = {}
    below: dict[str, Listed] = {}
    for path, info in listed_below(run).items():
        name, slash, rest = path.partition("/")
        if not slash or not rest:
            continue
        if name not in steps:
            step = takes(name)
            if step is None:
                continue
            steps[name], below[name] = step, {}
        below[name][rest] = info
    return steps, below


def read_commit_object(
    checkpoint: ObjectURL, listed: Listed
) -> tuple[Optional[Manifest], Optional[Problem], float]:
    """``read_commit`` of a checkpoint URL whose objects ``listed`` holds: its commit object
    is read (one GET) only if the listing has one. (manifest, None, the commit object's
    modification time), or (None, the problem, 0.0)."""
    info = listed.get(COMMIT_NAME)
    if info is None:
        return None, Problem("", "no-commit", f"no commit object {COMMIT_NAME} (never committed, "
                                              "or a commit was interrupted)"), 0.0  # fmt: skip
    if info.size > MAX_COMMIT_BYTES:
        return None, Problem(COMMIT_NAME, "bad-commit", f"the commit object is {info.size} bytes: "
                                                        "not one of safestage's"), 0.0  # fmt: skip
    try:
        found = _object_store.get(checkpoint / COMMIT_NAME, limit=MAX_COMMIT_BYTES)
    except OSError as exc:
        kind = "bad-commit" if exc.errno == errno.EFBIG else "unreadable"
        return None, Problem(COMMIT_NAME, kind, f"cannot read the commit object: {exc}"), 0.0
    if found is None:
        return None, Problem("", "no-commit", f"the commit object {COMMIT_NAME} was removed since "
                                              "the listing (a re-commit or a prune under way)"), 0.0  # fmt: skip
    try:
        manifest = parse(found[0])
    except NewerFormatError as exc:
        return None, Problem(COMMIT_NAME, "unreadable", f"cannot read the commit object: {exc}"), 0.0
    except ManifestError as exc:
        return None, Problem(COMMIT_NAME, "bad-commit", f"the commit object cannot be trusted: {exc}"), 0.0
    return manifest, None, info.modified


def check_objects(
    checkpoint: ObjectURL,
    manifest: Manifest,
    listed: Listed,
    *,
    deep: bool,
    progress: Optional[Progress] = None,
) -> VerifyResult:
    """``check`` of a checkpoint URL: each object of ``manifest`` against the listing (there,
    of the recorded size and ETag); deep, its bytes streamed back for their CRC-32 (and a
    ``.safetensors`` header), each GET If-Match the recorded ETag."""
    result, report = _started(checkpoint, deep, manifest, progress, "commit object")
    for entry in manifest.files:
        result.files_checked += 1
        info = listed.get(entry.path)
        if info is None:
            result.problems.append(Problem(entry.path, "missing", "listed in the commit object, not in the store"))
        elif info.size != entry.size:
            result.problems.append(Problem(entry.path, "size", f"{info.size} bytes, the commit object says {entry.size}"))
        elif entry.etag is not None and info.etag is not None and info.etag != entry.etag:
            result.problems.append(Problem(entry.path, "changed", f"ETag {info.etag}, the commit object says "
                                           f"{entry.etag}: overwritten after the commit (a second writer of "
                                           "this step?)"))  # fmt: skip
        elif deep:
            result.problems += _deep_object_problems(checkpoint / entry.path, entry.path, entry.size,
                                                     entry.digest, entry.etag or info.etag, result, report)  # fmt: skip
    if deep:
        named = {entry.path for entry in manifest.files} | {COMMIT_NAME, SET_ASIDE_NAME}
        result.extra = sorted(path for path in listed if path not in named and not path.endswith("/"))
    return result


def _deep_object_problems(
    url: ObjectURL,
    path: str,
    size: int,
    digest: str,
    etag: Optional[str],
    result: VerifyResult,
    report: Optional[Callable[[int], None]],
) -> list[Problem]:
    crc = Crc32()
    header = _Header() if path.endswith(".safetensors") else None
    count = 0
    try:
        for piece in _object_store.chunks(url, etag=etag, chunk=CHUNK_BYTES):
            crc.update(memoryview(piece))
            if header is not None:
                header.feed(piece)
            count += len(piece)
            if report is None:
                result.bytes_read += len(piece)
            else:
                report(len(piece))
    except OSError as exc:
        kind = {errno.ESTALE: "changed", errno.ENOENT: "missing"}.get(exc.errno or 0, "unreadable")
        return [Problem(path, kind, str(exc))]
    if count != size:
        return [Problem(path, "size", f"{count} bytes read back, the commit object says {size}")]
    problems = []
    if header is not None:
        why = header_problem(header.read, size)
        if why is not None:
            problems.append(Problem(path, "safetensors", why))
    if crc.hexdigest() != digest:
        problems.append(Problem(path, "digest", f"CRC-32 {crc.hexdigest()}, the commit object says {digest} "
                                                "(other content of the same size)"))  # fmt: skip
    return problems


class _Header:
    """The first bytes of a streamed ``.safetensors`` object: its length and header, at most
    ``_MAX_HEADER`` + 8 bytes, so that the header is checked from the one GET of the digest."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.want = 8

    def feed(self, piece: bytes) -> None:
        while piece and len(self.data) < self.want:
            take = self.want - len(self.data)
            self.data += piece[:take]
            piece = piece[take:]
            if self.want == 8 and len(self.data) == 8:
                (length,) = struct.unpack("<Q", self.data)
                if length <= _MAX_HEADER:  # else header_problem refuses it from the length alone
                    self.want = 8 + length

    def read(self, count: int, offset: int) -> bytes:
        if offset + count > len(self.data):
            raise OSError(errno.EIO, "the object ended early while reading its header")
        return bytes(self.data[offset : offset + count])


def set_aside_object(checkpoint: ObjectURL, listed: Listed) -> Optional[SetAside]:
    """``set_aside_by`` of a checkpoint URL: its marker object, read only if the listing has one.
    Raises the OSError of a GET the store refuses or fails."""
    if SET_ASIDE_NAME not in listed:
        return None
    found = _object_store.get(checkpoint / SET_ASIDE_NAME, limit=_MARKER_BYTES)
    return None if found is None else _parse_marker(found[0])


def _verify_url(url: ObjectURL, *, deep: bool, progress: Optional[Progress]) -> VerifyResult:
    try:
        listed = listed_below(url)
    except OSError as exc:
        return VerifyResult(url, deep, problems=[Problem("", "unreadable", str(exc))])
    if not listed:
        return VerifyResult(url, deep, problems=[Problem("", "not-a-directory", f"no object below {url} "
                                                         "(nothing was committed there, or the URL is mistyped)")])  # fmt: skip
    manifest, problem, _ = read_commit_object(url, listed)
    if manifest is None:
        assert problem is not None
        return VerifyResult(url, deep, problems=[problem])
    result = check_objects(url, manifest, listed, deep=deep, progress=progress)
    try:
        result.set_aside = set_aside_object(url, listed)
    except OSError as exc:
        result.problems.append(marker_problem(exc))
    return result


def _find_latest_url(
    run: ObjectURL, pattern: str, *, deep: bool
) -> tuple[Optional[Destination], list[tuple[Destination, str]]]:
    """``find_latest`` of a run URL: one paginated LIST, then the commit objects the listing
    shows, newest first (step, then the commit object's time, then the name), one GET each,
    until one is complete against the listing."""
    steps, below = run_listing(run, pattern)
    committed = [name for name in steps if COMMIT_NAME in below[name]]
    committed.sort(key=lambda name: (steps[name], below[name][COMMIT_NAME].modified, name), reverse=True)
    skipped: list[tuple[Destination, str]] = []
    for name in committed:
        checkpoint = run / name
        manifest, problem, _ = read_commit_object(checkpoint, below[name])
        if manifest is None:
            if problem is not None and problem.kind == "unreadable":
                skipped.append((checkpoint, problem.message))
            continue
        result = check_objects(checkpoint, manifest, below[name], deep=deep)
        try:
            aside = set_aside_object(checkpoint, below[name]) if result.complete else None
        except OSError as exc:
            aside = None
            result.problems.append(marker_problem(exc))
        if aside is not None:
            log.info("safestage.latest_complete: passed over %s: %s", checkpoint, aside.describe())
        elif result.complete:
            return checkpoint, skipped
        else:
            # A committed step that no longer matches its commit object: a late overwrite by a
            # stale writer (WARNING), or objects removed under it (a prune under way).
            changed = any(p.kind == "changed" for p in result.problems)
            log.log(logging.WARNING if changed else logging.INFO,
                    "safestage.latest_complete: passed over %s, committed but not complete: %s", checkpoint,
                    "; ".join(f"{p.path or '.'}: {p.kind}: {p.message}" for p in result.problems[:3]))  # fmt: skip
        unreadable = [p for p in result.problems if p.kind == "unreadable"]
        if unreadable:
            skipped.append((checkpoint, f"{unreadable[0].path}: {unreadable[0].message}"))
    return None, skipped
