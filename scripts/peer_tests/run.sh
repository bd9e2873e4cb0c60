#!/usr/bin/env bash
# Runs the five public peer test files against eagle3_ops.compat (see conftest.py for how the device is picked
# and what is marked). From the repository root:
#   CPU:  scripts/peer_tests/run.sh                      (PEER_DEVICE defaults to cpu when torch sees no CUDA device;
#                                                  the SGLang files' device="cuda" is mapped to the CPU)
#   H200: scripts/peer_tests/run.sh                      (PEER_DEVICE defaults to cuda: the SGLang files run on CUDA as
#                                                  published, vLLM's DEVICE_TYPE is "cuda"; needs the extension
#                                                  built in place first)
# Env: PYTHON (default .venv/bin/python if present, else python3); PEER_DEVICE=cpu|cuda to force a device;
#      EAGLE3_COMPAT_KERNELS=triton / EAGLE3_VLLM_KERNELS=tensor select the compat modules' other CUDA paths.
# Each file runs in its own pytest process (vLLM's file sets torch's default device in one test); the exit
# status is non-zero if any file had a failure or error.
set -u
cd "$(dirname "$0")/../.."
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
rc=0
for f in test_sgl_kernel_eagle_utils.py test_sgl_kernel_speculative_sampling.py test_srt_build_eagle_tree.py \
         test_jit_eagle_utils.py test_vllm_rejection_sampler.py; do
    echo "==== scripts/peer_tests/$f (PEER_DEVICE=${PEER_DEVICE:-auto})"
    "$PYTHON" -m pytest "scripts/peer_tests/$f" -q -p no:cacheprovider -rfEsxX "$@" || rc=1
done
echo "==== overall: $([ $rc = 0 ] && echo 'no failures' || echo 'FAILURES (see above)')"
exit $rc
