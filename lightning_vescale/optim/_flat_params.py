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
  (planner padding, another group's parameters, frozen ones) are never read or written.
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

import inspect
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_vescale.optim._base import param_layout
from lightning_vescale.placement import RaggedShard, ragged_from_local

__all__ = ["FlatParamOptimizer", "flat_param_optimizer", "SUPPORTED_OPTIMIZERS"]

#: The optimizer classes whose step is element-wise per parameter (exact types: a subclass may
#: change the step).
SUPPORTED_OPTIMIZERS: tuple[type[Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW,
                                                      torch.optim.SGD)
_PROBE_SIZES = (1, 2, 3, 5, 8, 13, 16, 17, 31, 33, 64, 65, 100, 129, 255, 300)
_PROBE_ALIGNMENTS = (1, 16, 64)
_NEVER = 0  # alignment meaning "one parameter per segment"
_probe_cache: dict[tuple, int] = {}
_GROUP_KEYS_NOT_OPTIONS = ("params", "param_names", "initial_lr")


# ---------------------------------------------------------------------------------------------
# The exactness probe
# ---------------------------------------------------------------------------------------------
def _option_key(group: dict[str, Any]) -> tuple:
    return tuple(sorted((k, repr(v)) for k, v in group.items()
                        if k not in _GROUP_KEYS_NOT_OPTIONS))


def _probe_aligned(cls: type[Optimizer], options: dict[str, Any], dtype: torch.dtype,
                   device: torch.device, align: int) -> bool:
    """Three steps of ``cls`` on ragged items, per item and as flat runs of ``align``: do the
    parameters and every element-wise state agree bit for bit?"""
    gen = torch.Generator().manual_seed(1234)
    sizes = _PROBE_SIZES
    total = sum(sizes)

    def values(scale: float) -> Tensor:  # mixed signs and magnitudes: many rounding cases
        x = (torch.rand(total, generator=gen, dtype=torch.float64) * 1.95 + 0.05) * scale
        sign = torch.where(torch.rand(total, generator=gen) < 0.5, -1.0, 1.0)
        return (x * sign).to(device=device, dtype=dtype)

    p0 = values(1.0)
    grads = [values(0.1) for _ in range(3)]
    offs = [0]
    for n in sizes:
        offs.append(offs[-1] + n)
    bounds = [0] + [i + 1 for i, n in enumerate(sizes) if align > 1 and n % align]
    if bounds[-1] != len(sizes):
        bounds.append(len(sizes))
    runs = list(zip(bounds, bounds[1:]))
    per_item_flat, flat_flat = p0.clone(), p0.clone()
    per_item = [per_item_flat[offs[i]:offs[i + 1]] for i in range(len(sizes))]
    flat = [flat_flat[offs[a]:offs[b]] for a, b in runs]
    accepted = inspect.signature(cls.__init__).parameters
    opts = {k: v for k, v in options.items()
            if k not in _GROUP_KEYS_NOT_OPTIONS and k in accepted}
    o1, o2 = cls(per_item, **opts), cls(flat, **opts)
    for g in grads:
        g1, g2 = g.clone(), g.clone()  # some steps edit gradients in place (SGD nesterov)
        for i, t in enumerate(per_item):
            t.grad = g1[offs[i]:offs[i + 1]]
        for (a, b), t in zip(runs, flat):
            t.grad = g2[offs[a]:offs[b]]
        o1.step()
        o2.step()
    bits = _int_of(dtype)
    if not torch.equal(per_item_flat.view(bits), flat_flat.view(bits)):
        return False
    for (a, b), t in zip(runs, flat):
        for k, v in o2.state[t].items():
            if _elementwise(v, t.numel()):
                ref = torch.cat([o1.state[per_item[i]][k] for i in range(a, b)])
                if not torch.equal(ref.view(_int_of(ref.dtype)), v.view(_int_of(v.dtype))):
                    return False
    return True


def _int_of(dtype: torch.dtype) -> torch.dtype:
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]


def exact_alignment(cls: type[Optimizer], options: dict[str, Any], dtype: torch.dtype,
                    device: torch.device) -> int:
    """The run alignment at which ``cls(**options)`` on flat runs is bitwise its per-tensor step.

    ``1``: any run; ``16``/``64``: runs break after every parameter whose length is not a
    multiple; ``0``: none (one parameter per segment). Cached per (class, options, dtype,
    device type); the probe runs a few small steps on ``device``.
    """
    key = (cls, _option_key(options), dtype, device.type)
    found = _probe_cache.get(key)
    if found is None:
        found = _NEVER
        with torch.no_grad():
            for align in _PROBE_ALIGNMENTS:
                if _probe_aligned(cls, options, dtype, device, align):
                    found = align
                    break
        _probe_cache[key] = found
    return found


# ---------------------------------------------------------------------------------------------
# Runs and segments
# ---------------------------------------------------------------------------------------------
def _local(p: Tensor) -> Tensor:
    return p._local_tensor if isinstance(p, DTensor) else p


def _elementwise(v: Any, numel: int) -> bool:
    return isinstance(v, Tensor) and v.dim() == 1 and v.numel() == numel


class _Run:
    """Consecutive parameters of one group, back to back in one storage (see [flat-params])."""

    __slots__ = ("params", "numels", "offs", "flat", "bounds", "segs", "itemsize", "dtype")

    def __init__(self, params: list[Tensor]) -> None:
        self.params = params
        locs = [_local(p) for p in params]
        self.numels = [t.numel() for t in locs]
        self.offs = [0]
        for n in self.numels:
            self.offs.append(self.offs[-1] + n)
        first = next((t for t in locs if t.numel()), locs[0])  # empty parts have no memory
        self.dtype = first.dtype
        self.itemsize = first.element_size()
        # One plain 1-D view over the whole run (no autograd history, its own Python object:
        # the inner optimizer's parameter and state key).
        self.flat = first.detach().as_strided((self.offs[-1],), (1,), first.storage_offset())
        self.bounds = [0, len(params)]  # the state partition (parameter indices)
        self.segs: dict[tuple[int, int], Tensor] = {}

    def seg(self, a: int, b: int) -> Tensor:
        t = self.segs.get((a, b))
        if t is None:
            t = self.segs[(a, b)] = self.flat[self.offs[a]:self.offs[b]]
        return t

    def where(self, i: int) -> tuple[int, int]:
        """The segment (a, b) of the state partition holding parameter ``i``."""
        bounds = self.bounds
        for a, b in zip(bounds, bounds[1:]):
            if a <= i < b:
                return a, b
        raise AssertionError(i)


def _grad_pieces(run: _Run) -> list[tuple[int, int, Tensor]]:
    """This step's (a, b, flat grad view): parameters with gradients, back to back in memory.

    Parameters with an empty local part never break a piece (they have no memory to line up).
    """
    closed: list[tuple[int, int, Tensor | None]] = []
    params, numels, itemsize, dtype = run.params, run.numels, run.itemsize, run.dtype
    a = -1
    base: Tensor | None = None
    expect = 0
    for i, p in enumerate(params):
        g = p.grad
        if g is None:
            if a >= 0:
                closed.append((a, i, base))
                a, base = -1, None
            continue
        gl = g._local_tensor if isinstance(g, DTensor) else g
        n = numels[i]
        if gl.dtype is not dtype or gl.numel() != n:
            raise TypeError(
                f"FlatParamOptimizer: the gradient of a parameter of shape {tuple(p.shape)} has "
                f"dtype {gl.dtype} and {gl.numel()} local elements; its parameter has {dtype} "
                f"and {n}. Gradients must match their parameters (as fully_shard's do).")
        if a < 0:
            a = i
        if n == 0:
            continue
        ptr = gl.data_ptr()
        contiguous = gl.is_contiguous()
        if base is not None:
            if ptr == expect and contiguous:
                expect += n * itemsize
                continue
            closed.append((a, i, base))
            a = i
        if contiguous:
            base, expect = gl, ptr + n * itemsize
        else:
            closed.append((a, i + 1, gl.reshape(-1)))
            a, base = -1, None
    if a >= 0:
        closed.append((a, len(params), base))
    views = []
    for a, b, g0 in closed:
        n = run.offs[b] - run.offs[a]
        if g0 is None:
            views.append((a, b, run.flat.new_empty(0)))
        elif g0.numel() == n:
            views.append((a, b, g0.reshape(n)))
        else:
            try:
                views.append((a, b, g0.as_strided((n,), (1,), g0.storage_offset())))
            except RuntimeError:  # beyond the storage: cannot happen for adjacent live tensors
                for i in range(a, b):
                    gi = _local(params[i].grad)  # type: ignore[arg-type]
                    views.append((i, i + 1, gi.reshape(-1)))
    return views


def _split_state(state: dict[str, Any], lo: int, hi: int, numel: int) -> dict[str, Any]:
    """The state of elements [lo, hi) of a segment of ``numel`` elements (views; 0-d cloned)."""
    out = {}
    for k, v in state.items():
        if _elementwise(v, numel):
            out[k] = v[lo:hi]
        elif isinstance(v, Tensor):
            if v.dim() != 0:
                raise TypeError(f"FlatParamOptimizer: state {k!r} of shape {tuple(v.shape)} is "
                                "neither per element nor a scalar; this optimizer cannot be "
                                "flattened: use it unwrapped.")
            out[k] = v.clone()
        else:
            out[k] = v
    return out


def _signature(state: dict[str, Any], numel: int, *, values: bool = True) -> tuple:
    """What must be equal for two segments' states to merge (``values=False``: without the
    scalar values, which may live on an accelerator: reading them synchronises)."""
    sig = []
    for k in sorted(state):
        v = state[k]
        if _elementwise(v, numel):
            sig.append((k, "elementwise", v.dtype, v.device))
        elif isinstance(v, Tensor):
            sig.append((k, "scalar", v.dtype, v.device, v.item() if values else None))
        else:
            sig.append((k, "value", repr(v)))
    return tuple(sig)


def _merge_states(states: list[dict[str, Any]], numels: list[int]) -> dict[str, Any]:
    """One state for adjacent segments with equal signatures (element-wise states concatenated)."""
    out = {}
    for k, v in states[0].items():
        if _elementwise(v, numels[0]):
            out[k] = torch.cat([s[k] for s in states])
        elif isinstance(v, Tensor):
            out[k] = v.clone()
        else:
            out[k] = v
    return out


class _GroupPlan:
    """The runs of one param group and the bookkeeping of their segments."""

    def __init__(self, group: dict[str, Any], gi: int, opt_cls: type[Optimizer]) -> None:
        params = list(group["params"])
        names = group.get("param_names")
        self.params = params
        self.runs: list[_Run] = []
        self.where: list[tuple[_Run, int]] = [None] * len(params)  # type: ignore[list-item]
        locs = [_check_param(p, gi, j, names) for j, p in enumerate(params)]
        align_of: dict[tuple[torch.dtype, torch.device], int] = {}
        for loc in locs:
            if (loc.dtype, loc.device) not in align_of:
                align_of[(loc.dtype, loc.device)] = exact_alignment(opt_cls, group, loc.dtype,
                                                                    loc.device)
        # Element-wise maths does not care about order within a group: runs follow memory
        # (nested fully_shard interleaves the groups' parameters in module order).
        order = sorted(range(len(params)), key=lambda j: (locs[j].numel() > 0,
                                                          locs[j].data_ptr()))
        cur: list[int] = []
        end_ptr = -1
        cur_storage = None
        for j in order:
            loc = locs[j]
            align = align_of[(loc.dtype, loc.device)]
            n = loc.numel()
            if cur:
                prev = locs[cur[-1]]
                has_memory = end_ptr >= 0
                joins = align != _NEVER and loc.dtype == prev.dtype and (
                    n == 0 or not has_memory or (
                        loc.untyped_storage().data_ptr() == cur_storage
                        and loc.data_ptr() == end_ptr))
                if joins and align > 1 and prev.numel() % align:
                    joins = False  # vector lanes would not line up (see exactness)
                if not joins:
                    self._add_run(params, cur)
                    cur, end_ptr = [], -1
            cur.append(j)
            if n:
                cur_storage = loc.untyped_storage().data_ptr()
                end_ptr = loc.data_ptr() + n * loc.element_size()
        if cur:
            self._add_run(params, cur)
        self.items: list[Tensor] = []

    def _add_run(self, params: list[Tensor], indices: list[int]) -> None:
        run = _Run([params[j] for j in indices])
        self.runs.append(run)
        for i, j in enumerate(indices):
            self.where[j] = (run, i)

    def prepare(self, state: dict[Tensor, dict[str, Any]]) -> list[Tensor]:
        """This step's inner parameters, each with ``.grad`` set (see [flat-params])."""
        items = []
        for run in self.runs:
            bounds = run.bounds
            for a, b, grad in _grad_pieces(run):
                if bounds == [0, len(run.params)] and a == 0 and b == bounds[1]:
                    t = run.seg(a, b)
                    t.grad = grad
                    items.append(t)
                    continue
                self._split_at(run, a, b, state)
                offs = run.offs
                for x, y in zip(run.bounds, run.bounds[1:]):
                    if a <= x and y <= b:
                        t = run.seg(x, y)
                        t.grad = grad[offs[x] - offs[a]:offs[y] - offs[a]]
                        items.append(t)
        self.items = items
        return items

    @staticmethod
    def _split_at(run: _Run, a: int, b: int, state: dict[Tensor, dict[str, Any]]) -> None:
        """Refine the state partition so that ``a`` and ``b`` are segment bounds."""
        for cut in (a, b):
            if cut in run.bounds:
                continue
            x, y = run.where(cut)
            old = run.segs.pop((x, y), None)
            offs = run.offs
            numel = offs[y] - offs[x]
            run.bounds.append(cut)
            run.bounds.sort()
            if old is not None and old in state:
                st = state.pop(old)
                state[run.seg(x, cut)] = _split_state(st, 0, offs[cut] - offs[x], numel)
                state[run.seg(cut, y)] = _split_state(st, offs[cut] - offs[x], numel, numel)

    def finish(self, state: dict[Tensor, dict[str, Any]]) -> None:
        """Drop the gradient views; merge adjacent segments whose states are equal again."""
        for t in self.items:
            t.grad = None
        self.items = []
        for run in self.runs:
            if len(run.bounds) > 2:
                self._merge(run, state)

    @staticmethod
    def _merge(run: _Run, state: dict[Tensor, dict[str, Any]]) -> None:
        offs = run.offs
        segs = list(zip(run.bounds, run.bounds[1:]))
        sts = []
        for a, b in segs:
            t = run.segs.get((a, b))
            sts.append(state.get(t, {}) if t is not None else {})
        shapes = [_signature(st, offs[b] - offs[a], values=False)
                  for st, (a, b) in zip(sts, segs)]

        def same(i: int, j: int) -> bool:
            if shapes[i] != shapes[j]:
                return False
            (a, b), (x, y) = segs[i], segs[j]
            return _signature(sts[i], offs[b] - offs[a]) == _signature(sts[j], offs[y] - offs[x])

        new_bounds = [0]
        i = 0
        while i < len(segs):
            j = i
            while j + 1 < len(segs) and same(i, j + 1):
                j += 1
            a, b = segs[i][0], segs[j][1]
            if j > i:
                olds = [run.segs.pop(s, None) for s in segs[i:j + 1]]
                merged = [state.pop(t) for t in olds if t is not None and t in state]
                if merged:
                    numels = [offs[y] - offs[x] for x, y in segs[i:j + 1]]
                    state[run.seg(a, b)] = _merge_states(merged, numels)
            new_bounds.append(b)
            i = j + 1
        run.bounds = new_bounds


def _check_param(p: Tensor, gi: int, j: int, names: list[str] | None) -> Tensor:
    name = f"{names[j]!r}" if names else f"param_groups[{gi}]['params'][{j}]"
    fix = ("Use the optimizer unwrapped, or build it on the parameters of a module sharded with "
           "lightning_vescale.fsdp.fully_shard (or VeScaleFSDPStrategy).")
    if not isinstance(p, DTensor) or not any(isinstance(pl, RaggedShard) for pl in p.placements):
        kind = (f"a DTensor with placements {tuple(p.placements)}" if isinstance(p, DTensor)
                else f"a plain {type(p).__name__}")
        raise TypeError(f"FlatParamOptimizer: parameter {name} (shape {tuple(p.shape)}) is {kind};"
                        f" it needs fully_shard's RaggedShard DTensors. {fix}")
    loc = p._local_tensor
    if not loc.is_contiguous():
        raise ValueError(f"FlatParamOptimizer: parameter {name} (shape {tuple(p.shape)}) has a "
                         f"non-contiguous local tensor (stride {loc.stride()}). {fix}")
    return loc


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
        self.optimizer = optimizer
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
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    @property  # type: ignore[override]
    def state(self) -> defaultdict:
        """Per original parameter: its states (element-wise ones as views, in its layout)."""
        out: defaultdict = defaultdict(dict)
        for plan in self._plans:
            for p, (run, i) in zip(plan.params, plan.where):
                st = self._param_state(p, run, i)
                if st:
                    out[p] = st
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
        return f"FlatParamOptimizer({params} parameters in {runs} runs, {self.optimizer!r})"

    # -- building -------------------------------------------------------------------------------
    def _build(self) -> None:
        cls = type(self.optimizer)
        self._plans = [_GroupPlan(g, gi, cls) for gi, g in enumerate(self.param_groups)]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer (its defaults apply) and plan its runs."""
        self.optimizer.add_param_group(param_group)
        g = self.param_groups[-1]
        self._plans.append(_GroupPlan(g, len(self.param_groups) - 1, type(self.optimizer)))

    def num_flat_tensors(self) -> int:
        """How many tensors the wrapped optimizer steps when every parameter has a gradient."""
        return sum(len(run.bounds) - 1 for plan in self._plans for run in plan.runs)

    # -- the step -------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One step of the wrapped optimizer on the flat segments (see [flat-params])."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        inner = self.optimizer
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
    def _param_state(self, p: Tensor, run: _Run, i: int) -> dict[str, Any]:
        a, b = run.where(i)
        t = run.segs.get((a, b))
        st = self.optimizer.state.get(t) if t is not None else None
        if not st:
            return {}
        offs = run.offs
        numel = offs[b] - offs[a]
        lo, hi = offs[i] - offs[a], offs[i + 1] - offs[a]
        out: dict[str, Any] = {}
        for k, v in st.items():
            if _elementwise(v, numel):
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
        self.optimizer.state.clear()
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
                sigs = [_signature(st, n) for st, n in zip(locals_, run.numels)]
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
                        inner_state[index] = _merge_states(locals_[a:b], run.numels[a:b])
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
            self.optimizer.load_state_dict(
                {"state": inner_state, "param_groups": [sg for sg, _ in inner_groups]})
        finally:
            self.optimizer.param_groups = groups
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
                out[k] = loc.to(device=_local(p).device)
            else:
                out[k] = v
        return out


def _state_dtensor(p: DTensor, flat_state: Tensor, lo: int, hi: int) -> DTensor:
    """Elements ``[lo, hi)`` of a flat state as a DTensor laid out like ``p`` (a view, no copy).

    The DTensor is created on an empty local tensor that is then pointed at the state's memory:
    a DTensor created directly on a view at a non-zero storage offset cannot be pickled or
    deep-copied in torch 2.13 (its wrapper inherits the offset, so ``Tensor.__reduce_ex__``
    takes it for a tensor with real storage). No autograd history: states are data.
    """
    local = flat_state.new_empty(0)
    out = ragged_from_local(local, p.device_mesh, tuple(p.placements), p.shape, p.stride(),
                            autograd=False, check=False)
    out._local_tensor.set_(flat_state.untyped_storage(), flat_state.storage_offset() + lo,
                           (hi - lo,), (1,))
    return out


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
                    _check_param(p, gi, j, g.get("param_names"))
        except (TypeError, ValueError):
            return optimizer
    return FlatParamOptimizer(optimizer)

