"""``activation_checkpointing_policy`` (design note [activation-checkpointing]): the values it
takes and the errors for bad ones, that the chosen layers recompute their forward in backward
(counted with hooks), and that losses and gradients equal the run without it: one process, 2
ranks, an HSDP mesh, with bf16 mixed precision, CPU offload and ``torch.compile``, through Fabric
and the Trainer (a set of classes and a class name)."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from examples.gpt import GPT, MLP, Block, GPTConfig, make_batches
from lightning_vescale import VeScaleFabricStrategy, VeScaleFSDPStrategy
from lightning_vescale._lightning.activation_checkpointing import (
    apply_activation_checkpointing,
    is_checkpointed,
    validate_activation_checkpointing_policy,
)

CFG = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=True)
BLOCKS = ["blocks.0", "blocks.1"]


def _apply(model: nn.Module, policy) -> list[str]:
    return apply_activation_checkpointing(model, validate_activation_checkpointing_policy(policy))


def _count_mlp_calls(model: nn.Module) -> list[int]:
    """Forward calls of every block's MLP: once per forward, once more per recompute."""
    calls = [0]

    def hook(*_):
        calls[0] += 1
    for m in model.modules():
        if isinstance(m, MLP):
            m.register_forward_pre_hook(hook)
    return calls


# -- the values the policy takes ------------------------------------------------------------------
def _three_arg_policy(module, recurse, nonwrapped_numel):  # Lightning's auto_wrap_policy form
    return isinstance(module, Block) and not recurse and nonwrapped_numel > 0


@pytest.mark.parametrize("policy", [
    {Block}, [Block], (Block,), Block, "Block", ["Block"], {"examples.gpt.Block"},
    lambda m: isinstance(m, Block), _three_arg_policy,
    # a selected module inside a selected one is left to the outer recompute
    {Block, MLP},
])
def test_policy_values_choose_the_blocks(policy):
    model = GPT(CFG)
    names = [n for n, _ in model.named_parameters()]
    assert _apply(model, policy) == BLOCKS
    assert all(is_checkpointed(b) for b in model.blocks)
    assert not any(is_checkpointed(m) for m in model.modules() if not isinstance(m, Block))
    assert [n for n, _ in model.named_parameters()] == names  # no name changes
    assert _apply(model, policy) == BLOCKS  # idempotent: not wrapped twice
    assert model.blocks[0].forward.args[0].__func__ is Block.forward


def test_torch_wrap_policies_are_understood():
    from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy

    assert _apply(GPT(CFG), ModuleWrapPolicy({Block})) == BLOCKS
    assert _apply(GPT(CFG), CustomPolicy(lambda m: isinstance(m, Block))) == BLOCKS


@pytest.mark.parametrize("policy", [None, set(), []])
def test_no_policy_changes_nothing(policy):
    model = GPT(CFG)
    assert _apply(model, policy) == []
    assert not any(is_checkpointed(m) for m in model.modules())


@pytest.mark.parametrize("value, match", [
    (3, r"must be a set of nn.Module classes or class names, or a callable, got 3 \(int\)"),
    ({3}, r"entries must be nn.Module classes or class names, got 3"),
    ([""], r"entries must be nn.Module classes or class names, got ''"),
    ([int], r"got <class 'int'>"),
    ({"Block": True}, r"got \{'Block': True\} \(dict\)"),
])
def test_bad_values_are_type_errors_naming_the_value_and_the_fix(value, match):
    for make in (lambda: validate_activation_checkpointing_policy(value),
                 lambda: VeScaleFSDPStrategy(activation_checkpointing_policy=value),
                 lambda: VeScaleFabricStrategy(activation_checkpointing_policy=value)):
        with pytest.raises(TypeError, match=match) as err:
            make()
        assert "activation_checkpointing_policy" in str(err.value)
        assert "{Block}" in str(err.value)  # the fix


def test_a_module_instance_is_refused_with_its_class_as_the_fix():
    with pytest.raises(TypeError, match=r"got a module instance \(MLP\); pass its class instead: "
                                        r"activation_checkpointing_policy=\{MLP\}"):
        validate_activation_checkpointing_policy(MLP(CFG))


