"""eagle3_ops: kernels for the hot paths of EAGLE-3 speculative decoding on MLA + MoE targets.

`import eagle3_ops` loads the native extension (the op table, and the CUDA kernels when it was built
with them), then registers each op's CPU implementation (its pure-PyTorch reference), its fake
implementation and any Triton launchers. It does no GPU work. Call the ops as `torch.ops.eagle3.*` or
through the typed wrappers in `eagle3_ops.ops`.
"""

from . import _startup

# The `eagle3` command checks its arguments before torch loads (so --help and a usage error answer at once);
# cli.main then completes this import (_startup.finish_import). Every other import runs the whole block.
if not _startup.defer():
    import torch  # noqa: F401  (loads libtorch before _C)

    from . import _version_check

    _version_check.check(torch)  # before _C: one built for another torch fails to load with an unrelated message
    try:
        from . import _C  # noqa: E402,F401  (defines torch.ops.eagle3.*)
    except ImportError as e:
        raise ImportError(_version_check.load_failed(e, torch)) from e
    from . import _register  # noqa: E402,F401  (CPU references, fakes, Triton launchers)
    from . import errors, ops, reference  # noqa: E402,F401
    from .errors import Eagle3InputError, check_errors, set_strict  # noqa: E402,F401
    from .ops import *  # noqa: E402,F401,F403

__version__ = "0.1.0"


def build_info() -> dict:
    """What this build holds: {'cuda': bool, 'cuda_archs', 'cuda_version', 'torch_version', 'cuda_kernels',
    'device_checks': bool (False when built with EAGLE3_DEVICE_CHECKS=0), 'dev_build': bool (True only when built
    with EAGLE3_DEV_BUILD=1: the development-only ops of bench/dev/ exist)}."""
    info = dict(_C.build_info())
    info["cuda_kernels"] = [k for k in info["cuda_kernels"].split(",") if k]
    return info
