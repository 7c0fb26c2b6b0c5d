"""Layer 4: the base of optimizers that need whole matrices (SOAP, Shampoo).

What they share (design note [distributed-soap] in ``soap.py``): the parameter checks, the
per-parameter choice between stepping local whole matrices and moving split ones to their
owner ranks and back (``_matrix_layout.py``; the owners are planned once over all parameters),
applying the update and decoupled weight decay to the local slice, a failure of one rank's
owner-side work raised on every rank (design note [owner-failure]), and the state
export/import for distributed checkpoint. A subclass says which dimensions it preconditions
(:meth:`_unit_args`) and steps the matrices (:meth:`_step_matrices`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_vescale.mesh import all_to_all_single_anywhere
from lightning_vescale.optim._base import ShardedOptimizer, local_view, param_layout
from lightning_vescale.optim._matrix_layout import (
    MatrixLayout,
    assign_owners,
    matrix_layout,
    needs_owners,
)
from lightning_vescale.optim._owner_failure import StepFailures

__all__ = ["WholeMatrixOptimizer"]


class WholeMatrixOptimizer(ShardedOptimizer):
    """Steps every parameter's whole matrices where they lie; see the module docstring."""

    #: the optimizer's name in messages
    who = "WholeMatrixOptimizer"
    tensor_parallel = "whole"  # design note [tp-matrix-optim]

    @staticmethod
    def check_hparams(h: dict[str, Any], *, where: str) -> None:
        """Raise ``ValueError`` for a bad hyper-parameter of ``h`` (the subclass's checks)."""
        raise NotImplementedError

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As ``torch.optim.Optimizer.add_param_group``, with :meth:`check_hparams` applied to
        the group's settings over the defaults; complex parameters are refused."""
        if isinstance(param_group, dict):
            self.check_hparams({**self.defaults, **{k: v for k, v in param_group.items()
                                                    if k != "params"}},
                               where=f"{self.who} param group #{len(self.param_groups)}")
        super().add_param_group(param_group)
        self._owners: dict[int, tuple[int, ...]] | None = None  # planned again at first use
        for p in self.param_groups[-1]["params"]:
            if torch.is_complex(p):
                raise TypeError(f"{self.who} does not support complex parameters (its factors "
                                "are real); view them as real with torch.view_as_real or use "
                                "torch.optim.AdamW for them.")

    def _unit_args(self, group: dict[str, Any]) -> dict[str, Any]:
        """``max_precond_dim`` and ``precondition_1d`` for ``matrix_layout``."""
        raise NotImplementedError

    def _layout(self, p: Tensor, group: dict[str, Any], name: str) -> MatrixLayout:
        if getattr(self, "_owners", None) is None:
            self._owners = self._plan_owners()
        return matrix_layout(p, **self._unit_args(group), name=f"{self.who}: {name}",
                             owners=self._owners.get(id(p)))

    def _plan_owners(self) -> dict[int, tuple[int, ...]]:
        """Owner ranks of every split matrix, balanced over all parameters of one shard group
        at once (the same plan on every rank: parameters in group order). Tensor-parallel
        parameters are planned over the flattened (dp, tp) mesh, the others of the same model
        over dp (design note [tp-matrix-optim])."""
        by_group: dict[Any, tuple[list[int], list[Any]]] = {}
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                where = f"{self.who}: #{i} of group {gi}"
                item = needs_owners(p, **self._unit_args(group), name=where)
                if item is not None:
                    info = param_layout(p, where=where).mesh_info
                    split, items = by_group.setdefault(info.shard_group, ([], []))
                    split.append(id(p))
                    items.append(item)
        owners: dict[int, tuple[int, ...]] = {}
        for split, items in by_group.values():
            owners.update(zip(split, assign_owners(items, len(items[0][0]))))
        return owners

    def _step_matrices(self, st: dict[str, Any], grad: Tensor, group: dict[str, Any],
                       lay: MatrixLayout) -> Tensor | None:
        """The update (to subtract, before weight decay) of the matrices ``grad`` holds (flat),
        or ``None`` for a step that only initialises."""
        raise NotImplementedError

    def _initialising(self, st: dict[str, Any]) -> bool:
        """Whether a step with state ``st`` only initialises (:meth:`_step_matrices` returns
        ``None``: no update to send back); the same on every rank."""
        return False

    def _update(self) -> None:
        todo = []
        for gi, group in enumerate(self.param_groups):
            for i, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{self.who}: parameter #{i} of group {gi} has a sparse "
                                       f"gradient; {self.who} needs dense gradients.")
                name = f"#{i} of group {gi}"
                todo.append((p, group, name, self._layout(p, group, name)))
        # Local matrices first: a failure there travels with the owned ones' exchanges.
        failures = StepFailures(self.who)
        for p, group, name, lay in sorted(todo, key=lambda t: t[3].owned):
            self._step_param(p, group, name, lay, failures)
        failures.raise_if_failed()  # design note [owner-failure]

    def _step_param(self, p: Tensor, group: dict[str, Any], name: str, lay: MatrixLayout,
                    failures: StepFailures) -> None:
        local = local_view(p.detach())
        grad = local_view(p.grad.detach()).float().reshape(-1)
        st, where = self.state[p], f"stepping parameter {name}"
        if lay.owned:  # split matrices: to their owners, stepped there, and back
            owned = _exchange(grad, lay.recv_splits, lay.send_splits, lay)
            tp = lay.layout.tp
            if tp is not None:  # design note [tp-matrix-optim]: virtual -> global order
                ranges = _clipped(lay)
                owned = tp.gather(torch.split(owned, list(lay.recv_splits)), ranges)
            initialising = self._initialising(st)
            update = failures.run(where, self._step_matrices, st, owned, group, lay)
            if tp is not None and update is not None:
                update = tp.scatter(update.reshape(-1), lay.recv_splits, ranges)
            update = _send_back(update, owned, initialising, lay, failures)
        else:
            update = failures.run(where, self._step_matrices, st, grad, group, lay)
        if update is not None:
            local.view(-1).sub_(update.reshape(-1).to(local.dtype))
            local.mul_(1.0 - group["lr"] * group["weight_decay"])

    # -- state dict ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """As ``torch.optim.Optimizer.state_dict``; for DTensor parameters the states are
        DTensors so that distributed checkpoint reshards them."""
        sd = super().state_dict()
        refs = self._param_refs()
        for k, st in sd["state"].items():
            ref = refs[k]
            if isinstance(ref.param, DTensor) and st:
                lay = self._layout(ref.param, ref.group, ref.name)
                sd["state"][k] = {key: lay.export(key, v) for key, v in st.items()}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load :meth:`state_dict`'s output, a single-process one, or one resharded by
        distributed checkpoint (gathering a DTensor in another layout is a collective: every
        rank must load)."""
        state_dict = dict(state_dict)
        saved = state_dict.get("state", {})
        state_dict["state"] = {}
        super().load_state_dict(state_dict)
        refs = self._saved_param_refs(state_dict)
        for k, st in saved.items():
            if k not in refs:
                continue
            ref = refs[k]
            lay = self._layout(ref.param, ref.group, ref.name)
            self.state[ref.param] = {key: lay.import_(key, v, ref.param, ref.name, self.who)
                                     for key, v in st.items()}


