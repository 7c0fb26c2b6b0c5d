"""lightning_vescale: veScale-FSDP (RaggedShard, structure-aware planner, zero-copy DBuffer) for Lightning.

The public names are listed in ``__all__``; see ``../shared/ARCHITECTURE.md`` for the layering.
"""

__version__ = "0.1.0.dev0"

__all__: list[str] = []
