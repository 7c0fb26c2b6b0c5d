"""Layer 5: ``VeScaleFabricStrategy`` — ``Fabric(strategy="vescale_fsdp")``.

The Fabric face of the engine. What it shares with the Trainer strategy (validation,
properties, environment set-up, collectives, sharding) is design note [strategy-core]
(``_lightning/core.py``); how modules become sharding groups is design note [sharding-units]
(``_lightning/sharding.py``); the checkpoint formats are ``lightning_vescale.checkpoint``.
"""

from __future__ import annotations

import weakref
from contextlib import AbstractContextManager, ExitStack
from datetime import timedelta
from typing import Any, Callable, Literal, Optional, Union

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import _apply_filter, _BackwardSyncControl
from lightning.fabric.utilities.distributed import ReduceOp
from lightning.fabric.utilities.types import _PATH, _Stateful
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_vescale._lightning.activation_checkpointing import ActivationCheckpointingPolicy
from lightning_vescale._lightning.core import RegistryEntry, VeScaleStrategyCore
from lightning_vescale._lightning.device_mesh import DeviceMeshArg
from lightning_vescale._lightning.parallel_sizes import SizeArg
from lightning_vescale._lightning.sharding import (
    DEFAULT_MIN_BLOCK_NUMEL,
    DEFAULT_OPTIMIZER_BLOCK_SIZE,
    NoGradSync,
    check_optimizer_params,
    is_sharded,
    remap_optimizer_params,
    reshard_all,
)
from lightning_vescale import checkpoint as ckpt
from lightning_vescale.fsdp import CommPolicy
from lightning_vescale.precision import (
    VeScaleFabricPrecision,
    clip_grad_norm_,
    clip_grad_value_,
    to_vescale_precision,
)

__all__ = ["VeScaleFabricStrategy"]


