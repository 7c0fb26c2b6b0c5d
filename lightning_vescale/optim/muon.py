"""Layer 4: Muon with an AdamW fallback, exact on RaggedShard-sharded parameters.

Design note [distributed-muon]
------------------------------
Muon orthogonalises each 2-D update with Newton–Schulz (NS), which needs the *whole* matrix:
running it on a shard silently gives a wrong update. Every rank could all-gather every matrix
and run NS redundantly ("naive"), but that multiplies NS work by the world size and moves
``W x`` the bytes. Instead, per step:

1. *Momentum on the shard.* ``buf.lerp_(g, 1 - mu)`` and the Nesterov blend are element-wise, so
   each rank updates only its local slice (bitwise what a single process computes).
2. *Owner assignment.* Every matrix gets one owner rank, chosen by longest-processing-time greedy
   on the NS cost ``~ rows * cols * min(rows, cols)`` over all matrices (:func:`assign_owners`),
   then moved to the rank already holding most of it wherever that keeps LPT's max load (fewer
   bytes). The choice is a pure function of shapes and placements, so every rank computes the
   same owners without talking. (Balancing per bucket instead was measured worse: it forced
   matrices off their holders and raised the total imbalance.)
3. *Gather to the owner.* Conceptually a redistribution ``RaggedShard(dims, units) ->
   RaggedShard((), one_hot(owner))``. Matrices are grouped in buckets (:func:`plan_buckets`,
   taking matrices round-robin over owners so every bucket has work for every owner); each
   bucket moves with ONE ``all_to_all_single`` (split sizes from the ranks' ranges, which all
   ranks know from the placement). Payload is bfloat16: NS starts with ``update.bfloat16()``, so
   casting before sending is exact and halves the bytes.
4. *NS on the owner only*, batched over same-shape matrices (see ``_newton_schulz.py``), while
   the next bucket's all-to-all is in flight (``async_op=True``).
5. *Scatter back* with the mirror all-to-all, then apply ``p <- p (1 - lr wd) - lr_adj * O`` on
   the local slice (again element-wise, so bitwise equal to torch.optim.Muon).

Ranks holding zero elements, uneven ranges and more ranks than matrices need nothing special:
every rank joins every bucket's collectives, possibly with empty splits. The plan is cached and
rebuilt when the set of parameters with gradients changes. Contract: the set of parameters with
``grad is not None`` is the same on every rank (true under data parallel / fully_shard).

Parameter routing (see :class:`Muon`): 2-D and conv-style (viewed as ``(shape[0], -1)``) hidden
weights go to Muon; 1-D parameters, embeddings and the model's output head (by name, see
:data:`DEFAULT_ADAMW_PATTERNS`) go to an AdamW fallback with its own hyper-parameters; the AdamW
fallback is element-wise and runs on local shards without communication. Optimizer states are
stored with the parameter's type: for a RaggedShard DTensor parameter they are DTensors with the
same placement, so distributed checkpoints can reshard them. ``Muon.load_state_dict`` also takes
a single-process (plain, full-shape) state dict into sharded parameters, slicing each state to
the rank's range.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim.adam import adam as _functional_adam

from lightning_vescale.optim._newton_schulz import (
    DEFAULT_EPS,
    DEFAULT_NS_COEFFICIENTS,
    DEFAULT_NS_STEPS,
    newton_schulz,
    newton_schulz_flops,
    validate_ns_args,
)
from lightning_vescale.placement import RaggedShard, ragged_from_local

try:  # DTensor needs a distributed-enabled torch build; plain tensors work without it.
    from torch.distributed.tensor import DTensor, Replicate
except ImportError:  # pragma: no cover - torch built without distributed
    DTensor = None  # type: ignore[assignment, misc]
    Replicate = None  # type: ignore[assignment, misc]

__all__ = [
    "Muon",
    "DEFAULT_ADAMW_PATTERNS",
    "assign_owners",
    "plan_buckets",
]

#: Regexes (``re.search`` on the parameter's qualified name) routed to AdamW by default:
#:
#: * embeddings: a name component that is, or has an ``_``-separated word that is, ``emb``,
#:   ``embed`` or ``embedding`` (plural too): ``tok_emb``, ``pos_emb``, ``embed_tokens``,
#:   ``word_embeddings``, ``embedding``; and GPT-2's ``wte``/``wpe``. Not ``ensemble``,
#:   ``membrane``, ``assembler``.
#: * the model's output head: a component ``lm_head`` or ``classifier`` anywhere, or a *top-level*
#:   ``head``/``output``/``fc_out`` (no component before it except the wrapper attributes
#:   ``model``, ``module``, ``_orig_mod``, ``_forward_module``, as in a LightningModule's
#:   ``self.model``). So ``head.weight`` and ``model.head.weight`` go to AdamW, but hidden
#:   layers named ``output`` (``encoder.layer.0.output.dense.weight``,
#:   ``blocks.0.attn.output.weight``) stay on Muon.
DEFAULT_ADAMW_PATTERNS: tuple[str, ...] = (
    r"(^|[._])(emb|embed|embedding)s?([._]|$)",
    r"(^|\.)(wte|wpe|lm_head|classifier)(\.|$)",
    r"^((model|module|_orig_mod|_forward_module)\.)*(head|output|fc_out)(\.|$)",
)

_MUON_KEYS = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps",
              "adjust_lr_fn")
_ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay")
_ADJUST_LR_FNS = (None, "original", "match_rms_adamw")


# ------------------------------------------------------------------------------------------------
# Pure planning (no process group): owners and buckets.
# ------------------------------------------------------------------------------------------------
def assign_owners(
    costs: Sequence[int],
    world_size: int,
    *,
    holdings: Sequence[Sequence[int]] | None = None,
    base_load: Sequence[int] | None = None,
) -> list[int]:
    """Owner rank per item: LPT greedy (largest cost first, onto the least-loaded rank).

    Ties on load are broken by ``base_load[r]`` (work already assigned elsewhere, e.g. earlier
    buckets), then by ``holdings[i][r]`` (elements of item ``i`` rank ``r`` already holds), then
    by the lowest rank. LPT's makespan (max load) is within 4/3 of optimal. With ``holdings``, a
    second pass prefers owners that already hold most of each item as long as no rank exceeds
    LPT's makespan; it is kept only if it moves fewer elements. Deterministic: every rank gets
    the same answer.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    base = list(base_load) if base_load is not None else [0] * world_size
    zero = [0] * world_size
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    load = [0] * world_size
    owners = [0] * len(costs)
    for i in order:
        hold = holdings[i] if holdings is not None else zero
        best = min(range(world_size), key=lambda r: (load[r], base[r], -hold[r], r))
        owners[i] = best
        load[best] += costs[i]
    if holdings is None:
        return owners
    # Locality pass: same LPT order, but put each item on the rank holding most of it among the
    # ranks where it still fits under LPT's makespan. Keep it only if the makespan is no worse
    # (so balance is never traded away) and fewer elements move.
    makespan = max(load)
    load2 = [0] * world_size
    owners2 = [0] * len(costs)
    for i in order:
        fits = [r for r in range(world_size) if load2[r] + costs[i] <= makespan]
        pool = fits or list(range(world_size))
        best = min(pool, key=lambda r: (-holdings[i][r], load2[r], base[r], r) if fits
                   else (load2[r], base[r], -holdings[i][r], r))
        owners2[i] = best
        load2[best] += costs[i]

    def moved(own: list[int]) -> int:
        return sum(sum(holdings[i]) - holdings[i][o] for i, o in enumerate(own))

    if max(load2) <= makespan and moved(owners2) < moved(owners):
        return owners2
    return owners


