#!/usr/bin/env bash
# Timing probes and Nsight Compute counters for the fused kernel (both MMA kinds). Logs under $OUT.
# (The ncu kernel filter matches the demangled base names conv3x3_min_tanh2_{wgmma,mma_sync}_kernel.)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 tools/experiments.py 2>&1 | tee "$OUT/experiments.log"
for kind in wgmma mma_sync; do
  ncu --clock-control none -k "regex:${kind}_kernel" --launch-count 1 --set full --page raw --csv \
    python3 tools/experiments.py --only base --trials 1 > "$OUT/ncu_${kind}.csv" 2> "$OUT/ncu_${kind}.err"
  echo "ncu ${kind}: rc=$? $(wc -c < "$OUT/ncu_${kind}.csv") bytes"
done
