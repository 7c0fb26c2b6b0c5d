"""The root context: root-only state of one sharded module tree (FSDP2's ``FSDPStateContext``).

Every :class:`~lightning_vescale.fsdp._state.FSDPState` starts with a :class:`RootContext` of its
own; the first state whose forward runs becomes the root and makes every state and group of its
tree use its context (design note [fsdp-schedule]).

Design note [fsdp-final-callback]
---------------------------------
A final autograd-engine callback, queued by the root at the first backward hook, handles the
groups without a structural completion (the root, whose inputs are token ids; a block whose
input does not require grad; a block under reentrant activation checkpointing), in tree order:
it reduce-scatters each group that needs it, waits for everything and reshards all. A group
needs a reduce when, since its last one, its forward ran with grad, its forward was recomputed
with grad inside backward (reentrant checkpointing), or a gradient reached its outputs (a second
backward through a retained graph). All three are structural, so every rank reduces the same
groups; whether a group reduces, at its structural completion or in the final callback, is
decided by :meth:`ParamGroup.should_reduce` alone. Then one small all-reduce (MAX) of the
"received a gradient" flags tells every rank which parameters received one on *any* rank:
exactly those get a sharded gradient, as in single-process training over the global batch
(:meth:`RootContext._publish_grads`). A rank whose flags are all set already knows the answer:
it leaves that all-reduce in flight (no host sync at the end of backward) and finishes it at the
next root pre-forward, where a ``set_post_optim_event`` event is also waited on. A rank that
lacks a gradient (an expert that got no tokens here) must read the result before the backward
returns: whether its ``.grad`` is ``None`` or zeros decides which collectives code between
backward and step runs (``clip_grad_norm_`` reduces over exactly the parameters with a
gradient), so deferring that read to the optimizer would let the ranks diverge. That host sync
happens only on such ranks, only in such backwards (FSDP2 by default reduce-scatters different
parameter sets on such ranks instead: a mismatch, or a hang). Groups set with
``set_reduce_scatter_unused_params(True)`` take FSDP2's answer instead: every trainable
parameter gets a gradient, zeros where no rank computed one, and no flag is exchanged for them
(no all-reduce, no host sync). Forward and backward orders are recorded on the first
iteration. A forward that runs *inside* backward (activation-checkpointing recompute,
detected with ``torch._C._current_graph_task_id()``) leaves the group unsharded and registers
nothing. No-grad/inference forwards reshard every group at the root's post-forward.

Design note [fsdp-gloo-fusion]
------------------------------
On gloo, small DBuffer collectives are queued and leave together as one all-to-all when one of
them is waited (design note [gloo-fused-exchange]); each such exchange is a rendezvous of every
rank, and at toy sizes their count, not their bytes, sets the step time. Four choices of the
schedule let the collectives meet. Each applies only to collectives that are queued (gloo, CPU
tensors, at most ``FUSE_MAX_BYTES``, "the budget", 1 MiB), so an accelerator, a large model
and ``unfused()`` keep the schedule of FSDP2:

* **gather ahead**: a group's pre-forward issues its own all-gather (asynchronously), then its
  forward prefetch, and only then waits. The prefetch goes past the next group while the groups
  it starts are queued, reshard ``auto`` (an explicit ``True`` asks for FSDP2's memory
  schedule) and their gathered bytes fit the budget (:meth:`RootContext.prefetch_forward`): a
  small model's root and blocks gather in one exchange. At most the budget's bytes are gathered
  ahead of what FSDP2 gathers.
* **keep into backward**: ``auto`` resharding ([fsdp-reshard-policy]) keeps the last group of
  the forward gathered, and here also the groups before it whose gathered bytes together fit
  the budget (:meth:`RootContext.keeps_into_backward`): their backward needs no all-gather.
  At most the budget's bytes stay gathered beyond the last group.
* **reduce together**: a structural reduce-scatter whose buffers are all queued
  (:attr:`ParamGroup.fuses_reduce_scatter`) is asynchronous on CPU too
  (:meth:`RootContext.reduce_async`), and several stay in flight while their gradient bytes fit
  the budget (:meth:`RootContext._joins_inflight`; an accelerator keeps one): they leave with
  the next backward all-gather or with the final callback's exchange.
* **flags with them**: the final callback issues the reduce-scatters of the groups it completes
  and the gradient-flag all-reduce (:meth:`RootContext._start_fused_flags`) before it waits for
  any, so they leave with those still in flight. The flags are then waited for on every rank
  inside the callback (they cost no rendezvous of their own), where the unfused path leaves
  them in flight on ranks that do not need them ([fsdp-final-callback]); on one rank only, a
  queued handle's wait would issue the exchange on that rank alone.

A root and two blocks then issue 2 exchanges per step instead of 8 (forward: the three
all-gathers; the final callback: three reduce-scatters and the flags), DDP's step time within
noise at toy sizes (``benchmarks/RESULTS_trainer_vs_ddp.md``), bitwise the same training
(``tests/distributed/test_gloo_exchange.py``, which also pins the budget's limits with four
blocks). When a group's collectives are too large to be queued, the final callback keeps the
order above it ("in tree order, each reduce then waited").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable
from lightning_vescale._labels import label

from lightning_vescale._dbuffer_comm import gloo_serves
from lightning_vescale._dbuffer_quant import any_unread, check_gathers
from lightning_vescale._gloo_exchange import fusable, submit_max_all_reduce
import lightning_vescale._gloo_exchange as gloo_exchange
from lightning_vescale._pinned import host_source
from lightning_vescale.fsdp._collective_check import check_collective
from lightning_vescale.fsdp._collective_check import enabled as collective_check_on
from lightning_vescale.fsdp._extensions import check_group_for_all_gather_extension
from lightning_vescale.fsdp._training_state import TrainingState
from lightning_vescale.fsdp._param_group import ParamGroup, sum_or_none

if TYPE_CHECKING:  # annotations only: _state imports this module
    from lightning_vescale.fsdp._state import FSDPState

__all__ = ["ATTR", "RootContext", "get_state", "states_in"]

# The state lives in the module's __dict__ (not in a weak-keyed registry: the state refers back
# to the module, so a registry value would keep every sharded model alive forever).
ATTR = "_lv_fsdp_state"


def get_state(module: nn.Module) -> "FSDPState | None":
    """The :class:`FSDPState` of a ``fully_shard``-ed module, or ``None``."""
    return module.__dict__.get(ATTR)


def states_in(module: nn.Module) -> list["FSDPState"]:
    """States of ``module`` and its submodules, in ``module.modules()`` order, each once (the
    modules of one ``fully_shard([a, b])`` call share one state)."""
    out: list[FSDPState] = []
    seen: set[int] = set()
    for m in module.modules():
        st = m.__dict__.get(ATTR)
        if st is not None and id(st) not in seen:
            seen.add(id(st))
            out.append(st)
    return out


def _ahead_bytes(group: ParamGroup | None) -> int | None:
    """The gathered bytes of a group that the schedule may gather ahead of its forward or keep
    into backward ([fsdp-gloo-fusion]): ``auto`` resharding (an explicit ``True`` asks for
    FSDP2's memory schedule) and every all-gather queued for the fused exchange; else ``None``."""
    if group is None or group.reshard_policy.mode != "auto":
        return None
    return group.fused_gather_bytes


class RootContext:
    """Root-only state of one sharded module tree, shared by all its states (FSDP2's
    ``FSDPStateContext``; design note [fsdp-schedule]).

    Every state starts with a context of its own (it may become a root); the root's lazy init
    (:meth:`adopt`) makes every state of its tree, and every group, use the root's.
    """

    def __init__(self) -> None:
        self.root: FSDPState | None = None  # None until a root adopted this context
        self.all_states: list[FSDPState] = []  # the root's tree, in modules() order
        self.groups: list[ParamGroup] = []  # their groups, same order
        # Recorded on the first iteration; prefetching follows them from the second one.
        self.forward_order: list[FSDPState] = []
        self.backward_order: list[FSDPState] = []
        self.forward_recorded = False
        self.backward_recorded = False
        self.prefetch = True  # set_prefetch (a root setting)
        self.final_callback_queued = False
        #: reduce-scatters in flight: one on an accelerator; on gloo, queued ones up to one
        #: exchange's bytes ([fsdp-gloo-fusion])
        self.inflight_reduces: list[ParamGroup] = []
        #: set_post_optim_event: waited on (then dropped) at the next root pre-forward
        self.post_optim_event: torch.Event | None = None
        #: the gradient-flag all-reduce of a backward whose result this rank did not need
        #: (every flag was set here): finished at the next root pre-forward, no host sync
        self.pending_flags: tuple[Any, torch.Tensor] | None = None
        #: per recorded order (by id): (the order, its length, {id(state or group): index})
        self._positions: dict[int, tuple[list, int, dict[int, int]]] = {}
        #: keeps_into_backward: the states kept, for (order length, FUSE_MAX_BYTES)
        self._tail_key: tuple[int, int] | None = None
        self._tail: set[int] = set()

    # -- lazy init and the root's forward ------------------------------------------------------
    def adopt(self, root: FSDPState) -> None:
        """Make ``root`` the root of its module tree: every state and group there uses us."""
        with label("vescale::lazy_init"):
            if len(root.modules) > 1:
                raise RuntimeError(
                    f"fully_shard needs a single root module, but the first forward ran in a "
                    f"module of the list group {[type(m).__name__ for m in root.modules]}; call "
                    "fully_shard on their common ancestor (the model) too, as with FSDP2.")
            self.root = root
            self.all_states = states_in(root.module)
            self.groups = [st.group for st in self.all_states if st.group is not None]
            for st in self.all_states:
                st.ctx = self  # an inner module that ran forward alone before is demoted
            paths = {id(m): name for name, m in root.module.named_modules()}
            for st in self.all_states:
                if st.group is not None:
                    st.group.module_fqn = paths.get(id(st.module)) or "<root>"
                    st.group.module_fqns = [paths.get(id(m)) or "" for m in st.modules]
            for i, group in enumerate(self.groups):
                group.root = self
                group.index = i
                group.adopt_replaced_params()  # FSDP2's reset_sharded_param
                group.check_views()
                check_group_for_all_gather_extension(group)  # [fsdp-all-gather-extension]
                group.sync_requires_grad()

    def root_pre_forward(self) -> None:
        """Start an iteration from the sharded state, whatever the last one left behind."""
        with label("vescale::root_pre_forward"):
            # set_post_optim_event: the optimizer ran on another stream; what is issued from
            # here on (the all-gathers, the offloaded shards' copies) waits for it (FSDP2)
            event, self.post_optim_event = self.post_optim_event, None
            if event is not None:
                event.wait()
            self.finish_flags()
            # A backward began (its first hook queued the final callback) and never reached
            # the callback: it raised. Forget it. Otherwise the last backward's callback already
            # forgot everything, or no backward ran since the last forward: several forwards
            # before one backward keep counting their uses (design note [fsdp-multi-forward]).
            interrupted = self.final_callback_queued
            self.finish_reduce(hooks=not interrupted)
            self.final_callback_queued = False
            if interrupted:
                self.forget_iteration()
            for st in self.all_states:
                st._pending = set()  # a list group that ran partly in the last forward
            for group in self.groups:
                # A forward whose output never went through backward (e.g. a loss computed
                # twice, or an evaluation with grad enabled) leaves the root (and groups with
                # reshard_after_forward=False) unsharded. Their full parameters would be stale
                # once the optimizer or load_state_dict changes the shards, so start every
                # iteration from the sharded state (a no-op after a normal backward).
                if (group.is_unsharded and group.reshard_after_backward) or group.has_partial:
                    group.reshard()
                group.sync_requires_grad()
                group.release_unused_grad_shards()

    def check_quantized(self) -> None:
        """Raise, on every rank alike, if a quantized all-gather since the last check carried
        a degenerate block: one host read for all of them (the root's post-forward calls it;
        design note [quantized-degenerate-blocks]). Nothing to do (the common case, no
        ``CommPolicy``): no walk over the groups."""
        if not any_unread():
            return
        check_gathers([buf.quantized for group in self.groups for buf in group.buffers.values()
                       if buf.quantized is not None])

    def reset_iteration(self) -> None:
        """``reset_iter_state()``: after a forward or backward raised, wait for collectives,
        reshard every group, drop the iteration's (and any unsynced) gradients and forget where
        every state was (FSDP2's recovery contract)."""
        self.finish_flags()
        self.finish_reduce(hooks=False)
        self.final_callback_queued = False
        self.forget_iteration()
        for st in self.all_states:
            st._forward_depth = 0
        for group in self.groups:
            group.reshard()
            group.discard_gradients()

    def forget_iteration(self) -> None:
        """Every state and group back to ``IDLE``, without backward bookkeeping: the end of a
        backward, the root's pre-forward and ``reset_iter_state()`` (design note
        [fsdp-training-state])."""
        for st in self.all_states:
            st.training_state = TrainingState.IDLE
            st.reset_post_backward()
        for group in self.groups:
            group.reset_backward()

    def record_forward(self, state: FSDPState) -> None:
        if not self.forward_recorded and state not in self.forward_order:
            self.forward_order.append(state)

    def record_backward(self, state: FSDPState) -> None:
        if not self.backward_recorded and state not in self.backward_order:
            self.backward_order.append(state)

    def keeps_into_backward(self, state: FSDPState) -> bool:
        """``auto`` ([fsdp-reshard-policy]): whether ``state``'s group keeps its parameters
        after forward: the last group of the recorded forward order, and on gloo the groups
        before it whose gathered bytes together fit one fused exchange ([fsdp-gloo-fusion])."""
        order = self.forward_order
        if not (self.forward_recorded and order):
            return False
        budget = gloo_exchange.FUSE_MAX_BYTES  # -1 in unfused(): nothing fits
        if self._tail_key != (len(order), budget):
            self._tail_key, self._tail = (len(order), budget), {id(order[-1])}
            for st in reversed(order[:-1]):
                if st.group is None:
                    continue
                nbytes = _ahead_bytes(st.group)
                if nbytes is None or nbytes > budget:
                    break
                budget -= nbytes
                self._tail.add(id(st))
        return id(state) in self._tail

    def reshard_all(self) -> None:
        """Inference (no backward follows): leave nothing unsharded."""
        for group in self.groups:
            group.reshard()

    # -- prefetch -------------------------------------------------------------------------------
    def prefetch_forward(self, state: FSDPState) -> None:
        """All-gather (async) the group that follows ``state`` in the recorded forward order,
        and on gloo the small ones after it that fit one exchange (design note
        [fsdp-gloo-fusion])."""
        if self.forward_recorded and self.prefetch:
            self._unshard_next(self.forward_order, state, skip_started=False,
                               ahead_bytes=gloo_exchange.FUSE_MAX_BYTES)

    def prefetch_backward(self, unit: FSDPState | ParamGroup) -> None:
        """All-gather (async) the first group after ``unit`` (a state, or a state's group) in
        the recorded backward order that has not begun its backward."""
        if self.backward_recorded and self.prefetch:
            self._unshard_next(self.backward_order, unit, skip_started=True)

    def _unshard_next(self, order: list[FSDPState], unit: FSDPState | ParamGroup,
                      skip_started: bool, ahead_bytes: int = 0) -> None:
        """All-gather (async) the next group of ``order`` after ``unit``; then, while each one
        started here is queued for the fused exchange and their bytes stay within
        ``ahead_bytes``, the groups after it too. A next group already gathered or in flight
        ends the walk (a lookahead before this one started it and what follows)."""
        pos = self._position(order, unit)
        if pos is None:
            return
        first = True
        for nxt in order[pos + 1:]:
            group = nxt.group
            if group is None:
                continue
            if skip_started and (group.training_state is not TrainingState.IDLE
                                 or not group.unshard_in_backward):
                continue  # already through its backward, or never gathered in backward
            if group.is_unsharded:
                return
            nbytes = _ahead_bytes(group) if ahead_bytes > 0 else None
            if not first and (nbytes is None or nbytes > ahead_bytes):
                return
            group.unshard(async_op=True)
            if nbytes is None:
                return
            ahead_bytes -= nbytes
            first = False

    def _position(self, order: list[FSDPState], unit: FSDPState | ParamGroup) -> int | None:
        """The first index of ``order`` holding ``unit`` (a state, or a state's group).

        A dictionary per recorded order, rebuilt only when the order grew: a scan per hook made
        each step's prefetches quadratic in the number of groups (issue 36)."""
        cached = self._positions.get(id(order))
        if cached is None or cached[0] is not order or cached[1] != len(order):
            index: dict[int, int] = {}
            for i, st in enumerate(order):
                index.setdefault(id(st), i)
                if st.group is not None:
                    index.setdefault(id(st.group), i)
            cached = self._positions[id(order)] = (order, len(order), index)
        return cached[2].get(id(unit))

    # -- backward -------------------------------------------------------------------------------
    def queue_final_callback(self) -> None:
        """Queue :meth:`_final_callback` at the end of the current backward (once)."""
        if not self.final_callback_queued:
            self.final_callback_queued = True
            Variable._execution_engine.queue_callback(self._final_callback)

    def reduce_scatter(self, group: ParamGroup) -> None:
        """Reduce-scatter ``group``: asynchronously on accelerators, at most one in flight.

        Asynchronous where an accelerator's streams make that real overlap (the previous one is
        waited first, bounding memory); synchronous on CPU, where the in-flight gradient buffer
        would only add to peak memory (FSDP2 is synchronous there). On gloo, queued ones stay
        in flight together while their bytes fit one exchange ([fsdp-gloo-fusion]).
        """
        if not self._joins_inflight(group):
            self.finish_reduce()
        async_op = self.reduce_async(group)
        group.reduce_scatter(async_op=async_op)
        if async_op:
            self.inflight_reduces.append(group)
        else:
            group.run_post_reduce_hooks()  # design note [fsdp-post-acc-grad-hooks]

    def _joins_inflight(self, group: ParamGroup) -> bool:
        """Whether ``group``'s reduce-scatter may stay queued beside those in flight: all of
        them queued for the fused exchange, their gradient bytes within one exchange's."""
        if not self.inflight_reduces:
            return True
        total = sum_or_none(g.fused_reduce_bytes for g in (*self.inflight_reduces, group))
        return total is not None and total <= gloo_exchange.FUSE_MAX_BYTES

    @staticmethod
    def reduce_async(group: ParamGroup) -> bool:
        """Whether ``group``'s structural reduce-scatter is asynchronous: on accelerators, and
        on gloo where it is queued to leave with the next collective (design note
        [fsdp-gloo-fusion]); a test may force the asynchronous path on gloo too."""
        return group.mesh_info.device_type != "cpu" or group.fuses_reduce_scatter

    def finish_reduce(self, hooks: bool = True) -> None:
        """Wait for the reduce-scatters in flight, then run their post-accumulate-grad hooks
        (``hooks=False``: the recovery of ``reset_iter_state()``, which drops gradients)."""
        groups, self.inflight_reduces = self.inflight_reduces, []
        for group in groups:
            group.wait_for_reduce()
        if hooks:
            for group in groups:
                group.run_post_reduce_hooks()

    def _final_callback(self) -> None:
        with label("vescale::post_backward_final_callback"):
            self.final_callback_queued = False
            to_reduce = [g for g in self.groups if g.should_reduce()]  # in tree order
            # [fsdp-gloo-fusion]: small reduce-scatters on gloo are queued; issuing them and
            # the flags before the first wait lets them all leave as one exchange
            fused = fusable(0) and all(g.fuses_reduce_scatter for g in to_reduce)
            flags = None
            if fused:
                for group in to_reduce:
                    group.reduce_scatter(async_op=True)
                flags = self._start_fused_flags()
            self.finish_reduce()
            reducing = {id(g) for g in to_reduce}
            for group in self.groups:  # groups without a structural completion, in tree order
                if id(group) in reducing:
                    if fused:
                        group.wait_for_reduce()
                    else:
                        group.reduce_scatter(async_op=False)
                    group.run_post_reduce_hooks()  # design note [fsdp-post-acc-grad-hooks]
                else:
                    group.accumulate_unsynced()  # no sync: sum in reduce_dtype (if it differs)
                if group.reshard_after_backward:  # set_reshard_after_backward(False): keep
                    group.reshard()
            for group in self.groups:  # offload: the asynchronous copies to the host
                for buf in group.buffers.values():
                    buf.wait_offload()
            self._publish_grads(flags)
            self.forget_iteration()
            if self.backward_order:
                self.backward_recorded = True

    def _flagged(self) -> tuple[list[ParamGroup], list[list], bytes]:
        """The groups reduced in this backward whose gradients are published by flags, their
        trainable parameters, and this rank's "received a gradient" flags for those."""
        groups = [g for g in self.groups
                  if g.reduced and not g.reduced_partially and not g.grads_for_unused]
        per_group = [g.trainable() for g in groups]
        return groups, per_group, bytes(int(mp.got_grad) for mps in per_group for mp in mps)

    def _publish_grads(self, fused: tuple[Any, torch.Tensor, tuple] | None = None) -> None:
        """Publish the sharded gradients of the groups reduced in this backward.

        Whether a parameter has a gradient must not depend on the rank (rank 1 may compute none
        for an expert rank 0 routed tokens to): one all-reduce (MAX) of the "received a
        gradient" flags of every reduced group's trainable parameters gives the global answer.
        Which groups were reduced is the same on every rank, so is the message. ``fused``: that
        all-reduce, already issued with the final callback's reduce-scatters
        (:meth:`_start_fused_flags`).
        """
        # a reduce without the replica all-reduce publishes nothing yet (FSDP2's
        # set_requires_all_reduce(False)): the arrival flags add up until the one with it
        for g in self.groups:  # set_reduce_scatter_unused_params(True): every parameter
            if g.reduced and not g.reduced_partially and g.grads_for_unused:
                g.publish_grads([True] * len(g.trainable()))
        # fused: the flags were taken (and sent) before the final callback's waits
        groups, per_group, local = fused[2] if fused is not None else self._flagged()
        if not groups:
            return
        if fused is not None:
            fused[0].wait()
            flags = bytes(fused[1].tolist())
        else:
            self._check_flags_collective(groups)
            flags = self._global_flags(local, groups[0]) if local else local
        i = 0
        for g, mps in zip(groups, per_group):
            g.publish_grads([bool(f) for f in flags[i:i + len(mps)]])
            i += len(mps)

    def _check_flags_collective(self, groups: list[ParamGroup]) -> None:
        if collective_check_on():  # design note [fsdp-collective-check]
            check_collective("gradient-flag all-reduce", -1, 0,
                             group=groups[0].mesh_info.shard_group,
                             device=next(iter(groups[0].buffers.values())).device,
                             name_of=lambda i: self.groups[i].module_fqn)

    def _start_fused_flags(self) -> tuple[Any, torch.Tensor, tuple] | None:
        """On gloo ([fsdp-gloo-fusion]), queue the flag all-reduce behind the
        final callback's reduce-scatters (one exchange for all of them) instead of issuing it
        after. Every rank then waits for it in this callback (in the queue it costs no
        rendezvous of its own), so none leaves it in flight. ``None`` where it does not
        apply (nothing to flag, one rank, a mesh torch cannot flatten, not gloo): then
        :meth:`_global_flags` runs as before."""
        flagged = self._flagged()
        groups, _, local = flagged
        if not local or not fusable(len(local)):  # unfused(): nothing is queued
            return None
        mesh_info = groups[0].mesh_info
        pg = mesh_info.data_parallel_group
        device = next(iter(groups[0].buffers.values())).device
        if mesh_info.data_parallel_size == 1 or pg is None or not gloo_serves(pg, device) \
                or device.type != "cpu":
            return None
        self.finish_flags()
        self._check_flags_collective(groups)
        t = torch.tensor(list(local), dtype=torch.uint8)
        with label("vescale::grad_flags_all_reduce"):
            work = submit_max_all_reduce(t, rank=dist.get_rank(pg),
                                         world_size=dist.get_world_size(pg), group=pg)
        return work, t, flagged

    def _global_flags(self, local: bytes, group: ParamGroup) -> bytes:
        """Every rank's "received a gradient" flags, MAX-reduced over the data-parallel mesh.

        HSDP: replicas must publish the same gradients too, so the flags span the whole mesh:
        one all-reduce over its flattened group (or, for a mesh torch cannot flatten, the shard
        group and then the replicate group). When every flag is already set on this rank (a
        dense model: the usual case) the result is known without reading it: the all-reduce is
        issued asynchronously and finished at the next root pre-forward, so the backward ends
        without a host sync (a ``tolist`` would wait for the whole backward on the device).
        """
        mesh_info = group.mesh_info
        if mesh_info.data_parallel_size == 1:
            return local
        with label("vescale::grad_flags_all_reduce"):
            device = next(iter(group.buffers.values())).device
            # pinned toward an accelerator: a pageable source may make the driver synchronise
            # (design note [pinned-host])
            t = host_source(local, device)
            if device.type != "cpu":  # non_blocking: a blocking copy would wait for the backward
                t = t.to(device, non_blocking=True)
            dp_group = mesh_info.data_parallel_group
            if dp_group is not None:
                pgs = [dp_group]
            else:
                pgs = [pg for pg, n in ((mesh_info.shard_group, mesh_info.shard_size),
                                        (mesh_info.replicate_group, mesh_info.replicate_size))
                       if n > 1]
            if all(local):
                self.finish_flags()
                work = None
                for pg in pgs:  # a mesh torch cannot flatten: dim by dim, ordered by the waits
                    if work is not None:
                        work.wait()  # NCCL: the stream waits, not the host
                    work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg, async_op=True)
                self.pending_flags = (work, t)
                return local
            for pg in pgs:
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)
            return bytes(t.tolist())

    def finish_flags(self) -> None:
        """Finish the gradient-flag all-reduce left in flight by :meth:`_global_flags`."""
        pending, self.pending_flags = self.pending_flags, None
        if pending is not None:
            pending[0].wait()
