"""Layer 4: what the optimizers share: local views, parameter layouts and checks, DCP state I/O.

Design note [sharded-optimizer]
-------------------------------
The optimizers of this package step sharded parameters on their *local* tensors: element-wise
maths needs no communication, and an optimizer that needs whole tensors (Muon) moves them itself.
Per-parameter states are laid out like their parameter (each rank holds the states of its own
flat range), so states never move. What every such optimizer needs lives here once, so that
another optimizer is one file:

* **Local views.** :func:`local_view`: a DTensor's local tensor (a view; for a ``fully_shard``
  parameter, into the group's DBuffer shard), a plain tensor itself.
* **Parameter layouts and checks.** :func:`param_layout` reads a parameter's :class:`ShardLayout`:
  its global shape, every shard rank's flat range ``[start, end)`` of the row-major tensor, this
  rank's index and the shard group's :class:`~lightning_vescale.mesh.MeshInfo`. Supported are
  plain tensors and all-``Replicate`` DTensors (every rank holds the whole tensor) and
  ``RaggedShard`` DTensors on the meshes ``MeshInfo.from_mesh`` accepts (the one place that knows
  the mesh restrictions): ``(RaggedShard,)`` on a 1-D mesh and ``(Replicate(), RaggedShard)`` on an
  HSDP mesh; with ``param_layout(..., tensor_parallel=True)`` also ``fully_shard``'s TP form
  (design note [fsdp-tp]), whose ranges index the rank's TP-local tensor (``region``). Ranges
  and the rank are the shard group's (``MeshInfo.shard_rank``), so the replicas
  of a shard rank hold, and step, the same range. Other placements raise ``TypeError`` naming the
  parameter; a local tensor whose size disagrees with its placement raises ``ValueError``.
  :func:`check_block_aligned` is the check block-wise states need: every rank's range starts on
  a block boundary and ends on one or at the tensor's end.
* **State export/import for distributed checkpoint.** A state laid out like its parameter is
  exported as a DTensor with the parameter's placements and global shape
  (:meth:`ShardLayout.to_dtensor`, :func:`state_like`), per-block statistics in the layout of
  :meth:`ShardLayout.per_block`, so DCP saves global tensors and reshards them on load (to another
  world size too). On load, :meth:`ShardLayout.local_part` turns a DTensor in the same layout into
  its local tensor (no communication), a DTensor in another layout into a gathered full tensor
  (``full_tensor()``: a collective, so every rank must load) and a full plain tensor (e.g. a
  single-process state) into this rank's slice (``placement.local_slice``).

:class:`ShardedOptimizer` is the ``torch.optim.Optimizer`` base: ``step`` (closure, ``no_grad``)
around the subclass's ``_update``, and the mapping of a saved state dict's parameter ids onto
this optimizer's parameters (:class:`ParamRef`).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.optim import Optimizer

from lightning_vescale.mesh import MeshInfo
from lightning_vescale.optim._quant import num_blocks
from lightning_vescale.optim._tp_layout import TPOrder, is_tp, register_tp_params, tp_layout_parts
from lightning_vescale.placement import RaggedShard, local_slice, ragged_from_local, ragged_ranges
from lightning_vescale.placement._ragged_tp import tp_local_box

__all__ = [
    "ParamRef",
    "ShardLayout",
    "ShardedOptimizer",
    "check_block_aligned",
    "local_view",
    "param_layout",
    "state_in_param_layout",
    "state_like",
]


def local_view(t: Tensor) -> Tensor:
    """The rank's local tensor of a DTensor (a view, no copy); ``t`` itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


def _dtensor(local: Tensor, mesh: DeviceMesh, placements: Sequence[Placement],
             shape: Sequence[int], stride: Sequence[int]) -> DTensor:
    # ``local`` itself as this rank's part of a DTensor: no copy, no autograd history (states
    # are data), and on ``local``'s device. ``DTensor.from_local`` would move a CPU-offloaded
    # state to the mesh's device (the GPU), where the next step meets its CPU parameter.
    if any(isinstance(pl, RaggedShard) for pl in placements) and not is_tp(placements):
        return ragged_from_local(local, mesh, placements, shape, stride, autograd=False)
    # (RaggedShard beside a TP placement, design note [tp-matrix-optim]: built as the engine
    # builds such parameters, without ragged_from_local's one-ragged-dim check)
    spec = DTensorSpec(mesh, tuple(placements),
                       tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), local.dtype))
    return DTensor(local, spec, requires_grad=False)


