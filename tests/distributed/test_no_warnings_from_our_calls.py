"""Our calls add no warnings to a user's script (issue 23, "noise in users' own scripts").

A forward/backward/step under ``fully_shard``, a ``state_dict()``, a sharded save and a safe
load, on 2 ranks, recorded with every warning filter set to "always": nothing may come from this
package's calls (torch's own deprecations of the collectives we call included). Warnings Lightning
itself raises (the ``LeafSpec`` one of its ``CombinedLoader``) and the user's own calls are not
ours to silence.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path


def _train_and_checkpoint_body(path: str) -> list[str]:
    import torch
    import torch.distributed as dist
    from torch import nn

    from lightning_vescale import checkpoint as ckpt
    from lightning_vescale.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(2):
            model(torch.randn(4, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
        state = {"state_dict": model.state_dict()}
        target = Path(path) / f"w{dist.get_world_size()}.ckpt"
        ckpt.save_sharded(target, state, {"step": 2})
        ckpt.load_sharded(target, model, {}, strict=True)
    return [f"{w.category.__name__} {w.filename}:{w.lineno}: {w.message}" for w in caught]


def test_training_and_checkpointing_warn_nothing(worlds):
    with tempfile.TemporaryDirectory() as tmp:
        for rank_warnings in worlds(2).run(_train_and_checkpoint_body, tmp):
            assert rank_warnings == [], "\n".join(rank_warnings)
