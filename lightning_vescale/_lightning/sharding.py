"""How both strategies turn a model into ``fully_shard`` groups (and check the arguments for it).

The Trainer and the Fabric strategy shard the same way; this module is that one implementation.
It talks to the engine (layer 3) through its public API only.

Design note [sharding-units]
----------------------------
Which modules become ``fully_shard`` groups is the one modelling decision a user makes. The
default fits transformer-style models without configuration: every child of every
``nn.ModuleList`` (the blocks) is a group, then the root takes whatever is left (embeddings,
final norm, head). ``sharding_units`` overrides it with module classes or class names (plain
strings keep LightningCLI/YAML configs simple: ``sharding_units: [Block]``; a dotted
``"package.module.Block"`` matches the fully qualified name). Groups are applied in post-order
(children before parents), so nested units work. A model the user already sharded (``fully_shard``
called in ``configure_model`` or before ``setup_module``) is respected: nothing is wrapped twice,
only a root is added when one is missing.

A model built on the CPU is never moved to the device whole: ``fully_shard`` copies each rank's
part of every group from the CPU source into the group's DBuffer on the mesh's device (design note
[mesh-device]), and buffers follow, so a GPU holds one rank's share plus one group's unsharded
buffers while sharding, not the whole model (FSDP2 does the same; Lightning's FSDP strategies
skip ``module_to_device`` for it). ``LightningModule.device`` is set to the device afterwards.

Granularity (shard bounds). Block-wise optimizers (``AdamW8bit``: blocks of 256 elements for
tensors with at least 4096 elements) need every rank's range to start on a block boundary.
The optimizer is created *after* sharding, so the strategy must make bounds block-aligned in
advance: ``optimizer_block_size`` (default 256) becomes the granularity of every parameter with
at least ``optimizer_min_block_numel`` elements (default 4096, the 8-bit threshold); smaller
tensors keep element granularity (less padding). An explicit ``granularity`` must be a multiple
of the block size; ``optimizer_block_size=None`` turns the alignment off.

Meta-device models (``init_module(empty_init=True)``, ``configure_model`` under the meta device)
are sharded on meta (no memory) and then materialised by ``lightning_vescale.fsdp.materialize``:
DBuffers on the device, ``reset_parameters()`` of every submodule on full temporaries, each rank
keeps its own ranges. The result equals non-meta initialisation with the same seed. Buffers built
on meta are recomputed (``reset_parameters()``, or a ``transformers`` model's ``_init_weights``
for rotary ``inv_freq``; design note [meta-buffers]); ``pretrained_weights`` then overwrite the
parameters ([pretrained-weights]).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import Any, Callable, Optional, Union

import torch
from lightning.fabric.utilities.device_dtype_mixin import _DeviceDtypeModuleMixin
from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn import Module
from torch.optim import Optimizer

from lightning_vescale.fsdp import (
    ReshardPolicy,
    VeScaleFSDPModule,
    find_replaced,
    fully_shard,
    materialize,
    reshard_policy,
)
from lightning_vescale.optim import DEFAULT_BLOCK_SIZE, DEFAULT_MIN_8BIT_SIZE
from lightning_vescale._lightning.granularity_rules import GranularityRules
from lightning_vescale.planner import (
    check_granularity,
    is_matrix_granularity,
    resolve_granularity,
)

__all__ = [
    "DEFAULT_OPTIMIZER_BLOCK_SIZE",
    "DEFAULT_MIN_BLOCK_NUMEL",
    "is_sharded",
    "reshard_all",
    "NoGradSync",
    "validate_sharding_args",
    "validate_reshard_after_forward",
    "validate_flat_optimizer",
    "validate_process_group_backend",
    "validate_timeout",
    "validate_state_dict_type",
    "ShardGranularity",
    "resolve_sharding_units",
    "has_meta",
    "shard_model",
    "remap_optimizer_params",
    "check_optimizer_params",
]

#: The default ``optimizer_block_size``: AdamW8bit's (and bitsandbytes') quantization block.
DEFAULT_OPTIMIZER_BLOCK_SIZE = DEFAULT_BLOCK_SIZE
#: Tensors below this many elements keep fp32 optimizer states in AdamW8bit: no alignment needed.
DEFAULT_MIN_BLOCK_NUMEL = DEFAULT_MIN_8BIT_SIZE


# ------------------------------------------------------------------------------------------------
# Groups of a sharded model (through the engine's public API)
# ------------------------------------------------------------------------------------------------
def _sharded_modules(module: Module) -> list[VeScaleFSDPModule]:
    return [m for m in module.modules() if isinstance(m, VeScaleFSDPModule)]


def is_sharded(module: Module) -> bool:
    """True if ``fully_shard`` was applied to ``module`` or any submodule."""
    return bool(_sharded_modules(module))


def _set_gradient_sync(module: Module, enabled: bool) -> None:
    """Turn reduce-scatter after backward on/off for every group under ``module``."""
    for m in _sharded_modules(module):
        m.set_requires_gradient_sync(enabled, recurse=False)


def reshard_all(module: Module) -> None:
    """Put every group under ``module`` back to its at-rest (sharded) state, if it is not.

    (``reshard()`` of a group that is already sharded changes nothing.)
    """
    for m in _sharded_modules(module):
        m.reshard()


class NoGradSync(AbstractContextManager):
    """Skip reduce-scatter inside the context (gradient accumulation), restore on exit."""

    def __init__(self, module: Module, enabled: bool = True) -> None:
        self._module = module
        self._enabled = enabled

    def __enter__(self) -> None:
        if self._enabled:
            _set_gradient_sync(self._module, False)

    def __exit__(self, *exc: Any) -> None:
        if self._enabled:
            _set_gradient_sync(self._module, True)


# ------------------------------------------------------------------------------------------------
# Arguments
# ------------------------------------------------------------------------------------------------
def validate_sharding_args(sharding_units: Any, granularity: Any, optimizer_block_size: Any,
                           optimizer_min_block_numel: Any) -> Optional[list[Union[str, type]]]:
    """Check the user's sharding arguments early (at construction), with actionable errors."""
    units: Optional[list[Union[str, type]]] = None
    if sharding_units is not None:
        if isinstance(sharding_units, (str, type)):
            sharding_units = [sharding_units]
        if not isinstance(sharding_units, Iterable):
            raise TypeError(
                f"sharding_units must be a list of nn.Module classes or class names (or None), "
                f"got {sharding_units!r}; e.g. sharding_units=['Block'].")
        units = list(sharding_units)
        for u in units:
            if not ((isinstance(u, str) and u.strip()) or
                    (isinstance(u, type) and issubclass(u, Module))):
                raise TypeError(
                    f"sharding_units entries must be nn.Module classes or class names, got {u!r}; "
                    "e.g. sharding_units=['Block'] or sharding_units=[Block]."
                )
    if optimizer_block_size is not None and (isinstance(optimizer_block_size, bool) or
                                             not isinstance(optimizer_block_size, int) or
                                             optimizer_block_size < 1):
        raise ValueError(
            f"optimizer_block_size must be a positive int or None, got {optimizer_block_size!r}; "
            f"e.g. optimizer_block_size={DEFAULT_OPTIMIZER_BLOCK_SIZE} (AdamW8bit's block) or "
            "None when the optimizer is not block-wise."
        )
    if (isinstance(optimizer_min_block_numel, bool) or
            not isinstance(optimizer_min_block_numel, int) or optimizer_min_block_numel < 0):
        raise ValueError(
            f"optimizer_min_block_numel must be an int >= 0, got {optimizer_min_block_numel!r}; "
            f"e.g. {DEFAULT_MIN_BLOCK_NUMEL} (AdamW8bit keeps smaller tensors in fp32)."
        )
    forms = (granularity.forms() if isinstance(granularity, GranularityRules)
             else (check_granularity(granularity),))
    for form in forms:
        _check_multiple_of_block(form, optimizer_block_size, optimizer_min_block_numel)
    return units


