"""The strategy names in Lightning's registries, without importing Lightning (design note
[lazy-registration]).

Design note [lazy-registration]
-------------------------------
Lightning resolves ``Trainer(strategy="vescale_fsdp")`` and ``Fabric(strategy="vescale_fsdp")``
through two registries, ``lightning.pytorch.strategies.StrategyRegistry`` and
``lightning.fabric.strategies.STRATEGY_REGISTRY``; it has no entry point for third-party
strategies, so the names must be registered before the Trainer/Fabric is built. Importing
Lightning costs seconds, and ``lightning_vescale.planner``, ``placement``, ``fsdp``, ``optim`` and
``checkpoint`` do not need it; every one of their imports runs the package's ``__init__`` first.
So ``import lightning_vescale`` calls :func:`register_lazily`, which imports nothing:

* a registry whose module is already imported gets the names at once;
* otherwise a one-shot finder on ``sys.meta_path`` waits for that module's import and registers
  the names as soon as the module has run (so ``import lightning_vescale`` before
  ``import lightning`` works as well as after).

A registered name maps to a small factory that imports the strategy class on first use and builds
it with the name's keywords (``start_method`` for the Trainer names): the registries are filled
without importing ``lightning_vescale.strategy`` (which imports Lightning itself, so importing it
from inside Lightning's import would be circular). Registration is idempotent: a name already in
a registry (ours, or the class's own ``register_strategies``) is left as it is.

Imports nothing from Lightning, and nothing of this package but this module.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple, Optional

__all__ = ["LazyEntry", "FABRIC_ENTRIES", "TRAINER_ENTRIES", "register_lazily"]


class LazyEntry(NamedTuple):
    """A strategy name, its description and constructor keywords, and where its class lives."""

    name: str
    description: str
    init_kwargs: dict[str, Any]
    module: str  #: the module defining the class (imported on first use of the name)
    cls: str


#: ``Trainer(strategy=...)`` names; the same as ``VeScaleFSDPStrategy._registry_entries``.
TRAINER_ENTRIES: tuple[LazyEntry, ...] = tuple(
    LazyEntry(name=name, description=f"veScale-FSDP (RaggedShard fully sharded data parallel), "
              f"start_method={start_method!r}", init_kwargs={"start_method": start_method},
              module="lightning_vescale.strategy", cls="VeScaleFSDPStrategy")
    for name, start_method in (("vescale_fsdp", "popen"), ("vescale_fsdp_spawn", "spawn"),
                               ("vescale_fsdp_fork", "fork")))

#: ``Fabric(strategy=...)`` names; the same as ``VeScaleFabricStrategy._registry_entries``.
FABRIC_ENTRIES: tuple[LazyEntry, ...] = (LazyEntry(
    name="vescale_fsdp", description="veScale-FSDP: RaggedShard fully sharded data parallel",
    init_kwargs={}, module="lightning_vescale.fabric", cls="VeScaleFabricStrategy"),)

#: registry module -> (the registry's attribute in it, the entries it gets)
_REGISTRIES: dict[str, tuple[str, tuple[LazyEntry, ...]]] = {
    "lightning.pytorch.strategies": ("StrategyRegistry", TRAINER_ENTRIES),
    "lightning.fabric.strategies": ("STRATEGY_REGISTRY", FABRIC_ENTRIES),
}


def _factory(entry: LazyEntry) -> Callable[..., Any]:
    """``entry``'s class, imported when the name is first used, called with the keywords."""
    def make(**init_kwargs: Any) -> Any:
        return getattr(importlib.import_module(entry.module), entry.cls)(**init_kwargs)

    make.__name__ = make.__qualname__ = f"lazy_{entry.cls}"
    make.__doc__ = f"Builds ``{entry.module}.{entry.cls}`` (imported on first use)."
    return make


def _register(module: ModuleType) -> None:
    """Add our names to the registry that ``module`` (one of :data:`_REGISTRIES`) defines."""
    import torch.distributed  # already imported by the package

    if not torch.distributed.is_available():  # as the classes' register_strategies
        return
    attr, entries = _REGISTRIES[module.__name__]
    registry = getattr(module, attr)
    for entry in entries:
        if entry.name not in registry:
            registry.register(entry.name, _factory(entry), description=entry.description,
                              **entry.init_kwargs)


class _RunThenRegister(importlib.abc.Loader):
    """Runs a registry module with its own loader, then registers our names in it."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = module.__spec__.loader = self._loader  # the module's own loader
        self._loader.exec_module(module)
        _register(module)


class _RegistryFinder(importlib.abc.MetaPathFinder):
    """One-shot ``sys.meta_path`` finder: wraps the loader of the registry modules not imported
    yet, and leaves ``sys.meta_path`` once it has seen all of them."""

    def __init__(self, pending: set[str]) -> None:
        self._pending = pending
        self._lock = threading.Lock()

    def find_spec(self, fullname: str, path: Any, target: Any = None
                  ) -> Optional[importlib.machinery.ModuleSpec]:
        with self._lock:
            if fullname not in self._pending:
                return None
            self._pending.discard(fullname)
            if not self._pending and self in sys.meta_path:
                sys.meta_path.remove(self)
        spec = _find_with_others(fullname, path, target, skip=self)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec  # nothing to wrap: the registry gets no names (as if not installed)
        spec.loader = _RunThenRegister(spec.loader)
        return spec


def _find_with_others(fullname: str, path: Any, target: Any, *, skip: Any
                      ) -> Optional[importlib.machinery.ModuleSpec]:
    for finder in list(sys.meta_path):
        find_spec = getattr(finder, "find_spec", None)
        if finder is skip or find_spec is None:
            continue
        spec = find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return None


def register_lazily() -> None:
    """Register the strategy names in Lightning's registries now if their modules are imported,
    else as soon as they are (design note [lazy-registration]). Imports nothing; idempotent."""
    pending = set()
    for name in _REGISTRIES:
        module = sys.modules.get(name)
        if module is None:
            pending.add(name)
        elif hasattr(module, _REGISTRIES[name][0]):
            _register(module)
    if pending and not any(isinstance(f, _RegistryFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegistryFinder(pending))
