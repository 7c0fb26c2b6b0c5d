"""Layer 5: ``VeScaleFabricStrategy`` (Lightning Fabric) and the sharding helpers both faces share.

Design note [sharding-units]
----------------------------
Which modules become ``fully_shard`` groups is the one modelling decision a user makes. The
default fits transformer-style models without configuration: every child of every
``nn.ModuleList`` (the blocks) is a group, then the root takes whatever is left (embeddings,
final norm, head). ``sharding_units`` overrides it with module classes or class names (plain
strings keep LightningCLI/YAML configs simple: ``sharding_units: [Block]``; a dotted
``"package.module.Block"`` matches the fully qualified name). Groups are applied in post-order
(children before parents), so nested units work. A model the user already sharded (``fully_shard``
called in ``configure_model`` or before ``setup_module``) is respected: nothing is wrapped twice,
only a root is added when one is missing.

Granularity (shard bounds). Block-wise optimizers (``AdamW8bit``: blocks of 256 elements for
tensors with at least 4096 elements) need every rank's range to start on a block boundary.
The optimizer is created *after* sharding, so the strategy must make bounds block-aligned in
advance: ``optimizer_block_size`` (default 256) becomes the granularity of every parameter with
at least ``optimizer_min_block_numel`` elements (default 4096, the 8-bit threshold); smaller
tensors keep element granularity (less padding). An explicit ``granularity`` must be a multiple
of the block size; ``optimizer_block_size=None`` turns the alignment off.

Meta-device models (``init_module(empty_init=True)``, ``configure_model`` under the meta device)
are sharded on meta (no memory) and then materialised by ``lightning_vescale.fsdp.materialize``:
DBuffers on the device, ``reset_parameters()`` of every submodule on full temporaries, each rank
keeps its own ranges. The result equals non-meta initialisation with the same seed.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
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
from lightning.fabric.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import TBroadcast, _BackwardSyncControl
from lightning.fabric.utilities.distributed import (
    ReduceOp,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH, _Stateful
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

import lightning_vescale._ragged_ops  # noqa: F401  (torch ops/optimizers on RaggedShard DTensors)
from lightning_vescale import _checkpoint as ckpt
from lightning_vescale.precision import (
    VeScaleFabricPrecision,
    clip_grad_norm_,
    clip_grad_value_,
    to_vescale_precision,
)

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["VeScaleFabricStrategy"]

#: The default ``optimizer_block_size``: AdamW8bit's (and bitsandbytes') quantization block.
DEFAULT_OPTIMIZER_BLOCK_SIZE = 256
#: Tensors below this many elements keep fp32 optimizer states in AdamW8bit: no alignment needed.
DEFAULT_MIN_BLOCK_NUMEL = 4096


# ------------------------------------------------------------------------------------------------
# Engine adapter (layer 3): the only place that touches lightning_vescale.fsdp internals.
# ------------------------------------------------------------------------------------------------
def _fsdp() -> Any:
    import lightning_vescale.fsdp as fsdp

    return fsdp


def _states(module: Module) -> list[Any]:
    return _fsdp()._state.states_in(module)


def _state_of(module: Module) -> Any:
    return _fsdp().get_state(module)


def is_sharded(module: Module) -> bool:
    """True if ``fully_shard`` was applied to ``module`` or any submodule."""
    return bool(_states(module))


def set_gradient_sync(module: Module, enabled: bool) -> None:
    """Turn reduce-scatter after backward on/off for every group under ``module``."""
    fsdp = _fsdp()
    for m in module.modules():
        if isinstance(m, fsdp.VeScaleFSDPModule):
            m.set_requires_gradient_sync(enabled, recurse=False)


def reshard_all(module: Module) -> None:
    """Put every group under ``module`` back to its at-rest (sharded) state, if it is not."""
    for st in _states(module):
        group = getattr(st, "group", None)
        if group is not None and group.is_unsharded:
            group.reshard()


class _NoGradSync(AbstractContextManager):
    """Skip reduce-scatter inside the context (gradient accumulation), restore on exit."""

    def __init__(self, module: Module, enabled: bool = True) -> None:
        self._module = module
        self._enabled = enabled

    def __enter__(self) -> None:
        if self._enabled:
            set_gradient_sync(self._module, False)

    def __exit__(self, *exc: Any) -> None:
        if self._enabled:
            set_gradient_sync(self._module, True)


# ------------------------------------------------------------------------------------------------
# Sharding plan helpers (shared with the Trainer strategy)
# ------------------------------------------------------------------------------------------------
def validate_sharding_args(sharding_units: Any, granularity: Any, optimizer_block_size: Any,
                           optimizer_min_block_numel: Any) -> Optional[list[Union[str, type]]]:
    """Check the user's sharding arguments early (at construction), with actionable errors."""
    units: Optional[list[Union[str, type]]] = None
    if sharding_units is not None:
        if isinstance(sharding_units, (str, type)):
            sharding_units = [sharding_units]
        units = list(sharding_units)
        for u in units:
            if not (isinstance(u, str) or (isinstance(u, type) and issubclass(u, Module))):
                raise TypeError(
                    f"sharding_units entries must be nn.Module classes or class names, got {u!r}; "
                    "e.g. sharding_units=['Block'] or sharding_units=[Block]."
                )
    if optimizer_block_size is not None and (isinstance(optimizer_block_size, bool) or
                                             not isinstance(optimizer_block_size, int) or
                                             optimizer_block_size < 1):
        raise ValueError(
            f"optimizer_block_size must be a positive int or None, got {optimizer_block_size!r}."
        )
    if not isinstance(optimizer_min_block_numel, int) or optimizer_min_block_numel < 0:
        raise ValueError(
            f"optimizer_min_block_numel must be an int >= 0, got {optimizer_min_block_numel!r}."
        )
    if granularity is not None:
        if isinstance(granularity, bool) or not isinstance(granularity, (int, str)):
            raise TypeError(
                f"granularity must be an int (elements), a string ('element', 'row', '<k>rows') "
                f"or None, got {granularity!r}."
            )
        if isinstance(granularity, int):
            if granularity < 1:
                raise ValueError(f"granularity must be >= 1, got granularity={granularity}.")
            if optimizer_block_size is not None and granularity % optimizer_block_size:
                raise ValueError(
                    f"granularity={granularity} is not a multiple of optimizer_block_size="
                    f"{optimizer_block_size}: block-wise optimizer states would straddle ranks. "
                    f"Use granularity={math.lcm(granularity, optimizer_block_size)} or set "
                    "optimizer_block_size=None if the optimizer is not block-wise."
                )
    return units


