"""Full sharding vs HSDP at world 4 (CPU/gloo): ours vs PyTorch FSDP2, bytes and step time.

Both engines train the same GPT (``examples.gpt``, same init, same per-rank micro-batches, same
``torch.optim.AdamW``), one group per transformer block plus the root, in two layouts of the same
4 ranks:

* ``full`` (1 x 4): a 1-D mesh, every group sharded over all 4 ranks;
* ``hsdp`` (2 x 2): a 2-D ``("dp_replicate", "dp_shard")`` mesh (FSDP2's convention: dim 0
  replicates, dim 1 shards), ``fully_shard(module, mesh=mesh)`` of each engine on the same mesh.

Printed per (engine, layout):

* bytes per step in all-gather / reduce-scatter / all-reduce, split into traffic inside the shard
  group and across replicas. Counted identically for both engines by :class:`GroupCommCounter`,
  a ``TorchDispatchMode`` that sees every ``c10d`` collective (whoever issues it, forward,
  backward hooks or optimizer) and reads its process group off the op's arguments. A
  collective's bytes are its *full-buffer* size (the all-gather output, the reduce-scatter
  input, the all-reduce tensor), the figure the network model uses; a ring moves ``(n-1)/n`` of
  it per rank. Copies (bytes, operators) are counted by the same mode, as in
  ``benchmarks/fsdp2_vs_vescale.py`` (design note [copy-comm-counting]);
* median step time (forward + backward + optimizer step, slowest rank per step) over
  ``--runs`` x ``--steps`` steps, all four (engine, layout) pairs built in one world and
  interleaved step by step (the order rotating) so machine load hits them alike; ratios
  ours / FSDP2 per layout and HSDP / full per engine;
* the losses of every pair (all four train the same data-parallel problem of 4 ranks, so they
  should agree to float rounding).

On CPU/gloo with 4 ranks on few cores the times measure the engines' software paths and gloo,
not a network: the network model (``benchmarks/hsdp_network_model.py``) projects clusters.

Run from the repository root::

    python -m benchmarks.hsdp                      # 3.19M-param GPT, world 4, ~2.5 min here
    python -m benchmarks.hsdp --runs 5 --fsdp2-keep-last-block
    python -m benchmarks.hsdp --n-layer 2 --n-embd 64 --steps 2 --runs 1   # seconds

Results and how they were taken: ``benchmarks/RESULTS_hsdp.md``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._pytree import tree_flatten

from lightning_vescale._gloo_exchange import unfused
from benchmarks.fsdp2_vs_vescale import _micro
from examples.gpt import GPT, GPTConfig, make_batches
from lightning_vescale.testing import CopyCommCounter

ENGINES = ("vescale", "fsdp2")
LAYOUTS = {"full": 1, "hsdp": 2}  # layout -> replicas
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "other")
ROLES = ("shard", "replicate", "other")


# ------------------------------------------------------------------------------------------------
# counting
# ------------------------------------------------------------------------------------------------
def _kind(op_name: str) -> str:
    if "allgather" in op_name or "all_gather" in op_name:
        return "all_gather"
    # on gloo lightning_vescale's reduce-scatter is an all-to-all plus a local sum (design note
    # [dbuffer-collectives]): same bytes sent per rank, (n - 1) / n of the buffer
    if "reduce_scatter" in op_name or "alltoall" in op_name:
        return "reduce_scatter"
    if "allreduce" in op_name or "all_reduce" in op_name:
        return "all_reduce"
    return "other"


def _group(args: tuple) -> tuple[str | None, int]:
    """``(name, size)`` of the process group in a c10d op's arguments (a boxed
    ``ProcessGroup``, or the group-name string that functional collectives take)."""
    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                pg = dist.ProcessGroup.unbox(a)
            except (RuntimeError, TypeError):
                continue
            return pg.group_name, pg.size()
        if isinstance(a, str):  # functional all_reduce's reduce op ("sum") comes first
            try:
                return a, _resolve_process_group(a).size()
            except RuntimeError:
                continue
    return None, 1


def ring_sent_bytes(kind: str, nbytes: int, n: int) -> float:
    """Bytes one rank sends in a ring collective of ``n`` ranks over an ``nbytes`` buffer."""
    if n <= 1:
        return 0.0
    return (2 if kind == "all_reduce" else 1) * (n - 1) / n * nbytes


def _tensor_bytes(x: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(x)[0]
               if isinstance(t, torch.Tensor))


class GroupCommCounter(CopyCommCounter):
    """:class:`~lightning_vescale.testing.CopyCommCounter` that also splits collectives by kind
    (all-gather / reduce-scatter / all-reduce / other) and by group role.

    ``roles`` maps process-group names to a role (``"shard"``, ``"replicate"``); a collective in
    any other group (e.g. the world group of a 1-D mesh used for a barrier) counts as
    ``"other"``. Bytes are the full-buffer size: the larger of the op's first two arguments'
    tensor bytes (output/input of all-gather and reduce-scatter; the tensor list of all-reduce).
    :attr:`bytes`, :attr:`calls` and :attr:`sent` (bytes one rank sends if the collective runs
    as a ring, :func:`ring_sent_bytes`) are ``Counter``s keyed by ``(kind, role)``.
    """

    def __init__(self, roles: dict[str, str]) -> None:
        super().__init__()
        self.roles = dict(roles)
        self.bytes: Counter[tuple[str, str]] = Counter()
        self.calls: Counter[tuple[str, str]] = Counter()
        self.sent: Counter[tuple[str, str]] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        if func.namespace in ("c10d", "_c10d_functional") and self._depth == 0:
            name, size = _group(args)
            key = (_kind(func.overloadpacket.__name__), self.roles.get(name or "", "other"))
            nbytes = max((_tensor_bytes(a) for a in args[:2]), default=0)
            self.bytes[key] += nbytes
            self.calls[key] += 1
            self.sent[key] += ring_sent_bytes(key[0], nbytes, size)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def split(self) -> dict[str, Any]:
        """Plain-dict figures: ``bytes``/``calls`` as ``{"kind/role": n}`` plus the copy counts."""
        return {"bytes": {f"{k}/{r}": v for (k, r), v in self.bytes.items()},
                "calls": {f"{k}/{r}": v for (k, r), v in self.calls.items()},
                "sent": {f"{k}/{r}": v for (k, r), v in self.sent.items()},
                **self.summary()}


# ------------------------------------------------------------------------------------------------
# one (engine, layout) pair
# ------------------------------------------------------------------------------------------------
def make_mesh(layout: str) -> DeviceMesh:
    """The layout's mesh over all ranks: 1-D ``("dp_shard",)`` or 2-D ``(replicas, shard)``."""
    world = dist.get_world_size()
    replicas = LAYOUTS[layout]
    if world % replicas:
        raise ValueError(f"layout {layout!r} needs a world size divisible by {replicas}, "
                         f"got {world}")
    device = "cpu" if dist.get_backend() == "gloo" else torch.accelerator.current_accelerator().type
    if replicas == 1:
        return init_device_mesh(device, (world,), mesh_dim_names=("dp_shard",))
    return init_device_mesh(device, (replicas, world // replicas),
                            mesh_dim_names=("dp_replicate", "dp_shard"))


def mesh_roles(mesh: DeviceMesh) -> dict[str, str]:
    """Group name -> role for a 1-D (shard) or 2-D (replicate, shard) mesh.

    On a 2-D mesh the flattened data-parallel group (our engine's one grad-flag all-reduce over
    every rank, ``MeshInfo.data_parallel_group``) crosses replicas, so it counts as
    ``"replicate"`` traffic (the ring figures use each op's own group size). Asking for it here
    creates it on every rank at the same point (it is cached by torch on the mesh).
    """
    if mesh.ndim == 1:
        return {mesh.get_group(0).group_name: "shard"}
    return {mesh.get_group(1).group_name: "shard", mesh.get_group(0).group_name: "replicate",
            mesh._flatten().get_group().group_name: "replicate"}


def build(engine: str, cfg: GPTConfig, mesh: DeviceMesh, seed: int = 0,
          fsdp2_keep_last_block: bool = False):
    """The GPT sharded by ``engine`` on ``mesh`` (each block, then the root) and its AdamW.

    Both engines run their defaults; ours keeps the last block's parameters into backward
    (``reshard_after_forward=None``). ``fsdp2_keep_last_block`` gives FSDP2 the same by hand
    (``reshard_after_forward=False`` on the last block, as torchtitan does).
    """
    if engine == "vescale":
        from lightning_vescale.fsdp import fully_shard
    elif engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard  # type: ignore[no-redef]
    else:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    torch.manual_seed(seed)
    model = GPT(cfg)
    for i, block in enumerate(model.blocks):
        keep = engine == "fsdp2" and fsdp2_keep_last_block and i == len(model.blocks) - 1
        fully_shard(block, mesh=mesh, **({"reshard_after_forward": False} if keep else {}))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, foreach=True)
    return model, opt


