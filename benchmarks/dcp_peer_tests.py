"""PyTorch's own DCP tests with the switch on (issue 25): the file-system save/load tests of
``test/distributed/checkpoint`` that run on CPU with gloo, run with pytest (one file at a time,
each under ``--timeout``), compared test by test:

1. plain: no safestage variable, temporary directories on local disk;
2. switched, once per kit mode: ``SAFESTAGE_DIR`` set (the start-up hook stages every process,
   the spawned ranks of ``MultiProcessTestCase`` included), and every temporary *directory* the
   tests make (``tempfile.mkdtemp``, ``TemporaryDirectory``, ``with_temp_dir``: where they save)
   on a kit mount; temporary files (the file store the ranks rendezvous through) stay local.

PyTorch's test files are not part of safestage: give their directory (a checkout's
``test/distributed/checkpoint``, at the tag of the installed torch) in
``SAFESTAGE_PYTORCH_TESTS`` (or ``--tests``), and ``expecttest`` and ``zstandard`` installed
(``torch.testing._internal.common_utils`` imports the first, the ``ZStandard`` tests the second).

    SAFESTAGE_PYTORCH_TESTS=~/pytorch/test/distributed/checkpoint \\
        PYTHONPATH=. .venv/bin/python benchmarks/dcp_peer_tests.py [--mounts mountpoint hdfs] \\
        [--files test_file_system_checkpoint_cpu.py ...]

Prints and writes ``benchmarks/results/<date>-dcp-peer-tests.{json,md}``: each test's outcome
per run (and why, where it did not pass), the tests whose outcome differs from the plain run,
and the switched runs' checkpoints (how many directories the tests left hold a commit file, and
that each of them verifies).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
FILES = ["test_file_system_checkpoint_cpu.py", "test_format_utils.py"]

# Loaded by every Python process of the switched run (PYTHONPATH): temporary directories go to
# the mount named by the variable, and each one made is listed, for the count at the end.
SITECUSTOMIZE = '''
import os, tempfile
_mount = os.environ.get("DCP_PEER_TMP_DIRS")
if _mount:
    _mkdtemp = tempfile.mkdtemp
    def mkdtemp(suffix=None, prefix=None, dir=None):
        path = _mkdtemp(suffix, prefix, _mount if dir is None else dir)
        with open(os.environ["DCP_PEER_TMP_LOG"], "a") as log:
            log.write(path + "\\n")
        return path
    tempfile.mkdtemp = mkdtemp
'''


def run(files: list[Path], env: dict[str, str], junit: Path, timeout: float) -> tuple[dict[str, str], dict[str, str], float, str]:
    """pytest over each of ``files`` in turn, each within ``timeout`` seconds (its process group
    killed past that): ({file::class::test: passed | failed | error | skipped}, {test: why, for
    the ones not passed}, seconds, output tail)."""
    started = time.monotonic()
    outcomes: dict[str, str] = {}
    reasons: dict[str, str] = {}
    tails = []
    for path in files:
        xml = junit.with_name(f"{junit.stem}-{path.stem}.xml")
        proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", str(path)],
            env=env, cwd=path.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)  # the ranks MultiProcessTestCase spawned too
            out, _ = proc.communicate()
            outcomes[f"{path.stem}::*"] = "timeout"
            reasons[f"{path.stem}::*"] = f"pytest still running after {timeout:.0f} s, killed"
        tails.append(f"== {path.name}: rc {proc.returncode}\n{out[-3000:]}")
        if not xml.exists():
            continue
        for case in ElementTree.parse(xml).iter("testcase"):
            name = f"{path.stem}::{case.get('classname', '').rpartition('.')[2]}::{case.get('name')}"
            child = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
            tag = "passed" if child is None else child.tag
            outcomes[name] = {"failure": "failed"}.get(tag, tag)
            if child is not None:
                text = child.get("message") or (child.text or "")
                reasons[name] = " ".join(text.split())[:300]
    return outcomes, reasons, time.monotonic() - started, "\n".join(tails)[-8000:]


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SAFESTAGE")}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tests", default=os.environ.get("SAFESTAGE_PYTORCH_TESTS"),
                        help="PyTorch's test/distributed/checkpoint directory (default $SAFESTAGE_PYTORCH_TESTS)")
    parser.add_argument("--files", nargs="+", default=FILES)
    parser.add_argument("--mounts", nargs="+", default=["mountpoint", "hdfs"], help="kit modes of the switched runs")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per test file and run")
    parser.add_argument("--out", default=f"{_dt.date.today().isoformat()}-dcp-peer-tests")
    args = parser.parse_args()
    if not args.tests:
        parser.error("give PyTorch's test/distributed/checkpoint directory: --tests or SAFESTAGE_PYTORCH_TESTS")
    files = [Path(args.tests).expanduser() / name for name in args.files]
    missing = [str(path) for path in files if not path.is_file()]
    if missing:
        parser.error(f"not found: {', '.join(missing)}")

    import torch

    sys.path.insert(0, str(REPO))
    import safestage
    from safestage.testing import hostile_mount

    work = Path(tempfile.mkdtemp(prefix="dcp-peer-"))
    custom = work / "site"
    custom.mkdir()
    (custom / "sitecustomize.py").write_text(SITECUSTOMIZE)
    runs: dict[str, dict[str, object]] = {}
    print(f"torch {torch.__version__}; tests {args.tests}: {', '.join(args.files)}", flush=True)
    outcomes, reasons, seconds, tail = run(files, clean_env(), work / "plain.xml", args.timeout)
    runs["plain"] = {"outcomes": outcomes, "reasons": reasons, "seconds": round(seconds, 1), "tail": tail}
    print(f"plain: {seconds:.0f} s, {sum(v == 'passed' for v in outcomes.values())}/{len(outcomes)} passed", flush=True)
    for mode in args.mounts:
        root, log = work / f"root-{mode}", work / f"dirs-{mode}.txt"
        root.mkdir()
        with hostile_mount(mode, work / f"mnt-{mode}") as mount:
            tmp_dirs = Path(mount.path) / "tmp"
            tmp_dirs.mkdir()
            env = clean_env()
            env.update(SAFESTAGE_DIR=str(root), DCP_PEER_TMP_DIRS=str(tmp_dirs), DCP_PEER_TMP_LOG=str(log),
                       PYTHONPATH=os.pathsep.join([str(custom), str(REPO), env.get("PYTHONPATH", "")]))  # fmt: skip
            outcomes, reasons, seconds, tail = run(files, env, work / f"{mode}.xml", args.timeout)
            made = [Path(line) for line in log.read_text().split()] if log.exists() else []
            committed = [path for path in made if (path / safestage.COMMIT_NAME).exists()]
            complete = [path for path in committed if safestage.verify(path, deep=True).complete]
            kept = [str(path) for path in root.rglob("safestage-kept.json")]
        runs[mode] = {"outcomes": outcomes, "reasons": reasons, "seconds": round(seconds, 1), "tail": tail, "dirs_made": len(made),
                      "dirs_left": sum(path.exists() for path in made), "committed": len(committed),
                      "committed_complete": len(complete), "kept_copies": kept}  # fmt: skip
        print(f"{mode}: {seconds:.0f} s, {sum(v == 'passed' for v in outcomes.values())}/{len(outcomes)} passed; "
              f"{len(made)} temp dirs made, {len(committed)} of those left hold a commit file "
              f"({len(complete)} verify complete), {len(kept)} kept copies", flush=True)  # fmt: skip
    plain = runs["plain"]["outcomes"]
    assert isinstance(plain, dict)
    differ = {
        mode: {name: (plain.get(name), run_["outcomes"].get(name)) for name in set(plain) | set(run_["outcomes"])  # type: ignore[arg-type]
               if plain.get(name) != run_["outcomes"].get(name)}  # type: ignore[attr-defined]
        for mode, run_ in runs.items() if mode != "plain"
    }  # fmt: skip
    result = {"torch": torch.__version__, "files": args.files, "runs": runs, "differ": differ}
    out = HERE / "results" / args.out
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    lines = [f"# PyTorch's DCP tests with the switch on ({_dt.date.today().isoformat()})", "",
             f"torch {torch.__version__}; files: {', '.join(args.files)}", "",
             "| test | plain (local disk) | " + " | ".join(f"switch, temp dirs on kit {m}" for m in args.mounts) + " |",
             "|---|---|" + "---|" * len(args.mounts)]  # fmt: skip
    names = sorted(set(plain).union(*(runs[m]["outcomes"] for m in args.mounts)))  # type: ignore[arg-type]
    for name in names:
        lines.append(f"| `{name}` | {plain.get(name)} | " + " | ".join(str(runs[m]["outcomes"].get(name)) for m in args.mounts) + " |")  # type: ignore[attr-defined]
    lines.append("")
    for mode in args.mounts:
        r = runs[mode]
        lines.append(f"- {mode}: {r['seconds']} s (plain {runs['plain']['seconds']} s); {r['dirs_made']} temporary "
                     f"directories made, {r['committed']} of those left hold a commit file, {r['committed_complete']} "
                     f"verify complete (deep); kept copies: {len(r['kept_copies'])}; differ from plain: "
                     f"{len(differ[mode]) or 'none'}")  # fmt: skip
        for name, (was, now) in sorted(differ[mode].items()):
            why = r["reasons"].get(name) or runs["plain"]["reasons"].get(name, "")  # type: ignore[attr-defined]
            lines.append(f"  - `{name}`: plain {was}, {mode} {now}: {why}")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
