"""SOAP and Shampoo on RaggedShard shards: step cost against AdamW, and against naive SOAP.

Same GPT-style matrices, same world size, same gradients, CPU + gloo, forked ranks:

* ``adamw``        — ``torch.optim.AdamW`` on the local shards (the element-wise baseline);
* ``soap-matrix``  — :class:`lightning_vescale.optim.SOAP` with every matrix whole on one rank
  (the planner's ``"matrix"`` layout): each rank preconditions its own, no collective;
* ``soap-owners``  — the same SOAP on FSDP2's layout (every tensor split by rows over all
  ranks, ``Shard(0)``): each split matrix goes to one load-balanced owner rank (one all-to-all
  per parameter), is stepped there, and its update comes back;
* ``soap-naive``   — gather-everything SOAP on that layout: every matrix's gradient is
  all-gathered to every rank, which keeps the whole state and computes the whole update, and
  keeps its own slice (what ``p.grad.full_tensor()``-style code does);
* ``shampoo-matrix`` — :class:`lightning_vescale.optim.Shampoo` on the ``"matrix"`` layout.

Printed per variant: step time averaged over every step of ``--steps`` (the refresh every
``precondition_frequency`` = 10 steps included; median of ``--repeats`` runs, the slowest rank
counts), bytes moved per step (``CopyCommCounter``), per-rank eigendecomposition load
(``sum d^3`` over the factors a rank refreshes; max/mean imbalance) and optimizer-state bytes per
parameter; then ratios against ``adamw`` and ``soap-naive``. SOAP results of ``soap-matrix`` and
``soap-naive`` are compared with each other (max abs difference).

Run:  python benchmarks/soap.py --world-size 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.muon_vs_naive import rows_layout, weights_and_grads  # noqa: E402
from lightning_vescale.optim import SOAP, Shampoo  # noqa: E402
from lightning_vescale.planner import plan_layout  # noqa: E402
from lightning_vescale.testing import CopyCommCounter  # noqa: E402
from tests.distributed._ragged_helpers import ragged_params, set_ragged_grads  # noqa: E402

VARIANTS = ("adamw", "soap-matrix", "soap-owners", "soap-naive", "shampoo-matrix")


def model_shapes(d: int, layers: int) -> dict[str, tuple[int, ...]]:
    """The matrices and vectors of a GPT-style stack."""
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(layers):
        shapes[f"blocks.{i}.attn.qkv.weight"] = (3 * d, d)
        shapes[f"blocks.{i}.attn.proj.weight"] = (d, d)
        shapes[f"blocks.{i}.mlp.fc.weight"] = (4 * d, d)
        shapes[f"blocks.{i}.mlp.proj.weight"] = (d, 4 * d)
        shapes[f"blocks.{i}.ln.weight"] = (d,)
    return shapes


class NaiveSOAP:
    """Gather-everything SOAP: full gradients on every rank, plain SOAP on full copies."""

    def __init__(self, params: list) -> None:
        self.params = params
        self.full = [torch.nn.Parameter(p.detach().full_tensor()) for p in params]
        self.opt = SOAP(self.full, lr=3e-3, precondition_frequency=10)
        self.state = self.opt.state

    def step(self) -> None:
        for p, f in zip(self.params, self.full):
            f.grad = p.grad.full_tensor()
        self.opt.step()
        with torch.no_grad():
            for p, f in zip(self.params, self.full):
                local = p.to_local()
                lo = _local_start(p)
                local.view(-1).copy_(f.detach().reshape(-1)[lo:lo + local.numel()])


def _local_start(p) -> int:
    from lightning_vescale.optim._base import param_layout

    return param_layout(p, where="naive").start


def _make(variant: str, params: list) -> torch.optim.Optimizer:
    if variant == "soap-naive":
        return NaiveSOAP(params)
    if variant == "adamw":
        return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)
    if variant.startswith("soap"):
        return SOAP(params, lr=3e-3, precondition_frequency=10)
    return Shampoo(params, lr=3e-3, precondition_frequency=10)


def _eig_load(opt: torch.optim.Optimizer) -> float:
    """``sum d^3`` over the factors this rank holds (what a refresh costs it): SOAP's are
    ``(matrices, d, d)``; Shampoo's ``(matrices, sum over tiles of d^2)``, its tiles those of
    the parameter's trailing matrix (design note [shampoo-blocks])."""
    from lightning_vescale.optim._kronecker import matrix_blocks

    total = 0.0
    for st in opt.state.values():
        for k, v in st.items():
            if (k.startswith("GG")) and isinstance(v, torch.Tensor) and v.dim() == 3:
                total += v.shape[0] * float(v.shape[-1]) ** 3
    if isinstance(opt, Shampoo):
        for group in opt.param_groups:
            for p in group["params"]:
                for k, v in opt.state.get(p, {}).items():
                    if k in ("GG0", "GG1") and v.dim() == 2:
                        side = int(k[-1])
                        tiles = matrix_blocks(p.shape[-2:], group["max_preconditioner_dim"])
                        total += v.shape[0] * sum(float(t[side].stop - t[side].start) ** 3
                                                  for t in tiles)
    return total


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    from lightning_vescale.optim._base import local_view

    return sum(local_view(v).numel() * v.element_size() for st in opt.state.values()
               for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)


