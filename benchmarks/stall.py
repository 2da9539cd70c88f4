"""The stall benchmark (issue 20): how long a training loop is blocked by each checkpoint, and
how long until ``latest_complete`` returns it, for each way of saving a ~1 GiB state.

    PYTHONPATH=. /work/main/.venv/bin/python benchmarks/stall.py            # 9-13 min on 2 shared cores
    PYTHONPATH=. /work/main/.venv/bin/python benchmarks/stall.py --quick    # smoke run, ~2 min

Writes benchmarks/results/<date>-stall.{json,md} (``-quick`` appended for a smoke run) and, for
a full run, rewrites the table between the ``stall`` markers of benchmarks/README.md.

The state: 5 ``nn.Linear(4096, 4096)`` in fp32 and their Adam moments after a real optimizer
step (0.94 GiB: weights 320 MiB, ``exp_avg`` + ``exp_avg_sq`` 640 MiB). The loop runs steps of
``--step-seconds`` wall time (default 0.5 s); a step changes the state in place (one weight
row and its moments) and idles for the rest of the step, as the host CPU does while an
accelerator computes. A real CPU step of this model takes 3-10 s on these 2 shared cores and
would starve the FUSE server and the publisher; ``--real-steps`` runs one anyway (forward,
backward, Adam) with no idling. The loop checkpoints every K steps, K chosen so that the
interval is 1.3x the mount's durable baseline (below): a background save then has time to
land before the next one is due.

Checkpoint formats: ``files`` (``model.safetensors`` by safetensors 0.8 ``save_file``,
``optimizer.pt`` by ``torch.save``, ``trainer_state.json``) and ``dcp`` (DCP's ``.distcp`` +
``.metadata``). Destinations: kit ``slow`` paced at 100 MB/s and kit ``hdfs`` (ftruncate
ENOSYS), backing in /dev/shm; the staging root is /dev/shm. Ways of saving:

  plain          ``files`` written straight into the mount (no commit file)
  plain-torch    hdfs only (plain fails there): the same with ``torch.save`` for the model too
  staged-sync    ``safestage.staged_dir(dest, root)``
  staged-bg      ``safestage.staged_dir(dest, root, background=True)``
  dcp-staged     ``dcp.async_save(sd, storage_writer=safestage.dcp.StagedWriter(dest, root))``
  dcp-fs         ``dcp.async_save(sd, storage_writer=FileSystemWriter(dest))`` (no commit file)

Per checkpoint: **blocked**, the seconds the loop spends in the checkpoint call, waiting for
the previous background save included (a save in flight is waited for before the next, as
DCP's docs and staged_dir do); **durable**, the seconds from the start of the save until a
separate poller process (``latest_complete(run_dir)`` every 50 ms) first returns it. For the
two ways without a commit file ``latest_complete`` never returns it; their figure is the time
the writer finished (plain: the call returned; dcp-fs: the future completed), marked so.

Baselines in the same run and the same process, on the same tensors: **local**, writing the
checkpoint into a fresh directory of the staging root alone (repeated before every way, so
its samples span the run), and **copy**, copying that local checkpoint onto the mount with a
plain read/write loop (4 MiB chunks, fsync per file, 2 files at once as a staged_dir commit).
Targets: blocked <= 1.1x local; durable <= 1.1x (local + copy), per format.

Old checkpoints are removed from the mount's backing directory (behind the FUSE server, so
it costs the mount nothing) once a newer one is done, so the backing holds at most two.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import errno
import faulthandler
import json
import logging
import math
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
README = HERE / "README.md"
MiB = 1 << 20
CHUNK = 4 * MiB
STREAMS = 2  # files a staged_dir commit publishes at once
POLL_S = 0.05
HANG_S = 300.0  # one save not done after this long is reported as a hang
START, END = "<!-- stall:start -->", "<!-- stall:end -->"

sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from checkpoint import _copy_one  # noqa: E402  # the plain copy every benchmark's ceiling uses

import safestage  # noqa: E402

# The poller: a process of its own, so that its listing and reads never hold the loop's GIL.
POLLER = r"""
import sys, time, safestage
run, interval = sys.argv[1], float(sys.argv[2])
last = None
while True:
    try:
        found = safestage.latest_complete(run)
    except OSError as exc:
        print("error", repr(exc), flush=True)
        found = None
    now = time.monotonic()
    if found is not None and found.name != last:
        last = found.name
        print("seen", found.name, repr(now), flush=True)
    time.sleep(interval)
