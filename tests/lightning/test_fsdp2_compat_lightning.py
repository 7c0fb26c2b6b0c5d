"""Lightning behaviours of FSDP strategies (issue 15) on ours: an optimizer built before the
model was sharded is re-pointed at the shards (or, when it cannot be, rejected at set-up as
Lightning's ``FSDPStrategy`` does), ``16-true``
precision in the Trainer and Fabric, Fabric ``save(..., filter=...)`` of full checkpoints."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from examples.gpt import GPT
from tests.lightning._lit import CONFIG, TinyGPT, dataloader, trainer

VESCALE = "vescale_fsdp_fork"


class _EarlyOptimizer(TinyGPT):
    """Creates its optimizer in ``__init__``, over the parameters before sharding (what
    LightningCLI 2.6's ``optimizer:`` section does too)."""

    def __init__(self, stepped: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)
        if stepped:  # it already has state for the old parameter objects: cannot be re-pointed
            self.model(*next(iter(dataloader()))).backward()
            self.opt.step()

    def configure_optimizers(self) -> Any:
        return self.opt


def test_trainer_repoints_an_optimizer_built_before_sharding(tmp_path):
    """Lightning's FSDPStrategy raises here and FSDP2 trains nothing; we re-point the optimizer
    at the shards by name, so it trains exactly like one built in ``configure_optimizers``."""
    from tests.lightning._lit import assert_close_losses, losses

    torch.manual_seed(0)
    early_model = _EarlyOptimizer(out_dir=str(tmp_path), tag="early")
    trainer(VESCALE, max_steps=3).fit(early_model, dataloader())
    torch.manual_seed(0)
    late_model = TinyGPT(out_dir=str(tmp_path), tag="late")
    trainer(VESCALE, max_steps=3).fit(late_model, dataloader())
    early, late = losses(tmp_path, "early"), losses(tmp_path, "late")
    assert len(early[0]) == 3 and early[0][0] != early[0][-1]  # it trained
    assert_close_losses(early, late, rtol=1e-6)


def test_trainer_rejects_an_optimizer_that_cannot_be_repointed():
    t = trainer(VESCALE, max_steps=1)
    with pytest.raises(Exception, match="already has state"):
        t.fit(_EarlyOptimizer(stepped=True), dataloader())


def _fabric(**kwargs):
    from lightning.fabric import Fabric

    from lightning_vescale import VeScaleFabricStrategy

    fabric_kwargs = kwargs.pop("fabric", {})
    fabric = Fabric(accelerator="cpu", devices=dist.get_world_size(),
                    strategy=VeScaleFabricStrategy(**kwargs), **fabric_kwargs)
    fabric.launch()
    return fabric


def _fabric_early_optimizer_body():
    fabric = _fabric()
    torch.manual_seed(0)
    model = GPT(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model = fabric.setup_module(model)
    try:
        fabric.setup_optimizers(opt)
    except ValueError as e:
        return str(e)
    return None


def test_fabric_rejects_an_optimizer_built_before_setup_module(worlds):
    for msg in worlds(2).run(_fabric_early_optimizer_body):
        assert msg is not None and "fabric.setup_module(model)" in msg, msg


# -- precision="16-true" ------------------------------------------------------------------------
class _Fp16Check(TinyGPT):
    def on_train_start(self) -> None:
        dtypes = sorted({str(p.dtype) for p in self.parameters()})
        torch.save(dtypes, f"{self.out_dir}/{self.tag}_dtypes_rank{self.global_rank}.pt")

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)  # (AdamW's eps underflows in fp16)


def _fit_16_true(strategy, out_dir, tag):
    import lightning.pytorch as pl

    pl.seed_everything(0, verbose=False)
    model = _Fp16Check(out_dir=str(out_dir), tag=tag, lr=1e-3)
    t = trainer(strategy, max_steps=3, precision="16-true")
    t.fit(model, dataloader())
    return model


def test_trainer_16_true_matches_ddp(tmp_path):
    from tests.lightning._lit import losses

    _fit_16_true(VESCALE, tmp_path, "v16")
    _fit_16_true("ddp_fork", tmp_path, "d16")
    for r in range(2):
        assert torch.load(tmp_path / f"v16_dtypes_rank{r}.pt") == ["torch.float16"]
    got, want = losses(tmp_path, "v16"), losses(tmp_path, "d16")
    for a, b in zip(got, want):
        assert len(a) == len(b) == 3
        for la, lb in zip(a, b):  # fp16 compute, gradient averaging in fp16 by both
            assert abs(la - lb) <= 5e-3 * abs(lb), (got, want)


def _fabric_16_true_body():
    fabric = _fabric(fabric={"precision": "16-true"})
    with fabric.init_module():
        torch.manual_seed(0)
        model = GPT(CONFIG)
    init_dtypes = {p.dtype for p in model.parameters()}
    model = fabric.setup_module(model)
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=1e-2))
    x = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.block_size))
    losses = []
    for _ in range(2):
        loss = model(x, x)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return init_dtypes, {p.dtype for p in model.parameters()}, losses


