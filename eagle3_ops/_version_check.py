"""The torch this build was compiled against, checked at import before the native extension loads.

A torch extension is bound to the torch it was compiled with: its C++ ABI changes between releases and a
CUDA build links torch's CUDA libraries. A `_C` built for another torch fails to load with a message that
does not say so (`libc10_cuda.so: cannot open shared object file`, an undefined symbol), hence this check.
setup.py writes the build's torch into `_built_with.py`; nothing here imports `_C`.
"""

REINSTALL = "reinstall eagle3_ops (pip install --no-build-isolation .) against this torch"


def describe(version: str, cuda) -> str:
    return f"{version} ({f'CUDA {cuda}' if cuda else 'CPU'})"


def mismatch(built_version: str, built_cuda, torch_version: str, torch_cuda):
    """The error message when the build's torch and this torch differ, else None. They agree when the public
    versions (`2.14.1` of `2.14.1+cu130`: release, and dev/rc tag of a nightly) and the flavours (CUDA
    version, or CPU) are equal; the local label alone (`+cu130`) is how the wheel was named, not what it is."""
    if built_version.split("+")[0] == torch_version.split("+")[0] and built_cuda == torch_cuda:
        return None
    return (f"eagle3_ops was built for torch {describe(built_version, built_cuda)} but torch "
            f"{describe(torch_version, torch_cuda)} is installed: {REINSTALL}")


def check(torch) -> None:
    """Raise ImportError naming both torches when this build was compiled against another one."""
    try:
        from . import _built_with
    except ImportError:  # a build by a setup.py that did not record it: _C's import error, reworded, is all
        return
    message = mismatch(_built_with.TORCH_VERSION, _built_with.TORCH_CUDA, str(torch.__version__), torch.version.cuda)
    if message:
        raise ImportError(message)


def load_failed(error: ImportError, torch) -> str:
    """The message for a `_C` that failed to load although the recorded torch matches (or none was recorded)."""
    return (f"eagle3_ops: its native extension did not load ({error}); it must be built against the torch "
            f"installed now, {describe(str(torch.__version__), torch.version.cuda)}: {REINSTALL}, or run make")
