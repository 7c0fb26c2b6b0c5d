"""CPU-offloaded tensors in collectives on a plain NCCL mesh, emulated on the CPU (issue 28).

With CPU offload, parameter shards, gradient shards and optimizer states live on the CPU while
the mesh is a CUDA one; plain NCCL refuses CPU tensors ("No backend type associated with device
type cpu"). Design note [mesh-device]: every collective that can meet such a tensor goes
through a device the group's backend takes, and offloaded states stay on the CPU.

The emulation, in one process:

* a process group of 2 ranks whose backend is torch's fake one (no communication: every
  collective returns at once) registered for the device type ``"cuda"`` only, as NCCL is; its
  ``_device_types`` are what :func:`lightning_vescale.mesh.collective_device` reads;
* a ``"cuda"`` ``DeviceMesh`` over it, and ``FakeTensorMode`` for the tensors, so that CUDA
  tensors exist without a GPU (values are fake, devices and shapes are checked like the real
  kernels do: a CPU state meeting a CUDA tensor raises a device mismatch);
* :class:`_NcclAudit`, a dispatch mode that sees every ``c10d`` / ``_c10d_functional`` op
  (every collective, whichever API issued it) and raises, like NCCL, when one of its tensors
  is not on the GPU. Under ``FakeTensorMode`` the fake backend's own check does not run (the
  fake mode answers the op first), hence the audit.

What it cannot show: values (the fake backend returns garbage), streams and timings; the
numerics of the staged paths are the same code on a device the backend takes, tested on gloo
elsewhere, and ``python -m benchmarks.gpu_check`` runs the offloaded optimizers on a GPU.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import lightning_vescale.mesh as mesh_mod
from lightning_vescale.optim import SOAP, AdamW8bit, FlatParamOptimizer, Muon
from lightning_vescale.placement import RaggedShard, ragged_from_local

pytestmark = pytest.mark.filterwarnings(  # the AdamW8bit fast path's storage key, on fakes
    "ignore:Accessing the data pointer of FakeTensor")

_BACKEND = "lv_fake_nccl"
WORLD = 2


#: The ``torch.distributed`` functions the audit wraps (what the package calls, by module
#: attribute; nested calls inside a DTensor op's dispatch are only seen here).
_WRAPPED = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
            "all_to_all_single", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single")


class _NcclAudit(TorchDispatchMode):
    """Raise like NCCL when a collective gets a tensor that is not on the GPU, and record the
    collectives seen (name, device types of their tensors).

    Two views of the same calls: this dispatch mode sees every ``c10d`` /
    ``_c10d_functional`` op issued outside an operator's dispatch (recorded as
    ``c10d::alltoall_base_``, ...: torch's functional collectives included), and
    :meth:`wrap` replaces the ``torch.distributed`` functions of :data:`_WRAPPED` (recorded as
    ``dist.all_to_all_single``, ...), which also sees the collectives a DTensor operator's
    handler issues from inside its dispatch, where a dispatch mode is off."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, frozenset[str]]] = []

    def check(self, name: str, tensors) -> None:
        kinds = frozenset(t.device.type for t in tensors if isinstance(t, torch.Tensor))
        self.seen.append((name, kinds))
        if kinds - {"cuda"}:
            raise RuntimeError(f"{name}: No backend type associated with device type "
                               f"{sorted(kinds - {'cuda'})} (NCCL takes CUDA tensors only)")

    def wrap(self, monkeypatch) -> None:
        for name in _WRAPPED:
            original = getattr(dist, name, None)
            if original is None:
                continue

            def checked(*args, _original=original, _name=name, **kwargs):
                self.check(f"dist.{_name}", tree_flatten((args, kwargs))[0])
                return _original(*args, **kwargs)
            monkeypatch.setattr(dist, name, checked)

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in ("c10d", "_c10d_functional"):
            self.check(func.name(), tree_flatten((args, kwargs))[0])
        return func(*args, **kwargs)


