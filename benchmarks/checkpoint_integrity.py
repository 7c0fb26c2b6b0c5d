"""What checkpoint trust costs: safe, verified loading and checksummed saves vs plain DCP.

Each rank of a ``--world-size`` gloo world (forked) shards the examples' GPT (default 25.3M
parameters: 8 layers, width 512) with one AdamW step taken, then times, interleaved over
``--runs`` rounds so machine noise hits every variant alike:

* save: torch's ``dcp.save`` into a fresh directory, against this package's ``save_sharded``
  (the same DCP write + ``.integrity.json`` with per-item CRC-32s + the atomic publish) into a
  fresh directory and over the previous checkpoint at one name (the publish then also removes
  the old checkpoint); and the checksum pass (``checksum_items``) alone;
* load: torch's ``dcp.load`` (plain ``FileSystemReader``, pickle, no checks), against
  ``checkpoint._trust.load`` with ``verify=False`` (restricted unpickling only) and with
  ``verify=True`` (the default: also every item's CRC-32).

Prints per-variant medians (rank 0's) and the ratios to torch. Run from the repository root::

    python -m benchmarks.checkpoint_integrity                # 25.3M parameters, world 2
    python -m benchmarks.checkpoint_integrity --n-layer 2 --n-embd 128 --runs 3   # quick

Results: ``benchmarks/RESULTS_checkpoint.md``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from examples.gpt import GPT, GPTConfig
from lightning_vescale import checkpoint as ckpt
from lightning_vescale._lightning.sharding import ShardGranularity, shard_model
from lightning_vescale.checkpoint import _trust
from lightning_vescale.mesh import init_mesh


def _state(model, opt) -> dict:
    return {"state_dict": ckpt.model_state(model, full=False),
            "optimizer_0": ckpt.optimizer_state(model, opt, full=False)}


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _rank_main(args, root: str):
    """One rank's timings (runs in a forked gloo rank of ``tests.harness.World``); rank 0
    returns ``(parameters, checkpoint bytes, {variant: seconds per run})``, the others None."""
    rank, world = dist.get_rank(), dist.get_world_size()
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=args.vocab, block_size=64, n_layer=args.n_layer,
                          n_head=8, n_embd=args.n_embd))
    n_params = sum(p.numel() for p in model.parameters())
    shard_model(model, units=None, mesh=init_mesh("cpu", world), device=torch.device("cpu"),
                mp_policy=None, granularity=ShardGranularity(
                    granularity=None, optimizer_block_size=None, min_block_numel=0),
                reshard_after_forward=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, args.vocab, (2, 64))
    model(x, x).backward()
    opt.step()
    base = Path(root)
    times: dict[str, list[float]] = {k: [] for k in
                                     ("save torch", "save ours", "save ours, replace",
                                      "checksums alone", "load torch",
                                      "load safe", "load safe+verify")}
    ours = base / "ours"
    for r in range(args.runs):
        plain = base / f"plain-{r}"
        times["save torch"].append(_timed(lambda: dcp.save(_state(model, opt),
                                                           checkpoint_id=plain)))
        fresh = base / f"ours-{r}"
        times["save ours"].append(_timed(lambda: ckpt.save_sharded(fresh, _state(model, opt),
                                                                   {"global_step": r})))
        times["checksums alone"].append(_timed(lambda: _trust.checksum_items(fresh)))
        # over the previous checkpoint at one name: the publish also removes the old one
        times["save ours, replace"].append(_timed(lambda: ckpt.save_sharded(
            ours, _state(model, opt), {"global_step": r})))
        times["load torch"].append(_timed(lambda: dcp.load(_state(model, opt),
                                                           checkpoint_id=plain)))
        times["load safe"].append(_timed(lambda: _trust.load(_state(model, opt), ours,
                                                             verify=False)))
        times["load safe+verify"].append(_timed(lambda: _trust.load(_state(model, opt), ours)))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(plain)
            shutil.rmtree(fresh)
    size = sum(f.stat().st_size for f in ours.iterdir())
    dist.barrier()
    return (n_params, size, times) if rank == 0 else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--n-layer", type=int, default=8)
    p.add_argument("--n-embd", type=int, default=512)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    from tests.harness import World

    root = tempfile.mkdtemp(prefix="ckpt-integrity-")
    try:
        with World(args.world_size, pg_timeout_s=600) as ranks:  # a failing rank raises
            n_params, size, times = ranks.run(_rank_main, args, root, timeout=3600)[0]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"model: {n_params / 1e6:.1f}M parameters; checkpoint (model + AdamW states): "
          f"{size / 2**20:.0f} MiB; world {args.world_size}; medians of {args.runs} runs")
    for key, value in med.items():
        ref = med["save torch"] if key.startswith("save") else med["load torch"]
        print(f"  {key:<18} {value * 1e3:8.1f} ms   {value / ref:5.2f}x torch "
              f"({', '.join(f'{t * 1e3:.0f}' for t in times[key])})")


if __name__ == "__main__":
    main()
