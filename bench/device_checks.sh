#!/usr/bin/env bash
# What device validation costs (issue 21): the microbenchmarks of bench/ (our providers only) run against two
# builds made in the same call, one with the device error word compiled in (the default, strict mode off)
# and one with EAGLE3_DEVICE_CHECKS=0, alternating ROUNDS times; bench/compare_checks.py prints each case's
# best median under both and the ratio, and writes $OUT/device_checks.json.
#   usage: OUT=... EAGLE3_COMMIT=... [ROUNDS=2] [BENCH_K='eagle3'] bash bench/device_checks.sh [bench files...]
set -o pipefail
OUT=${OUT:-/tmp/eagle3_checks_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} EAGLE3_COMMIT=${EAGLE3_COMMIT:-unknown}
[ -x /usr/bin/g++ ] && export CXX=/usr/bin/g++ CC=/usr/bin/gcc  # (bench/gpu_run.sh says why)
ROOT=$(pwd)
OFF=/tmp/eagle3_nochecks
BENCHES=("$@")
[ ${#BENCHES[@]} -eq 0 ] && BENCHES=(bench/bench_build_tree.py bench/bench_capture.py bench/bench_capture_aux.py
  bench/bench_fc.py bench/bench_kv_accept.py bench/bench_tree_attention.py bench/bench_verify.py bench/bench_verify_sampling.py)

rm -rf "$OFF" build && mkdir -p "$OFF"
tar --exclude=./build --exclude=./.git -cf - . | tar -xf - -C "$OFF"
[ -e eagle3_ops/triton_kernels ] || ln -s ../triton_kernels eagle3_ops/triton_kernels
[ -e "$OFF/eagle3_ops/triton_kernels" ] || ln -s ../triton_kernels "$OFF/eagle3_ops/triton_kernels"
start=$(date +%s)
(MAX_JOBS=8 python3 setup.py build_ext --inplace > "$OUT/build_on.log" 2>&1) &
(cd "$OFF" && EAGLE3_DEVICE_CHECKS=0 MAX_JOBS=8 python3 setup.py build_ext --inplace > "$OUT/build_off.log" 2>&1) &
wait
echo "both builds took $(( $(date +%s) - start )) s"
python3 -c "import eagle3_ops; print('on :', eagle3_ops.build_info())" || exit 1
(cd "$OFF" && python3 -c "import eagle3_ops; print('off:', eagle3_ops.build_info())") || exit 1

for round in $(seq 1 "${ROUNDS:-2}"); do
  for variant in on off; do
    dir=$ROOT; [ $variant = off ] && dir=$OFF
    mkdir -p "$OUT/$variant$round"
    echo "== round $round, checks $variant"
    (cd "$dir" && EAGLE3_BENCH_OUT="$OUT/$variant$round" python3 -m pytest "${BENCHES[@]}" -q -p no:cacheprovider \
      -k "${BENCH_K:-eagle3}" > "$OUT/$variant$round/bench.log" 2>&1)
    tail -n 2 "$OUT/$variant$round/bench.log"
  done
done
python3 bench/compare_checks.py "$OUT" --json "$OUT/device_checks.json"