def parse_granularity(granularity: Any) -> Union[int, str, None, GranularityRules]:
    """The strategies' ``granularity`` argument: one form for every parameter, or a mapping of
    name patterns to forms (design note [granularity-rules])."""
    if isinstance(granularity, Mapping):
        return GranularityRules.parse(granularity)
    return granularity


def _check_multiple_of_block(granularity: Any, optimizer_block_size: Optional[int],
                             optimizer_min_block_numel: int) -> None:
    """An explicit element count must be a multiple of the optimizer's block."""
    elements = granularity if isinstance(granularity, int) else (
        int(granularity) if isinstance(granularity, str) and granularity.strip().isdigit()
        else None)
    if elements is not None and optimizer_block_size is not None \
            and elements % optimizer_block_size:
        up = -(-elements // optimizer_block_size) * optimizer_block_size
        raise ValueError(
            f"granularity={granularity!r} is not a multiple of optimizer_block_size="
            f"{optimizer_block_size}: AdamW8bit's quantization blocks would straddle ranks. Use "
            f"granularity={up} (the next multiple of {optimizer_block_size}), or "
            f"granularity=None (element-wise, and multiples of {optimizer_block_size} for "
            f"tensors of {optimizer_min_block_numel}+ elements: the least padding), or "
            "optimizer_block_size=None if the optimizer is not block-wise."
        )


def validate_reshard_after_forward(reshard_after_forward: Any) -> ReshardPolicy:
    """The ``reshard_after_forward`` argument as a :class:`ReshardPolicy` (``fully_shard``'s
    rule, design note [fsdp-reshard-policy]): ``None`` (auto), a ``bool``, or an ``int`` >= 1
    (whether it divides the shard group is checked at ``fully_shard``, once the mesh exists);
    not a truthy string from a config."""
    return reshard_policy(reshard_after_forward)


def validate_bool(name: str, value: Any, meaning: str) -> bool:
    """A strategy argument that must be a ``bool`` (not a truthy string from a config);
    ``meaning`` says what ``True`` and ``False`` do, for the error."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}: {meaning}")
    return value


def validate_flat_optimizer(flat_optimizer: Any) -> bool:
    """The ``flat_optimizer`` argument: a ``bool`` (not a truthy string from a config)."""
    return validate_bool(
        "flat_optimizer", flat_optimizer, "True steps torch.optim.Adam/AdamW/SGD on flat views "
        "of the shards (FlatParamOptimizer, bitwise the same result), False steps them per "
        "tensor.")


def validate_process_group_backend(backend: Any) -> Optional[str]:
    """The ``process_group_backend`` argument: ``None`` (from the accelerator), a backend name
    torch knows (``"gloo"``, ``"nccl"``, a registered one) or ``"cpu:gloo,cuda:nccl"``."""
    if backend is None:
        return None
    known = [b for b in torch.distributed.Backend.backend_list if b not in ("undefined", "fake")] \
        if torch.distributed.is_available() else []
    names = [part.split(":")[-1].strip().lower() for part in backend.split(",")] \
        if isinstance(backend, str) and backend.strip() else None
    if names is None or (known and any(n not in known for n in names)):
        raise ValueError(
            f"process_group_backend must be None (taken from the accelerator: 'gloo' on CPU, "
            f"'nccl' on CUDA) or one of {known} (or 'cpu:gloo,cuda:nccl'), got {backend!r}."
        )
    return backend


def validate_timeout(timeout: Any) -> Optional[timedelta]:
    """The process-group ``timeout`` argument: a positive ``timedelta`` or ``None`` (torch's)."""
    if timeout is None:
        return None
    if not isinstance(timeout, timedelta):
        seconds = timeout if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) \
            else 1800
        raise TypeError(
            f"timeout must be a datetime.timedelta (or None for torch's default), got "
            f"{timeout!r}; e.g. timeout=timedelta(seconds={seconds})."
        )
    if timeout.total_seconds() <= 0:
        raise ValueError(
            f"timeout must be positive, got {timeout.total_seconds():g} s: it is how long a "
            "collective waits for the other ranks before failing; e.g. "
            "timeout=timedelta(minutes=30)."
        )
    return timeout


def validate_state_dict_type(state_dict_type: Any) -> str:
    """The ``state_dict_type`` argument: ``"sharded"`` or ``"full"``."""
    if state_dict_type not in ("sharded", "full"):
        raise ValueError(
            f"state_dict_type must be 'sharded' or 'full', got {state_dict_type!r}: 'sharded' "
            "writes a distributed-checkpoint directory (every rank its shard), 'full' one file "
            "from rank 0 that a plain nn.Module can load."
        )
    return state_dict_type


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardGranularity:
    """The strategy's granularity policy, given to ``fully_shard`` as its per-parameter callable.

    See design note [sharding-units]: tensors of at least ``min_block_numel`` elements get the
    user's ``granularity`` rounded up to a multiple of ``optimizer_block_size`` (so block-wise
    optimizer states never straddle ranks); smaller ones the user's granularity as it is. Every
    form resolves to elements here, once, through the planner's ``resolve_granularity``.
    """

    granularity: Union[int, str, None, GranularityRules]
    optimizer_block_size: Optional[int]
    min_block_numel: int

    def explain(self) -> str:
        """The rule, in words: which tensors get which granularity and why (for reports)."""
        g = self.granularity
        if isinstance(g, GranularityRules):
            rules = ", ".join(f"{p!r}: {f!r}" for p, f in g.rules)
            return (f"parameters by name, first matching rule ({rules}); unmatched and "
                    f"None: the default. Each rule's granularity as follows. "
                    + dataclasses.replace(self, granularity=None).explain())
        own = ("element-wise" if g is None or g in (1, "element", "elements")
               else f"granularity={g!r}")
        if self.optimizer_block_size is None:
            return (f"every tensor: {own} (optimizer_block_size=None: no alignment for "
                    "block-wise optimizer states).")
        block = self.optimizer_block_size
        large = (f"multiples of {block} elements" if own == "element-wise"
                 else f"{own}, rounded up to a multiple of {block} elements")
        return (f"tensors of {self.min_block_numel:,}+ elements: {large} (optimizer_block_size="
                f"{block}: an AdamW8bit quantization block never straddles two ranks, so each "
                f"rank quantizes its own shard without communication); smaller tensors: {own} "
                f"(AdamW8bit keeps their states in fp32, so they need no alignment and "
                f"{'pad the least' if own == 'element-wise' else 'keep your granularity'}).")

    def form_for(self, fqn: str) -> Union[int, str, None]:
        """The user's granularity for the parameter named ``fqn`` (a rule's, design note
        [granularity-rules], or the one form given for all)."""
        g = self.granularity
        return g.form_for(fqn) if isinstance(g, GranularityRules) else g

    def __call__(self, name: str, param: Tensor) -> int:
        shape = tuple(param.shape)
        large = self.optimizer_block_size is not None and math.prod(shape) >= self.min_block_numel
        form = self.form_for(name)
        # "matrix" and a block: lcm(matrix, block), bounds between matrices and on blocks;
        # whether a block may hold two matrices is the optimizer's check (AdamW8bit's), not
        # this layout's (design note [granularity-rules])
        return resolve_granularity(form, shape,
                                   multiple_of=self.optimizer_block_size if large else None)

    def whole_matrices(self, named_params: Iterable[tuple[str, Tensor]]
                       ) -> list[tuple[str, Tensor]]:
        """The ``(name, param)`` pairs whose granularity is ``"matrix"`` (names fully
        qualified, as :meth:`form_for` reads them): what ``mark_whole_matrices`` records for the
        block-wise optimizer's check."""
        return [(n, p) for n, p in named_params if is_matrix_granularity(self.form_for(n))]

    def bound(self, prefix: str) -> Callable[[str, Tensor], int]:
        """This policy for the parameters of the module at ``prefix`` (``fully_shard`` names
        them relative to the module; the rules match fully qualified names)."""
        if not prefix:
            return self
        return lambda name, param: self(f"{prefix}.{name}", param)


def _qualified_class(name: str) -> Optional[type]:
    """The class a dotted name as users write it denotes (``torch.nn.Linear``,
    ``torch.nn.modules.linear.Linear``, ``mymodule.Block``), if its module imports and holds a
    class of that name; else ``None``."""
    if "." not in name:
        return None
    module_name, _, attr = name.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module_name), attr, None)
    except Exception:  # noqa: BLE001 - not an importable module path: no class
        return None
    return obj if isinstance(obj, type) else None


