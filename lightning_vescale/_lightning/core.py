"""The one core of the Trainer strategy and the Fabric strategy.

Design note [strategy-core]
---------------------------
Lightning has two strategy hierarchies (``lightning.pytorch`` for the Trainer, ``lightning.fabric``
for Fabric) with the same notions under partly different names. Like Lightning's own
``ModelParallelStrategy`` pair, both faces of this package are thin; everything they have in
common is :class:`VeScaleStrategyCore`, a mixin listed *first* in each face's bases so that its
hooks take precedence over Lightning's defaults:

* constructor validation (:meth:`VeScaleStrategyCore._init_core`) and the properties (device mesh,
  root device, node/process counts, sampler arguments, backend, ``state_dict_type``);
* no ``CheckpointIO`` plugin: the strategies write checkpoints themselves (see
  ``lightning_vescale.checkpoint``), so a plugin is refused with a ``ValueError`` naming it and
  reading ``checkpoint_io`` raises instead of returning a plugin nothing would use;
* environment set-up: world ranks (Lightning's Trainer connector calls ``set_world_ranks``,
  Fabric's ``_set_world_ranks``: the same method), the default process group with the strategy's
  ``timeout``, the data-parallel mesh of the ``device_mesh`` argument (design note
  [strategy-mesh] in ``_lightning/device_mesh.py``: 1-D from ``lightning_vescale.mesh.init_mesh``
  by default, 2-D for HSDP), or the ``(data_parallel, tensor_parallel)`` mesh of
  ``tensor_parallel_size`` (design note [strategy-tp-mesh], ``_lightning/parallel_sizes.py``),
  whose data-parallel dim is what the strategy shards on, or with both the 3-D HSDP + TP mesh
  ``(dp_replicate, dp_shard, tensor_parallel)`` sharded on its first two dims;
* sharding through ``_lightning/sharding.py`` with the precision plugin's mixed-precision policy;
* collectives: ``broadcast`` and the barrier behind the peer-exception guard of design note
  [failures] (``strategy.py``; only the Trainer can be handling an exception, see
  :meth:`VeScaleStrategyCore._handling_exception`), the ``reduce``/``all_reduce`` body;
* the checkpoint path every rank agrees on, and teardown (which never touches a CheckpointIO).

What differs stays in the faces: the Trainer's LightningModule wrapper, launchers, optimizer
set-up, checkpoint layout (``optimizer_states``) and hooks; Fabric's ``setup_module``/state keys.
"""

from __future__ import annotations

import atexit
import sys
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any, NamedTuple, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.nn import Module
from typing_extensions import override

from lightning_vescale._lightning.comm import validate_comm_policy
from lightning_vescale._lightning.activation_checkpointing import (
    CheckpointSelection,
    apply_activation_checkpointing,
    validate_activation_checkpointing_policy,
)
from lightning_vescale._lightning.device_mesh import (
    build_device_mesh,
    check_world_size,
    validate_device_mesh,
)
from lightning_vescale._lightning.exception_agreement import ExceptionAgreement
from lightning_vescale._lightning.parallel_sizes import (
    sampler_kwargs,
    validate_parallel_sizes,
)
from lightning_vescale._lightning.sharding import (
    ShardGranularity,
    parse_granularity,
    remap_optimizer_params,
    shard_model,
    validate_flat_optimizer,
    validate_process_group_backend,
    validate_reshard_after_forward,
    validate_sharding_args,
    validate_state_dict_type,
    validate_timeout,
)
from lightning_vescale.checkpoint import check_checkpoint_path
from lightning_vescale.optim import AdamW8bit, Muon, flat_param_optimizer
from lightning_vescale.optim.adamw8bit import mark_sharded_for_block_size, mark_whole_matrices
from lightning_vescale._lightning.sync_states import (
    broadcast_module_states,
    validate_sync_module_states,
)
from lightning_vescale._lightning.pretrained import load_pretrained, validate_pretrained_weights
from lightning_vescale._lightning.other_nodes import (
    check_other_nodes_can_join,
    waiting_for_other_nodes,
)
from lightning_vescale.precision import _VeScalePrecisionMixin
from lightning_vescale.sharding_summary import sharding_summary

__all__ = ["RegistryEntry", "VeScaleStrategyCore"]


_EXIT_HOOK_REGISTERED = False
_EXIT_BARRIER_TIMEOUT = timedelta(seconds=10)


