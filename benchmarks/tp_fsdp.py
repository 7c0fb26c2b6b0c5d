"""FSDP + tensor parallelism: ours vs FSDP2 + TP, bytes per step per mesh dim and memory per rank.

Both engines shard the same small Llama-style model (pre-norm blocks, attention ``wq/wk/wv``
colwise and ``wo`` rowwise, MLP ``w1/w3`` colwise and ``w2`` rowwise: torch's usual TP plan
applied with ``parallelize_module`` on ``mesh["tp"]``), then ``fully_shard`` per block and the
root on the data-parallel sub-mesh, as Lightning's ``ModelParallelStrategy`` and torchtitan do.
Same init, same per-rank batches (every rank of one tp group sees the same micro-batch), same
``torch.optim.AdamW(foreach=True)``. Meshes:

* ``2x2``: world 4 as ``(dp 2, tp 2)``;
* ``2x2x2``: world 8 as ``(dp_replicate 2, dp_shard 2, tp 2)`` (HSDP + TP).

Printed per mesh and engine:

* bytes of one training step (forward, backward, optimizer step) per collective kind and mesh
  dim (``dp_shard``, ``dp_replicate``, ``tp``), counted by ``benchmarks.hsdp.GroupCommCounter``
  (a ``TorchDispatchMode`` that sees every ``c10d`` and functional collective, whoever issues
  it, and reads its process group off the op): the same counter for both engines. Bytes are the
  full-buffer size of each collective (all-gather output, reduce-scatter input, all-reduce
  tensor); our gloo reduce-scatter is an all-to-all (counted as reduce-scatter). The engine's
  flattened data-parallel group (one grad-flag all-reduce) counts as ``dp_replicate`` traffic;
* memory per rank at rest after the optimizer step (parameters resharded, gradients and
  optimizer states alive), by the engine's accounting of ``MemoryProfiler``
  (``callbacks._memory_accounting.account``: every storage byte once; for ours the DBuffers'
  own storages too, padding included; FSDP2's padded shards are its parameters' storages), the
  largest rank's figure per category;
* ratios ours / FSDP2 and whether the losses agree.

Bytes and memory are exact counts, independent of machine load (no times are printed: on CPU
with 4-8 ranks on 2 cores they would measure the scheduler).

Run from the repository root::

    python -m benchmarks.tp_fsdp                 # both meshes, ~1 min here
    python -m benchmarks.tp_fsdp --mesh 2x2 --dim 128 --layers 2

Results: ``benchmarks/RESULTS_tp.md``.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lightning_vescale._gloo_exchange import unfused
from benchmarks.hsdp import GroupCommCounter

ENGINES = ("vescale", "fsdp2")
MESHES = {"2x2": ((2, 2), ("dp", "tp")),
          "2x2x2": ((2, 2, 2), ("dp_replicate", "dp_shard", "tp"))}
DIMS = ("dp_shard", "dp_replicate", "tp", "other")
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "other")


class Counter(GroupCommCounter):
    """``GroupCommCounter`` without functional collectives' ``wait_tensor`` and
    ``_wrap_tensor_autograd`` (bookkeeping, not transfers: TP's functional all-reduces would
    count two and three times, the extra ones as "other")."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        if func.overloadpacket.__name__ in ("wait_tensor", "_wrap_tensor_autograd"):
            return super(GroupCommCounter, self).__torch_dispatch__(func, types, args, kwargs)
        return super().__torch_dispatch__(func, types, args, kwargs)


