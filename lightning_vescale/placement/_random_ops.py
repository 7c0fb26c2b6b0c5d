"""Random fills of ``RaggedShard`` DTensors (private; answered by ``_ops``'s hook).

Design note [ragged-random]
---------------------------
The FSDP2 meta-device flow (``with torch.device("meta"): model = ...``, ``fully_shard``,
``model.to_empty(device=...)``, ``reset_parameters()``) runs ``nn.init`` on the sharded
parameters: ``uniform_``/``normal_`` (``kaiming_uniform_``, ``trunc_normal_`` =
``uniform_`` + element-wise ``erfinv_``/``mul_``/``add_``/``clamp_``), ``zero_``/``fill_``.
The element-wise ones need nothing new; the random ones are answered here.

The contract: a random fill of a ragged DTensor gives **the values single-device
initialisation gives under the same seed**, on every device type, and leaves the generator in
the same state. Each rank draws the *whole* tensor into a temporary of the global shape on the
local tensor's device (same op, same arguments, same generator: the default one of that device,
or the ``generator=`` given) and keeps its flat range. Every rank must hold the same generator
state, as for any initialisation of a data-parallel model (seed every rank alike); no
collective runs. Cost: one full-size temporary per call (initialisation only). On an N-D mesh
(``(Replicate(), RaggedShard)``, design note [ragged-nd]) each rank keeps the range of its
coordinate on the ragged dim, so replicas hold identical values, as after a broadcast.

torch's FSDP2, for comparison (measured with torch 2.13): on CUDA its ``Shard(0)`` DTensors use
DTensor's ``OffsetBasedRNGTracker``, which offsets each shard's Philox stream to the shard's
position in the full tensor; on CPU there is no RNG tracker and every rank draws its *local*
numel from the start of the same stream, so the shards differ from single-device values (and
the ranks' generators end in different states).

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
from lightning_vescale.placement._ragged_shard import (
    RaggedShard,
    local_slice,
    ragged_from_local,
    ragged_shard_and_rank,
)

__all__ = ["RANDOM_HANDLERS"]


def _ragged_self(op: Any, args: tuple) -> tuple[DTensor, RaggedShard, int]:
    """The ragged DTensor ``self``, its ``RaggedShard`` and this rank's coordinate on that
    placement's mesh dim (the other dims replicate: design note [ragged-nd])."""
    x = args[0] if args else None
    if not (isinstance(x, DTensor) and has_ragged(x._spec)):
        raise unsupported(op, [getattr(x, "_spec", x)])
    try:
        placement, r = ragged_shard_and_rank(x.device_mesh, x.placements, str(op))
    except NotImplementedError as e:
        raise unsupported(op, [x._spec], f": {e}") from None
    return x, placement, r


def _check_plain(op: Any, x: DTensor, rest: tuple, kwargs: dict) -> None:
    for a in (*rest, *kwargs.values()):
        if isinstance(a, DTensor):
            raise unsupported(op, [x._spec, a._spec], ": a random op reading another DTensor")


def _fill_inplace(op: Any, args: tuple, kwargs: dict) -> DTensor:
    """``x.<random>_(...)``: draw the whole tensor, keep this rank's range."""
    x, placement, rank = _ragged_self(op, args)
    _check_plain(op, x, args[1:], kwargs)
    local = x._local_tensor
    full = torch.empty(tuple(x.shape), dtype=local.dtype, device=local.device)
    op(full, *args[1:], **kwargs)
    with torch.no_grad():
        local.copy_(local_slice(full, placement, rank))
    return x


def _random_like(op: Any, args: tuple, kwargs: dict) -> DTensor:
    """``torch.rand_like(x)`` and friends: a new DTensor with ``x``'s placement."""
    x, placement, rank = _ragged_self(op, args)
    _check_plain(op, x, args[1:], kwargs)
    local = x._local_tensor
    kwargs = dict(kwargs)
    kwargs.pop("memory_format", None)
    device = kwargs.pop("device", None) or local.device
    dtype = kwargs.pop("dtype", None) or local.dtype
    for k in ("layout", "pin_memory"):
        kwargs.pop(k, None)
    full_in = torch.empty(tuple(x.shape), dtype=dtype, device=device)
    full = op(full_in, *args[1:], dtype=dtype, device=device, **kwargs)
    piece = local_slice(full, placement, rank).clone()
    return ragged_from_local(piece, x.device_mesh, x._spec.placements, tuple(x.shape),
                             autograd=False, check=False)


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
