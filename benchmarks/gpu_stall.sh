#!/usr/bin/env bash
# The GPU mode of the stall benchmark (issue 26), as one prepared run on a GPU machine: a bf16
# state of $STALL_GIB GiB (default 4) on the GPU, saved by every way of benchmarks/stall.py's
# GPU mode (pinned copy, t.cpu(), plain save_file, staged_dir / activate background with and
# without snapshots, DCP async_save with default and pinned staging), staging root and dest on
# one local filesystem. Needs no network and installs nothing: the machine's python3 with CUDA
# torch and safetensors, and this tree on PYTHONPATH. At most ~6.5 minutes (preflight ~30 s included): saves start only
# in the first $STALL_DEADLINE_S seconds (default 240), the Python run is stopped (SIGINT, then
# KILL) after $STALL_LIMIT_S (default 330), and whatever was measured is written anyway.
#
#   bash benchmarks/gpu_stall.sh                          # on the GPU machine: results in $OUT
#   OUT=/tmp/out STALL_REHEARSE=1 bash benchmarks/gpu_stall.sh   # here, no GPU: the same flow on CPU tensors
#
# $OUT gets: machine.txt (what was used: nvidia-smi, versions, the filesystem and its write
# speed), log.txt (the run), stall-gpu.json and stall-gpu.md (the figures).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
GIB=${STALL_GIB:-4}
REPEATS=${STALL_REPEATS:-3}
DEADLINE=${STALL_DEADLINE_S:-240}
LIMIT=${STALL_LIMIT_S:-330}
REHEARSE=${STALL_REHEARSE:-0}

# Nothing of safestage's configuration may leak in: the plain ways must stay plain.
for name in $(env | sed -n 's/^\(SAFESTAGE[A-Z_]*\)=.*/\1/p'); do unset "$name"; done
export PYTHONPATH=$repo${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

# Where the staging root and dest go: $STALL_DIR, else the first of /var/tmp, /tmp that is not
# tmpfs (an fsync into RAM is not durable), else /tmp.
pick_dir() {
    if [ -n "${STALL_DIR:-}" ]; then echo "$STALL_DIR"; return; fi
    for dir in /var/tmp /tmp; do
        if [ -d "$dir" ] && [ -w "$dir" ] && [ "$(stat -f -c %T "$dir")" != "tmpfs" ]; then echo "$dir"; return; fi
    done
    echo /tmp
}
WORK_PARENT=$(pick_dir)
mkdir -p "$WORK_PARENT"

{
    echo "== gpu_stall.sh $(date -Is)"
    echo "repo: $repo (git $(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo '?'))"
    echo "python: $(command -v "$PYTHON" || echo "$PYTHON: not found")"
    echo "state: $GIB GiB bf16, $REPEATS repeats, saves start within ${DEADLINE} s, run stopped after ${LIMIT} s"
    echo "rehearsal on CPU tensors: $REHEARSE"
    echo "== machine"
    uname -srm
    echo "cpus: $(nproc)"
    free -g | sed -n '1,2p'
    echo "== nvidia-smi"
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv || true
        nvidia-smi || true
    else
        echo "nvidia-smi: not on PATH"
    fi
    echo "== filesystems (staging root and dest under $WORK_PARENT)"
    df -hT "$WORK_PARENT" /tmp /dev/shm 2>/dev/null || true
    probe="$WORK_PARENT/gpu-stall-probe.$$"
    echo "write speed of $WORK_PARENT, 512 MiB with fsync (dd conv=fsync):"
    dd if=/dev/zero of="$probe" bs=16M count=32 conv=fsync 2>&1 | tail -1 || true
    rm -f "$probe"
} 2>&1 | tee "$OUT/machine.txt"

# What Python has: torch with CUDA, safetensors and safestage's other needs, and safestage
# from this tree (not an installed copy).
echo "== python packages" | tee -a "$OUT/machine.txt"
set +e
"$PYTHON" - "$repo" "$REHEARSE" <<'EOF' 2>&1 | tee -a "$OUT/machine.txt"
import importlib, os, sys
repo, rehearse = sys.argv[1], sys.argv[2] == "1"
print("python", sys.version.split()[0], sys.executable)
missing = []
for name in ("torch", "safetensors", "numpy", "wrapt", "tqdm"):
    try:
        module = importlib.import_module(name)
        print(f"{name} {getattr(module, '__version__', '?')}")
    except Exception as exc:
        missing.append(f"{name} ({type(exc).__name__}: {exc})")
if missing:
    sys.exit("cannot run: missing " + ", ".join(missing) + f" in {sys.executable}; set PYTHON=/path/to/python3 that has them")
import torch
print("torch.version.cuda", torch.version.cuda, "cuda available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
elif not rehearse:
    sys.exit(f"cannot run: torch {torch.__version__} in {sys.executable} sees no CUDA device "
             "(torch.cuda.is_available() is False); STALL_REHEARSE=1 runs the flow on CPU tensors")
try:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: F401
    print("DCP pinned stager: torch.distributed.checkpoint.staging.DefaultStager")
except ImportError as exc:
    print(f"DCP pinned stager: none in this torch ({exc}); those ways are skipped")
import safestage
print("safestage", safestage.__version__, safestage.__file__)
if not os.path.realpath(safestage.__file__).startswith(os.path.realpath(repo) + os.sep):
    sys.exit(f"cannot run: safestage comes from {safestage.__file__}, not from this tree {repo}")
EOF
status=${PIPESTATUS[0]}
set -e
if [ "$status" -ne 0 ]; then
    echo "exit status $status (the checks above failed: nothing was measured)" | tee -a "$OUT/machine.txt"
    exit "$status"
fi

if [ "$REHEARSE" = 1 ]; then
    device=(--rehearse --tensor-mib 32)
else
    device=(--device cuda)
fi
echo "== stall.py GPU mode" | tee "$OUT/log.txt"
set +e
timeout --signal=INT --kill-after=20 "$LIMIT" \
    "$PYTHON" benchmarks/stall.py "${device[@]}" --gib "$GIB" --repeats "$REPEATS" --deadline-s "$DEADLINE" \
    --dir "$WORK_PARENT" --results-dir "$OUT" --out stall-gpu 2>&1 | tee -a "$OUT/log.txt"
status=${PIPESTATUS[0]}
set -e
rm -rf "$WORK_PARENT"/safestage-stall-gpu-* 2>/dev/null || true  # left only by a run killed hard
case "$status" in
    0) note="all ways measured" ;;
    1) note="some way failed: see the FAILED lines of $OUT/stall-gpu.md" ;;
    124 | 130 | 137) note="stopped at the ${LIMIT} s limit: $OUT/stall-gpu.md holds what was measured" ;;
    *) note="the run failed: see $OUT/log.txt" ;;
esac
echo "exit status $status ($note)" | tee -a "$OUT/log.txt"
exit "$status"