def _step(model, opt, x, y) -> float:
    loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


@unfused()  # bytes by collective kind, as NCCL issues them (not gloo's fused exchange)
def bench_body(cfg_kw: dict, batch: int, steps: int, warmup: int, runs: int,
               engines: tuple[str, ...] = ENGINES, layouts: tuple[str, ...] = tuple(LAYOUTS),
               fsdp2_keep_last_block: bool = False) -> dict[str, Any]:
    """On every rank: build every (engine, layout) pair, count one step, time the rest."""
    from lightning_vescale.placement import set_flat_step_enabled

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = GPTConfig(**cfg_kw)
    data = _micro(make_batches(warmup + steps, batch * world, cfg.block_size), rank, world)
    meshes = {lay: make_mesh(lay) for lay in layouts}
    pairs = [(e, lay) for lay in layouts for e in engines]
    built = {p: build(p[0], cfg, meshes[p[1]], fsdp2_keep_last_block=fsdp2_keep_last_block)
             for p in pairs}
    losses: dict[str, list[float]] = {f"{e}/{lay}": [] for e, lay in pairs}
    times: dict[str, list[float]] = {f"{e}/{lay}": [] for e, lay in pairs}
    counts: dict[str, Any] = {}
    k = 0
    for run in range(runs):
        for i, (x, y) in enumerate(data):
            k += 1
            order = pairs[k % len(pairs):] + pairs[:k % len(pairs)]  # rotate who goes first
            for e, lay in order:
                key = f"{e}/{lay}"
                model, opt = built[(e, lay)]
                # FSDP2 runs without this package's flat-step handlers (as in fsdp2_vs_vescale)
                set_flat_step_enabled(e == "vescale")
                dist.barrier()
                if run == 0 and i == warmup - 1:  # count the last warm-up step (not timed)
                    with GroupCommCounter(mesh_roles(meshes[lay])) as c:
                        loss = _step(model, opt, x, y)
                    counts[key] = c.split()
                    dt = float("nan")
                else:
                    t0 = time.perf_counter()
                    loss = _step(model, opt, x, y)
                    dt = time.perf_counter() - t0
                if run == 0:
                    losses[key].append(loss)
                if i >= warmup:
                    times[key].append(dt)
    set_flat_step_enabled(True)
    nparams = sum(p.numel() for p in built[pairs[0]][0].parameters())
    return {"times": times, "losses": losses, "counts": counts, "nparams": nparams}


