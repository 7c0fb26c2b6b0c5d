"""Model-initialisation ops on RaggedShard DTensors (issue 33, torchtitan's meta-device flow).

What init code written for FSDP2 runs on sharded parameters after ``to_empty()``: the
``new_*`` factories, in-place random fills (``normal_``, ``uniform_``, ``trunc_normal_``'s whole
decomposition, ``kaiming_uniform_``...), ``zero_``/``fill_``, ``copy_`` from a full tensor, and
dim-0 slices written through (``w[a:b].copy_(x)``, ``nn.init.normal_(w[a:b])``). Each case runs
the same calls on a full plain tensor from the same seed (the one-process reference) and checks
every rank's flat slice **bitwise**, the result's placement, and that the default generator ends
where the one-process run leaves it (so later draws agree too). Worlds 1, 2 and 3 (3: uneven
units, a rank without units, one-hot tensors), as in ``test_ragged_ops.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, init_device_mesh
from torch.distributed.tensor.experimental import implicit_replication
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lightning_vescale.placement import RaggedShard
from tests.distributed._ragged_helpers import ragged_tensor

WORLD_SIZES = [1, 2, 3]


def _layouts(ws: int) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """(shape, dims, local_units): rows, a prime length, units inside rows (dims (0, 1)),
    one-hot (``dims=()``), and zero units on some ranks."""
    return [
        ((6, 5), (0,), {1: (3,), 2: (1, 2), 3: (2, 0, 1)}[ws]),
        ((7,), (0,), {1: (7,), 2: (3, 4), 3: (2, 0, 5)}[ws]),
        ((4, 3, 2), (0, 1), {1: (1,), 2: (5, 7), 3: (1, 1, 2)}[ws]),
        ((5, 3), (), (0,) * (ws - 1) + (1,)),
    ]


def _mesh():
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _shard(full: torch.Tensor, dims, units) -> DTensor:
    return ragged_tensor(full, RaggedShard(dims, units), _mesh())


def _local_ref(dt: DTensor, full: torch.Tensor) -> torch.Tensor:
    start, end = dt.placements[0].local_range(tuple(full.shape), dist.get_rank())
    return full.reshape(-1)[start:end]


def _assert_ragged(dt, full: torch.Tensor, placement=None) -> None:
    """``dt`` is a RaggedShard DTensor (``placement`` if given) whose local is bitwise the
    matching flat slice of ``full``."""
    assert isinstance(dt, DTensor) and isinstance(dt.placements[0], RaggedShard), dt
    if placement is not None:
        assert dt.placements[0] == placement, (dt.placements, placement)
    assert tuple(dt.shape) == tuple(full.shape) and dt.dtype == full.dtype
    assert torch.equal(dt.to_local(), _local_ref(dt, full)), (dt.to_local(), full)


def _assert_replicate(dt, full: torch.Tensor) -> None:
    assert isinstance(dt, DTensor) and all(p.is_replicate() for p in dt.placements), dt
    assert torch.equal(dt.to_local(), full)


def _same_stream_after(check) -> None:
    """The default generator is where the one-process run left it: compare the next draw."""
    mine = torch.rand(3)
    assert torch.equal(mine, check), (mine, check)


# -- new_* factories ----------------------------------------------------------------------------
def _factories_body():
    ws = dist.get_world_size()
    for shape, dims, units in _layouts(ws):
        full = torch.randn(shape)
        w = _shard(full, dims, units)
        place = w.placements[0]
        # The input's own shape: its layout, a flat local of this rank's numel.
        e = w.new_empty(shape)
        assert e.placements == w.placements and e.to_local().shape == w.to_local().shape
        assert w.new_empty(shape, dtype=torch.float64).to_local().dtype == torch.float64
        assert w.new_empty_strided(shape, full.stride()).placements == w.placements
        _assert_ragged(w.new_zeros(shape), torch.zeros(shape), place)
        _assert_ragged(w.new_ones(shape, dtype=torch.bfloat16),
                       torch.ones(shape, dtype=torch.bfloat16), place)
        _assert_ragged(w.new_full(shape, 2.5), torch.full(shape, 2.5), place)
        # Another shape: Replicate, the full tensor on every rank (DTensor's rule).
        other = (2, *shape)
        r = w.new_empty(other)
        assert r.placements == (Replicate(),) and r.to_local().shape == other
        _assert_replicate(w.new_zeros(other), torch.zeros(other))
        _assert_replicate(w.new_ones(3), torch.ones(3))
        _assert_replicate(w.new_full((4,), -1.0, dtype=torch.float64),
                          torch.full((4,), -1.0, dtype=torch.float64))
        _assert_replicate(w.new_empty_strided((3, 2), (1, 3)).fill_(1.0), torch.ones(3, 2))
    return True


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_new_factories(worlds, ws):
    assert worlds(ws).run(_factories_body) == [True] * ws


# -- in-place init: random fills, constants, copies ---------------------------------------------
def _gen():
    return torch.Generator().manual_seed(11)


#: (name, init function); each is applied to a ragged DTensor and to the full tensor alike.
INITS = [
    ("normal_", lambda t: t.normal_(0.5, 2.0)),
    ("uniform_", lambda t: t.uniform_(-3.0, 1.0)),
    ("uniform_(generator)", lambda t: t.uniform_(generator=_gen())),
    ("nn.init.normal_", functools.partial(torch.nn.init.normal_, std=0.02)),
    ("nn.init.trunc_normal_", functools.partial(torch.nn.init.trunc_normal_, std=0.02)),
    ("nn.init.trunc_normal_(a, b)",
     functools.partial(torch.nn.init.trunc_normal_, mean=0.1, std=1.0, a=-0.5, b=1.5)),
    ("nn.init.trunc_normal_(narrow [a, b])",  # torch's other sampler (mass in [a, b] <= 0.3)
     functools.partial(torch.nn.init.trunc_normal_, mean=0.0, std=1.0, a=1.0, b=3.0)),
    ("nn.init.uniform_", functools.partial(torch.nn.init.uniform_, a=-0.1, b=0.1)),
    ("nn.init.zeros_", torch.nn.init.zeros_),
    ("nn.init.ones_", torch.nn.init.ones_),
    ("nn.init.constant_", functools.partial(torch.nn.init.constant_, val=0.25)),
    ("zero_", lambda t: t.zero_()),
    ("fill_", lambda t: t.fill_(-7.0)),
    ("normal_ then mul_/add_", lambda t: t.normal_().mul_(0.5).add_(1.0)),
]
MATRIX_INITS = [  # need a fan-in: 2-D and more
    ("nn.init.kaiming_uniform_", functools.partial(torch.nn.init.kaiming_uniform_, a=5 ** 0.5)),
    ("nn.init.xavier_normal_", torch.nn.init.xavier_normal_),
]


def _one_process(init: Callable[[torch.Tensor], object], shape: tuple[int, ...], seed: int = 3
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``init`` on a full tensor under ``seed`` and the next three draws of the stream after it
    (the reference of every in-place case); the generator is seeded again for the sharded
    run."""
    torch.manual_seed(seed)
    full = torch.empty(shape)
    with torch.no_grad():
        init(full)
    after = torch.rand(3)
    torch.manual_seed(seed)
    return full, after