"""


class Poller:
    """``latest_complete(run_dir)`` in a child process; records when each name first appears
    (CLOCK_MONOTONIC is system-wide, so the child's times compare with ours)."""

    def __init__(self, run_dir: Path) -> None:
        env = dict(os.environ, PYTHONPATH=str(HERE.parent))
        self.process = subprocess.Popen(
            [sys.executable, "-c", POLLER, str(run_dir), str(POLL_S)],
            stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        self.seen: dict[str, float] = {}
        self.errors: list[str] = []
        self._condition = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            kind, _, rest = line.strip().partition(" ")
            with self._condition:
                if kind == "seen":
                    name, _, when = rest.partition(" ")
                    self.seen.setdefault(name, float(when))
                else:
                    self.errors.append(rest)
                self._condition.notify_all()

    def wait_for(self, name: str, timeout: float) -> Optional[float]:
        with self._condition:
            self._condition.wait_for(lambda: name in self.seen, timeout)
            return self.seen.get(name)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)


# -- the state and the loop ------------------------------------------------------------------------


class Trainer:
    def __init__(self, layers: int, width: int, real_steps: bool) -> None:
        import torch
        from torch import nn

        torch.manual_seed(0)
        self.torch = torch
        self.model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.real_steps = real_steps
        self.x = torch.randn(8, width)
        self._real_step()  # Adam's moments exist from the first step on
        if not real_steps:
            for parameter in self.model.parameters():
                parameter.grad = None
        self.step = 0
        self.last_write_s: Optional[float] = None

    def _real_step(self) -> None:
        loss = self.model(self.x).pow(2).mean()
        self.optimizer.zero_grad(set_to_none=False)
        loss.backward()
        self.optimizer.step()

    def train_step(self, seconds: float) -> None:
        started = time.monotonic()
        self.step += 1
        if self.real_steps:
            self._real_step()
            return
        with self.torch.no_grad():  # the step changes the state: one row of a weight and its moments
            weights = [m.weight for m in self.model]
            weight = weights[self.step % len(weights)]
            row = self.step % weight.shape[0]
            weight[row].add_(1e-3)
            state = self.optimizer.state[weight]
            state["exp_avg"][row].mul_(0.9)
            state["exp_avg_sq"][row].mul_(0.999)
        left = seconds - (time.monotonic() - started)
        if left > 0:
            time.sleep(left)

    def state_bytes(self) -> int:
        total = sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
        for state in self.optimizer.state.values():
            total += sum(t.numel() * t.element_size() for t in state.values() if self.torch.is_tensor(t))
        return total

    def write_files(self, directory: Path, *, torch_only: bool = False) -> None:
        from safetensors.torch import save_file

        started = time.monotonic()
        if torch_only:
            self.torch.save(self.model.state_dict(), directory / "model.pt")
        else:
            save_file(self.model.state_dict(), str(directory / "model.safetensors"))
        self.torch.save(self.optimizer.state_dict(), directory / "optimizer.pt")
        (directory / "trainer_state.json").write_text(json.dumps({"global_step": self.step}))
        self.last_write_s = time.monotonic() - started

    def dcp_state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict(),
                "trainer": {"global_step": self.step}}  # fmt: skip


# -- the ways of saving ----------------------------------------------------------------------------


class Pending:
    """A save still running after the checkpoint call returned; ``finished`` its end time."""

    def __init__(self, wait: Callable[[float], None], done: Callable[[], bool]) -> None:
        self.wait, self.done = wait, done
        self.finished: Optional[float] = None


def _future_pending(future: Any) -> Pending:
    pending = Pending(lambda timeout: future.result(timeout=timeout), future.done)

    def landed(_: Any) -> None:
        pending.finished = time.monotonic()

    future.add_done_callback(landed)
    return pending