def _unit_matches(module: Module, unit: Union[str, type]) -> bool:
    cls = type(module)
    if not isinstance(unit, str):
        return isinstance(module, unit)
    if unit in (cls.__name__, cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}"):
        return True
    return _qualified_class(unit) is cls


def _class_matches(module: Module, units: Sequence[Union[str, type]]) -> bool:
    return any(_unit_matches(module, u) for u in units)


def _unmatched_unit_error(root: Module, unit: Union[str, type]) -> ValueError:
    """The error for a ``sharding_units`` entry that matches no submodule of ``root``: a
    submodule (attribute) name points at its class; otherwise the closest class names."""
    classes = sorted({type(m).__name__ for m in root.modules()})
    label = unit if isinstance(unit, str) else unit.__name__
    for path, m in root.named_modules():
        if path and label in (path, path.rpartition(".")[2]):
            inner = sorted({type(c).__name__ for c in m.children()})
            if isinstance(m, (nn.ModuleList, nn.ModuleDict, nn.Sequential)) and inner:
                what, suggest = f"{type(m).__name__} of {', '.join(inner)}", inner
            else:
                what, suggest = type(m).__name__, [type(m).__name__]
            return ValueError(
                f"sharding_units entry {label!r} is a submodule name ({what}), not a class; "
                f"sharding_units takes module classes or class names: did you mean "
                f"sharding_units={suggest}?")
    short = label.rpartition(".")[2]
    close = [c for c in classes if c.lower() in short.lower() or short.lower() in c.lower()]
    close += [c for c in difflib.get_close_matches(short, classes, n=3, cutoff=0.5)
              if c not in close]
    close = close[:3]
    hint = f" Closest: {close}." if close else ""
    return ValueError(
        f"sharding_units entry {label!r} matches no submodule of {type(root).__name__}.{hint} "
        f"Module classes in the model: {classes} (a class name, its qualified name such as "
        f"'torch.nn.Linear', or the class itself).")


