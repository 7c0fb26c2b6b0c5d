"""SOAP and Shampoo states through the project's distributed checkpoint (``save_sharded`` /
``load_sharded``, what the strategies use), saved at one world size and layout, loaded at
another: the next steps match a run that never stopped.

Every rank trains on the same batch, so data parallelism's mean gradient is the one-process
gradient up to reduction order; the reference is one process. Tolerance ``atol=1e-4``: that
noise through 5 steps of a preconditioned optimizer at ``lr=1e-3`` (a wrong, missing or
mis-sliced state moves parameters by ~1e-3 per step).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from examples.gpt import GPT, GPTConfig
from lightning_vescale import checkpoint as ckpt
from lightning_vescale._lightning.sharding import ShardGranularity, shard_model
from lightning_vescale.mesh import init_mesh
from lightning_vescale.optim import SOAP, Shampoo

CFG = GPTConfig(vocab_size=65, block_size=8, n_layer=2, n_head=2, n_embd=32)
SAVE_AFTER, STEPS = 3, 5


def _optimizer(name, params):
    if name == "soap":
        return SOAP(params, lr=1e-3, precondition_frequency=2)
    # "shampoo-blocks": every matrix of the model (32, 65, 96 and 128 long dimensions) cut into
    # tiles of at most 24 (design note [shampoo-blocks]), so per-tile factors are resharded
    block = 24 if name == "shampoo-blocks" else 8192
    return Shampoo(params, lr=1e-3, epsilon=1e-8, precondition_frequency=2,
                   start_preconditioning_step=2, max_preconditioner_dim=block)


def _model(granularity, sharded=True):
    torch.manual_seed(0)
    model = GPT(CFG)
    if sharded:
        shard_model(model, units=None, mesh=init_mesh("cpu", dist.get_world_size()),
                    device=torch.device("cpu"), mp_policy=None,
                    granularity=ShardGranularity(granularity=granularity,
                                                 optimizer_block_size=None, min_block_numel=0),
                    reshard_after_forward=True)
    return model


def _train(model, opt, steps):
    for step in steps:
        x = torch.randint(0, CFG.vocab_size, (2, CFG.block_size),
                          generator=torch.Generator().manual_seed(step))
        model(x, x).backward()
        opt.step()
        opt.zero_grad()


def _save(path, name, granularity):
    model = _model(granularity)
    opt = _optimizer(name, model.parameters())
    _train(model, opt, range(SAVE_AFTER))
    ckpt.save_sharded(path, {"state_dict": ckpt.model_state(model, full=False),
                             "optimizer_0": ckpt.optimizer_state(model, opt, full=False)}, {})
    return True


def _load(path, name, granularity):
    model = _model(granularity)
    opt = _optimizer(name, model.parameters())
    ckpt.load_sharded(path, model, {"optimizer_0": opt})
    _train(model, opt, range(SAVE_AFTER, STEPS))
    ref = _model(None, sharded=False)
    ref_opt = _optimizer(name, ref.parameters())
    _train(ref, ref_opt, range(STEPS))
    got = {n: p.full_tensor() for n, p in model.named_parameters()}
    return max(float((got[n] - p.detach()).abs().max()) for n, p in ref.named_parameters())


@pytest.mark.parametrize("name", ["soap", "shampoo", "shampoo-blocks"])
@pytest.mark.parametrize("load_world, load_granularity", [(3, "matrix"), (1, "matrix"),
                                                          (3, None)])
def test_saved_at_two_ranks_resumes_elsewhere(worlds, tmp_path, name, load_world,
                                               load_granularity):
    path = str(tmp_path / "ckpt")
    assert worlds(2).run(_save, path, name, "matrix") == [True, True]
    diffs = worlds(load_world).run(_load, path, name, load_granularity)
    assert max(diffs) <= 1e-4, diffs