# ------------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------------
def run(world_size: int, cfg_kw: dict, batch: int, steps: int, warmup: int, runs: int,
        engines: tuple[str, ...] = ENGINES, layouts: tuple[str, ...] = tuple(LAYOUTS),
        timeout: float = 3600, fsdp2_keep_last_block: bool = False) -> dict[str, Any]:
    """Fork ``world_size`` gloo ranks, run :func:`bench_body`, reduce over ranks."""
    from tests.harness import run_distributed

    if warmup < 1:
        raise ValueError(f"warmup must be >= 1 (the last warm-up step is the counted one), "
                         f"got warmup={warmup}")
    per_rank = run_distributed(bench_body, world_size, cfg_kw, batch, steps, warmup, runs,
                               engines, layouts, fsdp2_keep_last_block, timeout=timeout)
    out: dict[str, Any] = {"world_size": world_size, "nparams": per_rank[0]["nparams"],
                           "pairs": {}}
    for key in per_rank[0]["times"]:
        per_step = [max(ts) for ts in zip(*(r["times"][key] for r in per_rank))]
        counts = [r["counts"][key] for r in per_rank]
        out["pairs"][key] = {
            "median_step_s": statistics.median(per_step),
            "min_step_s": min(per_step),
            "steps_timed": len(per_step),
            "losses": per_rank[0]["losses"][key],
            "bytes": counts[0]["bytes"],
            "calls": counts[0]["calls"],
            "sent": counts[0]["sent"],
            "ranks_agree": all(c["bytes"] == counts[0]["bytes"] for c in counts),
            "copy_bytes": counts[0]["copy_bytes"],
            "copies": counts[0]["copies"],
            "by_op": counts[0]["by_op"],
        }
    return out