def _post_order(module: Module) -> Iterable[Module]:
    for child in module.children():
        yield from _post_order(child)
    yield module


def resolve_sharding_units(root: Module, units: Optional[Sequence[Union[str, type]]]
                           ) -> list[Module]:
    """The modules (excluding ``root``) that become their own group, children first.

    ``units=None``: every child of every ``nn.ModuleList``; a model without one is a single group
    (logged once, with how to choose units). ``units=[]``: a single group, as asked. Entries are
    classes or class names as users write them (``"Block"``, ``"torch.nn.Linear"``,
    ``"torch.nn.modules.linear.Linear"``, ``"mymodule.Block"``).

    Raises:
        ValueError: an entry matches no submodule; it names a submodule (attribute) instead of a
            class (the message suggests the class), or lists the closest class names.
    """
    if units is None:
        chosen = {id(c) for m in root.modules() if isinstance(m, nn.ModuleList) for c in m}
        found = [m for m in _post_order(root) if id(m) in chosen and m is not root]
        if not found:
            rank_zero_info(
                f"vescale_fsdp: {type(root).__name__} has no nn.ModuleList and no sharding_units "
                "were given, so the whole model is one sharding group (all of it is gathered for "
                "forward and backward). To shard block by block, pass sharding_units=['YourBlock']"
                " (class names or classes; `python -m lightning_vescale.planner --model ...` "
                "shows the groups).")
        return found
    if not units:
        return []
    modules = [m for m in _post_order(root) if m is not root]
    for unit in units:  # every entry must match: a typo is an error, not a silent no-op
        if not any(_unit_matches(m, unit) for m in modules):
            raise _unmatched_unit_error(root, unit)
    return [m for m in modules if _class_matches(m, units)]


