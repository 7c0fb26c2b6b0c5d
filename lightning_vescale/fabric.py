"""Layer 5: ``VeScaleFabricStrategy`` — ``Fabric(strategy="vescale_fsdp")``.

How modules become sharding groups (design note [sharding-units]) and the helpers this strategy
shares with the Trainer strategy live in ``_sharding.py``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Union

import torch
from lightning.fabric.accelerators import Accelerator
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher,
)
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import TBroadcast, _BackwardSyncControl
from lightning.fabric.utilities.distributed import (
    ReduceOp,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH, _Stateful
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_vescale import _checkpoint as ckpt
from lightning_vescale._sharding import (
    DEFAULT_MIN_BLOCK_NUMEL,
    DEFAULT_OPTIMIZER_BLOCK_SIZE,
    _has_meta,
    _NoGradSync,
    barrier,
    broadcast,
    connect,
    is_sharded,
    make_granularity,
    remap_optimizer_params,
    reshard_all,
    set_world_ranks,
    shard_model,
    validate_sharding_args,
    validate_state_dict_type,
    validate_timeout,
)
from lightning_vescale.precision import (
    VeScaleFabricPrecision,
    clip_grad_norm_,
    clip_grad_value_,
    to_vescale_precision,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["VeScaleFabricStrategy"]


# ------------------------------------------------------------------------------------------------
# Fabric strategy
# ------------------------------------------------------------------------------------------------
class VeScaleFabricStrategy(ParallelStrategy):
    """veScale-FSDP for Lightning Fabric: ``Fabric(strategy="vescale_fsdp")``.

    Set up the model first (``model = fabric.setup_module(model)``), then create the optimizer from
    ``model.parameters()`` and call ``fabric.setup_optimizers(opt)``; ``fabric.setup(model, opt)``
    also works when the optimizer has no state yet (its parameters are re-pointed).

    Args:
        sharding_units: module classes or class names that become sharding groups
            (default: every child of every ``nn.ModuleList``, then the root).
            See design note [sharding-units].
        granularity: shard-bound granularity for ``fully_shard`` (elements, or ``"row"``,
            ``"<k>rows"``); must be a multiple of ``optimizer_block_size`` if both are given.
        optimizer_block_size: block size of a block-wise optimizer (AdamW8bit: 256) that shard
            bounds of large tensors must align to; ``None`` disables the alignment.
        optimizer_min_block_numel: tensors smaller than this need no alignment (AdamW8bit's
            ``min_8bit_size``).
        reshard_after_forward: free unsharded parameters after each group's forward.
        state_dict_type: ``"sharded"`` (a DCP directory, every rank writes its shard) or
            ``"full"`` (one file from rank 0, loadable without this package).
        process_group_backend: defaults to the accelerator's (``gloo`` on CPU, ``nccl`` on CUDA).
        timeout: process-group timeout.
    """

    def __init__(
        self,
        sharding_units: Optional[list[Union[str, type[Module]]]] = None,
        granularity: Optional[Union[int, str]] = None,
        optimizer_block_size: Optional[int] = DEFAULT_OPTIMIZER_BLOCK_SIZE,
        optimizer_min_block_numel: int = DEFAULT_MIN_BLOCK_NUMEL,
        reshard_after_forward: bool = True,
        state_dict_type: Literal["sharded", "full"] = "sharded",
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        accelerator: Optional[Accelerator] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        precision: Optional[Precision] = None,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=None,
                         precision=precision)
        self._sharding_units = validate_sharding_args(
            sharding_units, granularity, optimizer_block_size, optimizer_min_block_numel)
        self._granularity = granularity
        self._optimizer_block_size = optimizer_block_size
        self._optimizer_min_block_numel = optimizer_min_block_numel
        self._reshard_after_forward = reshard_after_forward
        self._state_dict_type = validate_state_dict_type(state_dict_type)
        self._process_group_backend = process_group_backend
        self._timeout = validate_timeout(timeout)
        self._num_nodes = 1
        self._device_mesh: Optional[DeviceMesh] = None
        self._backward_sync_control = _VeScaleBackwardSyncControl()

    # -- properties ------------------------------------------------------------------------------
    @property
    def device_mesh(self) -> "DeviceMesh":
        if self._device_mesh is None:
            raise RuntimeError("The device mesh exists only after the processes are initialised.")
        return self._device_mesh

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        raise NotImplementedError(f"{type(self).__name__} does not use a CheckpointIO plugin.")

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: Optional[CheckpointIO]) -> None:
        if io is not None:
            raise NotImplementedError(
                f"{type(self).__name__} does not support a CheckpointIO plugin.")

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
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    # -- environment -----------------------------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes,
                                                       self.num_nodes)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self._set_world_ranks()
        assert self.cluster_environment is not None
        self._process_group_backend, self._device_mesh = connect(
            self.cluster_environment, self._process_group_backend, self.root_device,
            self.world_size, self._timeout)
        self.precision._set_device_type(self.root_device.type)

    def _set_world_ranks(self) -> None:
        set_world_ranks(self)

    # -- model & optimizers ----------------------------------------------------------------------
    def _granularity_fn(self) -> Optional[Callable[[str, Tensor], Any]]:
        return make_granularity(self._granularity, self._optimizer_block_size,
                                self._optimizer_min_block_numel)

    @override
    def setup_module_and_optimizers(self, module: Module, optimizers: list[Optimizer],
                                    scheduler: Any = None) -> tuple[Module, list[Optimizer], Any]:
        names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
        module = self.setup_module(module)
        for opt in optimizers:
            remap_optimizer_params(opt, names, module)
        return module, [self.setup_optimizer(o) for o in optimizers], scheduler

    @override
    def setup_module(self, module: Module) -> Module:
        module = self.precision.convert_module(module)
        shard_model(module, units=self._sharding_units, mesh=self.device_mesh,
                    device=self.root_device, mp_policy=self.precision.mixed_precision_policy,
                    granularity=self._granularity_fn(),
                    reshard_after_forward=self._reshard_after_forward)
        return module

    @override
    def module_to_device(self, module: Module) -> None:
        if not _has_meta(module) and not is_sharded(module):
            module.to(self.root_device)

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
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        barrier(self.root_device)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        return broadcast(obj, src)

    # -- checkpoints -----------------------------------------------------------------------------
    @override
    def save_checkpoint(self, path: _PATH, state: dict[str, Union[Module, Optimizer, Any]],
                        storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(storage_options=...) is not "
                            "supported: the strategy writes checkpoints itself.")
        if filter is not None:
            raise NotImplementedError(f"{type(self).__name__} does not support `filter`.")
        path = Path(self.broadcast(path))
        module_key, module = _find_module(state)
        full = self._state_dict_type == "full"
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
            ckpt.save_full(path, {**tensors, **metadata})
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
        path = ckpt.check_checkpoint_path(Path(self.broadcast(path)))
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
            metadata = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
            if only_module and module_key not in metadata:  # a bare state dict file
                metadata = {module_key: metadata}
            ckpt.load_full_model_state(metadata.pop(module_key), module, strict=strict)
            for key, opt in optimizers.items():
                if key not in metadata:
                    if strict:
                        raise ckpt.missing_optimizer_error(key, [
                            k for k, v in metadata.items() if isinstance(v, dict)
                            and "param_groups" in v])
                    continue
                ckpt.load_full_optimizer_state(metadata.pop(key), module, opt)
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

    # -- registration ----------------------------------------------------------------------------
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if not torch.distributed.is_available():
            return
        if "vescale_fsdp" not in strategy_registry:
            strategy_registry.register(
                "vescale_fsdp", cls,
                description="veScale-FSDP: RaggedShard fully sharded data parallel",
            )


class _VeScaleBackwardSyncControl(_BackwardSyncControl):
    @override
    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        return _NoGradSync(module, enabled)


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
