"""Reading checkpoints back: ``verify`` (``verify(p).complete``), ``latest_complete``.

A checkpoint directory is complete when its commit file (``_manifest``) parses and every
file it lists is a regular file of the listed size; ``deep`` also reads every file for its
CRC-32 and checks that each ``.safetensors`` header parses and its data ends exactly at the
end of the file. Nothing here writes, and nothing follows a symlink inside the checkpoint.

Reads only what is needed, so that resuming from a parent holding a thousand checkpoints on
a FUSE mount stays fast: ``latest_complete`` lists the parent once, orders the candidates by
the step number in their names, and reads commit files newest first, stat()ing files only
until the first complete checkpoint.
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
from typing import Any, Callable, Optional

from .._config import PathArg
from .._errors import ConfigError
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
    size, digest, safetensors, empty (a commit file listing no file)."""

    path: str
    kind: str
    message: str


@dataclass
class VerifyResult:
    """What ``verify`` found. ``complete`` is the answer; ``problems`` say why not."""

    path: Path
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
    path: PathArg, *, deep: bool = False, progress: Optional[Progress] = None
) -> VerifyResult:
    """Check the checkpoint directory ``path`` against its commit file; never raises for
    what it finds (missing files, a torn commit file, a missing directory: all problems).
    ``progress(bytes_read, total_bytes)`` is called as a deep verify reads."""
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


def latest_complete(
    parent: PathArg, pattern: str = "checkpoint-*", *, deep: bool = False
) -> Optional[Path]:
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
    part (or empty) raises ConfigError, as for ``prune``: it would take no name."""
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
    parent: PathArg, pattern: str = "checkpoint-*", *, deep: bool = False
) -> tuple[Optional[Path], list[tuple[Path, str]]]:
    """``latest_complete`` and the newer candidates it skipped as unreadable, with why."""
    base = as_path(parent)
    steps = candidate_steps(base, pattern)
    names = sorted(steps, key=lambda name: steps[name], reverse=True)
    skipped: list[tuple[Path, str]] = []
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


def check(
    directory: Path, manifest: Manifest, *, deep: bool, progress: Optional[Progress] = None
) -> VerifyResult:
    """Every file of ``manifest`` against ``directory``: type and size; deep, content too."""
    result = VerifyResult(directory, deep, manifest)
    report = None
    if deep and progress is not None:
        total = manifest.total_bytes

        def report(count: int) -> None:
            result.bytes_read += count
            progress(result.bytes_read, total)

    if not manifest.files:
        # A commit of nothing vouches for nothing: 0.4 committed a staged_dir block that saved
        # no file (or saved it elsewhere), and latest named it, retention counted it.
        why = "the commit file lists no file: nothing was saved into this checkpoint; delete it, or save it again"
        result.problems.append(Problem("", "empty", why))
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
    if size < 8:
        return f"{size} bytes: shorter than the 8-byte header length"
    (length,) = struct.unpack("<Q", _pread_exactly(fd, 8, 0))
    if length > size - 8:
        return f"the header announces {length} bytes, the file has {size - 8} after the length"
    if length > _MAX_HEADER:
        return f"a {length}-byte header (safetensors refuses more than {_MAX_HEADER})"
    try:
        header = json.loads(_pread_exactly(fd, length, 8))
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
            document = json.loads(handle.read(1 << 16))
    except (OSError, ValueError, RecursionError):
        return SetAside("?", "?")  # a marker that is there but cannot be read still marks it
    if not isinstance(document, dict):
        return SetAside("?", "?")
    return SetAside(str(document.get("by", "?")), str(document.get("at", "?")))


def marker_problem(exc: OSError) -> Problem:
    """What ``verify`` and the readers say of a checkpoint ``set_aside_by`` could not tell."""
    return Problem(SET_ASIDE_NAME, "unreadable", exc.strerror or str(exc))