def state_like(p: Tensor, local: Tensor) -> Tensor:
    """``local`` (shaped like ``p``'s local tensor) as a state laid out like ``p``.

    For a DTensor ``p``: a DTensor with ``p``'s mesh, placements, global shape and stride whose
    local tensor is ``local``. Any placement (RaggedShard ones through ``ragged_from_local``): an
    element-wise state, e.g. Muon's AdamW fallback's, works for placements the optimizer never
    checks. For a plain ``p``: ``local`` itself.
    """
    if not isinstance(p, DTensor):
        return local
    return _dtensor(local, p.device_mesh, p.placements, p.shape, p.stride())


# -------------------------------------------------------------------------------------------------
# Layouts
# -------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, eq=False)
class ShardLayout:
    """Where this rank's part of a tensor (a parameter, or a state laid out like one) lies.

    Build it with :func:`param_layout` (or :meth:`per_block`); it is a pure description, valid as
    long as the parameter's placement does not change.

    Attributes:
        shape: the global shape.
        ranges: every shard rank's flat range ``[start, end)`` of the row-major tensor, in rank
            order (``((0, numel),)`` when every rank holds the whole tensor).
        placement: the ``RaggedShard`` that shards the tensor, or ``None``: every rank holds
            the whole tensor (a plain tensor or a ``Replicate`` DTensor).
        rank: this rank's index in the shard group (``0`` when whole).
        mesh_info: the shard group (set exactly when ``placement`` is).
        mesh, placements: the DTensor's mesh and placements (``None``/``()`` for a plain tensor).
        region: for a tensor-parallel parameter (design note [fsdp-tp]), the shape of this
            rank's TP-local tensor, whose row-major flattening ``ranges`` index (``None``:
            ``ranges`` index the global tensor).
        tp: for a ``(RaggedShard, Shard(k))`` parameter (design note [tp-matrix-optim]), its
            :class:`~lightning_vescale.optim._tp_layout.TPOrder`: ``ranges`` are then virtual
            ranges over every rank of the (dp, tp) mesh (HSDP + TP: of this replica's
            (dp_shard, tp) ranks) and ``mesh_info`` the owner mesh's (``owner_mesh``).
    """

    shape: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]
    placement: RaggedShard | None = None
    rank: int = 0
    mesh_info: MeshInfo | None = None
    mesh: DeviceMesh | None = None
    placements: tuple[Placement, ...] = ()
    region: tuple[int, ...] | None = None
    tp: TPOrder | None = None

    @property
    def numel(self) -> int:
        """Global number of elements."""
        return math.prod(self.shape)

    @property
    def region_numel(self) -> int:
        """Elements of the tensor ``ranges`` split: the TP-local tensor, else the global one."""
        return math.prod(self.shape if self.region is None else self.region)

    @property
    def start(self) -> int:
        """First element of this rank's flat range."""
        start, _ = self.ranges[self.rank]
        return start

    @property
    def end(self) -> int:
        """One past the last element of this rank's flat range."""
        _, end = self.ranges[self.rank]
        return end

    @property
    def local_numel(self) -> int:
        return self.end - self.start

    def matches(self, value: DTensor) -> bool:
        """Whether the DTensor ``value`` is laid out like this (same mesh, placements, shape)."""
        return (self.mesh is not None and tuple(value.placements) == self.placements
                and tuple(value.shape) == self.shape and value.device_mesh == self.mesh)

    def local_part(self, value: Tensor) -> Tensor:
        """This rank's part of ``value``, a tensor of this layout's global shape.

        A DTensor laid out like this gives its local tensor (no communication); a DTensor in any
        other layout is gathered first (``full_tensor()``, a collective: every rank must call);
        a plain tensor is taken as the full tensor. Sharded: this rank's flat slice (a view of a
        contiguous full tensor); whole: the full tensor itself. The caller checks that ``value``
        has ``numel`` elements (a plain tensor of another shape is read row-major).
        """
        if isinstance(value, DTensor):
            if self.matches(value):
                return value.to_local()
            value = value.full_tensor()
        if self.placement is None:
            return value
        if self.tp is not None:
            return self.tp.local_part(value.contiguous(), self.start, self.end)
        full = value.reshape(self.shape)
        if self.region is not None:  # the TP-local box first ([fsdp-tp])
            assert self.mesh_info is not None
            local_shape, offset = tp_local_box(self.shape, self.mesh, self.placements,
                                               self.mesh_info.shard_mesh_dim)
            full = full[tuple(slice(o, o + n) for o, n in zip(offset, local_shape))]
            full = full.contiguous()
        return local_slice(full, self.placement, self.rank)

    def to_dtensor(self, local: Tensor, stride: Sequence[int] | None = None) -> DTensor:
        """This rank's part ``local`` (flat, or for a whole layout any shape with ``numel``
        elements) as a DTensor of this layout, without a copy. ``stride``: the global stride
        (default: contiguous). Only for layouts of DTensors (``mesh`` set)."""
        assert self.mesh is not None, "a plain tensor's layout has no DTensor form"
        if stride is None:
            stride = torch.empty(self.shape, device="meta").stride()
        if self.placement is None:
            local = local.reshape(self.shape)
        return _dtensor(local, self.mesh, self.placements, self.shape, stride)

    def per_block(self, block_size: int) -> ShardLayout:
        """The layout of a per-block statistic (one value per block of ``block_size`` flat
        elements, e.g. a quantization scale): shape ``(num_blocks,)``, each rank holding the
        blocks of its own range. Requires a block-aligned layout (:func:`check_block_aligned`)."""
        if self.region is not None:
            return self._tp_per_block(block_size)
        if self.tp is not None:
            raise NotImplementedError("per-block states of tensor-parallel parameters")
        nb = num_blocks(self.numel, block_size)
        if self.placement is None or nb == 0:
            return ShardLayout(shape=(nb,), ranges=((0, nb),), mesh=self.mesh,
                               placements=tuple(Replicate() for _ in self.placements))
        units = [num_blocks(e, block_size) - s // block_size if e > s else 0
                 for s, e in self.ranges]
        placement = RaggedShard((0,), units)
        assert self.mesh_info is not None
        placements = list(self.placements)
        placements[self.mesh_info.shard_mesh_dim] = placement
        return ShardLayout(shape=(nb,), ranges=_ranges((nb,), placement), placement=placement,
                           rank=self.rank, mesh_info=self.mesh_info, mesh=self.mesh,
                           placements=tuple(placements))


    def _tp_per_block(self, block_size: int) -> ShardLayout:
        """:meth:`per_block` of a tensor-parallel layout: each TP-local tensor has its own
        blocks (they never cross a tp rank), so the statistic of shape ``(tp * nb,)`` is
        ``Shard(0)`` over the tp dims that shard the parameter (``Replicate()`` where it
        replicates) and ragged over the data-parallel dim within its ``(nb,)`` TP-local part.
        Uneven TP shards would need a different ``nb`` per tp rank: ``NotImplementedError``."""
        assert self.mesh is not None and self.mesh_info is not None and self.region is not None
        d = self.mesh_info.shard_mesh_dim
        nb = num_blocks(self.region_numel, block_size)
        units = [num_blocks(e, block_size) - s // block_size if e > s else 0
                 for s, e in self.ranges]
        placement = RaggedShard((0,), units) if nb else None
        placements, total, shape = list(self.placements), nb, list(self.shape)
        for j in range(d + 1, len(placements)):
            pl = placements[j]
            if type(pl) is Shard:
                size = self.mesh.size(j)
                if shape[pl.dim] % size:
                    raise NotImplementedError(
                        f"per-block optimizer statistics (e.g. AdamW8bit's scales) of a "
                        f"parameter of shape {self.shape} sharded unevenly by tensor "
                        f"parallelism ({pl} over {size} ranks) cannot be exported; pad dim "
                        f"{pl.dim} to a multiple of {size}.")
                shape[pl.dim] //= size
                total *= size
                placements[j] = Shard(0)
        placements[d] = placement if placement is not None else Replicate()
        if placement is None:
            return ShardLayout(shape=(total,), ranges=((0, total),), mesh=self.mesh,
                               placements=tuple(placements))
        return ShardLayout(shape=(total,), ranges=_ranges((nb,), placement),
                           placement=placement, rank=self.rank, mesh_info=self.mesh_info,
                           mesh=self.mesh, placements=tuple(placements), region=(nb,))


