"""`safestage doctor PATH`: probe a destination directory and say what a save needs there.

Everything happens in a private probe directory ``.safestage-doctor-<host>-<pid>-<token>``
(0700) made under PATH, removed at the end even on errors; nothing else in PATH is touched.
A probe directory left by a crash is recognised by `safestage clean`.

``run_doctor`` returns a :class:`Report`; ``Report.to_json()`` is what ``--json`` prints.
Stable keys (schema 1)::

    schema          1
    path            absolute path of PATH
    mount           {mount_point, fs_type, source, is_fuse, is_network} or null
    staging         {root, source ("--dir" | "SAFESTAGE_DIR" | "default"), usable, error,
                     fs_type, same_device, publish, fsync}
                    same_device: the root shares a filesystem with PATH, so publishing is a
                    rename (no copy); null when the root is unusable
    probe           {dir, error, steps: {STEP: RESULT}, details: {STEP: text}}
                    STEP in STEPS (create, write, ftruncate, fsync, close, rename, replace,
                    chmod, o_trunc, out_of_order, read_back); RESULT is "ok", an errno name
                    ("ENOSYS", "EPERM", ...), "skipped" (its set-up failed), "mismatch"
                    (read-back bytes differ) or "timeout"; details explain every non-ok result
    plain_save      {result, error, errno, step, mode, strategy}: safetensors.torch.save_file
                    of a tiny tensor without staging
    staged_save     the same save through safestage, same keys.
                    result: "ok" | "failed" | "data-loss" (returned success, file missing or
                    different) | "cannot-run" (this Python cannot save safetensors at all: a
                    missing module such as numpy, named in error) | "not-run"; errno: errno
                    name of a failure or null; step: the publishing step that failed
                    (staged_save only); mode: octal string of the saved file ("0600");
                    strategy: how safestage published it (staged_save only)
    cleanup         {removed, error}: whether the probe directory (and any staged copy a
                    failed publish kept) is gone
    verdict         "plain-ok" | "needs-staging" | "unsafe" (even a staged save fails or loses
                    data) | "staging-unusable" (a plain save fails and the staging root is
                    unusable, so no staged save could be tried) | "unknown" (no probe
                    directory could be made, or plain_save is "cannot-run")
    problems        [text]: empty exactly when the exit status is 0
    recommendation  {env: {VAR: value}, text}
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import stat
import threading
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

from .. import _patch
from .._config import ENV_DIR, ENV_PUBLISH, Settings, resolve
from .._errors import ConfigError, PublishError, StagingError
from .._kept import remove_tree
from .._locks import Contended, claim, close_quietly, open_directory
from .._mounts import MountInfo, mount_of
from .._names import doctor_dir_name, parse_stage_dir
from .._paths import real_directory
from .._publish import NOT_SUPPORTED, write_all
from .._stage import StagingRoot, errno_of

SCHEMA = 1
STEPS = (
    "create", "write", "ftruncate", "fsync", "close", "rename", "replace", "chmod",
    "o_trunc", "out_of_order", "read_back",
)  # fmt: skip
STEP_TIMEOUT = 60.0  # seconds; the probes are tiny, a step this slow is a hung mount
_DATA = bytes(range(256)) * 64  # 16 KiB: big enough to be a real write, small enough to be instant
_GROW = 4096  # ftruncate grows the file by this much, the way safetensors 0.8 preallocates


class StepTimeout(Exception):
    """A probe step took longer than STEP_TIMEOUT."""


@dataclass
class StagingReport:
    root: str
    source: str
    usable: bool = False
    error: Optional[str] = None
    fs_type: Optional[str] = None
    same_device: Optional[bool] = None
    publish: str = "auto"
    fsync: bool = True


@dataclass
class ProbeReport:
    dir: str
    error: Optional[str] = None
    steps: dict[str, str] = field(default_factory=dict)
    details: dict[str, str] = field(default_factory=dict)


@dataclass
class SaveReport:
    result: str = "not-run"
    error: Optional[str] = None
    errno: Optional[str] = None
    step: Optional[str] = None
    mode: Optional[str] = None
    strategy: Optional[str] = None


@dataclass
class CleanupReport:
    removed: bool = True
    error: Optional[str] = None


@dataclass
class Report:
    path: str
    mount: Optional[dict[str, Any]]
    staging: StagingReport
    probe: ProbeReport
    plain_save: SaveReport = field(default_factory=SaveReport)
    staged_save: SaveReport = field(default_factory=SaveReport)
    cleanup: CleanupReport = field(default_factory=CleanupReport)
    verdict: str = "unsafe"
    problems: list[str] = field(default_factory=list)
    recommendation: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, **asdict(self)}


# -- entry point -------------------------------------------------------------------------------


def run_doctor(
    path: Path,
    *,
    root: Optional[Path] = None,
    environ: Optional[Mapping[str, str]] = None,
    timeout: float = STEP_TIMEOUT,
) -> Report:
    """Probe the existing directory ``path``; ``root`` overrides the staging root (--dir)."""
    env = os.environ if environ is None else environ
    path = Path(os.path.abspath(path))
    settings, config_error = _settings(root, env)
    source = (
        "--dir"
        if root is not None
        else ("SAFESTAGE_DIR" if settings.root is not None else "default")
    )
    report = Report(
        path=str(path),
        mount=_mount_dict(mount_of(path)),
        staging=_check_staging(settings, source, path),
        probe=ProbeReport(dir=str(path / doctor_dir_name())),
    )
    if config_error is not None:
        report.problems.append(f"configuration: {config_error}")
    _probe_in_private_dir(report, Path(report.probe.dir), settings, timeout)
    _conclude(report)
    return report


def _settings(root: Optional[Path], env: Mapping[str, str]) -> tuple[Settings, Optional[str]]:
    """The settings a save would use here; a bad SAFESTAGE_* variable is reported, and the
    probe goes on with the defaults for the bad ones."""
    try:
        return resolve(root=root, environ=env), None
    except ConfigError as exc:
        error = str(exc)
    try:
        return resolve(root=root, environ={ENV_DIR: env.get(ENV_DIR, "")}), error
    except ConfigError:
        return resolve(root=root, environ={}), error


def _mount_dict(mount: Optional[MountInfo]) -> Optional[dict[str, Any]]:
    if mount is None:
        return None
    return {
        "mount_point": mount.mount_point,
        "fs_type": mount.fs_type,
        "source": mount.source,
        "is_fuse": mount.is_fuse,
        "is_network": mount.is_network,
    }


def _check_staging(settings: Settings, source: str, path: Path) -> StagingReport:
    root = settings.staging_root()
    report = StagingReport(
        root=str(root), source=source, publish=settings.publish, fsync=settings.fsync
    )
    mount = mount_of(root)
    report.fs_type = mount.fs_type if mount is not None else None
    try:
        # The same checks a save makes at activation (local, a directory, a real write probe);
        # the default root is created 0700 here exactly as the first staged save would.
        staging = StagingRoot(root, is_default=settings.root is None)
    except StagingError as exc:
        report.error = str(exc)
        return report
    report.usable = True
    report.same_device = staging.device == os.stat(path).st_dev
    return report


# -- the probe directory -----------------------------------------------------------------------


def _probe_in_private_dir(
    report: Report, directory: Path, settings: Settings, timeout: float
) -> None:
    try:
        with _deadline(timeout):
            os.mkdir(directory, 0o700)
    except (OSError, StepTimeout) as exc:
        report.probe.error = f"cannot create a probe directory in {report.path}: {_describe(exc)}"
        report.problems.append(report.probe.error)
        return
    kept_copy: list[Path] = []
    lock = _lock_probe(directory)  # a clean in another PID namespace leaves a live probe alone
    try:
        _probe_syscalls(report.probe, directory, timeout)
        report.plain_save = _plain_save(directory, timeout)
        if report.staging.usable:
            report.staged_save = _staged_save(directory, settings, timeout, kept_copy)
    finally:
        report.cleanup = _remove_probe(directory, kept_copy)
        if lock is not None:
            close_quietly(lock)


def _lock_probe(directory: Path) -> Optional[int]:
    try:
        fd = open_directory(directory)
    except OSError:
        return None
    with contextlib.suppress(OSError, Contended):  # no locks here: the probe runs anyway
        claim(fd, directory)
    return fd


def _remove_probe(directory: Path, kept_copy: list[Path]) -> CleanupReport:
    for private in kept_copy:  # a failed publish keeps its staged copy; the probe's is disposable
        remove_tree(private)
    shutil.rmtree(directory, ignore_errors=True)
    if not directory.exists():
        return CleanupReport(removed=True)
    try:  # once more, to say why: some mounts refuse unlink (mountpoint-s3 while a file is open)
        shutil.rmtree(directory)
    except OSError as exc:
        why = f"{exc.filename}: {_describe(exc)}"
    else:
        return CleanupReport(removed=True)
    return CleanupReport(
        removed=False,
        error=f"could not remove the probe directory {directory} ({why}): remove it by hand "
        f"or run `safestage clean {directory.parent}`",
    )


# -- syscall probes ----------------------------------------------------------------------------


class _Recorder:
    """Runs probe steps, each under a deadline, recording "ok" or what went wrong."""

    def __init__(self, probe: ProbeReport, timeout: float) -> None:
        self.probe = probe
        self.timeout = timeout

    def run(self, step: str, action: Callable[[], object]) -> bool:
        failure = self._attempt(action)
        if failure is None:
            self.probe.steps[step] = "ok"
        elif isinstance(failure, StepTimeout):
            self.fail(step, "timeout", str(failure))
        elif isinstance(failure, _Mismatch):
            self.fail(step, "mismatch", str(failure))
        else:
            self.fail(step, _name_of(failure.errno) or "error", _describe(failure))
        return failure is None

    def setup(self, step: str, action: Callable[[], object]) -> bool:
        """Prepare ``step``: if that fails, the step is "skipped" (its own call never ran)."""
        failure = self._attempt(action)
        if failure is not None:
            self.fail(step, "skipped", f"set-up failed: {_describe(failure)}")
        return failure is None

    def fail(self, step: str, result: str, detail: str) -> None:
        self.probe.steps[step] = result
        self.probe.details[step] = detail

    def _attempt(self, action: Callable[[], object]) -> Union[OSError, StepTimeout, None]:
        try:
            with _deadline(self.timeout):
                action()
        except (OSError, StepTimeout) as exc:
            return exc
        return None


def _probe_syscalls(probe: ProbeReport, directory: Path, timeout: float) -> None:
    recorder = _Recorder(probe, timeout)
    _probe_new_file(recorder, directory / "probe")
    _probe_out_of_order(recorder, directory / "seek")
    _probe_renames(recorder, directory)
    _probe_chmod(recorder, directory / "chmod")
    _probe_overwrite(recorder, directory / "overwrite")
    probe.steps = {step: probe.steps[step] for step in STEPS}  # display order


def _probe_new_file(recorder: _Recorder, path: Path) -> None:
    """create, write, ftruncate (grow), fsync, close, read back: the life of a safetensors
    0.8 temp file (safetensors#787: ftruncate is what HDFS FUSE refuses with ENOSYS)."""
    fd = -1

    def create() -> None:
        nonlocal fd
        fd = _open_for_writing(path)

    if not recorder.run("create", create):
        for step in ("write", "ftruncate", "fsync", "close", "read_back"):
            recorder.fail(step, "skipped", "create failed")
        return
    expected = b""
    try:
        if recorder.run("write", lambda: write_all(fd, memoryview(_DATA))):
            expected = _DATA
        if recorder.run("ftruncate", lambda: os.ftruncate(fd, len(expected) + _GROW)):
            expected += bytes(_GROW)
        recorder.run("fsync", lambda: os.fsync(fd))
    finally:
        # close() is checked: object stores upload here and report failure only here.
        recorder.run("close", lambda: os.close(fd))  # Linux frees the fd even when close fails
    recorder.run("read_back", lambda: _read_back(path, expected))


def _read_back(path: Path, expected: bytes) -> None:
    with open(path, "rb") as handle:
        data = handle.read()
    if data != expected:
        raise _Mismatch(f"read {len(data)} bytes back, expected {len(expected)} (contents differ)")


class _Mismatch(OSError):
    """Read-back returned other bytes than were written (recorded as "mismatch")."""


def _probe_out_of_order(recorder: _Recorder, path: Path) -> None:
    """A write behind the current end (seek back): streaming uploads refuse it (#792)."""
    fd = -1

    def setup() -> None:
        nonlocal fd
        fd = _open_for_writing(path)
        write_all(fd, memoryview(_DATA))

    try:
        if recorder.setup("out_of_order", setup):
            recorder.run("out_of_order", lambda: os.pwrite(fd, b"\0" * 16, 0))
    finally:
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


def _open_for_writing(path: Path, flags: int = os.O_CREAT | os.O_EXCL) -> int:
    return os.open(path, os.O_WRONLY | os.O_CLOEXEC | flags, 0o644)


def _make_empty(path: Path) -> None:
    # Empty on purpose: rename and chmod are probed on their own, not behind a failing upload.
    os.close(_open_for_writing(path))


def _probe_renames(recorder: _Recorder, directory: Path) -> None:
    """rename to a new name, and replace over an existing file: what safetensors 0.8 and
    publish='replace' do last. mountpoint-s3 refuses both (#792)."""
    source, target = directory / "rename-src", directory / "rename-new"
    if recorder.setup("rename", lambda: _make_empty(source)):
        recorder.run("rename", lambda: os.replace(source, target))  # target absent: a rename
    source, target = directory / "replace-src", directory / "replace-old"

    def setup() -> None:
        _make_empty(source)
        _make_empty(target)

    if recorder.setup("replace", setup):
        recorder.run("replace", lambda: os.replace(source, target))


def _probe_chmod(recorder: _Recorder, path: Path) -> None:
    if recorder.setup("chmod", lambda: _make_empty(path)):
        recorder.run("chmod", lambda: os.chmod(path, 0o640))


def _probe_overwrite(recorder: _Recorder, path: Path) -> None:
    """Overwrite an existing file with open(O_TRUNC): how publish='direct' writes."""

    def write_file(flags: int) -> None:
        fd = _open_for_writing(path, flags)
        try:
            write_all(fd, memoryview(_DATA))
        except OSError:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        os.close(fd)

    if recorder.setup("o_trunc", lambda: write_file(os.O_CREAT | os.O_EXCL)):
        recorder.run("o_trunc", lambda: write_file(os.O_TRUNC))


# -- saves -------------------------------------------------------------------------------------


def _sample() -> dict[str, Any]:
    import torch

    return {"probe": torch.arange(64, dtype=torch.float32).reshape(8, 8)}


def _cannot_save(exc: ImportError) -> SaveReport:
    """This Python cannot save safetensors anywhere: a module is missing, not the destination.
    (safetensors' torch API imports numpy to save but declares it only in its [torch] extra.)"""
    missing = exc.name or str(exc)
    return SaveReport(
        result="cannot-run",
        error=f"this Python cannot save safetensors at all: {type(exc).__name__}: {exc}. "
        f"Install it (pip install {missing.split('.')[0]}), then run safestage doctor again",
    )


def _plain_save(directory: Path, timeout: float) -> SaveReport:
    """What a plain safetensors 0.8 save does here: temp file, ftruncate, rename."""
    target = directory / "plain.safetensors"
    try:
        from safetensors.torch import save_file

        tensors = _sample()
        with _patch.bypass(), _deadline(timeout):
            save_file(tensors, str(target))
    except ImportError as exc:
        return _cannot_save(exc)
    except Exception as exc:
        return SaveReport(result="failed", error=_describe(exc), errno=_errno_of(exc))
    return _verify(target, tensors, SaveReport(result="ok"))


def _staged_save(
    directory: Path, settings: Settings, timeout: float, kept_copy: list[Path]
) -> SaveReport:
    from .._api import Stage

    target = directory / "staged.safetensors"
    stage = Stage(settings)
    try:
        from safetensors.torch import save_file

        tensors = _sample()
        with _deadline(timeout), stage:
            save_file(tensors, str(target))
    except ImportError as exc:
        return _cannot_save(exc)
    except PublishError as exc:
        kept_copy.extend(_kept_private_dir(exc, settings))
        return SaveReport(result="failed", error=str(exc), errno=_errno_of(exc), step=exc.step)
    except Exception as exc:
        return SaveReport(result="failed", error=_describe(exc), errno=_errno_of(exc))
    strategy = stage.records[-1].publish if stage.records else None
    return _verify(target, tensors, SaveReport(result="ok", strategy=strategy))


def _kept_private_dir(exc: PublishError, settings: Settings) -> list[Path]:
    """The private staging directory holding the copy a failed publish kept, if it is ours."""
    if exc.staged_path is None:
        return []
    private = Path(exc.staged_path).parent
    owner = parse_stage_dir(private.name)
    ours = owner is not None and owner.pid == os.getpid() and owner.is_this_host()
    root = real_directory(settings.staging_root())  # the root may be given through a symlink
    return [private] if ours and root is not None and private.parent == root else []


def _verify(target: Path, tensors: dict[str, Any], report: SaveReport) -> SaveReport:
    """The save returned: does the file load back equal? (close-eio: it is simply gone)."""
    import torch
    from safetensors.torch import load_file

    try:
        report.mode = f"{stat.S_IMODE(os.stat(target).st_mode):04o}"
        loaded = load_file(str(target))
    except Exception as exc:
        report.result = "data-loss"
        report.error = f"the save returned without error, but {target.name} cannot be read back: {_describe(exc)}"
        return report
    if sorted(loaded) != sorted(tensors) or not all(
        torch.equal(loaded[k], v) for k, v in tensors.items()
    ):
        report.result = "data-loss"
        report.error = (
            f"the save returned without error, but {target.name} loads back different tensors"
        )
    return report


# -- conclusions -------------------------------------------------------------------------------


def _conclude(report: Report) -> None:
    """Problems are one line each; the sections above them hold the details."""
    plain, staged = report.plain_save, report.staged_save
    if plain.result == "cannot-run":
        # Not the destination's fault: say what is missing and conclude nothing about PATH.
        assert plain.error is not None
        report.problems.append(plain.error)
        report.verdict = "unknown"
        report.recommendation = _recommendation(f"none yet: {plain.error}")
        return
    if plain.result not in ("not-run", "ok"):
        report.problems.append(f"a plain safetensors save {_outcome(plain)}")
    if not report.staging.usable:
        report.problems.append(
            f"staging is not possible: the staging root {report.staging.root} is unusable"
        )
    elif staged.result not in ("not-run", "ok"):
        report.problems.append(f"a save through safestage {_outcome(staged)}")
    if not report.cleanup.removed and report.cleanup.error is not None:
        report.problems.append(report.cleanup.error)
    if plain.result == "not-run":
        report.verdict = "unknown"
    elif plain.result == "ok":
        report.verdict = "plain-ok"
    elif staged.result == "ok":
        report.verdict = "needs-staging"
    elif not report.staging.usable:
        report.verdict = "staging-unusable"  # not "unsafe": the staged save never ran
    else:
        report.verdict = "unsafe"
    report.recommendation = _recommend(report)


def _outcome(save: SaveReport) -> str:
    if save.result == "data-loss":
        return "reports success here but the file is lost or different (data loss)"
    where = f" at {save.step}" if save.step else ""
    return f"fails here ({save.errno or 'error'}{where})"


def _recommend(report: Report) -> dict[str, Any]:
    staging, steps = report.staging, report.probe.steps
    if report.verdict == "unknown":
        return _recommendation(f"none: {report.probe.error}")
    if report.verdict == "plain-ok":
        mode_note = ""
        if report.plain_save.mode == "0600":
            mode_note = (
                " Note: safetensors 0.8 leaves every saved file mode 0600 whatever the umask "
                "(safetensors#782); a save through safestage gets 0o666 & ~umask."
            )
        return _recommendation(f"not needed: a plain save works here.{mode_note}")
    if not staging.usable:
        return _recommendation(
            f"set SAFESTAGE_DIR to a local directory (the staging root {staging.root} "
            "is unusable), then run `safestage doctor` again"
        )
    cannot_rename = _errno_value(steps.get("rename")) in NOT_SUPPORTED
    if report.staged_save.result != "ok":
        return _staged_failed(report, cannot_rename)
    # #792: mountpoint-s3 cannot rename; auto would find that out on the first save (one
    # WARNING), direct skips the failed attempt.
    publish = "direct" if cannot_rename or report.staged_save.strategy == "direct" else "auto"
    return _recommendation(
        f"stage every save: set these in the environment, or `safestage run --dir "
        f"{staging.root} --publish {publish} -- CMD`, or safestage.staged() in code",
        {ENV_DIR: staging.root, ENV_PUBLISH: publish},
    )


def _staged_failed(report: Report, cannot_rename: bool) -> dict[str, Any]:
    staged = report.staged_save
    if cannot_rename and report.staging.publish == "replace":
        return _recommendation(
            "this destination cannot rename: publish='replace' (from your settings) "
            "cannot work here; use SAFESTAGE_PUBLISH=direct (or auto)",
            {ENV_DIR: report.staging.root, ENV_PUBLISH: "direct"},
        )
    if staged.errno == "EIO" and staged.step in ("fsync", "close"):
        return _recommendation(
            "none: this destination loses data at close (fsync/close answer EIO and "
            "the file is gone). A plain save reports success and loses the file; through "
            "safestage the save fails loudly (PublishError). Check the mount's health, "
            "credentials and logs."
        )
    return _recommendation(
        "none found: a save through safestage fails too; check the destination and "
        "the staging root"
    )


def _recommendation(text: str, env: Optional[dict[str, str]] = None) -> dict[str, Any]:
    return {"env": env or {}, "text": text}


def _errno_value(name: Optional[str]) -> Optional[int]:
    code = getattr(errno, name, None) if name else None
    return code if isinstance(code, int) else None


# -- helpers -----------------------------------------------------------------------------------


def _name_of(code: Optional[int]) -> Optional[str]:
    if not code:
        return None
    if code == errno.EOPNOTSUPP:
        return "EOPNOTSUPP"  # == ENOTSUP on Linux; errorcode says ENOTSUP, #842 says EOPNOTSUPP
    return errno.errorcode.get(code, f"errno {code}")


def _errno_of(exc: BaseException) -> Optional[str]:
    """The errno name of a failure, also from a SafetensorError's "(os error N)" text."""
    return _name_of(errno_of(exc))


def _describe(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.errno and not isinstance(exc, (PublishError, StagingError)):
        return f"[Errno {exc.errno}] {_name_of(exc.errno)}: {exc.strerror}"
    return f"{type(exc).__name__}: {exc}"


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Interrupt the block after ``seconds`` with StepTimeout (main thread only: SIGALRM).

    A FUSE call blocked in the kernel gets EINTR and the handler's exception surfaces; code
    that retries EINTR itself (the Rust writer) is bounded only by the mount.
    """
    if threading.current_thread() is not threading.main_thread() or seconds <= 0:
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise StepTimeout(f"no answer within {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
