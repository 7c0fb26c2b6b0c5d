"""Layer 4: ``AdamW8bit``, AdamW whose two moments are stored block-wise in 8 bits.

Design note [adamw8bit]
-----------------------
*Math.* Exactly ``torch.optim.AdamW`` (decoupled weight decay, bias correction), computed in fp32
from the dequantized moments; the parameter update uses the new fp32 moments, which are then
re-quantized for storage (as in bitsandbytes). The first moment uses the signed dynamic map, the
second the unsigned one, with one fp32 ``absmax`` per block of ``block_size`` (default 256)
elements, so the state costs ``2 * (1 + 4 / block_size)`` = 2.03 bytes per parameter instead of
8 (see ``_quant.py``). Tensors with fewer than ``min_8bit_size`` (default 4096, as bitsandbytes)
elements keep fp32 moments: their scales would cost more than they save and they are often
norms/biases that are sensitive to quantization. The choice is made on the parameter's GLOBAL
``numel`` (``p.shape``), so it never depends on the world size.

Only plain elementwise IEEE operations (``*``, ``+``, ``/``, ``sqrt``; no fused ``lerp`` /
``addcmul``, whose CPU vector and scalar paths may differ by an FMA) and per-block maxima are
used. Hence the result for an element depends only on its own values and its block's maximum,
never on how the tensor is chunked or sharded.

*Sharded parameters.* For a ``DTensor`` parameter the optimizer works on ``p.to_local()`` and
``p.grad.to_local()`` directly: no DTensor ops, no communication. Blocks are defined on the GLOBAL
flattened tensor (block ``k`` = elements ``[k*B, (k+1)*B)``), so every rank's flat range must
start on a multiple of ``B`` and end on one or at the tensor's end. Then each rank's codes and
scales are exactly the matching slice of a single-process run's. Supported placements on a 1-D
mesh: ``RaggedShard`` (local tensor = the rank's flat slice of the row-major tensor, see
``placement``) and ``Replicate``. A misaligned shard raises ``ValueError`` on every rank (the
check uses all ranks' ranges, which are pure functions of the placement) naming the fix: a
sharding granularity that is a multiple of ``block_size``.

*Fast path.* Quantized parameters whose local tensors are views into one storage (a ``DBuffer``
shard: ordered, possibly with padding gaps in between) and whose offsets in it are congruent
modulo ``B`` form a cluster. A cluster of >= 2 members is stepped as one span, in one vectorised
pass (in chunks of ``chunk_size`` elements, a multiple of ``B``, which bounds the fp32
temporaries), when: their gradients lie in one storage with the same relative layout, the
members fill >= 90% of the span, every quantized parameter in the span has a gradient and all
have taken the same number of steps (a parameter that once skipped a step keeps its cluster on
the per-parameter path). Relative offsets on multiples of ``B`` make span block ``rel/B + k``
the same elements as the parameter's own block ``k``. Everything else inside the span (padding,
fp32-state parameters, other clusters' or groups' parameters) is a gap: its moments are forced
to 0 before the block maxima (so it never changes a real block's scale, even if the padding
holds NaN) and its parameter values are written back as they are. The members' states are views
into one span-sized buffer per moment. The result is bitwise the same as the per-parameter path
(tested); parameters outside any qualifying span take that path. A planner that places every
quantized tensor at a buffer offset that is a multiple of ``B`` puts a whole shard in one span.

*State dict.* Per parameter: ``step`` (fp32 scalar) and either ``exp_avg_codes``,
``exp_avg_absmax``, ``exp_avg_sq_codes``, ``exp_avg_sq_absmax`` (uint8 codes shaped like the
parameter, fp32 scales of shape ``(num_blocks,)``) or fp32 ``exp_avg``/``exp_avg_sq``. For a
``DTensor`` parameter, codes and fp32 moments are ``DTensor``s with the parameter's placements and
global shape, and the scales are ``RaggedShard((0,), blocks_per_rank)`` ``DTensor``s, so
distributed checkpoint can save them and reshard them to another (block-aligned) world size.
``load_state_dict`` accepts those, local tensors, or full (single-process) tensors, which it
slices to the rank's range. It never casts codes or scales to the parameter's dtype. It also
loads a ``torch.optim.AdamW`` state dict: the groups get this optimizer's ``block_size``,
``min_8bit_size`` and ``chunk_size`` (``__setstate__`` fills missing group keys from the
defaults), and fp32 (or bf16) moments of a parameter that is quantized here are quantized on load.

*Non-finite values.* An ``inf``/NaN gradient element spoils only its own parameter element (as
with torch.optim.AdamW): block scales ignore non-finite values, which are stored saturated
(``inf``) or as 0 (NaN), so the rest of its block keeps finite states (see ``_quant.py``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.optim import Optimizer

from lightning_vescale.optim._quant import (
    codebook,
    dequantize_blockwise_,
    num_blocks,
    quantize_blockwise_,
)
from lightning_vescale.placement import RaggedShard, ragged_ranges

__all__ = ["AdamW8bit", "QuantizedMoment", "DEFAULT_BLOCK_SIZE", "DEFAULT_MIN_8BIT_SIZE"]

#: Elements per quantization block (bitsandbytes' value). Sharded parameters need a sharding
#: granularity that is a multiple of it; the strategy's default optimizer block size uses it.
DEFAULT_BLOCK_SIZE = 256
#: Parameters with fewer GLOBAL elements keep fp32 moments (bitsandbytes' value).
DEFAULT_MIN_8BIT_SIZE = 4096

_QUANT_KEYS = ("exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes", "exp_avg_sq_absmax")
# Group keys that torch.optim.AdamW's groups lack, with the values used when the optimizer's own
# defaults do not say (see ``AdamW8bit.__setstate__``).
_GROUP_FALLBACKS = {"block_size": DEFAULT_BLOCK_SIZE, "min_8bit_size": DEFAULT_MIN_8BIT_SIZE,
                    "chunk_size": 1 << 20, "amsgrad": False, "maximize": False}
_FP32_KEYS = ("exp_avg", "exp_avg_sq")
# The fast path allocates span-sized moment buffers (gaps included): use it only when the
# members fill at least this share of their span.
_MIN_SPAN_FILL = 0.9


# ---------------------------------------------------------------------------------------------
# The state type: one block-quantized moment (views into the optimizer's state tensors).
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class QuantizedMoment:
    """One moment stored as 8-bit ``codes`` into a dynamic map plus one fp32 ``absmax`` per block.

    ``codes`` and ``absmax`` are flat tensors (usually views into the optimizer state); this
    type only names them together with how to read them (see design note [blockwise-quant]).
    """

    codes: torch.Tensor
    absmax: torch.Tensor
    signed: bool
    block_size: int

    def dequantize(self) -> torch.Tensor:
        """The moment in fp32 (flat)."""
        out = torch.empty(self.codes.numel(), dtype=torch.float32, device=self.codes.device)
        dequantize_blockwise_(out, self.codes, self.absmax,
                              codebook(self.signed, self.codes.device).code, self.block_size)
        return out

    def quantize_(self, x: torch.Tensor) -> None:
        """Store the flat fp32 ``x`` into ``codes``/``absmax`` in place."""
        work = x.reshape(-1).to(dtype=torch.float32, copy=True)
        quantize_blockwise_(work, self.codes, self.absmax, codebook(self.signed, self.codes.device),
                            self.block_size)


@functools.lru_cache(maxsize=None)
def _zero_code(signed: bool) -> int:
    # The code of 0.0 (127 for the signed map, 0 for the unsigned one).
    return int(codebook(signed).nearest(torch.zeros(1)))


# ---------------------------------------------------------------------------------------------
# Where a parameter's local data sits in its global flat tensor.
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class _Layout:
    numel: int  # global
    start: int  # this rank's flat range [start, end)
    end: int
    quantized: bool
    ranges: tuple[tuple[int, int], ...]  # every rank's range (for exporting the scales)


@functools.lru_cache(maxsize=4096)
def _layout(shape: tuple[int, ...], placement: Any, rank: int, block_size: int,
            min_8bit_size: int, index: str) -> _Layout:
    numel = math.prod(shape)
    quantized = numel >= min_8bit_size
    if placement is None or isinstance(placement, Replicate):
        return _Layout(numel=numel, start=0, end=numel, quantized=quantized,
                       ranges=((0, numel),))
    if not isinstance(placement, RaggedShard):
        raise TypeError(
            f"AdamW8bit: parameter {index} (shape {shape}) is a DTensor with placement "
            f"{placement!r}; supported placements are RaggedShard (from "
            "lightning_vescale.fully_shard / VeScaleFSDPStrategy) and Replicate."
        )
    ranges = tuple(ragged_ranges(shape, placement))
    if quantized:
        for r, (s, e) in enumerate(ranges):
            if s == e:
                continue
            if s % block_size or (e % block_size and e != numel):
                raise ValueError(
                    f"AdamW8bit(block_size={block_size}): parameter {index} (shape {shape}, "
                    f"{numel} elements) is sharded with {placement!r}, so rank {r} holds the flat "
                    f"range [{s}, {e}), which does not start and end on multiples of "
                    f"block_size={block_size} (or at the tensor's end): quantization blocks "
                    "would straddle ranks. Shard with a granularity that is a multiple of the "
                    f"block size, e.g. VeScaleFSDPStrategy(granularity={block_size}) / "
                    f"fully_shard(module, granularity={block_size}) (or "
                    f"VeScaleFSDPStrategy(optimizer_block_size={block_size})), or pass a "
                    "block_size that divides every shard bound."
                )
    start, end = ranges[rank]
    return _Layout(numel=numel, start=start, end=end, quantized=quantized, ranges=ranges)


def _param_layout(p: torch.Tensor, block_size: int, min_8bit_size: int, index: str) -> _Layout:
    if isinstance(p, DTensor):
        mesh = p.device_mesh
        if mesh.ndim != 1:
            raise ValueError(
                f"AdamW8bit: parameter {index} lives on a {mesh.ndim}-D device mesh; only 1-D "
                "meshes (one sharding dimension) are supported."
            )
        placement = p.placements[0]
        rank = mesh.get_local_rank()
    else:
        placement, rank = None, 0
    return _layout(tuple(p.shape), placement, rank, int(block_size), int(min_8bit_size), index)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


# ---------------------------------------------------------------------------------------------
# The optimizer.
# ---------------------------------------------------------------------------------------------
class AdamW8bit(Optimizer):
    """AdamW with block-wise 8-bit moments; see design note [adamw8bit] in this module.

    Args:
        params: parameters or parameter groups (plain tensors on any device, or ``DTensor``s with
            ``RaggedShard``/``Replicate`` placements on a 1-D mesh).
        lr, betas, eps, weight_decay, maximize: as ``torch.optim.AdamW``.
        amsgrad: only ``False`` is supported.
        block_size: elements per quantization block (per group); sharded parameters need shard
            bounds on multiples of it.
        min_8bit_size: parameters with fewer GLOBAL elements keep fp32 moments.
        chunk_size: elements processed per vectorised pass (rounded down to a multiple of
            ``block_size``); bounds the fp32 temporaries of a step to ~20 bytes x ``chunk_size``.

    Groups passed here, added with :meth:`add_param_group` or loaded with
    :meth:`load_state_dict` are checked the same way (``ValueError`` naming the setting).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        amsgrad: bool = False,
        maximize: bool = False,
        block_size: int = DEFAULT_BLOCK_SIZE,
        min_8bit_size: int = DEFAULT_MIN_8BIT_SIZE,
        chunk_size: int = 1 << 20,
    ) -> None:
        _check_hparams(dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                            amsgrad=amsgrad, block_size=block_size, chunk_size=chunk_size,
                            min_8bit_size=min_8bit_size), where="AdamW8bit")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        amsgrad=False, maximize=maximize, block_size=block_size,
                        min_8bit_size=min_8bit_size, chunk_size=chunk_size)
        super().__init__(params, defaults)

    # -- groups ----------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.add_param_group``, with the constructor's checks applied to
        the group's hyper-parameters (its own keys over the optimizer's defaults)."""
        if isinstance(param_group, dict):
            _check_hparams({**self.defaults, **param_group},
                           where=f"AdamW8bit param group #{len(self.param_groups)}")
        super().add_param_group(param_group)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Groups from another optimizer's state dict (torch.optim.AdamW) or an older pickle lack
        # this optimizer's keys: fill them from its defaults.
        super().__setstate__(state)
        defaults = getattr(self, "defaults", None) or {}
        for group in self.param_groups:
            for key, fallback in _GROUP_FALLBACKS.items():
                group.setdefault(key, defaults.get(key, fallback))

    # -- introspection ---------------------------------------------------------------------------
    def dequantized_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        """The rank-local moments of ``p`` in fp32, flat: ``{"exp_avg": m, "exp_avg_sq": v}``."""
        st = self.state[p]
        if not st:
            return {}
        if "exp_avg_codes" in st:
            bs = self._group_of(p)["block_size"]
            return {
                "exp_avg": QuantizedMoment(codes=st["exp_avg_codes"], absmax=st["exp_avg_absmax"],
                                           signed=True, block_size=bs).dequantize(),
                "exp_avg_sq": QuantizedMoment(codes=st["exp_avg_sq_codes"],
                                              absmax=st["exp_avg_sq_absmax"], signed=False,
                                              block_size=bs).dequantize(),
            }
        return {k: st[k].reshape(-1).clone() for k in _FP32_KEYS}

    def _group_of(self, p: torch.Tensor) -> dict[str, Any]:
        for g in self.param_groups:
            if any(q is p for q in g["params"]):
                return g
        raise KeyError("parameter is not managed by this optimizer")

    # -- state creation --------------------------------------------------------------------------
    @staticmethod
    def _new_state(local: torch.Tensor, quantized: bool, block_size: int,
                   views: tuple[torch.Tensor, ...] | None = None) -> dict[str, torch.Tensor]:
        st: dict[str, torch.Tensor] = {"step": torch.tensor(0.0, dtype=torch.float32)}
        n, dev = local.numel(), local.device
        if quantized:
            if views is None:
                nb = num_blocks(n, block_size)
                views = (
                    torch.full((n,), _zero_code(True), dtype=torch.uint8, device=dev),
                    torch.zeros(nb, dtype=torch.float32, device=dev),
                    torch.full((n,), _zero_code(False), dtype=torch.uint8, device=dev),
                    torch.zeros(nb, dtype=torch.float32, device=dev),
                )
            st.update(zip(_QUANT_KEYS, views))
        else:
            st["exp_avg"] = torch.zeros(n, dtype=torch.float32, device=dev)
            st["exp_avg_sq"] = torch.zeros(n, dtype=torch.float32, device=dev)
        return st

    # -- step ------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):  # noqa: D102 - as torch.optim.Optimizer.step
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            self._step_group(gi, group)
        return loss

    def _step_group(self, gi: int, group: dict[str, Any]) -> None:
        bs = int(group["block_size"])
        if group.get("amsgrad", False):
            raise ValueError("AdamW8bit does not support amsgrad=True; set amsgrad=False.")
        items = []  # (param, layout, local, local grad)
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("AdamW8bit does not support sparse gradients")
            if torch.is_complex(p):
                raise TypeError("AdamW8bit does not support complex parameters")
            lay = _param_layout(p, bs, int(group["min_8bit_size"]), f"#{i} of group {gi}")
            local, glocal = _local(p.detach()), _local(p.grad.detach())
            if local.numel() != lay.end - lay.start or glocal.numel() != local.numel():
                raise RuntimeError(
                    f"AdamW8bit: parameter #{i} of group {gi}: local tensor has {local.numel()} "
                    f"elements, its gradient {glocal.numel()}, the placement says "
                    f"{lay.end - lay.start}"
                )
            st = self.state[p]
            if not st:
                st.update(self._new_state(local, lay.quantized, bs))
            items.append((p, lay, local, glocal, st))
        if not items:
            return
        done = set()
        for span in self._fast_spans(group, items):
            self._step_span(group, *span)
            done.update(id(it[0]) for it in span[0])
        for p, lay, local, glocal, st in items:
            if id(p) in done:
                continue
            st["step"] += 1
            if local.numel() == 0:
                continue
            flat = local.view(-1) if local.is_contiguous() else local.reshape(-1)
            g = glocal.reshape(-1)
            if "exp_avg_codes" in st:
                moments = tuple(st[k] for k in _QUANT_KEYS)
            else:
                moments = (st["exp_avg"], st["exp_avg_sq"])
            _step_flat(flat, g, moments, None, group, float(st["step"]), bs)
            if flat.data_ptr() != local.data_ptr() or not local.is_contiguous():
                local.copy_(flat.view_as(local))

    # -- fast path -------------------------------------------------------------------------------
    def _fast_spans(self, group, items) -> list[tuple]:
        """Spans of >= 2 quantized params that satisfy the fast-path rules (see design note).

        Candidates are clustered by (storage, storage offset mod ``block_size``): members of a
        cluster start on multiples of the block size relative to each other.
        """
        bs = int(group["block_size"])

        def key(t: torch.Tensor) -> tuple[int, int]:
            return t.untyped_storage().data_ptr(), t.storage_offset() % bs

        clusters: dict[tuple[int, int], list] = {}
        for it in items:
            if "exp_avg_codes" in it[4] and it[2].numel() > 0:
                clusters.setdefault(key(it[2]), []).append(it)
        # Every quantized state inside a span must be a member: a non-member's slice of the
        # span's moment buffers would be overwritten (a parameter without a gradient).
        with_grad = {id(it[0]) for it in items}
        for q in group["params"]:
            st = self.state.get(q)
            if id(q) not in with_grad and st and "exp_avg_codes" in st and \
                    st["exp_avg_codes"].numel():
                clusters.pop(key(_local(q.detach())), None)
        spans = []
        for mem in clusters.values():
            span = self._span(mem, bs) if len(mem) >= 2 else None
            if span is not None:
                spans.append(span)
        return spans

    def _span(self, mem, bs):
        """Members + span views when ``mem`` (same storage) tile it block-aligned; else None."""
        p0, g0 = mem[0][2], mem[0][3]
        pst, gst = p0.untyped_storage().data_ptr(), g0.untyped_storage().data_ptr()
        step0 = float(mem[0][4]["step"])
        for _, _, loc, gl, st in mem:
            if not (loc.is_contiguous() and gl.is_contiguous() and loc.dtype == p0.dtype
                    and gl.dtype == g0.dtype and loc.device == p0.device
                    and loc.untyped_storage().data_ptr() == pst
                    and gl.untyped_storage().data_ptr() == gst
                    and float(st["step"]) == step0):
                return None
        mem.sort(key=lambda it: it[2].storage_offset())
        base, gbase = mem[0][2].storage_offset(), mem[0][3].storage_offset()
        rels, prev_end = [], 0
        for _, _, loc, gl, _ in mem:
            rel = loc.storage_offset() - base
            if rel % bs or rel < prev_end or gl.storage_offset() - gbase != rel:
                return None
            rels.append(rel)
            prev_end = rel + loc.numel()
        span_len = prev_end
        if sum(it[2].numel() for it in mem) < _MIN_SPAN_FILL * span_len:
            return None  # mostly gaps: span-sized moment buffers would waste memory
        if (base + span_len) * p0.element_size() > p0.untyped_storage().nbytes() or \
                (gbase + span_len) * g0.element_size() > g0.untyped_storage().nbytes():
            return None
        p_span = torch.as_strided(p0, (span_len,), (1,), base)
        g_span = torch.as_strided(g0, (span_len,), (1,), gbase)
        moments = self._span_states(mem, rels, span_len, bs, p0.device)
        gaps = [(r + it[2].numel(), nxt) for r, it, nxt in zip(rels, mem, rels[1:] + [span_len])
                if r + it[2].numel() < nxt]
        return mem, p_span, g_span, moments, gaps

    def _span_states(self, mem, rels, span_len, bs, device):
        """Span-sized moment buffers whose slices are the members' states (re-packed if needed)."""
        nb_span = num_blocks(span_len, bs)
        sizes = (span_len, nb_span, span_len, nb_span)
        out = []
        packed = True
        for k, size in zip(_QUANT_KEYS, sizes):
            t0 = mem[0][4][k]
            per = 1 if size == span_len else bs
            tbase = t0.storage_offset()
            ok = (tbase + size) * t0.element_size() <= t0.untyped_storage().nbytes()
            ptr = t0.untyped_storage().data_ptr()
            for r, it in zip(rels, mem):
                t = it[4][k]
                ok = ok and t.untyped_storage().data_ptr() == ptr and \
                    t.storage_offset() - tbase == r // per and t.is_contiguous()
            if not ok:
                packed = False
                break
            out.append(torch.as_strided(t0, (size,), (1,), tbase))
        if packed:
            return tuple(out)
        # (Re)pack: one buffer per moment, members' states become views into it.
        bufs = (
            torch.full((span_len,), _zero_code(True), dtype=torch.uint8, device=device),
            torch.zeros(nb_span, dtype=torch.float32, device=device),
            torch.full((span_len,), _zero_code(False), dtype=torch.uint8, device=device),
            torch.zeros(nb_span, dtype=torch.float32, device=device),
        )
        for r, it in zip(rels, mem):
            n, st = it[2].numel(), it[4]
            nb = num_blocks(n, bs)
            views = (bufs[0][r: r + n], bufs[1][r // bs: r // bs + nb],
                     bufs[2][r: r + n], bufs[3][r // bs: r // bs + nb])
            for k, v in zip(_QUANT_KEYS, views):
                v.copy_(st[k].reshape(-1))
                st[k] = v
        return bufs

    def _step_span(self, group, mem, p_span, g_span, moments, gaps) -> None:
        for it in mem:
            it[4]["step"] += 1
        _step_flat(p_span, g_span, moments, gaps, group, float(mem[0][4]["step"]),
                   int(group["block_size"]))

    # -- state dict ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """As ``torch.optim.Optimizer.state_dict``; see design note [adamw8bit] for the states."""
        sd = super().state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        groups = [g for g in self.param_groups for _ in g["params"]]
        sd["state"] = {
            k: self._export_state(params[k], groups[k], v) if isinstance(k, int) else v
            for k, v in sd["state"].items()
        }
        return sd

    @staticmethod
    def _state_spec(p, group, key: str) -> tuple[tuple, torch.Size]:
        """(placements, global shape) of state ``key`` of the DTensor parameter ``p``."""
        if not key.endswith("_absmax"):
            return tuple(p.placements), p.shape
        bs = int(group["block_size"])
        lay = _param_layout(p, bs, int(group["min_8bit_size"]), "?")
        nb = num_blocks(lay.numel, bs)
        if isinstance(p.placements[0], Replicate) or nb == 0:
            return (Replicate(),), torch.Size((nb,))
        units = [num_blocks(e, bs) - s // bs if e > s else 0 for s, e in lay.ranges]
        return (RaggedShard((0,), units),), torch.Size((nb,))

    def _export_state(self, p, group, st) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in st.items():
            if k == "step" or not isinstance(v, torch.Tensor):
                out[k] = v
            elif not isinstance(p, DTensor):
                out[k] = v if k.endswith("_absmax") else v.view(p.shape)
            else:
                placements, shape = self._state_spec(p, group, k)
                out[k] = DTensor.from_local(v, p.device_mesh, placements, run_check=False,
                                            shape=shape, stride=(1,) if len(shape) == 1
                                            else p.stride())
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` (local, ``DTensor`` or full states).

        Unlike ``torch.optim.Optimizer.load_state_dict`` the moments are not cast to the
        parameter's dtype (codes stay uint8, scales and fp32 moments fp32).
        """
        state_dict = dict(state_dict)
        for i, g in enumerate(state_dict.get("param_groups", ())):
            _check_hparams({**self.defaults, **{k: v for k, v in g.items() if k != "params"}},
                           where=f"AdamW8bit.load_state_dict: saved param group #{i}")
        saved_state = state_dict.get("state", {})
        state_dict["state"] = {}
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        groups = [g for g in self.param_groups for _ in g["params"]]
        index = dict(zip(saved_ids, range(len(params))))
        for k, v in saved_state.items():
            if k not in index:
                self.state[k] = v
                continue
            j = index[k]
            self.state[params[j]] = self._import_state(params[j], groups[j], v, j)

    def _import_state(self, p, group, st, j) -> dict[str, Any]:
        bs = int(group["block_size"])
        lay = _param_layout(p, bs, int(group["min_8bit_size"]), f"#{j}")
        local_p = _local(p.detach())
        n = local_p.numel()
        out: dict[str, Any] = {}
        for k, v in st.items():
            if k == "step":
                out[k] = v.detach().clone().float().cpu() if isinstance(v, torch.Tensor) \
                    else torch.tensor(float(v), dtype=torch.float32)
                continue
            if not isinstance(v, torch.Tensor):
                out[k] = v
                continue
            if isinstance(v, DTensor):
                # our own layout: the local part; any other layout: gather, then slice below
                same = isinstance(p, DTensor) and \
                    (tuple(v.placements), v.shape) == self._state_spec(p, group, k)
                v = v.to_local() if same else v.full_tensor()
            v = v.detach().reshape(-1)
            per_block = k.endswith("_absmax")
            if per_block:
                want_local, want_full = num_blocks(n, bs), num_blocks(lay.numel, bs)
                lo, hi = lay.start // bs, lay.start // bs + want_local
            else:
                want_local, want_full = n, lay.numel
                lo, hi = lay.start, lay.end
            if v.numel() == want_full and want_full != want_local:
                v = v[lo:hi]
            elif v.numel() != want_local:
                raise ValueError(
                    f"AdamW8bit.load_state_dict: state {k!r} of parameter #{j} has {v.numel()} "
                    f"elements; this rank needs {want_local} (or the full {want_full}). Was it "
                    f"saved with another block_size (now {bs}) or sharding? Load sharded states "
                    "through distributed checkpoint, which reshards them."
                )
            dtype = torch.uint8 if k.endswith("_codes") else torch.float32
            if k in _FP32_KEYS and v.is_floating_point():
                v = v.float()  # e.g. torch.optim.AdamW's moments of a bf16 parameter
            if v.dtype != dtype:
                raise ValueError(
                    f"AdamW8bit.load_state_dict: state {k!r} of parameter #{j} has dtype "
                    f"{v.dtype}, expected {dtype}"
                )
            out[k] = v.to(device=local_p.device, copy=True).contiguous()
        if lay.quantized and all(k in out for k in _FP32_KEYS) and \
                not any(k in out for k in _QUANT_KEYS):
            # fp32 moments (torch.optim.AdamW's, or saved with a larger min_8bit_size) for a
            # parameter this optimizer quantizes: store them quantized. The local range starts
            # on a block boundary, so the local blocks are the global ones.
            for key, signed in zip(_FP32_KEYS, (True, False)):
                moment = out.pop(key)
                codes, absmax = (f"{key}_codes", f"{key}_absmax")
                out[codes] = torch.empty(n, dtype=torch.uint8, device=local_p.device)
                out[absmax] = torch.empty(num_blocks(n, bs), dtype=torch.float32,
                                          device=local_p.device)
                QuantizedMoment(codes=out[codes], absmax=out[absmax], signed=signed,
                                block_size=bs).quantize_(moment)
        return out


def _check_hparams(h: dict[str, Any], *, where: str) -> None:
    """The hyper-parameter checks of ``AdamW8bit`` (constructor, added and loaded groups)."""
    if h.get("amsgrad", False):
        raise ValueError(
            f"{where}: amsgrad=True is not supported (its running maximum would need a third "
            "quantized state); use amsgrad=False or torch.optim.AdamW(amsgrad=True)."
        )

    def number(name: str, value: Any, desc: str) -> float:
        try:
            return float(value)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"{where}: Invalid {desc}: {name}={value!r}; it must be a number "
                             ">= 0") from None

    for name, desc in (("lr", "learning rate"), ("eps", "epsilon value"),
                       ("weight_decay", "weight_decay")):
        if not number(name, h[name], desc) >= 0.0:
            raise ValueError(f"{where}: Invalid {desc}: {name}={h[name]!r}; it must be >= 0")
    betas = h["betas"]
    try:
        pair = tuple(betas)
    except TypeError:
        pair = ()
    if len(pair) != 2:
        raise ValueError(f"{where}: Invalid betas={betas!r}; it must be a pair (beta1, beta2), "
                         "each in [0, 1), e.g. betas=(0.9, 0.999)")
    if not all(0.0 <= number("betas", b, "betas") < 1.0 for b in pair):
        raise ValueError(f"{where}: Invalid betas={betas!r}; each must be in [0, 1)")
    for name in ("block_size", "chunk_size"):
        value = h[name]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{where}: {name} must be a positive int, got {name}={value!r}")
    if h["chunk_size"] < h["block_size"]:
        raise ValueError(f"{where}: chunk_size={h['chunk_size']} must be >= "
                         f"block_size={h['block_size']}")
    m = h["min_8bit_size"]
    if isinstance(m, bool) or not isinstance(m, int) or m < 0:
        raise ValueError(f"{where}: min_8bit_size must be an int >= 0, got min_8bit_size={m!r}")


def _step_flat(p: torch.Tensor, g: torch.Tensor, moments: Sequence[torch.Tensor],
               gaps: Sequence[tuple[int, int]] | None, group: dict[str, Any], step: float,
               block_size: int) -> None:
    """One AdamW step on the flat ``p`` (in place) from the flat gradient ``g``.

    ``moments`` is ``(m_codes, m_absmax, v_codes, v_absmax)`` (quantized, ``p[0]`` starts a
    block) or ``(m, v)`` fp32. ``gaps`` (``[a, b)`` ranges of ``p``) are not updated: they keep
    their parameter values and get zero moments. Work is done in chunks of
    ``group["chunk_size"]`` elements rounded down to whole blocks, so results do not depend on it.
    """
    lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
    beta1, beta2 = (float(b) for b in group["betas"])
    maximize = bool(group["maximize"])
    bc1 = 1 - beta1 ** step
    bc2_sqrt = (1 - beta2 ** step) ** 0.5
    step_size = lr / bc1
    decay = 1 - lr * wd
    quantized = len(moments) == 4
    chunk = max(block_size, int(group["chunk_size"]) // block_size * block_size)
    n = p.numel()
    dev = p.device
    if quantized:
        m_book, v_book = codebook(True, dev), codebook(False, dev)
    for s in range(0, n, chunk):
        e = min(n, s + chunk)
        b0, b1 = s // block_size, num_blocks(e, block_size)
        pc = p[s:e]
        p32 = pc.float()
        g32 = g[s:e].float()
        if maximize:
            g32 = -g32
        if quantized:
            m = torch.empty(e - s, dtype=torch.float32, device=dev)
            v = torch.empty_like(m)
            dequantize_blockwise_(m, moments[0][s:e], moments[1][b0:b1], m_book.code, block_size)
            dequantize_blockwise_(v, moments[2][s:e], moments[3][b0:b1], v_book.code, block_size)
        else:
            m, v = moments[0][s:e], moments[1][s:e]
        # m = beta1*m + (1-beta1)*g ; v = beta2*v + (1-beta2)*g*g  (plain IEEE ops, see note)
        m.mul_(beta1).add_(g32 * (1 - beta1))
        v.mul_(beta2).add_((g32 * g32).mul_(1 - beta2))
        cut = [(max(a, s) - s, min(b, e) - s) for a, b in gaps or () if a < e and b > s]
        for a, b in cut:  # gaps: zero moments (never raise a block's absmax, even from NaN)
            m[a:b] = 0.0
            v[a:b] = 0.0
        denom = v.sqrt().div_(bc2_sqrt).add_(eps)
        new_p = (p32 * decay).add_(torch.div(m, denom).mul_(-step_size))
        for a, b in cut:  # gaps: parameter values written back as they were
            new_p[a:b] = p32[a:b]
        pc.copy_(new_p)
        if quantized:
            quantize_blockwise_(m, moments[0][s:e], moments[1][b0:b1], m_book, block_size)
            quantize_blockwise_(v, moments[2][s:e], moments[3][b0:b1], v_book, block_size)
