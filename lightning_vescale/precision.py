"""Layer 5: ``VeScalePrecision`` — Lightning's precision flags mapped onto ``fully_shard``.

Design note [precision]
-----------------------
With a sharding engine, mixed precision is not an ``autocast`` affair alone: the engine keeps the
fp32 shards (the "master weights"), all-gathers them in ``param_dtype`` and reduce-scatters
gradients in ``reduce_dtype``. So a precision flag maps onto a
:class:`~lightning_vescale.fsdp.MixedPrecisionPolicy` that the strategy hands to ``fully_shard``.
These are the semantics of Lightning's own ``FSDPStrategy`` (its ``FSDPPrecision``:
``param_dtype = reduce_dtype = `` the flag's dtype, ``autocast`` on for the ``-mixed`` flags),
with ``autocast`` on the strategy's device instead of a hard-coded ``"cuda"``:

==============  ==============  ===============  ==================  ==============  ===========
flag            stored shards   compute          unsharded grads     reduce-scatter  shard grads
                (master)        (all-gather)     (backward)          (+ no-sync sum) (optimizer)
==============  ==============  ===============  ==================  ==============  ===========
``32-true``     fp32            fp32             fp32                fp32            fp32
``bf16-mixed``  fp32            bf16 params +    bf16                bf16            fp32
                                ``autocast``
``16-mixed``    fp32            fp16 params +    fp16 (scaled)       fp16            fp32
                                ``autocast``
``bf16-true``   bf16 (cast)     bf16             bf16                bf16            bf16
``16-true``     fp16 (cast)     fp16             fp16                fp16            fp16
==============  ==============  ===============  ==================  ==============  ===========

Unlike DDP's ``bf16-mixed`` (fp32 parameters under ``autocast``, fp32 all-reduce), the ops that
``autocast`` keeps in fp32 (norms, softmax, loss) see parameters rounded to bf16, and gradients are
produced and summed in bf16: the same model and data give slightly different losses from the
first step on (about 1e-4 relative after one step of the README demo; see README "Precision").
``VeScalePrecision(..., reduce_dtype=torch.float32)`` (or ``"float32"`` from YAML) reduces and
accumulates gradients in fp32 instead (FSDP2's usual recommendation; more accurate at large
worlds and with gradient accumulation). Buffers are never cast (FSDP2 has no ``buffer_dtype``).

``autocast`` runs on the strategy's device type (never hard-coded ``"cuda"``); it keeps numerically
sensitive ops (softmax, cross-entropy, norms) in fp32 on top of the bf16/fp16 parameters.

Gradients of sharded parameters are ``DTensor`` shards, so the generic tools are wrong or
unsupported on them: a norm computed per rank is a partial norm, a grad scaler's found-inf flag
differs between ranks (one rank skipping ``step`` while another steps desynchronises the model).
This module therefore owns the sharding-aware versions:

* :func:`clip_grad_norm_` sums ``|g|^p`` over each rank's *owned* elements, all-reduces once and
  scales every local shard by the same coefficient — the exact global norm of the full gradient.
  Replicated gradients (plain tensors / ``Replicate``) are counted once, not once per rank.
* :func:`clip_grad_value_` clamps local shards (element-wise, so it needs no communication).
* :class:`ShardedGradScaler` unscales local shards and all-reduces (MAX) the found-inf flag, so
  every rank takes the same skip/step decision and the same scale update.

Both the Trainer plugin (:class:`VeScalePrecision`) and the Fabric plugin
(:class:`VeScaleFabricPrecision`) share :class:`_VeScalePrecisionMixin`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Union

import torch
import torch.distributed as dist
from lightning.fabric.plugins import precision as _fabric_plugins
from lightning.fabric.plugins.precision.precision import Precision as FabricPrecision
from lightning.fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager
from lightning.pytorch.plugins import precision as _trainer_plugins
from lightning.pytorch.plugins.precision.precision import Precision
from lightning_utilities import apply_to_collection
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import get_args, override

from lightning_vescale.fsdp import MixedPrecisionPolicy
from lightning_vescale.mesh import all_reduce_anywhere

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = [
    "VeScalePrecision",
    "VeScaleFabricPrecision",
    "ShardedGradScaler",
    "as_sharded_scaler",
    "clip_grad_norm_",
    "clip_grad_value_",
    "PrecisionFlag",
]

PrecisionFlag = Literal["32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true"]
_SUPPORTED: tuple[str, ...] = get_args(PrecisionFlag)
_COMPUTE_DTYPES = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16,
                   "bf16-true": torch.bfloat16, "16-mixed": torch.float16,
                   "16-true": torch.float16}
#: "true" flags: the module is cast and the shards are stored in this dtype (no autocast)
_TRUE_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16}
_ALIASES = {"32": "32-true", 32: "32-true", "bf16": "bf16-mixed", "16": "16-mixed", 16: "16-mixed"}


# ------------------------------------------------------------------------------------------------
# Sharding-aware gradient utilities
# ------------------------------------------------------------------------------------------------
def _local_and_kind(grad: Tensor) -> tuple[Tensor, bool, Any]:
    """``(local tensor, is_sharded, process groups)`` of a (possibly DTensor) gradient.

    The groups are those the local pieces partition the tensor over: one per mesh dim that
    shards it. On an HSDP mesh ``(Replicate(), RaggedShard)`` that is the shard dim only;
    summing over the whole world would count every element once per replica (design note
    [hsdp]). With tensor parallelism ``(RaggedShard, Shard(k))`` both dims' groups, in mesh
    order (design note [fsdp-tp]); a plain tensor: ``()``.
    """
    if isinstance(grad, DTensor):
        mesh = grad.device_mesh
        dims = [d for d, p in enumerate(grad.placements) if not isinstance(p, Replicate)]
        return grad.to_local(), bool(dims), tuple(mesh.get_group(d) for d in dims)
    return grad, False, ()


def _grads(parameters: Union[Tensor, Iterable[Tensor]]) -> list[Tensor]:
    if isinstance(parameters, Tensor):
        parameters = [parameters]
    return [p.grad for p in parameters if p.grad is not None]


@torch.no_grad()
def clip_grad_norm_(
    parameters: Union[Tensor, Iterable[Tensor]],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> Tensor:
    """Clip gradients by their *global* norm, correct for sharded (``DTensor``) gradients.

    Same contract as :func:`torch.nn.utils.clip_grad_norm_`: returns the total norm (before
    clipping) as a 0-dim fp32 tensor, identical on every rank, and scales all gradients in place by
    ``min(1, max_norm / (total + 1e-6))``. Sharded gradients contribute their owned elements on
    each rank (one all-reduce over their group); replicated ones are counted once.
    """
    max_norm, norm_type = float(max_norm), float(norm_type)
    grads = _grads(parameters)
    locals_: list[Tensor] = []
    device = None
    # one accumulator per tuple of groups the elements are spread over (FSDP: the shard
    # group; FSDP + TP: (dp, tp) for TP-sharded, dp for the others: design note [fsdp-tp])
    sharded: dict[tuple[int, ...], tuple[tuple[Any, ...], Tensor]] = {}
    replicated_acc = None
    inf = math.isinf(norm_type)

    def add(acc: Tensor | None, part: Tensor) -> Tensor:
        return part if acc is None else (torch.maximum(acc, part) if inf else acc + part)

    for g in grads:
        local, is_sharded, g_groups = _local_and_kind(g)
        locals_.append(local)
        device = device or local.device
        if local.numel() == 0:
            part = torch.zeros((), dtype=torch.float32, device=local.device)
        elif inf:
            part = local.detach().abs().max().float()
        else:
            part = local.detach().float().abs().pow(norm_type).sum()
        if is_sharded:
            key = tuple(id(x) for x in g_groups)
            prev = sharded.get(key)
            sharded[key] = (g_groups, add(None if prev is None else prev[1], part))
        else:
            replicated_acc = add(replicated_acc, part)
    if device is None:
        return torch.zeros(())
    zero = torch.zeros((), dtype=torch.float32, device=device)
    sharded_acc = zero
    if not sharded:  # every rank runs the collective of the usual (sharded) path
        sharded[()] = ((None,), zero)
    for g_groups, acc in sharded.values():
        if dist.is_available() and dist.is_initialized():
            for group in g_groups:
                # offloaded (CPU) gradients on an NCCL group: through the device and back
                all_reduce_anywhere(acc, op=dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM,
                                    group=group)
        sharded_acc = add(sharded_acc, acc)
    replicated_acc = zero if replicated_acc is None else replicated_acc
    if inf:
        total = torch.maximum(sharded_acc, replicated_acc)
    else:
        total = (sharded_acc + replicated_acc).pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients is non-finite, so it cannot be "
            "clipped. Set `error_if_nonfinite=False` to skip this check."
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for local in locals_:
        local.mul_(coef.to(device=local.device, dtype=local.dtype))
    return total


@torch.no_grad()
def clip_grad_value_(parameters: Union[Tensor, Iterable[Tensor]], clip_value: float) -> None:
    """Clamp every gradient element to ``[-clip_value, clip_value]`` (local shards, no comms)."""
    clip_value = float(clip_value)
    for g in _grads(parameters):
        local, _, _ = _local_and_kind(g)
        local.clamp_(min=-clip_value, max=clip_value)


class ShardedGradScaler(torch.amp.GradScaler):
    """A ``GradScaler`` for sharded gradients: unscales local shards, agrees on found-inf.

    Every rank only sees its own gradient shard, so an overflow may be visible on one rank only.
    The found-inf flag is all-reduced with MAX over the default process group (the data-parallel
    world of ``fully_shard``), so all ranks skip or take the step together and update the scale
    identically. ``device=None``: the current accelerator's type (the CPU without one).
    """

    def __init__(self, device: Optional[str] = None, init_scale: float = 2.0**16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True,
                 process_group: Any = None) -> None:
        super().__init__(device or _default_device_type(), init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         enabled=enabled)
        self.process_group = process_group

    @override
    def _unscale_grads_(self, optimizer: Optimizer, inv_scale: Tensor, found_inf: Tensor,
                        allow_fp16: bool) -> dict[torch.device, Tensor]:
        per_device: dict[torch.device, dict[torch.dtype, list[Tensor]]] = defaultdict(
            lambda: defaultdict(list))
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    if not allow_fp16 and param.grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    local, _, _ = _local_and_kind(param.grad)
                    per_device[local.device][local.dtype].append(local)
            found: dict[torch.device, Tensor] = {}
            for device, per_dtype in per_device.items():
                f = found_inf.to(device)
                s = inv_scale.to(device)
                for grads in per_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, f, s)
                found[device] = f
            if not found:  # this rank holds no gradient at all: still take part in the agreement
                found[found_inf.device] = found_inf
        if dist.is_available() and dist.is_initialized():
            for f in found.values():  # a CPU (offloaded) flag on NCCL: via the device and back
                all_reduce_anywhere(f, op=dist.ReduceOp.MAX, group=self.process_group)
        return found


def as_sharded_scaler(scaler: Any, device_type: str) -> Optional[ShardedGradScaler]:
    """``scaler`` as a :class:`ShardedGradScaler` on ``device_type``, with every setting kept.

    A plain ``torch.amp.GradScaler`` (e.g. one passed to Lightning's ``MixedPrecision`` plugin)
    would let ranks disagree on found-inf; it is replaced by a sharded one that carries its
    scale, growth/backoff factors, growth interval, growth tracker and ``enabled`` flag (its
    ``state_dict``), so a user's ``init_scale=1024, growth_interval=100`` is never dropped.
    """
    if scaler is None:
        return None
    if not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(f"scaler must be a torch.amp.GradScaler (or a ShardedGradScaler), got "
                        f"{type(scaler).__name__}")
    if isinstance(scaler, ShardedGradScaler) and scaler._device == device_type:
        return scaler
    out = ShardedGradScaler(device_type, enabled=scaler.is_enabled(),
                            process_group=getattr(scaler, "process_group", None))
    if scaler.is_enabled():
        # state_dict() works before the first step too (the scale is then init_scale)
        out.load_state_dict(scaler.state_dict())
    return out


# ------------------------------------------------------------------------------------------------
# Precision plugins
# ------------------------------------------------------------------------------------------------
class _VeScalePrecisionMixin:
    """The flag -> (policy, dtypes, contexts) mapping shared by the Trainer and Fabric plugins."""

    precision: str
    scaler: Optional[ShardedGradScaler]
    _device_type: Optional[str]
    _mixed_precision_policy: Optional[MixedPrecisionPolicy]
    reduce_dtype: Optional[torch.dtype]

    def _init_precision(self, precision: Any, scaler: Optional[ShardedGradScaler],
                        device: Optional[str], reduce_dtype: Any = None) -> None:
        precision = _ALIASES.get(precision, precision)
        if precision not in _SUPPORTED:
            raise ValueError(
                f"{type(self).__name__}(precision={precision!r}) is not supported; choose one of "
                f"{', '.join(repr(p) for p in _SUPPORTED)} (e.g. precision='bf16-mixed')."
            )
        if scaler is not None and precision != "16-mixed":
            raise ValueError(
                f"precision={precision!r} does not use a grad scaler, found scaler={scaler!r}; "
                "pass a scaler only with precision='16-mixed'."
            )
        self.precision = precision
        self._device_type = device
        self.reduce_dtype = _as_reduce_dtype(reduce_dtype, precision)
        self._mixed_precision_policy = _policy_for(precision, self.reduce_dtype)
        if precision == "16-mixed" and scaler is None:
            scaler = ShardedGradScaler(device or _default_device_type())
        self.scaler = (as_sharded_scaler(scaler, device or scaler._device)
                       if scaler is not None else None)

    def _set_device_type(self, device_type: str) -> None:
        """Called by the strategy once the root device is known (autocast + scaler device)."""
        self._device_type = device_type
        # the scaler may have been made before the device was known: move it, settings kept
        self.scaler = as_sharded_scaler(self.scaler, device_type)

    # -- dtypes ----------------------------------------------------------------------------------
    @property
    def param_dtype(self) -> torch.dtype:
        """dtype of the stored (sharded) parameters."""
        return _TRUE_DTYPES.get(self.precision, torch.float32)

    @property
    def compute_dtype(self) -> torch.dtype:
        return _COMPUTE_DTYPES[self.precision]

    @property
    def mixed_precision_policy(self) -> Optional[MixedPrecisionPolicy]:
        """The ``MixedPrecisionPolicy`` the strategy hands to ``fully_shard`` (``None`` = no
        casting); built once, from the flag (table of design note [precision])."""
        return self._mixed_precision_policy

    # -- module / tensors ------------------------------------------------------------------------
    def convert_module(self, module: Module) -> Module:
        if self.precision in _TRUE_DTYPES:
            return module.to(dtype=_TRUE_DTYPES[self.precision])
        return module

    def tensor_init_context(self) -> AbstractContextManager:
        return _DtypeContextManager(self.param_dtype)

    def module_init_context(self) -> AbstractContextManager:
        return _DtypeContextManager(self.param_dtype)

    def forward_context(self) -> AbstractContextManager:
        if self.precision in ("bf16-mixed", "16-mixed"):
            device_type = self._device_type or _default_device_type()
            return torch.autocast(device_type, dtype=self.compute_dtype, cache_enabled=False)
        if self.precision in _TRUE_DTYPES:
            return _DtypeContextManager(_TRUE_DTYPES[self.precision])
        return nullcontext()

    def convert_input(self, data: Any) -> Any:
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor,
                                   dst_type=self.param_dtype)

    def convert_output(self, data: Any) -> Any:
        return apply_to_collection(data, function=_convert_fp_tensor, dtype=Tensor,
                                   dst_type=torch.get_default_dtype())

    # -- clipping --------------------------------------------------------------------------------
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        clip_grad_norm_(self.main_params(optimizer), clip_val)  # type: ignore[attr-defined]

    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        clip_grad_value_(self.main_params(optimizer), clip_val)  # type: ignore[attr-defined]

    # -- scaler state ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scaler is not None and state_dict:
            self.scaler.load_state_dict(state_dict)

    def __repr__(self) -> str:
        extra = f", reduce_dtype={self.reduce_dtype}" if self.reduce_dtype is not None else ""
        return f"{type(self).__name__}(precision={self.precision!r}{extra})"


def _policy_for(precision: str,
                reduce_dtype: Optional[torch.dtype] = None) -> Optional[MixedPrecisionPolicy]:
    """The one place a flag becomes a policy (table of design note [precision]): all-gather and
    reduce-scatter in the flag's dtype, as Lightning's ``FSDPPrecision``; ``reduce_dtype``
    overrides the reduction's."""
    if precision not in ("bf16-mixed", "16-mixed"):
        return None
    dtype = _COMPUTE_DTYPES[precision]
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype or dtype)


_DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def _as_reduce_dtype(value: Any, precision: str) -> Optional[torch.dtype]:
    """``reduce_dtype`` as a ``torch.dtype`` (a dtype, a name such as ``"float32"`` from YAML, or
    ``None``: the flag's own dtype)."""
    if value is None:
        return None
    if precision not in ("bf16-mixed", "16-mixed"):
        raise ValueError(
            f"reduce_dtype={value!r} needs a mixed precision flag, got precision={precision!r}; "
            "use precision='bf16-mixed' or '16-mixed', or leave reduce_dtype=None.")
    if isinstance(value, torch.dtype) and value.is_floating_point:
        return value
    if isinstance(value, str):
        name = value.removeprefix("torch.")
        if name in _DTYPE_NAMES:
            return _DTYPE_NAMES[name]
    raise ValueError(
        f"reduce_dtype={value!r} (precision={precision!r}) is not a floating-point dtype; pass "
        f"torch.float32 / torch.bfloat16 / torch.float16, one of {sorted(_DTYPE_NAMES)}, or None "
        "for the precision flag's own dtype.")


def _default_device_type() -> str:
    """The device type until the strategy sets its own (``_set_device_type``): the current
    accelerator's (``torch.accelerator``), or the CPU on a machine without one."""
    acc = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return acc.type if acc is not None else "cpu"


