"""Layer 4: the runs and segments behind :class:`FlatParamOptimizer`.

See design note [flat-params] in ``_flat_params``: this module holds the pure mechanics (which
parameters form a run, how a run's optimizer state is split into segments and merged back);
``_flat_params`` holds the optimizer wrapper and its state-dict conversion. The layers below
own the shared pieces: the exactness probe that decides a run alignment per optimizer kind
(``placement._flat_probe``), where runs break (``placement._flat_runs``), and the link from a
parameter's memory to its DBuffer (``dbuffer.dbuffer_of``).
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_vescale.dbuffer import DBuffer, dbuffer_of
from lightning_vescale.placement import RaggedShard
from lightning_vescale.placement._flat_probe import is_elementwise_state
from lightning_vescale.placement._flat_probe import optimizer_alignment as exact_alignment
from lightning_vescale.placement._flat_runs import run_bounds, runs_follow

__all__ = ["GradSource", "GroupPlan", "Run", "check_param", "exact_alignment",
           "is_elementwise_state", "local_of", "merge_states", "padding_between",
           "state_signature"]

# ---------------------------------------------------------------------------------------------
# Runs and segments
# ---------------------------------------------------------------------------------------------
def local_of(p: Tensor) -> Tensor:
    return p._local_tensor if isinstance(p, DTensor) else p


class GradSource(NamedTuple):
    """Where :func:`_published_grad` reads a run's gradient (design note
    [dbuffer-published-grads]). ``buffer`` is ``None`` for a run without elements here."""

    buffer: DBuffer | None
    #: the run's elements in the buffer's (gradient) shard: ``[start, stop)``
    start: int
    stop: int
    #: the run is the whole shard: its gradient is ``grad_shard`` itself, no slice
    whole: bool
    #: the parameters with elements here, and their ids (the keys ``fully_shard`` records)
    params: list[Tensor]
    ids: list[int]
    #: parameters whose local part is empty: no memory to check, but a missing gradient still
    #: breaks the run (they join any run, whichever buffer they belong to)
    empty: list[Tensor]


class Run:
    """Consecutive parameters of one group, back to back in one storage (see [flat-params])."""

    __slots__ = ("params", "numels", "offs", "flat", "bounds", "segs", "itemsize", "dtype",
                 "source", "is_gap")

    def __init__(self, params: list[Tensor], is_gap: list[bool] | None = None) -> None:
        self.params = params
        #: per item: a padding gap of the DBuffer shard (a plain view, not a parameter; see
        #: :func:`padding_between`), stepped with the run, never exported
        self.is_gap = is_gap or [False] * len(params)
        locs = [local_of(p) for p in params]
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
        #: ``None`` for a run outside fully_shard's DBuffers (gradients read by
        #: :func:`_grad_pieces` only).
        self.source: GradSource | None = None
        full = [p for p, n, g in zip(params, self.numels, self.is_gap) if n and not g]
        empty = [p for p, n in zip(params, self.numels) if not n]
        n = self.offs[-1]
        if not full:
            self.source = GradSource(buffer=None, start=0, stop=0, whole=False, params=[], ids=[],
                                     empty=empty)
        else:
            # The DBuffer whose shard the run views (the parameters' own link to it): a run
            # inside one reads its published gradients as one slice ([dbuffer-published-grads]).
            buf = dbuffer_of(first)
            if buf is not None and buf.shard.device.type != "meta" and buf.shard.numel():
                lo, rem = divmod(self.flat.data_ptr() - buf.shard.data_ptr(), self.itemsize)
                if rem == 0 and 0 <= lo and lo + n <= buf.shard_size:
                    self.source = GradSource(buffer=buf, start=lo, stop=lo + n,
                                             whole=lo == 0 and n == buf.shard_size, params=full,
                                             ids=[id(p) for p in full], empty=empty)

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


def padding_between(x: Tensor, y: Tensor) -> Tensor | None:
    """The padding of one DBuffer shard between ``x`` and ``y`` (local parameter views), as a
    plain 1-D view, when ``y`` starts after ``x`` ends in that shard and no parameter of the
    buffer has an element in between; else ``None``.

    A run may span it ([flat-params]): the planner's alignment padding is zeros in the
    parameter and gradient shards, and Adam/AdamW/SGD map zero parameters, gradients and
    states to zeros, so stepping it changes nothing; it is never exported.
    """
    if x.dtype != y.dtype or not (x.numel() and y.numel()):
        return None
    buf = dbuffer_of(x)
    if buf is None or dbuffer_of(y) is not buf or buf.shard.dtype != x.dtype:
        return None
    size = x.element_size()
    base = buf.shard.data_ptr()
    lo, r1 = divmod(x.data_ptr() - base, size)
    hi, r2 = divmod(y.data_ptr() - base, size)
    lo += x.numel()
    if r1 or r2 or not 0 <= lo < hi <= buf.shard_size:
        return None
    if any(a < hi and lo < b for a, b in buf._local.values() if a < b):
        return None  # another parameter (another group's, a frozen one) lies in between
    return buf.shard.detach()[lo:hi]


_GRAD = operator.attrgetter("grad")


def _published_grad(run: Run) -> Tensor | None:
    """The whole run's flat gradient when every parameter holds the gradient ``fully_shard``
    published for it (design note [dbuffer-published-grads]): one identity check per
    parameter, then a slice of the DBuffer's grad shard. ``None``: use :func:`_grad_pieces`."""
    src = run.source
    if src is None:
        return None
    buf, start, stop, whole, full, ids, empty = src
    for p in empty:  # no memory to check; a missing gradient still breaks the run
        if p.grad is None:
            return None
    if buf is None:  # no elements here
        return run.flat.new_empty(0)
    published = buf.published_grads()
    if published is None:
        return None
    try:
        if not all(map(operator.is_, map(_GRAD, full), map(published.__getitem__, ids))):
            return None  # a gradient was replaced (p.grad = ...): check memory instead
    except KeyError:  # a parameter without a published gradient (grad None, or frozen)
        return None
    gs = buf.grad_shard
    assert gs is not None  # published_grads() answers only for the live grad shard
    return gs if whole else gs[start:stop]


