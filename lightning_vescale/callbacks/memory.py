"""``MemoryProfiler``: where every byte of a (sharded) training run goes, per rank and per phase.

Why it exists
-------------
"Why did rank 3 run out of memory, and what did sharding save me?" needs three things the
Trainer does not give: peaks *per phase* (forward, backward, optimizer step, checkpoint save),
per *rank*, and a breakdown of the bytes into parameters (sharded / unsharded), gradients,
optimizer states and communication buffers, with the rest shown as activations/other rather than
hidden. This callback works with any strategy (``vescale_fsdp``, Lightning's DDP/FSDP/
ModelParallel, a single device), so strategies can be compared with the same yardstick.

How it measures
---------------
* Device figures come from :class:`~lightning_vescale.callbacks._memory_device.DeviceMemory`: the
  caching allocator on an accelerator (``memory_allocated`` / ``max_memory_allocated``, peaks reset
  with ``reset_peak_memory_stats`` at each phase boundary), the process RSS and its high-water mark
  on CPU (``VmRSS`` / ``VmHWM``, reset through ``/proc/self/clear_refs``).
* The breakdown comes from :func:`~lightning_vescale.callbacks._memory_accounting.account`: live
  tensors reachable from the module, the optimizers and the live ``DBuffer``s (by role, see
  :func:`engine_tensors`), each storage byte counted once. ``activations/other`` = current
  device figure − named bytes. On CPU the device figure is the process RSS, so that rest is mostly
  the ~220 MB torch runtime and the pages the C allocator keeps after frees: the table and plot
  label it ``RSS - tensors (runtime)`` there and say so (the logged key stays
  ``activations_other``).
* Phases are delimited by the Trainer hooks: ``on_train_batch_start`` → forward →
  ``on_before_backward`` → backward → ``on_after_backward`` → other → ``on_before_optimizer_step``
  → optimizer step → ``on_train_batch_end``; ``checkpoint_save`` covers ``trainer.save_checkpoint``
  (state-dict gathering and the write). Everything else (data loading, validation, the training
  batches that are not profiled) is the ``other`` phase, so the run's overall peak is never lost.

Cost
----
Only every ``every_n_steps``-th training batch (default: the Trainer's ``log_every_n_steps``) is
profiled: five peak reads/resets (microseconds each), five tensor walks (about a millisecond for
a few hundred parameters) and, when the Trainer has loggers, one ``all_gather`` of ~20 floats.
All other hooks return after one integer comparison. The measured overhead is in
``benchmarks/RESULTS_memory.md``. Allocator history recording (snapshots) is off by default: it
costs real time on every allocation and is only for debugging.

Outputs
-------
* Logged metrics (rank zero, through every Trainer logger; MiB; ``max`` and ``mean`` over ranks),
  once per profiled batch: ``memory_mib/{name}_{max|mean}`` for ``peak`` and ``peak_{phase}``
  (the phases that ended since the previous log; ``peak_other`` includes the unprofiled batches),
  and for ``current``, each breakdown category, ``activations_other`` and ``off_device`` (bytes
  of the run's tensors on another device, e.g. CPU offload; not part of ``current``) and
  ``off_device_pinned_host`` (the host memory the pinned ones among them really hold: the caching
  host allocator rounds each pinned storage up to a power of two, up to 2x), each the largest
  value at the batch's phase boundaries.
* A summary table at the end of ``fit`` on rank zero (``rank_zero_info``, also with
  ``logger=False``), kept in :attr:`MemoryProfiler.table`. Where the module's ``fully_shard``
  groups have a :class:`~lightning_vescale.CommPolicy`, the table names it under the
  communication buffers (its quantized all-gather codes and scales are counted there).
* With ``plot_dir``: ``memory_timeline_rank{r}.png`` per rank (needs ``matplotlib``:
  ``pip install 'lightning-vescale[plot]'``).
* On CUDA with ``snapshot_dir``: allocator snapshots (``oom_rank{r}.pickle`` on out-of-memory,
  ``batch{n}_rank{r}.pickle`` at ``snapshot_at_step``) for https://pytorch.org/memory_viz.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_vescale.callbacks._memory_accounting import (
    CATEGORIES,
    MemoryBreakdown,
    MemorySample,
    account,
    collect_training_tensors,
)
from lightning_vescale.callbacks._memory_device import DeviceMemory
from lightning_vescale.callbacks._memory_plot import PLOT_HINT, plot_timeline
from lightning_vescale.callbacks._memory_snapshots import SnapshotRecorder
from lightning_vescale.dbuffer import DBuffer, live_dbuffers
from lightning_vescale.fsdp import dbuffers, iter_param_groups
from lightning_vescale.sharding_summary import tensor_parallel_text

__all__ = ["MemoryProfiler", "MemorySample", "PHASES", "comm_policy_text", "engine_tensors",
           "format_table"]

#: Phases in table order. ``other`` is everything outside the first four on profiled batches,
#: plus every batch that is not profiled (so the overall peak is always covered).
PHASES: tuple[str, ...] = ("forward", "backward", "optimizer_step", "checkpoint_save", "other")

_MIB = float(1 << 20)
#: breakdown figures, logged and tabulated as their largest value over the phase boundaries.
_FIGURES: tuple[str, ...] = CATEGORIES + ("activations_other", "off_device",
                                         "off_device_pinned_host")


def engine_tensors(module: torch.nn.Module | None = None
                   ) -> tuple[dict[str, list[torch.Tensor]], int]:
    """Storage of the ``DBuffer``s of ``module``'s ``fully_shard`` groups, by role (with
    ``module=None``: every live ``DBuffer`` of the process, :func:`live_dbuffers`).

    Only the trained module's buffers belong to its run: another sharded model still alive in the
    process (a first Trainer's, in a script that compares strategies) is not this run's memory.

    Returns ``({category: tensors}, extra_comm_bytes)``. A ``DBuffer``'s owned ``shard`` is sharded
    parameter memory, its ``full`` buffer (the all-gather output that unsharded parameters view)
    unsharded parameter memory, ``grad_full``/``grad_shard`` gradient memory (padding included:
    it is what the layout costs), and the temporaries of in-flight collectives
    (``memory_bytes()["comm"]``) communication buffers. Freed storages count as zero. Empty when
    the engine is not in use.
    """
    found: dict[str, list[torch.Tensor]] = {
        "params_sharded": [], "params_unsharded": [], "grads": [], "comm_buffers": []}
    extra = 0
    roles = (("shard", "params_sharded"), ("full", "params_unsharded"),
             ("grad_full", "grads"), ("grad_shard", "grads"))
    buffers: list[DBuffer] = live_dbuffers() if module is None else dbuffers(module)
    for buf in buffers:
        for attr, cat in roles:
            t = getattr(buf, attr)
            if isinstance(t, torch.Tensor):
                found[cat].append(t)
        try:
            extra += int(buf.memory_bytes().get("comm", 0))
        except Exception:  # noqa: BLE001 - accounting must never break training
            pass
    return found, extra


def comm_policy_text(module: torch.nn.Module | None) -> str | None:
    """The ``CommPolicy`` of ``module``'s ``fully_shard`` groups in words
    (``CommPolicy.describe()``: format, block, reduce-scatter dtype; distinct policies joined by
    ``"; "``), or ``None`` where no group has one that changes a collective."""
    found: list[str] = []
    for _, group in iter_param_groups(module) if module is not None else ():
        policy = group.comm_policy
        if policy is not None and policy.is_active and policy.describe() not in found:
            found.append(policy.describe())
    return "; ".join(found) or None


def _mib(x: int | float | None) -> float:
    return float("nan") if x is None else float(x) / _MIB


class MemoryProfiler(Callback):
    """Per-rank device memory with a per-phase peak and a breakdown (see the module docstring).

    Args:
        every_n_steps: profile one training batch in this many (the first batch, then every
            n-th). ``None`` uses the Trainer's ``log_every_n_steps``. ``1`` profiles every batch.
        plot_dir: directory for ``memory_timeline_rank{r}.png`` (one per rank, written at the end
            of ``fit``). ``None``: no plot. Needs ``matplotlib`` (the ``plot`` extra); without
            it the constructor raises ``ModuleNotFoundError`` naming the install command.
        print_table: log the summary table on rank zero at the end of ``fit``.
        track_checkpoint: time ``trainer.save_checkpoint`` as the ``checkpoint_save`` phase (the
            callback wraps that method for the duration of ``fit``).
        breakdown: compute the tensor breakdown at each boundary of profiled batches. ``False``
            keeps only device figures (cheapest).
        max_samples: cap on the stored timeline (samples per rank); later samples still update
            the metrics and the table but are not plotted.
        snapshot_dir: CUDA only: directory for allocator snapshots. ``None``: none.
        snapshot_on_oom: CUDA only: record allocator history and dump ``oom_rank{r}.pickle`` when
            a CUDA out-of-memory error happens. Recording costs time on every allocation.
        snapshot_at_step: CUDA only: dump ``batch{n}_rank{r}.pickle`` at the end of training
            batch ``n`` (0-based count of training batches in this ``fit``).
        snapshot_max_entries: allocator history length kept for snapshots.
    """

    def __init__(
        self,
        every_n_steps: int | None = None,
        plot_dir: str | None = None,
        print_table: bool = True,
        track_checkpoint: bool = True,
        breakdown: bool = True,
        max_samples: int = 10_000,
        snapshot_dir: str | None = None,
        snapshot_on_oom: bool = False,
        snapshot_at_step: int | None = None,
        snapshot_max_entries: int = 100_000,
    ) -> None:
        super().__init__()
        if every_n_steps is not None and (not isinstance(every_n_steps, int) or every_n_steps < 1):
            raise ValueError(
                f"MemoryProfiler(every_n_steps={every_n_steps!r}): expected a positive int or None "
                "(None follows the Trainer's log_every_n_steps)."
            )
        if not isinstance(max_samples, int) or max_samples < 0:
            raise ValueError(f"MemoryProfiler(max_samples={max_samples!r}): expected an int >= 0.")
        if snapshot_at_step is not None and (not isinstance(snapshot_at_step, int)
                                             or snapshot_at_step < 0):
            raise ValueError(
                f"MemoryProfiler(snapshot_at_step={snapshot_at_step!r}): expected an int >= 0 "
                "or None."
            )
        if (snapshot_on_oom or snapshot_at_step is not None) and snapshot_dir is None:
            raise ValueError(
                "MemoryProfiler: snapshot_on_oom/snapshot_at_step need snapshot_dir=<directory>."
            )
        if not isinstance(snapshot_max_entries, int) or snapshot_max_entries < 1:
            raise ValueError(
                f"MemoryProfiler(snapshot_max_entries={snapshot_max_entries!r}): expected an "
                "int >= 1."
            )
        if plot_dir is not None:  # at construction: before any process starts or step runs
            try:
                import matplotlib  # noqa: F401
            except ImportError as err:
                raise ModuleNotFoundError(PLOT_HINT) from err
        self.every_n_steps = every_n_steps
        self.plot_dir = plot_dir
        self.print_table = print_table
        self.track_checkpoint = track_checkpoint
        self.breakdown = breakdown
        self.max_samples = max_samples
        self.snapshot_dir = snapshot_dir
        self.snapshot_on_oom = snapshot_on_oom
        self.snapshot_at_step = snapshot_at_step
        self.snapshot_max_entries = snapshot_max_entries
        #: the summary table of the last ``fit`` (rank zero; ``None`` before the end of ``fit``).
        self.table: str | None = None
        #: this rank's timeline of the last ``fit`` (see :class:`MemorySample`).
        self.samples: list[MemorySample] = []
        #: this rank's highest peak per phase over the last ``fit`` (bytes).
        self.phase_peaks: dict[str, int] = {}
        #: paths written by this rank (plot, snapshots).
        self.written: list[str] = []
        #: legend labels of the phase panel of this rank's last plot (which phases it marks).
        self.plot_labels: list[str] = []
        self._reset_state()

    # ---------------------------------------------------------------------------------------
    # state
    # ---------------------------------------------------------------------------------------
    def _reset_state(self) -> None:
        self._mem: DeviceMemory | None = None
        self._n = 1
        self._batches = 0
        self._batch = -1
        self._active = False
        self._phase: str | None = None
        self._seq = 0
        self._t0 = time.perf_counter()
        self._pending: dict[str, int] = {}
        # largest value of each figure over the boundaries since the last log / over the run
        self._step_max: dict[str, int] = {}
        self._run_max: dict[str, int] = {}
        self._trainer: Trainer | None = None
        self._module: LightningModule | None = None
        self._wrapped_save = False
        self._snapshots: SnapshotRecorder | None = None
        self._warned_cap = False

    @property
    def _rank(self) -> int:
        return self._trainer.global_rank if self._trainer is not None else 0

    # ---------------------------------------------------------------------------------------
    # measuring
    # ---------------------------------------------------------------------------------------
    def _measure_breakdown(self) -> MemoryBreakdown | None:
        if not self.breakdown or self._mem is None:
            return None
        trainer, module = self._trainer, self._module
        modules = [module] if module is not None else []
        optimizers = list(trainer.optimizers) if trainer is not None else []
        found = collect_training_tensors(modules, optimizers)
        engine, extra = engine_tensors(module)
        for cat, tensors in engine.items():
            found.setdefault(cat, []).extend(tensors)
        return account(device=self._mem.device, extra_comm_bytes=extra, **found)

    def _enter(self, phase: str) -> None:
        """Close the current phase (record a sample) and start ``phase`` with a fresh peak."""
        mem = self._mem
        if mem is None:
            return
        ended = self._phase
        if ended is not None:
            current, peak = mem.current_and_peak()
            if not mem.can_reset_peak:
                peak = None  # a high-water mark since process start is no phase peak
            sample = MemorySample(
                seq=self._seq,
                batch=self._batch,
                time_s=time.perf_counter() - self._t0,
                phase=ended,
                phase_peak=peak,
                current=current,
                breakdown=self._measure_breakdown(),
            )
            self._seq += 1
            if peak is not None:
                self._pending[ended] = max(self._pending.get(ended, 0), peak)
                self.phase_peaks[ended] = max(self.phase_peaks.get(ended, 0), peak)
            if len(self.samples) < self.max_samples:
                self.samples.append(sample)
            elif not self._warned_cap:
                self._warned_cap = True
                rank_zero_warn(
                    f"MemoryProfiler: timeline capped at max_samples={self.max_samples}; later "
                    "samples update metrics and the table but are not plotted."
                )
            figures: dict[str, int | None] = {"current": sample.current,
                                              "activations_other": sample.activations_other}
            if sample.breakdown is not None:
                figures.update(sample.breakdown.as_dict())
                figures["off_device"] = sample.breakdown.off_device
                figures["off_device_pinned_host"] = sample.breakdown.off_device_pinned_host
            for key, val in figures.items():
                if val is not None:
                    for acc in (self._step_max, self._run_max):
                        acc[key] = max(acc.get(key, val), val)
        self._phase = phase
        mem.reset_peak()

    # ---------------------------------------------------------------------------------------
    # Lightning hooks
    # ---------------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._reset_state()
        self.samples = []
        self.phase_peaks = {}
        self.written = []
        self.plot_labels = []
        self.table = None
        self._trainer = trainer
        self._module = pl_module
        self._n = self.every_n_steps or max(1, int(trainer.log_every_n_steps or 1))
        self._mem = DeviceMemory(trainer.strategy.root_device)
        if self.track_checkpoint and "save_checkpoint" not in vars(trainer):
            original = trainer.save_checkpoint

            def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
                resume = self._phase or "other"
                self._enter("checkpoint_save")
                try:
                    return original(*args, **kwargs)
                finally:
                    self._enter(resume)

            trainer.save_checkpoint = save_checkpoint  # type: ignore[method-assign]
            self._wrapped_save = True
        self._start_snapshots()

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._module = pl_module  # the strategy may have wrapped/replaced modules since setup
        self._t0 = time.perf_counter()
        self._enter("other")

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self._batch = self._batches
        self._active = self._batches % self._n == 0
        self._batches += 1
        if self._active:
            self._enter("forward")

    def on_before_backward(self, trainer: Trainer, pl_module: LightningModule,
                           loss: torch.Tensor) -> None:
        if self._active:
            self._enter("backward")

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._active:
            self._enter("other")

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule,
                                 optimizer: Any) -> None:
        if self._active:
            self._enter("optimizer_step")

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if self._active:
            self._enter("other")
            self._log(trainer)
            self._active = False
        if self.snapshot_at_step is not None and self._batch == self.snapshot_at_step:
            self._dump_snapshot(f"batch{self._batch}_rank{self._rank}.pickle")
            if not self.snapshot_on_oom:
                self._stop_snapshots()

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._enter("other")  # close the trailing phase so its peak is counted
        rows = self._gather(self._summary_vector(), trainer)
        table = format_table(rows, source=self._mem.source if self._mem else "n/a",
                             on_cpu=self._mem is not None and not self._mem.is_accelerator,
                             comm_policy=comm_policy_text(self._module),
                             tensor_parallel=tensor_parallel_text(self._module))
        if trainer.is_global_zero:
            self.table = table
            if self.print_table:
                rank_zero_info(table)
        if self.plot_dir is not None:
            os.makedirs(self.plot_dir, exist_ok=True)
            path = os.path.join(self.plot_dir, f"memory_timeline_rank{self._rank}.png")
            self.plot_labels = plot_timeline(self.samples, path, rank=self._rank,
                                             source=self._mem.source if self._mem else "")
            self.written.append(path)

    def on_exception(self, trainer: Trainer, pl_module: LightningModule,
                     exception: BaseException) -> None:
        if self._snapshots is not None and self.snapshot_on_oom and _is_oom(exception):
            self._snapshots.on_oom()
        self._restore(trainer)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._restore(trainer)

    def _restore(self, trainer: Trainer) -> None:
        if self._wrapped_save:
            vars(trainer).pop("save_checkpoint", None)
            self._wrapped_save = False
        self._stop_snapshots()

    # ---------------------------------------------------------------------------------------
    # logging
    # ---------------------------------------------------------------------------------------
    def _step_vector(self) -> tuple[list[str], list[float]]:
        peaks = [self._pending.get(p) for p in PHASES]
        known = [p for p in peaks if p is not None]
        names = ["current", "peak"] + [f"peak_{p}" for p in PHASES]
        values = [_mib(self._step_max.get("current")), _mib(max(known) if known else None)]
        values += [_mib(p) for p in peaks]
        names += list(_FIGURES)
        values += [_mib(self._step_max.get(c)) for c in _FIGURES]
        return names, values

    def _gather(self, values: Sequence[float], trainer: Trainer) -> torch.Tensor:
        """``(world, k)`` float64 tensor of every rank's ``values`` (collective on every rank)."""
        device = trainer.strategy.root_device
        t = torch.tensor(list(values), dtype=torch.float64, device=device)
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            # torch.distributed directly: Lightning's strategy.all_gather goes through
            # torch.distributed.nn.functional.all_gather, which torch 2.13 deprecates (a warning
            # on every rank and run); the list all_gather is the plain, supported collective.
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, t)
            t = torch.stack(parts)
        if t.dim() == 1:
            t = t.unsqueeze(0)
        return t.cpu()

    def _log(self, trainer: Trainer) -> None:
        loggers = trainer.loggers
        if loggers:  # same on every rank, so the collective is entered by all or none
            names, values = self._step_vector()
            table = self._gather(values, trainer)
            if trainer.is_global_zero:
                metrics: dict[str, float] = {}
                for j, name in enumerate(names):
                    col = table[:, j]
                    ok = col[~torch.isnan(col)]
                    if ok.numel() == 0:
                        continue
                    metrics[f"memory_mib/{name}_max"] = float(ok.max())
                    metrics[f"memory_mib/{name}_mean"] = float(ok.mean())
                step = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped",
                               trainer.global_step)
                for logger in loggers:
                    logger.log_metrics(metrics, step=step)
        self._pending = {}
        self._step_max = {}

    def _summary_vector(self) -> list[float]:
        values = [_mib(self.phase_peaks.get(p)) for p in PHASES]
        values += [_mib(self._run_max.get(c)) for c in _FIGURES]
        values += [_mib(self._run_max.get("current"))]
        return values

    def summary(self) -> str | None:
        """The summary table of the last ``fit`` (rank zero), or ``None``."""
        return self.table

    # ---------------------------------------------------------------------------------------
    # CUDA allocator snapshots
    # ---------------------------------------------------------------------------------------
    def _start_snapshots(self) -> None:
        wanted = self.snapshot_on_oom or self.snapshot_at_step is not None
        if not wanted or self._mem is None:
            return
        if self._mem.device.type != "cuda":
            rank_zero_warn(
                "MemoryProfiler: allocator snapshots (snapshot_on_oom/snapshot_at_step) need a "
                f"CUDA device; training runs on {self._mem.device}, so none will be written."
            )
            return
        self._snapshots = SnapshotRecorder(
            snapshot_dir=str(self.snapshot_dir), max_entries=self.snapshot_max_entries,
            on_oom=self.snapshot_on_oom, name_oom=f"oom_rank{self._rank}.pickle",
            written=self.written.append)
        self._snapshots.start()

    def _dump_snapshot(self, name: str) -> None:
        if self._snapshots is not None:
            self._snapshots.dump(name)

    def _stop_snapshots(self) -> None:
        if self._snapshots is not None:
            self._snapshots.stop()