def make_granularity(granularity: Union[int, str, None], optimizer_block_size: Optional[int],
                     min_block_numel: int) -> Optional[Callable[[str, Tensor], Any]]:
    """The per-parameter granularity given to ``fully_shard`` (``None`` = engine default).

    See design note [sharding-units]: large tensors get a multiple of the optimizer block size,
    small ones the user's granularity (or element granularity).
    """
    if granularity is None and optimizer_block_size is None:
        return None

    def per_param(name: str, param: Tensor) -> Any:
        shape = tuple(param.shape)
        numel = math.prod(shape)
        if optimizer_block_size is None or numel < min_block_numel:
            return granularity if granularity is not None else 1
        if granularity is None or isinstance(granularity, int):
            return granularity if granularity is not None else optimizer_block_size
        # a string granularity ("row", "<k>rows"): make the row count block-aligned too
        from lightning_vescale.planner import resolve_granularity

        g = resolve_granularity(granularity, shape)
        return math.lcm(g, optimizer_block_size)

    return per_param


def _class_matches(module: Module, units: Sequence[Union[str, type]]) -> bool:
    cls = type(module)
    for u in units:
        if isinstance(u, str):
            if u in (cls.__name__, cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}"):
                return True
        elif isinstance(module, u):
            return True
    return False


def _post_order(module: Module) -> Iterable[Module]:
    for child in module.children():
        yield from _post_order(child)
    yield module


def resolve_sharding_units(root: Module, units: Optional[Sequence[Union[str, type]]]
                           ) -> list[Module]:
    """The modules (excluding ``root``) that become their own group, children first."""
    if units is None:
        chosen = {id(c) for m in root.modules() if isinstance(m, nn.ModuleList) for c in m}
        return [m for m in _post_order(root) if id(m) in chosen and m is not root]
    found = [m for m in _post_order(root) if m is not root and _class_matches(m, units)]
    if not found:
        names = sorted({type(m).__name__ for m in root.modules()})
        raise ValueError(
            f"sharding_units={[u if isinstance(u, str) else u.__name__ for u in units]} matches no "
            f"submodule of {type(root).__name__}. Module classes in the model: {names}."
        )
    return found