@pytest.fixture
def nccl(monkeypatch):
    """A fake 2-rank NCCL world (this process is rank 0), its CUDA mesh and the audit."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore, _create_fake_pg

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    if _BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(_BACKEND, _create_fake_pg, extended_api=True,
                                      devices=["cuda"])
    dist.init_process_group(_BACKEND, store=FakeStore(), rank=0, world_size=WORLD)
    # the current GPU as torch.accelerator would name it (a CPU build has none)
    monkeypatch.setattr(mesh_mod, "current_accelerator", lambda: torch.device("cuda", 0))
    # dist.broadcast asks a CUDA tensor's GPU for its capability (fp8 handling)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    _quant_caches(warm=True)  # AdamW8bit's code books: real CPU tensors, built outside
    # The owner-failure markers (design note [owner-failure]) are fake values here: no host
    # read of them; the failure path itself is tests/distributed/test_owner_failure.py's
    from lightning_vescale.optim._owner_failure import StepFailures

    def raise_own_error_only(self) -> None:
        if self.error is not None:
            raise self.error

    monkeypatch.setattr(StepFailures, "raise_if_failed", raise_own_error_only)
    # FlatParamOptimizer probes torch's AdamW on real values once per (options, dtype, device)
    from lightning_vescale.placement._flat_probe import optimizer_alignment

    probe = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(8))], lr=1e-3)
    optimizer_alignment(torch.optim.AdamW, probe.param_groups[0], torch.float32,
                        torch.device("cpu"))
    try:
        assert mesh_mod.group_device_types(None) == {"cuda"}
        mesh = init_device_mesh("cuda", (WORLD,))
        hsdp = init_device_mesh("cuda", (WORLD, 1))  # (replicate, shard): replicas of a shard
        audit = _NcclAudit()
        audit.wrap(monkeypatch)
        with FakeTensorMode(allow_non_fake_inputs=True), audit:
            yield types.SimpleNamespace(mesh=mesh, hsdp=hsdp, audit=audit)
    finally:
        dist.destroy_process_group()
        _quant_caches(warm=False)  # no fake tensor outlives the test in a cache


def _quant_caches(*, warm: bool) -> None:
    from lightning_vescale.optim import _quant

    for cached in (_quant._dynamic_map_values, _quant.codebook, _quant.zero_code):
        cached.cache_clear()
    if warm:
        for signed in (True, False):
            _quant.zero_code(signed)
            _quant.codebook(signed, torch.device("cpu"))
            _quant.codebook(signed, "cpu")


# -- helpers --------------------------------------------------------------------------------------
SPLIT = RaggedShard((0,), [3, 5])  # an 8-row matrix cut between the two ranks: owner mode


def _offloaded(mesh, shape=(8, 6), placement=SPLIT, rank: int = 0) -> DTensor:
    """A sharded tensor as CPU offload leaves it: CPU local tensor, CUDA mesh."""
    a, b = placement.local_range(shape, rank)
    return ragged_from_local(torch.randn(b - a), mesh, placement, shape, autograd=False)


def _param(mesh, shape=(8, 6), placement=SPLIT) -> torch.nn.Parameter:
    p = torch.nn.Parameter(_offloaded(mesh, shape, placement))
    p.grad = _offloaded(mesh, shape, placement)
    return p


def _plain_dtensor(local: torch.Tensor, mesh, placement) -> DTensor:
    """A DTensor with torch's ``placement`` whose local tensor stays on the CPU (what
    ``DTensor.from_local`` would move to the mesh's device)."""
    meta = TensorMeta(local.shape, local.stride(), local.dtype)
    return DTensor(local, DTensorSpec(mesh, (placement,), tensor_meta=meta), requires_grad=False)


def _collectives(audit) -> list[str]:
    assert all(kinds <= {"cuda"} for _, kinds in audit.seen), audit.seen
    return [name for name, _ in audit.seen]


def _states_on_cpu(opt) -> None:
    for st in opt.state.values():
        for key, v in st.items():
            if isinstance(v, torch.Tensor) and key != "step":
                local = v.to_local() if isinstance(v, DTensor) else v
                assert local.device.type == "cpu", (key, local.device)


# -- states stay with their offloaded parameter ----------------------------------------------------
def test_states_built_for_an_offloaded_parameter_stay_on_its_device(nccl):
    """``state_like`` / ``ShardLayout.to_dtensor`` (every optimizer's fresh and exported states,
    and the loaded ones) wrap the local tensor where it is. Before, they went through
    ``DTensor.from_local``, which moves a CPU local tensor to the mesh's device: on a GPU the
    offloaded state landed there and the next step mixed devices (here: "PyTorch is not linked
    with support for cuda devices", the attempted move)."""
    from lightning_vescale.optim._base import param_layout, state_like

    p = _offloaded(nccl.mesh)
    local = torch.zeros_like(p.to_local())
    assert state_like(p, local)._local_tensor is local  # no copy, no move
    layout = param_layout(p, where="test")
    assert layout.to_dtensor(local).to_local().device.type == "cpu"
    whole = _plain_dtensor(torch.zeros(8, 6), nccl.mesh, Replicate())
    assert state_like(whole, torch.ones(8, 6)).to_local().device.type == "cpu"
    assert nccl.audit.seen == []  # no communication either


