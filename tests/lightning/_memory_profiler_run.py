"""Trainer run with ``MemoryProfiler`` for tests/lightning/test_memory_profiler.py.

Two ways in: :func:`fit_and_dump` with a fork launcher (``ddp_fork``, ``vescale_fsdp_fork``: the
workers are forks of the caller, ~2 s), or as a script (``python
tests/lightning/_memory_profiler_run.py STRATEGY OUT_DIR``) for the popen launchers (``ddp``,
``vescale_fsdp``), which re-run ``sys.argv`` and so cannot start from inside pytest.

Every rank writes ``OUT_DIR/rank{r}.json`` with the profiler's breakdown at the end of each
profiled batch's optimizer step and the *expected* sizes, computed here independently from the
tensors themselves (``numel * element_size`` of parameters, gradients and Adam's two moments plus
its ``step`` scalar); rank zero also writes the summary table. Metrics go to a CSVLogger under
``OUT_DIR/logs``.
"""

from __future__ import annotations

import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import lightning as L  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from lightning_vescale.callbacks.memory import MemoryProfiler  # noqa: E402


class Blocks(L.LightningModule):
    """Tiny MLP as a ModuleList of blocks (the default sharding units of vescale_fsdp)."""

    def __init__(self, width: int = 48, depth: int = 3) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
            for _ in range(depth)
        )
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)

    def training_step(self, batch, batch_idx):  # noqa: ANN001
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):  # noqa: ANN201
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def _nbytes(t: torch.Tensor) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def _dbuffer_storage_bytes(module: torch.nn.Module) -> dict[str, int]:
    """Allocated bytes of ``module``'s DBuffers' storages by role (empty without the engine).

    ``module``'s, not every live one: a forked rank also inherits whatever sharded model an
    earlier test left alive in the pytest process (not yet collected), which the profiler
    rightly leaves out (``engine_tensors(module)``); counting it failed this test in CI."""
    try:
        from lightning_vescale.fsdp import dbuffers
    except ImportError:
        return {}
    out = {"db_shard": 0, "db_full": 0, "db_grad": 0, "db_count": 0}
    for buf in dbuffers(module):
        out["db_count"] += 1
        out["db_shard"] += buf.shard.untyped_storage().nbytes()
        out["db_full"] += buf.full.untyped_storage().nbytes()
        for t in (buf.grad_full, buf.grad_shard):
            if t is not None:
                out["db_grad"] += t.untyped_storage().nbytes()
    return out


class Expect(L.Callback):
    """Records the expected sizes at the same moment the profiler closes ``optimizer_step``.

    Placed *before* the profiler in the callback list, so its ``on_train_batch_end`` sees the
    same live tensors the profiler accounts right after.
    """

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ANN001
        opts = trainer.optimizers
        params = [p for o in opts for g in o.param_groups for p in g["params"]]
        states = [v for o in opts for s in o.state.values() for v in s.values()
                  if isinstance(v, torch.Tensor)]
        self.rows.append({
            "batch": batch_idx,
            "params": sum(_nbytes(p) for p in params),
            "params_global_numel": sum(p.numel() for p in params),
            "params_local_numel": sum(_local(p).numel() for p in params),
            "grads": sum(_nbytes(p.grad) for p in params if p.grad is not None),
            "optimizer_states": sum(_nbytes(v) for v in states),
            "sharded": any(hasattr(p, "placements") for p in params),
            **_dbuffer_storage_bytes(pl_module),
        })


class Dump(L.Callback):
    """Writes this rank's results at the end of fit (after the profiler's own ``on_fit_end``).

    Runs inside the worker, so it also works with fork launchers, whose workers' callback state
    never reaches the parent process.
    """

    def __init__(self, out: str, expect: Expect, prof: MemoryProfiler) -> None:
        self.out, self.expect, self.prof = out, expect, prof

    def on_fit_end(self, trainer, pl_module):  # noqa: ANN001
        prof = self.prof
        steps = [
            {"batch": s.batch, **s.breakdown.as_dict()}
            for s in prof.samples if s.phase == "optimizer_step" and s.breakdown is not None
        ]
        rank = trainer.global_rank
        with open(os.path.join(self.out, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "world": trainer.world_size, "profiled": steps,
                       "expected": self.expect.rows, "table": prof.table,
                       "plot_labels": prof.plot_labels, "written": prof.written,
                       "metrics_dir": trainer.logger.log_dir if trainer.logger else None}, f)


def fit_and_dump(strategy: str, out: str, comm_policy: dict | None = None) -> None:
    """Train 4 steps with ``strategy`` (``single`` = one CPU process, else 2 processes);
    ``comm_policy``: ``vescale_fsdp_fork`` with that ``CommPolicy``."""
    torch.set_num_threads(1)
    if strategy.startswith("vescale_fsdp"):
        import lightning_vescale  # noqa: F401  (registers the strategy names)
    if comm_policy is not None:
        from lightning_vescale import VeScaleFSDPStrategy

        assert strategy == "vescale_fsdp_fork", strategy
        strategy = VeScaleFSDPStrategy(start_method="fork", comm_policy=comm_policy)
    os.makedirs(out, exist_ok=True)
    L.seed_everything(0)
    devices = 1 if strategy == "single" else 2
    data = TensorDataset(torch.randn(64, 48), torch.randn(64, 1))
    expect = Expect()
    prof = MemoryProfiler(every_n_steps=2, plot_dir=os.path.join(out, "plots"))
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy="auto" if strategy == "single" else strategy,
        max_steps=4, log_every_n_steps=1, logger=CSVLogger(os.path.join(out, "logs"), name="run"),
        callbacks=[expect, prof, Dump(out, expect, prof)], enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
    )
    trainer.fit(Blocks(), DataLoader(data, batch_size=8))


if __name__ == "__main__":
    fit_and_dump(sys.argv[1], sys.argv[2])
