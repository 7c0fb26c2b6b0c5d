"""``python -m lightning_vescale.planner``: the planner's command line (:mod:`.cli`)."""

import sys

from lightning_vescale.planner.cli import main

if __name__ == "__main__":
    sys.exit(main())
