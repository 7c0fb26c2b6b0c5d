"""The CUDA path's decisions, checked on the CPU (issue 28).

Nothing here needs a GPU: the device choices, divide factors and copy paths are pure functions
of devices and dtypes; ``FakeTensorMode`` stands in for CUDA tensors where a copy path must be
exercised (it checks devices like the real kernels do). What only a GPU can show is a row of
``python -m benchmarks.gpu_check``.
"""

from __future__ import annotations

import itertools
import types
import weakref

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import lightning_vescale.mesh as mesh_mod
from lightning_vescale._dbuffer_comm import gradient_divide_factors, offload_copy, reduce_factors

SUM, AVG = torch.distributed.ReduceOp.SUM, torch.distributed.ReduceOp.AVG


# -- fp16 divide factors (FSDP2's _get_gradient_divide_factors) ----------------------------------
@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 6, 8, 16, 64, 96, 512, 1024])
def test_fp16_divide_factors_match_fsdp2(ranks):
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        _get_gradient_divide_factors,
    )

    group = types.SimpleNamespace(size=lambda: ranks)
    pre, post, *_ = _get_gradient_divide_factors(group, None, torch.float16, "cuda")
    assert gradient_divide_factors(ranks, torch.float16) == (pre, post)
    assert pre * post == ranks


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp32_bf16_divide_once_after(dtype):
    assert gradient_divide_factors(8, dtype) == (None, 8.0)


def test_reduce_factors():
    # fp16: SUM with a division before and after, whatever the backend
    op, pre, post, scale = reduce_factors(AVG, None, ranks=1024, reduce_dtype=torch.float16,
                                          gloo=False)
    assert (op, pre, post, scale) == (SUM, 32, 32, None)
    # a divide factor (scale = 1/factor) on fp16 splits too
    op, pre, post, scale = reduce_factors(SUM, 1 / 64, ranks=8, reduce_dtype=torch.float16,
                                          gloo=False)
    assert op == SUM and pre * post == pytest.approx(64) and pre > 1 and scale is None
    # fp32 on NCCL: the collective's AVG, no division of ours
    assert reduce_factors(AVG, None, ranks=8, reduce_dtype=torch.float32, gloo=False) == (
        AVG, None, None, None)
    # gloo: SUM and one division after (bitwise gloo's AVG)
    assert reduce_factors(AVG, None, ranks=4, reduce_dtype=torch.float32, gloo=True) == (
        SUM, None, 4.0, None)
    # bf16/fp32 with a divide factor: SUM, then the multiplier as before
    assert reduce_factors(SUM, 0.25, ranks=4, reduce_dtype=torch.bfloat16, gloo=False) == (
        SUM, None, None, 0.25)


def test_fp16_sum_of_large_gradients_stays_finite():
    """What the factors buy: 1024 ranks of fp16 gradients of 100 average to 100; a SUM
    first overflows (102400 > 65504)."""
    g = torch.full((4,), 100.0, dtype=torch.float16)
    naive = torch.stack([g] * 1024).sum(0, dtype=torch.float16) / 1024
    assert torch.isinf(naive).all()
    pre, post = gradient_divide_factors(1024, torch.float16)
    total = torch.stack([g / pre] * 1024).sum(0, dtype=torch.float16)  # the same SUM
    torch.testing.assert_close(total / post, g)


# -- offload: the reduced shard goes to the host, never added across devices ---------------------
def test_offload_accumulate_copies_to_host_first():
    with FakeTensorMode():
        gs = torch.zeros(8)  # the pinned CPU gradient shard
        out = torch.empty(8, device="cuda")  # the reduce-scatter's output on the GPU
        with pytest.raises(FakeTensorDeviceMismatchError):
            gs.add_(out)  # what the epilogue did before (issue 28): a crash on CUDA
        assert offload_copy(gs, out, accumulate=True, non_blocking=True) is None
        assert offload_copy(gs, out, accumulate=False, non_blocking=False) is None


def test_offload_copy_on_cpu_is_exact():
    gs, out = torch.ones(5), torch.arange(5.0)
    offload_copy(gs, out, accumulate=True, non_blocking=True)
    torch.testing.assert_close(gs, torch.arange(5.0) + 1)
    assert offload_copy(gs, out, accumulate=False, non_blocking=True) is None  # CPU: no event
    torch.testing.assert_close(gs, out)