def _device_type(device: Any) -> Optional[str]:
    """The device type of a plugin's ``device`` (``"cuda"``, ``"cuda:1"``, a ``torch.device``,
    ...); ``None`` when it names none (the strategy sets the type from its root device)."""
    if isinstance(device, (str, torch.device)):
        try:
            return torch.device(device).type
        except (RuntimeError, ValueError):
            return None
    return None


#: Lightning's plugins built from a ``precision=`` flag, Trainer's and Fabric's: the base class
#: (``"32-true"``; exact type, as its subclasses are other precisions) and the ones that carry a
#: supported flag.
_PLAIN_PLUGINS = (_trainer_plugins.Precision, _fabric_plugins.Precision)
_FLAG_PLUGINS = (_trainer_plugins.MixedPrecision, _trainer_plugins.HalfPrecision,
                 _trainer_plugins.FSDPPrecision, _fabric_plugins.MixedPrecision,
                 _fabric_plugins.HalfPrecision, _fabric_plugins.FSDPPrecision)


class VeScalePrecision(_VeScalePrecisionMixin, Precision):
    """Precision plugin for :class:`~lightning_vescale.strategy.VeScaleFSDPStrategy` (Trainer).

    Args:
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"``, ``"16-mixed"`` or
            ``"16-true"``. See design note [precision] in this module for what each means for
            the sharded engine.
        scaler: only with ``"16-mixed"``: a :class:`ShardedGradScaler`, or any
            ``torch.amp.GradScaler`` whose settings are carried into one; one is created otherwise.
        device: device type for ``autocast``/the scaler; the strategy sets it from its root device.
        reduce_dtype: dtype of the gradient reduce-scatter and of gradient accumulation without
            sync (``None``: the flag's dtype, as Lightning's ``FSDPPrecision``; e.g.
            ``torch.float32`` or ``"float32"`` for fp32 reductions under ``"bf16-mixed"``).
    """

    def __init__(self, precision: PrecisionFlag = "32-true",
                 scaler: Optional[ShardedGradScaler] = None, device: Optional[str] = None,
                 reduce_dtype: Union[torch.dtype, str, None] = None) -> None:
        self._init_precision(precision, scaler, device, reduce_dtype)

    @override
    def pre_backward(self, tensor: Tensor,  # type: ignore[override]
                     module: "pl.LightningModule") -> Tensor:
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return super().pre_backward(tensor, module)

    @override
    def optimizer_step(  # type: ignore[override]
        self, optimizer: Any, model: "pl.LightningModule", closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        skip_unscaling = closure_result is None and model.automatic_optimization
        if not skip_unscaling:
            # unscale before clipping (`_after_closure` runs on_before_optimizer_step + clipping)
            self.scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        if not skip_unscaling:
            out = self.scaler.step(optimizer, **kwargs)  # skipped on every rank if any found inf
            self.scaler.update()
            return out
        return closure_result


class VeScaleFabricPrecision(_VeScalePrecisionMixin, FabricPrecision):
    """The same mapping for Lightning Fabric (``VeScaleFabricStrategy``); same arguments as
    :class:`VeScalePrecision`."""

    def __init__(self, precision: PrecisionFlag = "32-true",
                 scaler: Optional[ShardedGradScaler] = None, device: Optional[str] = None,
                 reduce_dtype: Union[torch.dtype, str, None] = None) -> None:
        self._init_precision(precision, scaler, device, reduce_dtype)

    @override
    def pre_backward(self, tensor: Tensor, module: Optional[Module]) -> Any:
        if self.scaler is not None:
            tensor = self.scaler.scale(tensor)
        return tensor

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if self.scaler is None:
            return optimizer.step(**kwargs)
        out = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return out

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)


