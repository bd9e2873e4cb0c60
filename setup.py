"""Build eagle3_ops._C: the op table (C++, always) and the CUDA kernels (when torch has CUDA and nvcc exists).

The CUDA sources are compiled whenever torch is a CUDA build and nvcc is found, with or without a GPU
present (CI has none and must still compile every .cu file). TORCH_CUDA_ARCH_LIST defaults to 9.0a.
DEBUG=1 gives -O0 -g -lineinfo. EAGLE3_DEVICE_CHECKS=0 compiles out the device error word (benchmarks of
what validation costs). EAGLE3_DEV_BUILD=1 adds the development-only ops and kernel builds that bench/dev/
tools use (never in a production build; build_info()['dev_build'] says which).
EAGLE3_CUDA_ONLY=capture_aux,kv_accept compiles just those kernels (empty: none), to iterate on one kernel
quickly; a kernel is csrc/<name>.cu, or the files KERNEL_PARTS lists under its name (compat_sglang: its three
csrc/compat_sglang_*.cu; mla_decode_sm90: csrc/mla_decode_sm90.cu and csrc/mla_decode_sm90_host.cu). Set
CUDA_HOME to the toolkit root; when it is unset and `nvcc` on PATH is a wrapper script, the toolkit root is asked
of nvcc itself (torch would otherwise guess the wrapper's folder and link against a libcudart that is not there).

It builds against the torch already installed (`pip install --no-build-isolation .`; with build isolation it
stops and says so), records that torch in eagle3_ops/_built_with.py for the import-time check, and makes the
wheel require that torch release exactly.
"""

import glob
import os
import subprocess
import sys

from setuptools import setup

try:
    import torch
except ImportError:  # pip's build isolation builds in a fresh environment without torch
    sys.exit("eagle3_ops compiles against the torch installed beside it and finds none: install torch first, then "
             "`pip install --no-build-isolation .` (a plain `pip install .` builds in an isolated environment "
             "without torch)")


