"""Meta-device init and ``materialize`` (exact, group by group), device moves, and the
lifetime of a sharded model (garbage collected with its DBuffers)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from tests.distributed._fully_shard_helpers import (
    OPTS,
    assemble,
    batches,
    build,
    local_pieces,
    make_opt,
    micro,
    shard,
)


# -- meta-device init ---------------------------------------------------------------------------
def _meta_body():
    from examples.gpt import GPT, GPTConfig
    from lightning_vescale.fsdp import materialize, memory_bytes

    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.device("meta"):
        model = GPT(GPTConfig())
    shard(model)
    meta_mem = memory_bytes(model)
    torch.manual_seed(0)
    materialize(model, "cpu", init_fn=lambda m: m.reset_parameters())
    ref = build("gpt", seed=1)
    torch.manual_seed(0)
    ref.reset_parameters()  # the same init sequence, on a plain model
    # train one step to check the materialised module is fully functional
    opt = make_opt(model.parameters(), "sgd")
    ref_opt = OPTS["sgd"][0](ref.parameters(), **OPTS["sgd"][1])
    x, y = batches("gpt", 1, 2 * world)[0]
    loss = model(micro(x, rank, world), micro(y, rank, world))
    loss.backward()
    opt.step()
    ref(x, y).backward()
    ref_opt.step()
    return meta_mem, local_pieces(model), {n: p.detach().clone() for n, p in ref.named_parameters()}


def test_meta_init_then_materialize(worlds):
    res = worlds(2).run(_meta_body)
    assert res[0][0]["param_shard"] == 0
    got, ref = assemble([r[1] for r in res]), res[0][2]
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-6, msg=n)


class _Stack(torch.nn.Module):
    """Root group: ``inp`` and ``out``; four block groups in between."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(4))
        self.out = torch.nn.Linear(16, 4)


def _default_materialize_body():
    from lightning_vescale.fsdp import fully_shard, materialize

    with torch.device("meta"):
        model = _Stack()
    for blk in model.blocks:
        fully_shard(blk)
    fully_shard(model)
    full_numel = []  # full-size temporaries registered in the model at each reset_parameters()
    original = torch.nn.Linear.reset_parameters

    def counting(self):
        full_numel.append(sum(p.numel() for p in model.parameters() if not isinstance(p, DTensor)))
        original(self)

    torch.nn.Linear.reset_parameters = counting
    try:
        torch.manual_seed(0)
        materialize(model, "cpu")  # default init: group by group
    finally:
        torch.nn.Linear.reset_parameters = original
    ref = _Stack()
    torch.manual_seed(0)
    for m in ref.modules():  # the same calls in the same order on a plain model
        if callable(getattr(m, "reset_parameters", None)):
            m.reset_parameters()
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    return local_pieces(model), ref_params, max(full_numel)


def test_default_materialize_is_group_by_group_and_exact(worlds):
    res = worlds(2).run(_default_materialize_body)
    got, ref = assemble([r[0] for r in res]), res[0][1]
    for n in ref:
        assert torch.equal(got[n], ref[n]), n
    root = 8 * 16 + 16 + 16 * 4 + 4
    block = 16 * 16 + 16
    for r in res:  # the root group and one block at a time, not the whole model (root + 4 blocks)
        assert r[2] <= root + block, r[2]


def _gc_body():
    import gc

    from lightning_vescale.dbuffer import live_dbuffers

    rank, world = dist.get_rank(), dist.get_world_size()
    gc.collect()
    before = len(live_dbuffers())
    model = build("gpt")
    shard(model)
    x, y = batches("gpt", 1, 2 * world)[0]
    model(micro(x, rank, world), micro(y, rank, world)).backward()
    during = len(live_dbuffers())
    del model, x, y
    gc.collect()
    return before, during, len(live_dbuffers())


def test_sharded_model_is_garbage_collected(worlds):
    before, during, after = worlds(2).run(_gc_body)[0]
    assert during == before + 3  # root + 2 blocks
    assert after == before


# -- device moves keep the mesh ------------------------------------------------------------------
def _device_move_body():
    from torch.distributed.device_mesh import DeviceMesh

    from lightning_vescale.fsdp import fully_shard, materialize

    group = dist.new_group(list(range(dist.get_world_size())))
    # A user mesh of another device type than the parameters (built without touching a GPU), so
    # materialising on CPU moves the group to another device type.
    user_mesh = DeviceMesh.from_group(group, "cuda", mesh_dim_names=("mine",))
    with torch.device("meta"):
        model = _Stack()
    for blk in model.blocks:
        fully_shard(blk, mesh=user_mesh)
    fully_shard(model, mesh=user_mesh)
    torch.manual_seed(0)
    materialize(model, "cpu")
    meshes = [p.device_mesh for p in model.parameters()]
    return ([m.device_type for m in meshes], [m.mesh_dim_names for m in meshes],
            all(m.get_group() is group for m in meshes))