class Block(nn.Module):
    """A pre-norm Llama block; heads are read off the local width (``-1``) so TP works."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads_dim = dim // heads
        self.norm1, self.norm2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.w1 = nn.Linear(dim, 4 * dim, bias=False)
        self.w3 = nn.Linear(dim, 4 * dim, bias=False)
        self.w2 = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        q, k, v = (w(h).view(b, t, -1, self.heads_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, -1))
        h = self.norm2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Model(nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        logits = self.out(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, self.vocab), targets.reshape(-1))


def _tp_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    col, row = ColwiseParallel, RowwiseParallel
    return {"wq": col(), "wk": col(), "wv": col(), "wo": row(),
            "w1": col(), "w3": col(), "w2": row()}


def build(engine: str, cfg: dict, mesh, seed: int = 0) -> tuple[nn.Module, Any]:
    """The model with the TP plan on ``mesh["tp"]`` and ``engine``'s ``fully_shard`` on the
    data-parallel sub-mesh (each block, then the root), and its AdamW."""
    from torch.distributed.tensor.parallel import parallelize_module

    if engine == "vescale":
        from lightning_vescale.fsdp import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard  # type: ignore[no-redef]
    names = mesh.mesh_dim_names
    dp = mesh[names[:-1]] if len(names) == 3 else mesh[names[0]]
    torch.manual_seed(seed)
    model = Model(**cfg)
    for b in model.blocks:
        parallelize_module(b, mesh["tp"], _tp_plan())
        fully_shard(b, mesh=dp)
    fully_shard(model, mesh=dp)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)


def mesh_roles(mesh) -> dict[str, str]:
    """Process-group name -> mesh dim role."""
    names = mesh.mesh_dim_names
    roles = {mesh.get_group("tp").group_name: "tp"}
    if len(names) == 2:
        roles[mesh.get_group(names[0]).group_name] = "dp_shard"
    else:
        dp = mesh[names[:-1]]
        roles[mesh.get_group("dp_shard").group_name] = "dp_shard"
        roles[mesh.get_group("dp_replicate").group_name] = "dp_replicate"
        roles[dp._flatten().get_group().group_name] = "dp_replicate"
    return roles


def _memory(engine: str, model: nn.Module, opt: Any) -> dict[str, int]:
    from lightning_vescale.callbacks._memory_accounting import account, collect_training_tensors
    from lightning_vescale.callbacks.memory import engine_tensors

    cats = collect_training_tensors([model], [opt])
    extra = 0
    if engine == "vescale":
        found, extra = engine_tensors(model)
        for k, ts in found.items():
            cats.setdefault(k, []).extend(ts)
    device = next(model.parameters()).device
    b = account(device=device, extra_comm_bytes=extra, **cats)
    return {**b.as_dict(), "total": b.total}


@unfused()  # bytes by collective kind, as NCCL issues them (not gloo's fused exchange)
def bench_body(mesh_name: str, cfg: dict, batch: int, seq: int, steps: int) -> dict[str, Any]:
    """On every rank: each engine counts its last step and accounts its memory after it."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_vescale.placement import set_flat_step_enabled

    shape, names = MESHES[mesh_name]
    device = "cpu" if dist.get_backend() == "gloo" else torch.accelerator.current_accelerator().type
    mesh = init_device_mesh(device, shape, mesh_dim_names=names)
    roles = mesh_roles(mesh)
    dp_rank = mesh.get_local_rank(names[0]) * (shape[1] if len(shape) == 3 else 1) + (
        mesh.get_local_rank(names[1]) if len(shape) == 3 else 0)
    g = torch.Generator().manual_seed(1000 + dp_rank)  # one micro-batch per data-parallel rank
    data = [(torch.randint(0, cfg["vocab"], (batch, seq), generator=g),
             torch.randint(0, cfg["vocab"], (batch, seq), generator=g)) for _ in range(steps)]
    out: dict[str, Any] = {}
    for engine in ENGINES:
        set_flat_step_enabled(engine == "vescale")  # FSDP2 runs without our flat-step handlers
        model, opt = build(engine, cfg, mesh)
        losses = []
        for i, (x, y) in enumerate(data):
            counter = Counter(roles)
            with counter if i == steps - 1 else _Null():
                loss = model(x.to(device), y.to(device))
                loss.backward()
                opt.step()
            if i == steps - 1:
                mem = _memory(engine, model, opt)
            opt.zero_grad()
            losses.append(loss.item())
        split = counter.split()
        out[engine] = {"bytes": split["bytes"], "calls": split["calls"], "memory": mem,
                       "losses": losses,
                       "nparams": sum(p.numel() for p in model.parameters())}
        del model, opt
    set_flat_step_enabled(True)
    return out


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def run(mesh_name: str, cfg: dict, batch: int, seq: int, steps: int,
        timeout: float = 1800) -> dict[str, Any]:
    """Fork the mesh's world, run :func:`bench_body`, reduce over ranks (bytes: rank 0's, all
    ranks checked equal per engine; memory: the largest rank per category)."""
    from tests.harness import run_distributed

    shape, _ = MESHES[mesh_name]
    world = 1
    for s in shape:
        world *= s
    per_rank = run_distributed(bench_body, world, mesh_name, cfg, batch, seq, steps,
                               timeout=timeout)
    res: dict[str, Any] = {"mesh": mesh_name, "world": world}
    for e in ENGINES:
        rs = [r[e] for r in per_rank]
        res[e] = {"bytes": rs[0]["bytes"], "calls": rs[0]["calls"],
                  "ranks_agree": all(r["bytes"] == rs[0]["bytes"] for r in rs),
                  "memory": {k: max(r["memory"][k] for r in rs) for k in rs[0]["memory"]},
                  "losses": rs[0]["losses"], "nparams": rs[0]["nparams"]}
    return res


