#!/usr/bin/env bash
# Nsight Compute counters of the fused kernel, one precision at a time (default: all four). Logs under $OUT.
#   tools/profile.sh [tf32|strict_fp32|bf16|fp16]...
# SECTIONS overrides the ncu sections (default: speed of light, warp states with the stall breakdown, occupancy).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device-out}
mkdir -p "$OUT"
SECTIONS=${SECTIONS:-"SpeedOfLight WarpStateStats Occupancy"}
args=()
for s in $SECTIONS; do args+=(--section "$s"); done
precisions=("$@")
[[ ${#precisions[@]} -gt 0 ]] || precisions=(tf32 strict_fp32 bf16 fp16)
for precision in "${precisions[@]}"; do
  ncu --clock-control none -k regex:conv3x3_min_tanh2_kernel --launch-skip 1 --launch-count 1 "${args[@]}" \
    --page raw python3 tools/run_once.py "$precision" > "$OUT/ncu_${precision}.txt" 2>&1
  echo "ncu ${precision}: rc=$? $(grep -c . "$OUT/ncu_${precision}.txt") lines"
done