def test_yaml_values_parse_as_class_names():
    """LightningCLI (jsonargparse) reads a list or a scalar of class names from YAML."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(VeScaleFSDPStrategy, "strategy", skip={
        "accelerator", "parallel_devices", "cluster_environment", "checkpoint_io",
        "precision_plugin"})
    for text in ("[Block]", "Block", "examples.gpt.Block", "[examples.gpt.Block, MLP]"):
        cfg = parser.parse_args([f"--strategy.activation_checkpointing_policy={text}"])
        value = cfg.strategy.activation_checkpointing_policy
        assert _apply(GPT(CFG), value) == BLOCKS, (text, value)


def test_unknown_class_name_names_the_entry_and_the_closest_class():
    with pytest.raises(ValueError, match=r"entry 'Blok' matches no submodule of GPT\. "
                                         r"Closest: \['Block'\]") as err:
        _apply(GPT(CFG), {"Blok"})
    assert "'CausalSelfAttention'" in str(err.value)  # the model's classes
    with pytest.raises(ValueError, match=r"GPT is the root module, which is never checkpointed"):
        _apply(GPT(CFG), {GPT})


def test_a_model_with_checkpoint_wrappers_is_left_alone():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = GPT(CFG)
    model.blocks[0] = checkpoint_wrapper(model.blocks[0])
    with pytest.warns(UserWarning, match="already contains torch CheckpointWrapper"):
        assert _apply(model, {MLP}) == []


# -- one process: recompute, same gradients, eval, deepcopy ---------------------------------------
def _loss_and_grads(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    loss = model(x, x)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_blocks_recompute_in_backward_with_the_same_gradients():
    torch.manual_seed(0)
    ref = GPT(CFG)
    model = copy.deepcopy(ref)
    assert _apply(model, {Block}) == BLOCKS
    calls, ref_calls = _count_mlp_calls(model), _count_mlp_calls(ref)
    x = make_batches(1, 4, 16, seed=1)[0][0] % 65
    torch.manual_seed(1)
    want_loss, want = _loss_and_grads(ref, x)
    torch.manual_seed(1)
    loss, got = _loss_and_grads(model, x)
    assert ref_calls[0] == 2 and calls[0] == 4  # each block's MLP ran again in backward
    torch.testing.assert_close(loss, want_loss, rtol=0, atol=0)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-6, atol=1e-7, msg=n)
    with torch.no_grad():  # evaluation: the plain forward, no recompute machinery
        model(x, x)
    assert calls[0] == 6
    twin = copy.deepcopy(model)  # the copy's blocks recompute their own forward
    assert twin.blocks[0].forward.args[0].__self__ is twin.blocks[0]
    torch.manual_seed(1)
    loss2, got2 = _loss_and_grads(twin, x)
    torch.testing.assert_close(loss2, want_loss, rtol=0, atol=0)
    assert all(torch.equal(got2[n], got[n]) for n in got)


# -- sharded: 2 ranks, HSDP, mixed precision, offload, compile ------------------------------------
def _sharded_body(policy, *, replicas=1, bf16=False, offload=False, compile_blocks=False):
    from lightning_vescale.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from lightning_vescale.mesh import init_mesh

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_mesh("cpu", replicas=replicas)
    kw = {"mesh": mesh}
    if bf16:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                               reduce_dtype=torch.float32)
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    out = {}
    for name, p in (("plain", None), ("ckpt", policy)):
        torch.manual_seed(0)
        model = GPT(CFG)
        chosen = _apply(model, p)
        calls = _count_mlp_calls(model)
        for block in model.blocks:
            fully_shard(block, **kw)
            if compile_blocks:
                block.compile()
        fully_shard(model, **kw)
        # SGD: a rounding difference in a gradient stays one in the parameter (Adam would
        # normalise a near-zero gradient's noise up to lr)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        losses = []
        for x, _ in make_batches(2, 2 * world, 16, seed=3):
            x = x[rank * 2:(rank + 1) * 2] % 65
            loss = model(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
        out[name] = (chosen, calls[0], losses, params)
    return out


def _check_sharded(results, *, exact: bool):
    for out in results:
        chosen, calls, losses, params = out["ckpt"]
        _, ref_calls, ref_losses, ref_params = out["plain"]
        assert chosen == BLOCKS
        assert ref_calls == 2 * 2 and calls == 2 * ref_calls  # 2 steps x 2 blocks, recomputed
        tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), **tol)
        for n in ref_params:
            torch.testing.assert_close(params[n], ref_params[n], **tol,
                                       msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("policy", [{Block}, ["Block"]])
def test_two_ranks_recompute_and_match_the_run_without(worlds, policy):
    # the recompute replays the same kernels on the same data: bitwise the same run
    _check_sharded(worlds(2).run(_sharded_body, policy), exact=True)


def test_hsdp_2x2_recomputes_and_matches_the_run_without(worlds):
    _check_sharded(worlds(4).run(_sharded_body, {Block}, replicas=2), exact=True)


def test_bf16_mixed_precision_and_cpu_offload(worlds):
    _check_sharded(worlds(2).run(_sharded_body, {Block}, bf16=True, offload=True), exact=True)


@pytest.mark.slow  # compiling two blocks on two ranks: ~30 s on 2 cores
def test_compiled_blocks_recompute_and_match(worlds):
    # inductor may fuse the recompute differently from the first forward: fp32 rounding only
    _check_sharded(worlds(2).run(_sharded_body, {Block}, compile_blocks=True), exact=False)


# -- Fabric and the Trainer ------------------------------------------------------------------------
def _fabric_body(policy):
    from lightning.fabric import Fabric

    out = {}
    for name, p in (("plain", None), ("ckpt", policy)):
        fabric = Fabric(accelerator="cpu", devices=dist.get_world_size(),
                        strategy=VeScaleFabricStrategy(activation_checkpointing_policy=p))
        fabric.launch()
        torch.manual_seed(0)
        model = fabric.setup_module(GPT(CFG))
        calls = _count_mlp_calls(model)
        opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
        losses = []
        for x, _ in make_batches(2, 4, 16, seed=5):
            x = x[dist.get_rank() * 2:][:2] % 65
            loss = model(x, x)
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        checkpointed = [n for n, m in model.module.named_modules() if is_checkpointed(m)]
        out[name] = (checkpointed, calls[0], losses)
    return out


def test_fabric_strategy_checkpoints_the_policy_layers(worlds):
    for out in worlds(2).run(_fabric_body, {"Block"}):
        assert out["plain"][:2] == ([], 4)
        assert out["ckpt"][:2] == (BLOCKS, 8)
        assert out["ckpt"][2] == out["plain"][2]


class _CountRecomputes:
    """A Trainer callback: each rank saves its MLP call count at the end of fit."""

    def __new__(cls, out_dir: str, tag: str):
        from lightning.pytorch.callbacks import Callback

        class Counter(Callback):
            def setup(self, trainer, pl_module, stage):
                self.calls = _count_mlp_calls(pl_module)

            def on_train_end(self, trainer, pl_module):
                checkpointed = [n for n, m in pl_module.named_modules() if is_checkpointed(m)]
                torch.save((self.calls[0], checkpointed),
                           Path(out_dir) / f"{tag}_calls_rank{trainer.global_rank}.pt")
        return Counter()


def test_trainer_with_a_set_of_classes_and_a_class_name(tmp_path):
    import lightning.pytorch as pl

    from tests.lightning._lit import TinyGPT, assert_close_losses, dataloader, losses, trainer

    for tag, policy in (("plain", None), ("classes", {Block}), ("names", ["Block"])):
        pl.seed_everything(0, verbose=False)
        strategy = VeScaleFSDPStrategy(start_method="fork",
                                       activation_checkpointing_policy=policy)
        t = trainer(strategy, max_epochs=1, callbacks=[_CountRecomputes(str(tmp_path), tag)])
        t.fit(TinyGPT(out_dir=str(tmp_path), tag=tag), dataloader())
    plain = losses(tmp_path, "plain")
    for tag in ("classes", "names"):
        assert_close_losses(losses(tmp_path, tag), plain, rtol=1e-6)
        for r in range(2):
            calls, checkpointed = torch.load(tmp_path / f"{tag}_calls_rank{r}.pt")
            ref_calls, _ = torch.load(tmp_path / f"plain_calls_rank{r}.pt")
            assert checkpointed == ["model.blocks.0", "model.blocks.1"]
            assert ref_calls == 3 * 2 and calls == 2 * ref_calls, (calls, ref_calls)
    assert all(math.isfinite(v) for v in plain[0])


@pytest.mark.slow  # two fresh 2-rank worlds
def test_the_benchmark_runs_and_checkpointing_saves_memory():
    from benchmarks.activation_checkpointing import report, run

    cfg = dict(vocab_size=65, block_size=64, n_layer=2, n_head=2, n_embd=32, tie_weights=True)
    res = run(2, cfg, batch=4, steps=1, warmup=0, runs=1)
    assert res["blocks"]["losses"] == res["none"]["losses"]
    assert res["blocks"]["rise_bytes"] < res["none"]["rise_bytes"]
    assert "peak live tensors / rank" in report(res)