# -- device choice: from the mesh / the process group, not the parameters ------------------------
class _Group:
    def __init__(self, *kinds: str) -> None:
        self._device_types = [torch.device(k) for k in kinds]


def _mesh(kind: str):
    return types.SimpleNamespace(device_type=kind)


def test_mesh_device():
    assert mesh_mod.mesh_device(_mesh("cpu")) == torch.device("cpu")
    assert mesh_mod.mesh_device(_mesh("meta")) == torch.device("meta")
    assert mesh_mod.mesh_device(_mesh("cuda")).type == "cuda"  # a CPU model on a CUDA mesh


def test_device_for_takes_the_mesh_not_the_parameters():
    from lightning_vescale.fsdp.api import _device_for

    info = types.SimpleNamespace(mesh=_mesh("cuda"))
    assert _device_for(info, torch.device("cpu")).type == "cuda"
    assert _device_for(info, None).type == "cuda"
    assert _device_for(info, torch.device("meta")) == torch.device("meta")  # deferred init


def test_default_device_type_follows_the_backend(monkeypatch):
    cuda = types.SimpleNamespace(type="cuda")
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: cuda)
    monkeypatch.setattr(mesh_mod.dist, "is_initialized", lambda: True)
    for backend, kinds, want in (("nccl", {"cuda"}, "cuda"),
                                 ("cpu:gloo,cuda:nccl", {"cpu", "cuda"}, "cuda"),
                                 ("gloo", {"cpu", "cuda"}, "cpu")):  # gloo: the CPU backend
        monkeypatch.setattr(mesh_mod.dist, "get_backend", lambda group=None, b=backend: b)
        monkeypatch.setattr(mesh_mod, "group_device_types", lambda group, k=kinds: k)
        assert mesh_mod.default_device_type() == want, backend


def test_collective_device():
    cpu = torch.device("cpu")
    assert mesh_mod.collective_device(_Group("cpu", "cuda"), cpu) == cpu  # cpu:gloo,cuda:nccl
    assert mesh_mod.collective_device(_Group("cuda"), cpu, _mesh("cuda")).type == "cuda"  # nccl
    with pytest.raises(RuntimeError, match="cpu:gloo,cuda:nccl"):
        mesh_mod.collective_device(_Group("xpu"), cpu, _mesh("cpu"))


def test_all_reduce_anywhere_moves_an_offloaded_tensor_and_back(monkeypatch):
    seen = []

    def all_reduce(t, op=None, group=None):
        seen.append(t.device.type)
        t.mul_(2)

    monkeypatch.setattr(mesh_mod.dist, "all_reduce", all_reduce)
    # a CPU-offloaded found-inf flag / norm accumulator on a group without a CPU backend (NCCL;
    # the meta device stands in for the GPU, FakeTensorMode lets values "move" back from it)
    with FakeTensorMode():
        t = torch.ones(3)
        out = mesh_mod.all_reduce_anywhere(t, group=_Group("meta"), mesh=_mesh("meta"))
        assert out is t and t.device.type == "cpu"
    assert seen == ["meta"]
    t = torch.ones(3)
    mesh_mod.all_reduce_anywhere(t, group=_Group("cpu", "cuda"))  # on the CPU, in place
    assert seen == ["meta", "cpu"] and torch.equal(t, torch.full((3,), 2.0))


def test_move_buffers_moves_managed_buffers_only():
    from lightning_vescale.fsdp.api import _move_buffers

    model = nn.Sequential(nn.BatchNorm1d(3), nn.BatchNorm1d(3))
    inner = model[1]
    inner.__dict__["_lv_fsdp_state"] = object()  # an inner fully_shard owns it
    _move_buffers([model], torch.device("meta"))  # meta stands in for the mesh's device
    assert model[0].running_mean.device.type == "meta"
    assert inner.running_mean.device.type == "cpu"


