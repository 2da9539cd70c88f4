#!/usr/bin/env bash
# Lightning's real FSDPStrategy on one GPU with the switch on (issue 25): sharded checkpoints to a
# local directory, committed whole, then two resumed fits. What landed and whether each check
# held: $OUT/report.txt, $OUT/report.json, $OUT/log.txt. A few minutes; no FUSE, no network.
#
#   OUT=/tmp/out bash benchmarks/gpu_lightning_fsdp.sh          # on the GPU machine ($OUT is set there)
#   OUT=/tmp/out bash benchmarks/gpu_lightning_fsdp.sh cpu      # here: ModelParallelStrategy (FSDP2) on CPU
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
work=$(mktemp -d /tmp/gpu-fsdp.XXXXXX)
mkdir -p "$work/root"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 SAFESTAGE_DIR=$work/root SAFESTAGE_LOG_LEVEL=INFO
PYTHON=${PYTHON:-python3}
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
"$PYTHON" benchmarks/gpu_lightning_fsdp.py --out "$OUT" --dir "$work" --accelerator "${1:-gpu}" 2>&1 | tee "$OUT/log.txt"
status=${PIPESTATUS[0]}
echo "exit status $status" | tee -a "$OUT/report.txt"
exit "$status"
