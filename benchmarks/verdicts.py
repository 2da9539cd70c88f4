"""Issue 13's verdicts from two full runs of run.py: each target's ratio in both runs, side by
side, and one verdict (met in both, met in one, missed in both).

    python benchmarks/verdicts.py results/RUN1.json results/RUN2.json --out results/STEM.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _issue13  # noqa: E402


def _value(target: dict[str, Any]) -> str:
    if target["value"] is None:
        return "n/a"
    return f"{target['value']:.3f}{target['unit']}" if target["unit"] == "x" else f"{target['value']:.1f}{target['unit']}"


def combined(verdicts: list[str]) -> str:
    met = verdicts.count("met")
    if "n/a" in verdicts:
        return "n/a in a run"
    if met == len(verdicts):
        return "met in both"
    return "missed in both" if met == 0 else "met in one, missed in one"


def render(documents: list[dict[str, Any]], names: list[str]) -> str:
    by_name = [{t["name"]: t for t in d["targets"]} for d in documents]
    lines = [
        "# Issue 13 verdicts from two full benchmark runs",
        "",
        "Runs: "
        + "; ".join(
            f"`{name}` (git {d['machine'].get('git', {}).get('head', '?')}, {d['wall_seconds'] / 60:.0f} min, "
            f"load average at the end {', '.join(f'{x:.1f}' for x in d['machine'].get('loadavg_at_end', []))})"
            for name, d in zip(names, documents)
        )
        + ". Every ratio is between two medians of the same run.",
        "",
        "| target | run 1 | run 2 | verdict | details (run 2) |",
        "|---|---|---|---|---|",
    ]
    for name in by_name[0]:
        rows = [b.get(name) for b in by_name]
        if any(r is None for r in rows):
            continue
        lines.append(
            f"| {name} | {_value(rows[0])} | {_value(rows[1])} | **{combined([r['verdict'] for r in rows])}** "
            f"| {'; '.join(rows[1]['details'])} |"
        )
    lines += ["", "## fsync's cost, 1 GiB, safestage default: fsync on / off, seconds", ""]
    lines += ["| destination | run 1 | run 2 |", "|---|---|---|"]
    costs = [{r["dest"]: r for r in _issue13.fsync_cost(d)} for d in documents]
    for dest in costs[0]:
        cells = [
            f"{c[dest]['on']:.2f} / {c[dest]['off']:.2f} ({c[dest]['ratio']:.2f}x)" if dest in c else "n/a"
            for c in costs
        ]
        lines.append(f"| {documents[0]['destinations'][dest]} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs=2, type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    documents = [json.loads(p.read_text(encoding="utf-8")) for p in args.runs]
    for document in documents:  # recompute: a run's stored targets may predate a new one
        import _report

        document["targets"] = _report.targets(document) + _issue13.targets(document)
    args.out.write_text(render(documents, [p.stem for p in args.runs]), encoding="utf-8")
    print(args.out.read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