# -- MemoryProfiler: one OOM observer per process; the user's recording is left on ---------------
def _profiler(tmp_path, monkeypatch, *, user_recording: bool):
    import lightning_vescale.callbacks._memory_snapshots as snaps
    from lightning_vescale import MemoryProfiler

    calls = {"record": [], "attach": 0}
    monkeypatch.setattr(torch._C, "_cuda_isHistoryEnabled", lambda: user_recording,
                        raising=False)
    monkeypatch.setattr(torch._C, "_cuda_attach_out_of_memory_observer",
                        lambda fn: calls.__setitem__("attach", calls["attach"] + 1),
                        raising=False)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history",
                        lambda enabled="all", **kw: calls["record"].append(enabled))
    monkeypatch.setattr(snaps, "_OOM_ATTACHED", [])

    def fit() -> None:
        prof = MemoryProfiler(snapshot_dir=str(tmp_path), snapshot_on_oom=True,
                              print_table=False)
        prof._mem = types.SimpleNamespace(device=torch.device("cuda"))
        prof._start_snapshots()
        prof._stop_snapshots()
    return fit, calls


def test_memory_profiler_attaches_one_oom_observer(tmp_path, monkeypatch):
    fit, calls = _profiler(tmp_path, monkeypatch, user_recording=False)
    fit()
    fit()
    assert calls["attach"] == 1  # not one more per fit
    assert calls["record"] == ["all", None, "all", None]  # ours: started and stopped


def test_memory_profiler_keeps_the_users_recording(tmp_path, monkeypatch):
    fit, calls = _profiler(tmp_path, monkeypatch, user_recording=True)
    fit()
    assert calls["record"] == []  # neither restarted with our settings nor switched off


# -- HSDP: the replica all-reduce is ordered on a side stream, not on the current one ------------
def test_replica_all_reduce_waits_on_a_side_stream(monkeypatch):
    import lightning_vescale._dbuffer_comm as comm

    log = []

    class _Stream:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait_stream(self, other) -> None:
            log.append(f"{self.name} waits for {other.name}")

        def __enter__(self):
            log.append(f"enter {self.name}")

        def __exit__(self, *exc):
            log.append(f"exit {self.name}")

    class _Work:
        def wait(self) -> None:
            log.append("reduce-scatter waited")

    def all_reduce(t, op=None, group=None, async_op=False):
        log.append(f"all-reduce (async={async_op})")
        return "ar-work"

    with FakeTensorMode():
        out = torch.empty(4, device="cuda")
    monkeypatch.setitem(comm._ALL_REDUCE_STREAMS, out.device, _Stream("side"))
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: _Stream("cur"))
    monkeypatch.setattr(comm.dist, "all_reduce", all_reduce)
    work = comm.replica_all_reduce(_Work(), out, op=AVG, group=None, async_op=True)
    assert work == "ar-work"
    # before issue 28 the current stream waited for the reduce-scatter, then the all-reduce ran
    assert log == ["side waits for cur", "enter side", "reduce-scatter waited",
                   "all-reduce (async=True)", "exit side"]


@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float16])
def test_replica_all_reduce_with_a_wire_dtype_stays_on_the_side_stream(monkeypatch, wire):
    """HSDP with a ``reduce_scatter_dtype`` (issue 35): the reduce-scatter's finish, the
    all-to-all, the fp32 sum and the all-gather are all issued on the side stream at reduce
    time; the current stream only waits for the event recorded behind them, at ``wait``.
    Before, the current stream waited for the reduce-scatter and the all-gather was issued at
    ``wait`` as a synchronous collective on the current stream."""
    import lightning_vescale._dbuffer_comm as comm

    log, where = [], ["cur"]

    class _Stream:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait_stream(self, other) -> None:
            log.append(f"{self.name} waits for {other.name}")

        def record_event(self):
            log.append(f"{self.name} records the event")
            return f"event of {self.name}"

        def wait_event(self, event) -> None:
            log.append(f"{self.name} waits for the {event}")

        def __enter__(self):
            where.append(self.name)

        def __exit__(self, *exc):
            where.pop()

    class _Work:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait(self) -> None:
            log.append(f"{self.name} waited on {where[-1]}")

    def collective(name):
        def issue(*args, group=None, async_op=False, **kwargs):
            log.append(f"{name} issued on {where[-1]} (async={async_op})")
            return _Work(name) if async_op else None
        return issue

    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: _Stream("cur"))
    monkeypatch.setattr(comm.dist, "all_to_all_single", collective("all-to-all"))
    monkeypatch.setattr(comm, "_all_gather_flat", collective("all-gather"))
    out = torch.ones(10, device="meta")  # an accelerator's tensor (a CPU build cannot copy
    monkeypatch.setitem(comm._ALL_REDUCE_STREAMS, out.device, _Stream("side"))  # fake CUDA)
    rs_work = _Work("reduce-scatter")
    rs_alive = weakref.ref(rs_work)
    work = comm.replica_all_reduce(rs_work, out, op=AVG, group=None, async_op=True,
                                   wire=wire, size=2)
    del rs_work
    assert log == ["side waits for cur", "reduce-scatter waited on side",
                   "all-to-all issued on side (async=True)", "all-to-all waited on side",
                   "all-gather issued on side (async=True)", "all-gather waited on side",
                   "side records the event"]
    # the reduce-scatter's tensors (its finish closure) live until the current stream waits
    assert rs_alive() is not None
    log.clear()
    work.wait()
    work.wait()  # idempotent
    assert log == ["cur waits for the event of side"]
    assert rs_alive() is None