@functools.lru_cache(maxsize=4096)
def _ranges(shape: tuple[int, ...], placement: RaggedShard) -> tuple[tuple[int, int], ...]:
    return tuple(ragged_ranges(shape, placement))


def refuse_tensor_parallel(p: Tensor, *, where: str) -> None:
    """Raise ``NotImplementedError`` for a tensor-parallel parameter sharded by ``fully_shard``
    (design note [fsdp-tp]), for the optimizers that do not support them."""
    placements = tuple(p.placements) if isinstance(p, DTensor) else ()
    if is_tp(placements):
        raise NotImplementedError(
            f"{where} (shape {tuple(p.shape)}) is tensor-parallel and sharded by fully_shard "
            f"(placements {placements}, design note [fsdp-tp]); this optimizer does not "
            "support tensor-parallel parameters yet. Use torch.optim.AdamW / SGD (element-"
            "wise), or Muon / SOAP / Shampoo, for them.")


def param_layout(p: Tensor, *, where: str, tensor_parallel: bool = False) -> ShardLayout:
    """The :class:`ShardLayout` of parameter ``p``, checking that it is supported.

    Args:
        p: a plain tensor, an all-``Replicate`` DTensor, or a ``RaggedShard`` DTensor (the other
            mesh dimensions, if ``MeshInfo`` allows any, replicate).
        where: how errors name the parameter, e.g. ``"Muon parameter 'fc.weight'"``.
        tensor_parallel: accept a ``fully_shard`` parameter over tensor parallelism (design
            note [fsdp-tp]): its layout's ``ranges`` index this rank's TP-local tensor
            (``region``). Only for element-wise optimizers whose per-block statistics stay
            within one TP-local tensor (AdamW8bit); otherwise such parameters are refused.

    Raises:
        TypeError: another placement (``Shard``, ``Partial``, ...).
        ValueError: a mesh ``MeshInfo.from_mesh`` does not support (more than two dims), or
            the local tensor's size disagrees with the placement.

    Tensor-parallel ``fully_shard`` parameters (``(RaggedShard, Shard(k) | Replicate())`` on a
    (dp, tp) mesh, with ``Replicate()`` in front on an HSDP + TP (dp_replicate, dp_shard, tp)
    one) get the layout of design note [tp-matrix-optim] (the first layout of one not
    registered by :func:`~lightning_vescale.optim._tp_layout.register_tp_params` is a
    collective); whether an optimizer accepts them is its own decision
    (:attr:`ShardedOptimizer.tensor_parallel`).
    """
    shape = tuple(p.shape)
    if not isinstance(p, DTensor):
        return ShardLayout(shape=shape, ranges=((0, math.prod(shape)),))
    placements = tuple(p.placements)
    if all(isinstance(pl, Replicate) for pl in placements):
        return ShardLayout(shape=shape, ranges=((0, math.prod(shape)),), mesh=p.device_mesh,
                           placements=placements)
    if tensor_parallel and tp_ragged_dim(placements) is not None:
        return _tp_layout(p, placements, where)  # AdamW8bit: TP-local ranges ([fsdp-tp])
    if is_tp(placements):  # whole matrices over (dp, tp): design note [tp-matrix-optim]
        parts = tp_layout_parts(p, where=where)
        layout = ShardLayout(shape=shape, mesh=p.device_mesh, placements=placements, **parts)
        _check_local_numel(p, layout, where)
        return layout
    if any(isinstance(pl, RaggedShard) for pl in placements):
        try:
            info = MeshInfo.from_mesh(p.device_mesh)
        except (NotImplementedError, ValueError) as err:
            raise type(err)(f"{where}: {err}") from None
        d = info.shard_mesh_dim
        placement = placements[d]
        if isinstance(placement, RaggedShard) and all(
                isinstance(pl, Replicate) for i, pl in enumerate(placements) if i != d):
            ranges, rank = _ranges(shape, placement), info.shard_rank
            layout = ShardLayout(shape=shape, ranges=ranges, placement=placement, rank=rank,
                                 mesh_info=info, mesh=p.device_mesh, placements=placements)
            _check_local_numel(p, layout, where)
            return layout
    raise TypeError(
        f"{where} (shape {shape}) is a DTensor with placements {placements}; supported are "
        "plain tensors, Replicate, and (RaggedShard(...),) on a 1-D mesh or "
        "(Replicate(), RaggedShard(...)) on a 2-D (replicate, shard) mesh (as produced by "
        "lightning_vescale.fully_shard / VeScaleFSDPStrategy).")


