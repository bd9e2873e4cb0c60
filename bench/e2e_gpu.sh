#!/usr/bin/env bash
# Issue 7 on the H200 in one call: build, the engine's GPU tests (the grouped MoE in a graph, the graphed loop
# against the eager one), then bench/bench_e2e.py with CUDA graphs; logs, e2e.json under $OUT.
#   usage: [EAGLE3_COMMIT=sha] [E2E_ARGS='--batch 1 --prefix 4096'] [E2E_TIMEOUT=s] [SKIP_BUILD=1] bash bench/e2e_gpu.sh
#   E2E_PROFILE='profile_e2e.py args': then bench/profile_e2e.py into $OUT/profile_e2e.log
#   SKIP_BUILD=1: on a warm machine whose last call built the same csrc/, reuse that build (no tests)
# Plot on a machine with matplotlib: python bench/bench_e2e.py --plot e2e.json
set -o pipefail
OUT=${OUT:-/tmp/eagle3_gpu_out}
mkdir -p "$OUT"
if [ "${SKIP_BUILD:-0}" = 1 ] && ls eagle3_ops/_C*.so > /dev/null 2>&1; then
  # a warm machine's last build of the same C++/CUDA sources (only Python changed since): no rebuild, no tests
  echo "SKIP_BUILD: reusing $(ls eagle3_ops/_C*.so)"; tests_rc=0
else
  TESTS="tests/test_torch_glue.py tests/test_target.py tests/test_fused_round.py" bash "$(dirname "$0")/gpu_run.sh" "" none \
    > "$OUT/e2e_build_tests.log" 2>&1
  tests_rc=$?
  grep -E "^test_|FAILED|rc=" "$OUT/e2e_build_tests.log"
fi
export EAGLE3_BENCH_OUT="$OUT"
# shellcheck disable=SC2086
timeout "${E2E_TIMEOUT:-420}" python3 bench/bench_e2e.py --graphs ${E2E_ARGS:---batch 1 --prefix 4096 --fixpoint 3} --json "$OUT/e2e.json" 2>&1 | tee "$OUT/e2e.log" \
  | grep -vE "^\|" | tail -n 40
bench_rc=$?
if [ -n "${E2E_PROFILE:-}" ]; then  # E2E_PROFILE='--batch 1 --spec "chain 3/1/4"': where a round's time goes
  eval "timeout 240 python3 bench/profile_e2e.py $E2E_PROFILE" > "$OUT/profile_e2e.log" 2>&1
  grep -E "rounds|decode phase" "$OUT/profile_e2e.log"
fi
echo "tests rc=$tests_rc bench rc=$bench_rc"
exit $(( tests_rc || bench_rc ))