def test_the_reduce_scatter_work_holds_its_input(monkeypatch):
    """NCCL, avoiding record_stream, drops its reference to a collective's input at
    ``Work.wait``; waited under the side stream that does not order the stream the input was
    allocated on, so the work itself keeps it (and the side-stream work keeps the work)."""
    import lightning_vescale._dbuffer_comm as comm

    class _Work:
        def wait(self) -> None:
            pass

    monkeypatch.setattr(comm.dist, "all_to_all_single", lambda *a, **k: _Work())
    for wire in (torch.bfloat16, torch.float16):
        inp = torch.ones(8)
        out = torch.empty(4)
        work = comm.wire_reduce_scatter_sum(out, inp, wire=wire, rank=0, world_size=2,
                                            group=None, async_op=True, release=lambda: None)
        sent = weakref.ref(work._keep)  # the wire-dtype copy (fp16: the scaled message)
        del inp
        work.wait()
        assert sent() is not None, wire
        del work
        assert sent() is None, wire


# -- the strategies shard from the CPU source: no whole-model copy on the device (issue 35) ------
class _LiveBytes(TorchDispatchMode):
    """The peak bytes of live storages on ``device_type``, sampled at every op (storages are
    deduplicated, so views count once; a storage resized to 0 counts 0; wrapper subclasses such
    as DTensor count through their local tensors)."""

    def __init__(self, device_type: str, module: nn.Module) -> None:
        super().__init__()
        self.device_type, self.module, self.peak, self._live = device_type, module, 0, []

    def now(self) -> int:
        # what ops created, and the module's tensors (``module.to`` swaps ``param.data``)
        held = itertools.chain(self.module.parameters(), self.module.buffers())
        sizes = {}
        for t in itertools.chain((ref() for ref in self._live), held):
            if type(t) in (torch.Tensor, nn.Parameter) and t.device.type == self.device_type:
                storage = t.untyped_storage()
                sizes[storage._cdata] = storage.nbytes()
        return sum(sizes.values())

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._live.append(weakref.ref(t))
        self.peak = max(self.peak, self.now())
        return out


class _Blocks(LightningModule):
    def __init__(self, n: int = 16, width: int = 32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(n))
        self.norm = nn.BatchNorm1d(width)


@pytest.fixture
def fake_world(monkeypatch):
    """A fake 4-rank world on a mesh whose device is ``meta``, standing in for the GPU (a CPU
    build cannot copy into fake CUDA tensors); the DBuffers free storage there as on a GPU."""
    import lightning_vescale.fsdp.api as api
    from lightning_vescale.dbuffer import DBuffer
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    meta = torch.device("meta")
    monkeypatch.setattr(api, "mesh_device", lambda mesh: meta)

    def resize(self, t, alloc):  # DBuffer's free/materialise, which skips meta storages
        t.untyped_storage().resize_(t.numel() * t.element_size() if alloc else 0)

    monkeypatch.setattr(DBuffer, "_resize", resize)
    try:
        yield init_device_mesh("cpu", (4,))
    finally:
        dist.destroy_process_group()