def tp_ragged_dim(placements: Sequence[Placement]) -> int | None:
    """The data-parallel (ragged) mesh dim of a ``fully_shard`` parameter over tensor
    parallelism (design note [fsdp-tp]): one ``RaggedShard``, ``Replicate()`` before it
    (HSDP's replicate dim), the TP placements (``Shard(k)``/``Replicate()``, at least one
    dim) after it. ``None`` for any other placements."""
    dims = [i for i, pl in enumerate(placements) if isinstance(pl, RaggedShard)]
    if len(dims) != 1 or dims[0] == len(placements) - 1:
        return None
    d = dims[0]
    if not all(isinstance(pl, Replicate) for pl in placements[:d]):
        return None
    if not all(type(pl) is Shard or type(pl) is Replicate for pl in placements[d + 1:]):
        return None
    return d


def _tp_layout(p: DTensor, placements: tuple[Placement, ...], where: str) -> ShardLayout:
    """:func:`param_layout` of a TP parameter: ranges over this rank's TP-local tensor."""
    d = tp_ragged_dim(placements)
    assert d is not None
    shape, mesh = tuple(p.shape), p.device_mesh
    info = MeshInfo(mesh=mesh, shard_mesh_dim=d, replicate_mesh_dim=d - 1 if d else None)
    region, _ = tp_local_box(shape, mesh, placements, d)
    placement = placements[d]
    assert isinstance(placement, RaggedShard)
    layout = ShardLayout(shape=shape, ranges=_ranges(region, placement), placement=placement,
                         rank=info.shard_rank, mesh_info=info, mesh=mesh,
                         placements=placements, region=region)
    if local_view(p).numel() != layout.local_numel:
        raise ValueError(
            f"{where}: local tensor has {local_view(p).numel()} elements but {placement!r} "
            f"gives rank {layout.rank} {layout.local_numel} of the TP-local shape {region}")
    return layout


