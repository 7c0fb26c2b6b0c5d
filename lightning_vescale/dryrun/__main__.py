"""``python -m lightning_vescale.dryrun``: the dry run's command line (:mod:`.cli`)."""

import sys

from lightning_vescale.dryrun.cli import main

if __name__ == "__main__":
    sys.exit(main())
