"""Layer 4: a torch optimizer that steps few flat tensors instead of one per parameter.

Design note [flat-params]
-------------------------
``torch.optim.AdamW/Adam/SGD`` cost O(parameters) Python per step whatever their kernels do:
the state lookup, the grouping by device/dtype, the bias corrections per parameter, and on
DTensors the argument handling of every list op. On a 292-tensor GPT that floor is ~7 ms (plain
local tensors) against 1.7 ms for the same maths on one flat tensor (design note [flat-step]
removes only the DTensor part). :class:`FlatParamOptimizer` removes the rest: the optimizer it
wraps sees *few* tensors.

* **Runs.** After ``fully_shard`` a parameter's local tensor is a 1-D view into its group's
  DBuffer shard. Consecutive parameters *of one param group* whose local tensors lie back to
  back in one storage form a run; a run is one plain 1-D tensor (a view of the shard), so gaps
  holding another group's parameters or frozen ones are never read or written. Planner
  padding between two parameters of one shard (the 256-aligned default granularity pads before
  large tensors) joins the run as a *gap item*: it is zeros in the parameter and gradient
  shards, Adam/AdamW/SGD keep zeros zero, and it is never exported; otherwise one shard would
  step as several tensors (issue 36: 49 instead of 25 on a 24-block GPT, ~25% slower).
  Everything is read from the parameters' local views, never from ``placements[0]``: 1-D
  meshes and HSDP's ``(Replicate(), RaggedShard)`` alike.
* **Segments and states.** The inner optimizer's parameters are *segments* of runs (normally
  one segment per run). Its state (``exp_avg``..., ``step``) is kept per segment, so per-
  parameter states are views into it; ``state_dict()`` exports them per original parameter as
  DTensors in the parameter's layout (checkpoints are interchangeable with the unwrapped
  optimizer) and ``load_state_dict()`` imports either form.
* **Gradients.** Each step every segment gets ``.grad`` = the matching 1-D view of the grad
  shard when its parameters' gradients lie back to back (the normal case: they are views into
  the DBuffer's grad shard). A parameter with ``grad=None`` is skipped exactly as torch skips
  it, and gradients that are not back to back are stepped separately: the segment is split
  (views of its states, no copy). Segments whose states are equal again (same keys, same step)
  are merged after the step (one copy), so a transient split (e.g. DCP's zero-gradient state
  initialisation) costs nothing afterwards.
* **Options.** The inner optimizer's ``param_groups`` *are* the visible ones (the same dicts);
  only ``"params"`` is swapped to the segments during ``step``/``load_state_dict`` and back,
  so lr schedulers and hand edits of ``param_groups[i]["lr"]`` apply as usual.
* **Exactness.** Segments give bitwise the per-tensor result when every element is computed
  the same wherever it sits in a tensor. CPU kernels have a vector body and a scalar tail,
  which differ for some ops (``_fused_adamw_``, bf16 ``add`` with ``alpha``). The first build
  for each (optimizer class, options, dtype, device) runs a *probe*: the inner optimizer's class
  on synthetic ragged items, per item and flat, two steps, compared bit for bit. If the flat
  form differs, runs break after every parameter whose length is not a multiple of 16 (then
  64), so vector lanes line up as per tensor; if no alignment is exact, each parameter is its
  own segment (still no DTensor and few Python objects).

What is refused (``TypeError``/``ValueError`` naming the parameter or option and the fix): any
optimizer other than ``torch.optim.Adam``, ``AdamW`` and ``SGD`` (Muon, AdamW8bit and LBFGS
are not element-wise in torch's per-parameter sense; this package's own optimizers already step
flat runs inside), ``differentiable=True``, and parameters that are not ``fully_shard``
``RaggedShard`` DTensors with contiguous local tensors. :func:`flat_param_optimizer` with
``strict=False`` returns such an optimizer unchanged instead (the rule a strategy can apply to
every user optimizer).
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_vescale.optim._base import param_layout
from lightning_vescale.optim._flat_param_runs import (
    GroupPlan,
    Run,
    check_param,
    is_elementwise_state,
    local_of,
    merge_states,
    state_signature,
)
from lightning_vescale.placement import ragged_from_local

__all__ = ["FlatParamOptimizer", "flat_param_optimizer", "SUPPORTED_OPTIMIZERS"]

#: The optimizer classes whose step is element-wise per parameter (exact types: a subclass may
#: change the step).
SUPPORTED_OPTIMIZERS: tuple[type[Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW,
                                                      torch.optim.SGD)


# ---------------------------------------------------------------------------------------------
# The optimizer
# ---------------------------------------------------------------------------------------------
class FlatParamOptimizer(Optimizer):
    """``optimizer`` (``torch.optim.Adam``/``AdamW``/``SGD``, foreach, fused or for-loop) stepping
    flat runs of ``fully_shard``'s DBuffer shards instead of one tensor per parameter.

    Results are bitwise those of ``optimizer`` on the parameters themselves; ``param_groups``
    are ``optimizer``'s (lr schedulers keep working); ``state_dict()``/``load_state_dict()`` use
    the per-parameter form of the unwrapped optimizer (states as DTensors laid out like their
    parameters), so checkpoints are interchangeable. ``state`` is a per-parameter view built on
    access. Design note [flat-params].

    Args:
        optimizer: the optimizer to wrap, built on RaggedShard parameters. Its existing state (if
            it already stepped) is taken over.

    Raises:
        TypeError: another optimizer class, or a parameter that is not a RaggedShard DTensor.
        ValueError: ``differentiable=True`` or a non-contiguous local tensor.
    """

    def __init__(self, optimizer: Optimizer) -> None:  # noqa: D107 - documented on the class
        _check_optimizer(optimizer)
        # not `self.optimizer`: Lightning's LightningOptimizer and _FabricOptimizer subclass the
        # wrapped class and own an `optimizer` property that would shadow it
        self._wrapped = optimizer
        self._optimizer_step_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_step_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: OrderedDict = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: OrderedDict = OrderedDict()
        self._patch_step_function()
        self._build()
        existing = {p: dict(s) for p, s in optimizer.state.items() if s}
        optimizer.state.clear()
        if existing:
            self._import_states(existing)

    # -- what torch.optim.Optimizer's users read -------------------------------------------------
    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self._wrapped.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._wrapped.param_groups = value

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self._wrapped.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._wrapped.defaults = value

    @property  # type: ignore[override]
    def state(self) -> defaultdict:
        """Per original parameter: its states (element-wise ones as views, in its layout).

        Built on access: assigning ``state[p] = ...`` raises ``TypeError`` (it would change a
        copy); edit the views in place or use ``load_state_dict()``."""
        out: defaultdict = _StateView(dict)
        for plan in self._plans:
            for p, (run, i) in zip(plan.params, plan.where):
                st = self._param_state(p, run, i)
                if st:
                    dict.__setitem__(out, p, st)
        return out

    @state.setter
    def state(self, value: Any) -> None:
        raise AttributeError("FlatParamOptimizer.state is a per-parameter view; use "
                             "load_state_dict() to replace states.")

    def __getstate__(self) -> dict[str, Any]:
        return {"defaults": self.defaults, "state": self.state, "param_groups": self.param_groups}

    def __repr__(self) -> str:
        runs = sum(len(p.runs) for p in self._plans)
        params = sum(len(p.params) for p in self._plans)
        return f"FlatParamOptimizer({params} parameters in {runs} runs, {self._wrapped!r})"

    # -- building -------------------------------------------------------------------------------
    def _build(self) -> None:
        cls = type(self._wrapped)
        self._plans = [GroupPlan(g, gi, cls) for gi, g in enumerate(self.param_groups)]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer (its defaults apply) and plan its runs."""
        self._wrapped.add_param_group(param_group)
        g = self.param_groups[-1]
        self._plans.append(GroupPlan(g, len(self.param_groups) - 1, type(self._wrapped)))

    def num_flat_tensors(self) -> int:
        """How many tensors the wrapped optimizer steps when every parameter has a gradient."""
        return sum(len(n) for n in self.flat_tensor_numels())

    def flat_tensor_numels(self) -> list[list[int]]:
        """Per param group, the element count of each tensor the wrapped optimizer steps when
        every parameter has a gradient (what ``benchmarks/optimizer_step.py`` rebuilds as plain
        tensors to time this layout without the wrapper)."""
        return [[run.offs[b] - run.offs[a] for run in plan.runs
                 for a, b in zip(run.bounds, run.bounds[1:])] for plan in self._plans]

    # -- the step -------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step of the wrapped optimizer on the flat segments (see [flat-params])."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        inner = self._wrapped
        groups = inner.param_groups
        if len(groups) != len(self._plans) or any(
                len(g["params"]) != len(p.params) for g, p in zip(groups, self._plans)):
            self._build()  # groups were edited by hand
        state = inner.state
        saved = [g["params"] for g in groups]
        try:
            for g, plan in zip(groups, self._plans):
                g["params"] = plan.prepare(state)
            inner.step()
        finally:
            for g, ps in zip(groups, saved):
                g["params"] = ps
            for plan in self._plans:
                plan.finish(state)
        return loss

    # -- states per original parameter ----------------------------------------------------------
    def _param_state(self, p: Tensor, run: Run, i: int) -> dict[str, Any]:
        a, b = run.where(i)
        t = run.segs.get((a, b))
        st = self._wrapped.state.get(t) if t is not None else None
        if not st:
            return {}
        offs = run.offs
        numel = offs[b] - offs[a]
        lo, hi = offs[i] - offs[a], offs[i + 1] - offs[a]
        out: dict[str, Any] = {}
        for k, v in st.items():
            if is_elementwise_state(v, numel):
                out[k] = _state_dtensor(p, v, lo, hi)
            elif isinstance(v, Tensor):
                out[k] = v.clone()
            else:
                out[k] = v
        return out

    def state_dict(self) -> dict[str, Any]:
        """The unwrapped optimizer's state dict: states per parameter, in the parameter's layout.

        Element-wise states are DTensors with the parameter's mesh, placements and global shape
        whose local tensors are views into the flat states (no copy); ``step`` is a copy.
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        groups_out = []
        state_out: dict[int, Any] = {}
        index = 0
        for g, plan in zip(self.param_groups, self._plans):
            ids = []
            for p, (run, i) in zip(plan.params, plan.where):
                st = self._param_state(p, run, i)
                if st:
                    state_out[index] = st
                ids.append(index)
                index += 1
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = ids
            groups_out.append(packed)
        sd = {"state": state_out, "param_groups": groups_out}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            result = post_hook(self, sd)
            if result is not None:
                sd = result
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this class or of the unwrapped optimizer (same parameters).

        States may be DTensors in the parameter's layout, in another layout (gathered: a
        collective, every rank must load), or full plain tensors (a single-process state).
        Group options (lr, betas, ...) are taken from ``state_dict`` as torch does.
        """
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = pre_hook(self, state_dict)
            if result is not None:
                state_dict = result
        saved_groups = state_dict["param_groups"]
        groups = self.param_groups
        if len(saved_groups) != len(groups) or any(
                len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, groups)):
            raise ValueError(
                "FlatParamOptimizer.load_state_dict: the state dict has groups of sizes "
                f"{[len(s['params']) for s in saved_groups]}, this optimizer "
                f"{[len(g['params']) for g in groups]}; it was saved for another model or "
                "another parameter grouping.")
        per_param: dict[Tensor, dict[str, Any]] = {}
        saved_state = state_dict["state"]
        for s, g in zip(saved_groups, groups):
            for pid, p in zip(s["params"], g["params"]):
                if pid in saved_state:
                    per_param[p] = dict(saved_state[pid])
        for s, g in zip(saved_groups, groups):
            for k, v in s.items():
                if k != "params":
                    g[k] = v
        self._wrapped.state.clear()
        self._build()
        self._import_states(per_param)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _import_states(self, per_param: dict[Tensor, dict[str, Any]]) -> None:
        """Per-parameter states (any layout) into segment states; then torch's own load casts
        them (dtype, device, the ``step`` convention of the optimizer's mode)."""
        inner_state: dict[int, dict[str, Any]] = {}
        inner_groups = []
        index = 0
        for g, plan in zip(self.param_groups, self._plans):
            ids = []
            items = []
            for run in plan.runs:
                locals_ = [self._local_state(p, per_param.get(p, {}), n)
                           for p, n in zip(run.params, run.numels)]
                for i, gap in enumerate(run.is_gap):  # padding: zero states like its neighbour's
                    if gap and locals_[i - 1]:
                        locals_[i] = _gap_state(locals_[i - 1], run.numels[i - 1],
                                                run.numels[i])
                sigs = [state_signature(st, n) for st, n in zip(locals_, run.numels)]
                bounds = [0]
                for i in range(1, len(run.params)):
                    if sigs[i] != sigs[i - 1]:
                        bounds.append(i)
                bounds.append(len(run.params))
                run.bounds, run.segs = bounds, {}
                for a, b in zip(bounds, bounds[1:]):
                    t = run.seg(a, b)
                    items.append(t)
                    if locals_[a]:
                        inner_state[index] = merge_states(locals_[a:b], run.numels[a:b])
                    ids.append(index)
                    index += 1
            inner_groups.append(({**{k: v for k, v in g.items() if k != "params"},
                                  "params": ids}, items))
        # torch's load rebuilds the group dicts: keep ours (the visible ones) as they are.
        groups = self.param_groups
        saved = [g["params"] for g in groups]
        try:
            for g, (_, items) in zip(groups, inner_groups):
                g["params"] = items
            self._wrapped.load_state_dict(
                {"state": inner_state, "param_groups": [sg for sg, _ in inner_groups]})
        finally:
            self._wrapped.param_groups = groups
            for g, ps in zip(groups, saved):
                g["params"] = ps

    @staticmethod
    def _local_state(p: Tensor, st: dict[str, Any], numel: int) -> dict[str, Any]:
        out = {}
        layout = None
        for k, v in st.items():
            if isinstance(v, Tensor) and v.dim() > 0:
                if tuple(v.shape) != tuple(p.shape):
                    raise ValueError(
                        f"FlatParamOptimizer.load_state_dict: state {k!r} has shape "
                        f"{tuple(v.shape)}, its parameter {tuple(p.shape)}; was the state saved "
                        "for another model or another parameter order?")
                if layout is None:
                    layout = param_layout(p, where=f"FlatParamOptimizer parameter of shape "
                                                   f"{tuple(p.shape)}")
                loc = layout.local_part(v).detach().reshape(-1)
                assert loc.numel() == numel
                out[k] = loc.to(device=local_of(p).device)
            else:
                out[k] = v
        return out


