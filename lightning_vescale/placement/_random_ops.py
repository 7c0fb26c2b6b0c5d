"""Random fills of ``RaggedShard`` DTensors (private; answered by ``_ops``'s hook).

Design note [ragged-random]
---------------------------
The FSDP2 meta-device flow (``with torch.device("meta"): model = ...``, ``fully_shard``,
``model.to_empty(device=...)``, ``reset_parameters()`` or torchtitan's ``init_weights()``) runs
``nn.init`` on the sharded parameters: ``uniform_``/``normal_`` (``kaiming_uniform_``,
``xavier_*``), ``zero_``/``fill_``, and ``trunc_normal_``, which torch 2.13 samples by
rejection: ``normal_``, then while ``((x < a) | (x > b)).any()`` redraws a full
``empty_like(x).normal_()`` and merges it with ``torch.where`` (or, when ``[a, b]`` holds at
most 30% of the mass, ``uniform_`` candidates accepted against ``uniform_().log_()``). The
element-wise parts need nothing new (design note [ragged-ops]), ``any()`` is one all-reduce
whose Replicate result makes every rank loop equally often ([ragged-reductions]), and the random
fills are answered here, so the whole sampler gives single-device values. Factories and dim-0
slice views used by init code are design note [ragged-init].

The contract: a random fill of a ragged DTensor gives **the values single-device
initialisation gives under the same seed**, on every device type, and leaves the generator in
the same state. The generator is the one the local tensor's device uses (the ``generator=``
given, else that device's default one), so where the shard lives decides:

* on an accelerator (a GPU's shard): that device's default generator. Each rank draws the
  *whole* tensor into a temporary of the global shape on the device (same op, same arguments)
  and keeps its flat range. Cost: one full-size temporary on the device per call, one
  parameter at a time (initialisation only). It cannot be avoided without changing the values:
  a Philox kernel spreads elements over threads by launch configuration, so a part drawn alone
  (or at an offset, as DTensor's tracker does) gives other values than the whole draw's.
* on the CPU (CPU training, and CPU offload, where the shards live in host memory): the CPU
  generator, and no whole tensor: its kernels draw in element order, so each rank draws only
  its range and draws the rest into a small scratch buffer it drops (``_random_range``;
  ``normal_`` in bf16/fp16 and below 16 elements keep the whole draw). With offload the values
  are therefore a one-process *CPU* initialisation's under the same seed, not a one-GPU one's
  (``torch.manual_seed`` seeds both generators); torchtitan's own offload flow initialises on
  the CPU too (``init_device="cpu"``), as do FSDP2's users.

Every rank must hold the same generator state, as for any initialisation of a data-parallel
model (seed every rank alike); no collective runs. On an N-D mesh
(``(Replicate(), RaggedShard)``, design note [ragged-nd]) each rank keeps the range of its
coordinate on the ragged dim, so replicas hold identical values, as after a broadcast. On a
tensor-parallel layout (``(RaggedShard, Shard(k))``, design note [ragged-tp]: TP or expert
parameters built on meta) a rank's part is its RaggedShard range of its TP-local box, i.e. runs
of the global tensor (``_ragged_tp.rank_flat_runs``): one run for ``Shard(0)`` on the leading
dim, drawn as a range on the CPU generator like any other; several (one per row of the box,
``Shard(1)``) are cut from a whole draw. The values are still one process's, whatever the
``(dp, tp)`` layout. The random ``*_like`` factories follow the same rule (ATen's ``rand_like`` is
``empty_like().uniform_(0, 1)``, ``randn_like`` ``normal_(0, 1)``, ``randint_like``
``random_(low, high)``; a tensor ``high`` keeps the whole draw).

torch's FSDP2, for comparison (torch 2.13): on CUDA its ``Shard(0)`` DTensors use DTensor's
``OffsetBasedRNGTracker``, which starts each shard's Philox stream at offset
``shard_index * local_numel`` (rounded up to 4) and advances every rank's generator by the full
numel (rounded up to 4). A Philox offset is not an element index of the full draw (a CUDA
kernel spreads elements over threads by launch configuration), so sharded values are in
general not the full tensor's, and depend on the world size; only at world 1 (one shard) are
they the full draw.
Measured on CPU, where there is no RNG tracker: every rank draws its *local* numel from the
start of the same stream, so the shards differ from single-device values (torchtitan's Llama3
debug model at world 2: 32 of 45 parameters) and the ranks' generators end in different states.
Ours: single-device values at every world size (torchtitan's Llama3 flow: all 45 bitwise at
world 2, the generator ending where one process's does).

Mixed with ``Replicate`` draws (e.g. ``t.new_empty(other_shape)`` in torchtitan's fused-QKV
init, answered by DTensor itself): on CPU those are plain full draws too, so the whole init is
single-device. On CUDA, with DTensor's tracker active, a Replicate draw gives the full draw's
values but advances the generator by DTensor's rule (numel rounded up to 4) instead of the
kernel's own increment, so later draws, ours included, follow DTensor's stream rather than a
plain single-device one: still the same on every world size, as ours never depend on it. (Not
measured: no GPU here. Routing our full draw through ``_rng_tracker._distribute_region`` with a
Replicate spec would make it equal FSDP2's at world 1 on CUDA; left for a GPU-tested change.)

Supported: the in-place random ops (``uniform_``, ``normal_``, ``bernoulli_`` with a float
``p``, ``random_``, ``exponential_``, ``geometric_``, ``log_normal_``, ``cauchy_``) and the
random ``*_like`` factories (``rand_like``, ``randn_like``, ``randint_like``), whose result is
a new DTensor with the input's placement. Random ops that read a ragged tensor's values
(``bernoulli(x)``, ``normal(mean=x)``, dropout) still raise the named-op error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_vescale.placement._common import aten, has_ragged, unsupported
from lightning_vescale.placement._random_range import can_draw_range, draw_range
from lightning_vescale.placement._ragged_shard import ragged_from_local
from lightning_vescale.placement._ragged_tp import copy_runs_, rank_flat_runs

__all__ = ["RANDOM_HANDLERS"]


def _ragged_self(op: Any, args: tuple) -> tuple[DTensor, list[tuple[int, int, int]]]:
    """The ragged DTensor ``self`` and this rank's part of it as runs of the global tensor
    (``placement._ragged_tp.rank_flat_runs``: one run on an FSDP/HSDP layout, [ragged-nd]; one
    per row of the TP-local box on a tensor-parallel one, [ragged-tp])."""
    x = args[0] if args else None
    if not (isinstance(x, DTensor) and has_ragged(x._spec)):
        raise unsupported(op, [getattr(x, "_spec", x)])
    try:
        runs = rank_flat_runs(tuple(x.shape), x.device_mesh, x.placements, str(op))
    except NotImplementedError as e:
        raise unsupported(op, [x._spec], f": {e}") from None
    return x, runs


def _check_plain(op: Any, x: DTensor, rest: tuple, kwargs: dict) -> None:
    for a in (*rest, *kwargs.values()):
        if isinstance(a, DTensor):
            raise unsupported(op, [x._spec, a._spec], ": a random op reading another DTensor")


def _fill_inplace(op: Any, args: tuple, kwargs: dict) -> DTensor:
    """``x.<random>_(...)``: this rank's part of the whole draw (on the CPU generator, for one
    run, without the whole tensor; elsewhere drawn whole and cut: [ragged-random])."""
    x, runs = _ragged_self(op, args)
    _check_plain(op, x, args[1:], kwargs)
    local = x._local_tensor
    numel = x.numel()
    with torch.no_grad():
        if local.dim() == 1 and len(runs) <= 1 and can_draw_range(op, local, numel, kwargs):
            # the CPU generator: this rank's range only, no whole-tensor temporary
            draw_range(op, local, runs[0][1] if runs else 0, numel, args[1:], kwargs)
            return x
        full = torch.empty(tuple(x.shape), dtype=local.dtype, device=local.device)
        op(full, *args[1:], **kwargs)
        copy_runs_(local.view(-1), full, runs)
    return x


def _random_like(op: Any, args: tuple, kwargs: dict) -> DTensor:
    """``torch.rand_like(x)`` and friends: a new DTensor with ``x``'s placement."""
    x, runs = _ragged_self(op, args)
    _check_plain(op, x, args[1:], kwargs)
    local = x._local_tensor
    kwargs = dict(kwargs)
    kwargs.pop("memory_format", None)
    device = kwargs.pop("device", None) or local.device
    dtype = kwargs.pop("dtype", None) or local.dtype
    for k in ("layout", "pin_memory"):
        kwargs.pop(k, None)
    fill = _as_fill(op, args[1:])
    piece = torch.empty(local.numel(), dtype=dtype, device=device)
    if fill is not None and len(runs) <= 1 and can_draw_range(fill[0], piece, x.numel(),
                                                               kwargs):
        # ``rand_like`` is ``empty_like().uniform_(0, 1)`` (and so on) in ATen: the range alone
        draw_range(fill[0], piece, runs[0][1] if runs else 0, x.numel(), fill[1], kwargs)
    else:
        full_in = torch.empty(tuple(x.shape), dtype=dtype, device=device)
        full = op(full_in, *args[1:], dtype=dtype, device=device, **kwargs)
        copy_runs_(piece, full, runs)
    return ragged_from_local(piece, x.device_mesh, x._spec.placements, tuple(x.shape),
                             autograd=False, check=False)


