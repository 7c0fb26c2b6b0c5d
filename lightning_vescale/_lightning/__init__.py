"""Layer 5 (private): what the Trainer strategy and the Fabric strategy share.

``core.py``: :class:`~lightning_vescale._lightning.core.VeScaleStrategyCore`, the mixin both
strategies are built on (design note [strategy-core]). ``sharding.py``: how a model becomes
``fully_shard`` groups and the checks of the sharding arguments (design note [sharding-units]).
``peers.py``: the out-of-band agreement of design note [failures]. ``launcher.py``: the Trainer's
``fork``/``spawn`` launcher. Checkpoint formats are the public ``lightning_vescale.checkpoint``.
Tests import the internals they need from these modules.
"""
