"""Layer 4: ``AdamW8bit``, AdamW whose two moments are stored block-wise in 8 bits.

Design note [adamw8bit]
-----------------------
*Math.* Exactly ``torch.optim.AdamW`` (decoupled weight decay, bias correction), computed in fp32
from the dequantized moments; the parameter update uses the new fp32 moments, which are then
re-quantized for storage (as in bitsandbytes). The first moment uses the signed dynamic map, the
second the unsigned one, with one fp32 ``absmax`` per block of ``block_size`` (default
``DEFAULT_BLOCK_SIZE`` = 256) elements, so the state costs ``2 * (1 + 4 / block_size)`` = 2.03
bytes per parameter instead of 8 (see ``_quant.py``). Tensors with fewer than ``min_8bit_size``
(default 4096, as bitsandbytes) elements keep fp32 moments: their scales would cost more than they save and they are often
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
scales are exactly the matching slice of a single-process run's. Supported placements:
``RaggedShard`` (local tensor = the rank's flat slice of the row-major tensor, see
``lightning_vescale.placement``) and ``Replicate``. A misaligned shard raises ``ValueError``
when the optimizer is built (or a group added, or the block size inherited) and at a step, on
every rank (the check uses all ranks' ranges, which are pure functions of the placement) naming
the fix: a sharding granularity that is a multiple of ``block_size``. Parameter checks and the
state export/import below are the shared ones of ``_base.py`` (design note [sharded-optimizer]).

*Tensor parallelism.* A ``fully_shard`` parameter over TP (design note [fsdp-tp]) is a DTensor
``(RaggedShard, Shard(k))`` (or ``Replicate()`` on tp) whose RaggedShard ranges split the
rank's TP-local tensor, not the global one. Blocks are then defined on the flattened TP-local
tensor (``ShardLayout.region``), so a block never crosses a rank of either dim and the ranges
must be block-aligned within it (the same check, naming the TP-local shape). The exact
reference is one process's AdamW8bit on the TP-local tensors with the same gradients (tested
bit-equal); it is *not* the single-process run on the full tensors, whose blocks differ where
the TP-local rows are not a range of the full tensor (``Shard(1)``). ``min_8bit_size`` still
reads the global numel. In the state dict the scales are a ``(tp * blocks,)`` DTensor,
``Shard(0)`` over tp and ragged over dp (uneven TP shards: ``NotImplementedError``). Where the
TP-local blocks are not the global ones (a ``Shard(1)`` weight), the same number of scales
means other blocks at another tp layout, which distributed checkpoint would reshard silently:
each quantized parameter's state therefore carries ``block_layout``, its block grid (TP-local
pieces per dim, all ones where the blocks are the global ones; ``_block_layout.py``), and
:meth:`AdamW8bit.load_state_dict` refuses a saved grid that differs from the live one
(``RuntimeError`` naming both and the fix) before touching the states; a state without the
record (saved before it existed) is read as the global blocks.

*Whole matrices.* A stacked ``(E, out, in)`` weight that the strategies shard with granularity
``"matrix"`` (each expert whole on one rank, design note [granularity-rules]) is marked with
its name (:func:`mark_whole_matrices`). Its quantization blocks must then lie in one matrix each
(one absmax scale must not mix two experts' moments): ``block_size`` must divide
``shape[-2] * shape[-1]``, checked where the layout is (construction, a group added, the block
size inherited), naming the block sizes that fit. It is this optimizer's rule, not the
strategy's: SOAP, Shampoo or Muon on the same layout have no blocks, and a tensor holding one
matrix (2-D) cannot mix two.

*Fast path.* Quantized parameters whose local tensors tile one storage (a ``DBuffer`` shard) at
block-aligned relative offsets are stepped as one span in one vectorised pass, bitwise equal to
the per-parameter path; the rules are design note [adamw8bit-fast-path] in ``_adamw8bit_flat.py``.

*State dict.* Per parameter: ``step`` (fp32 scalar) and either ``exp_avg_codes``,
``exp_avg_absmax``, ``exp_avg_sq_codes``, ``exp_avg_sq_absmax`` (uint8 codes shaped like the
parameter, fp32 scales of shape ``(num_blocks,)``, and the int64 ``block_layout`` record of
*Tensor parallelism*) or fp32 ``exp_avg``/``exp_avg_sq``. For a
``DTensor`` parameter, codes and fp32 moments are ``DTensor``s with the parameter's placements and
global shape, the record a ``Replicate()`` ``DTensor``, and the scales are
``RaggedShard((0,), blocks_per_rank)`` ``DTensor``s, so
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

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from lightning_vescale.optim._adamw8bit_flat import (
    FP32_KEYS,
    QUANT_KEYS,
    Span,
    StepEntry,
    find_spans,
    new_state,
    step_flat,
    step_span,
)
from lightning_vescale.optim._base import (
    ParamRef,
    ShardedOptimizer,
    ShardLayout,
    check_block_aligned,
    local_view,
    param_layout,
)
from lightning_vescale.optim._block_layout import (
    BLOCK_LAYOUT_KEY,
    block_layout_record,
    check_block_layout,
)
from lightning_vescale.optim._quant import DEFAULT_BLOCK_SIZE, QuantizedMoment, num_blocks
from lightning_vescale.placement import compact_, contiguous_runs, run_view

__all__ = ["AdamW8bit", "DEFAULT_MIN_8BIT_SIZE", "DEFAULT_CHUNK_SIZE",
           "mark_sharded_for_block_size", "mark_whole_matrices"]

#: Parameters with fewer GLOBAL elements keep fp32 moments (bitsandbytes' value).
DEFAULT_MIN_8BIT_SIZE = 4096
#: Elements per vectorised pass of a step (bounds the fp32 temporaries).
DEFAULT_CHUNK_SIZE = 1 << 20

#: Set by the strategies on the parameters they shard: the ``optimizer_block_size`` the shards
#: were aligned to (what a group with ``block_size=None`` inherits right after construction).
_SHARDED_FOR = "_lightning_vescale_optimizer_block_size"


def mark_sharded_for_block_size(params: Iterable[torch.Tensor], block_size: int | None) -> None:
    """Record on ``params`` that their shards were aligned to ``block_size`` (the strategies'
    ``optimizer_block_size``; ``None`` records nothing), so that ``AdamW8bit(block_size=None)``
    built on them checks their layout against it at construction."""
    if block_size is None:
        return
    for p in params:
        setattr(p, _SHARDED_FOR, int(block_size))


#: Set by the strategies on the parameters they shard with granularity ``"matrix"``: the
#: parameter's name, for the whole-matrix block check (design note [adamw8bit], *Whole matrices*).
_WHOLE_MATRICES = "_lightning_vescale_whole_matrices"


def mark_whole_matrices(named_params: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Record on each ``(name, param)`` that it was sharded with every matrix whole on one rank
    (granularity ``"matrix"``), so that an ``AdamW8bit`` built on it refuses blocks that would
    hold two of its matrices (see :func:`check_blocks_in_matrices`)."""
    for name, p in named_params:
        setattr(p, _WHOLE_MATRICES, str(name))