def test_device_move_keeps_a_user_mesh(worlds):
    for device_types, dim_names, same_group in worlds(2).run(_device_move_body):
        assert set(device_types) == {"cpu"}
        assert set(dim_names) == {("mine",)}
        assert same_group  # the user's process group, not the default world mesh


# -- list groups under to_empty / to / _apply (design note [fsdp-list-apply]) -------------------
class _ListHead(torch.nn.Module):
    """torchtitan's layout: embedding, a block of its own, then ``fully_shard([norm, head])``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16)
        self.block = torch.nn.Linear(16, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.head = torch.nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.norm(torch.tanh(self.block(self.emb(x)))))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), x.roll(1, 1).flatten())


def _init_normal(model: torch.nn.Module) -> None:
    """What torchtitan's ``init_weights`` does after ``to_empty``: in-place random fills of the
    (sharded) parameters, in a fixed order from a fixed seed."""
    torch.manual_seed(3)
    with torch.no_grad():
        for _, p in model.named_parameters():
            torch.nn.init.normal_(p, std=0.3)


def _list_group_body(flow: str):
    from lightning_vescale.fsdp import fully_shard, materialize

    dtype = torch.float64 if flow == "to" else torch.float32
    torch.manual_seed(0)
    with torch.device("meta" if flow != "to" else "cpu"):
        model = _ListHead()
    torch.manual_seed(0)
    ref = _ListHead()
    fully_shard(model.block)
    fully_shard([model.norm, model.head])
    fully_shard(model)
    if flow == "to_empty":
        model.to_empty(device="cpu")
        _init_normal(model)
        _init_normal(ref)
    elif flow == "materialize":  # to_empty, then reset_parameters() on full temporaries
        torch.manual_seed(1)
        materialize(model, "cpu")
        torch.manual_seed(1)
        for m in ref.modules():
            if callable(getattr(m, "reset_parameters", None)):
                m.reset_parameters()
    else:
        model.to(dtype)
        ref.to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    x = torch.randint(0, 32, (4, 6), generator=torch.Generator().manual_seed(5))
    losses, ref_losses = [], []
    for _ in range(4):  # every rank the full batch: the averaged gradient is the gradient
        for m, o, out in ((model, opt, losses), (ref, ref_opt, ref_losses)):
            loss = m(x)
            loss.backward()
            o.step()
            o.zero_grad()
            out.append(loss.item())
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    return losses, ref_losses, params, {n: p.detach() for n, p in ref.named_parameters()}


@pytest.mark.parametrize("flow", ["to_empty", "materialize", "to"])
@pytest.mark.parametrize("world", [1, 2])
def test_list_group_trains_after_to_empty_and_to(worlds, world, flow):
    """A ``fully_shard([norm, head])`` group's parameters are the ones the optimizer steps and
    the forward reads after ``to_empty`` + init (torchtitan's meta-device flow), ``materialize``
    and ``.to(dtype)``: losses and parameters equal a single-process run (before the fix the
    list group's sharded parameters stopped viewing its DBuffer after ``to_empty``, and the
    loss never moved)."""
    for losses, ref_losses, params, ref_params in worlds(world).run(_list_group_body, flow):
        assert losses[-1] < losses[0]
        torch.testing.assert_close(losses, ref_losses, rtol=1e-6, atol=1e-6)
        for n, p in ref_params.items():
            torch.testing.assert_close(params[n], p, rtol=1e-5, atol=1e-6, msg=n)


def _swapped_param_body():
    from lightning_vescale.fsdp import fully_shard

    model = _ListHead()
    fully_shard(model.block)
    fully_shard(model)
    w = model.block.weight
    torch.utils.swap_tensors(w, torch.nn.Parameter(torch.empty_like(w)))
    try:
        model(torch.zeros(2, 3, dtype=torch.long))
    except RuntimeError as e:
        return str(e)
    return None


def test_a_swapped_sharded_param_is_named_at_lazy_init(worlds):
    """A sharded parameter that stopped viewing its DBuffer would train nothing, silently: the
    root's lazy init names it instead (design note [fsdp-list-apply])."""
    msg = worlds(1).run(_swapped_param_body)[0]
    assert msg is not None and "'block.weight' no longer views" in msg, msg
