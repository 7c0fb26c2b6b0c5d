"""FSDP2's own FSDP + TP tests (issue 37), ported to CPU/gloo at world 4 as (dp 2, tp 2) and
run on torch's FSDP2 and on ours (design note [fsdp-tp]; pattern of ``_fsdp2_compat``).

Upstream (``test/distributed/_composable/fsdp/`` in pytorch/pytorch; the files do not ship with
the wheel, so each case names its original):

* ``test_fully_shard_init.py``: ``TestFullyShardShardedParameterDTensor.
  test_shard_dtensor_parameters``, ``TestFullyShardDeviceDTensor.
  test_move_states_to_device_dtensor_valid`` and ``TestFullyShardMetaDeviceInit.
  test_meta_device_2d_init``.
* ``test_fully_shard_training.py``: ``TestFullyShard2DTraining.test_train_parity_2d_mlp``,
  ``test_train_parity_2d_transformer`` (without ``shard_placement_fn``: refused with TP on our
  side), ``test_train_parity_2d_transformer_checkpoint_resume`` (one sub-case) and
  ``TestFullyShard2DStateDict.test_fully_shard_tp_2d_set_full_state_dict``.
* ``test_fully_shard_state_dict.py``: ``test_2d_state_dict_correctness``,
  ``test_dp_tp_state_dict_save_load`` and ``test_hsdp_tp_state_dict_save_load`` (at world 4 its
  mesh ``(2, 2, world // 4)`` is ``(2, 2, 1)``).

Models: upstream's ``MLP``/``MLPStack`` (``torch.testing._internal.common_fsdp``) and
``Transformer`` (``..._tensor.common_dtensor``), imported, as upstream does. Sub-case grids are
trimmed to keep the file quick; what each keeps is said where it runs.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint  # noqa: F401 - imported before the ranks fork
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.tensor.parallel  # noqa: F401
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.testing._internal.common_fsdp import MLP, MLPStack
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

import lightning_vescale.fsdp  # noqa: F401
from tests.distributed._fsdp2_compat import IMPLS, fully_shard_of


def _mesh(shape=(2, 2), names=("dp", "tp")):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _mlp_plan(n: int) -> dict:
    return {k: v for i in range(n) for k, v in ((f"{i}.in_proj", ColwiseParallel()),
                                                (f"{i}.out_proj", RowwiseParallel()))}


def _diff(a: torch.Tensor, b: torch.Tensor, what: str) -> str | None:
    """``None`` when close (upstream's ``assertEqual`` on float32: rtol 1.3e-6, atol 1e-5)."""
    try:
        torch.testing.assert_close(a, b)
    except AssertionError as e:
        return f"{what}: {str(e).splitlines()[0]}"
    return None


def _is_ragged(p) -> bool:
    from lightning_vescale.placement import RaggedShard

    return isinstance(p, RaggedShard)


# -- test_fully_shard_init.py ----------------------------------------------------------------
def _shard_dtensor_parameters_body(impl: str) -> list[str]:
    """``test_shard_dtensor_parameters``: odd dims (uneven shards) after a colwise/rowwise plan;
    placements are FSDP2's ``(_StridedShard(0, sf=tp), Shard(0))`` / ``(Shard(0), Shard(1))`` /
    ``(Shard(0), Replicate())`` there, ``(RaggedShard, <TP placement>)`` here. Added: the full
    tensors equal the originals."""
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = _mesh()
    torch.manual_seed(0)
    model = MLP(9, dim_multiplier=3)
    orig = {n: p.detach().clone() for n, p in model.named_parameters()}
    parallelize_module(model, mesh["tp"], {"in_proj": ColwiseParallel(),
                                          "out_proj": RowwiseParallel()})
    fully_shard_of(impl)(model, mesh=mesh["dp"])
    bad = []
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor) or p.device_mesh != mesh:
            bad.append(f"{name}: not a DTensor on the (dp, tp) mesh")
            continue
        if p.size() != orig[name].size() or p.stride() != orig[name].stride():
            bad.append(f"{name}: size/stride {p.size()}/{p.stride()}")
        tp = Shard(0) if "in_proj" in name else Shard(1) if "weight" in name else Replicate()
        if impl == "torch":
            dp = _StridedShard(0, split_factor=2) if "in_proj" in name else Shard(0)
            ok = tuple(p.placements) == (dp, tp)
        else:
            ok = _is_ragged(p.placements[0]) and p.placements[1] == tp
        if not ok:
            bad.append(f"{name}: placements {p.placements}")
        bad.append(_diff(p.full_tensor(), orig[name], f"{name} full_tensor"))
    return [b for b in bad if b]


