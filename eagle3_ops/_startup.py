"""Whether `import eagle3_ops` is the `eagle3` command starting. Torch-free.

The package's __init__ asks `defer()`: when the command is starting, it stops short of torch and the
native extension (2-3 s), so `eagle3 --help` and a usage error answer at once; `cli.main` checks the
arguments, then calls `finish_import()`, which runs __init__ in full. Any other import loads everything
at once, as always: a process is only deferred when it is the command itself.
"""

from __future__ import annotations

import importlib
import os
import sys

_CLI_MODULES = ("eagle3_ops", "eagle3_ops.__main__", "eagle3_ops.cli")
deferred = False  # __init__ stopped short of torch; finish_import completes it
checked = False  # the command's arguments passed: __init__ no longer defers


def _m_target(argv: list[str]) -> str | None:
    """The module of `python [options] -m MODULE ...` (or -mMODULE)."""
    for i, a in enumerate(argv[1:], 1):
        if a == "-m":
            return argv[i + 1] if i + 1 < len(argv) else None
        if a.startswith("-m"):
            return a[2:]
    return None


def cli_starting() -> bool:
    """`python -m eagle3_ops ...`: runpy imports the package before __main__, with sys.argv[0] = "-m"
    meanwhile. The `eagle3` console script: pip's script file, whose first import is eagle3_ops.cli."""
    if sys.argv[:1] == ["-m"]:
        return _m_target(sys.orig_argv) in _CLI_MODULES
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path or os.path.basename(path) != "eagle3":
        return False
    try:
        with open(path, encoding="utf-8") as f:
            return "from eagle3_ops.cli import main" in f.read(4096)
    except (OSError, UnicodeDecodeError):
        return False


def defer() -> bool:
    """Asked by the package's __init__ before torch: True to stop there."""
    global deferred
    deferred = not checked and cli_starting()
    return deferred


def finish_import() -> None:
    """The command's arguments passed its checks: complete `import eagle3_ops` (no-op when not deferred)."""
    global checked
    checked = True
    if deferred:
        importlib.reload(sys.modules["eagle3_ops"])
