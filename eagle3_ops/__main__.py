"""`python -m eagle3_ops`: the `eagle3` command (eagle3_ops.cli; exit codes in its docstring)."""

import sys

from .cli import main

sys.exit(main())