def test_strategies_shard_from_the_cpu_source(fake_world):
    from lightning_vescale._lightning.sharding import shard_model

    model = _Blocks()
    full = sum(p.numel() * p.element_size() for p in model.parameters())
    group = max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in model.blocks)
    live = _LiveBytes("meta", model)
    with live:
        shard_model(model, units=None, mesh=fake_world, device=torch.device("meta"),
                    mp_policy=None, granularity=None, reshard_after_forward=True)
    # one rank's share, plus one group's transient unsharded parameter and gradient buffers
    # (and the norm's buffers); before issue 35 the whole model was copied first (peak > full)
    assert live.peak <= full / 4 + 2 * group + 1024 < full
    assert all(p.device.type == "meta" for p in model.parameters())
    assert all(b.device.type == "meta" for b in model.buffers())
    assert model.device.type == "meta"  # LightningModule.device: where it computes now


def test_fabric_leaves_the_model_where_it_was_built():
    """``fabric.setup`` calls ``module_to_device`` before ``setup_module``: a no-op, as in
    Lightning's FSDP strategies (it moved the whole model to the GPU before issue 35)."""
    from lightning_vescale.fabric import VeScaleFabricStrategy

    model = nn.Linear(4, 4)
    VeScaleFabricStrategy.module_to_device(
        types.SimpleNamespace(root_device=torch.device("meta")), model)
    assert model.weight.device.type == "cpu"


def test_lightning_module_device_is_recorded():
    from lightning_vescale._lightning.sharding import _update_device_properties

    model = _Blocks(n=1)
    _update_device_properties(model, torch.device("cuda", 0))  # nothing moves
    assert model.device == torch.device("cuda", 0) and model.norm.running_mean.device.type == "cpu"


# -- pinned host memory: the gradient flags' source, and what pinning costs (issue 35) -----------
def test_should_pin_only_toward_an_accelerator(monkeypatch):
    from lightning_vescale._pinned import should_pin

    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    assert should_pin(torch.device("cuda", 0))
    assert not should_pin(torch.device("cpu")) and not should_pin(torch.device("meta"))
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)  # pin would raise
    assert not should_pin(torch.device("cuda", 0))


def test_gradient_flags_source_is_pinned_toward_an_accelerator(monkeypatch):
    from lightning_vescale import _pinned

    asked = []
    empty = torch.empty

    def recording_empty(*args, pin_memory=False, **kwargs):
        asked.append(pin_memory)
        return empty(*args, **kwargs)  # a CPU build cannot pin: the request is what counts

    monkeypatch.setattr(_pinned.torch, "empty", recording_empty)
    src = _pinned.host_source(b"\x01\x00\x01", torch.device("cpu"))  # the CPU: a plain view
    assert asked == [] and src.tolist() == [1, 0, 1]
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    src = _pinned.host_source(b"\x01\x00\x01", torch.device("cuda", 0))
    assert asked == [True] and src.tolist() == [1, 0, 1] and src.dtype == torch.uint8



@pytest.mark.parametrize(("nbytes", "held"), [(0, 0), (1, 1), (4096, 4096), (4097, 8192),
                                              (3 << 20, 4 << 20), ((1 << 30) + 1, 2 << 30)])
def test_pinned_host_bytes_round_up_to_a_power_of_two(nbytes, held):
    from lightning_vescale._pinned import pinned_host_bytes

    assert pinned_host_bytes(nbytes) == held
    assert nbytes <= held < 2 * nbytes or nbytes == held == 0


def test_memory_accounting_counts_pinned_storages_rounded(monkeypatch):
    """An offloaded shard of 3 MiB pinned holds 4 MiB of host memory: ``off_device`` says 3,
    ``off_device_pinned_host`` 4 (a CPU build cannot pin: the check is what is replaced)."""
    from lightning_vescale.callbacks import _memory_accounting as acc

    shard = torch.zeros(3 << 18)  # 3 MiB of fp32, as a pinned offloaded shard
    grad = torch.zeros(100)  # a pageable one
    monkeypatch.setattr(acc, "_is_pinned", lambda t: t.untyped_storage().data_ptr()
                        == shard.untyped_storage().data_ptr())
    out = acc.account(device="meta", params_sharded=[shard, shard[:10]], grads=[grad])
    assert out.off_device == shard.nbytes + grad.nbytes
    assert out.off_device_pinned_host == 4 << 20  # the storage once, rounded; not the pageable