class _StateView(defaultdict):
    """:attr:`FlatParamOptimizer.state`: a per-parameter view built on access, so replacing a
    parameter's entry would be silently lost; it raises instead (as ``opt.state = ...`` does).
    Reading a parameter without state gives an empty dict, as torch's ``defaultdict`` does."""

    _REFUSAL = ("FlatParamOptimizer.state is a per-parameter view built on access: {what} would "
                "change a copy and be lost. Edit the state tensors in place "
                "(opt.state[p]['exp_avg'].copy_(...)) or replace states with "
                "opt.load_state_dict(sd) (sd from opt.state_dict(), edited).")

    def __missing__(self, key: Any) -> Any:
        value = self.default_factory()  # type: ignore[misc]
        dict.__setitem__(self, key, value)
        return value

    def __setitem__(self, key: Any, value: Any) -> None:
        raise TypeError(self._REFUSAL.format(what="assigning state[p] = ..."))

    def __delitem__(self, key: Any) -> None:
        raise TypeError(self._REFUSAL.format(what="del state[p]"))

    def update(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(self._REFUSAL.format(what="state.update(...)"))

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key in self:
            return self[key]
        raise TypeError(self._REFUSAL.format(what="state.setdefault(p, ...)"))


def _gap_state(like: dict[str, Any], like_numel: int, numel: int) -> dict[str, Any]:
    """The state of a padding gap item: zeros where ``like`` is per element, its scalars (step)
    otherwise, so that the gap joins its neighbours' segment."""
    out: dict[str, Any] = {}
    for k, v in like.items():
        if is_elementwise_state(v, like_numel):
            out[k] = v.new_zeros(numel)
        elif isinstance(v, Tensor):
            out[k] = v.clone()
        else:
            out[k] = v
    return out


def _state_dtensor(p: DTensor, flat_state: Tensor, lo: int, hi: int) -> DTensor:
    """Elements ``[lo, hi)`` of a flat state as a DTensor laid out like ``p`` (a view, no copy;
    no autograd history: states are data). Pickling and deep-copying such views at a storage
    offset work through the placement package's DTensor hooks (design note
    [dtensor-views-pickle])."""
    return ragged_from_local(flat_state[lo:hi], p.device_mesh, tuple(p.placements), p.shape,
                             p.stride(), autograd=False, check=False)


def _check_optimizer(optimizer: Any) -> None:
    if isinstance(optimizer, FlatParamOptimizer):
        raise TypeError("FlatParamOptimizer: the optimizer is already flat; wrap it once.")
    if type(optimizer) not in SUPPORTED_OPTIMIZERS:
        raise TypeError(
            f"FlatParamOptimizer: {type(optimizer).__module__}.{type(optimizer).__qualname__} "
            "is not supported; supported are torch.optim.Adam, AdamW and SGD (exact classes), "
            "whose step is element-wise per parameter. Use other optimizers unwrapped "
            "(lightning_vescale.optim.AdamW8bit and Muon already step flat runs inside; "
            "LBFGS and Muon need whole tensors), or flat_param_optimizer(opt, strict=False) to "
            "keep unsupported ones as they are.")
    for gi, g in enumerate(optimizer.param_groups):
        if g.get("differentiable"):
            raise ValueError(
                f"FlatParamOptimizer: param_groups[{gi}] has differentiable=True; the flat step "
                "records no autograd history per parameter. Use the optimizer unwrapped.")


def flat_param_optimizer(optimizer: Optimizer, *, strict: bool = True) -> Optimizer:
    """``optimizer`` as a :class:`FlatParamOptimizer` (design note [flat-params]).

    Args:
        optimizer: ``torch.optim.Adam``/``AdamW``/``SGD`` on ``fully_shard`` parameters.
        strict: ``True`` (default): unsupported optimizers or parameters raise. ``False``: they
            are returned unchanged (the rule for applying it to any user optimizer), as is an
            optimizer that is already flat.
    """
    if not strict:
        if isinstance(optimizer, FlatParamOptimizer):
            return optimizer
        try:
            _check_optimizer(optimizer)
            for gi, g in enumerate(optimizer.param_groups):
                for j, p in enumerate(g["params"]):
                    check_param(p, gi, j, g.get("param_names"))
        except (TypeError, ValueError):
            return optimizer
    return FlatParamOptimizer(optimizer)