def _move_states_body(impl: str) -> list[str]:
    """``test_move_states_to_device_dtensor_valid`` on CPU: parameters (their local tensors
    too) and buffers end on the mesh's device type."""
    mesh = _mesh()
    model = MLP(8, torch.device("cpu"), with_buffer=True)
    parallelize_module(model, mesh["tp"], {"in_proj": ColwiseParallel(),
                                          "out_proj": RowwiseParallel()})
    fully_shard_of(impl)(model, mesh=mesh["dp"])
    bad = []
    for t in itertools.chain(model.parameters(), model.buffers()):
        local = t.to_local() if isinstance(t, DTensor) else t
        if t.device.type != mesh.device_type or local.device.type != mesh.device_type:
            bad.append(f"{type(t).__name__} on {t.device}")
    return bad


def _meta_2d_body(impl: str) -> list[str]:
    """``test_meta_device_2d_init`` (mlp_dim 8 and 3): meta TP parameters are sharded,
    ``to_empty`` + ``reset_parameters`` initialise them and a step runs (ours refused them at
    ``fully_shard`` before issue 33's follow-up; their values: ``test_tp_fsdp.py``)."""
    mesh = _mesh()
    bad = []
    for mlp_dim in (8, 3):
        with torch.device("meta"):
            model = MLP(mlp_dim, with_buffer=True)
            parallelize_module(model, mesh["tp"], {"in_proj": ColwiseParallel(),
                                                  "out_proj": RowwiseParallel()})
        fs = fully_shard_of(impl)
        for m in (model.in_proj, model.out_proj, model):
            fs(m, mesh=mesh["dp"])
        model.to_empty(device=mesh.device_type)
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        model(torch.randn(4, mlp_dim)).sum().backward()
        opt.step()
        bad += [f"{n} not initialised" for n, p in model.named_parameters()
                if not torch.isfinite(p.full_tensor()).all()]
    return [b for b in bad if b]


@pytest.mark.parametrize("impl", IMPLS)
def test_fully_shard_init_tp_cases(worlds, impl):
    for body in (_shard_dtensor_parameters_body, _move_states_body, _meta_2d_body):
        bad = worlds(4).run(body, impl)
        assert not any(bad), (impl, body.__name__, bad)


# -- test_fully_shard_training.py ------------------------------------------------------------
def _parallelize_mlp_stack(impl: str, model: MLPStack, mesh, ac: bool, **kw) -> MLPStack:
    """``MLPStack.parallelize`` with ``impl``'s ``fully_shard`` (upstream's calls torch's)."""
    from torch.distributed._composable import checkpoint

    plan = {k: (ColwiseParallel(use_local_output=False) if k.endswith("in_proj")
                else RowwiseParallel(use_local_output=False)) for k in _mlp_plan(3)}
    plan["2.out_proj"] = RowwiseParallel()
    parallelize_module(model, mesh["tp"], plan)
    fs = fully_shard_of(impl)
    for m in model:
        if ac:
            checkpoint(m)
        fs(m, mesh=mesh["dp"], **kw)
    fs(model, mesh=mesh["dp"], **kw)
    return model


