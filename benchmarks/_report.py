"""Targets, markdown tables and the chart for a benchmark results document (see run.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

MiB = 1 << 20

# Contenders that make each file durable before returning; the others leave it in the page
# cache. Ratios to the ceiling compare like with like: fsync'ed contenders against
# `dd conv=fsync`, the others against plain dd.
FSYNCING = {
    "ss-sync",
    "ss-xdev",
    "ss-direct",
    "ss-bg",
    "ss-bg-mp1",
    "ss-bg-mp4",
    "ss-when-auto",
    "ss-follow",
    "ss-follow-shm",
    "ss-sync-shm",
    "ceiling-fsync",
}

ROW_ORDER = [
    "ceiling",
    "ceiling-fsync",
    "st08",
    "st07",
    "ss-sync",
    "ss-sync-nofsync",
    "ss-sync-shm",
    "ss-follow",
    "ss-follow-shm",
    "serialize-disk",
    "serialize-shm",
    "ss-xdev",
    "ss-direct",
    "ss-bg",
    "ss-bg-nofsync",
    "ss-bg-mp1",
    "ss-bg-mp4",
    "ss-when-auto",
    "ss-when-auto-nofsync",
    "build-only",
]
DEST_ORDER = ["disk", "shm", "hdfs", "mountpoint", "slow", "rclone-local", "rclone-s3", "s3fs"]
REAL_DESTS = ("rclone-local", "rclone-s3", "s3fs")


def _cell(
    document: dict[str, Any], dest: str, workload: str, name: str
) -> Optional[dict[str, Any]]:
    return document["summary"].get(dest, {}).get(workload, {}).get(name)


def _median(document: dict[str, Any], dest: str, workload: str, name: str) -> Optional[float]:
    cell = _cell(document, dest, workload, name)
    if not cell or cell.get("fails"):
        return None
    return float(cell["median_s"])


def _ratio(
    document: dict[str, Any], dest: str, workload: str, name: str, base: str
) -> Optional[float]:
    value, reference = (
        _median(document, dest, workload, name),
        _median(document, dest, workload, base),
    )
    if value is None or reference is None or reference <= 0:
        return None
    return value / reference


def _ratio_min(
    document: dict[str, Any], dest: str, workload: str, name: str, base: str
) -> Optional[float]:
    a, b = _cell(document, dest, workload, name), _cell(document, dest, workload, base)
    if not a or not b or a.get("fails") or b.get("fails"):
        return None
    return float(a["min_s"]) / float(b["min_s"])


def _noise(document: dict[str, Any], dest: str, workload: str, name: str, base: str) -> str:
    value = _ratio_min(document, dest, workload, name, base)
    return f"best-of-runs ratio (min/min) {value:.3f}x" if value is not None else ""


def ceiling_for(name: str) -> str:
    return "ceiling-fsync" if name in FSYNCING else "ceiling"


def _target(
    name: str, value: Optional[float], limit: float, unit: str, details: list[str]
) -> dict[str, Any]:
    details = [d for d in details if d and "n/a" not in d]
    if value is None:
        verdict, display = "n/a", "not measured (a contender failed or was skipped)"
    else:
        verdict = "met" if value <= limit else "missed"
        display = (
            f"{value:.3f}{unit} (limit {limit:g}{unit})"
            if unit == "x"
            else f"{value:.1f}{unit} (limit {limit:g}{unit})"
        )
    return {
        "name": name,
        "value": value,
        "limit": limit,
        "unit": unit,
        "verdict": verdict,
        "display": display,
        "details": details,
    }


def _build_note(document: dict[str, Any]) -> str:
    build = _median(document, "disk", "shards", "build-only")
    return (
        f"building the shards alone takes {build:.2f} s (disk run), inside every contender's time but not dd's"
        if build
        else ""
    )


def _runs(document: dict[str, Any], dest: str, workload: str) -> int:
    cell = _cell(document, dest, workload, "st08")
    return int(cell["n"]) if cell else 0


def _fmt_ratio(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.3f}x"


def targets(document: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    shards = document["settings"]["sizes"]["shards"]["shards"]
    for dest in ("slow", "hdfs"):
        out.append(
            _target(
                f"{shards} x shards -> {dest}: background within 1.15x of the ceiling (both fsync each file)",
                _ratio(document, dest, "shards", "ss-bg", "ceiling-fsync"),
                1.15,
                "x",
                [
                    _noise(document, dest, "shards", "ss-bg", "ceiling-fsync"),
                    f"without fsync: ss-bg-nofsync / dd = {_fmt_ratio(_ratio(document, dest, 'shards', 'ss-bg-nofsync', 'ceiling'))}",
                    f"background fsync vs dd without fsync: {_fmt_ratio(_ratio(document, dest, 'shards', 'ss-bg', 'ceiling'))}",
                    _build_note(document),
                ],
            )
        )
        out.append(
            _target(
                f"{shards} x shards -> {dest}: synchronous within 1.6x of the ceiling (both fsync each file)",
                _ratio(document, dest, "shards", "ss-sync", "ceiling-fsync"),
                1.6,
                "x",
                [
                    _noise(document, dest, "shards", "ss-sync", "ceiling-fsync"),
                    f"without fsync: ss-sync-nofsync / dd = {_fmt_ratio(_ratio(document, dest, 'shards', 'ss-sync-nofsync', 'ceiling'))}",
                    f"publish=direct: {_fmt_ratio(_ratio(document, dest, 'shards', 'ss-direct', 'ceiling-fsync'))}",
                ],
            )
        )

    def precise(dest: str, name: str) -> tuple[Optional[float], str]:
        """The ratio to 0.8 from the 12-run block if it ran, else from the matrix."""
        if _cell(document, dest, "precise", name) and _cell(document, dest, "precise", "st08"):
            return _ratio(document, dest, "precise", name, "st08"), "precise"
        return _ratio(document, dest, "single", name, "st08"), "single"

    value, source = precise("disk", "ss-when-auto-nofsync")
    out.append(
        _target(
            "1 GiB -> plain disk, when='auto' within 1.05x of safetensors 0.8 (like for like: fsync=False)",
            value,
            1.05,
            "x",
            [
                f"from {_runs(document, 'disk', source)} interleaved runs; "
                + _noise(document, "disk", source, "ss-when-auto-nofsync", "st08"),
                f"the {_runs(document, 'disk', 'single')}-run matrix said {_fmt_ratio(_ratio(document, 'disk', 'single', 'ss-when-auto-nofsync', 'st08'))}",
                f"with the default fsync=True: {_fmt_ratio(_ratio(document, 'disk', 'single', 'ss-when-auto', 'st08'))} (the fsync is the difference)",
                f"8 shards, fsync=False: {_fmt_ratio(_ratio(document, 'disk', 'shards', 'ss-when-auto-nofsync', 'st08'))}",
            ],
        )
    )
    rename = {dest: precise(dest, "ss-sync-nofsync") for dest in ("disk", "shm")}
    worst = max((v for v, _ in rename.values() if v is not None), default=None)
    out.append(
        _target(
            "staging root on the destination's filesystem (rename), 1 GiB, fsync=False: within 1.10x of 0.8 (worst of disk, /dev/shm)",
            worst,
            1.10,
            "x",
            [
                f"{dest}: {_fmt_ratio(v)} from {_runs(document, dest, source)} runs ({_noise(document, dest, source, 'ss-sync-nofsync', 'st08')};"
                f" the matrix said {_fmt_ratio(_ratio(document, dest, 'single', 'ss-sync-nofsync', 'st08'))})"
                for dest, (v, source) in rename.items()
            ]
            + [
                f"8 shards {dest}: {_fmt_ratio(_ratio(document, dest, 'shards', 'ss-sync-nofsync', 'st08'))}"
                for dest in ("disk", "shm")
            ]
            + [
                f"fsync's cost on disk, 1 GiB: ss-sync / ss-sync-nofsync = {_fmt_ratio(_ratio(document, 'disk', 'single', 'ss-sync', 'ss-sync-nofsync'))}"
                f" (dd conv=fsync / dd = {_fmt_ratio(_ratio(document, 'disk', 'single', 'ceiling-fsync', 'ceiling'))})"
            ],
        )
    )
    overhead = document.get("overhead") or {}
    passthrough = None
    details = []
    if "wrapper_passthrough_ns" in overhead:
        passthrough = (
            overhead["wrapper_passthrough_ns"]["median"] - overhead["noop_direct_ns"]["median"]
        ) / 1000
        decision = (
            overhead["wrapper_to_stage_decision_ns"]["median"]
            - overhead["noop_direct_ns"]["median"]
        ) / 1000
        details.append(
            f"stage open, up to the point it stages (lookup, abspath, 2 stats): {decision:.1f} us"
        )
        plain = overhead.get("save_1KiB_plain_ns", {}).get("median")
        for key, label in (
            ("save_1KiB_staged_rename_nofsync_ns", "rename, no fsync"),
            ("save_1KiB_staged_rename_fsync_ns", "rename, fsync"),
            ("save_1KiB_staged_replace_nofsync_ns", "replace, no fsync"),
            ("save_1KiB_staged_replace_fsync_ns", "replace, fsync"),
        ):
            if plain and key in overhead:
                details.append(
                    f"whole 1 KiB save staged ({label}) minus plain 0.8: {(overhead[key]['median'] - plain) / 1000:.0f} us"
                )
    tiny = []
    for dest in ("disk", "hdfs"):
        plain_s = _median(document, dest, "tiny", "st08") or _median(document, dest, "tiny", "st07")
        staged_s = _median(document, dest, "tiny", "ss-sync")
        cell = _cell(document, dest, "tiny", "ss-sync")
        if plain_s and staged_s and cell:
            saves = document["settings"]["sizes"]["tiny"]["saves"]
            base = "0.8" if _median(document, dest, "tiny", "st08") else "0.7"
            tiny.append(
                f"tiny model ({dest}) staged minus plain {base}: {(staged_s - plain_s) / saves * 1e3:.2f} ms per save"
            )
    out.append(
        _target(
            "per-call overhead of an installed pass-through wrapper < 20 us",
            passthrough,
            20,
            " us",
            details + tiny,
        )
    )
    rss_rows = []
    worst_rss = None
    for dest in DEST_ORDER:
        base = _cell(document, dest, "single", "st08")
        if not base or base.get("fails") or "peak_rss_kib" not in base:
            continue
        for name in ROW_ORDER:
            if not name.startswith("ss-"):
                continue
            cell = _cell(document, dest, "single", name)
            if not cell or cell.get("fails") or "peak_rss_kib" not in cell:
                continue
            delta = (cell["peak_rss_kib"] - base["peak_rss_kib"]) / 1024
            rss_rows.append((delta, f"{dest} {name}: {delta:+.1f} MiB"))
            worst_rss = delta if worst_rss is None else max(worst_rss, delta)
    rss_rows.sort(reverse=True)
    out.append(
        _target(
            "peak RSS, 1 GiB file: staged minus plain 0.8 <= 64 MiB (worst staged contender)",
            worst_rss,
            64,
            " MiB",
            [text for _, text in rss_rows[:4]],
        )
    )
    return out


# -- markdown -----------------------------------------------------------------------------------


def _seconds_cell(document: dict[str, Any], dest: str, workload: str, name: str) -> str:
    cell = _cell(document, dest, workload, name)
    if cell is None:
        return ""
    if cell.get("fails"):
        return "fails"
    text = f"{cell['median_s']:.2f} ({cell['min_s']:.2f}-{cell['max_s']:.2f})"
    if name not in ("ceiling", "ceiling-fsync", "build-only", "serialize-disk", "serialize-shm"):
        ratio = _ratio(document, dest, workload, name, ceiling_for(name))
        if ratio is not None:
            text += f" x{ratio:.2f}"
    if cell.get("n_ok", 0) < cell.get("n", 0):
        text += f" ({cell['n'] - cell['n_ok']} failed)"
    return text


def _precise_cell(document: dict[str, Any], dest: str, name: str) -> str:
    cell = _cell(document, dest, "precise", name)
    if cell is None or cell.get("fails"):
        return "" if cell is None else "fails"
    text = f"{cell['median_s']:.3f} ({cell['min_s']:.3f}-{cell['max_s']:.3f})"
    if name != "st08":
        text += f" x{_ratio(document, dest, 'precise', name, 'st08'):.3f} of st08"
    return text


def _tiny_cell(document: dict[str, Any], dest: str, name: str) -> str:
    cell = _cell(document, dest, "tiny", name)
    if cell is None:
        return ""
    if cell.get("fails"):
        return "fails"
    saves = document["settings"]["sizes"]["tiny"]["saves"]
    return f"{cell['median_s'] / saves * 1e3:.1f} ({cell['min_s'] / saves * 1e3:.1f}-{cell['max_s'] / saves * 1e3:.1f})"


def _rss_cell(document: dict[str, Any], dest: str, name: str) -> str:
    cell = _cell(document, dest, "single", name)
    if cell is None or "peak_rss_kib" not in cell:
        return "" if cell is None else "fails"
    text = f"{cell['peak_rss_kib'] / 1024:.0f}"
    base = _cell(document, dest, "single", "st08")
    if name.startswith("ss-") and base and "peak_rss_kib" in base and not base.get("fails"):
        text += f" ({(cell['peak_rss_kib'] - base['peak_rss_kib']) / 1024:+.0f})"
    return text


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _dests(document: dict[str, Any]) -> list[str]:
    return [d for d in DEST_ORDER if d in document["summary"]]


def _rows(document: dict[str, Any], workload: str) -> list[str]:
    present = {name for dest in document["summary"].values() for name in dest.get(workload, {})}
    return [name for name in ROW_ORDER if name in present]


def markdown(document: dict[str, Any], png_name: str) -> str:
    settings = document["settings"]
    sizes = settings["sizes"]
    machine = document["machine"]
    dests = _dests(document)
    dest_header = [document["destinations"][d] for d in dests]
    single_mib = sizes["single"]["tensors"] * sizes["single"]["tensor_bytes"] / MiB
    shard_mib = sizes["shards"]["shard_bytes"] / MiB
    lines = [
        f"# safestage benchmarks, {document['date']}{' (QUICK smoke run: small sizes, not results)' if document['quick'] else ''}",
        "",
        f"`{document['command']}`: {document['wall_seconds'] / 60:.1f} min wall time. "
        f"{machine.get('cpus')} CPUs ({machine.get('cpu', '?')}), kernel {machine.get('kernel')}, "
        f"shared machine (load average at the end {', '.join(f'{x:.1f}' for x in machine.get('loadavg_at_end', []))}). "
        f"safestage {document['versions']['main'].get('safestage')} (git {machine.get('git', {}).get('head', '?')}"
        f"{', uncommitted: ' + ', '.join(machine['git']['safestage_uncommitted']) if machine.get('git', {}).get('safestage_uncommitted') else ''}), "
        f"torch {document['versions']['main']['torch']}, safetensors {document['versions']['main']['safetensors']} "
        f"and {document['versions']['st07']['safetensors']} (side venv), Python {document['versions']['main']['python']}.",
        "",
        f"Medians of {settings.get('local_repeats', settings['repeats'])} runs (the single file on disk and /dev/shm) or {settings['repeats']} runs (everything else), (min-max) beside them; every run is its own process; contenders "
        "interleaved in a fresh seeded random order every repeat. `xN.NN` = ratio to this destination's ceiling in the same run "
        "(fsync'ing contenders against `dd conv=fsync`, the others against plain `dd`). "
        f"Page cache: {settings['cache']}. Kit backing: {settings['kit_backing']}. "
        + (f"Real mounts: {settings['real_mounts']}. " if settings.get("real_mounts") else "")
        + f"Staging roots: disk dest {settings['staging_roots']['disk']}; /dev/shm dest {settings['staging_roots']['shm']}; "
        f"kit {settings['staging_roots']['kit']}. Ceiling: {settings['ceiling']}. Build: {settings['build']}.",
        "",
        "## Targets",
        "",
    ]
    lines += _table(
        ["target", "measured", "verdict", "details"],
        [
            [t["name"], t["display"], f"**{t['verdict']}**", "; ".join(t["details"])]
            for t in document["targets"]
        ],
    )
    lines += ["", f"![chart]({png_name})", ""]
    for workload, title in (
        (
            "single",
            f"One {single_mib:.0f} MiB file ({sizes['single']['tensors']} tensors), seconds",
        ),
        (
            "shards",
            f"{sizes['shards']['shards']} shards of {shard_mib:.0f} MiB, each built in the loop, seconds",
        ),
    ):
        lines += [f"## {title}", ""]
        lines += _table(
            ["contender", *dest_header],
            [
                [
                    f"`{n}` {document['contenders'][n]}",
                    *(_seconds_cell(document, d, workload, n) for d in dests),
                ]
                for n in _rows(document, workload)
            ],
        )
        lines.append("")
    if _rows(document, "precise"):
        lines += [
            f"## Precision block: the same {single_mib:.0f} MiB file, {settings.get('precise_repeats')} more interleaved runs of three contenders, seconds",
            "",
        ]
        lines += _table(
            ["contender", *(document["destinations"][d] for d in dests if d in ("disk", "shm"))],
            [
                [f"`{n}`", *(_precise_cell(document, d, n) for d in dests if d in ("disk", "shm"))]
                for n in _rows(document, "precise")
            ],
        )
        lines.append("")
    lines += [
        f"## Tiny model: {sizes['tiny']['tensors']} tensors of {sizes['tiny']['tensor_bytes']} B, "
        f"{sizes['tiny']['saves']} saves per run, milliseconds per save",
        "",
    ]
    lines += _table(
        ["contender", *dest_header],
        [[f"`{n}`", *(_tiny_cell(document, d, n) for d in dests)] for n in _rows(document, "tiny")],
    )
    lines += [
        "",
        f"## Peak RSS, one {single_mib:.0f} MiB file: MiB (VmHWM of the run's process; staged: +/- vs plain 0.8)",
        "",
    ]
    lines += _table(
        ["contender", *dest_header],
        [
            [f"`{n}`", *(_rss_cell(document, d, n) for d in dests)]
            for n in _rows(document, "single")
            if not n.startswith("ceiling")
        ],
    )
    lines += [
        "",
        "Baseline RSS of a run's process before it builds anything: "
        + ", ".join(
            f"{venv} {cell.get('baseline_rss_kib', 0) / 1024:.0f} MiB"
            for venv, cell in (
                ("0.8 venv", _cell(document, "disk", "single", "st08")),
                ("0.7 venv", _cell(document, "disk", "single", "st07")),
            )
            if cell
        )
        + ".",
        "",
    ]
    overhead = document.get("overhead") or {}
    if "noop_direct_ns" in overhead:
        lines += ["## Per-call overhead (microseconds, median of 7 batches (min-max))", ""]
        rows = []
        for key, label in (
            ("noop_direct_ns", "a no-op function called directly (reference)"),
            (
                "wrapper_passthrough_ns",
                "the same through safestage's installed wrapper, no stage open (pass-through)",
            ),
            (
                "wrapper_to_stage_decision_ns",
                "stage open: the wrapper up to the point it stages (Stage._save stubbed)",
            ),
            ("stage_open_close_ns", "opening + closing a stage (patch, root check, unpatch)"),
            ("save_1KiB_plain_ns", "a whole 1 KiB save_file, plain 0.8"),
            ("save_1KiB_staged_rename_nofsync_ns", "the same staged, rename path, fsync=False"),
            ("save_1KiB_staged_rename_fsync_ns", "the same staged, rename path, fsync=True"),
            (
                "save_1KiB_staged_replace_nofsync_ns",
                "the same staged, replace (root on /dev/shm), fsync=False",
            ),
            (
                "save_1KiB_staged_replace_fsync_ns",
                "the same staged, replace (root on /dev/shm), fsync=True",
            ),
        ):
            if key in overhead:
                value = overhead[key]
                rows.append(
                    [
                        label,
                        f"{value['median'] / 1000:.2f} ({value['min'] / 1000:.2f}-{value['max'] / 1000:.2f})",
                    ]
                )
        lines += _table(["what", "us per call"], rows)
        lines.append("")
    lines += _cpu_section(document)
    lines += _parallel_section(document)
    lines += _copy_section(document.get("copy_methods"))
    return "\n".join(lines).rstrip() + "\n"


def _cpu_section(document: dict[str, Any]) -> list[str]:
    """Where the CPU went: the saving process (or dd) and the FUSE server (a real mount's tool
    and its S3 server), per run."""
    dests = [d for d in ("hdfs", "mountpoint", "slow", *REAL_DESTS) if d in document["summary"]]
    if not dests:
        return []
    rows = []
    for name in _rows(document, "shards"):
        row = [f"`{name}`"]
        for dest in dests:
            cell = _cell(document, dest, "shards", name)
            if not cell or cell.get("fails") or "client_cpu_s" not in cell:
                row.append("" if not cell else "fails")
                continue
            client, server = cell["client_cpu_s"], cell.get("server_cpu_s", 0.0)
            row.append(
                f"{client:.2f} + {server:.2f} = {client + server:.2f} in {cell['median_s']:.2f} s"
            )
        rows.append(row)
    return [
        f"## CPU seconds per run, {document['settings']['sizes']['shards']['shards']} shards: saving process (or dd) + FUSE server (real mounts: the tool + the S3 server) = total, in the wall time",
        "",
        "2 cores are shared with other engineers' jobs: a total near 2 x wall time means the run was CPU-bound.",
        "",
        *_table(["contender", *(document["destinations"][d] for d in dests)], rows),
        "",
    ]


def _parallel_section(document: dict[str, Any]) -> list[str]:
    rows = []
    for dest in ("slow", "hdfs"):
        for name, label in (("ss-bg-mp1", "1"), ("ss-bg", "2 (default)"), ("ss-bg-mp4", "4")):
            cell = _cell(document, dest, "shards", name)
            if cell is None:
                continue
            rows.append(
                [
                    document["destinations"][dest],
                    label,
                    _seconds_cell(document, dest, "shards", name),
                ]
            )
    if not rows:
        return []
    return [
        "## Parallel publishes: 8 shards, background=True, fsync, by max_pending (seconds)",
        "",
        *_table(["destination", "max_pending", "seconds (x ceiling-fsync)"], rows),
        "",
    ]


def _copy_section(copy: Optional[dict[str, Any]]) -> list[str]:
    if not copy:
        return ["## Copy methods", "", "not run", ""]
    lines = [
        f"## Copy method and chunk size (copy_methods.py): MB/s, median of {copy['repeats']} (min-max)",
        "",
        f"{copy['bytes'] / MiB:.0f} MiB from a warm file on {copy['source_fs']} into each destination, no fsync "
        "(the copy alone), `sync` before each run. read/write = the library's loop (readinto a reusable "
        "buffer, write); sendfile and copy_file_range move `chunk` bytes per call.",
        "",
    ]
    chunks = copy["chunks_mib"]
    rows = []
    for dest, methods in copy["results"].items():
        for method, per_chunk in methods.items():
            row = [dest, method]
            for chunk in chunks:
                cell = per_chunk.get(str(chunk))
                if cell is None:
                    row.append("")
                elif cell.get("unsupported"):
                    row.append(cell["unsupported"])
                else:
                    row.append(
                        f"{cell['median_mbps']:.0f} ({cell['min_mbps']:.0f}-{cell['max_mbps']:.0f})"
                    )
            rows.append(row)
    lines += _table(["destination", "method", *(f"{c} MiB" for c in chunks)], rows)
    lines += ["", "### The kit's own ceiling (dd into the FUSE mount, MB/s, median (min-max))", ""]
    rows = [
        [r["dest"], r["what"], f"{r['median_mbps']:.0f} ({r['min_mbps']:.0f}-{r['max_mbps']:.0f})"]
        for r in copy.get("kit_ceiling", [])
    ]
    lines += _table(["destination", "writer", "MB/s"], rows)
    lines.append("")
    return lines


# -- chart ------------------------------------------------------------------------------------------

CHART_CONTENDERS = [
    ("ceiling", "#444444"),
    ("ceiling-fsync", "#888888"),
    ("st08", "#d62728"),
    ("st07", "#ff9896"),
    ("ss-sync", "#1f77b4"),
    ("ss-sync-nofsync", "#aec7e8"),
    ("ss-xdev", "#17becf"),
    ("ss-direct", "#9467bd"),
    ("ss-bg", "#2ca02c"),
    ("ss-bg-nofsync", "#98df8a"),
    ("ss-when-auto", "#ff7f0e"),
    ("ss-when-auto-nofsync", "#ffbb78"),
]


def chart(document: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    dests = _dests(document)
    sizes = document["settings"]["sizes"]
    panels = [
        (
            "single",
            f"one {sizes['single']['tensors'] * sizes['single']['tensor_bytes'] / MiB:.0f} MiB file: seconds",
        ),
        (
            "shards",
            f"{sizes['shards']['shards']} x {sizes['shards']['shard_bytes'] / MiB:.0f} MiB shards, built in the loop: seconds",
        ),
        (
            "tiny",
            f"tiny model ({sizes['tiny']['tensors']} x {sizes['tiny']['tensor_bytes']} B): ms per save",
        ),
    ]
    if document["quick"]:
        panels = [(w, f"{t} (QUICK sizes)") for w, t in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(13, 13))
    saves = document["settings"]["sizes"]["tiny"]["saves"]
    all_dests = dests
    for ax, (workload, title) in zip(axes, panels):
        dests = [
            d
            for d in all_dests
            if any(_cell(document, d, workload, n) for n, _ in CHART_CONTENDERS)
        ]
        names = [
            (n, c)
            for n, c in CHART_CONTENDERS
            if any(_cell(document, d, workload, n) for d in dests)
        ]
        width = 0.85 / max(len(names), 1)
        top = 0.0
        for index, (name, color) in enumerate(names):
            xs, heights, lows, highs, fails = [], [], [], [], []
            for position, dest in enumerate(dests):
                cell = _cell(document, dest, workload, name)
                x = position - 0.425 + width * (index + 0.5)
                if cell is None:
                    continue
                if cell.get("fails"):
                    fails.append(x)
                    continue
                scale = 1e3 / saves if workload == "tiny" else 1.0
                xs.append(x)
                heights.append(cell["median_s"] * scale)
                lows.append((cell["median_s"] - cell["min_s"]) * scale)
                highs.append((cell["max_s"] - cell["median_s"]) * scale)
                top = max(top, cell["max_s"] * scale)
            ax.bar(
                xs,
                heights,
                width,
                color=color,
                label=name,
                yerr=[lows, highs],
                capsize=1.5,
                error_kw={"elinewidth": 0.7},
            )
            for x in fails:
                ax.text(
                    x,
                    0,
                    "fails",
                    rotation=90,
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    color="#d62728",
                )
        ax.set_xticks(range(len(dests)))
        ax.set_xticklabels([document["destinations"][d] for d in dests])
        ax.set_title(title)
        ax.set_ylim(0, top * 1.12 if top else 1)
        ax.grid(axis="y", alpha=0.3)
    used = [
        (n, c)
        for n, c in CHART_CONTENDERS
        if any(_cell(document, d, w, n) for d in all_dests for w, _ in panels)
    ]
    fig.legend(
        handles=[Patch(color=c, label=n) for n, c in used],
        ncol=len(used) // 2 + len(used) % 2,
        fontsize=8,
        loc="lower center",
        frameon=False,
    )
    fig.suptitle(
        f"safestage vs safetensors vs dd ceiling, {document['date']} (medians, bars = min-max)"
    )
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)


# -- README -------------------------------------------------------------------------------------------

START, END = "<!-- results:start -->", "<!-- results:end -->"


def update_readme(readme: Path, markdown_text: str, stem: str) -> None:
    """Replace the README's results section with the latest run (image paths made relative)."""
    if not readme.exists():
        return
    text = readme.read_text(encoding="utf-8")
    if START not in text or END not in text:
        return
    body = markdown_text.split("\n", 1)[1]  # drop the H1
    body = re.sub(r"^### ", "#### ", body, flags=re.M)
    body = re.sub(r"^## ", "### ", body, flags=re.M)
    body = re.sub(r"!\[chart\]\(([^)]+)\)", lambda m: f"![chart](results/{Path(m[1]).name})", body)
    header = f"Latest full run: [`{stem}.md`]({stem}.md), [`{stem}.json`]({stem}.json).\n"
    new = text[: text.index(START) + len(START)] + "\n" + header + body + text[text.index(END) :]
    readme.write_text(new, encoding="utf-8")
