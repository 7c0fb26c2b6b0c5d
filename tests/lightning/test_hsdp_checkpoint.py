"""Strategy-level checkpoints across HSDP and full sharding (issue 13), through Fabric.

``fabric.save`` on a ``VeScaleFabricStrategy(device_mesh=(2, 2))`` run at world 4 must load with
``fabric.load`` into full sharding at world 4 and at world 2, and a full-sharding save must load
into HSDP; model and optimizer state (AdamW8bit's quantized state, Muon's momentum and AdamW
fallback). Every rank trains on the same batch, so the averaged gradient is exact and the
resumed run must equal, bit for bit, one uninterrupted single-process run. Both formats: the
sharded DCP directory (replicas dedup their identical chunks) and the full file.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from examples.gpt import make_batches
from lightning_vescale import VeScaleFabricStrategy
from lightning_vescale.optim import AdamW8bit, Muon

B = 256
STEPS = 4


def _optimizer(kind: str, model: torch.nn.Module):
    if kind == "adamw8bit":
        return AdamW8bit(model.parameters(), lr=1e-2, weight_decay=0.1, min_8bit_size=1024,
                         block_size=B)
    return Muon(model.named_parameters(), lr=0.02, weight_decay=0.1, adamw_lr=3e-3)


def _run(kind: str, device_mesh, steps: range, state_dict_type: str, *,
         load_from: str | None = None, save_to: str | None = None) -> dict:
    """Fabric GPT, ``steps`` steps on the whole batch; optionally load first / save after.
    Returns this rank's flat local parameters."""
    from examples.gpt import GPT
    from lightning.fabric import Fabric

    from tests.lightning.test_fabric import CFG

    fabric = Fabric(accelerator="cpu", devices=dist.get_world_size(),
                    strategy=VeScaleFabricStrategy(device_mesh=device_mesh, granularity=B,
                                                   optimizer_block_size=B,
                                                   state_dict_type=state_dict_type))
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(GPT(CFG))
    opt = fabric.setup_optimizers(_optimizer(kind, model.module))  # names as in one process
    state = {"model": model, "optimizer": opt, "step": 0}
    if load_from is not None:
        fabric.load(load_from, state)
        assert state["step"] == steps.start
    data = make_batches(steps.stop, 4, CFG.block_size)
    for step in steps:
        x, y = data[step]
        fabric.backward(model(x, y))
        opt.step()
        opt.zero_grad()
    state["step"] = steps.stop
    if save_to is not None:
        fabric.save(save_to, state)
    return {n: (p.to_local() if hasattr(p, "to_local") else p).detach().reshape(-1).clone()
            for n, p in model.module.named_parameters()}


def _reference(kind: str) -> dict:
    from examples.gpt import GPT

    from tests.lightning.test_fabric import CFG

    torch.manual_seed(0)
    model = GPT(CFG)
    opt = _optimizer(kind, model)
    for x, y in make_batches(STEPS, 4, CFG.block_size):
        model(x, y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().reshape(-1).clone() for n, p in model.named_parameters()}


def _check(outs: list[dict], shard_size: int, ref: dict, what: str) -> None:
    for first in range(0, len(outs), shard_size):
        group = outs[first:first + shard_size]
        got = {n: torch.cat([r[n] for r in group]) for n in group[0]}
        bad = [n for n in ref if not torch.equal(got[n], ref[n])]
        assert not bad, f"{what}: {bad} differ from one uninterrupted process"


@pytest.mark.parametrize("state_dict_type", ["sharded", "full"])
@pytest.mark.parametrize("kind", ["adamw8bit", "muon"])
def test_fabric_checkpoints_move_between_hsdp_and_full_sharding(worlds, tmp_path, kind,
                                                                 state_dict_type):
    ref = _reference(kind)
    half = STEPS // 2
    hsdp, full = str(tmp_path / "hsdp.ckpt"), str(tmp_path / "full.ckpt")
    worlds(4).run(_run, kind, (2, 2), range(0, half), state_dict_type, save_to=hsdp)
    worlds(4).run(_run, kind, None, range(0, half), state_dict_type, save_to=full)
    for world, mesh, src, shard_size in [(4, None, hsdp, 4), (2, None, hsdp, 2),
                                         (4, (2, 2), full, 2), (4, (2, 2), hsdp, 2)]:
        outs = worlds(world).run(_run, kind, mesh, range(half, STEPS), state_dict_type,
                                 load_from=src)
        _check(outs, shard_size, ref, f"{kind} {state_dict_type}: {src} on {mesh} x {world}")