def _check_local_numel(p: Tensor, layout: ShardLayout, where: str) -> None:
    local_numel = local_view(p).numel()
    if local_numel != layout.local_numel:
        raise ValueError(
            f"{where}: local tensor has {local_numel} elements but {layout.placement!r} gives "
            f"rank {layout.rank} {layout.local_numel} of shape {layout.shape}")


@functools.lru_cache(maxsize=4096)
def _first_misaligned(ranges: tuple[tuple[int, int], ...], numel: int,
                      block_size: int) -> tuple[int, int, int] | None:
    for r, (s, e) in enumerate(ranges):
        if s != e and (s % block_size or (e % block_size and e != numel)):
            return r, s, e
    return None


def check_block_aligned(layout: ShardLayout, block_size: int, *, who: str, name: str) -> None:
    """Raise ``ValueError`` (the same on every rank: it reads all ranks' ranges) unless every
    non-empty range of ``layout`` starts on a multiple of ``block_size`` and ends on one or at
    the tensor's end, naming the fix (a sharding granularity that is a multiple of it).

    ``who``: the optimizer's name (``"AdamW8bit"``); ``name``: the parameter's.
    """
    bad = _first_misaligned(layout.ranges, layout.region_numel, block_size)
    if bad is None:
        return
    r, s, e = bad
    tp = "" if layout.region is None else f" of its TP-local tensor {layout.region}"
    raise ValueError(
        f"{who}(block_size={block_size}): parameter {name} (shape {layout.shape}, "
        f"{layout.numel} elements) is sharded with {layout.placement!r}, so rank {r} holds the "
        f"flat range [{s}, {e}){tp}, which does not start and end on multiples of "
        f"block_size={block_size} (or at the tensor's end): its blocks would straddle ranks. "
        "Shard with a granularity that is a multiple of the block size, e.g. "
        f"VeScaleFSDPStrategy(granularity={block_size}) / fully_shard(module, "
        f"granularity={block_size}) (or VeScaleFSDPStrategy(optimizer_block_size={block_size})),"
        " or pass a block_size that divides every shard bound."
    )


