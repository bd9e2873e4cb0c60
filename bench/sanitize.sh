#!/usr/bin/env bash
# compute-sanitizer over the GPU test suite (issue 21), on an extension already built in place
# (bench/gpu_run.sh or bench/device_checks.sh first, in the same call):
#  - memcheck over every GPU test, JOBS sanitizer processes at once, CHUNK test ids each;
#  - racecheck and synccheck over the tests of the kernels that use shared memory, clusters or bulk copies
#    (RACE_K selects them, or RACE_IDS names test ids, space-separated; RACE=0 skips them). MEMCHECK=0 skips memcheck.
#    racecheck's known false positives (bench/results/sanitizer_d197f45_h200.log): mla_decode_kernel's s_alpha
#    handoff between its warpgroups, ordered by named barriers (bar.arrive / bar.sync), which racecheck does not
#    model, and torch's own argmax reduce_kernel; any other kernel in its report is ours to fix.
# Each chunk's "ERROR SUMMARY" and pytest result line is appended to $OUT/sanitizer.log as soon as the chunk ends,
# and a failing chunk's log to $OUT/sanitizer_failures.log, so that a call cut short still leaves what ran.
# Chunks not started DEADLINE seconds after the start are listed as "not run". The exit status is non-zero if
# any tool reported an error, any test failed, or any chunk did not run.
#   usage: OUT=... [JOBS=8] [CHUNK=40] [TESTS='tests/test_*.py'] [DEADLINE=s] [RACE_K=...|RACE_IDS=...] [MEMCHECK=0]
#          bash bench/sanitize.sh
set -o pipefail
OUT=${OUT:-/tmp/eagle3_sanitize_out}
mkdir -p "$OUT"
# Without the caching allocator memcheck sees every allocation's bounds, but a CUDA-graph test's allocation
# inside its capture then calls cudaMalloc, which capture forbids (seen on the H200): graph tests run with it on.
# EAGLE3_SANITIZER: tests that count kernels with torch.profiler skip (it records none under compute-sanitizer)
export PYTHONUNBUFFERED=1 EAGLE3_FUZZ_EXAMPLES=${EAGLE3_FUZZ_EXAMPLES:-25} EAGLE3_SANITIZER=1 OUT
S=$(mktemp -d)
export S END=$(( $(date +%s) + ${DEADLINE:-100000} ))
if [ "${MEMCHECK:-1}" = 0 ]; then : > "$S/all"; else
python3 -m pytest ${TESTS:-tests} -m gpu -q --collect-only -p no:cacheprovider 2>/dev/null | grep '::' > "$S/all"; fi
# graph tests in chunks of their own (see above)
{ grep -v graph "$S/all"; grep graph "$S/all"; } > "$S/ids"
split -d -a 3 -l "${CHUNK:-40}" "$S/ids" "$S/chunk"
echo "memcheck: $(wc -l < "$S/ids") GPU tests in $(ls "$S"/chunk* | wc -l) chunks, ${JOBS:-8} at once" | tee -a "$OUT/sanitizer.log"
ls "$S" | grep '^chunk' | xargs -r -P "${JOBS:-8}" -I{} sh -c '
  c={}; first=$(head -n 1 "$S/$c"); n=$(wc -l < "$S/$c")
  if [ "$(date +%s)" -ge "$END" ]; then echo "memcheck $c: not run (deadline) | $n tests from $first" >> "$OUT/sanitizer.log"; exit 0; fi
  case "$(cat "$S/$c")" in *graph*) cache=0 ;; *) cache=1 ;; esac
  tr "\n" "\0" < "$S/$c" | PYTORCH_NO_CUDA_MEMORY_CACHING=$cache xargs -0 compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 20 \
    python3 -m pytest -m gpu -q -p no:cacheprovider -x --tb=short > "$S/$c.log" 2>&1
  rc=$?
  summary=$(grep -h "ERROR SUMMARY" "$S/$c.log" | tail -n 1)
  result=$(grep -hE "^=*\s*[0-9]+ (passed|failed)" "$S/$c.log" | tail -n 1)
  echo "memcheck $c: ${summary:-no summary} | ${result:-no pytest result} | rc $rc | $n tests from $first" >> "$OUT/sanitizer.log"
  [ $rc = 0 ] || cat "$S/$c.log" >> "$OUT/sanitizer_failures.log"'
for tool in racecheck synccheck; do
  [ "${RACE:-1}" = 0 ] && break
  if [ -n "${RACE_IDS:-}" ]; then sel=($RACE_IDS); else
    sel=(tests -k "${RACE_K:-(kv_accept or verify_greedy or sm90 or add_rmsnorm or build_tree) and not fuzz}"); fi
  timeout "${RACE_TIMEOUT:-240}" compute-sanitizer --tool $tool --error-exitcode 9 --print-limit 20 python3 -m pytest "${sel[@]}" -m gpu -q \
    -p no:cacheprovider --tb=short > "$S/$tool.log" 2>&1
  trc=$?
  echo "$tool: $(grep -h 'ERROR SUMMARY' "$S/$tool.log" | tail -n 1) | $(grep -hE '^=*\s*[0-9]+ (passed|failed)' "$S/$tool.log" | tail -n 1) | rc $trc" >> "$OUT/sanitizer.log"
  [ $trc = 0 ] || cat "$S/$tool.log" >> "$OUT/sanitizer_failures.log"
done
rc=0
grep -qE "rc [1-9]|not run" "$OUT/sanitizer.log" && rc=1
tail -n 60 "$OUT/sanitizer.log"
grep -h "ERROR SUMMARY" "$S"/*.log | sort | uniq -c
echo "sanitizer rc=$rc"
exit $rc
