"""LightningCLI with the vescale_fsdp strategy configured from YAML (and the command line).

    python examples/cli.py fit --config examples/configs/gpt_vescale.yaml
    python examples/cli.py fit --config examples/configs/gpt_vescale.yaml \\
        --config examples/configs/muon.yaml                      # optimizer: Muon
    python examples/cli.py fit --config examples/configs/gpt_vescale.yaml \\
        --trainer.strategy.init_args.reshard_after_forward=false --trainer.max_steps=20

The model and data are ``examples/train_gpt.py``'s. Optimizers come from the CLI's own
``optimizer:`` section (``examples/configs/adamw8bit.yaml``, ``muon.yaml``); without one, the
model's ``configure_optimizers`` (AdamW) is used.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

from lightning.pytorch.cli import LightningCLI

try:
    import lightning_vescale  # noqa: F401  (registers strategy="vescale_fsdp")
except ImportError:  # a checkout without `pip install -e .`: use the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import lightning_vescale  # noqa: F401

try:
    from examples.train_gpt import CharDataModule, GPTModule
except ImportError:  # pragma: no cover - run as a script from its own directory
    from train_gpt import CharDataModule, GPTModule

# With an `optimizer:` section, LightningCLI replaces GPTModule.configure_optimizers (the AdamW
# default for runs without one) and says so on every run; that replacement is the point here.
warnings.filterwarnings("ignore", message=r".*configure_optimizers` will be overridden by")


def main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    # save_config_callback=None: with `logger: false` the config copy would land in the cwd
    return LightningCLI(GPTModule, CharDataModule, args=args, run=run, save_config_callback=None)


if __name__ == "__main__":
    main()