class VeScaleFabricStrategy(VeScaleStrategyCore, ParallelStrategy):
    """veScale-FSDP for Lightning Fabric: ``Fabric(strategy="vescale_fsdp")``.

    Set up the model first (``model = fabric.setup_module(model)``), then create the optimizer from
    ``model.parameters()`` and call ``fabric.setup_optimizers(opt)``; ``fabric.setup(model, opt)``
    also works when the optimizer has no state yet (its parameters are re-pointed).

    Args:
        sharding_units: module classes or class names that become sharding groups
            (default: every child of every ``nn.ModuleList``, then the root).
            See design note [sharding-units].
        granularity: shard-bound granularity for ``fully_shard`` (elements, or ``"row"``,
            ``"<k>rows"``, ``"matrix"``: each stacked expert whole on one rank); must be a
            multiple of ``optimizer_block_size`` if both are given. Or a mapping of
            parameter-name patterns to forms, first match wins (``{"*.experts.*": "matrix"}``;
            design note [granularity-rules]).
        optimizer_block_size: block size of a block-wise optimizer (AdamW8bit: 256) that shard
            bounds of large tensors must align to; ``None`` disables the alignment.
        optimizer_min_block_numel: tensors smaller than this need no alignment (AdamW8bit's
            ``min_8bit_size``).
        reshard_after_forward: ``None`` (default, "auto": every group reshards after forward
            but the last one, whose backward comes first), ``True``, ``False`` or an ``int``;
            as ``VeScaleFSDPStrategy``'s (design note [fsdp-reshard-policy]).
        state_dict_type: ``"sharded"`` (a DCP directory, every rank writes its shard) or
            ``"full"`` (one file from rank 0, loadable without this package).
        pretrained_weights: a Hugging Face safetensors checkpoint (a ``.safetensors`` file or a
            ``save_pretrained`` directory) loaded into the module in ``setup_module``, right
            after sharding (create the optimizer afterwards); each rank reads only its own
            shards. Keys match after the prefix the module holds the HF model under. See design
            note [pretrained-weights].
        process_group_backend: defaults to the accelerator's (``gloo`` on CPU, ``nccl`` on CUDA).
        timeout: process-group timeout.
        device_mesh: ``None`` (default): shard every group over all ranks. ``(replicas,
            shard_size)`` (a list in YAML: ``device_mesh: [2, 8]``): HSDP, shard inside groups of
            ``shard_size`` consecutive ranks and all-reduce gradient shards across the
            ``replicas`` groups; ``(num_nodes, devices)`` shards inside each node. Or a 1-D/2-D
            ``DeviceMesh`` (dim 0 replicates, dim 1 shards), used as it is. The product must be
            the world size (``num_nodes * devices``), or with ``tensor_parallel_size`` the world
            size over it (HSDP + TP). See design note [strategy-mesh].
        flat_optimizer: wrap ``torch.optim.Adam``/``AdamW``/``SGD`` in
            :class:`~lightning_vescale.optim.FlatParamOptimizer` (default ``True``): the step runs
            on a few flat views of each group's shard instead of one tensor per parameter
            (bitwise the same result, per-parameter state dicts); other optimizers are left as
            they are. ``False`` steps them per tensor.
        sync_module_states: broadcast global rank 0's parameters and buffers to every rank
            before sharding (default ``True``, as DDP does), so unseeded ranks start from one
            model; meta-device (``empty_init=True``) tensors are materialised per shard and not
            synchronised. See design note [sync-module-states].
        comm_policy: :class:`~lightning_vescale.CommPolicy` or a dict of its fields (YAML:
            ``comm_policy: {all_gather: int8, reduce_scatter_dtype: bf16}``): int8/fp8
            block-quantized all-gather and the gradients' wire dtype, for every group
            (``block_size`` defaults to ``optimizer_block_size``; design note [comm-policy]).
        activation_checkpointing_policy: layers that recompute their forward in backward
            instead of keeping activations (Lightning's ``FSDPStrategy`` meaning): a set of
            module classes or class names (``{Block}``; ``[Block]`` in YAML), or a callable
            ``(module) -> bool``. Applied before sharding; parameter names do not change. See
            design note [activation-checkpointing].
        tensor_parallel_size: ``None`` (default): no tensor parallelism. An int or ``"auto"``
            (the devices of a node): FSDP + TP as Lightning's ``ModelParallelStrategy``; the
            strategy builds the 2-D mesh ``("data_parallel", "tensor_parallel")``
            (``fabric.strategy.device_mesh`` after ``fabric.launch()``): apply the TP plan
            (``parallelize_module(model, device_mesh["tensor_parallel"], plan)``) before
            ``fabric.setup_module(model)``, and the
            strategy shards on ``device_mesh["data_parallel"]`` (design note [fsdp-tp]). The
            sampler spans the data-parallel dim. With ``device_mesh=(replicas, shard_size)``:
            HSDP + TP, the 3-D mesh ``("dp_replicate", "dp_shard", "tensor_parallel")`` whose
            first two dims are also flattened into ``"data_parallel"``; the strategy shards on
            ``device_mesh["dp_replicate", "dp_shard"]``. See design note
            [strategy-tp-mesh].
        data_parallel_size: with ``tensor_parallel_size``, the data-parallel dim (default
            ``"auto"``: the world size divided by ``tensor_parallel_size``; with both
            ``"auto"``, ``num_nodes``). ``data_parallel_size * tensor_parallel_size`` must be the
            world size. An int here alone also turns TP on (``tensor_parallel_size="auto"``).
            With ``device_mesh=(replicas, shard_size)`` it is ``replicas * shard_size``.
    """

    _registry_entries = (RegistryEntry(
        name="vescale_fsdp", description="veScale-FSDP: RaggedShard fully sharded data parallel",
        init_kwargs={}),)

    def __init__(
        self,
        sharding_units: Optional[list[Union[str, type[Module]]]] = None,
        granularity: Optional[Union[int, str, dict[str, Optional[Union[int, str]]]]] = None,
        optimizer_block_size: Optional[int] = DEFAULT_OPTIMIZER_BLOCK_SIZE,
        optimizer_min_block_numel: int = DEFAULT_MIN_BLOCK_NUMEL,
        reshard_after_forward: Optional[Union[bool, int]] = None,
        state_dict_type: Literal["sharded", "full"] = "sharded",
        pretrained_weights: Optional[_PATH] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        device_mesh: DeviceMeshArg = None,
        flat_optimizer: bool = True,
        sync_module_states: bool = True,
        comm_policy: Optional[Union[CommPolicy, dict[str, Any]]] = None,
        activation_checkpointing_policy: ActivationCheckpointingPolicy = None,
        data_parallel_size: SizeArg = "auto",
        tensor_parallel_size: Optional[SizeArg] = None,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        precision: Optional[Precision] = None,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=None,
                         precision=precision)
        self._init_core(sharding_units=sharding_units, granularity=granularity,
                        optimizer_block_size=optimizer_block_size,
                        optimizer_min_block_numel=optimizer_min_block_numel,
                        reshard_after_forward=reshard_after_forward,
                        state_dict_type=state_dict_type,
                        pretrained_weights=pretrained_weights,
                        process_group_backend=process_group_backend, timeout=timeout,
                        device_mesh=device_mesh, flat_optimizer=flat_optimizer,
                        sync_module_states=sync_module_states, comm_policy=comm_policy,
                        data_parallel_size=data_parallel_size,
                        tensor_parallel_size=tensor_parallel_size)
        self._init_activation_checkpointing(activation_checkpointing_policy)
        self._backward_sync_control = _VeScaleBackwardSyncControl()
        self._set_up_modules: list[weakref.ref[Module]] = []

    # -- properties ------------------------------------------------------------------------------
    @property
    @override
    def precision(self) -> VeScaleFabricPrecision:
        plugin = self._precision
        return plugin if plugin is not None else VeScaleFabricPrecision("32-true")

    @precision.setter
    @override
    def precision(self, precision: Optional[Precision]) -> None:
        self._precision = to_vescale_precision(precision, fabric=True)

    @property
    def _vescale_precision(self) -> VeScaleFabricPrecision:
        return self.precision

    # -- environment -----------------------------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._check_device_mesh_world()  # in the main process, before any rank starts
        # On every rank, as Fabric's DDP: where the processes were started outside (torchrun, or
        # the ranks > 0 this launcher re-ran) it starts nothing but still gives each rank its
        # share of the CPUs (OMP_NUM_THREADS, torch.set_num_threads) before the function runs.
        self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes,
                                                   self.num_nodes)

    # -- model & optimizers ----------------------------------------------------------------------
    @override
    def setup_module_and_optimizers(self, module: Module, optimizers: list[Optimizer],
                                    scheduler: Any = None) -> tuple[Module, list[Optimizer], Any]:
        names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
        module = self.setup_module(module)
        for opt in optimizers:
            remap_optimizer_params(opt, names, module)
        return module, [self.setup_optimizer(o) for o in optimizers], scheduler

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        check_optimizer_params(optimizer, "Make sure to create the optimizer after setting up "
                               "the model (`model = fabric.setup_module(model)`, then the "
                               "optimizer from `model.parameters()`), or pass both to "
                               "`fabric.setup(model, optimizer)`.")
        self._inherit_block_size(optimizer)
        self._bind_param_names(optimizer, [m for m in (r() for r in self._set_up_modules)
                                           if m is not None])
        return super().setup_optimizer(self._flatten_optimizer(optimizer))

    @override
    def setup_module(self, module: Module) -> Module:
        module = self.precision.convert_module(module)
        self._shard(module)
        self._set_up_modules.append(weakref.ref(module))  # names for setup_optimizer
        return module

    @override
    def module_to_device(self, module: Module) -> None:
        pass  # sharding places every group on the root device, from the CPU source per rank

    @override
    def module_init_context(self, empty_init: Optional[bool] = None) -> AbstractContextManager:
        stack = ExitStack()
        stack.enter_context(torch.device("meta") if empty_init else self.root_device)
        stack.enter_context(self.precision.module_init_context())
        return stack

    @override
    def clip_gradients_norm(self, module: Module, optimizer: Optimizer,
                            max_norm: Union[float, int], norm_type: Union[float, int] = 2.0,
                            error_if_nonfinite: bool = True) -> Tensor:
        self.precision.unscale_gradients(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        return clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)

    @override
    def clip_gradients_value(self, module: Module, optimizer: Optimizer,
                             clip_val: Union[float, int]) -> None:
        self.precision.unscale_gradients(optimizer)
        clip_grad_value_([p for g in optimizer.param_groups for p in g["params"]], clip_val)

    # -- collectives -----------------------------------------------------------------------------
    @override
    def all_reduce(self, tensor: Tensor, group: Optional[Any] = None,
                   reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Tensor:
        return self._all_reduce(tensor, group, reduce_op)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._barrier("barrier")

    # -- checkpoints -----------------------------------------------------------------------------
    @override
    def save_checkpoint(self, path: _PATH, state: dict[str, Union[Module, Optimizer, Any]],
                        storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:
        self._refuse_storage_options(storage_options)
        full = self._state_dict_type == "full"
        if filter is not None and not full:
            raise NotImplementedError(  # Lightning's FSDPStrategy has the same rule
                f"{type(self).__name__} saves `filter`ed checkpoints only with "
                "state_dict_type='full': a filtered sharded checkpoint could not be loaded back. "
                "Use VeScaleFabricStrategy(state_dict_type='full') for filtered saves.")
        path = self._checkpoint_target(path)
        _, module = _find_module(state)
        for m in state.values():
            if isinstance(m, Module):
                reshard_all(m)
        tensors: dict[str, Any] = {}
        metadata: dict[str, Any] = {}
        for key, obj in state.items():
            if isinstance(obj, Module):
                tensors[key] = ckpt.model_state(obj, full=full)
            elif isinstance(obj, Optimizer):
                tensors[key] = ckpt.optimizer_state(module, obj, full=full)
            else:
                metadata[key] = obj.state_dict() if isinstance(obj, _Stateful) else obj
        if full:
            checkpoint: dict[str, Any] = {}
            for key, value in {**tensors, **metadata}.items():
                # Lightning's rule: filter[key](name, value) keeps an item of that key's dict
                _apply_filter(key, filter or {}, value, checkpoint)
            ckpt.save_full(path, checkpoint)
        else:
            ckpt.save_sharded(path, tensors, metadata)

    @override
    def load_checkpoint(self, path: _PATH, state: Optional[Union[Module, Optimizer,
                                                                 dict[str, Any]]] = None,
                        strict: bool = True, weights_only: Optional[bool] = None) -> dict[str, Any]:
        if not state:
            raise ValueError(
                f"{type(self).__name__}.load_checkpoint needs the objects to restore: "
                "load_checkpoint(path, state={'model': model, 'optimizer': optimizer, ...})."
            )
        path = self._checkpoint_source(path)
        if isinstance(state, Optimizer):
            raise NotImplementedError("Load an optimizer together with its model: "
                                      "state={'model': model, 'optimizer': optimizer}.")
        if isinstance(state, Module):
            state = {"model": state}
            only_module = True
        else:
            only_module = False
        module_key, module = _find_module(state)
        reshard_all(module)
        optimizers = {k: v for k, v in state.items() if isinstance(v, Optimizer)}
        # other (unsharded) modules: `save_checkpoint` writes their state dicts with the tensors
        others = {k: v for k, v in state.items() if isinstance(v, Module) and k != module_key}
        loaded = set()
        if ckpt.is_sharded_checkpoint(path):
            saved = ckpt.sharded_checkpoint_has(path, others)
            in_dcp = {k: m for k, m in others.items() if k in saved}
            metadata = ckpt.load_sharded(path, module, optimizers, strict=strict,
                                         model_key=module_key, weights_only=weights_only,
                                         modules=in_dcp)
            loaded.update(in_dcp)  # modules not in the DCP tensors may be in meta.pt (below)
        else:
            metadata = ckpt.read_full(path, weights_only=weights_only)
            if only_module and module_key not in metadata:  # a bare state dict file
                metadata = {module_key: metadata}
            ckpt.load_full(metadata, module, optimizers, path=path, model_key=module_key,
                           strict=strict)
        if only_module:
            return {}
        requested = [k for k in state
                     if k != module_key and k not in optimizers and k not in loaded]
        missing = [k for k in requested if k not in metadata]
        if strict and missing:
            raise KeyError(f"The requested state keys {missing} are not in the checkpoint; "
                           "pass strict=False to ignore them.")
        for key in requested:
            if key not in metadata:
                continue
            value = metadata.pop(key)
            if isinstance(state[key], Module):
                state[key].load_state_dict(value, strict=strict)
            elif isinstance(state[key], _Stateful):
                state[key].load_state_dict(value)
            else:
                state[key] = value
        return metadata


class _VeScaleBackwardSyncControl(_BackwardSyncControl):
    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        return NoGradSync(module, enabled)


def _find_module(state: dict[str, Any]) -> tuple[str, Module]:
    found = [(k, v) for k, v in state.items() if isinstance(v, Module) and is_sharded(v)]
    if not found:
        raise ValueError(
            "Could not find a model sharded by the vescale_fsdp strategy in `state`; pass it like "
            "state={'model': model, ...} after fabric.setup_module(model)."
        )
    if len(found) > 1:
        raise ValueError("Found several sharded models in `state`; save/load one model per "
                         "checkpoint (call save_checkpoint for each with its own path).")
    return found[0]
