"""FSDP2's tensor-subclass all-gather extension: refused, naming the parameter.

Design note [fsdp-all-gather-extension]
---------------------------------------
FSDP2 lets a parameter's tensor (a subclass such as torchao's float8 training tensors, or any
tensor with the methods set on it) decide what its all-gather sends: ``fsdp_pre_all_gather``
returns the tensors to gather (e.g. float8 data and a scale) and ``fsdp_post_all_gather``
builds the compute tensor from the gathered ones. This engine's all-gather moves each group's
DBuffer, one flat shard per dtype whose rank ranges are RaggedShard ranges of many parameters
(design note [fsdp-buffer-order]): there is no per-parameter ``Shard(0)`` tensor to hand to the
pre-hook and no per-parameter output to give the post-hook, and copying such a parameter into
the buffer keeps only its values (the subclass is gone). Running the hooks would need a
per-parameter gather path beside the buffer; until then a parameter that defines them is
refused, at ``fully_shard`` (its class or the tensor itself has ``fsdp_pre_all_gather``) and at
lazy init (the methods were set on a sharded parameter's local tensor after ``fully_shard``,
FSDP2's monkey-patch recipe), instead of being silently all-gathered in full precision. The
message names the parameter and points at ``CommPolicy(all_gather="fp8"|"int8")``, this
engine's quantized all-gather, or at keeping such a module under torch's own ``fully_shard``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HOOKS", "check_group_for_all_gather_extension", "check_no_all_gather_extension"]

#: FSDP2's extension methods (``torch.distributed.fsdp._fully_shard._fsdp_param``)
HOOKS = ("fsdp_pre_all_gather", "fsdp_post_all_gather")


def _hooks_of(tensor: Any) -> list[str]:
    return [h for h in HOOKS if hasattr(tensor, h)]


def check_no_all_gather_extension(name: str, *tensors: Any) -> None:
    """Raise if any of ``tensors`` (a parameter, its local tensor) defines FSDP2's all-gather
    extension (design note [fsdp-all-gather-extension]).

    Raises:
        ValueError: naming the parameter ``name``, the tensor's class and the methods found.
    """
    for t in tensors:
        found = _hooks_of(t)
        if found:
            raise ValueError(
                f"parameter {name!r} ({type(t).__name__}) defines {' / '.join(found)}, FSDP2's "
                "tensor-subclass all-gather extension (what torchao's float8 all-gather uses), "
                "which lightning_vescale's fully_shard does not run: its all-gather moves flat "
                "DBuffers, so the hooks would be silently skipped and the parameter gathered in "
                "full precision. Use a plain tensor and CommPolicy(all_gather='fp8' or 'int8') "
                "for a quantized all-gather (e.g. torchao: convert_to_float8_training with "
                "enable_fsdp_float8_all_gather=False), or shard that module with torch's "
                "fully_shard.")


def check_group_for_all_gather_extension(group: Any) -> None:
    """At lazy init: the extension set on a sharded parameter or its local tensor after
    ``fully_shard`` (FSDP2's monkey-patch recipe) is refused as at ``fully_shard``."""
    for mp in group.params:
        p = mp.sharded
        if p is not None:
            check_no_all_gather_extension(group.param_fqn(mp), p,
                                          getattr(p, "_local_tensor", None))