def to_vescale_precision(plugin: Any, *, fabric: bool = False) -> Any:
    """Convert a Lightning precision plugin chosen from a ``precision=`` string into ours.

    Lightning builds ``Precision()`` / ``MixedPrecision`` / ``HalfPrecision`` from the flag
    before it knows our strategy; the strategy's ``precision_plugin`` setter calls this.
    Unsupported flags (``"64-true"``, transformer-engine, bitsandbytes, ...) raise a
    ``ValueError``.
    """
    target = VeScaleFabricPrecision if fabric else VeScalePrecision
    if plugin is None or isinstance(plugin, target):
        return plugin
    if isinstance(plugin, _VeScalePrecisionMixin):  # the sibling class (Fabric <-> Trainer)
        return target(plugin.precision, scaler=plugin.scaler, device=plugin._device_type,
                      reduce_dtype=plugin.reduce_dtype)
    flag = getattr(plugin, "precision", None)
    flag = _ALIASES.get(flag, flag)
    if type(plugin) in _PLAIN_PLUGINS and flag in (None, "32-true"):
        return target("32-true")
    if isinstance(plugin, _FLAG_PLUGINS) and flag in _SUPPORTED:
        # MixedPrecision's device is the accelerator's (Lightning's connector sets it); the
        # strategy sets its root device's type at setup either way
        device = _device_type(getattr(plugin, "device", None))
        # Lightning's MixedPrecision holds the user's GradScaler: carry its settings over
        scaler = getattr(plugin, "scaler", None) if flag == "16-mixed" else None
        return target(flag, scaler=scaler, device=device)
    raise ValueError(
        f"The vescale_fsdp strategy cannot use the precision plugin {type(plugin).__name__}"
        f"(precision={flag!r}). Use precision= one of {', '.join(repr(p) for p in _SUPPORTED)}, "
        f"or pass `{target.__name__}(...)` explicitly."
    )