def _destroy_process_group_at_exit() -> None:
    """Leave together and destroy the default process group when the interpreter exits.

    A process group the strategy created lives until the end of the script (later Trainers,
    Fabric calls and user code may use it). Left to the interpreter's finalisation, a rank that
    exits while its peer's gloo transport threads still hold the connection makes that peer
    abort with "terminate called without an active exception" (2 of 8 and 2 of 12 runs of
    ``examples/train_gpt.py``; one CI run). So at a normal exit every rank first meets the
    others in a ``monitored_barrier`` (gloo; bounded by :data:`_EXIT_BARRIER_TIMEOUT`, its error
    ignored: the process is leaving anyway), then destroys the group. A process dying of an
    uncaught exception (``sys.last_value`` is set) skips the barrier: its peers are failing too
    (design note [failures]) and must not wait for it. Registered once per process, and only for a group this package created
    (a launcher or user that created it owns its teardown).
    """
    global _EXIT_HOOK_REGISTERED
    if _EXIT_HOOK_REGISTERED:
        return
    _EXIT_HOOK_REGISTERED = True

    def leave() -> None:
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return
        failing = getattr(sys, "last_value", None) is not None
        if not failing and dist.get_backend() == "gloo" and dist.get_world_size() > 1:
            try:
                dist.monitored_barrier(timeout=_EXIT_BARRIER_TIMEOUT)
            except RuntimeError:
                pass  # a peer is gone: nothing left to wait for
        dist.destroy_process_group()

    atexit.register(leave)


def _has_tensor_parallel_params(optimizer: Any) -> bool:
    """Whether ``optimizer`` steps a TP parameter (``(..., RaggedShard, Shard(k))``, [fsdp-tp])."""
    from torch.distributed.tensor import DTensor

    from lightning_vescale.placement import RaggedShard

    return any(isinstance(p, DTensor) and len(p.placements) > 1
               and not isinstance(p.placements[-1], RaggedShard)
               for g in getattr(optimizer, "param_groups", ()) for p in g["params"])


class RegistryEntry(NamedTuple):
    """A name a strategy registers under (``strategy="<name>"``), with its constructor keywords."""

    name: str
    description: str
    init_kwargs: dict[str, Any]


