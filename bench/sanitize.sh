#!/usr/bin/env bash
# compute-sanitizer over the GPU test suite (issue 21), on an extension already built in place
# (bench/gpu_run.sh or bench/device_checks.sh first, in the same call):
#  - memcheck over every GPU test, JOBS sanitizer processes at once, CHUNK test ids each;
#  - racecheck and synccheck over the tests of the kernels that use shared memory, clusters or bulk copies
#    (RACE_K selects them).
# Each process's "ERROR SUMMARY" goes to $OUT/sanitizer.log with the failing chunks' logs; the exit status is
# non-zero if any tool reported an error or any test failed.
#   usage: OUT=... [JOBS=8] [CHUNK=40] [TESTS='tests/test_*.py'] [RACE_K=...] bash bench/sanitize.sh
set -o pipefail
OUT=${OUT:-/tmp/eagle3_sanitize_out}
mkdir -p "$OUT"
# Without the caching allocator memcheck sees every allocation's bounds, but a CUDA-graph test's allocation
# inside its capture then calls cudaMalloc, which capture forbids (seen on the H200): graph tests run with it on.
export PYTHONUNBUFFERED=1 EAGLE3_FUZZ_EXAMPLES=${EAGLE3_FUZZ_EXAMPLES:-25}
S=$(mktemp -d)
# graph tests in chunks of their own (see above)
python3 -m pytest ${TESTS:-tests} -m gpu -q --collect-only -p no:cacheprovider 2>/dev/null | grep '::' > "$S/all"
{ grep -v graph "$S/all"; grep graph "$S/all"; } > "$S/ids"
split -d -a 3 -l "${CHUNK:-40}" "$S/ids" "$S/chunk"
echo "memcheck: $(wc -l < "$S/ids") GPU tests in $(ls "$S"/chunk* | wc -l) chunks, ${JOBS:-8} at once"
export S
ls "$S" | grep '^chunk' | xargs -r -P "${JOBS:-8}" -I{} sh -c '
  case "$(cat "$S/{}")" in *graph*) cache=0 ;; *) cache=1 ;; esac
  tr "\n" "\0" < "$S/{}" | PYTORCH_NO_CUDA_MEMORY_CACHING=$cache xargs -0 compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 20 \
    python3 -m pytest -m gpu -q -p no:cacheprovider -x --tb=short > "$S/{}.log" 2>&1
  echo $? > "$S/{}.rc"'
rc=0
for log in "$S"/chunk*.log; do
  c=$(basename "$log" .log)
  summary=$(grep -h "ERROR SUMMARY" "$log" | tail -n 1)
  result=$(grep -hE '^=*\s*[0-9]+ (passed|failed)' "$log" | tail -n 1)
  echo "memcheck $c: ${summary:-no summary} | ${result:-no pytest result} | rc $(cat "$S/$c.rc")" >> "$OUT/sanitizer.log"
  if [ "$(cat "$S/$c.rc")" != 0 ]; then rc=1; cat "$log" >> "$OUT/sanitizer_failures.log"; fi
done
for tool in racecheck synccheck; do
  timeout "${RACE_TIMEOUT:-240}" compute-sanitizer --tool $tool --error-exitcode 9 --print-limit 20 python3 -m pytest tests -m gpu -q -p no:cacheprovider \
    -k "${RACE_K:-(kv_accept or verify_greedy or sm90 or add_rmsnorm or build_tree) and not fuzz}" --tb=short > "$S/$tool.log" 2>&1
  trc=$?
  echo "$tool: $(grep -h 'ERROR SUMMARY' "$S/$tool.log" | tail -n 1) | $(grep -hE '^=*\s*[0-9]+ (passed|failed)' "$S/$tool.log" | tail -n 1) | rc $trc" >> "$OUT/sanitizer.log"
  [ $trc = 0 ] || { rc=1; cat "$S/$tool.log" >> "$OUT/sanitizer_failures.log"; }
done
awk -F'|' '{print}' "$OUT/sanitizer.log" | tail -n 40
grep -h "ERROR SUMMARY" "$S"/*.log | sort | uniq -c
echo "sanitizer rc=$rc"
exit $rc