def _clipped(lay: MatrixLayout) -> list[tuple[int, int]]:
    """Every rank's range clipped to this owner's span (what it receives from each)."""
    u = lay.unit_numel
    lo, hi = lay.first * u, (lay.first + lay.count) * u
    return [(max(s, lo), max(min(e, hi), max(s, lo))) for s, e in lay.layout.ranges]


def _exchange(send: Tensor, recv_splits: tuple[int, ...], send_splits: tuple[int, ...],
              lay: MatrixLayout) -> Tensor:
    """One ``all_to_all_single`` over the shard group: ``send`` (split ``send_splits`` by
    destination) in, ``sum(recv_splits)`` elements out. Every rank of the group joins (the
    layouts are the same everywhere), with empty splits where it has nothing."""
    info = lay.layout.mesh_info
    assert info is not None
    out = send.new_empty(sum(recv_splits))
    all_to_all_single_anywhere(out, send.contiguous(), list(recv_splits), list(send_splits),
                               group=info.shard_group, mesh=info.mesh)  # offload: [mesh-device]
    return out


def _send_back(update: Tensor | None, owned: Tensor, initialising: bool, lay: MatrixLayout,
               failures: StepFailures) -> Tensor | None:
    """The owner's ``update`` of its matrices (``owned``: their gradients) back to the ranks
    holding them, with this rank's failure marker in front of each destination's piece (design
    note [owner-failure]); an initialising step sends the markers alone and returns ``None``.
    A rank that failed sends zeros."""
    if initialising:
        payload, back, mine = owned[:0], [0] * len(lay.send_splits), [0] * len(lay.recv_splits)
    else:
        assert update is not None or failures.failed, "only an initialising step returns None"
        payload = update.reshape(-1) if update is not None else torch.zeros_like(owned)
        back, mine = list(lay.send_splits), list(lay.recv_splits)
    send, send_splits = failures.with_markers(payload, mine)
    recv = _exchange(send, tuple(n + 1 for n in back), tuple(send_splits), lay)
    info = lay.layout.mesh_info
    assert info is not None
    out = failures.strip_markers(recv, back, info.shard_group)
    return None if initialising else out