def has_meta(module: Module) -> bool:
    """True if any parameter or buffer of ``module`` is on the meta device."""
    return any(t.is_meta for t in itertools.chain(module.parameters(), module.buffers()))


def shard_model(
    root: Module,
    *,
    units: Optional[Sequence[Union[str, type]]],
    mesh: DeviceMesh,
    device: torch.device,
    mp_policy: Any,
    granularity: Optional[Callable[[str, Tensor], Any]],
    reshard_after_forward: Union[bool, int, ReshardPolicy, None],
    comm_policy: Any = None,
    init_params: bool = True,
) -> None:
    """Apply ``fully_shard`` to the units of ``root``, then to ``root`` itself (the root group).

    If the user already sharded (parts of) the model, only the missing root group is added.
    A meta-device model is sharded on meta, then materialised (``fsdp.materialize``: DBuffers on
    ``device``, ``reset_parameters()`` of every submodule, each rank keeps its ranges).
    ``init_params=False`` allocates a meta model's parameters without initialising them: every
    one of them is about to be loaded (design note [pretrained-weights]).
    """
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if comm_policy is not None:
        kwargs["comm_policy"] = comm_policy
    prefixes = {id(m): name for name, m in root.named_modules()}

    def granularity_at(module: Module) -> dict[str, Any]:
        # fully_shard names parameters relative to the module; a policy that matches fully
        # qualified names (design note [granularity-rules]) is bound to the module's prefix
        if granularity is None:
            return {}
        bound = getattr(granularity, "bound", None)
        return {"granularity": bound(prefixes.get(id(module), "")) if bound else granularity}
    # The root keeps its parameters after forward (backward needs them first): the "auto"
    # policy (reshard_after_forward=None), whatever the units were given; the strategy's value
    # applies to the units (design note [fsdp-reshard-policy]).
    root_kwargs = {**kwargs, "reshard_after_forward": ReshardPolicy(mode="auto")}
    is_meta = has_meta(root)
    if is_sharded(root):
        if not isinstance(root, VeScaleFSDPModule):  # the user sharded units: add the root only
            if not is_meta:
                _move_unsharded(root, device)
            fully_shard(root, **root_kwargs, **granularity_at(root))
    else:
        chosen = resolve_sharding_units(root, units)
        # no ``root.to(device)`` first: each group copies its rank's part from where the model
        # was built (design note [sharding-units])
        for unit in chosen:
            fully_shard(unit, **kwargs, **granularity_at(unit))
        fully_shard(root, **root_kwargs, **granularity_at(root))
        rules = getattr(granularity, "granularity", None)
        if isinstance(rules, GranularityRules):  # every parameter met the rules: a typo shows
            rules.check_all_used([n for n, _ in root.named_parameters()])
    if is_meta:
        materialize(root, device, init_params=init_params)
    _move_unsharded(root, device)
    _update_device_properties(root, device)