def _toolkit_root_from_nvcc():
    """The CUDA toolkit that `nvcc` on PATH really runs (follows wrapper scripts), or None."""
    try:
        probe = subprocess.run(
            ["nvcc", "--dryrun", "-E", "-x", "cu", os.devnull],
            capture_output=True, text=True, timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    for line in (probe.stdout + probe.stderr).splitlines():
        if line.startswith("#$ _HERE_="):
            return os.path.dirname(line.split("=", 1)[1].strip())
    return None


if not os.environ.get("CUDA_HOME") and not os.environ.get("CUDA_PATH"):
    root = _toolkit_root_from_nvcc()
    if root:
        os.environ["CUDA_HOME"] = root
os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")

# CUDA_HOME must be set before cpp_extension reads it (`import torch` does not).
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
DEBUG = os.environ.get("DEBUG", "0") == "1"
# EAGLE3_DEVICE_CHECKS=0 compiles out the device error word's recording (csrc/include/eagle3/errors.cuh),
# for measuring what validation costs; the bounds checks that keep accesses inside the tensors stay.
DEVICE_CHECKS = os.environ.get("EAGLE3_DEVICE_CHECKS", "1") != "0"
# EAGLE3_DEV_BUILD=1 defines EAGLE3_DEV_BUILD: the diagnostic kernel builds and their private ops (today
# _tree_attention_mla_sm90_dev, csrc/mla_decode_sm90_host.cu, over csrc/mla_decode_sm90.cu's per-block trace and
# no-math skeletons, for bench/dev/trace_mla.py and bench/dev/ceiling_mla.py). Off by default; the production op
# table never has them.
DEV_BUILD = os.environ.get("EAGLE3_DEV_BUILD", "0") == "1"
SUPPORT_SOURCES = ("errors.cu",)  # not kernels of an op: built whenever any CUDA source is
# A kernel split over several csrc/*.cu: its one name (EAGLE3_CUDA_ONLY's, build_info()['cuda_kernels']'s) -> its
# files. Every other csrc/<name>.cu is the kernel <name>.
KERNEL_PARTS = {
    "compat_sglang": ("compat_sglang_build.cu", "compat_sglang_walk.cu", "compat_sglang_pack.cu"),
    "mla_decode_sm90": ("mla_decode_sm90.cu", "mla_decode_sm90_host.cu"),
}
WITH_CUDA = torch.version.cuda is not None and CUDA_HOME is not None


def _define(name, value):
    return f'-D{name}="{value}"'


def _pip_cuda_includes():
    """Headers of the CUDA libraries that pip installed beside torch (cuBLAS, cuSPARSE, ...), for a
    toolkit that ships only the compiler and runtime."""
    if os.path.exists(os.path.join(CUDA_HOME, "include", "cublas_v2.h")):
        return []
    found = []
    for path in sys.path:
        found += glob.glob(os.path.join(path, "nvidia", "*", "include"))
    return sorted({d for d in found if os.path.exists(os.path.join(d, "cublas_v2.h"))})


def _warn_static_libstdcxx():
    """A compiler that can only link libstdc++ statically gives the extension a private copy whose
    locale crashes on the first number formatted into an error message: say so before building."""
    cxx = os.environ.get("CXX", "c++")
    try:
        found = subprocess.run([cxx, "-print-file-name=libstdc++.so"], capture_output=True, text=True,
                               timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return
    if found == "libstdc++.so":  # not found: only the static archive is there
        print(f"eagle3_ops: WARNING: {cxx} has no shared libstdc++ and will link it statically into _C; "
              "error messages would then crash the process. Set CXX/CC to a compiler with a shared "
              "libstdc++ (e.g. CXX=/usr/bin/g++ CC=/usr/bin/gcc).", file=sys.stderr)


def _record_torch():
    """eagle3_ops/_built_with.py: the torch this build compiles against, which `import eagle3_ops` compares
    with the torch it finds before loading _C (eagle3_ops/_version_check.py). Rewritten only when it changes."""
    text = (f"# Written by setup.py: the torch this build of eagle3_ops was compiled against.\n"
            f"TORCH_VERSION = {str(torch.__version__)!r}\nTORCH_CUDA = {torch.version.cuda!r}\n")
    path = os.path.join(HERE, "eagle3_ops", "_built_with.py")
    if not os.path.exists(path) or open(path).read() != text:
        with open(path, "w") as f:
            f.write(text)


def kernel_of(path):
    """The kernel a csrc/*.cu file belongs to: its KERNEL_PARTS name, else the file's own name."""
    base = os.path.basename(path)
    for kernel, parts in KERNEL_PARTS.items():
        if base in parts:
            return kernel
    return os.path.splitext(base)[0]


def extension():
    _warn_static_libstdcxx()
    cpp = sorted(glob.glob(os.path.join("csrc", "*.cpp")))
    cuda = sorted(glob.glob(os.path.join("csrc", "*.cu")))
    absent = [p for parts in KERNEL_PARTS.values() for p in parts if os.path.join("csrc", p) not in cuda]
    if absent:
        sys.exit(f"eagle3_ops: setup.py's KERNEL_PARTS names csrc files that are not there: {absent}")
    support = [f for f in cuda if os.path.basename(f) in SUPPORT_SOURCES]  # always built with the kernels
    cuda = [f for f in cuda if f not in support]
    only = os.environ.get("EAGLE3_CUDA_ONLY")  # e.g. "capture_aux,kv_accept": build just these kernels
    if only is not None:
        wanted = {k.strip() for k in only.split(",") if k.strip()}
        unknown = wanted - {kernel_of(f) for f in cuda}
        if unknown:
            sys.exit(f"eagle3_ops: EAGLE3_CUDA_ONLY names no kernel (csrc/<name>.cu or KERNEL_PARTS) for "
                     f"{sorted(unknown)}")
        cuda = [f for f in cuda if kernel_of(f) in wanted]
    opt = ["-O0", "-g"] if DEBUG else ["-O3"]
    cxx = opt + [_define("EAGLE3_TORCH_VERSION", torch.__version__)]  # torch picks the C++ standard
    cxx += ["-DEAGLE3_DEV_BUILD"] if DEV_BUILD else []
    include_dirs = [os.path.join(HERE, "csrc", "include")]
    if not WITH_CUDA:
        why = "torch is a CPU build" if torch.version.cuda is None else "nvcc was not found (set CUDA_HOME)"
        print(f"eagle3_ops: building the C++ op table only; {why}. CUDA kernels: none.", file=sys.stderr)
        return CppExtension("eagle3_ops._C", cpp, include_dirs=include_dirs, extra_compile_args={"cxx": cxx})

    archs = os.environ["TORCH_CUDA_ARCH_LIST"]
    kernels = ",".join(dict.fromkeys(kernel_of(f) for f in cuda))  # each kernel once, in file order
    defines = [
        "-DEAGLE3_WITH_CUDA",
        _define("EAGLE3_CUDA_ARCHS", archs),
        _define("EAGLE3_CUDA_VERSION", torch.version.cuda),
        _define("EAGLE3_CUDA_KERNELS", kernels),
    ] + ([] if DEVICE_CHECKS else ["-DEAGLE3_NO_DEVICE_CHECKS"])
    nvcc = opt + ["--expt-relaxed-constexpr"] + (["-lineinfo"] if DEBUG else [])
    nvcc += ["-DEAGLE3_DEV_BUILD"] if DEV_BUILD else []
    nvcc += ["-Xptxas=-v"] if os.environ.get("PTXAS_VERBOSE") else []
    include_dirs += _pip_cuda_includes()
    print(f"eagle3_ops: building C++ + CUDA kernels [{kernels}] for {archs} with {CUDA_HOME}"
          f"{' (development build: EAGLE3_DEV_BUILD=1)' if DEV_BUILD else ''}", file=sys.stderr)
    return CUDAExtension(
        "eagle3_ops._C",
        cpp + support + cuda,
        include_dirs=include_dirs,
        extra_compile_args={"cxx": cxx + defines, "nvcc": nvcc + defines},
    )


_record_torch()
# The wheel requires the torch release it was compiled against, exactly: torch promises no C++ ABI across
# releases (torchvision and torchaudio pin theirs the same way), and the import check refuses any other.
TORCH_REQUIREMENT = "torch==" + str(torch.__version__).split("+")[0]

setup(
    name="eagle3_ops",
    version="0.1.0",
    description="Kernels for EAGLE-3 speculative decoding on MLA + MoE targets (torch.ops.eagle3)",
    python_requires=">=3.10",
    # Our Triton kernels ship as eagle3_ops.triton_kernels, never as a top-level `triton_kernels`
    # (another project's package name).
    packages=["eagle3_ops", "eagle3_ops.models", "eagle3_ops.engine", "eagle3_ops.compat", "eagle3_ops.triton_kernels"],
    package_dir={"eagle3_ops": "eagle3_ops", "eagle3_ops.triton_kernels": "triton_kernels"},
    package_data={"eagle3_ops": ["assets/*/*.json", "assets/*/*.md", "assets/*/*/*.json", "assets/*/*/*.safetensors"]},
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    install_requires=[TORCH_REQUIREMENT, "numpy", "safetensors", "tqdm"],
    extras_require={"test": ["pytest", "pytest-benchmark", "hypothesis"], "plot": ["matplotlib"]},
    entry_points={"console_scripts": ["eagle3=eagle3_ops.cli:main"]},
    zip_safe=False,
)