def _inplace_body():
    ws = dist.get_world_size()
    for shape, dims, units in _layouts(ws):
        inits = INITS + (MATRIX_INITS if len(shape) >= 2 else [])
        for name, init in inits:
            full, after = _one_process(init, shape)
            w = _shard(torch.full(shape, float("nan")), dims, units)
            with torch.no_grad():
                out = init(w)
            assert out is w, name
            try:
                _assert_ragged(w, full)
                _same_stream_after(after)
            except AssertionError as e:
                raise AssertionError(f"{name} on {shape} {dims} {units}: {e}") from None
    return True


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_inplace_init_ops_match_one_process(worlds, ws):
    assert worlds(ws).run(_inplace_body) == [True] * ws


def _copy_body():
    ws = dist.get_world_size()
    mesh = _mesh()
    for shape, dims, units in _layouts(ws):
        torch.manual_seed(0)
        src = torch.randn(shape)
        w = _shard(torch.zeros(shape), dims, units)
        with torch.no_grad():
            w.copy_(DTensor.from_local(src, mesh, [Replicate()]))
        _assert_ragged(w, src)
        w2 = _shard(torch.zeros(shape, dtype=torch.float64), dims, units)
        with torch.no_grad():
            w2.copy_(DTensor.from_local(src, mesh, [Replicate()]))  # with a dtype cast
        _assert_ragged(w2, src.double())
        # A plain full tensor: DTensor refuses mixing plain and DTensor operands (for Shard(0)
        # too); under implicit_replication() it is a Replicate operand, each rank keeps its range.
        w3 = _shard(torch.zeros(shape), dims, units)
        with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
            w3.copy_(src * 2)
        with torch.no_grad(), implicit_replication():
            w3.copy_(src * 2)
        _assert_ragged(w3, src * 2)
    return True


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_copy_from_a_full_tensor(worlds, ws):
    assert worlds(ws).run(_copy_body) == [True] * ws


