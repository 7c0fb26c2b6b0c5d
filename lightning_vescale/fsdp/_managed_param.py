"""A managed parameter of a group: its owners and its two long-lived parameter objects.

Design note [fsdp-param-objects]
--------------------------------
Every managed parameter has two long-lived ``nn.Parameter`` objects:

* ``sharded``: a DTensor with placements ``(RaggedShard,)`` (HSDP: ``(Replicate(),
  RaggedShard)``) whose local tensor is a 1-D view of the DBuffer's owned slice. This is what
  modules hold *at rest*: optimizers, ``state_dict()`` and ``named_parameters()`` see it, and
  its ``.grad`` is a DTensor view of the sharded gradient slice.
* ``unsharded``: a plain tensor over the DBuffer's unsharded storage (design note
  [dbuffer-views]). Modules hold it while the group computes. Its storage is freed between
  uses, but the object lives on, so the autograd graph recorded in forward stays valid.

Swapping is a dict assignment in each owner's ``_parameters`` (tied parameters have several
owners), as in FSDP2. Both objects are rebuilt only when the module moves device/dtype
(``_apply``, see design note [fsdp-materialize]). :attr:`ParamGroup.modules_hold_unsharded` says
which of the two the modules hold; :attr:`ParamGroup.is_unsharded` is also true while an
all-gather that will give them the unsharded ones is in flight (a prefetch).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from torch import nn

from lightning_vescale.dbuffer import DBuffer

__all__ = ["ManagedParam", "Owner", "set_param"]


class Owner(NamedTuple):
    """A module that registers a parameter, and the attribute name it uses."""

    module: nn.Module
    attr: str


_MODULE_SETATTR = nn.Module.__setattr__


def set_param(module: nn.Module, attr: str, param: nn.Parameter) -> None:
    """Register ``param`` as ``module.<attr>`` without nn.Module.__setattr__'s checks."""
    if type(module).__setattr__ is _MODULE_SETATTR:
        module._parameters[attr] = param
    else:  # a module overriding __setattr__: honour it
        setattr(module, attr, param)


@dataclass(eq=False, kw_only=True)
class ManagedParam:
    """One parameter of a group (see design note [fsdp-param-objects])."""

    name: str  # name relative to the group's module; key in the plan and DBuffer
    owners: list[Owner]
    shape: tuple[int, ...]
    requires_grad: bool
    buffer: DBuffer | None = None
    sharded: nn.Parameter | None = None
    unsharded: nn.Parameter | None = None
    got_grad: bool = False  # received a gradient since its last reduce-scatter
    #: its sharded parameter's post-accumulate-grad hooks ran in this backward, right after its
    #: group's reduce-scatter (design note [fsdp-post-acc-grad-hooks])
    hooks_ran: bool = False
    aliases: list[str] = field(default_factory=list)  # all names (tied params have several)
    #: all names relative to module ``k`` of a ``fully_shard([...])`` list, as ``(k, name)``
    scoped_aliases: list[tuple[int, str]] = field(default_factory=list)
    #: weak reference to the user's parameter before sharding (tie detection by later groups)
    original_weakref: weakref.ref | None = None
    hooks: list[Any] = field(default_factory=list)
    #: the DTensor placements of ``sharded`` and its gradient: ``(RaggedShard,)`` on a 1-D
    #: mesh, ``(Replicate(), RaggedShard)`` on an HSDP mesh. Set with the buffer at each build;
    #: one tuple per parameter, so ``ragged_from_local``'s per-step spec cache hits.
    placements: Any = None
    #: a tensor-parallel parameter's :class:`~lightning_vescale.fsdp._tp.TPSpec` (``shape`` is
    #: then its TP-local shape, what the group plans: design note [fsdp-tp]); ``None`` otherwise
    tp: Any = None
    #: the :class:`~lightning_vescale.mesh.MeshInfo` of a parameter that
    #: ``shard_placement_fn`` gave a mesh of its own (its DBuffer shards over it: design note
    #: [fsdp-param-mesh]); ``None``: the group's
    mesh_info: Any = None
    #: the ``DTensorSpec`` of its sharded gradient, from the first publication: later ones wrap
    #: the new gradient view with it directly (a gradient per parameter per step, issue 36)
    grad_spec: Any = None

    def dtensor_meta(self, mesh: Any) -> tuple[Any, tuple[int, ...], Any]:
        """``(mesh, global shape, global stride or None)`` of the sharded DTensor and its
        gradient: the group's mesh, or a TP parameter's 2-D ``(dp, tp)`` mesh."""
        if self.tp is None:
            return mesh, self.shape, None
        return self.tp.mesh, self.tp.shape, self.tp.stride