def _b(n: float) -> str:
    return f"{int(n):,}"


def report(res: dict[str, Any]) -> str:
    pairs = res["pairs"]
    cols = ["engine/layout"] + [f"{k} {r}" for k in KINDS[:3] for r in ROLES[:2]] + [
        "other", "total", "collectives", "ring sent shard", "ring sent replicate", "copied",
        "copies", "median step ms", "min step ms"]
    body = []
    for key, p in pairs.items():
        b, c = p["bytes"], p["calls"]
        cells = [key]
        for k in KINDS[:3]:
            for r in ROLES[:2]:
                cells.append(f"{_b(b.get(f'{k}/{r}', 0))} ({c.get(f'{k}/{r}', 0)})")
        other = sum(v for name, v in b.items() if name.split("/")[0] == "other"
                    or name.endswith("/other"))
        sent = {r: sum(v for name, v in p["sent"].items() if name.endswith("/" + r))
                for r in ROLES[:2]}
        cells += [_b(other), _b(sum(b.values())), str(sum(c.values())), _b(sent["shard"]),
                  _b(sent["replicate"]), _b(p["copy_bytes"]), str(p["copies"]),
                  f"{p['median_step_s'] * 1e3:.1f}", f"{p['min_step_s'] * 1e3:.1f}"]
        if not p["ranks_agree"]:
            cells[0] += " (ranks differ!)"
        body.append(cells)
    w = [max(len(col), *(len(b[i]) for b in body)) for i, col in enumerate(cols)]
    n = next(iter(pairs.values()))["steps_timed"]
    lines = [f"GPT with {res['nparams'] / 1e6:.2f}M parameters, world size {res['world_size']}, "
             f"{n} timed steps per pair (slowest rank per step). Bytes per step, full-buffer "
             "size of each collective (calls in brackets); 'shard' = inside the shard group, "
             "'replicate' = across replicas; 'ring sent' = bytes one rank sends if each "
             "collective runs as a ring ((n-1)/n of the buffer, all-reduce twice that); copies "
             "in fwd+bwd+step.",
             "  ".join(col.rjust(w[i]) for i, col in enumerate(cols))]
    lines += ["  ".join(v.rjust(w[i]) for i, v in enumerate(b)) for b in body]

    def med(key: str) -> float | None:
        return pairs[key]["median_step_s"] if key in pairs else None

    for lay in LAYOUTS:
        a, f = med(f"vescale/{lay}"), med(f"fsdp2/{lay}")
        if a and f:
            lines.append(f"{lay}: step time vescale / fsdp2 = {a / f:.3f}; bytes vescale / fsdp2 "
                         f"= {_total(pairs, 'vescale', lay) / _total(pairs, 'fsdp2', lay):.3f}")
    for e in ENGINES:
        a, f = med(f"{e}/hsdp"), med(f"{e}/full")
        if a and f:
            lines.append(f"{e}: step time hsdp / full = {a / f:.3f}")
    ref = next(iter(pairs.values()))["losses"]
    worst = max(abs(x - y) / abs(y) for p in pairs.values() for x, y in zip(p["losses"], ref))
    lines.append(f"losses agree across all pairs: max relative difference {worst:.2e} over "
                 f"{len(ref)} steps")
    for key, p in pairs.items():
        lines.append(f"{key} ops: {p.get('by_op', {})}")
    return "\n".join(lines)


def _total(pairs: dict[str, Any], engine: str, layout: str) -> int:
    return sum(pairs[f"{engine}/{layout}"]["bytes"].values())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="micro-batch per rank")
    p.add_argument("--steps", type=int, default=8, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--fsdp2-keep-last-block", action="store_true",
                   help="FSDP2 with reshard_after_forward=False on the last block (torchtitan's "
                        "setting; ours does this by default)")
    a = p.parse_args(argv)
    cfg_kw = dict(vocab_size=65, block_size=a.block_size, n_layer=a.n_layer, n_head=a.n_head,
                  n_embd=a.n_embd, tie_weights=True)
    res = run(a.world_size, cfg_kw, a.batch, a.steps, a.warmup, a.runs, tuple(a.engines),
              tuple(a.layouts), fsdp2_keep_last_block=a.fsdp2_keep_last_block)
    print(report(res))
    if a.fsdp2_keep_last_block:
        print("FSDP2 ran with reshard_after_forward=False on the last block.")


if __name__ == "__main__":
    main()
