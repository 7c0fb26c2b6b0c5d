"""Layer 5 (private): what the Trainer strategy and the Fabric strategy share.

``core.py``: :class:`~lightning_vescale._lightning.core.VeScaleStrategyCore`, the mixin both
strategies are built on (design note [strategy-core]). ``sharding.py``: how a model becomes
``fully_shard`` groups and the checks of the sharding arguments (design note [sharding-units]).
``device_mesh.py``: the strategies' ``device_mesh`` argument (full sharding or HSDP, design note
[strategy-mesh]). ``exception_agreement.py``: the out-of-band agreement of design note
[failures]. ``launcher.py``: the Trainer's ``fork``/``spawn`` launcher. ``registry.py``: the
strategy names in Lightning's registries, registered without importing Lightning (design note
[lazy-registration]; the only module here that does not import Lightning, and the only one the
package's ``__init__`` imports). Checkpoint formats are the public ``lightning_vescale.checkpoint``.
Tests import the internals they need from these modules.
"""
