"""MemoryProfiler as the demo uses it: no deprecation warning from our code on every run, and a
second model in the same process (the demo's DDP run after the vescale one) is not counted."""

from __future__ import annotations

import types
import warnings

import torch

from examples.gpt import GPT, GPTConfig
from lightning_vescale import MemoryProfiler
from lightning_vescale.callbacks.memory import engine_tensors
from lightning_vescale.fsdp import dbuffers, fully_shard


def _gather_warnings():
    import torch.distributed as dist

    from lightning.fabric.utilities.distributed import _all_gather_ddp_if_available

    # what DDPStrategy.all_gather is (the profiler works with any strategy)
    strategy = types.SimpleNamespace(root_device=torch.device("cpu"),
                                     all_gather=_all_gather_ddp_if_available)
    trainer = types.SimpleNamespace(strategy=strategy, world_size=dist.get_world_size())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        table = MemoryProfiler()._gather([float(dist.get_rank()), 2.0], trainer)
    return table.tolist(), [f"{w.category.__name__}: {w.message}" for w in caught]


def test_gathering_ranks_warns_nothing(worlds):
    for table, caught in worlds(2).run(_gather_warnings):
        assert table == [[0.0, 2.0], [1.0, 2.0]]
        assert caught == []  # Lightning's strategy.all_gather warned (deprecated torch path)


def _count_only_the_module():
    torch.manual_seed(0)
    first = GPT(GPTConfig(n_layer=1, n_embd=32))
    fully_shard(first)
    second = GPT(GPTConfig(n_layer=2, n_embd=32))
    fully_shard(second)
    found, _ = engine_tensors(second)
    counted = sum(t.untyped_storage().nbytes() for t in found["params_sharded"])
    mine = sum(b.shard.untyped_storage().nbytes() for b in dbuffers(second))
    everyone, _ = engine_tensors()  # module=None: every live DBuffer of the process
    return counted, mine, sum(t.untyped_storage().nbytes() for t in everyone["params_sharded"])


def test_breakdown_counts_only_the_trained_modules_buffers(worlds):
    for counted, mine, everyone in worlds(2).run(_count_only_the_module):
        assert counted == mine < everyone
