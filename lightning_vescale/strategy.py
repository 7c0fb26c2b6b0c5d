"""Layer 5: ``VeScaleFSDPStrategy`` — ``Trainer(strategy="vescale_fsdp")``.

Design note [trainer-strategy]
------------------------------
A thin Trainer face over ``fully_shard`` (layer 3), modelled on Lightning's
``ModelParallelStrategy`` (FSDP2) and ``FSDPStrategy``:

* Processes: Lightning's subprocess launcher (``torchrun``/SLURM environments create processes
  externally) or, with ``start_method="fork"|"spawn"``, a multiprocessing launcher whose
  worker hands rank 0's *full* weights back to the main process (DTensors do not survive the
  trip). Backend from the accelerator (``gloo`` on CPU, ``nccl`` on CUDA), a 1-D device mesh
  over the world (or the 2-D HSDP mesh of ``device_mesh``, design note [strategy-mesh], or the
  ``(data_parallel, tensor_parallel)`` mesh of ``tensor_parallel_size``, or with both the 3-D
  ``(dp_replicate, dp_shard, tensor_parallel)`` HSDP + TP mesh, design note
  [strategy-tp-mesh]), exposed as ``LightningModule.device_mesh`` for ``configure_model``.
* Sharding in ``setup``: the units of design note [sharding-units] (``_lightning/sharding.py``),
  then the LightningModule itself is the root group, so calling it directly works anywhere (a
  summary's example input, sampling in a hook, a later Trainer on the same module). Lightning calls
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
* Checkpoints: see design note [checkpoint-formats] in ``lightning_vescale.checkpoint``. The
  strategy restores model and optimizer states itself, after setup
  (``restore_checkpoint_after_setup``).
* What this face shares with the Fabric strategy is design note [strategy-core]
  (``_lightning/core.py``).

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
  ``min(timeout, EXCEPTION_AGREEMENT_WINDOW)`` (``_lightning/exception_agreement.py``). If all ranks arrive
  (Ctrl+C, the same error everywhere), the checkpoint is written collectively as usual; if not,
  the failing rank raises an error naming the original one and exits, which releases its peers.
  (The Fabric strategy shares the mechanism, but Fabric never reports an exception to it.)
"""

from __future__ import annotations

import sys
from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Literal, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.multiprocessing.spawn import ProcessException
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_vescale._lightning.activation_checkpointing import ActivationCheckpointingPolicy
from lightning_vescale._lightning.core import RegistryEntry, VeScaleStrategyCore
from lightning_vescale._lightning.device_mesh import DeviceMeshArg
from lightning_vescale._lightning.parallel_sizes import SizeArg
from lightning_vescale._lightning.requested_load import DirectLauncher, RecordingScriptLauncher
from lightning_vescale._lightning.launcher import (
    SAVED_AFTER_LAUNCH_KEY,
    VeScaleMultiProcessingLauncher,
    in_launching_process,
    saved_after_launch,
    saved_after_launch_error,
    warn_saved_after_launch,
)
from lightning_vescale._lightning.sharding import (
    DEFAULT_MIN_BLOCK_NUMEL,
    DEFAULT_OPTIMIZER_BLOCK_SIZE,
    NoGradSync,
    check_optimizer_params,
    reshard_all,
)
from lightning_vescale import checkpoint as ckpt
from lightning_vescale.fsdp import CommPolicy
from lightning_vescale.precision import VeScalePrecision, to_vescale_precision

if TYPE_CHECKING:
    import lightning.pytorch as pl

__all__ = ["VeScaleFSDPStrategy"]


