"""The targets of issue 13 ("one big file as fast as its slowest half, and never slower than
safetensors 0.7"), computed from one run.py results document.

- default vs 0.7: ``ss-sync`` (safestage's defaults: auto, fsync on) against ``st07`` on every
  destination where 0.7 works, every workload; and like for like (``ss-sync-nofsync``: 0.7
  never fsyncs) where that contender ran.
- default vs 0.8 where 0.8 works (disk, /dev/shm), like for like: ``ss-sync-nofsync`` / ``st08``.
- follow: one 1 GiB file onto kit hdfs and kit slow, ``ss-follow`` (root on local disk, the
  default root) and ``ss-follow-shm`` against max(serializing alone into that root, ``dd
  conv=fsync`` onto the mount).
- fsync's cost on every destination: ``ss-sync`` / ``ss-sync-nofsync`` (a measurement, no limit).

Each returns rows shaped like _report._target, so the markdown and verdicts.py treat them alike.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import _report
from _report import _fmt_ratio, _median, _target

WORKLOADS = ("single", "shards", "tiny")
ZERO_SEVEN_DESTS = ("disk", "shm", "hdfs", "mountpoint", "slow", "rclone-local", "rclone-s3", "s3fs")


def _ratio(document: dict[str, Any], dest: str, workload: str, name: str, base: str) -> Optional[float]:
    if workload == "single" and _median(document, dest, "precise", name) and _median(
        document, dest, "precise", base
    ):
        workload = "precise"  # 12 more interleaved runs where they exist (disk, /dev/shm)
    return _report._ratio(document, dest, workload, name, base)


def _worst(
    document: dict[str, Any], dest: str, name: str, base: str
) -> tuple[Optional[float], list[str]]:
    ratios = {w: _ratio(document, dest, w, name, base) for w in WORKLOADS}
    measured = {w: r for w, r in ratios.items() if r is not None}
    details = [f"{w} {_fmt_ratio(r)}" for w, r in measured.items()]
    return (max(measured.values()) if measured else None), details


def _per_destination(
    document: dict[str, Any], dests: tuple[str, ...], one: Callable[[str], dict[str, Any]]
) -> list[dict[str, Any]]:
    """One target per destination this run measured."""
    return [one(dest) for dest in dests if dest in document["summary"]]


def default_vs_07(document: dict[str, Any]) -> list[dict[str, Any]]:
    def one(dest: str) -> dict[str, Any]:
        value, details = _worst(document, dest, "ss-sync", "st07")
        like, like_details = _worst(document, dest, "ss-sync-nofsync", "st07")
        if like is not None:
            details.append("fsync off (0.7 never fsyncs): " + ", ".join(like_details))
        upstream, upstream_details = _worst(document, dest, "st08", "st07")
        if upstream is not None:  # the writer safestage runs is 0.8's: its own cost against 0.7
            details.append("safetensors 0.8 itself / 0.7: " + ", ".join(upstream_details))
        strategies = (_report._cell(document, dest, "single", "ss-sync") or {}).get("strategies")
        if strategies:
            details.append(f"publish: {', '.join(sorted(set(strategies)))}")
        return _target(
            f"issue 13: {dest}, safestage default as run (ss-sync) <= 1.0x of safetensors 0.7 (worst workload)",
            value,
            1.0,
            "x",
            details,
        )

    return _per_destination(document, ZERO_SEVEN_DESTS, one)


def follow_default_vs_07(document: dict[str, Any]) -> list[dict[str, Any]]:
    """The default chosen from these runs (follow=None, "auto"): a 1 GiB safetensors save
    published by replace is followed, which is the ``ss-follow`` contender; elsewhere
    (rename, direct) the default is ``ss-sync`` as before."""
    def one(dest: str) -> dict[str, Any]:
        name = "ss-follow" if _median(document, dest, "single", "ss-follow") else "ss-sync"
        value = _ratio(document, dest, "single", name, "st07")
        details = [f"measured as {name}"]
        before = _ratio(document, dest, "single", "ss-sync", "st07")
        if name == "ss-follow" and before is not None:
            details.append(f"follow off (the previous default) {_fmt_ratio(before)}")
        return _target(
            f"issue 13: {dest}, 1 GiB, default with follow auto <= 1.0x of safetensors 0.7",
            value,
            1.0,
            "x",
            details,
        )

    return _per_destination(document, ZERO_SEVEN_DESTS, one)


def default_vs_08(document: dict[str, Any]) -> list[dict[str, Any]]:
    def one(dest: str) -> dict[str, Any]:
        value, details = _worst(document, dest, "ss-sync-nofsync", "st08")
        with_fsync, fsync_details = _worst(document, dest, "ss-sync", "st08")
        if with_fsync is not None:
            details.append("default fsync on, against 0.8 without: " + ", ".join(fsync_details))
        return _target(
            f"issue 13: {dest}, safestage <= 1.05x of safetensors 0.8, like for like (fsync off; worst workload)",
            value,
            1.05,
            "x",
            details,
        )

    return _per_destination(document, ("disk", "shm"), one)


def follow_bound(document: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for dest in ("hdfs", "slow"):
        ceiling = _median(document, dest, "single", "ceiling-fsync")
        for name, root in (("ss-follow", "disk"), ("ss-follow-shm", "shm")):
            serialize = _median(document, dest, "single", f"serialize-{root}")
            value = _median(document, dest, "single", name)
            sequential = _median(document, dest, "single", "ss-sync" if root == "disk" else "ss-sync-shm")
            bound = max(serialize, ceiling) if serialize and ceiling else None
            ratio = value / bound if value and bound else None
            details = []
            if bound:
                details.append(
                    f"serialize alone {serialize:.2f} s, dd conv=fsync {ceiling:.2f} s, follow {value or 0:.2f} s"
                )
                if sequential:
                    details.append(f"sequential (follow off) {sequential / bound:.3f}x")
            zero_seven = _median(document, dest, "single", "st07")
            if value and zero_seven:
                details.append(f"follow / 0.7 = {value / zero_seven:.3f}x")
            out.append(
                _target(
                    f"issue 13: 1 GiB -> {dest}, follow=True, root {'local disk' if root == 'disk' else '/dev/shm'}: "
                    "<= 1.15x of max(serialize alone, dd conv=fsync)",
                    ratio,
                    1.15,
                    "x",
                    details,
                )
            )
    return out


def fsync_cost(document: dict[str, Any]) -> list[dict[str, Any]]:
    """Not a target: what fsync=True costs, default against fsync=False, 1 GiB."""
    rows = []
    for dest in _report.DEST_ORDER:
        on = _median(document, dest, "single", "ss-sync")
        off = _median(document, dest, "single", "ss-sync-nofsync")
        if on and off:
            rows.append({"dest": dest, "on": on, "off": off, "ratio": on / off})
    return rows


def targets(document: dict[str, Any]) -> list[dict[str, Any]]:
    return (
        default_vs_07(document)
        + follow_default_vs_07(document)
        + default_vs_08(document)
        + follow_bound(document)
    )


def section(document: dict[str, Any]) -> list[str]:
    """Markdown: what fsync=True costs on each destination (issue 13 asks for both)."""
    rows = fsync_cost(document)
    if not rows:
        return []
    lines = [
        "## fsync's cost (issue 13): one 1 GiB file, safestage default with fsync on and off, seconds",
        "",
        "| destination | fsync on (default) | fsync off | on / off |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {document['destinations'][r['dest']]} | {r['on']:.2f} | {r['off']:.2f} | {r['ratio']:.2f}x |"
        for r in rows
    ]
    return lines + [""]
