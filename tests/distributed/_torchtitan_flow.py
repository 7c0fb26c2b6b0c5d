"""torchtitan 0.3.0's own model-building and parallelize functions, with our ``fully_shard``.

What runs is torchtitan's code: its debug model configs (``model_registry("debugmodel")``),
``model_config.build()``, ``init_weights()`` and its ``parallelize_llama`` /
``parallelize_deepseekv3`` (``torchtitan.distributed.fsdp.apply_fsdp_to_decoder`` inside: list
groups, ``set_gradient_divide_factor(1.0)``, MoE ``shard_placement_fn``), as its trainer calls
them (``torchtitan/trainer.py``: build on meta, parallelize, ``to_empty``, ``init_weights``), with
``torchtitan.distributed.fsdp.fully_shard`` (the name it imported from torch) replaced by ours.
Three CPU shims, each for something this CPU-only machine lacks, none touching FSDP:

* ``torchtitan.distributed.parallel_dims.device_type = "cpu"`` (it builds its meshes on
  ``"cuda"`` when no accelerator is found);
* ``torchtitan.distributed.minimal_async_ep.kernels``: its Triton GPU kernels for expert
  parallelism, imported unconditionally by every model, never called at ``ep=1``; without
  ``triton`` installed, a module whose kernels raise if called stands in for it
  (``_torchtitan_helpers.import_torchtitan_models``);
* FlexAttention has no backward on CPU, so the configs' inner attention is torchtitan's own
  ``ScaledDotProductAttention`` (causal; the maskless backend its trainer supports).

Functions here run on ranks.
"""

from __future__ import annotations

import dataclasses
import tempfile
from typing import Any

import torch
import torch.distributed as dist

SEQ = 32
VOCAB_USED = 64  # tokens drawn from the first 64 ids: a short, learnable stream


def _cpu_shims() -> None:
    from tests.distributed._torchtitan_helpers import import_torchtitan_models

    import_torchtitan_models()  # a stand-in for its Triton kernels when triton is missing
    import torchtitan.distributed.parallel_dims as parallel_dims

    parallel_dims.device_type = "cpu"
    _gloo_uneven_all_to_all()


class _GlooDist:
    """``torch.distributed`` for ``spmd_types`` (its own patch point, ``spmd_types._dist.
    set_dist``) with ``all_to_all`` of uneven chunks, which gloo's ``alltoall`` refuses
    ("invalid tensor size"): the same exchange as one ``all_to_all_single`` with split sizes
    (gloo's alltoallv). torchtitan's token dispatcher sends each rank a different number of
    tokens under expert parallelism; NCCL takes the list form directly."""

    def __getattr__(self, name: str) -> Any:
        return getattr(dist, name)

    @staticmethod
    def all_to_all(outputs: list[torch.Tensor], inputs: list[torch.Tensor], group: Any = None,
                   async_op: bool = False) -> Any:
        assert not async_op, "spmd_types calls all_to_all synchronously"
        out = torch.empty((sum(o.shape[0] for o in outputs), *outputs[0].shape[1:]),
                          dtype=outputs[0].dtype, device=outputs[0].device)
        dist.all_to_all_single(out, torch.cat(inputs), [o.shape[0] for o in outputs],
                               [i.shape[0] for i in inputs], group=group)
        for o, piece in zip(outputs, out.split([o.shape[0] for o in outputs])):
            o.copy_(piece)
        return None


def _gloo_uneven_all_to_all() -> None:
    import spmd_types._dist

    if dist.get_backend() == "gloo":
        spmd_types._dist.set_dist(_GlooDist())