def test_fabric_16_true_and_init_module(worlds):
    for init_dtypes, dtypes, losses in worlds(2).run(_fabric_16_true_body):
        assert init_dtypes == dtypes == {torch.float16}
        assert all(torch.isfinite(torch.tensor(losses))) and losses[1] < losses[0], losses


# -- Fabric save(..., filter=...) of a full checkpoint --------------------------------------------
def _fabric_filter_body(tmp: str, state_dict_type: str):
    fabric = _fabric(state_dict_type=state_dict_type)
    torch.manual_seed(0)
    model = fabric.setup_module(GPT(CONFIG))
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    x = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.block_size))
    fabric.backward(model(x, x))
    opt.step()
    state = {"model": model, "optimizer": opt, "meta": {"step": 1, "skip": 2}}
    keep_weights = {"model": lambda k, v: "weight" in k, "meta": lambda k, v: k == "step"}
    path = f"{tmp}/filtered.ckpt"
    try:
        fabric.save(path, state, filter=keep_weights)
    except NotImplementedError as e:
        return str(e)
    full = {n: p.full_tensor() for n, p in model.module.named_parameters()}
    if dist.get_rank() != 0:
        return None
    saved = torch.load(path, weights_only=True)
    return (sorted(saved["model"]), sorted(k for k in full if "weight" in k),
            all(torch.equal(saved["model"][k], full[k]) for k in saved["model"]
                if k in full), saved["meta"], sorted(saved["optimizer"]))


def test_fabric_save_filter_full(worlds, tmp_path):
    res = worlds(2).run(_fabric_filter_body, str(tmp_path), "full")[0]
    keys, want_keys, equal, meta, opt_keys = res
    assert keys and all("weight" in k for k in keys), keys
    assert set(want_keys) <= set(keys) and equal
    assert meta == {"step": 1} and opt_keys == ["param_groups", "state"]


def test_fabric_save_filter_sharded_is_refused(worlds, tmp_path):
    for msg in worlds(2).run(_fabric_filter_body, str(tmp_path), "sharded"):
        assert "state_dict_type='full'" in msg, msg


# -- Lightning's own FSDPModule branches reach our methods ---------------------------------------
def _model_parallel_body():
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy

    from lightning_vescale.fsdp import fully_shard, get_state

    def parallelize(model, device_mesh):
        for block in model.blocks:
            fully_shard(block, mesh=device_mesh["data_parallel"])
        return fully_shard(model, mesh=device_mesh["data_parallel"])

    world = dist.get_world_size()
    fabric = Fabric(accelerator="cpu", devices=world, strategy=ModelParallelStrategy(
        parallelize, data_parallel_size=world, tensor_parallel_size=1))
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(GPT(CONFIG))
    opt = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.block_size))
    group = get_state(model.module.blocks[0]).group
    with fabric.no_backward_sync(model, enabled=True):  # isinstance(m, FSDPModule) in Lightning
        inside = group.reduce_grads
        fabric.backward(model(x, x))
    after = group.reduce_grads
    fabric.backward(model(x, x))
    opt.step()
    return inside, after


def test_lightning_model_parallel_no_backward_sync_reaches_our_groups(worlds):
    for inside, after in worlds(2).run(_model_parallel_body):
        assert (inside, after) == (False, True)
