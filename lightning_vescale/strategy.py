"""Layer 5: ``VeScaleFSDPStrategy`` — ``Trainer(strategy="vescale_fsdp")``.

Design note [trainer-strategy]
------------------------------
A thin Trainer face over ``fully_shard`` (layer 3), modelled on Lightning's
``ModelParallelStrategy`` (FSDP2) and ``FSDPStrategy``:

* Processes: Lightning's subprocess launcher (``torchrun``/SLURM environments create processes
  externally) or, with ``start_method="fork"|"spawn"``, a multiprocessing launcher whose
  worker hands rank 0's *full* weights back to the main process (DTensors do not survive the
  trip). Backend from the accelerator (``gloo`` on CPU, ``nccl`` on CUDA), a 1-D device mesh
  over the world, exposed as ``LightningModule.device_mesh`` for ``configure_model``.
* Sharding in ``setup``: the units of design note [sharding-units] (``_sharding.py``), then the
  LightningModule itself is the root group, so calling it directly works anywhere (a summary's
  example input, sampling in a hook, a later Trainer on the same module). Lightning calls
  ``training_step``/``validation_step``, not ``forward``; an unsharded *redirection wrapper*
  (:class:`_RootWrapper`) routes them through ``lm(...)`` (Lightning's forward redirection, as
  for DDP/FSDP), so the root's hooks run — all-gather before the step, final reduce-scatter
  callback in backward — even when the step calls ``self.model(x)`` rather than ``self(x)``.
  A step that calls ``self(x)`` re-enters the root's forward (design note [fsdp-reentrant]).
  A model the user sharded in ``configure_model`` is respected (only a missing root is added).
* Gradient accumulation: Lightning enters :meth:`block_backward_sync` on non-final
  micro-batches; it turns the groups' gradient sync off, so gradients accumulate unsharded and
  the final micro-batch reduce-scatters the sum once.
* Precision: any ``precision=`` flag becomes :class:`~lightning_vescale.precision.VeScalePrecision`
  in the ``precision_plugin`` setter (Lightning replaces the plugin after construction).
* Checkpoints: see design note [checkpoint-formats] in ``_checkpoint.py``. The strategy restores
  model and optimizer states itself, after setup (``restore_checkpoint_after_setup``).

Design note [failures]
----------------------
A rank that fails must not leave the others hanging forever. Three mechanisms:

* ``timeout`` goes to ``init_process_group`` (the device mesh reuses that group), so a collective
  that a peer never joins becomes an error after ``timeout`` (gloo and NCCL). On gloo, a peer
  *process* that dies fails the others' collectives at once ("Connection closed by peer").
* The fork/spawn launcher (torch's ``ProcessContext.join``) terminates the other workers as soon
  as one exits with an error and re-raises it in the main process.
* With the default launcher / torchrun every rank handles its own exception, and Lightning runs
  the ``on_exception`` hooks there — e.g. ``OnExceptionCheckpoint`` or
  ``ModelCheckpoint(save_on_exception=True)`` call ``trainer.save_checkpoint``, a *collective*
  (barrier, DCP). If only one rank failed, its peers are blocked in some other collective, so the
  failing rank would wait for them for the whole ``timeout`` (30 min by default) before its
  error even appears. So while the trainer is ``INTERRUPTED``, the strategy's collective entry
  points first agree *out of band* (the process group's TCP store, which cannot mismatch with
  an in-flight collective) that every rank is handling an exception; they wait at most
  ``min(timeout, _EXCEPTION_AGREEMENT_WINDOW)``. If all ranks arrive (Ctrl+C, the same error
  everywhere), the checkpoint is written collectively as usual; if not, the failing rank raises
  an error naming the original one and exits, which releases its peers.
"""

from __future__ import annotations