def _train_parity_2d_mlp_body(impl: str) -> list[str]:
    """``test_train_parity_2d_mlp``: 10 Adam steps against a data-parallel reference on the
    dp group (upstream's ``replicate``: here the reference's gradients are averaged over dp by
    hand). Grid kept: mlp_dim 3 (uneven TP and dp shards) and 16 x (reshard_after_forward,
    activation checkpointing) in {(True, False), (False, True)}."""
    mesh = _mesh()
    dp_group = mesh["dp"].get_group()
    bad = []
    for mlp_dim, (raf, ac) in itertools.product((3, 16), ((True, False), (False, True))):
        torch.manual_seed(42)
        model = MLPStack(mlp_dim)
        ref = copy.deepcopy(model)
        ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2, foreach=False)
        _parallelize_mlp_stack(impl, model, mesh, ac, reshard_after_forward=raf)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
        torch.manual_seed(42 + mesh["dp"].get_local_rank() + 1)
        for it in range(10):
            x = torch.randn(8, mlp_dim)
            losses = []
            for m, o in ((ref, ref_opt), (model, opt)):
                o.zero_grad(set_to_none=(it % 2 == 0))
                losses.append(m(x).sum())
                losses[-1].backward()
                if m is ref:
                    for p in ref.parameters():
                        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG, group=dp_group)
                o.step()
            bad.append(_diff(losses[1].detach(), losses[0].detach(),
                             f"mlp_dim={mlp_dim} raf={raf} ac={ac} iter {it} loss"))
    return [b for b in bad if b]


def _train_parity_2d_transformer_body(impl: str) -> list[str]:
    """``test_train_parity_2d_transformer`` (use_shard_placement_fn=False): upstream's
    Transformer with sequence parallelism, 5 AdamW steps; losses, full gradients and
    parameters equal the reference's, ``pos_embeddings``' TP placement (and its gradient's)
    stays ``Shard``. On CPU: the math attention kernel without the causal mask (see below)."""
    torch.manual_seed(42)
    # use_attn_mask=False: on CPU the math kernel builds the causal mask as a plain tensor
    # (mixed with DTensor scores); upstream's GPU kernels take is_causal under DTensor
    args = ModelArgs(n_layers=3, dropout_p=0.0, use_attn_mask=False)
    model = Transformer(args)
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    mesh = _mesh()
    model = Transformer.parallelize(model, mesh["tp"], use_seq_parallel=True)
    fs = fully_shard_of(impl)
    for layer in model.layers:
        fs(layer, mesh=mesh["dp"])
    fs(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    bad = [_diff(p.full_tensor(), r, "init") for p, r in zip(model.parameters(),
                                                              ref.parameters())]
    torch.manual_seed(42 + mesh.get_local_rank("dp"))
    x = torch.randint(0, args.vocab_size, (2, 16))
    for step in range(5):
        # the math kernel: DTensor has no sharding rule for CPU's flash attention (upstream
        # runs on GPUs)
        with sdpa_kernel(SDPBackend.MATH):
            ref_loss, loss = ref(x).sum(), model(x).sum()
        bad.append(_diff(loss.detach(), ref_loss.detach(), f"step {step} loss"))
        ref_loss.backward()
        loss.backward()
        for p in ref.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=mesh.get_group("dp"), op=dist.ReduceOp.AVG)
        pos = model.pos_embeddings.weight
        if not isinstance(pos.placements[1], Shard) or not isinstance(
                pos.grad.placements[1], Shard):
            bad.append(f"pos_embeddings placements {pos.placements} / {pos.grad.placements}")
        for (n, p), r in zip(model.named_parameters(), ref.parameters()):
            bad.append(_diff(p.grad.full_tensor(), r.grad, f"step {step} grad {n}"))
        ref_opt.step()
        opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    bad += [_diff(p.full_tensor(), r, f"final {n}") for (n, p), r in
            zip(model.named_parameters(), ref.parameters())]
    return [b for b in bad if b]


@pytest.mark.parametrize("impl", IMPLS)
def test_train_parity_2d_mlp(worlds, impl):
    bad = worlds(4).run(_train_parity_2d_mlp_body, impl)
    assert not any(bad), (impl, bad)


@pytest.mark.parametrize("impl", IMPLS)
def test_train_parity_2d_transformer(worlds, impl):
    bad = worlds(4).run(_train_parity_2d_transformer_body, impl)
    assert not any(bad), (impl, bad)


# -- test_fully_shard_state_dict.py ----------------------------------------------------------
def _state_dict_correctness_body(impl: str) -> list[str]:
    """``test_2d_state_dict_correctness``: each sharded state dict value's full tensor equals
    the unsharded model's."""
    mesh = _mesh()
    torch.manual_seed(42)
    model = nn.Sequential(*[MLP(4) for _ in range(3)])
    model_2d = parallelize_module(copy.deepcopy(model), mesh["tp"], _mlp_plan(3))
    fs = fully_shard_of(impl)
    for mlp in model_2d:
        fs(mlp, mesh=mesh["dp"])
    fs(model_2d, mesh=mesh["dp"])
    bad = []
    for (k, t), d in zip(model.state_dict().items(), model_2d.state_dict().values()):
        bad.append(None if isinstance(d, DTensor) else f"{k} is not a DTensor")
        bad.append(_diff(d.full_tensor(), t, k))
    return [b for b in bad if b]


