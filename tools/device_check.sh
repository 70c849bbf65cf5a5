#!/usr/bin/env bash
# Build, test, bench, disassemble, sanitize, mutate and run KernelBench on a CUDA machine. Logs go to $OUT
# (default ./device-out).
# Usage: tools/device_check.sh [smoke|pytest|bench|bench-fast|kernelbench|mutants|sass|sanitize|all]...
# smoke: tools/kernel_sweep.py on SMOKE_KERNELS under a timeout, before anything else: kernels no GPU has run yet
# show a hang or a wrong result there in a minute, not in the suite.
# kernelbench needs KERNELBENCH_DIR (a KernelBench checkout); it and bench write results/<gpu>.json.
# SANITIZE_CASES (case keys of harness.CASES or backends, e.g. "kernel") limits the sanitizer to those cases.
# COMMIT names the tree's commit for bench's results where this machine's .git does not hold the tree (bench.py
# records none where the tracked files differ from HEAD).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-device-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
steps=("${@:-all}")
want() { for s in "${steps[@]}"; do [[ $s == "$1" || $s == all ]] && return 0; done; return 1; }
status=0

{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())"
  python3 -c "import time; t = time.perf_counter(); import model_new; assert model_new.extension_available(); \
print(f'build + import: {time.perf_counter() - t:.1f} s')"; } 2>&1 | tee "$OUT/env.log" || status=1

if want smoke; then
  timeout "${SMOKE_TIMEOUT:-300}" python3 tools/kernel_sweep.py ${SMOKE_KERNELS:-} --trials 10 2>&1 | tee "$OUT/smoke.log"
  [[ ${PIPESTATUS[0]} == 0 ]] || status=1
fi
if want mutants; then  # in the background beside sass and pytest: it builds two extensions of its own
  python3 tools/mutants.py > "$OUT/mutants.log" 2>&1 &
  mutants_pid=$!
fi
if want sass; then
  lib=$(python3 -c "import model_new; print(model_new._ext.__file__)")
  cuobjdump --dump-sass "$lib" > /tmp/ext.sass
  { echo "HMMA: $(grep -c HMMA /tmp/ext.sass)  HGMMA: $(grep -c HGMMA /tmp/ext.sass)  LDL/STL: $(grep -cE '\b(LDL|STL)\b' /tmp/ext.sass)"
    grep -E "Function :" /tmp/ext.sass; } 2>&1 | tee "$OUT/sass.log"
fi
if want pytest; then
  python3 -m pytest -q -rs test_correctness.py 2>&1 | tee "$OUT/pytest.log" || status=1
fi
if want mutants; then  # finished before anything is timed
  wait "$mutants_pid" || status=1
  cat "$OUT/mutants.log"
fi
if want bench-fast; then
  python3 bench.py --skip-compile --output "$OUT/bench-fast.json" 2>&1 | tee "$OUT/bench-fast.log" || status=1
fi
if want bench; then
  python3 bench.py --measure-import ${COMMIT:+--commit "$COMMIT"} 2>&1 | tee "$OUT/bench.log" || status=1
fi
if want kernelbench; then
  python3 tools/kernelbench_eval.py 2>&1 | tee "$OUT/kernelbench.log" || status=1
fi
if want bench || want kernelbench; then
  cp results/*.json results/*.png "$OUT/" 2>/dev/null
fi
if want sanitize; then
  export PYTORCH_NO_CUDA_MEMORY_CACHING=1
  # memcheck: every case, the full problem too; racecheck: the ragged shapes (the full problem outlasts its limit)
  for tool in memcheck racecheck; do
    args=${SANITIZE_CASES:-}
    [[ $tool == racecheck ]] && args="--ragged $args"
    echo "== compute-sanitizer --tool $tool tools/sanitize.py $args"
    timeout "${SANITIZE_TIMEOUT:-240}" compute-sanitizer --tool "$tool" python3 tools/sanitize.py $args 2>&1 | grep -vE "^========= *$" | tail -n 60
  done 2>&1 | tee "$OUT/sanitize.log" || status=1
fi
exit $status
