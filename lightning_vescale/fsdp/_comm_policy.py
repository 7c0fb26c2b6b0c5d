"""``CommPolicy``: what a group's collectives carry (quantized all-gather, gradient wire dtype).

Design note [comm-policy]
-------------------------
``fully_shard(module, comm_policy=CommPolicy(...))`` (and the strategies' ``comm_policy=``)
changes what travels, never what is stored: the sharded master parameters, their gradients, the
optimizer states and checkpoints stay full precision.

* ``all_gather="int8"|"fp8"``: the group's *quantized* parameters go into DBuffers of their own
  (``group.buffers`` key ``(dtype, trainable, True)`` beside the usual ``(dtype, trainable)``,
  each with ``"matrix"`` twins where [plan-buckets] splits; design note [fsdp-buffer-order]
  holds inside each), whose all-gather moves 1-byte codes plus
  one fp32 scale per ``block_size`` elements (design note [quantized-all-gather] in
  ``lightning_vescale/_dbuffer_quant.py``) and dequantizes into the unsharded parameters in
  ``param_dtype``. Gradients flow to the master shards as usual (straight-through: the
  backward of ``W_hat`` is applied to ``W``).
* Which parameters: by default every floating-point tensor of 2+ dims with at least
  ``min_numel`` (4096, ``AdamW8bit``'s ``min_8bit_size``) elements; norms, biases and small
  tensors stay exact (they cost little and suffer most). ``quantize`` overrides it per
  parameter, as ``granularity`` does: a dict ``name -> bool`` (names relative to the
  ``fully_shard`` module; others keep the default) or a callable ``(name, param) -> bool``.
* Blocks never straddle ranks: a quantized tensor's granularity must be a multiple of
  ``block_size``. ``granularity=None`` (``fully_shard``'s default) and a callable's results
  (the strategies' policy) are rounded up to one; an int, str or dict granularity that is not a
  multiple is an error, as is quantizing an integer parameter. ``block_size=None``: 256, or the
  strategy's ``optimizer_block_size`` (one block for ``AdamW8bit``'s states and the all-gather).
* ``reduce_scatter_dtype`` (e.g. ``torch.bfloat16`` or ``"bf16"``): every trainable buffer's
  gradients travel in it and are summed in fp32 (design note [dbuffer-collectives]),
  independently of ``MixedPrecisionPolicy.reduce_dtype`` (which still decides the dtype
  unsynced micro-batches are accumulated in). ``torch.float16`` (max 65504) travels scaled:
  each rank's message by a power of two that fits its absmax, the exponent beside it
  (``_dbuffer_comm.pack_scaled``), so gradients arrive finite (a non-finite one stays
  non-finite, for the grad scaler). 8-bit floats are refused: unscaled they flush or saturate
  gradients (8-bit traffic is the all-gather's ``"int8"``/``"fp8"``).
* A quantized block whose codes would mostly be 0 (one outlier sets its scale) raises on every
  rank, naming the parameter: design note [quantized-degenerate-blocks].

Everything is checked when the policy is built or at ``fully_shard``, before any step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Union

import torch
from torch import nn

from lightning_vescale._dbuffer_quant import QUANT_FORMATS, fp8_dtype
from lightning_vescale.planner import DEFAULT_BLOCK_ALIGN, DEFAULT_BLOCK_MIN_NUMEL

__all__ = ["CommPolicy", "as_comm_policy", "quantized_params", "quantized_granularities"]

#: ``CommPolicy.quantize``: ``None``, ``name -> bool`` or ``(name, param) -> bool``
QuantizeArg = Union[None, Mapping[str, bool], Callable[[str, nn.Parameter], bool]]

_DTYPE_NAMES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
    "float16": torch.float16, "half": torch.float16, "fp32": torch.float32,
    "float32": torch.float32, "float": torch.float32,
}


def _as_dtype(value: Any) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype):
        dtype = value
    elif isinstance(value, str):
        key = value.lower().removeprefix("torch.")
        if key not in _DTYPE_NAMES:
            raise ValueError(
                f"CommPolicy: reduce_scatter_dtype={value!r} is not a dtype name; use one of "
                f"{sorted(_DTYPE_NAMES)} or a torch.dtype (e.g. torch.bfloat16).")
        dtype = _DTYPE_NAMES[key]
    else:
        raise TypeError(f"CommPolicy: reduce_scatter_dtype must be a torch.dtype, a dtype name "
                        f"('bf16') or None, got {value!r}")
    if dtype is not None and not dtype.is_floating_point:
        raise ValueError(f"CommPolicy: reduce_scatter_dtype={dtype} is not a floating-point "
                         "dtype; gradients travel in a float dtype (e.g. torch.bfloat16).")
    if dtype is not None and dtype.itemsize < 2:
        # float8/float4: unscaled, e4m3 flushes gradients below 2**-9 to zero and saturates
        # at 448 (e5m2: 2 mantissa bits); a scaled 8-bit wire is not implemented
        raise ValueError(
            f"CommPolicy: reduce_scatter_dtype={dtype} is not supported: gradients would travel "
            "without a scale, flushed to zero or saturated. Supported: torch.bfloat16, "
            "torch.float16 (scaled per rank, design note [comm-policy]) and torch.float32; "
            "for 8-bit traffic quantize the all-gather (all_gather='int8' or 'fp8').")
    return dtype


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommPolicy:
    """What ``fully_shard``'s collectives carry (design note [comm-policy]).

    Args:
        all_gather: ``None`` (default: ``param_dtype``), ``"int8"`` (symmetric linear codes,
            absmax per block) or ``"fp8"`` (``float8_e4m3fn`` codes, scale per block).
        block_size: elements per quantization block (``None``: 256, or the strategy's
            ``optimizer_block_size``); quantized tensors' shard bounds align to it.
        reduce_scatter_dtype: the dtype gradients travel in (a ``torch.dtype`` or a name like
            ``"bf16"``), summed in fp32; ``None``: the reduce dtype, as without a policy.
            ``torch.bfloat16``, ``torch.float16`` (scaled per rank) or ``torch.float32``;
            8-bit floats are refused.
        quantize: per-parameter override of which tensors are quantized: a dict
            ``name -> bool`` or a callable ``(name, param) -> bool``; ``None``: the default rule.
        min_numel: the default rule's size threshold (floating tensors of 2+ dims with at
            least this many elements are quantized).

    Raises:
        ValueError, TypeError, RuntimeError: an unknown format or dtype name, an 8-bit
            ``reduce_scatter_dtype``, a bad block size, or ``"fp8"`` on a torch without float8
            dtypes.
    """

    all_gather: str | None = None
    block_size: int | None = None
    reduce_scatter_dtype: torch.dtype | str | None = None
    quantize: QuantizeArg = None
    min_numel: int = DEFAULT_BLOCK_MIN_NUMEL

    def __post_init__(self) -> None:
        fmt = self.all_gather
        if fmt is not None:
            if not isinstance(fmt, str) or fmt.lower() not in QUANT_FORMATS:
                raise ValueError(f"CommPolicy: all_gather={fmt!r} is not supported; use None, "
                                 "'int8' or 'fp8'.")
            object.__setattr__(self, "all_gather", fmt.lower())
            if fmt.lower() == "fp8" and fp8_dtype() is None:
                raise RuntimeError(
                    f"CommPolicy: all_gather='fp8' needs torch.float8_e4m3fn, which torch "
                    f"{torch.__version__} lacks; use all_gather='int8' or a newer torch.")
        b = self.block_size
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or b < 1):
            raise ValueError(f"CommPolicy: block_size must be a positive int or None, got "
                             f"block_size={b!r} (e.g. 256).")
        object.__setattr__(self, "reduce_scatter_dtype", _as_dtype(self.reduce_scatter_dtype))
        q = self.quantize
        if q is not None and not isinstance(q, Mapping) and not callable(q):
            raise TypeError(f"CommPolicy: quantize must be None, a dict name -> bool or a "
                            f"callable (name, param) -> bool, got {type(q).__name__}")
        if isinstance(q, Mapping):
            bad = {k: v for k, v in q.items() if not isinstance(v, bool)}
            if bad:
                raise TypeError(f"CommPolicy: quantize values must be bools, got {bad}")
        m = self.min_numel
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"CommPolicy: min_numel must be an int >= 1, got min_numel={m!r}")

    @property
    def is_active(self) -> bool:
        """Whether the policy changes any collective."""
        return self.all_gather is not None or self.reduce_scatter_dtype is not None

    def resolved_block_size(self, default: int | None = None) -> int:
        """``block_size``, else ``default``, else 256."""
        return self.block_size or default or DEFAULT_BLOCK_ALIGN

    def describe(self) -> str:
        """The policy in a few words (the sharding summary's line)."""
        parts = []
        if self.all_gather is not None:
            parts.append(f"all-gather {self.all_gather} (block {self.resolved_block_size()})")
        if self.reduce_scatter_dtype is not None:
            parts.append(f"reduce-scatter {str(self.reduce_scatter_dtype).removeprefix('torch.')}"
                         " on the wire, fp32 sums")
        return ", ".join(parts) or "none"


def as_comm_policy(comm_policy: Any) -> CommPolicy | None:
    """The ``comm_policy`` argument: ``None``, a :class:`CommPolicy`, or a dict of its fields
    (YAML: ``comm_policy: {all_gather: int8}``).

    Raises:
        TypeError, ValueError: another type, or a dict with unknown keys or bad values.
    """
    if comm_policy is None or isinstance(comm_policy, CommPolicy):
        return comm_policy
    if isinstance(comm_policy, Mapping):
        fields = {f.name for f in dataclasses.fields(CommPolicy)}
        unknown = sorted(set(comm_policy) - fields)
        if unknown:
            raise ValueError(f"comm_policy has unknown keys {unknown}; valid: {sorted(fields)}")
        return CommPolicy(**dict(comm_policy))
    raise TypeError(f"comm_policy must be a lightning_vescale.CommPolicy, a dict of its fields "
                    f"or None, got {type(comm_policy).__name__}")


def _default_rule(policy: CommPolicy, param: nn.Parameter) -> bool:
    return (param.is_floating_point() and param.dim() >= 2
            and param.numel() >= policy.min_numel)


def quantized_params(policy: CommPolicy | None,
                     named_params: Sequence[tuple[str, nn.Parameter]]) -> dict[str, bool]:
    """Which parameters of a group all-gather quantized (see [comm-policy]).

    Raises:
        ValueError: ``quantize`` names an unknown parameter, or asks for an integer one.
        TypeError: the callable returns something other than a bool.
    """
    if policy is None or policy.all_gather is None:
        return {n: False for n, _ in named_params}
    q = policy.quantize
    names = [n for n, _ in named_params]
    if isinstance(q, Mapping):
        unknown = sorted(set(q) - set(names))
        if unknown:
            raise ValueError(f"CommPolicy.quantize names {unknown}, which are not parameters "
                             f"of this fully_shard group; valid names: {names}")
    out = {}
    for name, p in named_params:
        if isinstance(q, Mapping) and name in q:
            want = q[name]
        elif callable(q) and not isinstance(q, Mapping):
            want = q(name, p)
            if not isinstance(want, bool):
                raise TypeError(f"CommPolicy.quantize returned {want!r} for {name!r}; it must "
                                "return True or False.")
        else:
            want = _default_rule(policy, p)
        if want and not p.is_floating_point():
            raise ValueError(
                f"CommPolicy(all_gather={policy.all_gather!r}) asks to quantize parameter "
                f"{name!r} of dtype {p.dtype}; only floating-point parameters can be quantized. "
                f"Leave it out of CommPolicy.quantize (or map it to False).")
        out[name] = want
    return out


def quantized_granularities(granularities: dict[str, int], quantized: dict[str, bool], *,
                            block_size: int, user_given: bool) -> dict[str, int]:
    """Granularities with every quantized tensor's a multiple of ``block_size`` (so blocks
    never straddle ranks): rounded up when the user gave none, else checked.

    Raises:
        ValueError: a granularity the user gave is not a multiple of ``block_size``.
    """
    out = dict(granularities)
    for name, g in granularities.items():
        if not quantized.get(name) or g % block_size == 0:
            continue
        if user_given:
            up = math.lcm(g, block_size)
            raise ValueError(
                f"fully_shard: parameter {name!r} has granularity {g} elements, which "
                f"CommPolicy's block_size={block_size} does not divide: its quantization blocks "
                f"would straddle ranks. Use a granularity that is a multiple of {block_size} "
                f"(e.g. {up}), a block_size dividing {g}, or CommPolicy(quantize={{{name!r}: "
                "False}).")
        out[name] = math.lcm(g, block_size)
    return out