def _rank_main(args) -> dict:
    """One rank's measurements (runs in a forked gloo rank of ``tests.harness.World``)."""
    warnings.filterwarnings("ignore")
    world = dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    shapes = model_shapes(args.d_model, args.layers)
    matrix_plan = plan_layout(list(shapes.items()), world, granularity="matrix", align=1)
    # naive: FSDP2's layout, every tensor split over all ranks by rows (Shard(0))
    even = rows_layout(shapes, world)
    full, grads = weights_and_grads(shapes, args.steps)
    out = {}
    for variant in VARIANTS:
        place = even if variant in ("soap-naive", "soap-owners") else \
            {n: matrix_plan.placement(n) for n in shapes}
        runs, comm = [], 0
        for _ in range(args.repeats):
            params = ragged_params(full, place, mesh)
            opt = _make(variant, list(params.values()))
            elapsed = 0.0
            for step in range(args.steps):
                set_ragged_grads(params, grads[step], place, mesh)
                dist.barrier()
                t0 = time.perf_counter()
                with CopyCommCounter() as counter:
                    opt.step()
                dist.barrier()
                elapsed += time.perf_counter() - t0
                comm += counter.comm_bytes
            runs.append(elapsed / args.steps)
        finals = {n: p.detach().full_tensor() for n, p in params.items()}
        out[variant] = dict(step_s=statistics.median(runs), eig=_eig_load(opt),
                            state_bytes=_state_bytes(opt),
                            local_params=sum(p.to_local().numel() for p in params.values()),
                            comm_bytes=comm / (args.repeats * args.steps), finals=finals)
    diff = max(float((out["soap-matrix"]["finals"][n] - out[v]["finals"][n]).abs().max())
               for n in shapes for v in ("soap-naive", "soap-owners"))
    for v in VARIANTS:
        del out[v]["finals"]
    out["soap_diff"] = diff
    return out


def run(world: int, args) -> list[dict]:
    """Every rank's measurements, in rank order (forked gloo world; a failing rank raises)."""
    from tests.harness import World

    with World(world, pg_timeout_s=600) as ranks:
        return ranks.run(_rank_main, args, timeout=1800)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world-size", type=int, nargs="+", default=[2])
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    n_params = sum(torch.Size(s).numel() for s in model_shapes(args.d_model, args.layers).values())
    print(f"model: {args.layers} layers x d_model {args.d_model} ({n_params:,} parameters); "
          f"CPU/gloo, 1 thread per rank; step time averaged over {args.steps} steps "
          f"(precondition_frequency 10), median of {args.repeats} runs")
    print("| world | variant | step ms | x adamw | KiB moved/step (rank 0) | eig load max/mean | "
          "state bytes/param |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for world in args.world_size:
        per_rank = run(world, args)
        base = max(per_rank[r]["adamw"]["step_s"] for r in range(world))
        for v in VARIANTS:
            rows = [per_rank[r][v] for r in range(world)]
            step = max(r["step_s"] for r in rows)
            eig = [r["eig"] for r in rows]
            imbalance = max(eig) / (sum(eig) / world) if sum(eig) else float("nan")
            per_param = sum(r["state_bytes"] for r in rows) / n_params
            print(f"| {world} | {v} | {1e3 * step:.2f} | {step / base:.2f} | "
                  f"{rows[0]['comm_bytes'] / 1024:.1f} | {imbalance:.3f} | {per_param:.1f} |",
                  flush=True)
        print(f"\nworld {world}: soap-matrix vs soap-owners and soap-naive parameters, max abs "
              f"difference "
              f"{max(per_rank[r]['soap_diff'] for r in range(world)):.2e}\n")


if __name__ == "__main__":
    main()