import itertools
import os
import sys
import tempfile
import time
from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import (
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers.multiprocessing import (
    _MultiProcessingLauncher,
    _WorkerOutput,
)
from lightning.pytorch.strategies.launchers.subprocess_script import (
    _SubprocessScriptLauncher,
)
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_vescale import _checkpoint as ckpt
from lightning_vescale._sharding import (
    DEFAULT_MIN_BLOCK_NUMEL,
    DEFAULT_OPTIMIZER_BLOCK_SIZE,
    _NoGradSync,
    barrier,
    broadcast,
    connect,
    make_granularity,
    reshard_all,
    set_world_ranks,
    shard_model,
    validate_sharding_args,
    validate_state_dict_type,
    validate_timeout,
)
from lightning_vescale.precision import VeScalePrecision, to_vescale_precision

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["VeScaleFSDPStrategy"]

#: Upper bound on how long a rank handling an exception waits for its peers before a collective
#: checkpoint save (design note [failures]); the process-group ``timeout`` bounds it too.
_EXCEPTION_AGREEMENT_WINDOW = timedelta(seconds=15)


class _RootWrapper(nn.Module):
    """The root sharding group of a Trainer run: its ``forward`` is the step redirection."""

    def __init__(self, module: Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class VeScaleFSDPStrategy(ParallelStrategy):
    """veScale-FSDP for the Lightning Trainer: ``Trainer(strategy="vescale_fsdp")``.

    Parameters are sharded with ``RaggedShard`` (structure-aware, block-aligned shard bounds) into
    one zero-copy buffer per group; see ``lightning_vescale.fsdp``. ``configure_model`` is
    optional: without it, the modules listed by ``sharding_units`` (default: each block of every
    ``nn.ModuleList``) become groups and the root takes the rest.

    Args:
        sharding_units: module classes or class names (``["Block"]``) that become sharding
            groups; ``None`` = every child of every ``nn.ModuleList``, then the root.
        granularity: shard-bound granularity (elements, ``"row"`` or ``"<k>rows"``); an int must
            be a multiple of ``optimizer_block_size``.
        optimizer_block_size: block size that the shard bounds of large tensors align to, so that
            block-wise optimizers (``lightning_vescale.optim.AdamW8bit``, block 256) need no
            communication; ``None`` disables the alignment.
        optimizer_min_block_numel: tensors smaller than this are not aligned (AdamW8bit keeps fp32
            states for them).
        reshard_after_forward: free each group's unsharded parameters after its forward (ZeRO-3);
            ``False`` keeps them until backward (more memory, one all-gather less per step).
        state_dict_type: ``"sharded"``: a directory written by all ranks in parallel
            (distributed checkpoint); ``"full"``: one Lightning checkpoint file from rank 0 that a
            plain ``nn.Module``/DDP run can load.
        process_group_backend: default: from the accelerator (``gloo``/``nccl``).
        timeout: process-group timeout (a hung collective becomes an error after it).
        start_method: ``"popen"`` (default; re-runs the script per rank, like ``ddp``), or
            ``"fork"``/``"spawn"``/``"forkserver"`` (processes started from the current one, like
            ``ddp_fork``/``ddp_spawn``; useful in notebooks and tests).
    """

    strategy_name = "vescale_fsdp"

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
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        _reject_checkpoint_io(checkpoint_io)
        self._sharding_units = validate_sharding_args(
            sharding_units, granularity, optimizer_block_size, optimizer_min_block_numel)
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(f"start_method must be one of 'popen', 'spawn', 'fork', "
                             f"'forkserver', got {start_method!r}.")
        self._granularity = granularity
        self._optimizer_block_size = optimizer_block_size
        self._optimizer_min_block_numel = optimizer_min_block_numel
        self._reshard_after_forward = reshard_after_forward
        self._state_dict_type = validate_state_dict_type(state_dict_type)
        self._process_group_backend = process_group_backend
        self._timeout = validate_timeout(timeout)
        self._start_method = start_method
        self._num_nodes = 1
        self._device_mesh: Optional[DeviceMesh] = None
        self._wrapper: Optional[_RootWrapper] = None
        self._setups = 0  # per-run key of the exception agreement (design note [failures])
        self._peers_in_exception: Optional[bool] = None

    # -- properties ------------------------------------------------------------------------------
    @property
    def is_distributed(self) -> bool:
        """Lightning adds the distributed sampler and makes ``sync_dist`` reduce only if True."""
        return True

    @property
    def device_mesh(self) -> "DeviceMesh":
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
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @property
    def state_dict_type(self) -> str:
        return self._state_dict_type

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        """Lightning's default ``TorchCheckpointIO``: used only to remove old checkpoints."""
        return super().checkpoint_io

    @checkpoint_io.setter
    @override
    def checkpoint_io(self, io: Optional[CheckpointIO]) -> None:
        _reject_checkpoint_io(io)

    @property
    @override
    def precision_plugin(self) -> VeScalePrecision:
        plugin = self._precision_plugin
        if plugin is None:
            return VeScalePrecision("32-true")
        return plugin  # type: ignore[return-value]

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Optional[Precision]) -> None:
        self._precision_plugin = to_vescale_precision(precision_plugin)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False

    # -- processes -------------------------------------------------------------------------------
    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            if not self.cluster_environment.creates_processes_externally:
                self._launcher = _SubprocessScriptLauncher(self.cluster_environment,
                                                           self.num_processes, self.num_nodes)
        else:
            self._launcher = _VeScaleMultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        self._process_group_backend, self._device_mesh = connect(
            self.cluster_environment, self._process_group_backend, self.root_device,
            self.world_size, self._timeout)
        self.precision_plugin._set_device_type(self.root_device.type)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh  # for configure_model

    def set_world_ranks(self) -> None:
        set_world_ranks(self)

    # -- model & optimizers ----------------------------------------------------------------------
    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None
        self._setups += 1
        self._peers_in_exception = None
        self.accelerator.setup(trainer)
        lm = self.lightning_module
        assert lm is not None and self.model is not None
        if trainer.state.fn == TrainerFn.FITTING and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model = self._shard(lm)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _shard(self, lm: "pl.LightningModule") -> Module:
        """Shard ``lm`` (once; a second fit/validate reuses the groups) and return the root."""
        granularity = make_granularity(self._granularity, self._optimizer_block_size,
                                       self._optimizer_min_block_numel)
        common = dict(units=self._sharding_units, mesh=self.device_mesh, device=self.root_device,
                      mp_policy=self.precision_plugin.mixed_precision_policy,
                      granularity=granularity, reshard_after_forward=self._reshard_after_forward)
        if self._wrapper is not None and self._wrapper.module is lm:
            return self._wrapper
        # The LightningModule itself is the root group, so calling it directly works everywhere
        # (ModelSummary's example_input_array, sampling in epoch-end hooks, a second Trainer on
        # the fitted model: the groups live on the module). The unsharded wrapper only redirects
        # the steps through ``lm(...)``, so the root's hooks run even if a step never calls
        # ``self(...)``; one that does is a re-entrant root forward (design note
        # [fsdp-reentrant] in fsdp/_state.py).
        self._wrapper = _RootWrapper(lm)
        shard_model(lm, **common)  # type: ignore[arg-type]
        return self._wrapper

    @override
    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)

    @override
    def model_to_device(self) -> None:
        pass  # sharding places every group on the root device

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        device_ctx = torch.device("meta") if empty_init else self.root_device
        with device_ctx, self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        with _NoGradSync(self.model) if self.model is not None else nullcontext():
            yield None

    @override
    def on_validation_end(self) -> None:
        reshard_all(self.model)

    @override
    def on_test_end(self) -> None:
        reshard_all(self.model)

    @override
    def on_predict_end(self) -> None:
        reshard_all(self.model)

    # -- collectives -----------------------------------------------------------------------------
    @override
    def barrier(self, name: Optional[str] = None) -> None:
        self._check_peers_if_interrupted(f"barrier({name!r})" if name else "barrier")
        barrier(self.root_device)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        self._check_peers_if_interrupted("broadcast")
        return broadcast(obj, src)

    def _is_main_process_after_failed_workers(self) -> bool:
        """True in the main process of the fork/spawn launcher while it handles a worker's error."""
        from torch.multiprocessing.spawn import ProcessException

        return (isinstance(self._launcher, _MultiProcessingLauncher)
                and isinstance(sys.exc_info()[1], ProcessException)
                and not (torch.distributed.is_available() and torch.distributed.is_initialized()))

    def _check_peers_if_interrupted(self, what: str) -> None:
        """While the trainer handles an exception, enter a collective only if every rank does.

        See design note [failures]. Out of the exception path this is one attribute check.
        """
        lm = self.lightning_module
        trainer = getattr(lm, "_trainer", None) if lm is not None else None
        if trainer is None or trainer.state.status != TrainerStatus.INTERRUPTED:
            return
        if not torch.distributed.is_available() or not torch.distributed.is_initialized():
            return
        world = torch.distributed.get_world_size()
        if world == 1 or self._peers_in_exception:
            return
        if self._peers_in_exception is None:
            self._peers_in_exception = _all_ranks_arrive(
                f"lightning_vescale/exception/{self._setups}", world,
                min(self._timeout or _EXCEPTION_AGREEMENT_WINDOW, _EXCEPTION_AGREEMENT_WINDOW))
        if not self._peers_in_exception:
            original = sys.exc_info()[1]
            cause = f" ({type(original).__name__}: {original})" if original is not None else ""
            raise RuntimeError(
                f"Rank {self.global_rank} is handling an exception{cause} but the other ranks are "
                f"not, so the collective `{what}` (e.g. a checkpoint save from an `on_exception` "
                "hook such as OnExceptionCheckpoint) cannot run: it would wait for them until the "
                "process-group timeout. Nothing was written; any previous checkpoint is untouched. "
                "Fix the original error shown above."
            )

    @override
    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None,
               reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Tensor:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def teardown(self) -> None:
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # -- checkpoints -----------------------------------------------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        self._check_peers_if_interrupted("lightning_module_state_dict")
        reshard_all(self.model)
        return ckpt.model_state(self.lightning_module, full=self._state_dict_type == "full")

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        assert self.lightning_module is not None
        return ckpt.optimizer_state(self.lightning_module, optimizer,
                                    full=self._state_dict_type == "full")

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # done in load_checkpoint (after setup, straight into the shards)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # done in load_checkpoint

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH,
                        storage_options: Optional[Any] = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint(storage_options=...) is not "
                            "supported: the strategy writes checkpoints itself.")
        if self._is_main_process_after_failed_workers():
            # With start_method="fork"/"spawn", Lightning runs the `on_exception` hooks in the main
            # process, whose model never trained (the workers' state died with them): writing it
            # would replace a good checkpoint at that path with the initial weights.
            rank_zero_warn(f"Not saving the checkpoint {str(filepath)!r}: a worker process "
                           "failed and the main process only holds the untrained model.")
            return
        path = Path(self.broadcast(filepath))
        if self._state_dict_type == "full":
            ckpt.save_full(path, checkpoint)
            return
        tensors = {"state_dict": checkpoint.pop("state_dict")}
        for idx, state in enumerate(checkpoint.pop("optimizer_states", [])):
            tensors[f"optimizer_{idx}"] = state
        ckpt.save_sharded(path, tensors, checkpoint)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Remove a checkpoint (e.g. ``ModelCheckpoint`` rotation) and its hidden leftovers.

        Besides the file or directory, the ``.<name>.tmp-*`` / ``.<name>.old-*`` siblings of
        saves to that name that were killed half-way are removed too (design note
        [checkpoint-formats]), so rotating names do not pile them up. Rank 0 only.
        """
        if self.is_global_zero:
            ckpt.remove_checkpoint(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = ckpt.check_checkpoint_path(Path(self.broadcast(checkpoint_path)))
        lm = self.lightning_module
        assert lm is not None and self.model is not None
        reshard_all(self.model)
        fitting = lm.trainer.state.fn == TrainerFn.FITTING
        optimizers = list(self.optimizers) if fitting else []
        if ckpt.is_sharded_checkpoint(path):
            if optimizers:
                _check_optimizer_count(len(optimizers), ckpt.count_sharded_optimizers(path))
            return ckpt.load_sharded(
                path, lm, {f"optimizer_{i}": o for i, o in enumerate(optimizers)},
                strict=lm.strict_loading, weights_only=weights_only)
        checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
        if "state_dict" not in checkpoint:
            raise ValueError(f"{str(path)!r} is not a Lightning checkpoint (no 'state_dict' key).")
        ckpt.load_full_model_state(checkpoint.pop("state_dict"), lm, strict=lm.strict_loading)
        states = checkpoint.pop("optimizer_states", None)
        if optimizers and states is not None:
            _check_optimizer_count(len(optimizers), len(states))
            for opt, state in zip(optimizers, states):
                ckpt.load_full_optimizer_state(state, lm, opt)
        return checkpoint

    # -- registration ----------------------------------------------------------------------------
    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        if not torch.distributed.is_available():
            return
        for name, start_method in (("vescale_fsdp", "popen"), ("vescale_fsdp_spawn", "spawn"),
                                   ("vescale_fsdp_fork", "fork")):
            if name not in strategy_registry:
                strategy_registry.register(
                    name, cls, description=f"veScale-FSDP (RaggedShard fully sharded data "
                    f"parallel), start_method={start_method!r}", start_method=start_method)


def _reject_checkpoint_io(io: Optional[CheckpointIO]) -> None:
    if io is not None:
        raise ValueError(
            f"VeScaleFSDPStrategy writes checkpoints itself (a distributed-checkpoint directory, "
            f"or one file with state_dict_type='full'), so the CheckpointIO plugin "
            f"{type(io).__name__} would be ignored. Remove it from Trainer(plugins=...) / "
            "checkpoint_io=.")


def _all_ranks_arrive(key: str, world_size: int, window: timedelta) -> bool:
    """Whether all ``world_size`` ranks reach ``key`` within ``window``: one answer for all.

    Out of band (the default group's TCP store, not a collective), so it cannot pair with a
    collective a healthy peer is blocked in. Each rank counts itself in at ``key``. The first
    rank that sees every rank counted, or whose window runs out, records the decision at
    ``key/decision`` with an atomic ``compare_set``; every rank returns that one decision, so a
    rank that arrives after another gave up does not enter the collective alone. A store that is
    gone (its host rank died) counts as "not all ranks".
    """
    decision_key = f"{key}/decision"
    try:
        store = torch.distributed.distributed_c10d._get_default_store()
        store.add(key, 1)
        deadline = time.monotonic() + window.total_seconds()
        while True:
            if store.check([decision_key]):
                return store.get(decision_key) == b"all"
            if store.add(key, 0) >= world_size:
                return store.compare_set(decision_key, "", "all") == b"all"
            if time.monotonic() >= deadline:
                return store.compare_set(decision_key, "", "missing") == b"all"
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - an unreachable store means a peer process is gone
        return False


def _alias_groups(module: Module) -> list[list[str]]:
    """Qualified names of each parameter registered under more than one name (tied weights)."""
    by_id: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _retie(module: Module, groups: list[list[str]]) -> None:
    """Register the first name's parameter under every other name of its group."""
    for first, *others in groups:
        param = module.get_parameter(first)
        for name in others:
            owner, _, attr = name.rpartition(".")
            module.get_submodule(owner)._parameters[attr] = param


def _check_optimizer_count(configured: int, saved: int) -> None:
    if saved == 0 and configured > 0:
        raise KeyError(  # Lightning's own wording for this case, plus the fix
            "Trying to restore optimizer state but checkpoint contains only the model. This is "
            "probably due to `ModelCheckpoint.save_weights_only` being set to `True`. Resume from "
            "a checkpoint saved with save_weights_only=False, or load only the weights (e.g. "
            "trainer.validate(model, ckpt_path=...)) and start a new fit.")
    if configured != saved:
        raise RuntimeError(
            f"You have configured {configured} optimizers but the checkpoint contains {saved} "
            "optimizers to load. Please resume training with the same number of optimizers or "
            "edit the checkpoint manually to remove states."
        )


class _VeScaleMultiProcessingLauncher(_MultiProcessingLauncher):
    """``fork``/``spawn`` launcher that sends rank 0's *full* weights back to the main process.

    The stock launcher pickles ``lightning_module.state_dict()``, i.e. ``DTensor`` shards that
    cannot be loaded in the (unsharded) main process; we gather full tensors instead.
    """

    @override
    def _collect_rank_zero_results(self, trainer: "pl.Trainer",
                                   results: Any) -> Optional[_WorkerOutput]:
        callback = trainer.checkpoint_callback
        best_model_path = getattr(callback, "best_model_path", None) if callback else None
        reshard_all(trainer.strategy.model)
        state_dict = ckpt.model_state(trainer.lightning_module, full=True)  # collective
        if self._strategy.local_rank != 0:
            return None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            torch.save(state_dict, weights_path)
        extra = self.get_extra_results(trainer)
        return _WorkerOutput(best_model_path, weights_path, trainer.state, results, extra)

    @override
    def _recover_results_in_main_process(self, worker_output: _WorkerOutput,
                                         trainer: "pl.Trainer") -> None:
        if trainer.checkpoint_callback and hasattr(trainer.checkpoint_callback, "best_model_path"):
            trainer.checkpoint_callback.best_model_path = str(worker_output.best_model_path)
        if worker_output.weights_path is not None:
            state = torch.load(worker_output.weights_path, map_location="cpu", weights_only=True)
            module = trainer.lightning_module
            on_meta = any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))
            if on_meta:
                # `assign=True` installs one tensor per key, which would untie tied parameters
                # (an embedding shared with the output head): tie them again afterwards.
                aliases = _alias_groups(module)
                module.load_state_dict(state, strict=False, assign=True)
                _retie(module, aliases)
            else:
                module.load_state_dict(state, strict=False)
            Path(worker_output.weights_path).unlink(missing_ok=True)
        trainer.state = worker_output.trainer_state
        self.update_main_process_results(trainer, worker_output.extra)
