"""Compile csrc/*.cu files to throw-away objects with the extension's flags, for one or more architectures:
a quick check that a kernel builds (no GPU needed), without touching the installed extension.

    python scripts/nvcc_check.py csrc/kv_accept.cu [more.cu ...] [--arch 9.0a --arch 8.0] [-D NAME ...] [--ptxas] [-j 2]

CI runs it over every source for 8.0 (`make compile-check`, next to the real sm_90a build), so that an
unguarded Hopper-only instruction fails CI instead of a user's build.
"""

import argparse
import concurrent.futures
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sources", nargs="+")
    p.add_argument("--arch", action="append", help="e.g. 9.0a, 9.0, 8.0 (default 9.0a)")
    p.add_argument("-D", dest="defines", action="append", default=[])
    p.add_argument("--ptxas", action="store_true", help="print ptxas register / spill lines")
    p.add_argument("-j", dest="jobs", type=int, default=1, help="files compiled at once (default 1)")
    a = p.parse_args()
    from torch.utils.cpp_extension import include_paths  # torch's headers; nvcc on PATH knows its own

    archs = a.arch or ["9.0a"]
    gencode = []
    for arch in archs:
        num = arch.replace(".", "")
        gencode += [f"-gencode=arch=compute_{num},code=sm_{num}"]
    import sysconfig

    import glob

    incs = [os.path.join(HERE, "csrc", "include")] + include_paths() + [sysconfig.get_paths()["include"]]
    for path in sys.path:  # CUDA libraries' headers that pip installed beside torch (cuSPARSE, cuBLAS, ...)
        incs += sorted(glob.glob(os.path.join(path, "nvidia", "*", "include")))
    flags = ["-O3", "--expt-relaxed-constexpr", "-std=c++20", "-DEAGLE3_WITH_CUDA", "-D_GLIBCXX_USE_CXX11_ABI=1",
             "--compiler-options", "-fPIC", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
             "-U__CUDA_NO_BFLOAT16_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__"]
    flags += [f"-D{d}" for d in a.defines] + (["-Xptxas=-v"] if a.ptxas else [])
    nvcc = os.environ.get("NVCC", "nvcc")
    with tempfile.TemporaryDirectory() as tmp:
        def compile_one(k, src):
            cmd = [nvcc, "-c", src, "-o", os.path.join(tmp, f"{k}.o")] + flags + gencode + [f"-I{i}" for i in incs]
            return subprocess.run(cmd, capture_output=True, text=True)

        with concurrent.futures.ThreadPoolExecutor(max(1, a.jobs)) as pool:
            runs = [pool.submit(compile_one, k, src) for k, src in enumerate(a.sources)]
            failed = 0
            for src, run in zip(a.sources, runs):  # reported in the order given
                r = run.result()
                status = "ok" if r.returncode == 0 else "FAILED"
                print(f"{src} [{' '.join(archs)}]: {status}", flush=True)
                out = (r.stdout + r.stderr).strip()
                if out and (r.returncode != 0 or a.ptxas):
                    print("\n".join(out.splitlines()[:40]))
                failed += r.returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