def _grad_pieces(run: Run) -> list[tuple[int, int, Tensor]]:
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
                    gi = local_of(params[i].grad)  # type: ignore[arg-type]
                    views.append((i, i + 1, gi.reshape(-1)))
    return views


def _split_state(state: dict[str, Any], lo: int, hi: int, numel: int) -> dict[str, Any]:
    """The state of elements [lo, hi) of a segment of ``numel`` elements (views; 0-d cloned)."""
    out = {}
    for k, v in state.items():
        if is_elementwise_state(v, numel):
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


def state_signature(state: dict[str, Any], numel: int, *, values: bool = True) -> tuple:
    """What must be equal for two segments' states to merge (``values=False``: without the
    scalar values, which may live on an accelerator: reading them synchronises)."""
    sig = []
    for k in sorted(state):
        v = state[k]
        if is_elementwise_state(v, numel):
            sig.append((k, "elementwise", v.dtype, v.device))
        elif isinstance(v, Tensor):
            sig.append((k, "scalar", v.dtype, v.device, v.item() if values else None))
        else:
            sig.append((k, "value", repr(v)))
    return tuple(sig)


def merge_states(states: list[dict[str, Any]], numels: list[int],
                 scalars_from: int = 0) -> dict[str, Any]:
    """One state for adjacent segments with equal signatures (element-wise states
    concatenated, scalars from ``states[scalars_from]``)."""
    out = {}
    for k, v in states[scalars_from].items():
        if is_elementwise_state(v, numels[scalars_from]):
            out[k] = torch.cat([s[k] for s in states])
        elif isinstance(v, Tensor):
            out[k] = v.clone()
        else:
            out[k] = v
    return out