def _as_fill(op: Any, rest: tuple) -> tuple[Any, tuple] | None:
    """The in-place fill a random ``*_like`` factory runs on ``empty_like`` in ATen, and its
    arguments (``None``: a form left to the whole draw, e.g. a tensor ``high``)."""
    name = op._schema.name.split("::")[-1]
    if name == "rand_like":
        return aten.uniform_.default, (0.0, 1.0)
    if name == "randn_like":
        return aten.normal_.default, (0.0, 1.0)
    if name == "randint_like" and rest and all(isinstance(v, int) for v in rest):
        low, high = (0, rest[0]) if len(rest) == 1 else rest[:2]
        return getattr(aten.random_, "from"), (low, high)
    return None


def _overloads(names: tuple[str, ...]) -> list[torch._ops.OpOverload]:
    out = []
    for name in names:
        packet = getattr(aten, name, None)
        if packet is None:  # pragma: no cover - an older/newer torch without the op
            continue
        out.extend(getattr(packet, o) for o in packet.overloads())
    return out


_INPLACE = ("uniform_", "normal_", "random_", "exponential_", "geometric_", "log_normal_",
            "cauchy_")
_LIKE = ("rand_like", "randn_like", "randint_like")

#: Random ops on ragged DTensors (design note [ragged-random]); ``_ops``'s slow path answers
#: these with the handler's result (never cached: each call draws new numbers).
RANDOM_HANDLERS: dict[torch._ops.OpOverload, Callable[..., Any]] = {
    **{op: _fill_inplace for op in _overloads(_INPLACE)},
    aten.bernoulli_.float: _fill_inplace,
    **{op: _random_like for op in _overloads(_LIKE) if not op._schema.name.endswith("out")
       and "out" not in op._overloadname},
}