def _move_unsharded(module: Module, device: torch.device) -> None:
    """Move buffers to ``device`` (the root's ``fully_shard`` owns every parameter left, so no
    parameter stays unsharded); sharded groups stay put."""
    for m in module.modules():
        for name, b in list(m._buffers.items()):
            if b is not None and b.device != device and not b.is_meta:
                m._buffers[name] = b.to(device)


def _update_device_properties(root: Module, device: torch.device) -> None:
    """Record in Lightning's modules (``LightningModule.device``) where they now compute: with
    no ``root.to(device)`` nothing else does (Lightning's ``_update_properties``, which ``.to()``
    calls, without moving anything)."""
    for m in root.modules():
        if isinstance(m, _DeviceDtypeModuleMixin):
            m._device = device


def remap_optimizer_params(optimizer: Optimizer, old_names: dict[int, str],
                           module: Module) -> bool:
    """Point an optimizer created before sharding at the new (sharded) parameter objects.

    ``old_names`` maps ``id()`` of the parameters before sharding to their names. Parameters that
    are already ``module``'s own are kept. Returns whether anything was re-pointed.

    Raises:
        ValueError: the optimizer has state (it would stay with the old objects), or holds a
            parameter that is neither ``module``'s nor one of the old ones.
    """
    new = dict(module.named_parameters(remove_duplicate=False))
    current = {id(p) for p in new.values()}
    stale = [p for group in optimizer.param_groups for p in group["params"]
             if id(p) not in current]
    if not stale:
        return False
    if optimizer.state:
        raise ValueError(
            "The optimizer already has state, so it cannot be moved onto sharded parameters. "
            "Create the optimizer before its first step, or call setup_module() first and create "
            "the optimizer from the returned module's parameters."
        )
    for group in optimizer.param_groups:
        params = []
        for p in group["params"]:
            if id(p) in current:
                params.append(p)
                continue
            name = old_names.get(id(p))
            if name is None or name not in new:
                raise ValueError(
                    f"The optimizer {type(optimizer).__name__} holds a parameter of shape "
                    f"{tuple(p.shape)} that is not part of the module being sharded; create the "
                    "optimizer from this module's parameters (self.parameters() in "
                    "configure_optimizers)."
                )
            params.append(new[name])
        group["params"] = params
    return True


def check_optimizer_params(optimizer: Optimizer, hint: str) -> None:
    """Reject an optimizer built over parameters that sharding replaced (as Lightning's
    ``FSDPStrategy`` does): it would step on tensors the model no longer uses.

    Raises:
        ValueError: naming the parameter; ``hint`` says where to create the optimizer instead.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    found = find_replaced(params)
    if found is not None:
        label, _ = found
        raise ValueError(
            "The optimizer does not seem to reference the sharded parameters: it holds "
            f"{label!r}, which sharding replaced, so training would change nothing. HINT: {hint}")
