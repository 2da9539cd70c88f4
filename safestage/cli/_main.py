"""The `safestage` command: doctor, run, status, clean, recover, verify, latest, prune, fetch, demo, kit. The
only module that prints.

Exit status: 0 all good; 1 the command found a problem (doctor: a plain save fails or loses
data here, or staging is not possible / fails too; status: a SAFESTAGE_* variable is bad;
clean, prune: something could not be removed; recover: a kept copy was refused or failed); 2 a
usage error; 3 `latest`, `recover` or `prune` could not look, `fetch` failed. `run` becomes its command (exec)
after its checks; called in-process it returns the command's status (128 + N for signal N).

--json output: doctor's keys are documented in _doctor; status prints {version, python,
hook {installed, files, searched}, environment {VAR: value of every SAFESTAGE* variable set},
would_activate, settings {root, root_source, publish, fsync, and every other option} or null,
active_in_this_process, error}; clean
prints {path, dry_run, entries [{name, kind, host, pid, action, reason}], removed,
would_remove, kept, failed}.

Nothing heavy is imported at module level: `safestage status` stays fast, and torch and
safetensors are imported only by the saves of `safestage doctor`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import site
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from .. import __version__
from .._config import (
    ENV_BACKGROUND,
    ENV_DIR,
    ENV_PUBLISH,
    ENV_SKIP_LOCAL_DISK,
    ENV_SWITCH,
    ENV_TORCH_SAVE,
    env_value,
    parse_background,
    parse_publish,
    parse_root,
    resolve,
)
from .._errors import ConfigError

if TYPE_CHECKING:
    from .._config import Settings
    from .._destination import Destination
    from ._doctor import Report, SaveReport, StagingReport

# `safestage latest`: 0 found (printed), 1 no complete checkpoint, 2 usage, 3 could not look.
LATEST_COULD_NOT_LOOK = 3
# `safestage recover`: 0 all recovered, 1 something failed or was refused, 2 usage, 3 no root.
RECOVER_COULD_NOT_READ = 3

HOOK_FILES = ("safestage.pth", "safestage.start")  # .pth up to Python 3.14, .start (PEP 829) after


def console_main() -> int:
    """The `safestage` command and `python -m safestage`."""
    _EXEC_ALLOWED[0] = True
    return main()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.handler is None:
        parser.print_help(sys.stderr)
        return 2
    handler: Callable[[argparse.Namespace], int] = args.handler
    return handler(args)


# -- arguments ---------------------------------------------------------------------------------


def _root_argument(value: str) -> Path:
    try:
        return parse_root(value, "--dir")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _publish_argument(value: str) -> str:
    try:
        return parse_publish(value, "--publish")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _background_argument(value: str) -> int:
    try:
        return parse_background(value, "--background")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _keep_argument(value: str) -> int:
    from ..checkpoint._prune import check_keep

    try:
        return check_keep(int(value) if value.strip().isdigit() else value, "--keep")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _pattern_argument(value: str) -> str:
    from ..checkpoint._verify import check_pattern

    try:
        return check_pattern(value, "--pattern")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _destination_argument(value: str) -> Destination:
    """A path, or an object-store URL (s3://bucket/run): never Path("s3://b/run"), which is the
    relative path s3:/b/run."""
    from .._destination import UnsupportedDestination, url_of

    try:
        url = url_of(value)
    except UnsupportedDestination as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return Path(value) if url is None else url


def _seconds_argument(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds >= 0")
    return seconds


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="safestage",
        description="Make safetensors saves land, complete, on FUSE, object-store and "
        "cross-device destinations.",
    )
    parser.add_argument("--version", action="version", version=f"safestage {__version__}")
    parser.set_defaults(handler=None)
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")

    doctor = commands.add_parser(
        "doctor",
        help="probe a destination directory: what fails there, and the settings that fix it",
        description="Probe PATH (in a private directory it removes afterwards): which "
        "syscalls fail there, whether a plain safetensors save works, whether a save through "
        "safestage works, and the settings to use.",
    )
    doctor.add_argument("path", metavar="PATH", type=Path, help="the directory you save into")
    doctor.add_argument("--dir", metavar="STAGING_ROOT", type=_root_argument,
                        help="staging root to check (default: SAFESTAGE_DIR, else $TMPDIR/safestage-<uid>)")  # fmt: skip
    doctor.add_argument("--json", action="store_true", help="print one JSON object")
    doctor.set_defaults(handler=_doctor)

    run = commands.add_parser(
        "run",
        help="run a command with staging switched on through the environment",
        description="Run CMD with SAFESTAGE=1 and the given SAFESTAGE_DIR, SAFESTAGE_PUBLISH, "
        "SAFESTAGE_BACKGROUND, SAFESTAGE_SKIP_LOCAL_DISK, SAFESTAGE_TORCH_SAVE in its environment; "
        "the start-up hook of its Python activates staging.",
    )
    run.add_argument("--dir", metavar="D", type=_root_argument, help="staging root (SAFESTAGE_DIR)")
    run.add_argument("--publish", metavar="P", type=_publish_argument,
                     help="auto, replace or direct (SAFESTAGE_PUBLISH)")  # fmt: skip
    run.add_argument("--background", metavar="N", type=_background_argument,
                     help="publish on worker threads while CMD goes on: 0 off, 1 on (2 files at "
                     "once), N at most N at once (SAFESTAGE_BACKGROUND)")  # fmt: skip
    run.add_argument("--skip-local-disk", action="store_true",
                     help="write local-disk destinations unstaged (SAFESTAGE_SKIP_LOCAL_DISK=1)")  # fmt: skip
    run.add_argument(
        "--torch-save",
        action="store_true",
        help="also stage torch.save(obj, path) (SAFESTAGE_TORCH_SAVE=1)",
    )
    # Removed in 0.2 with SAFESTAGE_FSYNC: turning durability off is a decision made in code.
    run.add_argument("--no-fsync", action="store_true", help=argparse.SUPPRESS)
    run.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ARGS")
    run.set_defaults(handler=_run)

    status = commands.add_parser(
        "status",
        help="version, start-up hook, and what the environment would activate",
    )
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.set_defaults(handler=_status)

    clean = commands.add_parser(
        "clean",
        help="remove safestage's leftovers whose process is gone",
        description="Remove safestage's leftovers whose owner process is gone: among the "
        "entries of PATH, its temp files, staging directories and doctor probe directories; in "
        "every subdirectory of PATH (a run directory's checkpoints, theirs), its temp files. "
        "Symlinks are never followed, nothing else is ever touched. A kept copy is listed with "
        "the destination it was for.",
    )
    clean.add_argument(
        "path", metavar="PATH", type=Path, help="a destination directory or a staging root"
    )
    clean.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    clean.add_argument("--older-than", metavar="SECONDS", type=_seconds_argument,
                       help="also remove leftovers of other hosts untouched for longer than this")  # fmt: skip
    clean.add_argument("--json", action="store_true", help="print one JSON object")
    clean.set_defaults(handler=_clean)

    recover = commands.add_parser(
        "recover",
        help="commit or publish the copies kept in a staging root by saves that did not finish",
        description="For every copy kept in ROOT (a commit that failed, or whose process was "
        "killed after its block returned; a failed single-file publish) whose process is gone: "
        "commit the checkpoint directory to the destination its record names (the commit of "
        "staged_dir: the commit file last), or publish the file, then remove the copy. Refuse, "
        "touching nothing, what cannot be done right (the destination's parent missing, a newer "
        "complete checkpoint there, files not matching the record, one rank's part of a "
        "checkpoint). Each copy is shown with the job that kept it (host, pid, command line): the "
        "default root is shared by every job of the user on the host. Exit 0 all recovered, 1 "
        "something failed or was refused, 3 ROOT could not be read.",
    )
    recover.add_argument("root", metavar="ROOT", nargs="?", type=_root_argument, default=None,
                         help="the staging root (default: SAFESTAGE_DIR, else $TMPDIR/safestage-<uid>)")  # fmt: skip
    recover.add_argument("--dest", metavar="PATH", type=_destination_argument,
                         help="only the copies whose destination is PATH (or URL) or lies under it")  # fmt: skip
    recover.add_argument("--discard", metavar="COPY", type=Path,
                         help="delete the kept copy COPY (a path recover printed), once its owner is gone")  # fmt: skip
    recover.add_argument("--dry-run", action="store_true", help="only say what would be done")
    recover.add_argument("--json", action="store_true", help="print one JSON object")
    recover.set_defaults(handler=_recover)

    verify = commands.add_parser(
        "verify",
        help="is a checkpoint directory complete? (its commit file against its files)",
        description="Check the checkpoint directory PATH against its commit file "
        "(_SAFESTAGE_COMMIT.json, written last by safestage.staged_dir): every listed file "
        "there, with its size; --deep also reads every file for its CRC-32 and checks each "
        ".safetensors header. Exit 0 complete, 1 not.",
    )
    verify.add_argument("path", metavar="PATH", type=_destination_argument,
                        help="a checkpoint directory, or its URL (s3://bucket/run/checkpoint-100)")  # fmt: skip
    verify.add_argument("--deep", action="store_true", help="read every file: digests, safetensors headers")
    verify.add_argument("--json", action="store_true", help="print one JSON object")
    verify.set_defaults(handler=_verify)

    latest = commands.add_parser(
        "latest",
        help="print the newest complete checkpoint directory in PARENT",
        description="Print the newest complete checkpoint in PARENT: among the directories "
        "matching --pattern, the highest step number (what the pattern's last * matches), "
        "then the latest commit; never one a resumed run set aside. Exit 0 with the path "
        "printed; 1 if none is complete (the committed directories the pattern does not take "
        "are named); 3 if it could not look (PARENT cannot be listed, or no candidate could be "
        "read). A newer candidate skipped because it could not be read is named in a WARNING "
        "line on stderr.",
    )
    latest.add_argument("parent", metavar="PARENT", type=_destination_argument,
                        help="the directory holding the checkpoints, or the run's URL (s3://bucket/run)")  # fmt: skip
    latest.add_argument("--pattern", metavar="P", default="checkpoint-*", type=_pattern_argument,
                        help="fnmatch pattern of checkpoint names whose last * is the step number "
                        "(default: checkpoint-*, which takes checkpoint-500, not checkpoint-500-merged)")  # fmt: skip
    latest.add_argument("--deep", action="store_true", help="verify candidates deeply (reads them)")
    latest.set_defaults(handler=_latest)

    prune = commands.add_parser(
        "prune",
        help="remove old checkpoints in PARENT, keeping the N newest complete ones",
        description="Remove, among the directories of PARENT matching --pattern (ordered as "
        "`latest` orders them), the complete checkpoints beyond the N newest complete ones and "
        "the incomplete ones older than the newest complete one. Never the newest complete "
        "one, nor an incomplete one at least as new (a save in progress), nor one a live "
        "safestage commit on this host is writing (seen through the staging roots: --dir, "
        "SAFESTAGE_DIR, the default root), nor one a resumed run set aside (not counted "
        "either), nor a name without a step number or a symlink. "
        "The commit file goes first, then the rest. Prints each checkpoint removed (or that "
        "would be, --dry-run) and each kept for a reason. Exit 0 done; 1 a removal failed; 2 "
        "usage; 3 could not look (PARENT cannot be listed).",
    )
    prune.add_argument("parent", metavar="PARENT", type=_destination_argument,
                       help="the directory holding the checkpoints, or the run's URL (s3://bucket/run)")  # fmt: skip
    prune.add_argument("--keep", metavar="N", type=_keep_argument, required=True,
                       help="how many complete checkpoints to keep (>= 1)")  # fmt: skip
    prune.add_argument("--pattern", metavar="P", default="checkpoint-*", type=_pattern_argument,
                       help="fnmatch pattern of checkpoint names whose last * is the step number "
                       "(default: checkpoint-*)")  # fmt: skip
    prune.add_argument("--dir", metavar="STAGING_ROOT", type=Path,
                       help="also look for live commits in this staging root")  # fmt: skip
    prune.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    prune.set_defaults(handler=_prune)

    fetch = commands.add_parser(
        "fetch",
        help="download a committed checkpoint from an object store (s3://, gs://, az://)",
        description="Download the committed checkpoint URL (it holds _SAFESTAGE_COMMIT.json), or "
        "the newest complete checkpoint under the run URL (as `latest` finds it), into "
        "LOCAL_DIR/<its name>: every object it lists, checked against the commit (ETag, size, "
        "CRC-32), the commit file written last. Prints the local checkpoint's path on stdout "
        "(what was done on stderr). Exit 0 fetched; 1 no complete checkpoint there; 2 usage; 3 "
        "the fetch failed (an object missing, overwritten since the commit, not matching its "
        "CRC-32, or the store or the disk failed): the local copy has no commit file, and "
        "running the same command again resumes it.",
    )
    fetch.add_argument("url", metavar="URL", help="a checkpoint or run URL (s3://bucket/run)")
    fetch.add_argument("local_dir", metavar="LOCAL_DIR", type=Path, help="the local directory to fetch into")
    fetch.add_argument("--pattern", metavar="P", default="checkpoint-*", type=_pattern_argument,
                       help="for a run URL: fnmatch pattern of checkpoint names whose last * is the "
                       "step number (default: checkpoint-*)")  # fmt: skip
    fetch.set_defaults(handler=_fetch)

    demo = commands.add_parser(
        "demo",
        help="mount real hostile filesystems and save to each, without and with safestage",
        description="Mount the hostile FUSE filesystems of safestage.testing (needs fuse3 and "
        "/dev/fuse) and real rclone and s3fs mounts of a local S3 server (needs rclone, s3fs "
        "and moto[server]), save the same tensors to each with plain safetensors, then through "
        "safestage, and print what happened side by side.",
    )
    demo.set_defaults(handler=_demo)

    kit = commands.add_parser(
        "kit",
        help="bring a hostile FUSE mount of the testing kit up, or down, for a shell session",
        description="Mount one of the testing kit's hostile filesystems (safestage.testing; "
        "needs fuse3 and /dev/fuse) and keep it after this command exits, to try your own "
        "training script against it; `kit down` unmounts it.",
    )
    kit_commands = kit.add_subparsers(dest="kit_command", metavar="{up,down}", required=True)
    up = kit_commands.add_parser("up", help="mount MODE at PATH and keep it mounted")
    up.add_argument("mode", metavar="MODE", help="hdfs, eopnotsupp, objectstore, mountpoint, close-eio, slow or passthrough")
    up.add_argument("path", metavar="PATH", type=Path, help="the mountpoint: an empty directory (created if missing)")
    up.add_argument("--backing", metavar="DIR", type=Path, default=None,
                    help="where the bytes really go (default: a new directory under the system temp dir, kept)")  # fmt: skip
    up.add_argument("--mbps", metavar="N", type=float, default=None, help="pace writes to N MB/s (slow: 200)")
    up.set_defaults(handler=_kit_up)
    down = kit_commands.add_parser("down", help="unmount a kit mount that `kit up` made")
    down.add_argument("path", metavar="PATH", type=Path, help="the mountpoint")
    down.set_defaults(handler=_kit_down)
    return parser


def _kit_up(args: argparse.Namespace) -> int:
    from ..testing import MODES, FuseUnavailable
    from ..testing._mount import KeptMount

    if args.mode not in MODES:
        return _usage_error("kit up", f"unknown mode {args.mode!r}: choose one of {', '.join(MODES)}")
    backing = args.backing
    if backing is None:
        import tempfile

        backing = Path(tempfile.mkdtemp(prefix=f"safestage-kit-{args.mode}-"))
    try:
        mount = KeptMount(args.mode, args.path, mbps=args.mbps, backing=backing).start()
    except FuseUnavailable as exc:
        print(f"safestage kit up: {exc}", file=sys.stderr)
        return 1
    except (ValueError, RuntimeError, OSError) as exc:
        return _usage_error("kit up", str(exc))
    pace = f", writes paced to {mount.mbps:g} MB/s" if mount.mbps else ""
    print(f"mounted {mount.mode} at {mount.path} (bytes in {mount.backing}{pace}; server log {mount.log_path})")
    print(f"unmount with: safestage kit down {mount.path}")
    return 0


def _kit_down(args: argparse.Namespace) -> int:
    from ..testing._mount import unmount_kept

    try:
        politely = unmount_kept(args.path)
    except (ValueError, RuntimeError) as exc:
        return _usage_error("kit down", str(exc))
    print(f"unmounted {args.path}" + ("" if politely else " (lazily: files were still open on it)"))
    return 0


def _demo(args: argparse.Namespace) -> int:
    import textwrap

    from ..testing import FuseUnavailable
    from ..testing._demo import THE_DIFFERENCE, run_demo

    try:
        rows = run_demo(progress=lambda text: print(f"... {text}", file=sys.stderr))
    except FuseUnavailable as exc:
        print(f"safestage demo: {exc}", file=sys.stderr)
        return 1
    import safetensors

    print(f"\nThe same save_file() of 3 tensors, safetensors {safetensors.__version__} alone vs through safestage:\n")
    width = 44
    print(f"{'destination':<18} {'safetensors alone':<{width}}   {'through safestage':<{width}}   verdict")
    print(f"{'-' * 18} {'-' * width}   {'-' * width}   {'-' * 9}")
    for row in [row for row in rows if row.missing is None]:
        left = textwrap.wrap(row.plain, width) or [""]
        right = textwrap.wrap(row.staged, width) or [""]
        for index in range(max(len(left), len(right))):
            first = index == 0
            print(
                f"{row.destination if first else '':<18} "
                f"{left[index] if index < len(left) else '':<{width}}   "
                f"{right[index] if index < len(right) else '':<{width}}   "
                f"{row.verdict if first else ''}"
            )
    print("\nThe one change that made the difference, around the same save_file() call:\n")
    for line in THE_DIFFERENCE:
        print(f"    {line}")
    print("\nor none at all in the code: SAFESTAGE_DIR=/local/scratch python train.py")
    missing = [row for row in rows if row.missing is not None]
    if missing:
        print("\nNot shown, for what this machine lacks (install it and run the demo again):", file=sys.stderr)
        for row in missing:
            print(f"  {row.destination}: {row.missing}", file=sys.stderr)
    broken = [row.destination for row in rows if row.verdict == "BROKEN"]
    if broken:
        print(f"\nsafestage did not fix: {', '.join(broken)}", file=sys.stderr)
    return 1 if broken else 0


def _usage_error(command: str, message: str) -> int:
    print(f"safestage {command}: error: {message}", file=sys.stderr)
    return 2


def _print_json(data: Mapping[str, Any]) -> None:
    print(json.dumps(data, indent=2))


def _table(rows: Sequence[tuple[str, str]], indent: str = "  ") -> None:
    width = max((len(label) for label, _ in rows), default=0)
    for label, value in rows:
        _print_line(f"{indent}{label:<{width}}  {value}".rstrip())


def _print_line(text: str) -> None:
    """print(), but a file name the stream cannot encode (not UTF-8, under a strict locale)
    is shown escaped instead of crashing after the work is done."""
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    print(text.encode(encoding, "backslashreplace").decode(encoding, "replace"))


def _existing_directory(command: str, path: Destination) -> Optional[int]:
    if not isinstance(path, Path):
        return None  # a URL: the store says what is there (a bucket has no directories)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return _usage_error(command, f"{path} does not exist: give the directory to {command}")
    except OSError as exc:  # a symlink loop, a component that is not a directory, EACCES
        return _usage_error(command, f"{path}: [Errno {exc.errno}] {exc.strerror}: give the directory to {command}")
    if not stat.S_ISDIR(info.st_mode):
        return _usage_error(command, f"{path} is not a directory: give the directory to {command}")
    return None


# -- doctor ------------------------------------------------------------------------------------


def _doctor(args: argparse.Namespace) -> int:
    from ._doctor import run_doctor

    error = _existing_directory("doctor", args.path)
    if error is not None:
        return error
    report = run_doctor(args.path, root=args.dir)
    if args.json:
        _print_json(report.to_json())
    else:
        _print_doctor(report)
    return 1 if report.problems else 0


def _print_doctor(report: Report) -> None:
    staging, mount = report.staging, report.mount
    print(f"safestage doctor {report.path}")
    rows = [("mount", _mount_text(mount)), ("staging root", _staging_text(staging))]
    if report.probe.error is not None:
        rows.append(("probe", report.probe.error))
    for step, result in report.probe.steps.items():
        detail = report.probe.details.get(step)
        rows.append(
            (
                step.replace("_", "-"),
                result if result == "ok" or detail is None else f"{result}  ({detail})",
            )
        )
    rows += [
        ("plain save", _save_text(report.plain_save, plain=True)),
        ("staged save", _save_text(report.staged_save, plain=False)),
        (
            "cleanup",
            "probe directory removed"
            if report.cleanup.removed
            else f"FAILED: {report.cleanup.error}",
        ),
        ("verdict", report.verdict),
    ]
    recommendation = report.recommendation
    env = recommendation.get("env") or {}
    if env:
        rows.append(("recommended", " ".join(f"{name}={value}" for name, value in env.items())))
        rows.append(("", recommendation["text"]))
    else:
        rows.append(("recommended", recommendation.get("text", "")))
    _table(rows)
    if report.problems:
        print("problems:")
        for problem in report.problems:
            print(f"  - {problem}")


def _mount_text(mount: Optional[Mapping[str, Any]]) -> str:
    if mount is None:
        return "unknown (no /proc/self/mountinfo entry)"
    kind = " (FUSE)" if mount["is_fuse"] else " (network)" if mount["is_network"] else ""
    return f"{mount['fs_type']}{kind}  {mount['source']} at {mount['mount_point']}"


def _staging_text(staging: StagingReport) -> str:
    head = f"{staging.root} ({staging.source}, {staging.fs_type or 'unknown fs'})"
    if not staging.usable:
        return f"{head}  UNUSABLE: {staging.error}"
    where = (
        "same filesystem: publish is a rename, no copy"
        if staging.same_device
        else "another filesystem: publish copies"
    )
    return f"{head}  usable; {where}"


def _save_text(save: SaveReport, *, plain: bool) -> str:
    if save.result == "not-run":
        return "not run"
    if save.result == "ok":
        how = f"{save.strategy}, " if save.strategy else ""
        note = (
            ": safetensors 0.8 ignores the umask, safetensors#782"
            if plain and save.mode == "0600"
            else ""
        )
        return f"ok  ({how}loads back equal; mode {save.mode}{note})"
    label = {"data-loss": "DATA LOSS", "cannot-run": "CANNOT RUN"}.get(save.result, "FAILED")
    return f"{label}  {save.error}"


# -- run ---------------------------------------------------------------------------------------


def _run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        return _usage_error("run", "no command given: safestage run [options] -- CMD ARGS...")
    if args.no_fsync:
        return _usage_error(
            "run",
            "--no-fsync is removed in safestage 0.2 (with SAFESTAGE_FSYNC): turning durability "
            "off is a decision made in code, pass fsync=False to safestage.staged()",
        )
    env = child_environment(
        os.environ,
        root=args.dir,
        publish=args.publish,
        background=args.background,
        skip_local_disk=args.skip_local_disk,
        torch_save=args.torch_save,
    )
    try:
        settings = resolve(environ=env)  # what the child would fail on, said once, before it starts
    except ConfigError as exc:
        return _usage_error("run", str(exc))
    problem = _root_problem(settings)
    if problem is not None:
        return _usage_error("run", problem)
    if not _hook_files():
        print(
            "safestage run: warning: the start-up hook (safestage.pth) is not installed in "
            f"{sys.executable}; CMD's saves are staged only if its Python has the hook "
            "(pip install safestage)",
            file=sys.stderr,
        )
    return _run_child(command, env)


def child_environment(
    environ: Mapping[str, str],
    *,
    root: Optional[Path],
    publish: Optional[str],
    background: Optional[int] = None,
    skip_local_disk: bool = False,
    torch_save: bool = False,
) -> dict[str, str]:
    """The parent's environment with staging switched on. SAFESTAGE=1 also with --dir: an
    inherited SAFESTAGE=0 would otherwise switch the requested staging off."""
    env = dict(environ)
    env[ENV_SWITCH] = "1"
    if root is not None:
        env[ENV_DIR] = str(root)
    if publish is not None:
        env[ENV_PUBLISH] = publish
    if background is not None:
        env[ENV_BACKGROUND] = str(background)
    if skip_local_disk:
        env[ENV_SKIP_LOCAL_DISK] = "1"
    if torch_save:
        env[ENV_TORCH_SAVE] = "1"
    return env


def _run_child(command: list[str], env: dict[str, str]) -> int:
    """Become CMD (exec) when this is the main thread of a real process, so that every
    signal sent to `safestage run` (SIGINT from docker stop or a supervisor too) reaches it;
    else run it as a child and forward what we can."""
    if threading.current_thread() is threading.main_thread() and _EXEC_ALLOWED[0]:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            os.execvpe(command[0], command, env)
        except FileNotFoundError:
            print(f"safestage run: command not found: {command[0]}", file=sys.stderr)
            return 127
        except PermissionError:
            print(f"safestage run: permission denied: {command[0]}", file=sys.stderr)
            return 126
    try:
        child = subprocess.Popen(command, env=env)
    except FileNotFoundError:
        print(f"safestage run: command not found: {command[0]}", file=sys.stderr)
        return 127
    except PermissionError:
        print(f"safestage run: permission denied: {command[0]}", file=sys.stderr)
        return 126
    with _signals_forwarded_to(child):
        code = child.wait()
    return 128 - code if code < 0 else code


# Only the `safestage` command itself may become CMD: main() called in-process (tests,
# embedding) must return a status, not replace the caller.
_EXEC_ALLOWED = [False]


@contextmanager
def _signals_forwarded_to(child: subprocess.Popen[bytes]) -> Iterator[None]:
    """While waiting: Ctrl-C reaches the child from the terminal (ignore it here, so we still
    return its status); SIGTERM and SIGHUP sent to us are passed on."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def forward(signum: int, frame: Any) -> None:
        child.send_signal(signum)

    previous = {
        signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
        signal.SIGTERM: signal.signal(signal.SIGTERM, forward),
        signal.SIGHUP: signal.signal(signal.SIGHUP, forward),
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


# -- status ------------------------------------------------------------------------------------


def _site_dirs() -> list[str]:
    dirs = list(getattr(site, "getsitepackages", list)())
    dirs.append(site.getusersitepackages())
    return list(dict.fromkeys(dirs))


def _hook_files() -> list[str]:
    return [
        str(Path(directory) / name)
        for directory in _site_dirs()
        for name in HOOK_FILES
        if (Path(directory) / name).is_file()
    ]


def status_report(environ: Optional[Mapping[str, str]] = None) -> dict[str, Any]:
    """What `safestage status --json` prints (keys in the module docstring)."""
    from .. import is_active
    from .._config import switched_on

    env = os.environ if environ is None else environ
    report: dict[str, Any] = {
        "version": __version__,
        "python": sys.executable,
        "hook": {"installed": False, "files": _hook_files(), "searched": _site_dirs()},
        "environment": {
            name: env[name]
            for name in sorted(env)
            if name == ENV_SWITCH or name.startswith("SAFESTAGE_")
        },
        "would_activate": False,
        "settings": None,
        "active_in_this_process": is_active(),
        "error": None,
    }
    report["hook"]["installed"] = bool(report["hook"]["files"])
    try:
        switched = switched_on(env)
        settings = resolve(environ=env)
    except ConfigError as exc:
        report["error"] = str(exc)
        return report
    report["settings"] = {
        **{k: v for k, v in asdict(settings).items() if k != "follow"},  # every public option
        "root": str(settings.staging_root()),
        "root_source": ENV_DIR if env_value(env, ENV_DIR) is not None else "default",
    }
    # An unusable root makes the start-up hook warn and leave saves unstaged: say so here.
    report["error"] = _root_problem(settings) if switched else None
    report["would_activate"] = switched and report["error"] is None
    return report


def _root_problem(settings: Settings) -> Optional[str]:
    """Why activation with ``settings`` would fail on its staging root, or None."""
    from .._errors import StagingError
    from .._stage import check_root

    try:
        check_root(settings.staging_root(), is_default=settings.root is None)
    except StagingError as exc:
        return str(exc)
    return None


def _status(args: argparse.Namespace) -> int:
    report = status_report()
    if args.json:
        _print_json(report)
        return 1 if report["error"] else 0
    hook = report["hook"]
    settings = report["settings"]
    env_text = " ".join(f"{name}={value}" for name, value in report["environment"].items())
    rows = [
        ("version", report["version"]),
        ("python", report["python"]),
        (
            "start-up hook",
            ", ".join(hook["files"])
            if hook["installed"]
            else f"not installed (looked in {', '.join(hook['searched'])})",
        ),
        ("environment", env_text or "no SAFESTAGE_* variable set"),
        ("would stage", _activation_text(report)),
        ("settings", _settings_text(settings)),
        ("active here", "yes" if report["active_in_this_process"] else "no"),
    ]
    _table(rows, indent="")
    if report["error"]:
        print(f"error: {report['error']}")
        return 1
    return 0


def _settings_text(settings: Optional[Mapping[str, Any]]) -> str:
    if settings is None:
        return "-"
    return (
        f"root {settings['root']} ({settings['root_source']}), publish {settings['publish']}, "
        f"fsync {'on' if settings['fsync'] else 'off'}, "
        f"background {settings['background'] or 'off'}, "
        f"local disk {'unstaged' if settings['skip_local_disk'] else 'staged'}, "
        f"torch.save {'staged' if settings['torch_save'] else 'not staged'}"
    )


def _activation_text(report: Mapping[str, Any]) -> str:
    if report["error"] and report["settings"] is not None:
        return "no: the staging root is unusable (error below); saves would run unstaged"
    if report["error"]:
        return "unknown (configuration error below)"
    if not report["would_activate"]:
        return (
            "no (set SAFESTAGE=1 or SAFESTAGE_DIR to stage every save; SAFESTAGE=0 switches it off)"
        )
    if not report["hook"]["installed"]:
        return "yes, but the start-up hook is not installed: only code calling safestage.staged() stages"
    if report["settings"]["torch_save"]:
        return "yes: every safetensors save and torch.save to a path in a new Python process is staged"
    return "yes: every safetensors save in a new Python process is staged"


# -- verify, latest ----------------------------------------------------------------------------


def _verify(args: argparse.Namespace) -> int:
    from ..checkpoint._verify import verify

    with _progress_bar(enabled=args.deep and not args.json) as progress:
        result = verify(args.path, deep=args.deep, progress=progress)
    if args.json:
        _print_json(result.to_json())
        return 0 if result.complete else 1
    manifest = result.manifest
    if result.complete and manifest is not None:
        checked = f", {result.bytes_read} bytes read back, digests match" if args.deep else ""
        writer = manifest.writer or {}
        print(
            f"{args.path}: complete: {len(manifest.files)} files, {manifest.total_bytes} bytes"
            f"{checked}; committed {manifest.committed_at} by {writer.get('host', '?')} pid "
            f"{writer.get('pid', '?')}"
        )
        if result.set_aside is not None:
            print(f"  but {result.set_aside.describe()}: latest_complete never names it (delete it, or "
                  "re-commit this step, if that run was the one to keep)")  # fmt: skip
    else:
        print(f"{args.path}: NOT complete")
        for problem in result.problems:
            print(f"  - {problem.path or '.'}: {problem.kind}: {problem.message}")
    if args.deep and result.extra:
        print(f"  not in the commit file (ignored): {', '.join(result.extra)}")
    return 0 if result.complete else 1


@contextmanager
def _progress_bar(*, enabled: bool) -> Iterator[Optional[Callable[[int, int], None]]]:
    """A tqdm bar of bytes on stderr for long work, only when both streams are a terminal:
    a pipe, a log file or ``$(...)`` gets no progress lines."""
    if not (enabled and sys.stderr.isatty() and sys.stdout.isatty()):
        yield None
        return
    from tqdm import tqdm

    bar: Optional[Any] = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="reading", leave=False)
        bar.update(done - bar.n)

    try:
        yield update
    finally:
        if bar is not None:
            bar.close()


def _latest(args: argparse.Namespace) -> int:
    from ..checkpoint._verify import find_latest

    error = _existing_directory("latest", args.parent)
    if error is not None:
        return error
    try:
        found, skipped = find_latest(args.parent, args.pattern, deep=args.deep)
    except OSError as exc:
        # Not 1 ("no complete checkpoint"): a resume script must not start from scratch
        # because a FUSE readdir failed or permissions are wrong.
        print(f"safestage latest: could not look: {_said(exc)}", file=sys.stderr)
        return LATEST_COULD_NOT_LOOK
    for path, why in skipped:
        print(f"safestage latest: WARNING: skipped {path}, which could not be read ({why})", file=sys.stderr)
    if found is None:
        if skipped:
            print(
                f"safestage latest: could not look: no readable complete checkpoint matching "
                f"{args.pattern!r} in {args.parent}, and {len(skipped)} could not be read",
                file=sys.stderr,
            )
            return LATEST_COULD_NOT_LOOK
        print(f"safestage latest: no complete checkpoint matching {args.pattern!r} in {args.parent}"
              + _what_else(args.parent, args.pattern), file=sys.stderr)  # fmt: skip
        return 1
    print(found)
    return 0


# `safestage fetch`: 0 fetched (the path printed), 1 no complete checkpoint, 2 usage, 3 failed.
FETCH_FAILED = 3


def _fetch(args: argparse.Namespace) -> int:
    from ..checkpoint._fetch import NothingCommitted, fetch_checkpoint

    try:
        fetched = fetch_checkpoint(args.url, args.local_dir, pattern=args.pattern)
    except ConfigError as exc:
        print(f"safestage fetch: {exc}", file=sys.stderr)
        return 2
    except NothingCommitted as exc:
        print(f"safestage fetch: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        # Not 1: a resume script must not start from scratch because a download failed.
        print(f"safestage fetch: {exc}", file=sys.stderr)
        return FETCH_FAILED
    print(f"safestage fetch: {fetched.source} -> {fetched.path}: {fetched.files} files, "
          f"{fetched.nbytes} bytes downloaded, {fetched.kept} already there, in "
          f"{fetched.seconds:.1f} s", file=sys.stderr)  # fmt: skip
    print(fetched.path)
    return 0


def _said(exc: OSError) -> str:
    """What an OSError says: safestage's own (a StoreError names the URL, the request and the
    store's answer) whole; another's strerror, which its raiser made the message."""
    from .._errors import SafestageError

    return str(exc) if isinstance(exc, SafestageError) else str(exc.strerror)


def _what_else(parent: Destination, pattern: str) -> str:
    """What a `latest` that found nothing did see: the committed directories whose names the
    pattern does not take, and a pattern that would (the DCP docs name them step-*)."""
    from .. import _object_store
    from ..checkpoint._manifest import COMMIT_NAME
    from ..checkpoint._timeline import series
    from ..checkpoint._verify import matcher, read_commit

    takes = matcher(pattern)
    try:
        if isinstance(parent, Path):
            names = sorted(os.listdir(parent))
            others = [name for name in names if takes(name) is None and read_commit(parent / name)[0] is not None]
        else:  # a run URL: the prefixes holding a commit object (one more LIST, after a failure)
            start = len(parent.prefix)
            committed = {name for name, _, rest in (info.key[start:].partition("/") for info in
                         _object_store.listing(parent)) if rest == COMMIT_NAME}  # fmt: skip
            others = sorted(name for name in committed if takes(name) is None)
    except OSError:
        return ""
    if not others:
        return ""
    shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
    suggestions = []
    for name in others:
        parts = series(name)
        if parts is not None and f"{parts[0]}*{parts[1]}" not in suggestions:
            suggestions.append(f"{parts[0]}*{parts[1]}")
    hint = f" (try --pattern {suggestions[0]!r})" if suggestions else ""
    return f"; it holds committed directories the pattern does not take: {shown}{hint}"


def _prune(args: argparse.Namespace) -> int:
    from ..checkpoint._prune import apply, known_roots, plan

    error = _existing_directory("prune", args.parent)
    if error is not None:
        return error
    try:
        decisions = plan(args.parent, args.keep, args.pattern, roots=known_roots(args.dir))
    except OSError as exc:
        print(f"safestage prune: could not look: {_said(exc)}", file=sys.stderr)
        return LATEST_COULD_NOT_LOOK
    for decision in decisions:
        if decision.action == "keep" and not decision.routine:
            _print_line(f"kept          {decision.path}  ({decision.reason})")
    removing = [decision for decision in reversed(decisions) if decision.action == "remove"]
    failed = None
    done = partly = 0
    for decision in removing:
        try:
            whole = apply([decision], dry_run=args.dry_run) or args.dry_run
        except OSError as exc:
            failed = exc
            break
        word = "would remove" if args.dry_run else "removed" if whole else "partly"
        _print_line(f"{word:<12}  {decision.path}  ({decision.reason}"
                    f"{'' if whole else '; an upload in flight below it stays, said above'})")  # fmt: skip
        done += bool(whole)
        partly += not whole
    if failed is not None:
        print(f"safestage prune: {_said(failed)}", file=sys.stderr)
        return 1
    _print_line(
        f"{done} {'would be removed' if args.dry_run else 'removed'}, "
        f"{f'{partly} partly removed, ' if partly else ''}{len(decisions) - done - partly} kept "
        f"(checkpoints matching {args.pattern!r} in {args.parent})"
    )
    return 0


# -- clean -------------------------------------------------------------------------------------


def _clean(args: argparse.Namespace) -> int:
    from .._clean import KINDS, clean

    error = _existing_directory("clean", args.path)
    if error is not None:
        return error
    try:
        entries = clean(args.path, dry_run=args.dry_run, older_than=args.older_than, recursive=True)
    except OSError as exc:
        print(f"safestage clean: cannot list {args.path}: [Errno {exc.errno}] {exc.strerror}", file=sys.stderr)
        return 1
    counts = {
        action: sum(e.action == action for e in entries)
        for action in ("removed", "would-remove", "kept", "failed")
    }
    if args.json:
        _print_json(
            {
                "path": str(Path(os.path.abspath(args.path))),
                "dry_run": args.dry_run,
                "entries": [entry.to_json() for entry in entries],
                **{action.replace("-", "_"): count for action, count in counts.items()},
            }
        )
    else:
        if entries:
            _table(
                [
                    (entry.action, f"{entry.name}  {KINDS[entry.kind]}: {entry.reason}"
                     + (f" (a copy for {entry.destination})"
                        if entry.destination and entry.destination not in entry.reason else ""))
                    for entry in entries
                ],
                indent="",
            )
        summary = ", ".join(
            f"{count} {action}"
            for action, count in counts.items()
            if count or action in ("removed", "kept")
        )
        _print_line(f"{summary} (safestage leftovers in {args.path}; nothing else is touched)")
    return 1 if counts["failed"] else 0


# -- recover -----------------------------------------------------------------------------------


def _recover(args: argparse.Namespace) -> int:
    from .._errors import StagingError
    from ..checkpoint._recover import ACTIONS, discard_copy, recover

    if args.discard is not None:
        if args.root is not None or args.dest is not None or args.dry_run:
            return _usage_error("recover", "--discard COPY takes no ROOT, --dest or --dry-run")
        why = discard_copy(args.discard)
        if why is not None:
            print(f"safestage recover: did not discard {args.discard}: {why}", file=sys.stderr)
            return 1
        _print_line(f"discarded {args.discard}")
        return 0
    try:
        results = recover(args.root, dry_run=args.dry_run, dest=args.dest)
    except ConfigError as exc:
        return _usage_error("recover", str(exc))
    except StagingError as exc:  # the root is missing, unreadable, not a usable staging root
        print(f"safestage recover: {exc}", file=sys.stderr)
        return RECOVER_COULD_NOT_READ
    counts = {action: sum(result.action == action for result in results) for action in ACTIONS}
    status = 1 if counts["refused"] or counts["failed"] else 0
    if args.json:
        _print_json({
            "dry_run": args.dry_run,
            "entries": [result.to_json() for result in results],
            **{action.replace("-", "_"): count for action, count in counts.items()},
        })  # fmt: skip
        return status
    for result in results:
        _print_line(f"{result.action}  {result.local} -> {result.destination or '?'}: {result.reason}")
        if result.job is not None:
            _print_line(f"    kept by {result.job}")
    summary = ", ".join(f"{count} {action}" for action, count in counts.items() if count)
    _print_line(f"{summary or 'no kept copy'} (kept copies in {args.root or 'the staging root'})")
    return status