def check_blocks_in_matrices(p: torch.Tensor, block_size: int) -> None:
    """Raise ``ValueError`` if ``p`` was marked by :func:`mark_whole_matrices`, stacks more than
    one matrix, and ``block_size`` does not divide one matrix's element count: a quantization
    block would then hold two matrices' (experts') moments under one scale. Names the fix."""
    name = getattr(p, _WHOLE_MATRICES, None)
    shape = tuple(p.shape)
    if name is None or len(shape) < 3 or math.prod(shape[:-2]) < 2:
        return  # not sharded per matrix, or one matrix: no block can hold two
    m = shape[-2] * shape[-1]
    if m % block_size == 0:
        return
    fits = math.gcd(m, block_size)
    raise ValueError(
        f"AdamW8bit(block_size={block_size}): parameter {name!r} of shape {shape} is sharded "
        f"with granularity 'matrix' (each of its {math.prod(shape[:-2])} matrices whole on one "
        f"rank), but one matrix has {m} elements, not a multiple of {block_size}, so a "
        f"quantization block would hold two matrices' (experts') moments under one scale. Use "
        f"optimizer_block_size={fits} on the strategy (the largest block that divides {m} and "
        f"{block_size}; AdamW8bit(block_size=None) inherits it), or a granularity other than "
        f"'matrix' for {name!r}, or a matrix optimizer (Muon, SOAP, Shampoo), which has no "
        "blocks.")