# -- what SOAP's and Shampoo's states and checks share ---------------------------------------------
def new_matrix_state(g: Tensor, lay: MatrixLayout, basis_key: str) -> dict[str, Any]:
    """Fresh state for the matrices ``g`` (``(count, *unit_shape)``): ``step``, Adam's two
    moments (flat, like ``g``), and per preconditioned dimension ``i`` zero ``GG{i}`` factors
    and ``{basis_key}{i}`` matrices derived from them (SOAP's eigenbases, Shampoo's roots),
    each ``(count, d, d)``."""
    st: dict[str, Any] = {"step": torch.tensor(0.0),
                          "exp_avg": torch.zeros(g.numel(), device=g.device),
                          "exp_avg_sq": torch.zeros(g.numel(), device=g.device)}
    for i, d in enumerate(lay.unit_shape):
        if lay.preconditioned[i]:
            st[f"GG{i}"] = torch.zeros(lay.count, d, d, device=g.device)
            st[f"{basis_key}{i}"] = torch.zeros(lay.count, d, d, device=g.device)
    return st


def per_matrix(st: dict[str, Any], key: str, j: int, lay: MatrixLayout) -> list[Tensor | None]:
    """Matrix ``j``'s ``key{i}`` state for each dimension ``i`` (``None`` where that dimension
    is not preconditioned): what ``_kronecker.py``'s functions take."""
    return [st[f"{key}{i}"][j] if f"{key}{i}" in st else None
            for i in range(len(lay.unit_shape))]


def check_non_negative(h: dict[str, Any], keys: tuple[str, ...], *, where: str) -> None:
    """Each of ``keys`` is a number >= 0."""
    for key in keys:
        v = h[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ValueError(f"{where}: {key} must be a number >= 0, got {key}={v!r}")


def check_betas(betas: Any, *, where: str, example: str) -> None:
    """A pair of rates in ``[0, 1)``."""
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"{where}: betas must be a pair in [0, 1), got betas={betas!r}; e.g. "
                         f"betas={example}")


def check_positive_ints(h: dict[str, Any], examples: dict[str, str | None], *,
                        where: str) -> None:
    """Each key of ``examples`` is an ``int >= 1``; the error shows the example if any."""
    for key, example in examples.items():
        v = h[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            hint = f"; e.g. {example}" if example else ""
            raise ValueError(f"{where}: {key} must be an int >= 1, got {key}={v!r}{hint}")
