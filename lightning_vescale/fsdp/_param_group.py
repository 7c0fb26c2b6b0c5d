"""One sharding group: the parameters of one ``fully_shard`` call, their DBuffers and swaps.

The group's gradient half (hooks, reduce-scatter, accumulation, publication) is the
:class:`~lightning_vescale.fsdp._param_group_grads.GroupGradients` mixin (design note
[fsdp-grads]); its parameter entries are :class:`~lightning_vescale.fsdp._managed_param.
ManagedParam` (design note [fsdp-param-objects]).

Design note [fsdp-buffer-order]
-------------------------------
Inside a DBuffer, parameters of two or more dims (weight matrices, embeddings) come first and
the others (biases, norm scales, scalars) after them, each in module order. The usual recipe
puts weight decay on the matrices only; with this order each of its two param groups is one
contiguous run per buffer, so the flat optimizer step and ``FlatParamOptimizer`` step 2 flat
tensors per group instead of one per parameter (on the 292-tensor GPT: 50 instead of 145).
The planner keeps the order it is given (design note in ``planner/_layout``); checkpoints are
keyed by parameter name and global boxes, so the order never shows outside a group.

One bucket (dtype, trainable[, quantized]) may become several DBuffers: its parameters whose
granularity keeps a whole matrix or more on one rank (``"matrix"`` experts) get a buffer of
their own, keyed like the bucket plus ``"matrix"`` (``(dtype, trainable[, True], "matrix")``),
or one each, keyed plus ``("matrix", name)``, when every additional buffer lowers the bucket's
padding by more than 1% of its elements. Planned behind the element-granular tensors, whole
experts cannot fill each rank's remainder (GPT-OSS-120B's blocks pad 24% at 64 ranks); planned
apart, both parts pad ~0%; DeepSeek-V3's stacks tile 256 ranks only in a buffer each. Each
buffer costs one more all-gather and reduce-scatter per group, hence the margin. The decision is
:func:`~lightning_vescale.planner.plan_buckets` (design note [plan-buckets]), the same function
the planner CLI and ``benchmarks/moe.py`` print; the order above holds inside each buffer.

Parameters that are frozen when the group is built (``requires_grad=False``: a frozen base
model under LoRA, say) go into a DBuffer of their own, which never allocates a gradient buffer
and is never reduce-scattered: gradient memory and reduce-scatter traffic follow the trainable
parameters only. Everything above is per buffer and per parameter, so a parameter unfrozen
later simply makes its buffer carry gradients from then on; no rebuild is needed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_vescale.dbuffer import CommHandle, DBuffer
from lightning_vescale.fsdp._collective_check import check_collective
from lightning_vescale.fsdp._comm_policy import CommPolicy
from lightning_vescale.fsdp._collective_check import enabled as collective_check_on
from lightning_vescale.fsdp._training_state import TrainingState
from lightning_vescale.fsdp._managed_param import _MODULE_SETATTR, ManagedParam, Owner, set_param
from lightning_vescale.fsdp._param_group_grads import BackwardRoot, GroupGradients
from lightning_vescale.fsdp._param_mesh import param_mesh_keys
from lightning_vescale.fsdp._policy import CPUOffloadPolicy, MixedPrecisionPolicy
from lightning_vescale.fsdp._replaced import mark_replaced
from lightning_vescale.fsdp._reshard import ReshardPolicy
from lightning_vescale.fsdp._subgroups import partial_group
from lightning_vescale.fsdp._tp import tp_unsharded
from lightning_vescale.mesh import MeshInfo
from lightning_vescale.placement import ragged_from_local
from lightning_vescale.planner import LayoutPlan, plan_buckets

__all__ = ["BackwardRoot", "ManagedParam", "Owner", "ParamGroup", "set_param"]


def sum_or_none(sizes: Iterable[int | None]) -> int | None:
    """The sum of ``sizes``; ``None`` if any is ``None`` or there are none."""
    total: int | None = None
    for n in sizes:
        if n is None:
            return None
        total = (total or 0) + n
    return total


class ParamGroup(GroupGradients):
    """The parameters of one ``fully_shard`` call, bucketed into DBuffers per dtype.

    Not a public constructor: :func:`lightning_vescale.fsdp.fully_shard` builds it. The
    strategy, optimizers and the memory profiler may read :attr:`params` and :attr:`buffers`.

    Args:
        params: the managed parameters (names relative to the group's module).
        mesh_info: the shard group (every DBuffer and DTensor of the group uses it).
        mp_policy: the user's policy, kept whole: DBuffer dtypes come from it.
        granularity: block size in elements per parameter name (resolved by ``fully_shard``).
        reshard_policy: what the group does with its gathered parameters after forward
            (design note [fsdp-reshard-policy]); ``set_reshard_after_forward`` replaces it.
        fqn: a label for buffer names and error messages.
        offload: ``CPUOffloadPolicy``: shards and sharded gradients in CPU memory.
        comm_policy: what the collectives carry (design note [comm-policy]), its block size
            resolved; ``quantized[name]``: whether the parameter all-gathers quantized.
    """

    def __init__(self, *, params: list[ManagedParam], mesh_info: MeshInfo,
                 mp_policy: MixedPrecisionPolicy, granularity: dict[str, int],
                 reshard_policy: ReshardPolicy, fqn: str = "",
                 offload: CPUOffloadPolicy | None = None, comm_policy: CommPolicy | None = None,
                 quantized: dict[str, bool] | None = None) -> None:
        self.fqn = fqn
        self.params = params
        self.mesh_info = mesh_info
        self.mp_policy = mp_policy
        self.granularity = granularity
        self.reshard_policy = reshard_policy
        self.offload = offload
        self.comm_policy = comm_policy
        self.quantized = quantized or {}
        self.reduce_grads = True  # set_requires_gradient_sync
        self.requires_all_reduce = True  # set_requires_all_reduce (HSDP)
        self.reduced_partially = False  # the last reduce skipped the replica all-reduce
        # FSDPModule setters (design note [fsdp-module] in _module.py)
        self.reshard_after_backward = True
        self.unshard_in_backward = True
        self.gradient_divide_factor: float | None = None  # None: the shard-group size (AVG)
        self.force_sum_reduction = False
        #: FSDP2's ``set_reduce_scatter_unused_params(True)``: every trainable parameter gets a
        #: gradient after a backward that reduced the group (zeros where no rank computed one),
        #: so the root needs no flag all-reduce for it (design note [fsdp-final-callback])
        self.grads_for_unused = False
        self.explicit_backward_prefetch: list[ParamGroup] | None = None
        # list groups: (the ``_apply`` function, modules of the list it reached) of the last pass
        self.applying: tuple[Any, set[int]] | None = None
        # One DBuffer per (dtype, trainable at build time); see design note [fsdp-grads]. The
        # tensors a CommPolicy quantizes get their own, keyed (dtype, trainable, True): see
        # design note [comm-policy]. Whole-matrix tensors may get their own, the key plus
        # "matrix" (or one each, plus ("matrix", name)): see design note [fsdp-buffer-order].
        self.buffers: dict[tuple, DBuffer] = {}
        self.modules_hold_unsharded = False
        self._gather: list[CommHandle] | None = None  # in-flight all-gathers
        self._reduce: list[CommHandle] | None = None  # in-flight reduce-scatters
        self._num_trainable = 0
        # -- backward bookkeeping (design note [fsdp-grads]) --
        self.root: BackwardRoot | None = None  # set by the root's lazy init
        self.training_state = TrainingState.IDLE
        # Structural (the same on every rank): the group's gradients must be reduced since it
        # ran forward with grad / was recomputed with grad / got output gradients.
        self.needs_reduce = False
        self.reduced = False  # reduce-scattered in the current backward
        self._grads_ready = False  # grad_full materialised and unsharded .grads point at it
        self._arrived = 0  # trainable parameters that received a gradient in this backward
        self._backward_prefetched = False
        self._rs_bytes: int | None = None  # fused_reduce_bytes, 0 if not fused; at the 1st reduce
        # -- the opt-in collective check (design note [fsdp-collective-check]) --
        self.index = -1  # position in the root's tree, set by its lazy init
        self.module_fqn = fqn  # the module's FQN relative to the root, set by its lazy init
        self.module_fqns: list[str] = []  # those of every module of a list group, likewise
        self.collectives = 0  # collectives checked so far

    # -- construction --------------------------------------------------------------------------
    def build(self, sources: dict[str, torch.Tensor], device: torch.device,
              local_sources: bool = False) -> None:
        """(Re)create DBuffers on ``device`` and both parameter objects of every parameter.

        ``sources[name]`` provides each parameter's data and dtype: the full tensor (global
        shape), or with ``local_sources`` the rank's 1-D local part. Meta sources copy nothing.
        """
        for mp in self.params:
            self._remove_grad_hooks(mp)
        self.buffers = {}
        policy, comm = self.mp_policy, self.comm_policy
        for (dtype, trainable, quantized), suffix, mps, plan in self._bucket_plans(sources):
            if dtype.is_floating_point:
                pdt = policy.param_dtype if policy.param_dtype is not None else dtype
                rdt = policy.reduce_dtype if policy.reduce_dtype is not None else pdt
            else:  # integer/bool parameters (never trainable) keep their dtype: no cast
                pdt = rdt = dtype
            label = (f"{dtype}{'' if trainable else ', frozen'}{', quantized' if quantized else ''}"
                     f"{''.join(f', {part}' for part in suffix)}")
            buf = DBuffer(plan, dtype=dtype, device=device, mesh_info=self.mesh_of(mps[0]),
                          param_dtype=pdt, reduce_dtype=rdt,
                          name=f"{self.fqn or '<root>'}[{label}]",
                          offload=self.offload is not None,
                          pin_memory=self.offload is not None and self.offload.pin_memory,
                          quantize=comm.all_gather if quantized and comm else None,
                          quant_block_size=(comm.block_size or 0) if comm else 0,
                          wire_dtype=(comm.reduce_scatter_dtype if comm and trainable
                                      and dtype.is_floating_point else None))
            if buf.quantized is not None:  # the root checks its marks once per forward
                buf.quantized.defer_check = True  # ([quantized-degenerate-blocks])
            key = (dtype, trainable, True) if quantized else (dtype, trainable)
            self.buffers[(*key, *suffix)] = buf
            for mp in mps:
                mp.buffer = buf
                src = sources[mp.name]
                if src.device.type != "meta" and device.type != "meta":
                    with torch.no_grad():
                        if local_sources:
                            buf.local_view(mp.name).copy_(src.reshape(-1))
                        else:
                            buf.load_local_(mp.name, src)
                self._make_param_objects(mp)
        self._arrived = 0
        self._count_trainable()
        self._grads_ready = False
        self.modules_hold_unsharded = False
        self._gather = None
        self._reduce = None
        self.swap(sharded=True)

    def _bucket_plans(self, sources: dict[str, torch.Tensor]
                      ) -> list[tuple[tuple[torch.dtype, bool, bool], tuple[str, ...],
                                      list[ManagedParam], LayoutPlan]]:
        """``((dtype, trainable, quantized), key suffix, params in buffer order, plan)`` per
        DBuffer: one bucket per ``(dtype, trainable, quantized)`` in [fsdp-buffer-order], split
        (its whole-matrix parameters together, suffix ``("matrix",)``, or one buffer each,
        ``("matrix", name)``) when :func:`~lightning_vescale.planner.plan_buckets` says so
        (design note [plan-buckets])."""
        buckets: dict[tuple, list[ManagedParam]] = {}
        mesh_keys = param_mesh_keys(self.params)  # design note [fsdp-param-mesh]
        for mp in self.params:
            key = (sources[mp.name].dtype, mp.requires_grad, self.quantized.get(mp.name, False),
                   mesh_keys.get(mp.name, ()))
            buckets.setdefault(key, []).append(mp)
        out = []
        for (*key, mesh_key), mps in buckets.items():
            mps = sorted(mps, key=lambda mp: len(mp.shape) < 2)  # [fsdp-buffer-order]
            specs = [(mp.name, mp.shape, self.granularity[mp.name]) for mp in mps]
            by_name = {mp.name: mp for mp in mps}
            decided = plan_buckets(specs, self.mesh_of(mps[0]).shard_size)
            for suffix, plan in zip(decided.suffixes, decided.plans, strict=True):
                out.append((tuple(key), (*mesh_key, *suffix),
                            [by_name[n] for n in plan.names], plan))
        return out

    def mesh_of(self, mp: ManagedParam) -> MeshInfo:
        """The mesh ``mp``'s DBuffer shards over: its own (design note [fsdp-param-mesh]) or
        the group's."""
        return self.mesh_info if mp.mesh_info is None else mp.mesh_info

    def _make_param_objects(self, mp: ManagedParam) -> None:
        buf = mp.buffer
        assert buf is not None
        if mp.sharded is not None:  # a rebuild: an optimizer holding the old one trains nothing
            mark_replaced(mp.sharded, f"{self.fqn}.{mp.name}" if self.fqn else mp.name,
                          original=False)
        local = buf.local_view(mp.name)
        mesh_info = self.mesh_of(mp)
        mp.placements = mesh_info.placements(buf.placement(mp.name))
        if mp.tp is not None:  # (RaggedShard, <tp placement>): design note [fsdp-tp]
            mp.placements = (*mp.placements, *mp.tp.placements)
        mesh, shape, stride = mp.dtensor_meta(mesh_info.mesh)
        dt = ragged_from_local(local, mesh, mp.placements, shape, stride,
                               autograd=False, check=False)
        mp.sharded = nn.Parameter(dt, requires_grad=mp.requires_grad)
        if mp.tp is not None:
            mp.unsharded = tp_unsharded(buf.param_view(mp.name), mp.tp, mp.requires_grad)
        else:
            mp.unsharded = nn.Parameter(buf.param_view(mp.name), requires_grad=mp.requires_grad)
        mp.got_grad = False
        if not buf.is_meta and mp.requires_grad:
            self._register_grad_hooks(mp)

    def sync_requires_grad(self) -> None:
        """Follow ``requires_grad_`` calls users made on the sharded parameters (every root
        pre-forward: one attribute compare per parameter while nothing changed)."""
        changed = False
        for mp in self.params:
            sharded = mp.sharded
            assert sharded is not None and mp.unsharded is not None
            rg = sharded.requires_grad
            if rg != mp.requires_grad:
                changed = True
                mp.requires_grad = rg
                mp.unsharded.requires_grad_(rg)
                self._remove_grad_hooks(mp)
                if rg:
                    self._register_grad_hooks(mp)
        if changed:
            self._count_trainable()

    def adopt_replaced_params(self) -> None:
        """Make parameters the user replaced on the modules since ``fully_shard`` the group's
        again, with their new values: FSDP2's ``reset_sharded_param`` at lazy init (design note
        [fsdp-materialize]; e.g. ``model.w = nn.Parameter(...)`` computed from materialised
        layers between a meta-device ``fully_shard`` and the first forward).

        Raises:
            ValueError: a new parameter's shape (or, in a materialised group, dtype) differs.
            RuntimeError: a new parameter is on the meta device, or a meta group would keep
                parameters that were neither replaced nor materialised.
        """
        replaced = {mp.name: p for mp in self.params if (p := self._replaced_by(mp)) is not None}
        if not replaced:
            return
        news = {}
        for mp in self.params:
            if mp.name in replaced:
                news[mp.name] = self._replacement_data(mp, replaced[mp.name])
                mp.requires_grad = replaced[mp.name].requires_grad
        self._count_trainable()
        if any(buf.is_meta for buf in self.buffers.values()):
            left = [mp.name for mp in self.params if mp.name not in news]
            if left:
                raise RuntimeError(
                    f"fully_shard({self.fqn}): parameters {sorted(replaced)} were replaced but "
                    f"{left} are still on the meta device; materialise the module "
                    "(module.to_empty(device=...) or lightning_vescale.fsdp.materialize) or "
                    "replace them too before the first forward.")
            self.build(news, next(iter(news.values())).device)  # registers the new objects
            return
        for name, data in news.items():
            mp = next(m for m in self.params if m.name == name)
            assert mp.buffer is not None and mp.sharded is not None
            mp.buffer.load_local_(name, data.to(mp.buffer.shard_device))
            mp.sharded.requires_grad_(mp.requires_grad)
        self.swap(sharded=True)

    def check_views(self) -> None:
        """Raise if a sharded parameter no longer views its DBuffer (design note
        [fsdp-list-apply]): the optimizer would step a tensor the forward never reads, and
        nothing would train, silently. Checked once, at the root's lazy init.

        Raises:
            RuntimeError: naming the parameter, e.g. after ``torch.utils.swap_tensors`` or a
                ``.data =`` assignment on it.
        """
        for mp in self.params:
            buf, p = mp.buffer, mp.sharded
            if buf is None or p is None or buf.is_meta:
                continue
            local, view = p.detach(), buf.local_view(mp.name)
            if isinstance(local, DTensor):
                local = local._local_tensor
            if view.numel() and (local.data_ptr() != view.data_ptr()
                                 or local.dtype != view.dtype):
                raise RuntimeError(
                    f"fully_shard: parameter {self.param_fqn(mp)!r} no longer views its group's "
                    "DBuffer (its data was swapped or reassigned after fully_shard), so an "
                    "optimizer step would never reach the forward. Change sharded parameters "
                    "in place (copy_, normal_, ...), through module.to()/to_empty(), or "
                    "replace the parameter on its module (module.weight = nn.Parameter(...)).")

    @staticmethod
    def _replaced_by(mp: ManagedParam) -> nn.Parameter | None:
        for owner in mp.owners:
            current = owner.module._parameters.get(owner.attr)
            if current is not None and current is not mp.sharded and current is not mp.unsharded:
                return current
        return None

    def param_fqn(self, mp: ManagedParam) -> str:
        """``mp``'s name relative to the root module (for messages; after lazy init), a list
        group's parameters under their own module's name."""
        if len(self.module_fqns) > 1 and mp.scoped_aliases:
            k, rel = mp.scoped_aliases[0]
            return f"{self.module_fqns[k]}.{rel}" if self.module_fqns[k] else rel
        prefix = "" if self.module_fqn in ("", "<root>") else f"{self.module_fqn}."
        return prefix + mp.name

    def _replacement_data(self, mp: ManagedParam, new: nn.Parameter) -> torch.Tensor:
        """The full value of ``new`` (a DTensor is gathered: every rank replaced it alike)."""
        data = new.detach()
        if isinstance(data, DTensor):
            data = data.full_tensor()
        name = self.param_fqn(mp)
        if tuple(data.shape) != tuple(mp.shape):
            raise ValueError(f"fully_shard: parameter {name!r} was replaced by one of shape "
                             f"{tuple(data.shape)}, but its group was planned for {mp.shape}; "
                             "keep the shape (or replace it before calling fully_shard).")
        if data.is_meta:
            raise RuntimeError(f"fully_shard: parameter {name!r} was replaced by a meta tensor; "
                               "give it values before the first forward.")
        buf = mp.buffer
        if buf is not None and not buf.is_meta and data.dtype != buf.dtype:
            raise ValueError(f"fully_shard: parameter {name!r} was replaced by one of dtype "
                             f"{data.dtype}, but its group holds {buf.dtype}; keep the dtype.")
        return data

    def _count_trainable(self) -> None:
        self._num_trainable = sum(1 for mp in self.params if mp.requires_grad)

    # -- unshard / reshard ----------------------------------------------------------------------
    def swap(self, *, sharded: bool) -> None:
        """Register the sharded (or the unsharded) parameter objects in every owner module."""
        for mp in self.params:  # set_param inlined: four calls per group and step
            p = mp.sharded if sharded else mp.unsharded
            assert p is not None
            for module, attr in mp.owners:
                if type(module).__setattr__ is _MODULE_SETATTR:
                    module._parameters[attr] = p
                else:
                    set_param(module, attr, p)
        self.modules_hold_unsharded = not sharded

    @property
    def is_unsharded(self) -> bool:
        """True while modules hold the unsharded parameters or an all-gather for them is in
        flight (a prefetch): :meth:`unshard` has nothing left to start."""
        return self.modules_hold_unsharded or self._gather is not None

    def unshard(self, async_op: bool = False) -> None:
        """Start (or run) the all-gather of every buffer; no-op if already (being) unsharded."""
        if self.is_unsharded:
            if not async_op:
                self.wait_for_unshard()
            return
        self.check_collective("all-gather")
        self._gather = [buf.all_gather(async_op=async_op) for buf in self.buffers.values()]
        if not async_op:
            self.wait_for_unshard()

    @property
    def fused_reduce_bytes(self) -> int | None:
        """The bytes of the group's reduce-scatter when every buffer's is queued to leave with
        the next small gloo collective (design note [gloo-fused-exchange]), else ``None``: the
        root then issues it asynchronously, also on CPU, and keeps several in flight within one
        exchange's bytes (design note [fsdp-gloo-fusion]). Decided once, at the first reduce
        (inside ``unfused()`` for a model built and trained there)."""
        if self._rs_bytes is None:
            self._rs_bytes = sum_or_none(b.fused_reduce_bytes for b in self.buffers.values()) or 0
        return self._rs_bytes or None

    @property
    def fuses_reduce_scatter(self) -> bool:
        """Whether the reduce-scatter is queued (:attr:`fused_reduce_bytes` is not ``None``)."""
        return bool(self._rs_bytes if self._rs_bytes is not None else self.fused_reduce_bytes)

    @property
    def fused_gather_bytes(self) -> int | None:
        """The bytes this group's all-gathers unshard when every one of them is queued with
        other small gloo collectives (design note [gloo-fused-exchange]), else ``None``: the
        forward prefetch gathers such groups ahead by bytes (design note [fsdp-gloo-fusion])."""
        return sum_or_none(b.fused_gather_bytes for b in self.buffers.values())

    def check_collective(self, kind: str) -> None:
        """With the opt-in check on, make sure every rank runs this collective of this group
        (design note [fsdp-collective-check]); a no-op before lazy init and when off."""
        if self.root is None or self.index < 0 or not self.buffers or not collective_check_on():
            return
        self.collectives += 1
        groups = self.root.groups
        check_collective(kind, self.index, self.collectives, group=self.mesh_info.shard_group,
                         device=next(iter(self.buffers.values())).device,
                         name_of=lambda i: groups[i].module_fqn)

    def wait_for_unshard(self) -> None:
        """Finish an in-flight all-gather and register the unsharded parameters."""
        self._wait_for_gather()
        if not self.modules_hold_unsharded:
            self.swap(sharded=False)

    def reshard(self) -> None:
        """Free the unsharded storage and register the sharded parameters."""
        self._wait_for_gather()
        for buf in self.buffers.values():
            buf.free()
        if self.modules_hold_unsharded:
            self.swap(sharded=True)

    def reshard_after_forward_now(self, ranks: int) -> None:
        """The post-forward reshard: stay sharded over ``ranks`` ranks, i.e. all of them
        (reshard), ``1`` (keep everything gathered), or groups of ``k`` (design note
        [dbuffer-memory]'s ``partial``). ``ranks`` comes from
        :meth:`ReshardPolicy.ranks_after_forward` (design note [fsdp-reshard-policy])."""
        if ranks >= self.mesh_info.shard_size:
            self.reshard()
        elif ranks > 1:
            group, rank = partial_group(self.mesh_info, ranks)
            self._wait_for_gather()
            for buf in self.buffers.values():
                buf.reshard_to(group, ranks, rank)
            if self.modules_hold_unsharded:
                self.swap(sharded=True)

    @property
    def has_partial(self) -> bool:
        """Whether a buffer keeps a ``reshard_after_forward=<int>`` chunk."""
        return any(buf.partial is not None for buf in self.buffers.values())

    def _wait_for_gather(self) -> None:
        if self._gather is not None:
            for h in self._gather:
                h.wait()
            self._gather = None

    def pre_backward(self) -> None:
        """A gradient reached the group's outputs: unshard for backward."""
        self.training_state = TrainingState.PRE_BACKWARD
        # E.g. a second backward through a retained graph after the first one reduced the
        # group: this backward's gradients must be reduced too.
        self.expect_gradients()
        if self.unshard_in_backward:
            self.unshard()
            self.wait_for_unshard()
        if self._num_trainable == 0 or self.explicit_backward_prefetch is not None:
            self.prefetch_backward_once()  # else when half of the gradients arrived

    def post_backward(self) -> None:
        """The group's backward is complete (on every rank at this point): reshard.

        A backward prefetch the gradient arrivals did not trigger yet is issued first, so every
        rank issues the next group's all-gather before this group's reduce-scatter; the caller
        then reduces if :meth:`should_reduce`.
        """
        self.training_state = TrainingState.POST_BACKWARD
        self.prefetch_backward_once()
        if self.reshard_after_backward:
            self.reshard()  # parameters are done: free them before the reduce-scatter runs

    def prefetch_backward_once(self) -> None:
        """Ask the root to all-gather the next group in backward order, once per backward."""
        if self._backward_prefetched or self.root is None:
            return
        self._backward_prefetched = True
        if self.explicit_backward_prefetch is not None:  # set_modules_to_backward_prefetch
            for group in self.explicit_backward_prefetch:
                if group.training_state is TrainingState.IDLE and group.unshard_in_backward:
                    group.unshard(async_op=True)
            return
        self.root.prefetch_backward(self)

    def reset_backward(self) -> None:
        """Forget this iteration's backward (the end of a backward, or the root's pre-forward)."""
        self.training_state = TrainingState.IDLE
        self._arrived = 0
        self.reduced = False
        self._backward_prefetched = False
        for mp in self.params:
            mp.hooks_ran = False  # design note [fsdp-post-acc-grad-hooks]