class GroupPlan:
    """The runs of one param group and the bookkeeping of their segments."""

    def __init__(self, group: dict[str, Any], gi: int, opt_cls: type[Optimizer]) -> None:
        params = list(group["params"])
        names = group.get("param_names")
        self.params = params
        self.runs: list[Run] = []
        self.where: list[tuple[Run, int]] = [None] * len(params)  # type: ignore[list-item]
        locs = [check_param(p, gi, j, names) for j, p in enumerate(params)]
        align_of: dict[tuple[torch.dtype, torch.device], int] = {}
        for loc in locs:
            if (loc.dtype, loc.device) not in align_of:
                align_of[(loc.dtype, loc.device)] = exact_alignment(opt_cls, group, loc.dtype,
                                                                    loc.device)
        # Element-wise maths does not care about order within a group: runs follow memory
        # (nested fully_shard interleaves the groups' parameters in module order). Empty local
        # parts sort first and join any run (no memory to line up).
        order = sorted(range(len(params)), key=lambda j: (locs[j].numel() > 0,
                                                          locs[j].data_ptr()))
        # Padding of a DBuffer shard between two parameters joins their run as a gap item
        # (issue 36: fully_shard's 256-aligned default pads before large tensors).
        seq: list[tuple[Tensor, int | None]] = []  # (local tensor, parameter index | None)
        for k, j in enumerate(order):
            gap = padding_between(seq[-1][0], locs[j]) if seq else None
            if gap is not None:
                seq.append((gap, None))
            seq.append((locs[j], j))
        ordered = [loc for loc, _ in seq]
        breaks = {k for k in range(len(seq) - 1)
                  if not runs_follow(ordered[k], ordered[k + 1], empty_joins=True)}
        aligns = [align_of[(loc.dtype, loc.device)] for loc in ordered]
        for a, b in run_bounds([loc.numel() for loc in ordered], breaks, aligns):
            while a < b and seq[a][1] is None:  # a run neither starts nor ends with a gap
                a += 1
            while b > a and seq[b - 1][1] is None:
                b -= 1
            if a < b:
                self._add_run(params, seq[a:b])
        self.items: list[Tensor] = []

    def _add_run(self, params: list[Tensor], entries: list[tuple[Tensor, int | None]]) -> None:
        run = Run([params[j] if j is not None else gap for gap, j in entries],
                  [j is None for _, j in entries])
        self.runs.append(run)
        for i, (_, j) in enumerate(entries):
            if j is not None:
                self.where[j] = (run, i)

    def prepare(self, state: dict[Tensor, dict[str, Any]]) -> list[Tensor]:
        """This step's inner parameters, each with ``.grad`` set (see [flat-params])."""
        items = []
        for run in self.runs:
            bounds = run.bounds
            grad = _published_grad(run)
            if grad is not None:  # every parameter has its published gradient: the usual case
                if len(bounds) == 2:
                    t = run.seg(0, bounds[1])
                    t.grad = grad
                    items.append(t)
                else:
                    offs = run.offs
                    for x, y in zip(bounds, bounds[1:]):
                        t = run.seg(x, y)
                        t.grad = grad[offs[x]:offs[y]]
                        items.append(t)
                continue
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
    def _split_at(run: Run, a: int, b: int, state: dict[Tensor, dict[str, Any]]) -> None:
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
    def _merge(run: Run, state: dict[Tensor, dict[str, Any]]) -> None:
        offs = run.offs
        segs = list(zip(run.bounds, run.bounds[1:]))
        sts = []
        for a, b in segs:
            t = run.segs.get((a, b))
            sts.append(state.get(t, {}) if t is not None else {})
        shapes = [state_signature(st, offs[b] - offs[a], values=False)
                  for st, (a, b) in zip(sts, segs)]
        # A segment of padding only (a gap item left out of a step in pieces) merges whatever
        # its scalars: its zeros are zeros at any step count; scalars come from the others.
        gaps = [all(run.is_gap[a:b]) for a, b in segs]

        def same(i: int, j: int) -> bool:
            if shapes[i] != shapes[j]:
                return False
            if gaps[i] or gaps[j]:
                return True
            (a, b), (x, y) = segs[i], segs[j]
            return state_signature(sts[i], offs[b] - offs[a]) == state_signature(sts[j], offs[y] - offs[x])

        new_bounds = [0]
        i = 0
        while i < len(segs):
            j = i
            while j + 1 < len(segs) and same(i, j + 1):
                j += 1
            a, b = segs[i][0], segs[j][1]
            if j > i and all(gaps[i:j + 1]):
                j = i  # cannot happen (gaps are never adjacent): nothing to take scalars from
                b = segs[i][1]
            if j > i:
                olds = [run.segs.pop(s, None) for s in segs[i:j + 1]]
                merged = [state.pop(t) for t in olds if t is not None and t in state]
                if merged:
                    numels = [offs[y] - offs[x] for x, y in segs[i:j + 1]]
                    first = next(k for k in range(j - i + 1) if not gaps[i + k])
                    state[run.seg(a, b)] = merge_states(merged, numels, first)
            new_bounds.append(b)
            i = j + 1
        run.bounds = new_bounds


def check_param(p: Tensor, gi: int, j: int, names: list[str] | None) -> Tensor:
    name = f"{names[j]!r}" if names else f"param_groups[{gi}]['params'][{j}]"
    fix = ("Use the optimizer unwrapped, or build it on the parameters of a module sharded with "
           "lightning_vescale.fsdp.fully_shard (or VeScaleFSDPStrategy).")
    if not isinstance(p, DTensor) or not any(isinstance(pl, RaggedShard) for pl in p.placements):
        kind = (f"a DTensor with placements {tuple(p.placements)}" if isinstance(p, DTensor)
                else f"a plain {type(p).__name__}")
        raise TypeError(f"FlatParamOptimizer: parameter {name} (shape {tuple(p.shape)}) is {kind};"
                        f" it needs fully_shard's RaggedShard DTensors. {fix}")
    if len(p.placements) > 1 and not isinstance(p.placements[-1], RaggedShard):
        raise NotImplementedError(
            f"FlatParamOptimizer: parameter {name} (shape {tuple(p.shape)}) is tensor-parallel "
            f"(placements {tuple(p.placements)}, design note [fsdp-tp]); FlatParamOptimizer does "
            "not support tensor-parallel parameters yet. Use the optimizer unwrapped.")
    loc = p._local_tensor
    if not loc.is_contiguous():
        raise ValueError(f"FlatParamOptimizer: parameter {name} (shape {tuple(p.shape)}) has a "
                         f"non-contiguous local tensor (stride {loc.stride()}). {fix}")
    return loc