def _handle_pending(handle: Any) -> Pending:
    def wait(timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not handle.done():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the background commit of {handle.dest} is not done after {timeout:.0f} s")
            time.sleep(0.01)
        handle.wait()

    return Pending(wait, handle.done)


WAYS: dict[str, dict[str, Any]] = {
    "plain": {"format": "files", "committed": False, "what": "save_file + torch.save straight into the mount"},
    "plain-torch": {"format": "files", "committed": False, "what": "torch.save (model and optimizer) straight into the mount"},
    "staged-sync": {"format": "files", "committed": True, "what": "staged_dir(dest, root)"},
    "staged-bg": {"format": "files", "committed": True, "what": "staged_dir(dest, root, background=True)"},
    "dcp-staged": {"format": "dcp", "committed": True, "what": "dcp.async_save + safestage.dcp.StagedWriter"},
    "dcp-fs": {"format": "dcp", "committed": False, "what": "dcp.async_save + FileSystemWriter"},
}  # fmt: skip


def save(way: str, trainer: Trainer, dest: Path, root: Path) -> Optional[Pending]:
    """The checkpoint call of ``way``: what the loop waits for. Returns what goes on after."""
    if way in ("plain", "plain-torch"):
        dest.mkdir()
        trainer.write_files(dest, torch_only=way == "plain-torch")
        return None
    if way == "staged-sync":
        with safestage.staged_dir(dest, root) as local:
            trainer.write_files(local)
        return None
    if way == "staged-bg":
        handle = safestage.staged_dir(dest, root, background=True)
        with handle as local:
            trainer.write_files(local)
        return _handle_pending(handle)
    import torch.distributed.checkpoint as dcp

    if way == "dcp-staged":
        from safestage.dcp import StagedWriter

        return _future_pending(dcp.async_save(trainer.dcp_state(), storage_writer=StagedWriter(dest, root)))
    if way == "dcp-fs":
        from torch.distributed.checkpoint import FileSystemWriter

        return _future_pending(dcp.async_save(trainer.dcp_state(), storage_writer=FileSystemWriter(dest)))
    raise ValueError(way)


def write_local(fmt: str, trainer: Trainer, directory: Path) -> None:
    if fmt == "files":
        directory.mkdir()
        trainer.write_files(directory)
    else:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemWriter

        dcp.save(trainer.dcp_state(), storage_writer=FileSystemWriter(directory))


# -- baselines -------------------------------------------------------------------------------------


def copy_dir(source: Path, dest: Path) -> float:
    dest.mkdir()
    files = sorted(source.iterdir(), key=lambda p: -p.stat().st_size)
    started = time.monotonic()
    with ThreadPoolExecutor(STREAMS) as pool:
        list(pool.map(lambda p: _copy_one(p, dest / p.name), files))
    return time.monotonic() - started


def dir_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())


def time_local(fmt: str, trainer: Trainer, base: Path, label: str) -> tuple[float, Path]:
    directory = base / f"local-{fmt}-{label}"
    os.sync()
    started = time.monotonic()
    write_local(fmt, trainer, directory)
    return time.monotonic() - started, directory


# -- one way on one mount --------------------------------------------------------------------------


def _error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}"
    if isinstance(exc, OSError) and exc.errno is not None:
        text += f" [{errno.errorcode.get(exc.errno, exc.errno)}]"
    message = str(exc).strip().splitlines()
    return f"{text}: {message[0][:400] if message else ''}"


def _listing(directory: Path) -> list[str]:
    try:
        return sorted(f"{p.relative_to(directory)} ({p.stat().st_size} B)" for p in directory.rglob("*") if p.is_file())
    except OSError as exc:
        return [f"cannot list: {exc}"]


def _prune(backing_run: Path, before_step: int) -> None:
    """Remove, in the backing directory, the checkpoints older than ``before_step``."""
    if not backing_run.is_dir():
        return
    for entry in backing_run.iterdir():
        step = entry.name.rpartition("-")[2]
        if step.isdigit() and int(step) < before_step:
            shutil.rmtree(entry, ignore_errors=True)


def _peak_rss_reset() -> None:
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux >= 4.0)


def _peak_rss_mib() -> Optional[float]:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return None


