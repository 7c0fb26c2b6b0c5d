"""``python -m lightning_vescale.plan``: the planner's command line under its first name.

The same program as ``python -m lightning_vescale.planner`` (:mod:`lightning_vescale.planner.cli`):
same options, output and exit codes. Kept because scripts and documentation use this path.
"""

import sys

from lightning_vescale.planner.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
