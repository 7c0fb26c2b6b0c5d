"""One training step of a sharding engine as rank r of N, measured (design note [dryrun]).

Design note [dryrun]
--------------------
:func:`dry_run` makes this process rank ``r`` of ``N`` under torch's ``"fake"`` process group
(``FakeStore``: collectives return at once, nothing is sent) and builds the model under
``FakeTensorMode`` (tensors with shapes, dtypes and storages sizes, no data), so a 70B model
costs nothing to hold. Then it runs the *real* code of the engine on it: ``fully_shard`` on each
block and the root (the planner, the ``DBuffer``s, the hooks), one forward, a backward and an
optimizer step (:func:`run_step`), under a :class:`~lightning_vescale.dryrun._tracker.StepTracker`
that counts live storage bytes (the peak and the phase it happens in) and every collective with
its bytes. The category figures (sharded and unsharded parameters, gradients, optimizer states,
communication buffers) are the MemoryProfiler's own accounting
(``collect_training_tensors`` + ``engine_tensors`` + ``account``), sampled at every block
boundary (the maximum of each) and after the step. The same step runs with torch's FSDP2
(``torch.distributed.fsdp.fully_shard``) on a fresh copy of the model under the same group,
placed as torchtitan places it: stacked experts ``(E, ...)`` are split along dim 1 when there
are more shards than experts (FSDP2's default ``Shard(0)`` would pad them to N rows, a cost no
MoE trainer accepts, so comparing with it would overstate our lead).

:func:`run_step` is also what a real run calls (real tensors, a real group): the test that
checks the dry run against gloo runs it in a forked world and compares the figures.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_vescale.callbacks._memory_accounting import (
    CATEGORIES,
    account,
    collect_training_tensors,
)
from lightning_vescale.dryrun._tracker import StepTracker

__all__ = ["EngineReport", "OPTIMIZERS", "make_optimizer", "run_step"]

#: name -> what builds it (the strategies' optimizers plus torch's AdamW)
OPTIMIZERS = ("adamw", "adamw8bit", "muon", "soap", "shampoo")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineReport:
    """What one engine's step held and sent on this rank (bytes)."""

    engine: str
    #: steady state after the optimizer step, by MemoryProfiler category
    after_step: dict[str, int]
    #: the largest value of each category seen at a block boundary during the step
    max_at_boundaries: dict[str, int]
    #: the high-water mark of all live storage (model, activations, temporaries, buffers)
    peak_bytes: int
    peak_where: str
    #: live bytes near the peak (within 0.2%) by the op (and phase) that created them
    peak_top: list[tuple[str, int]]
    #: bytes this rank holds beyond its even share of the parameters (layout padding)
    padding_bytes: int
    #: family -> [count, input bytes, output bytes]
    collectives: dict[str, list[int]]
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def make_optimizer(name: str, params: list[nn.Parameter], lr: float = 1e-3) -> Any:
    """``"adamw"`` (torch), ``"adamw8bit"``, ``"muon"``, ``"soap"`` or ``"shampoo"``
    (``lightning_vescale.optim``, default hyper-parameters)."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, foreach=False)
    if name == "adamw8bit":
        from lightning_vescale.optim import AdamW8bit
        return AdamW8bit(params, lr=lr)
    if name == "muon":
        from lightning_vescale.optim import Muon
        return Muon(params, lr=lr)
    if name == "soap":
        from lightning_vescale.optim import SOAP
        return SOAP(params, lr=lr)
    if name == "shampoo":
        from lightning_vescale.optim import Shampoo
        return Shampoo(params, lr=lr)
    raise ValueError(f"optimizer={name!r} is not supported; choose one of {OPTIMIZERS}")


def _shard(engine: str, model: nn.Module, blocks: list[nn.Module], mesh: Any,
           options: dict[str, Any]) -> None:
    if engine == "vescale":
        from lightning_vescale.fsdp import fully_shard
        for b in blocks:
            fully_shard(b, mesh=mesh, **options)
        fully_shard(model, mesh=mesh, **options)
    elif engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard as fsdp2
        opts = {k: v for k, v in options.items()
                if k in ("reshard_after_forward", "mp_policy")}
        opts["shard_placement_fn"] = functools.partial(_fsdp2_placement,
                                                       shards=mesh.size(mesh.ndim - 1))
        for b in blocks:
            fsdp2(b, mesh=mesh, **opts)
        fsdp2(model, mesh=mesh, **opts)
    else:
        raise ValueError(f"engine={engine!r}: choose 'vescale' or 'fsdp2'")


def _fsdp2_placement(param: nn.Parameter, *, shards: int) -> Any:
    """FSDP2's placement as torchtitan sets it for MoE models: stacked experts ``(E, ...)``
    split along dim 1 when there are more shards than experts (``Shard(0)`` would leave
    ranks with padded, empty chunks: torchtitan/distributed/fsdp.py), else FSDP2's default.
    FSDP2 shards a dim other than 0 only evenly: when dim 1 does not divide, the next dim
    that does, else ``Shard(0)`` (GPT-OSS's 2,880 and 5,760 at 1,024 ranks: none does)."""
    from torch.distributed.tensor import Shard

    if param.dim() >= 3 and param.shape[0] < shards:
        for d in range(1, param.dim()):
            if param.shape[d] % shards == 0:
                return Shard(d)
    return None


def _allocate(model: nn.Module, device: str) -> None:
    """Replace meta parameters and buffers by uninitialised ones on ``device`` (tied ones stay
    tied). ``to_empty`` cannot: it swaps tensors, and a meta tensor cannot be swapped with a
    FakeTensor."""
    new: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if p.device.type == "meta":
                if id(p) not in new:
                    new[id(p)] = nn.Parameter(torch.empty_like(p, device=device),
                                              requires_grad=p.requires_grad)
                setattr(mod, name, new[id(p)])
        for name, b in list(mod.named_buffers(recurse=False)):
            if b is not None and b.device.type == "meta":
                mod._buffers[name] = torch.zeros_like(b, device=device)


def _padding(model: nn.Module, engine: str, world: int) -> int:
    """Bytes this rank holds beyond ``param_bytes / world`` (rounded up per parameter for
    FSDP2, whose chunks along the sharded dim are padded to equal size; DBuffer padding for
    ours)."""
    if engine == "vescale":
        from lightning_vescale.fsdp.api import dbuffers
        pad = 0
        for b in dbuffers(model):
            payload = sum(s.numel for s in b.plan.entries)
            pad += (b.buffer_size - payload) * b.shard.element_size()
        return pad // max(world, 1)
    pad = 0
    for p in model.parameters():
        local = getattr(p, "_local_tensor", p)
        dim = getattr(getattr(p, "placements", [None])[-1], "dim", 0)  # Shard(d); else 0
        if p.shape and p.dim():
            rows = -(-p.shape[dim] // world)
            padded = rows * world * (p.numel() // max(p.shape[dim], 1))
            pad += (padded - p.numel()) * local.element_size()
    return pad // max(world, 1)


def _breakdown(model: nn.Module, optimizer: Any, engine: str) -> dict[str, int]:
    found = collect_training_tensors([model], [optimizer] if optimizer is not None else [])
    extra = 0
    if engine == "vescale":
        from lightning_vescale.callbacks.memory import engine_tensors
        eng, extra = engine_tensors(model)
        for cat, tensors in eng.items():
            found.setdefault(cat, []).extend(tensors)
    device = next(iter(model.parameters())).device
    return account(device=device, extra_comm_bytes=extra, **found).as_dict()


def run_step(*, engine: str, build: Callable[[], nn.Module], mesh: Any,
             inputs: Callable[[], tuple[torch.Tensor, torch.Tensor]], optimizer: str = "adamw",
             options: dict[str, Any] | None = None,
             blocks: Callable[[nn.Module], list[nn.Module]] | None = None,
             activation_checkpointing: bool = False) -> EngineReport:
    """Shard ``build()`` with ``engine`` on ``mesh``, run one step and measure it.

    ``inputs()`` returns ``(input_ids, labels)``; the loss is the cross-entropy of the model's
    logits (or of its output's ``logits``). ``activation_checkpointing``: each block recomputes
    its forward in backward, as the strategies' ``activation_checkpointing_policy`` does.
    Works on real and on fake tensors alike; the caller
    owns the process group and any ``FakeTensorMode``.
    """
    t0 = time.perf_counter()
    tracker = StepTracker()
    tracker.__enter__()
    try:
        return _step(tracker, t0, engine=engine, build=build, mesh=mesh, inputs=inputs,
                     optimizer=optimizer, options=options, blocks=blocks,
                     checkpointing=activation_checkpointing)
    finally:
        tracker.__exit__(None, None, None)


def _step(tracker: StepTracker, t0: float, *, engine: str, build: Callable[[], nn.Module],
          mesh: Any, inputs: Callable[[], tuple[torch.Tensor, torch.Tensor]], optimizer: str,
          options: dict[str, Any] | None,
          blocks: Callable[[nn.Module], list[nn.Module]] | None,
          checkpointing: bool) -> EngineReport:
    from lightning_vescale.dryrun._models import blocks_of

    tracker.phase("build and shard")
    model = build()
    block_list = (blocks or blocks_of)(model)
    if checkpointing:  # checkpoint, then shard (the strategies' order)
        from lightning_vescale._lightning.activation_checkpointing import _checkpointed_forward
        for b in block_list:
            b.forward = functools.partial(_checkpointed_forward, b.forward)
    if any(t.device.type == "meta" for t in [*model.parameters(), *model.buffers()]):
        # built on the meta device (the planner's --model loader, a configure_model): allocate
        # it whole first; under the dry run's FakeTensorMode that costs nothing
        _allocate(model, mesh.device_type)
    _shard(engine, model, block_list, mesh, dict(options or {}))
    opt = make_optimizer(optimizer, list(model.parameters()))
    world = mesh.size()
    gc.collect()
    tracker.reset_peak()
    maxima = {c: 0 for c in CATEGORIES}

    def sample() -> None:
        for k, v in _breakdown(model, opt, engine).items():
            maxima[k] = max(maxima[k], v)

    names = {id(m): f"block {i}" for i, m in enumerate(block_list)}
    names[id(model)] = "root"
    handles = []
    for m in [*block_list, model]:
        label = names[id(m)]

        def pre(mod: nn.Module, args: Any, label: str = label) -> None:
            sample()
            tracker.phase(f"forward {label}")

        def post(mod: nn.Module, args: Any, out: Any, label: str = label) -> None:
            t = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
            if t is None and isinstance(out, (tuple, list)) and out:
                t = out[0]
            if isinstance(t, torch.Tensor) and t.requires_grad:
                def on_grad(g: torch.Tensor) -> None:
                    sample()
                    tracker.phase(f"backward {label}")
                t.register_hook(on_grad)

        handles += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]

    ids, labels = inputs()
    tracker.phase("forward")
    out = model(ids)
    logits = out if isinstance(out, torch.Tensor) else out.logits
    loss = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten())
    del out, logits
    tracker.phase("backward loss")
    loss.backward()
    sample()
    tracker.phase("optimizer step")
    opt.step()
    sample()
    tracker.phase("after step")
    after = _breakdown(model, opt, engine)
    del loss
    gc.collect()
    for h in handles:
        h.remove()
    fams: dict[str, list[int]] = {}
    for c in tracker.collectives:
        row = fams.setdefault(c.family, [0, 0, 0])
        row[0] += 1
        row[1] += c.input_bytes
        row[2] += c.output_bytes
    return EngineReport(
        engine=engine, after_step=after, max_at_boundaries=maxima, peak_bytes=tracker.peak,
        peak_where=tracker.peak_where, peak_top=list(tracker.peak_top),
        padding_bytes=_padding(model, engine, world),
        collectives=fams, seconds=time.perf_counter() - t0)