# -- the optimizers' own collectives ---------------------------------------------------------------
def test_muon_owner_all_to_all_with_offload(nccl):
    ps = [("a.weight", _param(nccl.mesh)), ("b.weight", _param(nccl.mesh, (4, 10),
                                                                RaggedShard((0, 1), [10, 30])))]
    opt = Muon(ps, lr=0.02)
    opt.step()
    opt.step()
    names = _collectives(nccl.audit)
    assert names.count("c10d::alltoall_base_") == 4  # one bucket: there and back, per step
    _states_on_cpu(opt)
    assert all(p.to_local().device.type == "cpu" for _, p in ps)


def test_soap_owner_all_to_all_with_offload(nccl):
    p = _param(nccl.mesh)
    opt = SOAP([p], precondition_frequency=1)
    opt.step()
    opt.step()
    assert "c10d::alltoall_base_" in _collectives(nccl.audit)
    _states_on_cpu(opt)


@pytest.mark.parametrize("cls", ["Muon", "SOAP", "Shampoo"])
def test_matrix_optimizers_say_once_that_offload_runs_their_maths_on_the_cpu(nccl, cls,
                                                                            monkeypatch):
    """Issue 35: with CPU offload the owner's Newton-Schulz / eigh / QR run on the CPU (states
    and matrices live with the offloaded parameters); the first step says so, naming the
    optimizer, once per optimizer class."""
    import warnings

    import lightning_vescale.optim as optim
    import lightning_vescale.optim._base as base

    monkeypatch.setattr(base, "_WARNED_CPU_MATRIX_MATH", set())
    make = getattr(optim, cls)
    opt = make([_param(nccl.mesh)], lr=0.01)
    with pytest.warns(UserWarning, match=f"{cls} with CPU offload .* runs its .* on the CPU"):
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # once: not every step
        make([_param(nccl.mesh)], lr=0.01).step()  # nor every optimizer of the class


def test_matrix_optimizers_without_offload_do_not_warn(monkeypatch):
    import warnings

    import lightning_vescale.optim._base as base

    monkeypatch.setattr(base, "_WARNED_CPU_MATRIX_MATH", set())
    p = torch.nn.Parameter(torch.randn(8, 6))
    p.grad = torch.randn(8, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Muon([p], lr=0.02).step()
    assert not base.offloaded_to_cpu(p)


# -- optimizer-state loads: a state in another layout is gathered ----------------------------------
ONE_HOT = RaggedShard((0,), [0, 1])  # everything on rank 1 (scaled to the tensor below)


def _elsewhere(sd: dict, mesh) -> dict:
    """``sd`` with every DTensor state moved (an all-to-all of offloaded tensors) to rank 1."""
    def move(v):
        if not isinstance(v, DTensor):
            return v
        units = [0, v.shape[0]] if v.dim() else [0, 1]
        return v.redistribute(mesh, (RaggedShard((0,) if v.dim() else (), units),))
    return {"param_groups": sd["param_groups"],
            "state": {k: {key: move(v) for key, v in st.items()} for k, st in sd["state"].items()}}


LOADERS = {
    "muon": lambda p: Muon([("w", p)], lr=0.02),
    "adamw8bit": lambda p: AdamW8bit([p], min_8bit_size=0),
    "soap": lambda p: SOAP([p], precondition_frequency=1),
    "flat-adamw": lambda p: FlatParamOptimizer(torch.optim.AdamW([p], lr=1e-3)),
}


@pytest.mark.parametrize("name", sorted(LOADERS))
def test_state_load_from_another_layout_with_offload(nccl, name):
    p = _param(nccl.mesh, (8, 64), RaggedShard((0,), [4, 4]))  # block-aligned for AdamW8bit
    opt = LOADERS[name](p)
    opt.step()
    sd = opt.state_dict()
    _states_on_cpu(opt)  # exported as DTensors without moving to the mesh's device
    for st in sd["state"].values():
        for v in st.values():
            if isinstance(v, DTensor):
                assert v.to_local().device.type == "cpu"
    moved = _elsewhere(sd, nccl.mesh)
    nccl.audit.seen.clear()
    fresh = LOADERS[name](p)
    fresh.load_state_dict(moved)  # full_tensor() of each: a collective per state
    assert _collectives(nccl.audit), "nothing was gathered"
    _states_on_cpu(fresh)
    fresh.step()
    _states_on_cpu(fresh)


# -- DTensor redistribution, reductions and module-state broadcast of offloaded tensors ------------
def test_ragged_redistribute_of_offloaded_dtensor(nccl):
    x = _offloaded(nccl.mesh)
    partial = _plain_dtensor(torch.randn(8, 6), nccl.mesh, Partial())
    outs = {
        "full_tensor (padded all-gather)": x.full_tensor(),
        "to Shard(0) (all-to-all)": x.redistribute(nccl.mesh, (Shard(0),)).to_local(),
        "to another RaggedShard (all-to-all)":
            x.redistribute(nccl.mesh, (RaggedShard((0,), [5, 3]),)).to_local(),
        "one-hot full_tensor (broadcast)":
            _offloaded(nccl.mesh, placement=RaggedShard((0,), [8, 0])).full_tensor(),
        "Partial to RaggedShard (reduce-scatter)":
            partial.redistribute(nccl.mesh, (SPLIT,)).to_local(),
        "inf-norm (all-gather)": torch.linalg.vector_norm(x, float("inf")).to_local(),
        "2-norm (all-reduce)": torch.linalg.vector_norm(x, 2.0).to_local(),
    }
    names = set(_collectives(nccl.audit))
    assert {"c10d::_allgather_base_", "c10d::alltoall_base_", "c10d::broadcast_",
            "c10d::reduce_scatter_", "dist.all_gather_single", "dist.all_reduce"} <= names, names
    for what, out in outs.items():
        assert out.device.type == "cpu", what  # the result stays where the shard lives
    x.redistribute(nccl.mesh, (Replicate(),))  # ok too (same path as full_tensor)


def test_sync_module_states_broadcasts_offloaded_shards(nccl):
    from lightning_vescale._lightning.sync_states import broadcast_module_states

    hsdp = nccl.hsdp  # the replicas hold the same (CPU) shard: broadcast across them
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(ragged_from_local(torch.randn(48), hsdp,
                                                    (Replicate(), RaggedShard((0,), [8])),
                                                    (8, 6), autograd=False))
    assert broadcast_module_states(module, hsdp) == 1
    assert _collectives(nccl.audit) == ["dist.broadcast", "c10d::broadcast_"]
    assert module.w.to_local().device.type == "cpu"


# -- the helpers themselves: copy-free where the backend takes the tensor --------------------------
class _Group:
    def __init__(self, *kinds: str) -> None:
        self._device_types = [torch.device(k) for k in kinds]


def _record(monkeypatch, name: str, seen: list, work=None):
    def collective(*args, **kwargs):
        seen.append([t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)])
        return work
    monkeypatch.setattr(mesh_mod.dist, name, collective)