def _has_meta(module: Module) -> bool:
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def shard_model(
    root: Module,
    *,
    units: Optional[Sequence[Union[str, type]]],
    mesh: "DeviceMesh",
    device: torch.device,
    mp_policy: Any,
    granularity: Optional[Callable[[str, Tensor], Any]],
    reshard_after_forward: bool,
    wrapper: Optional[Module] = None,
) -> None:
    """Apply ``fully_shard`` to the units of ``root`` then to the root (or to ``wrapper``).

    ``wrapper`` is a module containing ``root`` whose forward is what the training loop calls
    (the Trainer's redirection wrapper); it becomes the root group instead of ``root`` itself.
    If the user already sharded (parts of) the model, only the missing root group is added.
    A meta-device model is sharded on meta, then materialised (``fsdp.materialize``: DBuffers on
    ``device``, ``reset_parameters()`` of every submodule, each rank keeps its ranges).
    """
    fsdp = _fsdp()
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if granularity is not None:
        kwargs["granularity"] = granularity
    top = wrapper if wrapper is not None else root
    is_meta = _has_meta(top)
    if is_sharded(root):
        if _state_of(top) is None:  # the user sharded some units: add the missing root only
            if not is_meta:
                _move_unsharded(top, device)
            fsdp.fully_shard(top, **kwargs)
    else:
        chosen = resolve_sharding_units(root, units)
        if not is_meta:
            top.to(device)
        for unit in chosen:
            fsdp.fully_shard(unit, **kwargs)
        fsdp.fully_shard(top, **kwargs)
    if is_meta:
        fsdp.materialize(top, device)
    _move_unsharded(top, device)


def _move_unsharded(module: Module, device: torch.device) -> None:
    """Move buffers (and any parameter no group owns) to ``device``; sharded groups stay put."""
    for m in module.modules():
        for name, b in list(m._buffers.items()):
            if b is not None and b.device != device and not b.is_meta:
                m._buffers[name] = b.to(device)


def remap_optimizer_params(optimizer: Optimizer, old_names: dict[int, str],
                           module: Module) -> None:
    """Point an optimizer created before sharding at the new (sharded) parameter objects."""
    if optimizer.state:
        raise ValueError(
            "The optimizer already has state, so it cannot be moved onto sharded parameters. "
            "Create the optimizer before its first step, or call setup_module() first and create "
            "the optimizer from the returned module's parameters."
        )
    new = dict(module.named_parameters(remove_duplicate=False))
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            name = old_names.get(id(p))
            if name is None or name not in new:
                raise ValueError(
                    "The optimizer holds a parameter that is not part of the module being set up; "
                    "create the optimizer from this module's parameters."
                )
            params.append(new[name])
        group["params"] = params


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
        if state_dict_type not in ("sharded", "full"):
            raise ValueError(
                f"state_dict_type must be 'sharded' or 'full', got {state_dict_type!r}.")
        self._granularity = granularity
        self._optimizer_block_size = optimizer_block_size
        self._optimizer_min_block_numel = optimizer_min_block_numel
        self._reshard_after_forward = reshard_after_forward
        self._state_dict_type = state_dict_type
        self._process_group_backend = process_group_backend
        self._timeout = timeout
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
        self._process_group_backend = self._process_group_backend or \
            _get_default_process_group_backend_for_device(self.root_device)
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        self._device_mesh = make_mesh(self.root_device, self.world_size)
        self.precision._set_device_type(self.root_device.type)

    def _set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes
                                                     + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

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
        if ckpt.is_sharded_checkpoint(path):
            metadata = ckpt.load_sharded(path, module, optimizers, strict=strict,
                                         model_key=module_key, weights_only=weights_only)
        else:
            metadata = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
            if only_module and module_key not in metadata:  # a bare state dict file
                metadata = {module_key: metadata}
            ckpt.load_full_model_state(metadata.pop(module_key), module, strict=strict)
            for key, opt in optimizers.items():
                if key not in metadata:
                    if strict:
                        raise KeyError(f"The checkpoint has no optimizer state under {key!r}.")
                    continue
                ckpt.load_full_optimizer_state(metadata.pop(key), module, opt)
        if only_module:
            return {}
        requested = [k for k in state if k != module_key and k not in optimizers]
        missing = [k for k in requested if k not in metadata]
        if strict and missing:
            raise KeyError(f"The requested state keys {missing} are not in the checkpoint; "
                           "pass strict=False to ignore them.")
        for key in requested:
            if key not in metadata:
                continue
            value = metadata.pop(key)
            if isinstance(state[key], _Stateful):
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


# ------------------------------------------------------------------------------------------------
# Small distributed helpers shared with the Trainer strategy
# ------------------------------------------------------------------------------------------------
def make_mesh(device: torch.device, world_size: int) -> "DeviceMesh":
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp_shard",))


def barrier(device: torch.device) -> None:
    if not _distributed_is_initialized():
        return
    if torch.distributed.get_backend() == "nccl" and device.index is not None:
        torch.distributed.barrier(device_ids=[device.index])
    else:
        torch.distributed.barrier()


def broadcast(obj: Any, src: int = 0) -> Any:
    if not _distributed_is_initialized():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src, group=_group.WORLD)
    return box[0]