def run_way(
    way: str, trainer: Trainer, mount_path: Path, backing: Path, root: Path, *, checkpoints: int,
    interval_steps: int, step_s: float,
) -> dict[str, Any]:  # fmt: skip
    run_dir, backing_run = mount_path / way, backing / way
    run_dir.mkdir()
    committed = WAYS[way]["committed"]
    poller = Poller(run_dir)  # every way: a way without a commit file must stay invisible
    records: list[dict[str, Any]] = []
    result: dict[str, Any] = {"way": way, **WAYS[way], "interval_steps": interval_steps, "records": records}
    previous: Optional[Pending] = None
    previous_step = 0
    cpu_before = _cpu_seconds()
    _peak_rss_reset()
    result["load_average_at_start"] = os.getloadavg()
    started_way = time.monotonic()
    try:
        for _ in range(checkpoints):
            for _ in range(interval_steps):
                trainer.train_step(step_s)
            name = f"checkpoint-{trainer.step}"
            t0 = time.monotonic()
            if previous is not None:
                previous.wait(HANG_S)
            t_waited = time.monotonic()
            _prune(backing_run, previous_step)
            t1 = time.monotonic()
            trainer.last_write_s = None
            try:
                pending = save(way, trainer, run_dir / name, root)
            except Exception as exc:
                result["error"] = _error_text(exc)
                result["left_at_destination"] = _listing(run_dir / name)
                print(f"    {way} {name}: FAILED {result['error']}", flush=True)
                break
            t2 = time.monotonic()
            records.append({"name": name, "step": trainer.step, "started": t1, "returned": t2,
                            "waited_s": t_waited - t0, "blocked_s": (t_waited - t0) + (t2 - t1),
                            "write_s": trainer.last_write_s, "pending": pending})  # fmt: skip
            print(f"    {way} {name}: blocked {records[-1]['blocked_s']:.2f} s", flush=True)
            previous, previous_step = pending, trainer.step
        # The loop goes on while the last save lands, then waits for it.
        if records:
            last = records[-1]
            for _ in range(interval_steps):
                if last["pending"] is None or last["pending"].done():
                    break
                trainer.train_step(step_s)
            if last["pending"] is not None:
                last["pending"].wait(HANG_S)
            if committed:
                poller.wait_for(last["name"], 60.0)
            else:
                time.sleep(4 * POLL_S)  # the poller has had time to see it, if it could
    except TimeoutError as exc:
        result["error"] = f"hang: {exc}"
        faulthandler.dump_traceback(all_threads=True)
    except Exception as exc:  # a background save failed: raised by wait()
        result["error"] = _error_text(exc)
    finally:
        poller.stop()
    result["seconds"] = time.monotonic() - started_way
    result["cpu_s"] = _cpu_seconds() - cpu_before
    result["peak_rss_mib"] = _peak_rss_mib()
    result["load_average_at_end"] = os.getloadavg()
    result["poller_errors"] = poller.errors[:5]
    result["poller_saw"] = sorted(poller.seen)
    for record in records:
        pending = record.pop("pending")
        if committed:
            seen = poller.seen.get(record["name"])
            record["durable_s"] = None if seen is None else seen - record["started"]
        else:
            end = record["returned"] if pending is None else pending.finished
            record["durable_s"] = None if end is None else end - record["started"]
            record["latest_complete_saw_it"] = record["name"] in poller.seen
        record.pop("started"), record.pop("returned")
    if committed and records:
        last = run_dir / records[-1]["name"]
        check = safestage.verify(last)
        result["last_verified"] = {"complete": check.complete, "problems": [str(p) for p in check.problems][:3]}
        if WAYS[way]["format"] == "files" and check.complete:
            result["last_step_in_checkpoint"] = json.loads((last / "trainer_state.json").read_text())["global_step"]
    return result


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


def _summary(values: list[float]) -> Optional[dict[str, float]]:
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


# -- one mount -------------------------------------------------------------------------------------