def plan_buckets(numels: Sequence[int], cap_numel: int) -> list[list[int]]:
    """Split items (in order) into consecutive buckets of at most ``cap_numel`` elements.

    An item larger than the cap gets a bucket of its own; empty input gives no bucket.
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, n in enumerate(numels):
        if current and size + n > cap_numel:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        buckets.append(current)
    return buckets


@dataclass(frozen=True, kw_only=True)
class _Bucket:
    """One all-to-all round. ``items`` index the step's distributed matrices."""

    items: tuple[int, ...]
    owned: tuple[int, ...]  # items of this bucket that this rank orthogonalises
    to_owner_send: tuple[int, ...]  # per destination rank: my elements of its matrices
    to_owner_recv: tuple[int, ...]  # per source rank: its elements of my matrices


@dataclass(frozen=True, kw_only=True)
class _CommPlan:
    key: tuple
    rank: int
    world_size: int
    shapes: tuple[tuple[int, int], ...]  # (rows, cols) per item
    ranges: tuple[tuple[tuple[int, int], ...], ...]  # per item, per rank
    owners: tuple[int, ...]
    buckets: tuple[_Bucket, ...]


def _build_plan(key: tuple, shapes: list[tuple[int, int]], ranges: list[list[tuple[int, int]]],
                rank: int, world_size: int, ns_steps: int, cap_numel: int) -> _CommPlan:
    """Owners for all matrices at once (best balance, most locality), then buckets.

    Buckets take the matrices round-robin over owners (each owner's in parameter order), so
    every bucket gives every owner some Newton–Schulz work while the next bucket is in flight.
    """
    costs = [newton_schulz_flops(r, c, ns_steps) for r, c in shapes]
    holds = [[e - s for s, e in rng] for rng in ranges]
    owners = assign_owners(costs, world_size, holdings=holds)
    per_owner = [[i for i in range(len(shapes)) if owners[i] == r] for r in range(world_size)]
    order = [i for column in itertools.zip_longest(*per_owner) for i in column if i is not None]

    def numel(i: int, r: int) -> int:
        return ranges[i][r][1] - ranges[i][r][0]

    buckets = []
    for positions in plan_buckets([shapes[i][0] * shapes[i][1] for i in order], cap_numel):
        items = [order[p] for p in positions]
        buckets.append(_Bucket(
            items=tuple(items),
            owned=tuple(i for i in items if owners[i] == rank),
            to_owner_send=tuple(sum(numel(i, rank) for i in items if owners[i] == d)
                                for d in range(world_size)),
            to_owner_recv=tuple(sum(numel(i, s) for i in items if owners[i] == rank)
                                for s in range(world_size)),
        ))
    return _CommPlan(key=key, rank=rank, world_size=world_size, shapes=tuple(shapes),
                     ranges=tuple(tuple(r) for r in ranges), owners=tuple(owners),
                     buckets=tuple(buckets))


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------
def _is_dtensor(t: Tensor) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def _local(t: Tensor) -> Tensor:
    """The rank's local tensor (a view, no copy) of a DTensor; ``t`` itself otherwise."""
    return t.to_local() if _is_dtensor(t) else t