def _is_oom(exc: BaseException) -> bool:
    oom = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    return (oom is not None and isinstance(exc, oom)) or "out of memory" in str(exc).lower()


_ROW_LABELS = (
    [(f"peak: {p}", True) for p in PHASES]
    + [
        ("params (sharded)", False),
        ("params (unsharded)", False),
        ("gradients", False),
        ("optimizer states", False),
        ("communication buffers", False),
        ("activations/other", False),
        ("off-device tensors", False),
        ("  pinned (host, rounded)", False),
        ("current (total)", False),
    ]
)


def _fmt(mib: float) -> str:
    a = abs(mib)
    return f"{mib:.1f}" if a >= 100 else f"{mib:.2f}" if a >= 1 or a == 0 else f"{mib:.4f}"


#: The ``activations_other`` row's label on CPU: there "current" is the process RSS, so the rest
#: is mostly the torch runtime (~220 MB) and pages the C allocator keeps, not activations.
CPU_OTHER_LABEL = "RSS - tensors (runtime)"
CPU_OTHER_NOTE = ("on CPU, 'RSS - tensors (runtime)' is process memory minus the tensors named "
                  "above: mostly the torch runtime and allocator cache, plus activations")


def _table_cells(col: torch.Tensor) -> str:
    """Max, mean and the max's rank of one figure over the ranks (NaN: unknown on that rank)."""
    ok = ~torch.isnan(col)
    if not bool(ok.any()):
        return f"{'n/a':>12}{'n/a':>12}{'':>10}"
    vals = torch.where(ok, col, torch.full_like(col, -math.inf))
    mx, arg = float(vals.max()), int(vals.argmax())
    return f"{_fmt(mx):>12}{_fmt(float(col[ok].mean())):>12}{arg:>10d}"