def state_in_param_layout(p: Tensor, value: Tensor, *, who: str, key: str, name: str) -> Tensor:
    """A loaded state ``value`` of parameter ``p`` in ``p``'s own layout, for optimizers that keep
    states shaped and placed like their parameter (e.g. Muon's momentum).

    ``value`` must have ``p``'s global shape. A DTensor laid out like ``p`` is kept as it is. For
    a plain ``p`` a DTensor is gathered, a plain tensor kept. For a DTensor ``p`` the value (a
    DTensor in another layout: gathered, a collective, so every rank must load; or a full plain
    tensor, e.g. from a single-process run) is cut to this rank's part, cast to ``p``'s dtype
    and device, and wrapped in ``p``'s layout as a new tensor.

    Args:
        who, key, name: name the optimizer, the state and the parameter in errors.

    Raises:
        ValueError: ``value`` has another shape (checked before anything is loaded).
        TypeError, NotImplementedError: ``p`` has a layout :func:`param_layout` refuses, and
            ``value`` is not already laid out like it.
    """
    if tuple(value.shape) != tuple(p.shape):
        kind = "a DTensor of" if isinstance(value, DTensor) else "a tensor of"
        raise ValueError(
            f"{who}.load_state_dict: state {key!r} of parameter {name} is {kind} shape "
            f"{tuple(value.shape)}, but the parameter's (global) shape is {tuple(p.shape)}. "
            f"States must be full-shape tensors (as a single-process {who} saves them) or "
            "DTensors of the parameter's shape (as a sharded one does); was the state saved for "
            "another model or another parameter order?")
    if not isinstance(p, DTensor):
        return value.full_tensor() if isinstance(value, DTensor) else value
    if isinstance(value, DTensor) and tuple(value.placements) == tuple(p.placements) and \
            value.device_mesh == p.device_mesh and value.device == p.device:
        return value  # else (e.g. a GPU state for a CPU-offloaded parameter): copied below
    layout = param_layout(p, where=f"{who}.load_state_dict: parameter {name}")
    local = layout.local_part(value).detach().to(device=p.device, dtype=p.dtype)
    return layout.to_dtensor(local.clone(), p.stride())


# -------------------------------------------------------------------------------------------------
# The optimizer base
# -------------------------------------------------------------------------------------------------
_WARNED_CPU_MATRIX_MATH: set[str] = set()


def offloaded_to_cpu(p: Tensor) -> bool:
    """``p`` is a DTensor whose local tensor is on the CPU while its mesh is an accelerator's:
    a CPU-offloaded ``fully_shard`` parameter (``CPUOffloadPolicy``)."""
    return (isinstance(p, DTensor) and p.to_local().device.type == "cpu"
            and p.device_mesh.device_type not in ("cpu", "meta"))


def warn_matrix_math_on_cpu(optimizer: "ShardedOptimizer") -> bool:
    """Warn once per optimizer class when its parameters are CPU-offloaded: the owner's whole
    matrices, their states and the step's ``matrix_math`` stay on the CPU (the optimizer steps
    where the parameters live, as torch's optimizers do with FSDP2's offload). Returns whether
    this call warned."""
    name = type(optimizer).__name__
    if name in _WARNED_CPU_MATRIX_MATH:
        return False
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not any(offloaded_to_cpu(p) for p in params):
        return False
    _WARNED_CPU_MATRIX_MATH.add(name)
    warnings.warn(
        f"{name} with CPU offload (CPUOffloadPolicy) runs its {optimizer.matrix_math} on the "
        "CPU: the owner's whole matrices and their states live where the offloaded parameters "
        "do, so every step's matrix maths is CPU time. Without offload it runs on the GPU; "
        "offload trades that time for GPU memory.", UserWarning, stacklevel=4)
    return True