# -- dim-0 slices: views written through ----------------------------------------------------
def _slices(n: int) -> list[slice]:
    return [slice(0, 1), slice(1, n - 1), slice(None, n // 2), slice(n // 2, None),
            slice(-2, None), slice(2, 2), slice(0, n), slice(n - 1, n + 5)]


def _slice_body():
    ws = dist.get_world_size()
    for shape, dims, units in _layouts(ws):
        n = shape[0]
        for sl in _slices(n):
            torch.manual_seed(1)
            full = torch.randn(shape)
            w = _shard(full.clone(), dims, units)
            v = w[sl]
            assert isinstance(v.placements[0], RaggedShard) and tuple(v.shape) == full[sl].shape
            assert torch.equal(v.full_tensor(), full[sl]), (sl, shape)  # the placement is right
            # copy_ into the view reaches w
            x = torch.randn(full[sl].shape)
            with torch.no_grad():
                v.copy_(DTensor.from_local(x, w.device_mesh, [Replicate()]))
            full[sl] = x
            _assert_ragged(w, full)
            # nn.init on a slice: the values of nn.init on the full tensor's slice, same seed
            torch.manual_seed(2)
            torch.nn.init.trunc_normal_(full[sl], std=0.5)
            after = torch.rand(3)
            torch.manual_seed(2)
            torch.nn.init.trunc_normal_(w[sl], std=0.5)
            _assert_ragged(w, full)
            _same_stream_after(after)
            w[sl].zero_()
            full[sl].zero_()
            w.narrow(0, 0, 1).fill_(4.0)
            full.narrow(0, 0, 1).fill_(4.0)
            _assert_ragged(w, full)
            if sl.start is None and n > 2:  # a slice of a slice
                w[sl][1:].fill_(9.0)
                full[sl][1:].fill_(9.0)
                _assert_ragged(w, full)
    return True


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_dim0_slices_are_views(worlds, ws):
    assert worlds(ws).run(_slice_body) == [True] * ws


def _bad_slice_body():
    w = _shard(torch.randn(6, 5), (0,), {1: (3,), 2: (1, 2)}[dist.get_world_size()])
    for fn, why in [(lambda: w[:, :2], "dim=1"), (lambda: w[::2], "step=2"),
                    (lambda: w.t()[1:], "aten.t")]:
        with pytest.raises(NotImplementedError, match="RaggedShard") as e:
            fn()
        assert why in str(e.value), (why, str(e.value))
    return True


@pytest.mark.parametrize("ws", [1, 2])
def test_other_slices_raise(worlds, ws):
    assert worlds(ws).run(_bad_slice_body) == [True] * ws


# -- torchtitan's fused-QKV init, on one parameter --------------------------------------------
def _fused_qkv_init(t, n_heads=4, n_kv=2, head_dim=2):
    """The calls of torchtitan 0.3.0's ``_fused_qkv_param_init`` (models/common/config_utils.py)
    with ``base_init = trunc_normal_(std=0.02)``: q/k/v from ``t.new_empty`` (Replicate for a
    sharded ``t``), initialised whole, concatenated, copied into ``t``."""
    tail = t.shape[1:]
    q = t.new_empty(n_heads * head_dim, *tail)
    k = t.new_empty(n_kv * head_dim, *tail)
    v = t.new_empty(n_kv * head_dim, *tail)
    for x in (q, k, v):
        torch.nn.init.trunc_normal_(x, std=0.02)
    fused = torch.cat([q.view(n_kv, n_heads // n_kv, head_dim, *tail),
                       k.view(n_kv, 1, head_dim, *tail),
                       v.view(n_kv, 1, head_dim, *tail)], dim=1).view(-1, *tail)
    with torch.no_grad():
        t.copy_(fused)


def _fused_qkv_body():
    ws = dist.get_world_size()
    shape = (16, 6)  # (n_kv * (n_heads / n_kv + 2) * head_dim, dim)
    torch.manual_seed(4)
    full = torch.empty(shape)
    _fused_qkv_init(full)
    after = torch.rand(3)
    for dims, units in [((0,), {1: (1,), 2: (3, 5), 3: (1, 0, 3)}[ws]),
                        ((0, 1), {1: (1,), 2: (7, 9), 3: (5, 5, 6)}[ws]),
                        ((), (0,) * (ws - 1) + (1,))]:
        torch.manual_seed(4)
        w = _shard(torch.zeros(shape), dims, units)
        _fused_qkv_init(w)
        _assert_ragged(w, full)
        _same_stream_after(after)
    return True


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_torchtitan_fused_qkv_init_pattern(worlds, ws):
    assert worlds(ws).run(_fused_qkv_body) == [True] * ws


# -- HSDP: (Replicate(), RaggedShard) on a 2 x 2 mesh ----------------------------------------
def _hsdp_body():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    j = mesh.get_local_rank(1)
    for dims, units in [((0,), (1, 3)), ((0, 1), (7, 9)), ((), (0, 1))]:
        place = RaggedShard(dims, units)
        full = torch.zeros(16, 6)
        w = ragged_tensor(full, place, mesh)
        assert w.placements == (Replicate(), place)

        def mine(t: torch.Tensor, dt: DTensor = w) -> torch.Tensor:
            start, end = dt.placements[1].local_range(tuple(t.shape), j)
            return t.reshape(-1)[start:end]

        assert w.new_zeros(16, 6).placements == w.placements
        assert w.new_empty(3).placements == (Replicate(), Replicate())
        torch.manual_seed(4)
        _fused_qkv_init(full)
        after = torch.rand(3)
        torch.manual_seed(4)
        _fused_qkv_init(w)
        assert torch.equal(w.to_local(), mine(full))
        _same_stream_after(after)
        v = w[3:11]
        assert v.placements[0] == Replicate() and isinstance(v.placements[1], RaggedShard)
        torch.manual_seed(5)
        torch.nn.init.trunc_normal_(v, std=0.1)
        torch.manual_seed(5)
        torch.nn.init.trunc_normal_(full[3:11], std=0.1)
        assert torch.equal(w.to_local(), mine(full))
        assert torch.equal(v.full_tensor(), full[3:11])
    return True


def test_init_ops_on_an_hsdp_mesh(worlds):
    assert worlds(4).run(_hsdp_body) == [True] * 4


# -- tensor parallelism: (RaggedShard, Shard(k)) on a (dp 2, tp 2) mesh ------------------------
def _tp_layouts() -> list[tuple[tuple[int, ...], int, RaggedShard]]:
    """(shape, TP shard dim, RaggedShard of the TP-local tensor): rows of a ``Shard(0)``
    TP-local tensor (one run of the global tensor per rank), ``Shard(1)`` (one run per row,
    uneven columns: 3 and 2), units inside rows, and a one-hot expert stack (torchtitan's
    experts on ``("efsdp", "ep")``: one rank holds the whole TP-local stack)."""
    return [((16, 6), 0, RaggedShard((0,), (1, 3))),
            ((8, 5), 1, RaggedShard((0,), (3, 1))),
            ((16, 6), 1, RaggedShard((0, 1), (5, 7))),
            ((4, 3, 2), 0, RaggedShard((), (1, 0)))]


def _tp_tensor(full: torch.Tensor, k: int, place: RaggedShard, mesh) -> tuple[DTensor, callable]:
    """The ``(RaggedShard, Shard(k))`` DTensor of ``full`` on ``mesh`` (what ``fully_shard``
    makes of a TP parameter: design note [fsdp-tp]), and ``mine(t)``: this rank's local part
    of a full tensor ``t`` (``torch.chunk`` on the tp dim, then the flat RaggedShard range)."""
    from lightning_vescale.placement import ragged_from_local

    i, j = mesh.get_local_rank(0), mesh.get_local_rank(1)

    def mine(t: torch.Tensor) -> torch.Tensor:
        tp_local = t.chunk(2, dim=k)[j].contiguous()
        start, end = place.local_range(tuple(tp_local.shape), i)
        return tp_local.reshape(-1)[start:end]

    w = ragged_from_local(mine(full).clone(), mesh, (place, Shard(k)), tuple(full.shape),
                          autograd=False, check=False)
    return w, mine


def _tp_body():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for shape, k, place in _tp_layouts():
        inits = INITS + (MATRIX_INITS if len(shape) >= 2 else [])
        if shape[0] == 16:
            inits = inits + [("fused QKV", _fused_qkv_init)]
        for name, init in inits:
            full, after = _one_process(init, shape)
            w, mine = _tp_tensor(torch.full(shape, float("nan")), k, place, mesh)
            with torch.no_grad():
                init(w)
            where = f"{name} on {shape} Shard({k}) {place}"
            assert w.placements == (place, Shard(k)), where
            assert torch.equal(w.to_local(), mine(full)), where
            _same_stream_after(after)
            assert torch.equal(w.full_tensor(), full), where
        torch.manual_seed(6)
        full = torch.rand(shape)
        torch.manual_seed(6)
        r = torch.rand_like(w)
        assert r.placements == w.placements and torch.equal(r.to_local(), mine(full))
        same = w.new_zeros(shape)
        assert same.placements == w.placements and same.to_local().shape == w.to_local().shape
        other = w.new_empty(3)
        assert other.placements == (Replicate(), Replicate()) and other.to_local().shape == (3,)
    return True


def test_init_ops_on_a_tensor_parallel_layout(worlds):
    """Init ops on the sharded parameters of a TP (or EP) model built on the meta device
    (design note [ragged-random]): each rank's part of its TP-local box, bitwise the
    one-process values, the generator where one process leaves it."""
    assert worlds(4).run(_tp_body) == [True] * 4


# -- the CPU generator: no whole-tensor temporary (issue 35) -------------------------------------
class _LargestAllocation(TorchDispatchMode):
    """The largest storage an op creates (outputs whose storage no input has) while active,
    through DTensor's own handling (the mode passes DTensor calls on to it); DTensor's sharding
    propagation's fake tensors hold no memory and are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor answers; its local ops come back here
        out = func(*args, **(kwargs or {}))

        def real(tree):
            return [t for t in tree_flatten(tree)[0]
                    if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor)]

        seen = {t.untyped_storage().data_ptr() for t in real((args, kwargs))}
        for t in real(out):
            if t.untyped_storage().data_ptr() not in seen:
                self.largest = max(self.largest, t.untyped_storage().nbytes())
        return out


def _no_whole_temporary_body():
    import lightning_vescale.placement._random_range as rr

    rr.SCRATCH_NUMEL = 64  # a forked child: the parent keeps its value
    shape = (64, 40)
    full_bytes = 64 * 40 * 4
    w = _shard(torch.zeros(shape), (0,), {2: (1, 1), 3: (1, 2, 1)}[dist.get_world_size()])
    local_bytes = w.to_local().numel() * 4
    for name, init in INITS[:5] + MATRIX_INITS:
        full, after = _one_process(init, shape, seed=9)
        mode = _LargestAllocation()
        with torch.no_grad(), mode:
            init(w)
        _assert_ragged(w, full)
        _same_stream_after(after)
        # local-sized temporaries (trunc_normal_'s element-wise steps) and the scratch only
        assert mode.largest <= max(local_bytes, 64 * 4) < full_bytes, (name, mode.largest)
    likes = [("rand_like", torch.rand_like), ("randn_like", torch.randn_like),
             ("randint_like(high)", lambda t: torch.randint_like(t, 10)),
             ("randint_like(low, high)", lambda t: torch.randint_like(t, -3, 10)),
             ("rand_like(generator)", lambda t: torch.rand_like(t, generator=_gen()))]
    for name, like in likes:
        torch.manual_seed(9)
        full = like(torch.empty(shape))
        after = torch.rand(3)
        torch.manual_seed(9)
        mode = _LargestAllocation()
        with mode:
            out = like(w)
        _assert_ragged(out, full, w.placements[0])
        _same_stream_after(after)
        assert mode.largest <= max(local_bytes, 64 * 4) < full_bytes, (name, mode.largest)
    return True


@pytest.mark.parametrize("ws", [2, 3])
def test_random_fills_on_the_cpu_generator_draw_no_whole_tensor(worlds, ws):
    assert worlds(ws).run(_no_whole_temporary_body) == [True] * ws