def format_table(rows: torch.Tensor, *, source: str, on_cpu: bool = False,
                 comm_policy: str | None = None, tensor_parallel: str | None = None) -> str:
    """Summary table from ``(world, k)`` per-rank summary vectors (MiB).

    The first block is each phase's peak over the run; the second is the breakdown, each line
    being that figure's largest value at any phase boundary of the run (so the lines need not add
    up to ``current (total)``, the largest device figure at a boundary). ``on_cpu``: the figures
    are process RSS, so the rest is labelled for what it mostly is (:data:`CPU_OTHER_LABEL`).
    ``comm_policy``: the run's ``CommPolicy`` in words (:func:`comm_policy_text`), printed under
    the communication buffers; ``None``: no line. ``tensor_parallel``: how the sharded parameters
    are tensor-parallel (:func:`~lightning_vescale.sharding_summary.tensor_parallel_text`),
    printed under the sharded parameters; ``None``: no line.
    """
    world = rows.shape[0]
    head = f"{'':<24}{'max MiB':>12}{'mean MiB':>12}{'max rank':>10}"
    lines = [
        f"MemoryProfiler summary: {world} rank(s), {source}",
        head,
        "-" * len(head),
    ]
    for j, (label, _is_peak) in enumerate(_ROW_LABELS):
        if on_cpu and label == "activations/other":
            label = CPU_OTHER_LABEL
        if j == len(PHASES):
            lines.append("breakdown (largest at any phase boundary):")
        lines.append(f"{label:<24}{_table_cells(rows[:, j])}")
        if label == "params (sharded)" and tensor_parallel:
            lines.append(f"  ({tensor_parallel})")
        if label == "communication buffers" and comm_policy:
            lines.append(f"  (comm policy: {comm_policy})")
    if on_cpu:
        lines.append(f"({CPU_OTHER_NOTE})")
    return "\n".join(lines)
