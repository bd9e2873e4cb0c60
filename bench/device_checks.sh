#!/usr/bin/env bash
# What device validation costs (issue 21): the microbenchmarks of bench/ (our providers only) run against two
# builds made in the same call, one with the device error word compiled in (the default, strict mode off)
# and one with EAGLE3_DEVICE_CHECKS=0, alternating ROUNDS times; bench/compare_checks.py prints each case's
# best median under both and the ratio, and writes $OUT/device_checks.json.
# The logs (builds, each round's pytest tail) go to $OUT/device_checks.log, each round's rows to
# $OUT/<on|off><round>.json; a round is bounded by ROUND_TIMEOUT s, so a call cut short keeps the rounds that ended.
# Every round's process runs on the same CPUs (PIN_CPUS, through taskset where it exists): the eager rows time the
# host, and two processes of one build on different cores differed by half (device_checks_h200.log at f803251).
#   usage: OUT=... EAGLE3_COMMIT=... [REUSE=1] [ROUNDS=3] [ROUND_TIMEOUT=150] [BENCH_K='eagle3'] [PIN_CPUS=4-7]
#          bash bench/device_checks.sh [bench files...]
set -o pipefail
OUT=${OUT:-/tmp/eagle3_checks_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} EAGLE3_COMMIT=${EAGLE3_COMMIT:-unknown}
[ -x /usr/bin/g++ ] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc  # (bench/gpu_run.sh says why)
ROOT=$(pwd)
OFF=/tmp/eagle3_nochecks
BENCHES=("$@")
# every microbenchmark (bench_e2e.py, the decode loop, has its own script: bench/e2e_gpu.sh)
[ ${#BENCHES[@]} -eq 0 ] && BENCHES=($(ls bench/bench_*.py | grep -v bench_e2e))

LOG=$OUT/device_checks.log
# REUSE=1: a warm machine's two builds from an earlier call of this script (same sources) are timed again as they are
if [ "${REUSE:-0}" = 1 ] && [ -d "$OFF/eagle3_ops" ]; then
  rm -rf "$OFF.rows"; echo "reusing the builds already here" | tee -a "$LOG"
else
rm -rf "$OFF" "$OFF.rows" build && mkdir -p "$OFF"
tar --exclude=./build --exclude=./.git --exclude='*.so' -cf - . | tar -xf - -C "$OFF"
[ -e eagle3_ops/triton_kernels ] || ln -s ../triton_kernels eagle3_ops/triton_kernels
[ -e "$OFF/eagle3_ops/triton_kernels" ] || ln -s ../triton_kernels "$OFF/eagle3_ops/triton_kernels"
start=$(date +%s)
(MAX_JOBS=8 python3 setup.py build_ext --inplace > "$OFF.build_on.log" 2>&1) &
(cd "$OFF" && EAGLE3_DEVICE_CHECKS=0 MAX_JOBS=8 python3 setup.py build_ext --inplace > "$OFF.build_off.log" 2>&1) &
wait
tail -n 3 "$OFF.build_on.log" "$OFF.build_off.log" >> "$LOG"
echo "both builds took $(( $(date +%s) - start )) s" | tee -a "$LOG"
fi
python3 -c "import eagle3_ops; print('on :', eagle3_ops.build_info())" 2>&1 | tee -a "$LOG" || exit 1
(cd "$OFF" && python3 -c "import eagle3_ops; print('off:', eagle3_ops.build_info())") 2>&1 | tee -a "$LOG" || exit 1

PIN=()
command -v taskset > /dev/null && taskset -c "${PIN_CPUS:-4-7}" true 2> /dev/null && PIN=(taskset -c "${PIN_CPUS:-4-7}")
echo "rounds pinned to: ${PIN[*]:-(no taskset)}" | tee -a "$LOG"
for round in $(seq 1 "${ROUNDS:-3}"); do
  for variant in on off; do
    dir=$ROOT; [ $variant = off ] && dir=$OFF
    mkdir -p "$OFF.rows/$variant$round"
    echo "== round $round, checks $variant (started $(date +%T))" | tee -a "$LOG"
    (cd "$dir" && EAGLE3_BENCH_OUT="$OFF.rows/$variant$round" timeout "${ROUND_TIMEOUT:-150}" "${PIN[@]}" python3 -m pytest "${BENCHES[@]}" \
      -q -p no:cacheprovider -k "${BENCH_K:-eagle3}" > "$OFF.rows/$variant$round.log" 2>&1)
    echo "rc $?" >> "$LOG"
    tail -n 2 "$OFF.rows/$variant$round.log" | tee -a "$LOG"
    [ -e "$OFF.rows/$variant$round/bench.json" ] && cp "$OFF.rows/$variant$round/bench.json" "$OUT/$variant$round.json"
  done
done
python3 bench/compare_checks.py "$OUT" --json "$OUT/device_checks.json" 2>&1 | tee -a "$LOG"