# Group keys that torch.optim.AdamW's groups lack, with the values used when the optimizer's own
# defaults do not say (see ``AdamW8bit.__setstate__``).
_GROUP_FALLBACKS = {"block_size": DEFAULT_BLOCK_SIZE, "min_8bit_size": DEFAULT_MIN_8BIT_SIZE,
                    "chunk_size": DEFAULT_CHUNK_SIZE, "amsgrad": False, "maximize": False}


class AdamW8bit(ShardedOptimizer):
    """AdamW with block-wise 8-bit moments; see design note [adamw8bit] in this module.

    Args:
        params: parameters or parameter groups (plain tensors on any device, or ``DTensor``s with
            ``(RaggedShard,)`` / ``(Replicate(), RaggedShard)`` / all-``Replicate`` placements
            on a 1-D or HSDP mesh; the shard group's ranges decide the blocks).
        lr: as ``torch.optim.AdamW``'s ``lr``.
        betas: as ``torch.optim.AdamW``'s ``betas``.
        eps: as ``torch.optim.AdamW``'s ``eps``.
        weight_decay: as ``torch.optim.AdamW``'s ``weight_decay``.
        maximize: as ``torch.optim.AdamW``'s ``maximize``.
        amsgrad: only ``False`` is supported.
        block_size: elements per quantization block (per group); sharded parameters need shard
            bounds on multiples of it. ``None`` (default): the block size the parameters were
            sharded for, so it is stated once: under ``VeScaleFSDPStrategy`` /
            ``VeScaleFabricStrategy`` their ``optimizer_block_size`` (see
            :meth:`inherit_block_size`), otherwise ``DEFAULT_BLOCK_SIZE`` (256).
        min_8bit_size: parameters with fewer GLOBAL elements keep fp32 moments.
        chunk_size: elements processed per vectorised pass (rounded down to a multiple of
            ``block_size``); bounds the fp32 temporaries of a step to ~20 bytes x ``chunk_size``.

    Groups passed here, added with :meth:`add_param_group` or loaded with
    :meth:`load_state_dict` are checked the same way (``ValueError`` naming the setting).
    """

    #: ``fully_shard`` parameters over tensor parallelism: blocks within the TP-local tensor
    tensor_parallel = "local"  # design note [fsdp-tp]: blocks inside the TP-local tensor

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
        block_size: int | None = None,
        min_8bit_size: int = DEFAULT_MIN_8BIT_SIZE,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
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
        self._check_layouts(len(self.param_groups) - 1)

    def _check_layouts(self, gi: int) -> None:
        """Group ``gi``'s sharded parameters that will be quantized are block-aligned, checked
        when the group arrives (construction, :meth:`add_param_group`,
        :meth:`inherit_block_size`), so a misaligned layout raises here, naming the parameter,
        its rank's range, the block size and the fix, instead of at the first ``step()``. A
        group that stated no ``block_size`` is checked against the block its parameters were
        sharded for (a strategy's ``optimizer_block_size``), else ``DEFAULT_BLOCK_SIZE``."""
        group = self.param_groups[gi]
        for i, p in enumerate(group["params"]):
            if not isinstance(p, DTensor):
                continue  # plain or not yet sharded (the strategies re-point, then inherit)
            bs = group["block_size"] or getattr(p, _SHARDED_FOR, None) or DEFAULT_BLOCK_SIZE
            self._layout(p, {**group, "block_size": bs}, f"#{i} of group {gi}")

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
            bs = group_block_size(self._group_of(p))
            return {
                "exp_avg": QuantizedMoment(codes=st["exp_avg_codes"], absmax=st["exp_avg_absmax"],
                                           signed=True, block_size=bs).dequantize(),
                "exp_avg_sq": QuantizedMoment(codes=st["exp_avg_sq_codes"],
                                              absmax=st["exp_avg_sq_absmax"], signed=False,
                                              block_size=bs).dequantize(),
            }
        return {k: st[k].reshape(-1).clone() for k in FP32_KEYS}

    def inherit_block_size(self, block_size: int | None) -> None:
        """Give every group that did not state a ``block_size`` this one.

        The strategies call it with their ``optimizer_block_size`` right after the optimizers
        are created, so ``AdamW8bit()`` quantizes in the blocks the shards were aligned to and
        the user states the block size once. Groups that stated one keep it; every group's
        layout is checked again here (a mismatch with the sharding raises now, naming the
        fix); ``None`` leaves the default.
        """
        if block_size is None:
            return
        _check_hparams({**self.defaults, "block_size": block_size}, where="AdamW8bit")
        for gi, group in enumerate(self.param_groups):
            if group["block_size"] is None:
                group["block_size"] = block_size
            self._check_layouts(gi)

    def _group_of(self, p: torch.Tensor) -> dict[str, Any]:
        for g in self.param_groups:
            if any(q is p for q in g["params"]):
                return g
        raise KeyError("parameter is not managed by this optimizer")

    @staticmethod
    def _layout(p: torch.Tensor, group: dict[str, Any], name: str) -> tuple[ShardLayout, bool]:
        """``p``'s checked layout and whether its moments are quantized (GLOBAL numel >=
        ``min_8bit_size``; then its shard must be block-aligned)."""
        layout = param_layout(p, where=f"AdamW8bit: parameter {name}", tensor_parallel=True)
        quantized = layout.numel >= int(group["min_8bit_size"])
        if quantized:
            check_block_aligned(layout, group_block_size(group), who="AdamW8bit", name=name)
            check_blocks_in_matrices(p, group_block_size(group))
        return layout, quantized

    # -- step ------------------------------------------------------------------------------------
    def _update(self) -> None:
        for gi, group in enumerate(self.param_groups):
            self._step_group(gi, group)

    def _step_group(self, gi: int, group: dict[str, Any]) -> None:
        bs = group_block_size(group)
        if group.get("amsgrad", False):
            raise ValueError("AdamW8bit does not support amsgrad=True; set amsgrad=False.")
        entries: list[StepEntry] = []
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("AdamW8bit does not support sparse gradients")
            if torch.is_complex(p):
                raise TypeError("AdamW8bit does not support complex parameters")
            _, quantized = self._layout(p, group, f"#{i} of group {gi}")
            local, glocal = local_view(p.detach()), local_view(p.grad.detach())
            if glocal.numel() != local.numel():
                raise RuntimeError(
                    f"AdamW8bit: parameter #{i} of group {gi}: local tensor has {local.numel()} "
                    f"elements, its gradient {glocal.numel()}; give the gradient the "
                    "parameter's placement"
                )
            st = self.state[p]
            if not st:
                st.update(new_state(local, quantized, bs))
            entries.append(StepEntry(param=p, local=local, grad=glocal, state=st))
        if not entries:
            return
        done = set()
        for span in find_spans(entries, group["params"], self.state, bs):
            self._step_span(group, span)
            done.update(id(e.param) for e in span.members)
        rest = [e for e in entries if id(e.param) not in done]
        for e in rest:
            e.state["step"] += 1
        done.update(self._step_fp32_runs(group, rest, bs))
        for e in rest:
            if id(e.param) in done:
                continue
            st, local = e.state, e.local
            if local.numel() == 0:
                continue
            flat = local.view(-1) if local.is_contiguous() else local.reshape(-1)
            moments = tuple(st[k] for k in (QUANT_KEYS if "exp_avg_codes" in st else FP32_KEYS))
            step_flat(flat, e.grad.reshape(-1), moments, None, group, float(st["step"]), bs)
            if flat.data_ptr() != local.data_ptr() or not local.is_contiguous():
                local.copy_(flat.view_as(local))

    @staticmethod
    def _step_fp32_runs(group: dict[str, Any], entries: list[StepEntry], bs: int) -> set[int]:
        """Parameters with fp32 moments (small tensors: norms, biases) that lie back to back
        in one storage (a DBuffer shard), with their gradients and moments, and have taken the
        same number of steps, are stepped as one flat range (design note [flat-step] in
        ``lightning_vescale.placement``): the same plain element-wise ops on more elements,
        so bitwise the per-parameter result. Moments are moved into one buffer on first use.
        Returns the ``id``s of the parameters stepped."""
        fp32 = [e for e in entries if "exp_avg" in e.state and e.local.numel()]
        if len(fp32) < 2:
            return set()
        for key in FP32_KEYS:
            compact_([e.state[key] for e in fp32])
        lists = ([e.local for e in fp32], [e.grad for e in fp32],
                 [e.state["exp_avg"] for e in fp32], [e.state["exp_avg_sq"] for e in fp32])
        done: set[int] = set()
        for a, b in contiguous_runs(*lists):
            start = a
            for k in range(a + 1, b + 1):  # cut where the step counts differ
                if k < b and float(fp32[k].state["step"]) == float(fp32[start].state["step"]):
                    continue
                if k - start > 1:
                    views = [run_view(lst, start, k) for lst in lists]
                    step_flat(views[0], views[1], (views[2], views[3]), None, group,
                              float(fp32[start].state["step"]), bs)
                    done.update(id(e.param) for e in fp32[start:k])
                start = k
        return done

    def _step_span(self, group: dict[str, Any], span: Span) -> None:
        # One fast-path span (a method, so tests can count the spans taken).
        step_span(span, group)

    # -- state dict ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """As ``torch.optim.Optimizer.state_dict``; see design note [adamw8bit] for the states."""
        sd = super().state_dict()
        refs = self._param_refs()
        sd["state"] = {
            k: self._export_state(refs[k], v) if isinstance(k, int) else v
            for k, v in sd["state"].items()
        }
        return sd

    def _export_state(self, ref: ParamRef, st: dict[str, Any]) -> dict[str, Any]:
        """``st`` with codes and fp32 moments shaped like the parameter; for a DTensor
        parameter, DTensors in its layout (scales: per-block layout)."""
        p = ref.param
        layout = None
        if isinstance(p, DTensor):
            layout, _ = self._layout(p, ref.group, ref.name)
        out: dict[str, Any] = {}
        if "exp_avg_codes" in st:  # which blocks the scales belong to, checked on load
            lay = layout or param_layout(p, where=f"AdamW8bit: parameter {ref.name}")
            out[BLOCK_LAYOUT_KEY] = block_layout_record(lay, group_block_size(ref.group),
                                                        like=p)
        for k, v in st.items():
            if k == "step" or not isinstance(v, torch.Tensor):
                out[k] = v
            elif layout is None:
                out[k] = v if k.endswith("_absmax") else v.view(p.shape)
            elif k.endswith("_absmax"):
                out[k] = layout.per_block(group_block_size(ref.group)).to_dtensor(v)
            else:
                out[k] = layout.to_dtensor(v, p.stride())
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
        super().load_state_dict(state_dict)  # the groups (torch's checks); states below
        refs = self._saved_param_refs(state_dict)  # after the load: the loaded groups' settings
        for k, v in saved_state.items():
            if k in refs:
                self.state[refs[k].param] = self._import_state(refs[k], v)
            else:
                self.state[k] = v

    def _import_state(self, ref: ParamRef, st: dict[str, Any]) -> dict[str, Any]:
        p, group, name = ref.param, ref.group, ref.name
        bs = group_block_size(group)
        layout, quantized = self._layout(p, group, name)
        device = local_view(p.detach()).device
        st = dict(st)
        record = st.pop(BLOCK_LAYOUT_KEY, None)
        if quantized and any(k in st for k in QUANT_KEYS):  # before any collective below
            check_block_layout(record, layout, bs, name=name)
        out: dict[str, Any] = {}
        for k, v in st.items():
            if k == "step":
                out[k] = v.detach().clone().float().cpu() if isinstance(v, torch.Tensor) \
                    else torch.tensor(float(v), dtype=torch.float32)
                continue
            if not isinstance(v, torch.Tensor):
                out[k] = v
                continue
            lay = layout.per_block(bs) if k.endswith("_absmax") else layout
            # a DTensor must be whole (its global size: the same check on every rank, before
            # any gather); a plain tensor whole or this rank's part
            if v.numel() != lay.numel and (isinstance(v, DTensor)
                                           or v.numel() != lay.local_numel):
                raise ValueError(
                    f"AdamW8bit.load_state_dict: state {k!r} of parameter {name} has {v.numel()} "
                    f"elements; this rank needs {lay.local_numel} (or the full {lay.numel}). Was "
                    f"it saved with another block_size (now {bs}) or sharding? Load sharded "
                    "states through distributed checkpoint, which reshards them."
                )
            if isinstance(v, DTensor) or v.numel() != lay.local_numel:
                v = lay.local_part(v)  # a DTensor (any layout) or a full tensor
            v = v.detach().reshape(-1)
            dtype = torch.uint8 if k.endswith("_codes") else torch.float32
            if k in FP32_KEYS and v.is_floating_point():
                v = v.float()  # e.g. torch.optim.AdamW's moments of a bf16 parameter
            if v.dtype != dtype:
                raise ValueError(
                    f"AdamW8bit.load_state_dict: state {k!r} of parameter {name} has dtype "
                    f"{v.dtype}, expected {dtype}"
                )
            out[k] = v.to(device=device, copy=True).contiguous()
        if quantized and all(k in out for k in FP32_KEYS) and \
                not any(k in out for k in QUANT_KEYS):
            # fp32 moments (torch.optim.AdamW's, or saved with a larger min_8bit_size) for a
            # parameter this optimizer quantizes: store them quantized. The local range starts
            # on a block boundary, so the local blocks are the global ones.
            n = layout.local_numel
            for key, signed in zip(FP32_KEYS, (True, False)):
                moment = out.pop(key)
                codes, absmax = (f"{key}_codes", f"{key}_absmax")
                out[codes] = torch.empty(n, dtype=torch.uint8, device=device)
                out[absmax] = torch.empty(num_blocks(n, bs), dtype=torch.float32, device=device)
                QuantizedMoment(codes=out[codes], absmax=out[absmax], signed=signed,
                                block_size=bs).quantize_(moment)
        return out


def group_block_size(group: dict[str, Any]) -> int:
    """A group's block size; an unstated one (``None``) becomes ``DEFAULT_BLOCK_SIZE`` at its
    first use, so every later read (steps, state dicts) sees the same number."""
    if group.get("block_size") is None:
        group["block_size"] = DEFAULT_BLOCK_SIZE
    return int(group["block_size"])


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
    if h["block_size"] is not None:  # None: inherited or the default (group_block_size)
        value = h["block_size"]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{where}: block_size must be a positive int, got "
                             f"block_size={value!r} (or None: the block size the parameters "
                             "were sharded for)")
    value = h["chunk_size"]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{where}: chunk_size must be a positive int, got chunk_size={value!r}")
    block_size = h["block_size"] if h["block_size"] is not None else DEFAULT_BLOCK_SIZE
    if h["chunk_size"] < block_size:
        raise ValueError(f"{where}: chunk_size={h['chunk_size']} must be >= "
                         f"block_size={block_size}")
    m = h["min_8bit_size"]
    if isinstance(m, bool) or not isinstance(m, int) or m < 0:
        raise ValueError(f"{where}: min_8bit_size must be an int >= 0, got min_8bit_size={m!r}")