def _zeros_state_like(p: Tensor) -> Tensor:
    """A zero state with the parameter's type: a DTensor with its placement for DTensors."""
    if _is_dtensor(p):
        local = torch.zeros_like(p.to_local(), memory_format=torch.preserve_format)
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())
    return torch.zeros_like(p, memory_format=torch.preserve_format)


def _state_to_param_layout(p: Tensor, value: Any, key: str, name: str) -> Any:
    """A loaded state ``value`` of parameter ``p`` in ``p``'s layout (see ``load_state_dict``)."""
    if key == "step" or not isinstance(value, Tensor):
        return value
    if tuple(value.shape) != tuple(p.shape):
        kind = "a DTensor of" if _is_dtensor(value) else "a tensor of"
        raise ValueError(
            f"Muon.load_state_dict: state {key!r} of parameter {name} is {kind} shape "
            f"{tuple(value.shape)}, but the parameter's (global) shape is {tuple(p.shape)}. "
            "States must be full-shape tensors (as a single-process Muon saves them) or DTensors "
            "of the parameter's shape (as a sharded one does); was the state saved for another "
            "model or another parameter order?")
    if _is_dtensor(value):
        if _is_dtensor(p) and tuple(value.placements) == tuple(p.placements) and \
                value.device_mesh == p.device_mesh:
            return value
        value = value.full_tensor()  # another layout: gather (every rank loads), slice below
    if not _is_dtensor(p):
        return value
    value = value.detach().to(device=p.device, dtype=p.dtype)
    placements = tuple(p.placements)
    if all(isinstance(pl, Replicate) for pl in placements):
        return DTensor.from_local(value.clone(), p.device_mesh, placements, run_check=False,
                                  shape=p.shape, stride=p.stride())
    if len(placements) == 1 and isinstance(placements[0], RaggedShard) and p.device_mesh.ndim == 1:
        start, end = placements[0].local_range(p.shape, p.device_mesh.get_local_rank(0))
        return ragged_from_local(value.reshape(-1)[start:end].clone(), p.device_mesh,
                                 placements[0], p.shape, p.stride())
    raise TypeError(f"Muon.load_state_dict: parameter {name} is a DTensor with placements "
                    f"{placements}; supported are Replicate and (RaggedShard(...),) on a 1-D "
                    "mesh.")


def _matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """2-D view of a Muon parameter: ``(shape[0], prod(shape[1:]))``."""
    return int(shape[0]), math.prod(int(s) for s in shape[1:])