def _state_dict_save_load(model: nn.Module) -> list[str]:
    """Upstream's ``_test_state_dict_save_load``: state dict values are DTensors sharing the
    sharded parameters' storage; loading new DTensors writes their values into the parameters
    (in place where the dp shard is even)."""
    bad = [f"{n} is {type(p).__name__}" for n, p in model.named_parameters()
           if not isinstance(p, DTensor)]
    old, new = 1.0, 42.0 + dist.get_rank()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(old)
    ptr = {n: p.to_local().data_ptr() for n, p in model.named_parameters()}
    sd = model.state_dict()
    if set(sd) != set(ptr):
        bad.append(f"keys {sorted(sd)} != {sorted(ptr)}")
    for n, t in sd.items():
        if not isinstance(t, DTensor):
            bad.append(f"state dict {n} is not a DTensor")
        elif t.to_local().numel() and t.to_local().data_ptr() != ptr[n]:
            bad.append(f"state dict {n} does not share the parameter's storage")
    new_sd = {n: t.detach().clone().fill_(new) for n, t in sd.items()}
    model.load_state_dict(new_sd)
    for n, p in model.named_parameters():
        local = p.to_local()
        if not torch.equal(local, torch.full_like(local, new)):
            bad.append(f"{n} not loaded")
        even = local.size(0) * p.device_mesh.size() == p.size(0)
        if even and local.numel() and local.data_ptr() != ptr[n]:
            bad.append(f"{n}: an even shard's storage moved on load")
    return bad


def _save_load_body(impl: str, shape: tuple[int, ...], names: tuple[str, ...]) -> list[str]:
    """``test_dp_tp_state_dict_save_load`` (mesh (2, 2)) and ``test_hsdp_tp_state_dict_save_load``
    (mesh (2, 2, 1) at world 4), mlp_dim 4, 6, 8, 10."""
    mesh = _mesh(shape, names)
    dp = mesh[names[:-1]] if len(names) == 3 else mesh["dp"]
    bad = []
    for mlp_dim in (4, 6, 8, 10):
        torch.manual_seed(42)
        model = parallelize_module(nn.Sequential(*[MLP(mlp_dim) for _ in range(3)]),
                                   mesh["tp"], _mlp_plan(3))
        fs = fully_shard_of(impl)
        for mlp in model:
            fs(mlp, mesh=dp)
        fs(model, mesh=dp)
        bad += [f"mlp_dim={mlp_dim}: {b}" for b in _state_dict_save_load(model)]
    return bad


@pytest.mark.parametrize("impl", IMPLS)
def test_fully_shard_state_dict_2d_cases(worlds, impl):
    cases = ((_state_dict_correctness_body,),
             (_save_load_body, (2, 2), ("dp", "tp")),
             (_save_load_body, (2, 2, 1), ("dp_replicate", "dp_shard", "tp")))
    for body, *args in cases:
        bad = worlds(4).run(body, impl, *args)
        assert not any(bad), (impl, body.__name__, args, bad)


class SimpleModel(nn.Module):
    """Upstream's ``SimpleModel`` of ``test_fully_shard_training.py``."""

    def __init__(self) -> None:
        super().__init__()
        self.net1, self.net2, self.net3 = nn.Linear(5, 8), nn.Linear(8, 4), nn.Linear(4, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.net1(x))
        x = torch.relu(self.net2(x))
        return torch.relu(self.net3(x))


