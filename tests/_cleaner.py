"""A cleaner in another process (test_invariant_walk): reads directory paths, one per line, runs
`safestage clean`'s own function on each and answers one JSON line per path with what it
did. Started plainly and under ``unshare --pid --fork`` (another PID namespace, where the
saver's pid is invisible and only its locks protect it)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from safestage._clean import clean


def main() -> int:
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        path = line.rstrip("\n")
        try:
            entries = [e.to_json() for e in clean(Path(path))]
        except OSError as exc:
            entries = [{"error": str(exc)}]
        print(json.dumps({"path": path, "entries": entries}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
