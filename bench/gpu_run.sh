#!/usr/bin/env bash
# Everything that needs the H200, in one call (GPU.md): build for sm_90a, run the GPU tests, run the
# benchmarks, and leave logs, JSON and the table under $OUT (the table printed last).
#   usage: bash bench/gpu_run.sh [pytest -k expression for the GPU tests] [bench files...]
set -o pipefail
OUT=${OUT:-/tmp/eagle3_gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-16}
export EAGLE3_BENCH_OUT="$OUT" EAGLE3_COMMIT=${EAGLE3_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
KEXPR=${1:-}
shift || true
BENCHES=("$@")
[ ${#BENCHES[@]} -eq 0 ] && BENCHES=(bench/bench_*.py)

{
  echo "== machine"; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  echo "== build (commit $EAGLE3_COMMIT)"
  start=$(date +%s)
  # pip there cannot build without a network, so build in place and make the checkout look
  # installed: eagle3_ops.triton_kernels is the top-level triton_kernels/ folder (as setup.py maps it).
  python3 setup.py build_ext --inplace || exit 1
  [ -e eagle3_ops/triton_kernels ] || ln -s ../triton_kernels eagle3_ops/triton_kernels
  echo "build took $(( $(date +%s) - start )) s"
  python3 -c "import eagle3_ops; print(eagle3_ops.build_info())" || exit 1
} 2>&1 | tee "$OUT/build.log" || exit 1

echo "== gpu tests"
python3 -m pytest tests -m gpu -q ${KEXPR:+-k "$KEXPR"} -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -n 40
tests_rc=$?

echo "== benchmarks: ${BENCHES[*]}"
python3 -m pytest "${BENCHES[@]}" -q -p no:cacheprovider --benchmark-json="$OUT/pytest_benchmark.json" \
  --benchmark-columns=median 2>&1 | tee "$OUT/bench.log" | tail -n 60
bench_rc=$?
echo "tests rc=$tests_rc bench rc=$bench_rc"
exit $(( tests_rc || bench_rc ))
