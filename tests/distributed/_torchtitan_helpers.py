"""torchtitan 0.3.0 on a CPU-only torch, for tests that run its own model and FSDP code.

``torchtitan.models`` imports ``torchtitan.distributed.minimal_async_ep.kernels`` (through
``models/common/token_dispatcher.py``), which imports ``triton`` at module level for its
GPU-only expert-parallel dispatch kernels. The CPU wheel of torch has no triton, so the import
fails. :func:`import_torchtitan_models` registers a stand-in for that one torchtitan module
(every kernel raises if called; nothing on CPU calls them) and then imports the models. A
stand-in ``triton`` package would be wrong: torch itself then believes triton is installed and
its inductor import breaks (measured: ``No module named 'triton.backends'``).

:func:`meta_init_flow` is torchtitan's trainer flow for a decoder (``trainer.py``: build on the
meta device, ``parallelize_fn`` -> here ``torchtitan.distributed.fsdp.apply_fsdp_to_decoder``,
``model.to_empty(device=...)``, ``model.init_weights(buffer_device=None)`` under ``no_grad``),
with the ``fully_shard`` that ``apply_fsdp_to_decoder`` calls swapped for the engine's.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Callable, Iterator

import torch

_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
_KERNEL_NAMES = (
    "copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel", "expand_topk_grad_kernel",
    "fill_combine_metadata_kernel", "fill_dispatch_metadata_kernel",
    "invert_flat_indices_kernel", "reduce_topk_slots_kernel", "topk_scores_grad_kernel",
)


def _gpu_only(*args, **kwargs):
    raise RuntimeError(f"{_KERNELS} needs triton and a GPU (a CPU test's stand-in)")


def import_torchtitan_models() -> types.ModuleType:
    """``torchtitan.models`` importable without triton (see the module docstring)."""
    try:
        import triton  # noqa: F401 - a machine with triton imports torchtitan as it is
    except ImportError:
        if _KERNELS not in sys.modules:
            stub = types.ModuleType(_KERNELS)
            stub.__doc__ = "CPU stand-in: torchtitan's triton kernels, never called on CPU"
            for name in _KERNEL_NAMES:
                setattr(stub, name, _gpu_only)
            sys.modules[_KERNELS] = stub
    import torchtitan.models

    return torchtitan.models


@contextlib.contextmanager
def fully_shard_of(engine: str) -> Iterator[None]:
    """``torchtitan.distributed.fsdp`` calling ``engine``'s ``fully_shard`` inside the block
    (``"vescale"``: ``lightning_vescale.fully_shard``; ``"fsdp2"``: torch's own)."""
    import torchtitan.distributed.fsdp as titan_fsdp

    if engine == "vescale":
        from lightning_vescale import fully_shard
    elif engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard
    else:
        raise ValueError(f"engine must be 'vescale' or 'fsdp2', got {engine!r}")
    saved = titan_fsdp.fully_shard
    titan_fsdp.fully_shard = fully_shard
    try:
        yield
    finally:
        titan_fsdp.fully_shard = saved


def llama3_debugmodel() -> torch.nn.Module:
    """torchtitan's Llama3 ``debugmodel`` (6 layers, dim 256, vocab 2048, fused QKV), on meta."""
    import_torchtitan_models()
    from torchtitan.models.llama3 import llama3_configs

    config = llama3_configs["debugmodel"](attn_backend="flex")
    with torch.device("meta"):
        return config.build()


def meta_init_flow(build: Callable[[], torch.nn.Module], engine: str | None, mesh, *,
                   seed: int, device: torch.device) -> torch.nn.Module:
    """torchtitan's meta-device flow; ``engine=None``: no sharding (the one-process model)."""
    model = build()
    if engine is not None:
        from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

        with fully_shard_of(engine):
            apply_fsdp_to_decoder(model, mesh, param_dtype=torch.float32,
                                  reduce_dtype=torch.float32, pp_enabled=False)
    model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model
