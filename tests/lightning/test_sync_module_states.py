"""``sync_module_states`` (design note [sync-module-states]): unseeded ranks start from global
rank 0's initial weights, as with DDP, on a 1-D and an HSDP mesh."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from examples.gpt import GPT
from lightning_vescale._lightning.sync_states import broadcast_module_states
from lightning_vescale.mesh import init_mesh
from tests.lightning._lit import CONFIG, TinyGPT, dataloader, trainer


def _broadcast_body(shape):
    torch.manual_seed(100 + dist.get_rank())  # every rank draws other weights
    model = GPT(CONFIG)
    mesh = init_mesh("cpu", *shape) if len(shape) == 1 else \
        torch.distributed.device_mesh.init_device_mesh("cpu", shape)
    broadcast_module_states(model, mesh)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("world_size,shape", [(2, (2,)), (4, (2, 2))], ids=["1d", "hsdp"])
def test_broadcast_gives_every_rank_rank0s_states(worlds, world_size, shape):
    results = worlds(world_size).run(_broadcast_body, shape)
    torch.manual_seed(100)
    want = GPT(CONFIG).state_dict()
    for states in results:
        for k, v in want.items():
            torch.testing.assert_close(states[k], v, rtol=0, atol=0)


class PerRankInit(TinyGPT):
    """Builds its GPT in ``configure_model`` from a per-rank seed (an unseeded run), records the
    full initial parameters (after sharding) and the first loss."""

    def __init__(self, out_dir: str, tag: str) -> None:
        super().__init__(out_dir=out_dir, tag=tag)
        self.model = None

    def configure_model(self) -> None:
        if self.model is None:
            torch.manual_seed(100 + self.global_rank)
            self.model = GPT(CONFIG)

    def on_fit_start(self) -> None:
        full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for n, p in self.model.named_parameters()}
        torch.save(full, Path(self.out_dir) / f"{self.tag}_init_rank{self.global_rank}.pt")


def _run(strategy: Any, tmp_path: Path, tag: str) -> list[float]:
    trainer(strategy, max_steps=1).fit(PerRankInit(str(tmp_path), tag), dataloader())
    return [torch.load(tmp_path / f"{tag}_rank{r}.pt")[0] for r in range(2)]


def test_unseeded_ranks_start_from_rank0_and_match_ddp(tmp_path):
    from lightning_vescale import VeScaleFSDPStrategy

    ours = _run(VeScaleFSDPStrategy(start_method="fork"), tmp_path, "ours")
    torch.manual_seed(100)
    want = dict(GPT(CONFIG).named_parameters())
    for r in range(2):
        init = torch.load(tmp_path / f"ours_init_rank{r}.pt")
        for n, p in want.items():
            torch.testing.assert_close(init[n], p.detach(), rtol=0, atol=0, msg=n)
    ddp = _run("ddp_fork", tmp_path, "ddp")
    assert ours == pytest.approx(ddp, rel=1e-6)  # the first step's per-rank losses


def test_off_keeps_each_ranks_own_draw(tmp_path):
    from lightning_vescale import VeScaleFSDPStrategy

    _run(VeScaleFSDPStrategy(start_method="fork", sync_module_states=False), tmp_path, "off")
    torch.manual_seed(100)  # rank 0's draw
    rank0 = dict(GPT(CONFIG).named_parameters())
    for r in range(2):  # the elements rank 1 owns come from rank 1's own draw (main's behaviour)
        init = torch.load(tmp_path / f"off_init_rank{r}.pt")
        assert any(not torch.equal(init[n], p.detach()) for n, p in rank0.items())


def test_sync_module_states_must_be_a_bool():
    from lightning_vescale import VeScaleFSDPStrategy

    with pytest.raises(TypeError, match="sync_module_states must be True or False, got 'yes'"):
        VeScaleFSDPStrategy(sync_module_states="yes")