def _sdpa(config: Any, seen: set[int] | None = None) -> None:
    """Replace every ``FlexAttention.Config`` in ``config``'s tree by torchtitan's SDPA one."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    seen = set() if seen is None else seen
    if id(config) in seen or not dataclasses.is_dataclass(config):
        return
    seen.add(id(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if isinstance(value, FlexAttention.Config):
            setattr(config, f.name, ScaledDotProductAttention.Config())
        elif isinstance(value, (list, tuple)):
            for v in value:
                _sdpa(v, seen)
        else:
            _sdpa(value, seen)


def _spec(model: str) -> Any:
    """torchtitan's ``debugmodel`` spec of ``model``; ``"deepseek_v3:<n>"``: its first ``n``
    layers only (layer 0 dense, the others MoE), a cheaper run of the same code."""
    model, _, layers = model.partition(":")
    if model == "llama3":
        from torchtitan.models.llama3 import model_registry
    else:
        from torchtitan.models.deepseek_v3 import model_registry
    spec = model_registry("debugmodel")
    _sdpa(spec.model)
    if layers:
        spec.model.layers = spec.model.layers[:int(layers)]
    return spec


def use_vescale_fully_shard() -> None:
    """The README's recipe: torchtitan's ``apply_fsdp_to_decoder`` (behind every
    ``parallelize_*``) calls the ``fully_shard`` it imported from torch; give it ours."""
    import torchtitan.distributed.fsdp

    from lightning_vescale.fsdp import fully_shard

    torchtitan.distributed.fsdp.fully_shard = fully_shard


def _model_parallel(spec: Any, spmd_backend: str, world: int, ep: int, tp: int,
                    replicas: int = 1) -> Any:
    """What torchtitan's trainer does before building a model (``trainer.py``,
    ``Trainer.__init__``): ``dist_utils.set_spmd_backend`` and
    ``model_config.update_from_config`` (which sets the sharding configs that
    ``model.parallelize`` reads: the MoE experts become ``Shard(0)`` DTensors on ``"ep"``, the
    TP plan's weights DTensors on ``"tp"``), with a config-like object holding the
    ``ParallelismConfig`` (what ``Decoder.Config.update_from_config`` documents for non-trainer
    callers). Returns that config. Done for ``ep > 1``, ``tp > 1`` and the ``spmd_types``
    backend (torchtitan's default: its modules' sharding configs, which ``model.parallelize``
    applies, come from here), so the other ``ep=1``, ``tp=1`` flows stay the ones measured
    before (``full_dtensor`` with these configs wants DTensor inputs, which torchtitan's
    trainer builds from its batches)."""
    import types

    import torchtitan.distributed.utils as dist_utils
    from torchtitan.config import ParallelismConfig

    parallelism = ParallelismConfig(spmd_backend=spmd_backend, expert_parallel_degree=ep,
                                    tensor_parallel_degree=tp,
                                    data_parallel_replicate_degree=replicas,
                                    data_parallel_shard_degree=world // (tp * replicas))
    dist_utils.set_spmd_backend(spmd_backend)
    spec.model.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    return parallelism


def _batches(world: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB_USED, (2 * world, SEQ + 1), generator=g) for _ in range(2)]



def train(impl: str, model: str, flow: str = "cpu", spmd_backend: str = "partial_dtensor",
          steps: int = 20, ep: int = 1, with_init: bool = False, tp: int = 1,
          replicas: int = 1) -> dict[str, Any]:
    """``steps`` AdamW steps of torchtitan's ``model`` debug config at this world (every rank
    its part of a global batch), sharded by ``impl``'s ``fully_shard`` through torchtitan's
    ``parallelize_fn``; ``flow``: ``"cpu"`` (built and initialised on CPU, then sharded) or
    ``"meta"`` (torchtitan's trainer: meta, parallelize, ``to_empty``, ``init_weights``);
    ``ep``: torchtitan's expert-parallel degree (``dp_shard=world``, so ``efsdp=world/ep``);
    ``tp``: its tensor-parallel degree (``dp_shard=world/tp``; the ranks of one tp group read
    the same batch, and the vocab-sharded logits are gathered for the loss); ``replicas``: its
    ``dp_replicate`` degree (HSDP: ``dp_shard=world/(tp*replicas)``). Forward and backward run
    in torchtitan's ``train_context`` (``get_spmd_context``), as its trainer does (under
    ``spmd_types``: the current SPMD mesh its token dispatcher reads).
    Returns the global-mean losses and the final full parameters (``with_init``: the initial
    ones too, as ``"init"``)."""
    _cpu_shims()
    import torchtitan.distributed.fsdp
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    import torchtitan.distributed.utils as dist_utils
    from torchtitan.distributed import ParallelDims

    theirs = torchtitan.distributed.fsdp.fully_shard
    if impl == "ours":
        use_vescale_fully_shard()
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        spec = _spec(model)
        dims = ParallelDims(dp_replicate=replicas, dp_shard=world // (tp * replicas), cp=1,
                            tp=tp, pp=1, ep=ep, world_size=world, spmd_backend=spmd_backend)
        parallelism = ParallelismConfig(spmd_backend=spmd_backend) \
            if ep == tp == 1 and spmd_backend != "spmd_types" else \
            _model_parallel(spec, spmd_backend, world, ep, tp, replicas)
        torch.manual_seed(0)
        with torch.device("meta" if flow == "meta" else "cpu"):
            net = spec.model.build()
        if flow == "cpu":  # the seed again: both flows initialise from the same RNG state
            torch.manual_seed(0)
            with torch.no_grad():
                net.init_weights(buffer_device=None)
        with tempfile.TemporaryDirectory() as dump:
            net = spec.parallelize_fn(
                net, parallel_dims=dims,
                training=TrainingConfig(mixed_precision_param="float32", local_batch_size=2,
                                        seq_len=SEQ),
                parallelism=parallelism,
                compile_config=CompileConfig(), ac_config=None, dump_folder=dump)
        if impl == "torch":  # gloo has no PREMUL_SUM
            for m in net.modules():
                if isinstance(m, torch.distributed.fsdp.FSDPModule):
                    m.set_force_sum_reduction_for_comms(True)
        if flow == "meta":
            net.to_empty(device="cpu")
            torch.manual_seed(0)
            with torch.no_grad():
                net.init_weights(buffer_device=None)
        init = _full_params(net) if with_init else None
        net.train()
        opt = torch.optim.AdamW(net.parameters(), lr=8e-4)
        data = _batches(world)
        positions = torch.arange(SEQ).expand(2, SEQ)
        losses = []
        # torchtitan's Trainer.forward_backward_step runs both in its train_context (under
        # spmd_types: the current SPMD mesh its token dispatcher reads; otherwise a no-op)
        train_context = dist_utils.get_spmd_context(parallel_dims=dims)
        dp_rank = rank // tp  # tp is the innermost mesh dim
        for step in range(steps):
            tokens = data[step % len(data)][2 * dp_rank:2 * dp_rank + 2]
            with train_context():
                logits = net(tokens[:, :-1], positions=positions)
                if hasattr(logits, "full_tensor"):  # TP: vocab-sharded DTensor logits
                    logits = logits.full_tensor()
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                         tokens[:, 1:].flatten())
                loss.backward()
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
        params = _full_params(net)
        layouts = {n: (tuple(p.device_mesh.mesh_dim_names or ()),
                       tuple(type(pl).__name__ for pl in p.placements))
                   for n, p in net.named_parameters() if hasattr(p, "device_mesh")}
        return {"losses": losses, "params": params, "layouts": layouts, "init": init}
    finally:
        torchtitan.distributed.fsdp.fully_shard = theirs


def _full_params(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full value (a collective for DTensors: every rank calls it)."""
    return {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
            for n, p in net.named_parameters()}


def train_one_process(model: str, world: int, steps: int) -> list[float]:
    """The reference of :func:`train`: the same model, seed, global batches and AdamW in one
    process, without ``parallelize_fn``. torchtitan's ``set_gradient_divide_factor(1.0)``
    makes the sharded gradient the *sum* of the ranks' mean-loss gradients, i.e. ``world``
    times the gradient of the mean over the global batch (every rank has as many tokens), so
    the loss here is scaled by ``world`` before ``backward``. Returns the (unscaled) losses."""
    _cpu_shims()
    spec = _spec(model)
    torch.manual_seed(0)
    net = spec.model.build()
    torch.manual_seed(0)
    with torch.no_grad():
        net.init_weights(buffer_device=None)
    net.train()
    opt = torch.optim.AdamW(net.parameters(), lr=8e-4)
    data = _batches(world)
    positions = torch.arange(SEQ).expand(2 * world, SEQ)
    losses = []
    for step in range(steps):
        tokens = data[step % len(data)]
        logits = net(tokens[:, :-1], positions=positions)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                 tokens[:, 1:].flatten())
        (loss * world).backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