@dataclass(frozen=True, kw_only=True)
class ParamRef:
    """One parameter of an optimizer, as a state dict addresses it.

    ``index`` is its position in the state dict's order (groups in order, then their params);
    ``name`` is how messages call it: its name's ``repr`` when the group has ``param_names``,
    else ``#index``.
    """

    param: Tensor
    group: dict[str, Any]
    index: int
    name: str


class ShardedOptimizer(Optimizer):
    """Base of this package's optimizers (see design note [sharded-optimizer]).

    Subclasses implement :meth:`_update` (one step on every group, under ``no_grad``) and use the
    module's helpers for layouts and state export/import. A subclass whose step runs matrix
    decompositions on the owner's whole matrices names them in :attr:`matrix_math`: with CPU
    offload those run on the CPU, which its first step says once (:func:`warn_matrix_math_on_cpu`).
    """

    #: the matrix maths of the step (``"Newton-Schulz"``, ...), ``None`` for element-wise steps
    matrix_math: str | None = None
    #: how the subclass steps ``fully_shard`` parameters over tensor parallelism: ``None``
    #: refuses them at construction; ``"local"``: on each rank's TP-local tensor, blocks never
    #: crossing a rank (AdamW8bit, design note [fsdp-tp]); ``"whole"``: each matrix whole over
    #: the (dp, tp) mesh (HSDP + TP: within each replica) for its step (Muon/SOAP/Shampoo,
    #: design note [tp-matrix-optim])
    tensor_parallel: str | None = None

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """Perform one optimization step; ``closure`` (re-evaluates the model and returns the
        loss) runs first, with gradients enabled. Returns its loss (``None`` without one)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.matrix_math is not None and not getattr(self, "_offload_checked", False):
            self._offload_checked = True  # the placement of the parameters does not change
            warn_matrix_math_on_cpu(self)
        self._update()
        return loss

    def _update(self) -> None:
        raise NotImplementedError

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.add_param_group``. Tensor-parallel parameters are refused
        (:func:`refuse_tensor_parallel`) at construction unless :attr:`tensor_parallel`; then
        every rank's range of them is gathered here (one collective per mesh: the constructor
        runs on every rank, design note [tp-matrix-optim])."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        names = group.get("param_names")
        if self.tensor_parallel == "whole":
            register_tp_params(group["params"])
        for i, p in enumerate(group["params"]):
            name = repr(names[i]) if names else f"#{i} of group #{len(self.param_groups) - 1}"
            where = f"{type(self).__name__}: parameter {name}"
            if self.tensor_parallel is None:
                refuse_tensor_parallel(p, where=where)
            elif self.tensor_parallel == "whole" and isinstance(p, DTensor) and is_tp(
                    p.placements):
                tp_layout_parts(p, where=where)  # refuses what it cannot lay out

    def _param_refs(self) -> list[ParamRef]:
        """Every parameter of every group, in state-dict order."""
        refs = []
        for group in self.param_groups:
            names = group.get("param_names")
            for i, p in enumerate(group["params"]):
                n = len(refs)
                refs.append(ParamRef(param=p, group=group, index=n,
                                     name=repr(names[i]) if names else f"#{n}"))
        return refs

    def _saved_param_refs(self, state_dict: dict[str, Any]) -> dict[Any, ParamRef]:
        """``state_dict``'s parameter ids mapped onto this optimizer's parameters, as
        ``Optimizer.load_state_dict`` pairs them; ``{}`` when the counts differ (torch's own
        load then raises its error)."""
        saved_ids = [i for g in state_dict.get("param_groups", ()) for i in g["params"]]
        refs = self._param_refs()
        if len(saved_ids) != len(refs):
            return {}
        return dict(zip(saved_ids, refs))