def _adjust_lr(lr: float, adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """torch.optim.Muon's learning-rate adjustment, on the 2-D (flattened) shape."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        ratio = 1.0
    return lr * ratio


def _scalar(x: Any) -> float:
    return x.item() if isinstance(x, Tensor) else x


@dataclass(kw_only=True)
class _Item:
    """One Muon matrix in one step."""

    param: Tensor
    update: Tensor  # bf16: flat local slice (distributed) or the whole 2-D update (local)
    rows: int
    cols: int
    lr: float
    weight_decay: float
    adjusted_lr: float
    ns_args: tuple  # (ns_coefficients, ns_steps, eps) of its group
    group: Any = None  # process group (distributed items)
    result: Tensor | None = None  # bf16 NS output: local flat slice / whole matrix


# ------------------------------------------------------------------------------------------------
# The optimizer
# ------------------------------------------------------------------------------------------------
class Muon(torch.optim.Optimizer):
    """Muon for hidden matrices plus AdamW for everything else; exact on sharded parameters.

    Single-process semantics equal ``torch.optim.Muon`` (same arithmetic, bitwise equal results)
    for the Muon parameters and ``torch.optim.AdamW`` for the others. On ``RaggedShard``
    ``DTensor`` parameters the result is the same as single-process (see design note
    [distributed-muon] in this module).

    Args:
        params: an iterable of tensors, of ``(name, tensor)`` pairs (``model.named_parameters()``,
            recommended: names enable the embedding/head routing), or of param-group dicts.
            A group dict may set ``use_muon`` (bool) to route all its parameters explicitly and
            then uses the plain hyper-parameter keys of its kind (Muon: ``lr, weight_decay,
            momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn``; AdamW: ``lr,
            betas, eps, weight_decay``). A group without ``use_muon`` is routed per parameter and
            split in two; its plain keys override the Muon half and ``adamw_``-prefixed keys
            (``adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay``) the AdamW half.
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn: as in
            ``torch.optim.Muon`` (``adjust_lr_fn``: ``None``/``"original"`` scales lr by
            ``sqrt(max(1, rows/cols))``, ``"match_rms_adamw"`` by ``0.2 * sqrt(max(rows, cols))``).
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: the AdamW fallback's defaults (as
            ``torch.optim.AdamW``'s ``lr, betas, eps, weight_decay``).
        muon_patterns: regexes (``re.search`` on the name) forcing a >= 2-D parameter to Muon;
            checked first.
        adamw_patterns: regexes routing a parameter to AdamW (default
            :data:`DEFAULT_ADAMW_PATTERNS`: embeddings, i.e. name components with an
            ``emb``/``embed``/``embedding`` word and GPT-2's ``wte``/``wpe``, and the output
            head, i.e. ``lm_head``/``classifier`` or a top-level ``head``/``output``/``fc_out``,
            optionally behind ``model.``/``module.``; hidden layers named ``output`` inside
            blocks stay on Muon).
        bucket_cap_mb: upper bound on the bfloat16 size of the whole matrices moved by one
            all-to-all (a larger matrix gets its own bucket). Smaller buckets overlap
            communication with Newton–Schulz more finely.
        batch_newton_schulz: run NS on same-shape matrices of a bucket as one batched call.

    Routing of a parameter without an explicit group flag: ``muon_patterns`` match -> Muon;
    else ``adamw_patterns`` match -> AdamW; else ``ndim >= 2`` -> Muon (conv-style weights are
    viewed as ``(shape[0], -1)``), otherwise AdamW. Without names only the shape rule applies,
    so pass ``named_parameters()`` or explicit groups to keep embeddings off Muon.

    Each resolved entry of ``param_groups`` carries ``use_muon`` and its kind's keys, so LR
    schedulers scale both kinds. ``comm_bytes`` / ``ns_flops`` count, cumulatively for this rank,
    bytes sent to other ranks and Newton–Schulz FLOPs run here. :meth:`init_state` creates the
    states up front (needed before a distributed-checkpoint load).

    Example::

        model = GPT(cfg)                       # after fully_shard(...) or not: same call
        opt = Muon(model.named_parameters(), lr=0.02, weight_decay=0.1,
                   adamw_lr=3e-3, adamw_betas=(0.9, 0.95))
        # or explicitly: Muon([{"params": hidden, "use_muon": True},
        #                      {"params": others, "use_muon": False, "lr": 3e-3}])
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
        eps: float = DEFAULT_EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        adamw_lr: float = 1e-3,
        adamw_betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 1e-2,
        muon_patterns: Sequence[str] = (),
        adamw_patterns: Sequence[str] = DEFAULT_ADAMW_PATTERNS,
        bucket_cap_mb: float = 32.0,
        batch_newton_schulz: bool = True,
    ) -> None:
        self._muon_defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum,
                                   nesterov=nesterov, ns_coefficients=tuple(ns_coefficients),
                                   eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        self._adamw_defaults = dict(lr=adamw_lr, betas=tuple(adamw_betas), eps=adamw_eps,
                                    weight_decay=adamw_weight_decay)
        _check_muon_hparams(self._muon_defaults, where="Muon")
        _check_adamw_hparams(self._adamw_defaults, where="Muon", prefix="adamw_")
        if isinstance(muon_patterns, str) or isinstance(adamw_patterns, str):
            raise TypeError("muon_patterns and adamw_patterns must be sequences of regex "
                            "strings, e.g. adamw_patterns=('lm_head',), not a single string")
        self._muon_res = _compile_patterns(muon_patterns, "muon_patterns")
        self._adamw_res = _compile_patterns(adamw_patterns, "adamw_patterns")
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.batch_newton_schulz = bool(batch_newton_schulz)
        self.comm_bytes = 0
        self.ns_flops = 0
        self._plans: dict[Any, _CommPlan] = {}
        defaults = {**self._muon_defaults, **{f"adamw_{k}": v for k, v in
                                              self._adamw_defaults.items()}}
        super().__init__(params, defaults)

    # -- groups ----------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Route ``param_group`` (see the class docstring) and add the resolved group(s)."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
        group = dict(param_group)
        raw = group.pop("params")
        raw = [raw] if isinstance(raw, Tensor) else list(raw)
        named = [(x if isinstance(x, tuple) else (None, x)) for x in raw]
        if "param_names" in group:  # e.g. a group re-added from another optimizer
            names = list(group.pop("param_names"))
            named = [(n, p) for n, (_, p) in zip(names, named)]
        for name, p in named:
            if not isinstance(p, Tensor):
                raise TypeError(f"Muon can only optimize Tensors, got {type(p).__name__} "
                                f"for parameter {name!r}")
            if torch.is_complex(p):
                raise TypeError(f"Muon does not support complex parameters ({name!r})")
        if "use_muon" in group:
            use_muon = group.pop("use_muon")
            if not isinstance(use_muon, bool):
                raise TypeError(f"param group 'use_muon' must be a bool, got {use_muon!r}")
            self._add_resolved(named, use_muon, group)
            return
        muon_kw = {k: v for k, v in group.items() if not k.startswith("adamw_")}
        adamw_kw = {k[len("adamw_"):]: v for k, v in group.items() if k.startswith("adamw_")}
        to_muon = [(n, p) for n, p in named if self._routes_to_muon(n, p)]
        to_adamw = [(n, p) for n, p in named if not self._routes_to_muon(n, p)]
        if to_muon or not to_adamw:
            self._add_resolved(to_muon, True, muon_kw)
        if to_adamw:
            self._add_resolved(to_adamw, False, adamw_kw)

    def _routes_to_muon(self, name: str | None, p: Tensor) -> bool:
        if name is not None and any(r.search(name) for r in self._muon_res):
            if p.ndim < 2:
                raise ValueError(f"muon_patterns matched parameter {name!r} of shape "
                                 f"{tuple(p.shape)}, but Muon needs >= 2-D parameters; narrow "
                                 "the pattern.")
            return True
        if name is not None and any(r.search(name) for r in self._adamw_res):
            return False
        return p.ndim >= 2

    def _add_resolved(self, named: list[tuple[str | None, Tensor]], use_muon: bool,
                      overrides: dict[str, Any]) -> None:
        keys = _MUON_KEYS if use_muon else _ADAMW_KEYS
        defaults = self._muon_defaults if use_muon else self._adamw_defaults
        unknown = sorted(set(overrides) - set(keys))
        if unknown:
            kind = "Muon" if use_muon else "AdamW"
            raise ValueError(f"unknown {kind} param-group option(s) {unknown}; a {kind} group "
                             f"accepts {list(keys)} (an auto-routed group takes the AdamW ones "
                             "with an 'adamw_' prefix)")
        group = {**defaults, **overrides, "use_muon": use_muon}
        where = f"param group (use_muon={use_muon})"
        if use_muon:
            group["ns_coefficients"] = tuple(group["ns_coefficients"])
            _check_muon_hparams(group, where=where)
            for name, p in named:
                if p.ndim < 2:
                    raise ValueError(f"parameter {name!r} of shape {tuple(p.shape)} is in a "
                                     "use_muon=True group, but Muon needs >= 2-D parameters; "
                                     "put it in a use_muon=False (AdamW) group.")
        else:
            group["betas"] = tuple(group["betas"])
            _check_adamw_hparams(group, where=where, prefix="")
        has_names = all(n is not None for n, _ in named) and bool(named)
        if not has_names and any(n is not None for n, _ in named):
            raise ValueError("give names for all parameters or for none "
                             "(mix of (name, tensor) pairs and bare tensors)")
        group["params"] = [(n, p) for n, p in named] if has_names else [p for _, p in named]
        if not named and self.param_groups and "param_names" in self.param_groups[0]:
            group["param_names"] = []
        saved, self.defaults = self.defaults, {}
        try:  # the group is complete: keep torch from merging the other kind's defaults into it
            super().add_param_group(group)
        finally:
            self.defaults = saved

    @torch.no_grad()
    def init_state(self) -> None:
        """Create every missing state (zeros, AdamW ``step=0``) for parameters needing grads.

        States are otherwise created lazily on the first step. A distributed checkpoint load
        needs them in place first (at any world size: they take the *current* placements)::

            opt.init_state(); sd = {"optim": opt.state_dict()}
            torch.distributed.checkpoint.load(sd, checkpoint_id=path)
            opt.load_state_dict(sd["optim"])
        """
        for group in self.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                state = self.state[p]
                if group["use_muon"]:
                    if "momentum_buffer" not in state:
                        state["momentum_buffer"] = _zeros_state_like(p)
                elif "step" not in state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = _zeros_state_like(p)
                    state["exp_avg_sq"] = _zeros_state_like(p)

    # -- state dict ------------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``, converting states to the parameters'
        layout first.

        For a ``DTensor`` parameter a state may be a ``DTensor`` with its placement (kept), a
        ``DTensor`` with another placement (gathered, then sliced: a collective, so every rank
        must load) or a plain full-shape tensor, e.g. from a single-process run (sliced to this
        rank's range and wrapped with the parameter's placement). For a plain parameter a
        ``DTensor`` state is gathered. Any other shape raises ``ValueError`` naming the
        parameter, before anything is loaded.
        """
        params, names = [], []
        for g in self.param_groups:
            for i, p in enumerate(g["params"]):
                names.append(repr(g["param_names"][i]) if g.get("param_names")
                             else f"#{len(params)}")
                params.append(p)
        saved_ids = [i for g in state_dict.get("param_groups", ()) for i in g["params"]]
        if len(saved_ids) == len(params):  # else torch raises its own error below
            index = dict(zip(saved_ids, range(len(params))))
            state_dict = dict(state_dict)
            state_dict["state"] = {
                k: ({key: _state_to_param_layout(params[index[k]], v, key, names[index[k]])
                     for key, v in st.items()} if k in index and isinstance(st, dict) else st)
                for k, st in state_dict.get("state", {}).items()
            }
        super().load_state_dict(state_dict)

    # -- step ------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """Perform one optimization step (Muon groups and AdamW groups)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        items: list[_Item] = []
        for group in self.param_groups:
            if group["use_muon"]:
                items.extend(self._muon_momentum(group))
            else:
                self._adamw_step(group)
        self._orthogonalize(items)
        for it in items:
            p = _local(it.param)
            p.mul_(1 - it.lr * it.weight_decay)
            p.add_(it.result.reshape(p.shape), alpha=-it.adjusted_lr)
            it.result = None
        return loss

    def _muon_momentum(self, group: dict[str, Any]) -> list[_Item]:
        lr = _scalar(group["lr"])
        mu = group["momentum"]
        out = []
        names = group.get("param_names")
        ns_args = (group["ns_coefficients"], group["ns_steps"], group["eps"])
        for idx, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("Muon does not support sparse gradients")
            name = repr(names[idx]) if names else f"#{idx}"
            pg = self._process_group(p, name)
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = _zeros_state_like(p)
            grad, buf = _local(p.grad), _local(state["momentum_buffer"])
            if grad.shape != buf.shape:
                raise ValueError(f"gradient of Muon parameter {name} has local shape "
                                 f"{tuple(grad.shape)}, expected {tuple(buf.shape)} (give the "
                                 "gradient the parameter's placement)")
            buf.lerp_(grad, 1 - mu)
            update = grad.lerp(buf, mu) if group["nesterov"] else buf
            rows, cols = _matrix_shape(p.shape)
            update = update.bfloat16()  # exactly NS's first op; halves the bytes to move
            out.append(_Item(
                param=p,
                update=update.reshape(-1) if pg is not None else update.reshape(rows, cols),
                rows=rows, cols=cols, lr=lr, weight_decay=group["weight_decay"],
                adjusted_lr=_adjust_lr(lr, group["adjust_lr_fn"], rows, cols), ns_args=ns_args,
                group=pg))
        return out

    def _process_group(self, p: Tensor, name: str) -> Any:
        """The group to orthogonalise ``p`` over, or None when the whole matrix is local."""
        if not _is_dtensor(p):
            return None
        placements = tuple(p.placements)
        if len(placements) == 1 and isinstance(placements[0], RaggedShard):
            mesh = p.device_mesh
            if mesh.size() == 1:
                return None
            pg = mesh.get_group(0)
            rank = mesh.get_local_rank(0)
            if dist.get_rank(pg) != rank:  # pragma: no cover - exotic mesh orders
                raise ValueError(f"parameter {name}: mesh coordinate {rank} differs from its "
                                 f"process-group rank {dist.get_rank(pg)}")
            local_numel = p.to_local().numel()
            expected = placements[0].local_numel(p.shape, rank)
            if local_numel != expected:
                raise ValueError(f"parameter {name}: local tensor has {local_numel} elements "
                                 f"but {placements[0]!r} gives rank {rank} {expected} of shape "
                                 f"{tuple(p.shape)}")
            return pg
        if all(isinstance(pl, Replicate) for pl in placements):
            return None
        raise TypeError(f"Muon parameter {name} is a DTensor with placements {placements}; "
                        "supported are plain tensors, Replicate, and (RaggedShard(...),) on a "
                        "1-D mesh (as produced by lightning_vescale.fully_shard).")

    # -- Newton–Schulz: local items directly, distributed ones through owners --------------------
    def _orthogonalize(self, items: list[_Item]) -> None:
        local = [it for it in items if it.group is None]
        for it, out in zip(local, self._newton_schulz_many([it.update for it in local], local)):
            it.result = out
        by_group: dict[Any, list[_Item]] = {}
        for it in items:
            if it.group is not None:
                by_group.setdefault(it.group, []).append(it)
        for pg, dist_items in by_group.items():
            self._orthogonalize_distributed(pg, dist_items)

    def _newton_schulz_many(self, inputs: list[Tensor], items: list[_Item]) -> list[Tensor]:
        """NS of each whole bf16 matrix ``inputs[k]`` (any layout of ``items[k]``'s numel);
        same-shape matrices run as one batched call when ``batch_newton_schulz``."""
        outs: list[Tensor] = [None] * len(items)  # type: ignore[list-item]
        batches: dict[Any, list[int]] = {}
        for k, it in enumerate(items):
            key = (it.rows, it.cols, it.ns_args) if self.batch_newton_schulz else k
            batches.setdefault(key, []).append(k)
        for ks in batches.values():
            it = items[ks[0]]
            coeffs, steps, eps = it.ns_args
            if len(ks) == 1:
                outs[ks[0]] = newton_schulz(inputs[ks[0]].view(it.rows, it.cols), coeffs,
                                            steps, eps)
            else:
                stacked = torch.stack([inputs[k].view(it.rows, it.cols) for k in ks])
                for k, o in zip(ks, newton_schulz(stacked, coeffs, steps, eps).unbind(0)):
                    outs[k] = o
            self.ns_flops += len(ks) * newton_schulz_flops(it.rows, it.cols, steps)
        return outs

    def _plan(self, pg: Any, items: list[_Item]) -> _CommPlan:
        rank, world = dist.get_rank(pg), dist.get_world_size(pg)
        cap = max(1, int(self.bucket_cap_mb * 2**20) // 2)  # bf16 elements
        steps = items[0].ns_args[1]
        key = (tuple(id(it.param) for it in items), tuple(it.param.placements for it in items),
               tuple(tuple(it.param.shape) for it in items), cap, steps)
        plan = self._plans.get(pg)
        if plan is None or plan.key != key:
            shapes = [(it.rows, it.cols) for it in items]
            ranges = [[it.param.placements[0].local_range(it.param.shape, r) for r in range(world)]
                      for it in items]
            plan = _build_plan(key, shapes, ranges, rank, world, steps, cap)
            self._plans[pg] = plan
        return plan

    def _orthogonalize_distributed(self, pg: Any, items: list[_Item]) -> None:
        plan = self._plan(pg, items)
        rank, world = plan.rank, plan.world_size
        dtype, device = torch.bfloat16, items[0].update.device

        def numel(i: int, r: int) -> int:
            s, e = plan.ranges[i][r]
            return e - s

        def launch_gather(b: _Bucket):
            send = [items[i].update for d in range(world) for i in b.items if plan.owners[i] == d]
            send_t = torch.cat(send) if send else torch.empty(0, dtype=dtype, device=device)
            recv = torch.empty(sum(b.to_owner_recv), dtype=dtype, device=device)
            self.comm_bytes += 2 * (sum(b.to_owner_send) - b.to_owner_send[rank])
            work = dist.all_to_all_single(recv, send_t, list(b.to_owner_recv),
                                          list(b.to_owner_send), group=pg, async_op=True)
            return work, recv

        def finish_scatter(b: _Bucket, work, recv: Tensor) -> None:
            work.wait()
            off = 0
            for s in range(world):  # chunks from owner s: my slices of its matrices, in order
                for i in b.items:
                    if plan.owners[i] == s:
                        n = numel(i, rank)
                        items[i].result = recv[off:off + n]
                        off += n

        pending_scatter = None
        gather = launch_gather(plan.buckets[0]) if plan.buckets else None
        for k, b in enumerate(plan.buckets):
            work, recv = gather
            work.wait()
            if k + 1 < len(plan.buckets):  # overlap: next bucket moves while NS runs here
                gather = launch_gather(plan.buckets[k + 1])
            full: dict[int, Tensor] = {}
            offs = [0] * world  # per source: running offset inside its chunk
            starts = [sum(b.to_owner_recv[:s]) for s in range(world)]
            for i in b.owned:
                pieces = []
                for s in range(world):
                    n = numel(i, s)
                    pieces.append(recv[starts[s] + offs[s]: starts[s] + offs[s] + n])
                    offs[s] += n
                full[i] = torch.cat(pieces)
            outs = self._newton_schulz_many([full[i] for i in b.owned],
                                            [items[i] for i in b.owned])
            results = {i: o.reshape(-1) for i, o in zip(b.owned, outs)}
            send = []
            for d in range(world):
                for i in b.owned:
                    s_, e_ = plan.ranges[i][d]
                    send.append(results[i][s_:e_])
            send_t = torch.cat(send) if send else torch.empty(0, dtype=dtype, device=device)
            recv_back = torch.empty(sum(b.to_owner_send), dtype=dtype, device=device)
            self.comm_bytes += 2 * (sum(b.to_owner_recv) - b.to_owner_recv[rank])
            work_back = dist.all_to_all_single(recv_back, send_t, list(b.to_owner_send),
                                               list(b.to_owner_recv), group=pg, async_op=True)
            if pending_scatter is not None:
                finish_scatter(*pending_scatter)
            pending_scatter = (b, work_back, recv_back)
        if pending_scatter is not None:
            finish_scatter(*pending_scatter)

    # -- AdamW fallback ----------------------------------------------------------------------------
    def _adamw_step(self, group: dict[str, Any]) -> None:
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("Muon's AdamW fallback does not support sparse gradients")
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = _zeros_state_like(p)
                state["exp_avg_sq"] = _zeros_state_like(p)
            params.append(_local(p))
            grads.append(_local(p.grad))
            exp_avgs.append(_local(state["exp_avg"]))
            exp_avg_sqs.append(_local(state["exp_avg_sq"]))
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        _functional_adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=None,
                         capturable=False, differentiable=False, fused=None, has_complex=False,
                         decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2,
                         lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                         maximize=False)