def bench_mount(
    kit: str, mbps: Optional[float], trainer: Trainer, shm: Path, root: Path, args: argparse.Namespace, seed: int
) -> dict[str, Any]:
    from safestage.testing import hostile_mount

    out: dict[str, Any] = {"mount": kit, "mbps": mbps, "load_average_at_start": os.getloadavg()}
    local_runs: dict[str, list[float]] = {"files": [], "dcp": []}
    copy_runs: dict[str, list[float]] = {"files": [], "dcp": []}
    sizes: dict[str, int] = {}
    base = shm / f"baseline-{kit}"
    base.mkdir()
    with hostile_mount(kit, shm / f"mnt-{kit}", mbps=mbps, backing=shm / f"backing-{kit}") as mount:
        mount_path, backing = Path(mount.path), Path(mount.backing)
        (mount_path / "baseline").mkdir()
        for repeat in range(args.copy_repeats):
            for fmt in ("files", "dcp"):
                seconds, local = time_local(fmt, trainer, base, f"c{repeat}")
                local_runs[fmt].append(seconds)
                sizes[fmt] = dir_bytes(local)
                os.sync()
                copy_runs[fmt].append(copy_dir(local, mount_path / "baseline" / f"{fmt}-{repeat}"))
                shutil.rmtree(backing / "baseline" / f"{fmt}-{repeat}")
                shutil.rmtree(local)
                print(f"  {kit} baseline {fmt}: local {seconds:.2f} s, copy {copy_runs[fmt][-1]:.2f} s", flush=True)
        durable_base = max(statistics.median(local_runs[f]) + statistics.median(copy_runs[f]) for f in local_runs)
        interval_steps = max(2, math.ceil(1.3 * durable_base / args.step_seconds))
        out["interval_steps"] = interval_steps
        ways = ["plain", "staged-sync", "staged-bg", "dcp-staged", "dcp-fs"] + (["plain-torch"] if kit == "hdfs" else [])
        random.Random(seed).shuffle(ways)
        out["order"] = ways
        out["ways"] = {}
        for index, way in enumerate(ways):
            for fmt in ("files", "dcp"):  # a local sample before every way: they span the run
                seconds, local = time_local(fmt, trainer, base, f"w{index}")
                local_runs[fmt].append(seconds)
                shutil.rmtree(local)
            print(f"  {kit} {way} (every {interval_steps} steps) ...", flush=True)
            out["ways"][way] = run_way(
                way, trainer, mount_path, backing, root, checkpoints=args.checkpoints,
                interval_steps=interval_steps, step_s=args.step_seconds,
            )  # fmt: skip
            shutil.rmtree(backing / way, ignore_errors=True)
    shutil.rmtree(base, ignore_errors=True)
    out["baseline"] = {
        fmt: {"local_s": _summary(local_runs[fmt]), "copy_s": _summary(copy_runs[fmt]),
              "local_runs": local_runs[fmt], "copy_runs": copy_runs[fmt], "bytes": sizes[fmt]}
        for fmt in local_runs
    }  # fmt: skip
    for result in out["ways"].values():
        fmt = result["format"]
        local = out["baseline"][fmt]["local_s"]["median"]
        copy = out["baseline"][fmt]["copy_s"]["median"]
        blocked = _summary([r["blocked_s"] for r in result["records"]])
        durable_values = [r["durable_s"] for r in result["records"] if r["durable_s"] is not None]
        durable = _summary(durable_values)
        result["blocked_s"], result["durable_s"] = blocked, durable
        # The loop's own writes of the files inside the call: the rest is the way's own cost.
        result["write_s"] = _summary([r["write_s"] for r in result["records"] if r["write_s"] is not None])
        result["own_s"] = _summary([r["blocked_s"] - r["waited_s"] - r["write_s"]
                                    for r in result["records"] if r["write_s"] is not None])  # fmt: skip
        result["blocked_x_local"] = None if blocked is None else blocked["median"] / local
        result["durable_x_local_plus_copy"] = None if durable is None else durable["median"] / (local + copy)
        if len(durable_values) < len(result["records"]):
            result["durable_missing"] = len(result["records"]) - len(durable_values)
    out["load_average_at_end"] = os.getloadavg()
    return out


# -- report ----------------------------------------------------------------------------------------

BLOCKED_TARGET = DURABLE_TARGET = 1.1


def _cell(summary: Optional[dict[str, float]]) -> str:
    if summary is None:
        return "-"
    return f"{summary['median']:.2f} ({summary['min']:.2f}-{summary['max']:.2f})"


def _verdict(ratio: Optional[float], limit: float) -> str:
    if ratio is None:
        return "n/a"
    return f"{ratio:.2f}x **{'met' if ratio <= limit else 'missed'}**"