class VeScaleStrategyCore:
    """What ``VeScaleFSDPStrategy`` and ``VeScaleFabricStrategy`` share (design note
    [strategy-core]). A face lists it first in its bases, calls :meth:`_init_core` after
    Lightning's ``__init__`` and provides :attr:`_vescale_precision`."""

    # Lightning's ParallelStrategy (either hierarchy) provides these.
    accelerator: Any
    cluster_environment: Any
    parallel_devices: Optional[list[torch.device]]
    local_rank: int
    node_rank: int
    global_rank: int
    world_size: int

    #: The names the face registers in its framework's strategy registry.
    _registry_entries: tuple[RegistryEntry, ...] = ()
    #: ``activation_checkpointing_policy``, validated (:meth:`_init_activation_checkpointing`).
    _activation_checkpointing: Optional[CheckpointSelection] = None

    def _init_core(
        self,
        *,
        sharding_units: Any,
        granularity: Optional[Union[int, str]],
        optimizer_block_size: Optional[int],
        optimizer_min_block_numel: int,
        reshard_after_forward: Any,
        state_dict_type: Any,
        process_group_backend: Optional[str],
        timeout: Any,
        device_mesh: Any = None,
        flat_optimizer: bool = True,
        sync_module_states: bool = True,
        pretrained_weights: Any = None,
        comm_policy: Any = None,
        data_parallel_size: Any = "auto",
        tensor_parallel_size: Any = None,
    ) -> None:
        """Validate and store the arguments both strategies take (errors name the parameter).

        Every argument is checked here, in the constructor: a mistake in a YAML config fails
        before any process is started, not after the launch (design note [strategy-core]).
        """
        granularity = parse_granularity(granularity)
        self._sharding_units = validate_sharding_args(
            sharding_units, granularity, optimizer_block_size, optimizer_min_block_numel)
        self._optimizer_block_size = optimizer_block_size
        self._granularity = ShardGranularity(granularity=granularity,
                                             optimizer_block_size=optimizer_block_size,
                                             min_block_numel=optimizer_min_block_numel)
        self._reshard_policy = validate_reshard_after_forward(reshard_after_forward)
        self._comm_policy = validate_comm_policy(comm_policy, optimizer_block_size)
        self._state_dict_type = validate_state_dict_type(state_dict_type)
        self._process_group_backend = validate_process_group_backend(process_group_backend)
        self._timeout: Optional[timedelta] = validate_timeout(timeout)
        self._num_nodes = 1
        self._device_mesh_spec = validate_device_mesh(device_mesh)
        # [strategy-tp-mesh]: None, or the (dp, tp) sizes of Lightning's ModelParallelStrategy
        # (with device_mesh=(replicas, shard_size): HSDP + TP, the 3-D mesh)
        self._parallel_sizes = validate_parallel_sizes(data_parallel_size, tensor_parallel_size,
                                                       self._device_mesh_spec)
        self._flat_optimizer = validate_flat_optimizer(flat_optimizer)
        self._sync_module_states = validate_sync_module_states(sync_module_states)
        self._pretrained_weights = validate_pretrained_weights(pretrained_weights)
        self._device_mesh: Optional[DeviceMesh] = None
        self._exception_agreement = ExceptionAgreement()

    def _init_activation_checkpointing(self, policy: Any) -> None:
        """Validate and store ``activation_checkpointing_policy`` (design note
        [activation-checkpointing]); applied to the model in :meth:`_shard`."""
        self._activation_checkpointing = validate_activation_checkpointing_policy(policy)

    # -- what a face provides --------------------------------------------------------------------
    @property
    def _vescale_precision(self) -> _VeScalePrecisionMixin:
        """The face's precision plugin (``precision_plugin`` / ``precision``)."""
        raise NotImplementedError

    def _handling_exception(self) -> bool:
        """Whether this rank is handling an exception (collectives then check their peers)."""
        return False

    # -- properties ------------------------------------------------------------------------------
    @property
    def device_mesh(self) -> DeviceMesh:
        if self._device_mesh is None:
            raise RuntimeError("The device mesh exists only after the processes are initialised.")
        return self._device_mesh

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
        if self._parallel_sizes is not None:  # the ranks of a TP group see one batch
            return sampler_kwargs(self._resolved_parallel_sizes(), self.global_rank)
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    def _resolved_parallel_sizes(self) -> tuple[int, int]:
        """``(dp, tp)`` of ``data_parallel_size``/``tensor_parallel_size`` for this run."""
        assert self._parallel_sizes is not None
        return self._parallel_sizes.resolve(world_size=self.num_nodes * self.num_processes,
                                            num_nodes=self.num_nodes, devices=self.num_processes)

    @property
    def _data_parallel_mesh(self) -> DeviceMesh:
        """The mesh the strategy shards on: ``device_mesh["data_parallel"]`` with TP, the
        ``("dp_replicate", "dp_shard")`` sub-mesh with HSDP + TP ([strategy-tp-mesh])."""
        mesh = self.device_mesh
        return mesh if self._parallel_sizes is None else self._parallel_sizes.sharding_mesh(mesh)

    @property
    def granularity_policy(self) -> ShardGranularity:
        """How shard bounds are chosen per tensor (``granularity``, ``optimizer_block_size``,
        ``optimizer_min_block_numel``); ``.explain()`` says it in words."""
        return self._granularity

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @property
    def state_dict_type(self) -> str:
        return self._state_dict_type

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        raise NotImplementedError(
            f"{type(self).__name__} writes checkpoints itself and has no CheckpointIO plugin; "
            "save and load through the Trainer/Fabric (trainer.save_checkpoint, fabric.save).")

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: Optional[CheckpointIO]) -> None:
        self._reject_checkpoint_io(io)

    def _reject_checkpoint_io(self, io: Optional[CheckpointIO]) -> None:
        if io is not None:
            raise ValueError(
                f"{type(self).__name__} writes checkpoints itself (a distributed-checkpoint "
                f"directory, or one file with state_dict_type='full'), so the CheckpointIO plugin "
                f"{type(io).__name__} would be ignored. Remove it from the Trainer's or Fabric's "
                "plugins=[...] / checkpoint_io=.")

    # -- environment -----------------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        super().setup_environment()  # type: ignore[misc]  (Lightning's: the accelerator's device)
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        device = self.root_device
        backend = (self._process_group_backend
                   or _get_default_process_group_backend_for_device(device))
        kwargs: dict[str, Any] = {"timeout": self._timeout}  # bounds every collective of the run
        if device.type != "cpu":
            kwargs["device_id"] = device  # eager NCCL communicator bound to this rank's device
        created = not torch.distributed.is_initialized()
        with waiting_for_other_nodes(self.cluster_environment, num_nodes=self.num_nodes,
                                     devices=self.num_processes, global_rank=self.global_rank):
            _init_dist_connection(self.cluster_environment, backend, **kwargs)
        if created:
            _destroy_process_group_at_exit()
        self._process_group_backend = backend
        # reuses the default group (a 2-D mesh makes one subgroup per row and column)
        if self._parallel_sizes is not None:  # [strategy-tp-mesh]
            self._device_mesh = self._parallel_sizes.build_mesh(
                device_type=device.type, world_size=self.world_size, num_nodes=self.num_nodes,
                devices=self.num_processes)
        else:
            self._device_mesh = build_device_mesh(
                self._device_mesh_spec, device_type=device.type, world_size=self.world_size,
                num_nodes=self.num_nodes, devices=self.num_processes)
        self._vescale_precision._set_device_type(device.type)

    def _check_device_mesh_world(self) -> None:
        """Before any launch: the ``device_mesh`` shape against ``num_nodes * devices``, and that
        the other nodes of a multi-node run can join at all ([other-nodes])."""
        if self._parallel_sizes is not None:  # (with HSDP + TP: device_mesh's product too)
            self._resolved_parallel_sizes()
        else:
            world = self.num_nodes * self.num_processes
            check_world_size(self._device_mesh_spec, world_size=world, num_nodes=self.num_nodes,
                             devices=self.num_processes)
        check_other_nodes_can_join(self.cluster_environment, num_nodes=self.num_nodes,
                                   devices=self.num_processes)

    def set_world_ranks(self) -> None:
        """Tell the cluster environment and ``rank_zero_only`` this process's global rank."""
        env = self.cluster_environment
        if env is not None:
            env.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            env.set_world_size(self.num_nodes * self.num_processes)
        # lightning.pytorch, lightning.fabric and lightning_utilities share this one function.
        rank_zero_only.rank = self.global_rank

    _set_world_ranks = set_world_ranks  # the name Fabric's connector calls

    # -- sharding --------------------------------------------------------------------------------
    def _shard(self, module: Module) -> None:
        """``fully_shard`` the units of ``module`` and ``module`` itself (design note
        [sharding-units]), on this rank's device, with the precision plugin's policy; first
        rank 0's initial states are broadcast when ``sync_module_states`` ([sync-module-states]);
        then ``pretrained_weights`` are loaded ([pretrained-weights])."""
        if self._sync_module_states:
            broadcast_module_states(module, self.device_mesh)
        apply_activation_checkpointing(module, self._activation_checkpointing)  # before sharding
        # [pretrained-weights]: a strict load overwrites every parameter, so a meta model's
        # parameters are only allocated, not initialised first
        strict = bool(getattr(module, "strict_loading", True))
        shard_model(module, units=self._sharding_units, mesh=self._data_parallel_mesh,
                    device=self.root_device,
                    mp_policy=self._vescale_precision.mixed_precision_policy,
                    granularity=self._granularity,
                    reshard_after_forward=self._reshard_policy,
                    comm_policy=self._comm_policy,
                    init_params=self._pretrained_weights is None or not strict)
        # AdamW8bit(block_size=None) built on these checks them against this block at once
        mark_sharded_for_block_size(module.parameters(), self._optimizer_block_size)
        # and its blocks must not mix two matrices of a tensor sharded per matrix (checked by
        # AdamW8bit, the optimizer with blocks: design note [granularity-rules])
        mark_whole_matrices(self._granularity.whole_matrices(module.named_parameters()))
        if self._comm_policy is not None:  # say once that the policy is on, and what it saves
            rank_zero_info(f"vescale_fsdp: {sharding_summary(module).comm_line()}")
        if self._pretrained_weights is not None:  # [pretrained-weights]: before any optimizer
            load_pretrained(module, self._pretrained_weights, strict=strict)

    def _adopt_optimizer(self, optimizer: Any, module: Module,
                         names_before_sharding: dict[int, str]) -> None:
        """Make an optimizer that was built before ``module`` was sharded step the shards.

        LightningCLI's ``optimizer:`` section builds the optimizer when the command line is
        parsed, from ``model.parameters()`` as they were *before* the strategy sharded them:
        left as it is, it would step parameters nothing uses any more, and the model would not
        train. Its parameters are re-pointed at the sharded ones by name (it has no state yet).
        """
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
        remap_optimizer_params(optimizer, names_before_sharding, module)

    def _bind_param_names(self, optimizer: Any, modules: Iterable[Module]) -> None:
        """A ``Muon`` built from unnamed parameters (LightningCLI's ``optimizer:`` section,
        ``OptimizerCallable``, ``Muon(model.parameters())``) gets the modules' parameter names,
        so it becomes exactly ``Muon(model.named_parameters(), ...)``: embeddings and the
        output head go to its AdamW fallback instead of being orthogonalised."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
        if not isinstance(optimizer, Muon):
            return
        named = [pair for m in modules for pair in m.named_parameters()]
        try:
            optimizer.bind_names(named)
        except ValueError as err:
            rank_zero_warn(f"{err} Until then Muon routes these parameters by shape only.")

    def _flatten_optimizer(self, optimizer: Any) -> Any:
        """``optimizer`` wrapped in ``FlatParamOptimizer`` when ``flat_optimizer`` is on and it
        is a torch Adam/AdamW/SGD on sharded parameters; otherwise unchanged (design note
        [flat-params] in ``lightning_vescale.optim``)."""
        if not self._flat_optimizer:
            return optimizer
        inner = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer
        if _has_tensor_parallel_params(inner):  # FlatParamOptimizer has no TP layout yet
            rank_zero_info("vescale_fsdp: flat_optimizer is skipped for an optimizer over "
                           "tensor-parallel parameters (it steps them per tensor).")
            return optimizer
        flat = flat_param_optimizer(inner, strict=False)
        return optimizer if flat is inner else flat

    def _inherit_block_size(self, optimizer: Any) -> None:
        """An ``AdamW8bit`` that stated no ``block_size`` quantizes in the blocks the shards were
        aligned to: the user states ``optimizer_block_size`` once, on the strategy."""
        if isinstance(optimizer, AdamW8bit):
            optimizer.inherit_block_size(self._optimizer_block_size)

    # -- collectives -----------------------------------------------------------------------------
    def _check_peers(self, what: str) -> None:
        """While this rank handles an exception, enter the collective ``what`` only if every rank
        does (design note [failures]); otherwise a no-op."""
        if self._handling_exception():
            self._exception_agreement.check(what, rank=self.global_rank, timeout=self._timeout)

    def _barrier(self, what: str) -> None:
        self._check_peers(what)
        if not _distributed_is_initialized():
            return
        device = self.root_device
        if torch.distributed.get_backend() == "nccl" and device.index is not None:
            torch.distributed.barrier(device_ids=[device.index])
        else:
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._check_peers("broadcast")
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src, group=_group.WORLD)
        return box[0]

    @staticmethod
    def _all_reduce(tensor: Union[Tensor, Any], group: Optional[Any],
                    reduce_op: Optional[Union[ReduceOp, str]]) -> Union[Tensor, Any]:
        """The body of the Trainer's ``reduce`` and Fabric's ``all_reduce``."""
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def teardown(self) -> None:
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self._vescale_precision.teardown()
        self.accelerator.teardown()

    # -- registration ----------------------------------------------------------------------------
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register :attr:`_registry_entries` (idempotent: a registered name is left as it is)."""
        if not torch.distributed.is_available():
            return
        for entry in cls._registry_entries:
            if entry.name not in strategy_registry:
                strategy_registry.register(entry.name, cls, description=entry.description,
                                           **entry.init_kwargs)

    # -- checkpoints -----------------------------------------------------------------------------
    def _refuse_storage_options(self, storage_options: Optional[Any]) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(storage_options=...) is not "
                            "supported: the strategy writes checkpoints itself.")

    def _checkpoint_target(self, path: _PATH) -> Path:
        """The path a save writes to: rank 0's (every rank must write the same checkpoint)."""
        return Path(self.broadcast(path))

    def _checkpoint_source(self, path: _PATH) -> Path:
        """The checkpoint a load reads: rank 0's path, checked to be one of our formats."""
        return check_checkpoint_path(Path(self.broadcast(path)))