# ------------------------------------------------------------------------------------------------
# Validation
# ------------------------------------------------------------------------------------------------
def _check_muon_hparams(h: dict[str, Any], *, where: str) -> None:
    lr = h["lr"]
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError(f"{where}: Tensor lr must have 1 element, got shape {tuple(lr.shape)}")
    if not _scalar(lr) >= 0.0:
        raise ValueError(f"{where}: lr must be >= 0, got lr={lr!r}")
    if not h["momentum"] >= 0.0:
        raise ValueError(f"{where}: momentum must be >= 0, got momentum={h['momentum']!r}")
    if not h["weight_decay"] >= 0.0:
        raise ValueError(f"{where}: weight_decay must be >= 0, got "
                         f"weight_decay={h['weight_decay']!r}")
    if h["adjust_lr_fn"] not in _ADJUST_LR_FNS:
        raise ValueError(f"{where}: adjust_lr_fn must be one of {_ADJUST_LR_FNS}, got "
                         f"adjust_lr_fn={h['adjust_lr_fn']!r}")
    if not isinstance(h["nesterov"], bool):
        raise TypeError(f"{where}: nesterov must be a bool, got nesterov={h['nesterov']!r}")
    validate_ns_args(h["ns_coefficients"], h["ns_steps"], h["eps"])


def _check_adamw_hparams(h: dict[str, Any], *, where: str, prefix: str) -> None:
    if not _scalar(h["lr"]) >= 0.0:
        raise ValueError(f"{where}: {prefix}lr must be >= 0, got {h['lr']!r}")
    betas = h["betas"]
    if len(betas) != 2 or not all(0.0 <= _scalar(b) < 1.0 for b in betas):
        raise ValueError(f"{where}: {prefix}betas must be two floats in [0, 1), got {betas!r}")
    if not h["eps"] >= 0.0:
        raise ValueError(f"{where}: {prefix}eps must be >= 0, got {h['eps']!r}")
    if not h["weight_decay"] >= 0.0:
        raise ValueError(f"{where}: {prefix}weight_decay must be >= 0, got "
                         f"{h['weight_decay']!r}")


def _compile_patterns(patterns: Sequence[str], arg: str) -> list[re.Pattern]:
    out = []
    for p in patterns:
        try:
            out.append(re.compile(p))
        except (re.error, TypeError) as e:
            raise ValueError(f"{arg}: {p!r} is not a valid regular expression ({e})") from e
    return out