class _RootWrapper(nn.Module):
    """The root sharding group of a Trainer run: its ``forward`` is the step redirection."""

    def __init__(self, module: Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class VeScaleFSDPStrategy(VeScaleStrategyCore, ParallelStrategy):
    """veScale-FSDP for the Lightning Trainer: ``Trainer(strategy="vescale_fsdp")``.

    Parameters are sharded with ``RaggedShard`` (structure-aware, block-aligned shard bounds) into
    one zero-copy buffer per group; see ``lightning_vescale.fsdp``. ``configure_model`` is
    optional: without it, the modules listed by ``sharding_units`` (default: each block of every
    ``nn.ModuleList``) become groups and the root takes the rest.

    Args:
        sharding_units: module classes or class names (``["Block"]``) that become sharding
            groups; ``None`` = every child of every ``nn.ModuleList``, then the root.
        granularity: shard-bound granularity (elements, ``"row"``, ``"<k>rows"`` or
            ``"matrix"``: each expert of a stacked ``(E, out, in)`` weight whole); an int must
            be a multiple of ``optimizer_block_size``. Or a mapping of parameter-name patterns
            to forms, first match wins (``{"*.experts.*": "matrix"}``: experts whole, the
            rest the default; design note [granularity-rules]).
        optimizer_block_size: block size that the shard bounds of large tensors align to, so that
            block-wise optimizers (``lightning_vescale.optim.AdamW8bit``, block 256) need no
            communication; ``None`` disables the alignment.
        optimizer_min_block_numel: tensors smaller than this are not aligned (AdamW8bit keeps fp32
            states for them).
        reshard_after_forward: what each group does with its gathered parameters after its
            forward, ``fully_shard``'s meaning (design note [fsdp-reshard-policy]). ``None``
            (default, "auto"): reshard every group (ZeRO-3) except the last one of the forward,
            whose backward comes first, so it keeps its parameters (one all-gather less per
            step); ``True``: reshard every group; ``False``: keep them until backward (more
            memory, one all-gather less per group and step); an ``int`` ``k`` dividing the
            shard-group size: keep them sharded over ``k`` ranks. The root group (the
            LightningModule) always keeps its parameters into backward.
        state_dict_type: ``"sharded"``: a directory written by all ranks in parallel
            (distributed checkpoint); ``"full"``: one Lightning checkpoint file from rank 0 that a
            plain ``nn.Module``/DDP run can load.
        pretrained_weights: a Hugging Face safetensors checkpoint (a ``.safetensors`` file or a
            ``save_pretrained`` directory) loaded into the model right after sharding, before
            the optimizers are built; each rank reads only its own shards, so with the model
            built on meta (``configure_model`` under ``torch.device("meta")``) no host holds the
            full model. Keys match after the prefix the LightningModule holds the HF model under
            (e.g. ``model.``); strict as ``LightningModule.strict_loading``. See design note
            [pretrained-weights].
        process_group_backend: default: from the accelerator (``gloo``/``nccl``).
        timeout: process-group timeout (a hung collective becomes an error after it).
        start_method: ``"popen"`` (default; re-runs the script per rank, like ``ddp``), or
            ``"fork"``/``"spawn"``/``"forkserver"`` (processes started from the current one, like
            ``ddp_fork``/``ddp_spawn``; useful in notebooks and tests).
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
            strategy builds the 2-D mesh ``("data_parallel", "tensor_parallel")``, the
            LightningModule's ``self.device_mesh`` in ``configure_model``: apply the TP plan there
            (``parallelize_module(model, device_mesh["tensor_parallel"], plan)``), and the
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

    strategy_name = "vescale_fsdp"
    _registry_entries = tuple(
        RegistryEntry(name=name, description=f"veScale-FSDP (RaggedShard fully sharded data "
                      f"parallel), start_method={start_method!r}",
                      init_kwargs={"start_method": start_method})
        for name, start_method in (("vescale_fsdp", "popen"), ("vescale_fsdp_spawn", "spawn"),
                                   ("vescale_fsdp_fork", "fork")))

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
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        device_mesh: DeviceMeshArg = None,
        flat_optimizer: bool = True,
        sync_module_states: bool = True,
        comm_policy: Optional[Union[CommPolicy, dict[str, Any]]] = None,
        activation_checkpointing_policy: ActivationCheckpointingPolicy = None,
        data_parallel_size: SizeArg = "auto",
        tensor_parallel_size: Optional[SizeArg] = None,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._reject_checkpoint_io(checkpoint_io)
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
        if start_method not in ("popen", "spawn", "fork", "forkserver"):
            raise ValueError(f"start_method must be one of 'popen', 'spawn', 'fork', "
                             f"'forkserver', got {start_method!r}.")
        self._start_method = start_method
        self._wrapper: Optional[_RootWrapper] = None
        self._names_before_sharding: dict[int, str] = {}

    # -- properties ------------------------------------------------------------------------------
    @property
    def is_distributed(self) -> bool:
        """Lightning adds the distributed sampler and makes ``sync_dist`` reduce only if True."""
        return True

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
    def _vescale_precision(self) -> VeScalePrecision:
        return self.precision_plugin

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
        self._check_device_mesh_world()  # in the main process, before any rank starts
        # every launcher records the entry point's weights_only ([requested-weights-only])
        if self._start_method == "popen":
            if not self.cluster_environment.creates_processes_externally:
                self._launcher = RecordingScriptLauncher(self, self.cluster_environment,
                                                         self.num_processes, self.num_nodes)
            else:
                self._launcher = DirectLauncher(self)
        else:
            self._launcher = VeScaleMultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self.device_mesh  # for configure_model

    # -- model & optimizers ----------------------------------------------------------------------
    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None
        self._exception_agreement.new_run()
        self.accelerator.setup(trainer)
        lm = self.lightning_module
        assert lm is not None and self.model is not None
        if trainer.state.fn == TrainerFn.FITTING and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        # names of the parameters as they are before sharding, for an optimizer that was built
        # from them (LightningCLI's optimizer section); the list keeps the ids valid meanwhile
        before = list(lm.named_parameters(remove_duplicate=False))
        self._names_before_sharding = {id(p): n for n, p in before}
        self.model = self._shard_root(lm)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        del before
        self._names_before_sharding = {}
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _shard_root(self, lm: "pl.LightningModule") -> Module:
        """Shard ``lm`` (once; a second fit/validate reuses the groups) and return the root."""
        if self._wrapper is not None and self._wrapper.module is lm:
            return self._wrapper
        # The LightningModule itself is the root group, so calling it directly works everywhere
        # (ModelSummary's example_input_array, sampling in epoch-end hooks, a second Trainer on
        # the fitted model: the groups live on the module). The unsharded wrapper only redirects
        # the steps through ``lm(...)``, so the root's hooks run even if a step never calls
        # ``self(...)``; one that does is a re-entrant root forward (design note
        # [fsdp-reentrant] in fsdp/_state.py).
        self._wrapper = _RootWrapper(lm)
        self._shard(lm)
        return self._wrapper

    @override
    def setup_optimizers(self, trainer: "pl.Trainer") -> None:
        self._reset_optimizers_and_schedulers()
        super().setup_optimizers(trainer)
        lm = self.lightning_module
        assert lm is not None
        for optimizer in self.optimizers:
            self._adopt_optimizer(optimizer, lm, self._names_before_sharding)
            check_optimizer_params(optimizer, _OPTIMIZER_HINT)
            self._inherit_block_size(optimizer)
            self._bind_param_names(optimizer, [lm])
        # Lightning's LR scheduler configs keep the optimizer they were built with: the flat
        # wrapper shares its param_groups dicts, so their lr changes reach the wrapped step.
        self.optimizers = [self._flatten_optimizer(o) for o in self.optimizers]

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
        with NoGradSync(self.model) if self.model is not None else nullcontext():
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
    def _handling_exception(self) -> bool:
        lm = self.lightning_module
        trainer = getattr(lm, "_trainer", None) if lm is not None else None
        return trainer is not None and trainer.state.status == TrainerStatus.INTERRUPTED

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        self._barrier(f"barrier({name!r})" if name else "barrier")

    @override
    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None,
               reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Tensor:
        return self._all_reduce(tensor, group, reduce_op)

    def _is_main_process_after_failed_workers(self) -> bool:
        """True in the main process of the fork/spawn launcher while it handles a worker's error."""
        return (isinstance(self._launcher, _MultiProcessingLauncher)
                and isinstance(sys.exc_info()[1], ProcessException)
                and not (torch.distributed.is_available() and torch.distributed.is_initialized()))

    # -- checkpoints -----------------------------------------------------------------------------
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.lightning_module is not None
        self._check_peers("lightning_module_state_dict")
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
        self._refuse_storage_options(storage_options)
        if self._is_main_process_after_failed_workers():
            # With start_method="fork"/"spawn", Lightning runs the `on_exception` hooks in the main
            # process, whose model never trained (the workers' state died with them): writing it
            # would replace a good checkpoint at that path with the initial weights.
            rank_zero_warn(f"Not saving the checkpoint {str(filepath)!r}: a worker process "
                           "failed and the main process only holds the untrained model.")
            return
        if in_launching_process(self._launcher):  # weights only: say so (see [saved-after-launch])
            warn_saved_after_launch(checkpoint, filepath, self._start_method)
        path = self._checkpoint_target(filepath)
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
        if weights_only is None:  # Lightning drops it when restoring after setup
            weights_only = getattr(self, "_requested_weights_only", None)
        path = self._checkpoint_source(checkpoint_path)
        lm = self.lightning_module
        assert lm is not None and self.model is not None
        reshard_all(self.model)
        fitting = lm.trainer.state.fn == TrainerFn.FITTING
        optimizers = {f"optimizer_{i}": o for i, o in enumerate(self.optimizers)} if fitting \
            else {}
        if ckpt.is_sharded_checkpoint(path):
            if optimizers:
                _check_optimizer_count(len(optimizers), ckpt.count_sharded_optimizers(path), path,
                                       lambda: saved_after_launch(path))
            return ckpt.load_sharded(path, lm, optimizers, strict=lm.strict_loading,
                                     weights_only=weights_only)
        checkpoint = ckpt.read_full(path, weights_only=weights_only)
        states = checkpoint.pop("optimizer_states", None)  # Lightning's layout: a list
        if optimizers and states is not None:
            _check_optimizer_count(len(optimizers), len(states), path,
                                   lambda: checkpoint.get(SAVED_AFTER_LAUNCH_KEY))
            checkpoint.update(zip(optimizers, states))
        else:
            optimizers = {}
        return ckpt.load_full(checkpoint, lm, optimizers, path=path, strict=lm.strict_loading)


_OPTIMIZER_HINT = ("Make sure to create the optimizer in the `configure_optimizers()` hook from "
                   "`self.parameters()` (or `self.trainer.model.parameters()`), not in "
                   "`__init__`: the strategy shards the model before it calls "
                   "`configure_optimizers()`.")


def _check_optimizer_count(configured: int, saved: int, path: Any = None,
                           saved_after_launch: Callable[[], Optional[str]] = lambda: None) -> None:
    if saved == 0 and configured > 0:
        start_method = saved_after_launch()
        if start_method:
            raise saved_after_launch_error(path, start_method)
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