def test_helpers_fast_path_passes_the_callers_tensors(monkeypatch):
    """``cpu:gloo,cuda:nccl`` (or gloo) takes CPU tensors: the very tensors go to torch, no
    copy, and an asynchronous all-to-all returns torch's own handle."""
    seen: list = []
    both = _Group("cpu", "cuda")
    inp, out = torch.arange(4.0), torch.empty(4)
    _record(monkeypatch, "all_to_all_single", seen, work="torch's work")
    assert mesh_mod.all_to_all_single_anywhere(out, inp, [2, 2], [2, 2], group=both,
                                               async_op=True) == "torch's work"
    assert seen[-1][0] is out and seen[-1][1] is inp
    _record(monkeypatch, "broadcast", seen)
    assert mesh_mod.broadcast_anywhere(inp, group_src=0, group=both) is inp
    assert seen[-1] == [inp]
    _record(monkeypatch, "reduce_scatter", seen)
    mine = out[:1]
    mesh_mod.reduce_scatter_anywhere(mine, inp, [1, 3], group=both)
    assert seen[-1][0] is mine
    assert [t.untyped_storage().data_ptr() for t in seen[-1][1:]] == \
        [inp.untyped_storage().data_ptr()] * 2  # views of the caller's input


def test_staged_all_to_all_copies_back_at_wait(monkeypatch):
    """On a group without a CPU backend the send buffer goes to the mesh's device once, and the
    staged receive buffer comes back into the caller's tensor when the handle is waited on (the
    meta device stands in for the GPU; FakeTensorMode lets values "move" back from it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    seen: list = []

    class Work:
        waited = False

        def wait(self):
            Work.waited = True

    _record(monkeypatch, "all_to_all_single", seen, work=Work())
    mesh = types.SimpleNamespace(device_type="meta")
    with FakeTensorMode():
        inp, out = torch.ones(6), torch.empty(6)
        handle = mesh_mod.all_to_all_single_anywhere(out, inp, [3, 3], [2, 4],
                                                     group=_Group("meta"), mesh=mesh,
                                                     async_op=True)
        assert [t.device.type for t in seen[-1]] == ["meta", "meta"]  # one staged pair
        assert isinstance(handle, mesh_mod.StagedWork) and not handle.is_completed()
        assert handle.wait() and Work.waited and handle.is_completed()
        assert out.device.type == "cpu"
        assert mesh_mod.all_to_all_single_anywhere(out, inp, group=_Group("meta"),
                                                   mesh=mesh) is None  # synchronous
