#!/usr/bin/env bash
# Everything that needs the H200, in one call (docs/method.md): build for sm_90a, run the GPU tests, run the
# benchmarks, and leave logs, JSON and the table under $OUT (the table printed last).
#   usage: [SKIP_BUILD=1] [SANITIZE='-k expr'] bash bench/gpu_run.sh [pytest -k expression for the GPU tests] [bench files... | none]
#   SANITIZE runs the GPU tests matching that expression under compute-sanitizer memcheck.
#   TESTS='tests/test_kv_accept.py ...' selects the test files (their GPU tests run in chunks of TEST_CHUNK node ids,
#   TEST_JOBS pytest processes at once); EAGLE3_CUDA_ONLY=a,b
#   builds only those kernels (setup.py: csrc/<name>.cu, or its KERNEL_PARTS, e.g. compat_sglang's three files,
#   mla_decode_sm90's two);
#   EAGLE3_COMMIT names the commit in the results (required in practice).
set -o pipefail
OUT=${OUT:-/tmp/eagle3_gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-16}
# The image's CXX (/opt/gcc/bin/g++, a wrapper) links libstdc++ statically into the extension, whose
# private copy of the locale then crashes the first integer formatted into an error message (seen on
# the H200: a segfault in std::ostream inside _C.so). The system compilers link it shared.
[ -x /usr/bin/g++ ] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc
# Pass EAGLE3_COMMIT: the device checkout's .git can be older than the files copied in (seen: it named the
# session's first commit while later files ran), so its HEAD is not evidence of what ran.
export EAGLE3_BENCH_OUT="$OUT" EAGLE3_COMMIT=${EAGLE3_COMMIT:-unknown}
KEXPR=${1:-}
shift || true
BENCHES=("$@")
[ ${#BENCHES[@]} -eq 0 ] && BENCHES=(bench/bench_*.py)
[ "${BENCHES[*]}" = none ] && BENCHES=()  # "none": tests only (a sweep follows in the same call)

{
  echo "== machine"; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  echo "== build (commit $EAGLE3_COMMIT)"
  start=$(date +%s)
  # pip there cannot build without a network, so build in place and make the checkout look
  # installed: eagle3_ops.triton_kernels is the top-level triton_kernels/ folder (as setup.py maps it).
  # A warm machine keeps the last call's build/ folder, whose objects can be newer than the sources copied in
  # now (ninja then says "no work to do" and the old kernels run): always build from scratch.
  # SKIP_BUILD=1: use the build already in place (made earlier in the same call, e.g. by bench/device_checks.sh)
  if [ "${SKIP_BUILD:-0}" = 1 ]; then echo "using the build in place" > "$OUT/.build_raw.log"; else
  rm -rf build
  python3 setup.py build_ext --inplace 2>&1 | tee "$OUT/.build_raw.log" || exit 1
  fi
  # ptxas reports wgmmas it serialises (every one then waited for: ~2x slower) as "info", not as a warning or
  # an error (C7510-C7520; seen at 19a402e, where the line sat unread in this log): fail the build on it
  if grep -E "\(C75(1[0-9]|20)\)" "$OUT/.build_raw.log"; then
    echo "BUILD REFUSED: ptxas serialised wgmma instructions (lines above)"; rm -f "$OUT/.build_raw.log"; exit 1
  fi
  rm -f "$OUT/.build_raw.log"
  [ -e eagle3_ops/triton_kernels ] || ln -s ../triton_kernels eagle3_ops/triton_kernels
  echo "build took $(( $(date +%s) - start )) s"
  python3 -c "import eagle3_ops; print(eagle3_ops.build_info())" || exit 1
} 2>&1 | tee "$OUT/build.log" || exit 1

# GPU tests in parallel pytest processes, TEST_JOBS (6) at once: tests are not timed, the float64 references
# leave the GPU far from full, and device time is the scarce thing. A file's selected GPU tests are split
# into chunks of at most TEST_CHUNK (16) node ids, so that no one file is the pole (test_tree_attention.py's
# 75 alone took 5 minutes in one process).
echo "== gpu tests"
TLOG=$(mktemp -d)
export KEXPR TLOG
tests_rc=0
for f in ${TESTS:-tests/test_*.py}; do
  name=$(basename "$f" .py)
  python3 -m pytest "$f" -m gpu -q --collect-only -p no:cacheprovider ${KEXPR:+-k "$KEXPR"} > "$TLOG/$name.collect" 2>&1
  rc=$?
  if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then  # a collection error: shown, and the run fails
    echo "$name: COLLECTION FAILED (rc $rc)"; tail -n 5 "$TLOG/$name.collect"; tests_rc=1
  fi
  grep '::' "$TLOG/$name.collect" > "$TLOG/$name.ids"
  # the fuzz tests (hundreds of examples each) one a chunk, so that they run side by side
  chunk=${TEST_CHUNK:-16}; [ "$name" = test_fuzz_gpu ] && chunk=1
  split -d -l "$chunk" "$TLOG/$name.ids" "$TLOG/$name.chunk"
done
# (node ids, one a line, may hold spaces and [...]: passed NUL-separated, never split or globbed)
# Each chunk is bounded (CHUNK_TIMEOUT s, 300; a test by TEST_TIMEOUT s, 150, through pytest-timeout, which
# dumps every thread's stack, so a hang names its test), and its log is appended to $OUT/progress.log as it
# ends, so a call stopped at its limit still brings back what finished.
export OUT
{ ls "$TLOG" | grep '^test_fuzz_gpu\.chunk[0-9]*$'; ls "$TLOG" | grep -v '^test_fuzz_gpu' | grep '\.chunk[0-9]*$'; } | xargs -r -P "${TEST_JOBS:-6}" -I{} sh -c '
  tr "\n" "\0" < "$TLOG/{}" | timeout "${CHUNK_TIMEOUT:-300}" xargs -0 python3 -m pytest -m gpu -q -p no:cacheprovider \
    -rf --tb=short --timeout "${TEST_TIMEOUT:-150}" --timeout-method thread > "$TLOG/{}.log" 2>&1
  echo $? > "$TLOG/{}.rc"
  { echo "== {} rc $(cat "$TLOG/{}.rc") at $(date +%T)"; tail -n 60 "$TLOG/{}.log"; } >> "$OUT/progress.log"'
for ids in "$TLOG"/*.ids; do
  name=$(basename "$ids" .ids)
  echo "== $name ($(wc -l < "$ids") GPU tests)" >> "$OUT/tests.log"
  finals=""
  for log in "$TLOG/$name".chunk*.log; do
    [ -e "$log" ] || continue
    cat "$log" >> "$OUT/tests.log"
    finals="$finals$(grep -E '^=*\s*[0-9]+ (passed|failed|skipped|errors?|deselected)' "$log" | tail -n 1), "
    grep -E '^(FAILED|ERROR)' "$log" | head -n 10
    [ "$(cat "${log%.log}.rc")" = 0 ] || tests_rc=1
  done
  # the chunks' final lines summed: "N passed, M skipped" per file
  echo "$name: $(echo "$finals" | grep -oE '[0-9]+ (passed|failed|skipped|errors?)' \
    | awk '{n[$2] += $1} END {for (k in n) printf "%d %s  ", n[k], k}')$([ -s "$TLOG/$name.ids" ] || echo 'no GPU tests')"
done

echo "== self-check on the GPU (every CUDA kernel against the CPU reference)"
python3 -m eagle3_ops selfcheck --device cuda 2>&1 | tee "$OUT/selfcheck.log"
selfcheck_rc=$?

if [ -n "${SANITIZE:-}" ]; then
  echo "== compute-sanitizer memcheck: -k '$SANITIZE'"
  PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --error-exitcode 9 \
    python3 -m pytest ${TESTS:-tests} -m gpu -q -k "$SANITIZE" -p no:cacheprovider 2>&1 | tee "$OUT/sanitizer.log" | tail -n 15
  sanitize_rc=$?
fi

bench_rc=0
if [ ${#BENCHES[@]} -gt 0 ]; then
  echo "== benchmarks: ${BENCHES[*]}"
  python3 -m pytest "${BENCHES[@]}" -q -p no:cacheprovider --benchmark-json="$OUT/pytest_benchmark.json" \
    --benchmark-columns=median 2>&1 | tee "$OUT/bench.log" | tail -n 60
  bench_rc=$?
fi
echo "tests rc=$tests_rc selfcheck rc=$selfcheck_rc sanitizer rc=${sanitize_rc:-not run} bench rc=$bench_rc"
exit $(( tests_rc || selfcheck_rc || ${sanitize_rc:-0} || bench_rc ))