def _set_full_state_dict_body(impl: str) -> list[str]:
    """``test_fully_shard_tp_2d_set_full_state_dict``: full model and optimizer state dicts
    (cpu_offload, broadcast_from_rank0) set back give the same sharded state dicts."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    mesh = _mesh()
    torch.manual_seed(0)
    model = parallelize_module(SimpleModel(), mesh["tp"], {
        "net1": ColwiseParallel(), "net2": RowwiseParallel(), "net3": ColwiseParallel()})
    fully_shard_of(impl)(model, mesh=mesh["dp"])
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.rand(4, 5)).sum().backward()
    optim.step()
    ref_msd = copy.deepcopy(get_model_state_dict(model))
    ref_osd = copy.deepcopy(get_optimizer_state_dict(model, optimizers=optim))
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, broadcast_from_rank0=True)
    full_msd = get_model_state_dict(model, options=opts)
    full_osd = get_optimizer_state_dict(model, optimizers=optim, options=opts)
    set_model_state_dict(model, full_msd, options=opts)
    set_optimizer_state_dict(model, optimizers=optim, optim_state_dict=full_osd, options=opts)
    new_msd = get_model_state_dict(model)
    new_osd = get_optimizer_state_dict(model, optimizers=optim)
    bad = []

    def same(a, b, what: str) -> None:
        if isinstance(a, dict):
            if set(a) != set(b):
                bad.append(f"{what}: keys differ")
            for k in a:
                same(a[k], b.get(k), f"{what}.{k}")
        elif isinstance(a, DTensor):
            if not isinstance(b, DTensor) or a.placements != b.placements:
                bad.append(f"{what}: placements {a.placements} vs {getattr(b, 'placements', b)}")
            else:
                bad.append(_diff(b.to_local(), a.to_local(), what))
        elif isinstance(a, torch.Tensor):
            bad.append(_diff(b, a, what))
        elif isinstance(a, (list, tuple)):  # (upstream's assertEqual: tuple == list)
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                same(x, y, f"{what}[{i}]")
        elif a != b:
            bad.append(f"{what}: {a!r} != {b!r}")

    same(ref_msd, new_msd, "model")
    same(ref_osd, new_osd, "optim")
    return [b for b in bad if b]


def _checkpoint_resume_body(impl: str, path: str) -> list[str]:
    """``test_train_parity_2d_transformer_checkpoint_resume``, sub-case use_seq_parallel=True,
    reuse_model_optim=False, AdamW: one step, DCP save of the model and optimizer state dicts,
    a new model (other seed, one step taken) loads them in place and its next step's loss
    equals the uninterrupted run's second."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    fs = fully_shard_of(impl)
    mesh = _mesh()
    args = ModelArgs(dropout_p=0.0, use_attn_mask=False)  # see the transformer case

    def build(seed: int):
        torch.manual_seed(seed)
        model = Transformer.parallelize(Transformer(args), mesh["tp"], True)
        for layer in model.layers:
            fs(layer, mesh=mesh["dp"])
        fs(model, mesh=mesh["dp"])
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(model, optim, x) -> torch.Tensor:
        with sdpa_kernel(SDPBackend.MATH):
            loss = model(x).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss.detach()

    model, optim = build(42)
    torch.manual_seed(42 + mesh["dp"].get_local_rank() + 1)
    x = torch.randint(0, args.vocab_size, (3, 16))
    loss1, loss2 = step(model, optim, x), step(model, optim, x)
    model, optim = build(42)
    bad = [_diff(step(model, optim, x), loss1, "first step")]
    dcp.save({"model": get_model_state_dict(model),
              "optim": get_optimizer_state_dict(model, optim)}, checkpoint_id=path)
    model, optim = build(43)  # other values; a step creates the optimizer state to load into
    if torch.equal(step(model, optim, x), loss2):
        bad.append("a model of another seed gave the same loss")
    # DCP loads in place: the state dicts' tensors are the parameters' and optimizer's storage
    dcp.load({"model": get_model_state_dict(model),
              "optim": get_optimizer_state_dict(model, optim)}, checkpoint_id=path)
    bad.append(None if optim.state_dict()["state"] else "no optimizer state")
    bad.append(_diff(step(model, optim, x), loss2, "resumed step"))
    return [b for b in bad if b]


@pytest.mark.parametrize("impl", IMPLS)
def test_fully_shard_2d_optimizer_state_dicts(worlds, impl, tmp_path):
    bad = worlds(4).run(_set_full_state_dict_body, impl)
    assert not any(bad), (impl, bad)
    bad = worlds(4).run(_checkpoint_resume_body, impl, str(tmp_path / "ckpt"))
    assert not any(bad), (impl, bad)