def _by_dim(b: dict[str, int]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {d: dict.fromkeys(KINDS, 0) for d in DIMS}
    for key, n in b.items():
        kind, role = key.split("/")
        out[role if role in out else "other"][kind] += n
    return out


def _ratio(a: float, b: float) -> str:
    return "-" if b == 0 else f"{a / b:.3f}"


def report(res: dict[str, Any]) -> str:
    ours, theirs = res["vescale"], res["fsdp2"]
    lines = [f"mesh {res['mesh']} (world {res['world']}), {ours['nparams']:,} parameters; "
             f"ranks agree on bytes: ours {ours['ranks_agree']}, FSDP2 {theirs['ranks_agree']}",
             "", "| mesh dim | collective | ours (bytes) | FSDP2 + TP (bytes) | ours / FSDP2 |",
             "|---|---|---:|---:|---:|"]
    mine, other = _by_dim(ours["bytes"]), _by_dim(theirs["bytes"])
    for d in DIMS:
        for k in KINDS:
            a, b = mine[d][k], other[d][k]
            if a or b:
                lines.append(f"| {d} | {k} | {a:,} | {b:,} | {_ratio(a, b)} |")
        ta, tb = sum(mine[d].values()), sum(other[d].values())
        if ta or tb:
            lines.append(f"| **{d}** | all | **{ta:,}** | **{tb:,}** | **{_ratio(ta, tb)}** |")
    ta, tb = sum(ours["bytes"].values()), sum(theirs["bytes"].values())
    lines.append(f"| **all** | all | **{ta:,}** | **{tb:,}** | **{_ratio(ta, tb)}** |")
    lines += ["", "| memory per rank (largest rank) | ours (bytes) | FSDP2 + TP (bytes) | "
              "ours / FSDP2 |", "|---|---:|---:|---:|"]
    for k, a in ours["memory"].items():
        b = theirs["memory"][k]
        if a or b:
            lines.append(f"| {k} | {a:,} | {b:,} | {_ratio(a, b)} |")
    diff = max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"], strict=True))
    lines += ["", f"losses ours {[round(v, 6) for v in ours['losses']]}, FSDP2 "
              f"{[round(v, 6) for v in theirs['losses']]} (max difference {diff:.2e})"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mesh", choices=(*MESHES, "all"), default="all")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=3, help="the last one is counted")
    a = p.parse_args(argv)
    cfg = {"vocab": a.vocab, "dim": a.dim, "heads": a.heads, "layers": a.layers}
    for name in (MESHES if a.mesh == "all" else (a.mesh,)):
        print(report(run(name, cfg, a.batch, a.seq, a.steps)), flush=True)
        print()


if __name__ == "__main__":
    main()