def table(results: dict[str, Any]) -> list[str]:
    lines = [
        "| mount | way | ckpts | blocked s | blocked / local | of which writing the files s | durable s | durable / (local + copy) | peak RSS MiB | notes |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kit in ("slow", "hdfs"):
        if kit not in results:
            continue
        mount = results[kit]
        label = f"kit {kit}" + (f" {mount['mbps']:.0f} MB/s" if mount["mbps"] else "")
        for way in ("plain", "plain-torch", "staged-sync", "staged-bg", "dcp-staged", "dcp-fs"):
            r = mount["ways"].get(way)
            if r is None:
                continue
            notes = []
            if r.get("error"):
                notes.append(f"FAILED: `{r['error']}`")
                if "left_at_destination" in r:
                    notes.append("left at the destination: " + (", ".join(r["left_at_destination"]) or "nothing"))
            if not r["committed"] and r["records"]:
                saw = any(rec.get("latest_complete_saw_it") for rec in r["records"])
                notes.append("durable = the writer finished; latest_complete " + ("returned it (!)" if saw else "never returns it (no commit file)"))
            if r.get("own_s") and r["way"].startswith("staged"):
                notes.append(f"staged_dir's own share of blocked: {_cell(r['own_s'])} s")
            waited = [rec["waited_s"] for rec in r["records"] if rec["waited_s"] > 0.01]
            if waited:
                notes.append(f"waited for the previous save: {', '.join(f'{w:.2f}' for w in waited)} s")
            if r.get("last_verified") and not r["last_verified"]["complete"]:
                notes.append(f"last checkpoint does not verify: {r['last_verified']['problems']}")
            if r.get("durable_missing"):
                notes.append(f"{r['durable_missing']} never seen by latest_complete")
            durable = _verdict(r["durable_x_local_plus_copy"], DURABLE_TARGET)
            if not r["committed"] and r["durable_x_local_plus_copy"] is not None:
                durable = f"({r['durable_x_local_plus_copy']:.2f}x: not a commit)"
            rss = f"{r['peak_rss_mib']:.0f}" if r.get("peak_rss_mib") else "-"
            lines.append(
                f"| {label} | `{way}` ({r['format']}) | {len(r['records'])} | {_cell(r['blocked_s'])} | "
                f"{_verdict(r['blocked_x_local'], BLOCKED_TARGET)} | {_cell(r.get('write_s'))} | {_cell(r['durable_s'])} | {durable} | {rss} | "
                f"{'; '.join(notes)} |"
            )
    return lines


def baseline_table(results: dict[str, Any]) -> list[str]:
    lines = ["| mount | format | MiB | local write s | copy to the mount s (MB/s) | local + copy s | checkpoint every |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for kit in ("slow", "hdfs"):
        if kit not in results:
            continue
        mount = results[kit]
        for fmt, b in mount["baseline"].items():
            copy = b["copy_s"]["median"]
            lines.append(
                f"| kit {kit} | {fmt} | {b['bytes'] / MiB:.0f} | {_cell(b['local_s'])} | {_cell(b['copy_s'])} "
                f"({b['bytes'] / copy / 1e6:.0f}) | {b['local_s']['median'] + copy:.2f} | "
                f"{mount['interval_steps']} steps ({mount['interval_steps'] * results['step_seconds']:.1f} s) |"
            )
    return lines


def report(results: dict[str, Any]) -> str:
    load = results["load_average_at_start"]
    lines = [
        f"# Stall benchmark, {results['date']} ({'quick' if results['quick'] else 'full'}; "
        f"state {results['state_bytes'] / MiB:.0f} MiB; {results['checkpoints']} checkpoints per way; "
        f"{results['cpus']} CPUs; load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at start, "
        f"{results['load_average_at_end'][0]:.1f} at end; {results['total_seconds']:.0f} s)",
        "",
        f"Command: `{results['command']}`. Steps of {results['step_seconds']} s "
        f"({'real CPU steps' if results['real_steps'] else 'state changed in place, then idle'}); "
        f"staging root {results['root']}; torch {results['torch']}, safetensors {results['safetensors']}.",
        "",
        "## Blocked and durable per checkpoint (median, min-max, seconds)",
        "",
        f"Targets: blocked <= {BLOCKED_TARGET}x the local write of the same format; durable (until "
        f"`latest_complete` returns it) <= {DURABLE_TARGET}x (local write + copy).",
        "",
        *table(results),
        "",
        "## Baselines (same run, same tensors)",
        "",
        *baseline_table(results),
        "",
        "## Load average per way (1 min, at its start and end)",
        "",
    ]
    for kit in ("slow", "hdfs"):
        if kit in results:
            parts = [f"{w} {r['load_average_at_start'][0]:.1f}-{r['load_average_at_end'][0]:.1f}"
                     for w, r in results[kit]["ways"].items()]  # fmt: skip
            lines.append(f"- kit {kit} (order run): {', '.join(parts)}")
    return "\n".join(lines) + "\n"


def update_readme(results: dict[str, Any], stem: Path) -> None:
    text = README.read_text(encoding="utf-8")
    if START not in text or END not in text:
        return
    load = results["load_average_at_start"]
    body = [
        f"Latest full run: [`{stem.name}.md`](results/{stem.name}.md) ({results['date']}, load average "
        f"{load[0]:.1f} at start, {results['load_average_at_end'][0]:.1f} at end, {results['total_seconds']:.0f} s).",
        "",
        *table(results),
        "",
        *baseline_table(results),
    ]
    new = text[: text.index(START) + len(START)] + "\n" + "\n".join(body) + "\n" + text[text.index(END) :]
    README.write_text(new, encoding="utf-8")


# -- main ------------------------------------------------------------------------------------------


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small state, 2 checkpoints per way")
    parser.add_argument("--checkpoints", type=int, default=None, help="per way (default 3, quick 2)")
    parser.add_argument("--copy-repeats", type=int, default=None, help="copy baselines per format (default 2, quick 1)")
    parser.add_argument("--step-seconds", type=float, default=None, help="wall time of a step (default 0.5, quick 0.2)")
    parser.add_argument("--real-steps", action="store_true", help="a real forward/backward/Adam step, no idling")
    parser.add_argument("--only", nargs="*", default=None, help="slow hdfs")
    parser.add_argument("--seed", type=int, default=20)
    parser.add_argument("--out", default=None, help="file stem under results/ (default <date>-stall)")
    args = parser.parse_args(argv)
    args.checkpoints = args.checkpoints or (2 if args.quick else 3)
    args.copy_repeats = args.copy_repeats or (1 if args.quick else 2)
    args.step_seconds = args.step_seconds or (0.2 if args.quick else 0.5)
    if os.environ.get("SAFESTAGE", "0") not in ("", "0"):
        parser.error("unset SAFESTAGE: the plain writers must not be staged by the start-up hook")
    faulthandler.dump_traceback_later(1800, exit=True)  # a hang ends the run with every thread's stack
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    started = time.monotonic()
    import safetensors
    import torch

    torch.set_num_threads(1)
    layers, width = (2, 2048) if args.quick else (5, 4096)
    trainer = Trainer(layers, width, args.real_steps)
    results: dict[str, Any] = {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "command": "python benchmarks/stall.py" + " ".join([""] + (argv if argv is not None else sys.argv[1:])),
        "quick": args.quick, "checkpoints": args.checkpoints, "copy_repeats": args.copy_repeats,
        "step_seconds": args.step_seconds, "real_steps": args.real_steps, "model": f"{layers} x Linear({width}, {width}) + Adam",
        "state_bytes": trainer.state_bytes(), "torch": torch.__version__, "safetensors": safetensors.__version__,
        "python": sys.version.split()[0], "cpus": os.cpu_count(), "load_average_at_start": os.getloadavg(),
    }  # fmt: skip
    shm = Path(tempfile.mkdtemp(prefix="safestage-stall-", dir="/dev/shm"))
    root = shm / "root"
    root.mkdir()
    results["root"] = "/dev/shm"
    wanted = args.only or ["slow", "hdfs"]
    try:
        for seed, (kit, mbps) in enumerate((("slow", 100.0), ("hdfs", None))):
            if kit in wanted:
                print(f"kit {kit} ...", flush=True)
                results[kit] = bench_mount(kit, mbps, trainer, shm, root, args, args.seed + seed)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    results["load_average_at_end"] = os.getloadavg()
    results["total_seconds"] = time.monotonic() - started
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / (args.out or f"{_dt.date.today().isoformat()}-stall{'-quick' if args.quick else ''}")
    stem.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    text = report(results)
    stem.with_suffix(".md").write_text(text)
    if not args.quick and args.out is None:
        update_readme(results, stem)
    print(text)
    print(f"written: {stem}.json, {stem}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
