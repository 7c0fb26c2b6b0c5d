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
   on the NS cost ``~ rows * cols * min(rows, cols)`` over all matrices (``assign_owners``, in
   ``_muon_plan.py`` with the rest of the plan), then moved to the rank already holding most of
   it wherever that keeps LPT's max load (fewer bytes). The choice is a pure function of shapes and placements, so every rank computes the
   same owners without talking. (Balancing per bucket instead was measured worse: it forced
   matrices off their holders and raised the total imbalance.)
3. *Gather to the owner.* Conceptually a redistribution ``RaggedShard(dims, units) ->
   RaggedShard((), one_hot(owner))``. Matrices are grouped in buckets (``plan_buckets``,
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

Steps 3-5 are ``_muon_dist.py``. Parameter routing (see :class:`Muon` and ``_muon_groups.py``):
2-D, stacked-expert 3-D (each ``(out, in)`` matrix on its own: design note
[muon-stacked-experts] in ``_muon_groups.py``) and conv-style (viewed as ``(shape[0], -1)``)
hidden weights go to Muon; 1-D parameters,
embeddings and the model's output head (by name, see :data:`DEFAULT_ADAMW_PATTERNS`) go to an
AdamW fallback with its own hyper-parameters; the AdamW fallback is element-wise and runs on
local shards without communication. Optimizer states are stored with the parameter's type: for
a RaggedShard DTensor parameter they are DTensors with the same placement, so distributed
checkpoints can reshard them. ``Muon.load_state_dict`` also takes a single-process (plain,
full-shape) state dict into sharded parameters, slicing each state to the rank's range. Layouts,
parameter checks and that state conversion are the shared ones of ``_base.py`` (design note
[sharded-optimizer]).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam as _functional_adam

from lightning_vescale.optim._base import (
    ShardedOptimizer,
    ShardLayout,
    local_view,
    param_layout,
    state_in_param_layout,
    state_like,
)
from lightning_vescale.optim._muon_dist import (
    MatrixUpdate,
    NSArgs,
    orthogonalize,
    split_matrices,
)
from lightning_vescale.optim._muon_groups import (
    DEFAULT_ADAMW_PATTERNS,
    Router,
    adjusted_lr,
    check_adamw_hparams,
    check_muon_hparams,
    matrix_stack,
    resolve_groups,
    scalar,
)
from lightning_vescale.optim._muon_plan import CommPlan
from lightning_vescale.optim._newton_schulz import (
    DEFAULT_EPS,
    DEFAULT_NS_COEFFICIENTS,
    DEFAULT_NS_STEPS,
)
from lightning_vescale.optim._tp_layout import is_tp
from lightning_vescale.placement import RaggedShard

__all__ = ["Muon"]


#: Every key a resolved group may hold (either kind); anything else was added afterwards.
_RESOLVED = frozenset(("params", "param_names", "use_muon", "lr", "weight_decay", "momentum",
                       "nesterov", "ns_coefficients", "eps", "ns_steps", "adjust_lr_fn",
                       "matrix_view", "betas",
                       "foreach", "maximize", "capturable", "differentiable", "fused",
                       "decoupled_weight_decay"))


def _is_ragged(t: Tensor) -> bool:
    """A plain ``fully_shard`` DTensor (not a tensor-parallel one: those step locally)."""
    return isinstance(t, DTensor) and any(isinstance(pl, RaggedShard) for pl in t.placements) \
        and not is_tp(t.placements)


def _zeros_state(p: Tensor) -> Tensor:
    """A zero state laid out like ``p`` (a DTensor with its placement for a DTensor ``p``)."""
    return state_like(p, torch.zeros_like(local_view(p), memory_format=torch.preserve_format))


class Muon(ShardedOptimizer):
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
            momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn, matrix_view``;
            AdamW: ``lr,
            betas, eps, weight_decay``). A group without ``use_muon`` is routed per parameter and
            split in two; its plain keys override the Muon half and ``adamw_``-prefixed keys
            (``adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay``) the AdamW half.
        lr: as in ``torch.optim.Muon``.
        weight_decay: as in ``torch.optim.Muon``.
        momentum: as in ``torch.optim.Muon``.
        nesterov: as in ``torch.optim.Muon``.
        ns_coefficients: as in ``torch.optim.Muon``.
        eps: as in ``torch.optim.Muon``.
        ns_steps: as in ``torch.optim.Muon``.
        adjust_lr_fn: as in ``torch.optim.Muon``: ``None``/``"original"`` scales lr by
            ``sqrt(max(1, rows/cols))``, ``"match_rms_adamw"`` by ``0.2 * sqrt(max(rows, cols))``,
            with ``rows, cols`` the shape of each matrix: of each expert for a stack.
        matrix_view: which matrices a parameter is (design note [muon-stacked-experts]):
            ``"auto"`` (default) orthogonalises each ``(out, in)`` expert of a 3-D
            ``(E, out, in)`` weight on its own (``torch.optim.Muon`` on ``E`` separate 2-D
            parameters) and flattens 4-D+ (conv) weights to ``(shape[0], -1)``; ``"stack"``
            treats every leading dim as a stack; ``"flatten"`` one ``(shape[0], -1)`` matrix per
            parameter (the whole stack together). A group key of the same name overrides it.
        adamw_lr: the AdamW fallback's default ``lr`` (as torch's AdamW).
        adamw_betas: the AdamW fallback's default ``betas`` (as torch's AdamW).
        adamw_eps: the AdamW fallback's default ``eps`` (as torch's AdamW).
        adamw_weight_decay: the AdamW fallback's default ``weight_decay`` (as torch's AdamW).
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

    CPU offload (``CPUOffloadPolicy``): the owner's whole matrices and their states live on
    the CPU with the parameters, so the Newton-Schulz iterations run on the CPU; the first step
    warns once.
    """

    matrix_math = "Newton-Schulz iterations"  # on the CPU with offload: warned once
    tensor_parallel = "whole"  # design note [tp-matrix-optim]


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
        matrix_view: str = "auto",
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
                                   eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
                                   matrix_view=matrix_view)
        self._adamw_defaults = dict(lr=adamw_lr, betas=tuple(adamw_betas), eps=adamw_eps,
                                    weight_decay=adamw_weight_decay)
        check_muon_hparams(self._muon_defaults, where="Muon")
        check_adamw_hparams(self._adamw_defaults, where="Muon", prefix="adamw_")
        self._router = Router.from_patterns(muon_patterns, adamw_patterns)
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.batch_newton_schulz = bool(batch_newton_schulz)
        self.comm_bytes = 0
        self.ns_flops = 0
        self._plans: dict[Any, CommPlan] = {}
        # per user group: (its settings, how many resolved groups, each parameter's position)
        self._user_groups: list[tuple[dict[str, Any], int, list[tuple[int, int]]]] = []
        defaults = {**self._muon_defaults, **{f"adamw_{k}": v for k, v in
                                              self._adamw_defaults.items()}}
        super().__init__(params, defaults)

    # -- groups ----------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Route ``param_group`` (see the class docstring) and add the resolved group(s)."""
        named = bool(self.param_groups) and "param_names" in self.param_groups[0]
        if isinstance(param_group, dict):  # (resolve_groups names the type error otherwise)
            params = param_group.get("params", ())
            param_group = {**param_group,  # a generator is read once: keep the list
                           "params": [params] if isinstance(params, Tensor) else list(params)}
        resolved = resolve_groups(param_group, self._router, self._muon_defaults,
                                  self._adamw_defaults, named_optimizer=named)
        where = {id(x[1] if isinstance(x, tuple) else x): (k, j)
                 for k, group in enumerate(resolved) for j, x in enumerate(group["params"])}
        for group in resolved:
            saved, self.defaults = self.defaults, {}
            try:  # the group is complete: keep torch from merging the other kind's defaults
                super().add_param_group(group)
            finally:
                self.defaults = saved
        # How the user's group was split, by position: bind_names regroups the parameters the
        # resolved groups hold *then* (a strategy may have re-pointed them at sharded ones).
        order = [where[id(x[1] if isinstance(x, tuple) else x)] for x in param_group["params"]]
        spec = {k: v for k, v in param_group.items() if k not in ("params", "param_names")}
        self._user_groups.append((spec, len(resolved), order))

    def bind_names(self, named_parameters: Iterable[tuple[str, Tensor]]) -> bool:
        """Name the parameters this optimizer received without names, and route them again.

        ``Muon(model.parameters())`` cannot tell an embedding or the output head from a hidden
        matrix (it routes by shape alone), and that is how LightningCLI's ``optimizer:`` section
        and ``OptimizerCallable`` build it. The strategies (Trainer and Fabric) call this with the
        module's ``named_parameters()`` when they set the optimizer up, so that it becomes exactly
        the optimizer ``Muon(model.named_parameters(), ...)`` builds: the same groups,
        parameters, order, hyper-parameters and ``param_names``. Keys added to the groups after
        construction (an LR scheduler's ``initial_lr``) are carried over to the regrouped group
        of the same kind.

        Args:
            named_parameters: ``(name, parameter)`` pairs, e.g. ``module.named_parameters()``;
                the first name of a parameter counts (tied parameters have several).

        Returns:
            ``True`` if the groups were rebuilt with names, ``False`` if they had names already.

        Raises:
            RuntimeError: the optimizer has state already (names must come before the first
                step), or an LR scheduler would see a different number of groups.
            ValueError: a parameter of the optimizer has no name in ``named_parameters``
                (nothing is changed).
        """
        if not self.param_groups or "param_names" in self.param_groups[0]:
            return False
        if self.state:
            raise RuntimeError("Muon.bind_names must be called before the first step (the "
                               "optimizer has state); build it with named_parameters() instead.")
        names: dict[int, str] = {}
        for name, p in named_parameters:
            names.setdefault(id(p), name)
        sources, base = [], 0
        for spec, count, order in self._user_groups:
            params = [self.param_groups[base + k]["params"][j] for k, j in order]
            base += count
            missing = [tuple(p.shape) for p in params if id(p) not in names]
            if missing:
                raise ValueError(
                    f"Muon.bind_names: {len(missing)} parameter(s) of the optimizer (shapes "
                    f"{missing[:3]}{'...' if len(missing) > 3 else ''}) are not in the given "
                    "named_parameters; pass the named_parameters() of the module that owns them, "
                    "or build Muon with (name, parameter) pairs yourself.")
            sources.append({**spec, "params": [(names[id(p)], p) for p in params]})
        old_groups, old_sources = self.param_groups, self._user_groups
        self.param_groups, self._user_groups = [], []
        try:
            for spec in sources:
                self.add_param_group(spec)
            self._carry_group_extras(old_groups, old_sources)
        except Exception:
            self.param_groups, self._user_groups = old_groups, old_sources
            raise
        self._plans.clear()
        return True

    def _carry_group_extras(self, old_groups: list[dict[str, Any]],
                            old_sources: list[tuple[dict[str, Any], int, list]]) -> None:
        """Copy keys that were added to the old resolved groups (not set by resolution) into the
        new groups of the same source and kind."""
        start_old = start_new = 0
        for (_, n_old, _), (_, n_new, _) in zip(old_sources, self._user_groups):
            olds = old_groups[start_old:start_old + n_old]
            news = self.param_groups[start_new:start_new + n_new]
            start_old, start_new = start_old + n_old, start_new + n_new
            extras = {g["use_muon"]: {k: v for k, v in g.items() if k not in _RESOLVED}
                      for g in olds}
            if any(extras.values()) and len(olds) != len(news):
                raise RuntimeError(
                    "Muon.bind_names: naming the parameters changes the number of param groups "
                    f"({len(olds)} -> {len(news)}) and something (an LR scheduler?) already "
                    f"added {sorted({k for e in extras.values() for k in e})} to them; build "
                    "Muon with named_parameters() before creating the scheduler.")
            for g in news:
                g.update(extras.get(g["use_muon"], {}))

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
                        state["momentum_buffer"] = _zeros_state(p)
                elif "step" not in state:
                    self._init_adamw_state(state, p)

    @staticmethod
    def _init_adamw_state(state: dict[str, Any], p: Tensor) -> None:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = _zeros_state(p)
        state["exp_avg_sq"] = _zeros_state(p)

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
        refs = self._saved_param_refs(state_dict)
        if refs:  # else torch raises its own error below
            state_dict = dict(state_dict)
            state_dict["state"] = {
                k: ({key: self._loaded_state(refs[k].param, v, key, refs[k].name)
                     for key, v in st.items()} if k in refs and isinstance(st, dict) else st)
                for k, st in state_dict.get("state", {}).items()
            }
        super().load_state_dict(state_dict)

    @staticmethod
    def _loaded_state(p: Tensor, value: Any, key: str, name: str) -> Any:
        if key == "step" or not isinstance(value, Tensor):
            return value
        return state_in_param_layout(p, value, who="Muon", key=key, name=name)

    # -- step ------------------------------------------------------------------------------------
    def _update(self) -> None:
        items: list[MatrixUpdate] = []
        for group in self.param_groups:
            if group["use_muon"]:
                items.extend(self._muon_momentum(group))
            else:
                self._adamw_step(group)
        cost = orthogonalize(items, plans=self._plans,
                             cap_numel=max(1, int(self.bucket_cap_mb * 2**20) // 2),  # bf16
                             batch=self.batch_newton_schulz)
        self.comm_bytes += cost.comm_bytes
        self.ns_flops += cost.ns_flops
        for it in items:
            p = local_view(it.param)
            if it.local is not None:  # one matrix of a stack: its slice of the local tensor
                p = p.view(-1)[it.local[0]:it.local[1]]
            if p.numel() == 0:
                it.result = None
                continue
            p.mul_(1 - it.lr * it.weight_decay)
            p.add_(it.result.reshape(p.shape), alpha=-it.adjusted_lr)
            it.result = None

    def _muon_momentum(self, group: dict[str, Any]) -> list[MatrixUpdate]:
        lr = scalar(group["lr"])
        mu = group["momentum"]
        out = []
        names = group.get("param_names")
        ns_args = NSArgs(coefficients=group["ns_coefficients"], steps=group["ns_steps"],
                         eps=group["eps"])
        for idx, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("Muon does not support sparse gradients")
            name = repr(names[idx]) if names else f"#{idx}"
            layout = self._sharded_layout(p, name)
            count, rows, cols = matrix_stack(p.shape, group.get(
                "matrix_view", self._muon_defaults["matrix_view"]))
            if count > 1 and layout is not None and layout.tp is not None and \
                    layout.tp.permutes:
                raise NotImplementedError(
                    f"Muon parameter {name} (shape {tuple(p.shape)}) is a stack of {count} "
                    f"matrices, tensor-parallel with {p.placements[-1]} (design note "
                    "[tp-matrix-optim]): only Shard(0) (the stack dim) is supported for stacks. "
                    "Shard the stack dim, or route it to the AdamW fallback (use_muon=False).")
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = _zeros_state(p)
            grad, buf = local_view(p.grad), local_view(state["momentum_buffer"])
            if grad.shape != buf.shape:
                raise ValueError(f"gradient of Muon parameter {name} has local shape "
                                 f"{tuple(grad.shape)}, expected {tuple(buf.shape)} (give the "
                                 "gradient the parameter's placement)")
            buf.lerp_(grad, 1 - mu)
            update = grad.lerp(buf, mu) if group["nesterov"] else buf
            update = update.bfloat16()  # exactly NS's first op; halves the bytes to move
            adj = adjusted_lr(lr, group["adjust_lr_fn"], rows, cols)
            for k, (matrix, ranges, where) in enumerate(split_matrices(update, layout, count,
                                                                        rows, cols)):
                out.append(MatrixUpdate(
                    param=p, update=matrix, rows=rows, cols=cols, lr=lr,
                    weight_decay=group["weight_decay"], adjusted_lr=adj, ns_args=ns_args,
                    layout=layout, ranges=ranges, local=where,
                    name=name if count == 1 else f"{name}[{k}]"))
        return out

    @staticmethod
    def _sharded_layout(p: Tensor, name: str) -> ShardLayout | None:
        """``p``'s layout when Newton–Schulz needs other ranks' parts of it; ``None`` when the
        whole matrix is local (plain, ``Replicate``, or sharded over a single rank)."""
        layout = param_layout(p, where=f"Muon parameter {name}")
        return layout if layout.placement is not None and len(layout.ranges) > 1 else None

    # -- AdamW fallback ----------------------------------------------------------------------------
    def _adamw_step(self, group: dict[str, Any]) -> None:
        """torch's AdamW over the group. All-RaggedShard groups pass their DTensors with
        ``foreach=True``: the element-wise work then runs on whole DBuffer shards (design note
        [flat-step] in ``lightning_vescale.placement``); torch's multi-tensor AdamW is bitwise
        its single-tensor one, so results equal ``torch.optim.AdamW``'s either way. Other
        groups step the local tensors (single-tensor on CPU, as ``torch.optim.AdamW``)."""
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError("Muon's AdamW fallback does not support sparse gradients")
            state = self.state[p]
            if "step" not in state:
                self._init_adamw_state(state, p)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        flat = all(_is_ragged(t) for lst in (params, grads, exp_avgs, exp_avg_sqs) for t in lst)
        if not flat:
            params, grads, exp_avgs, exp_avg_sqs = (
                [local_view(t) for t in lst] for lst in (params, grads, exp_avgs, exp_avg_sqs))
        beta1, beta2 = group["betas"]
        _functional_adam(params, grads, exp_avgs, exp_avg_sqs, [], steps,
                         foreach=True if flat else None,
                         capturable=False, differentiable=False, fused=None, has_complex=False,
                         decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2,
                         lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                         maximize=False)
