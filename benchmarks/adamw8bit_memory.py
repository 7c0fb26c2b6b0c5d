"""Memory: AdamW8bit vs fp32 torch.optim.AdamW, state bytes per parameter and peak per rank.

1. Optimizer state bytes per parameter, counted from the optimizer's state tensors after one
   step (``step`` counters excluded), for the whole model and for its 8-bit tensors only.
   Expected: 8 for AdamW; 2 * (1 + 4/256) = 2.03 for 8-bit tensors.
2. Peak memory per rank in a real training step: the GPT of ``examples/gpt.py`` sharded with
   ``fully_shard(granularity=256)`` at each world size, one warm-up step (creates the states),
   then the high-water mark of the process's resident memory (Linux ``VmHWM``, reset through
   ``/proc/self/clear_refs``) over one full step (forward, backward, optimizer step). The
   baseline is the RSS just before the model is built (torch runtime, ~220 MB), reported
   separately. ``torch.cuda.max_memory_allocated`` is used instead on a CUDA device.

Run:  python benchmarks/adamw8bit_memory.py [--worlds 1 2] [--d-model 512 --layers 8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from examples.gpt import GPT, GPTConfig, make_batches  # noqa: E402
from lightning_vescale.optim import AdamW8bit  # noqa: E402

OUT_DIR = os.path.join(ROOT, "benchmarks", "out")
MIB = 2**20


def state_bytes(opt: torch.optim.Optimizer, params) -> tuple[int, int, int, int]:
    """(state bytes all, params all, state bytes of >= 4096-element params, their numel)."""
    total = big = n_big = 0
    n = 0
    for p in params:
        st = opt.state.get(p, {})
        b = 0
        for k, v in st.items():
            if k == "step" or not isinstance(v, torch.Tensor):
                continue
            local = v.to_local() if hasattr(v, "to_local") else v
            b += local.numel() * local.element_size()
        local_p = p.to_local() if hasattr(p, "to_local") else p
        total += b
        n += local_p.numel()
        if p.numel() >= 4096:
            big += b
            n_big += local_p.numel()
    return total, n, big, n_big


def _make(kind, params, lr=1e-3):
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    return AdamW8bit(params, lr=lr)


def bytes_per_param(args) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=args.layers, n_head=8, n_embd=args.d_model, block_size=64))
    out = {}
    for kind in ("adamw", "adamw8bit"):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt = _make(kind, model.parameters())
        opt.step()
        total, n, big, n_big = state_bytes(opt, list(model.parameters()))
        out[kind] = dict(bytes_per_param=total / n, bytes_per_param_8bit_tensors=big / n_big,
                         state_mib=total / MIB, params=n, share_8bit=n_big / n)
        del opt
    return out


def _rss() -> tuple[int, int]:
    vals = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                k, v = line.split(":")
                vals[k] = int(v.split()[0]) * 1024
    return vals["VmRSS"], vals["VmHWM"]


def _exact_rss() -> None:
    """Make RSS track live tensors on glibc: mmap (and so return on free) every block >= 64 KiB.

    Without it, freed memory stays in malloc's arenas and RSS peaks drift by tens of MiB
    between runs. Called in the parent before any rank is forked; the ranks inherit it.
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 0)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _rss()[1]


def _current(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return _rss()[0]


def _peak_body(kind: str, d_model: int, layers: int, batch: int, block: int) -> dict:
    from lightning_vescale.fsdp import fully_shard

    torch.set_num_threads(1)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
        else torch.device("cpu")
    if device.type == "cpu":
        _reset_peak(device)  # (trims malloc's free memory)
    baseline = _current(device)
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(GPTConfig(n_layer=layers, n_head=8, n_embd=d_model, block_size=block))
    for blk in model.blocks:
        fully_shard(blk, granularity=256)
    fully_shard(model, granularity=256)
    opt = _make(kind, model.parameters())
    x, y = make_batches(1, batch, block, seed=dist.get_rank())[0]
    x, y = x.to(device), y.to(device)
    for i in range(2):  # warm-up (creates the states), then the measured step
        if i == 1:
            before = _current(device)
            _reset_peak(device)
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    peak = _peak(device)
    total, n, big, n_big = state_bytes(opt, list(model.parameters()))
    return dict(baseline=baseline, before_step=before, peak=peak, state_bytes=total,
                local_params=n)


def peak_per_rank(args) -> dict:
    from tests.harness import run_distributed

    out = {}
    for world in args.worlds:
        for kind in ("adamw", "adamw8bit"):
            res = run_distributed(_peak_body, world, kind, args.peak_d_model, args.peak_layers,
                                  args.batch, args.block, timeout=1200)
            out[f"{kind}@{world}"] = res
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--peak-d-model", type=int, default=512)
    ap.add_argument("--peak-layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    _exact_rss()
    os.makedirs(OUT_DIR, exist_ok=True)

    bpp = bytes_per_param(args)
    print(f"1. optimizer state bytes per parameter (GPT {bpp['adamw']['params'] / 1e6:.2f}M "
          "params, "
          f"{bpp['adamw8bit']['share_8bit']:.1%} of them >= 4096 elements)")
    for kind, r in bpp.items():
        print(f"   {kind:10s} {r['bytes_per_param']:6.3f} B/param overall, "
              f"{r['bytes_per_param_8bit_tensors']:6.3f} B/param on tensors >= 4096 elements, "
              f"{r['state_mib']:8.2f} MiB")
    ratio = bpp["adamw8bit"]["bytes_per_param"] / bpp["adamw"]["bytes_per_param"]
    print(f"   ratio 8-bit / fp32: {ratio:.3f}")

    peaks = peak_per_rank(args)
    n_params = sum(p.numel() for p in GPT(GPTConfig(
        n_layer=args.peak_layers, n_head=8, n_embd=args.peak_d_model,
        block_size=args.block)).parameters())
    print(f"2. peak memory per rank over one training step, GPT {n_params / 1e6:.1f}M params, "
          f"fully_shard(granularity=256), batch {args.batch}x{args.block}")
    print(f"   {'world':>5s} {'rank':>4s} {'optimizer':10s} {'states MiB':>10s} "
          f"{'before step':>11s} {'peak':>8s} {'peak-runtime':>12s}  (MiB; runtime = RSS before "
          "the model)")
    rows = []
    for world in args.worlds:
        for rank in range(world):
            r = {k: peaks[f"{k}@{world}"][rank] for k in ("adamw", "adamw8bit")}
            for kind in ("adamw", "adamw8bit"):
                x = r[kind]
                print(f"   {world:5d} {rank:4d} {kind:10s} {x['state_bytes'] / MIB:10.1f} "
                      f"{x['before_step'] / MIB:11.1f} {x['peak'] / MIB:8.1f} "
                      f"{(x['peak'] - x['baseline']) / MIB:12.1f}")
            saved = r["adamw"]["peak"] - r["adamw8bit"]["peak"]
            net_a = r["adamw"]["peak"] - r["adamw"]["baseline"]
            net_b = r["adamw8bit"]["peak"] - r["adamw8bit"]["baseline"]
            rows.append(dict(world=world, rank=rank, saved_mib=saved / MIB,
                             peak_ratio_net=net_b / net_a,
                             state_saved_mib=(r["adamw"]["state_bytes"]
                                              - r["adamw8bit"]["state_bytes"]) / MIB))
            print(f"   -> peak reduced by {saved / MIB:.1f} MiB (states: "
                  f"{rows[-1]['state_saved_mib']:.1f} MiB less); peak above runtime "
                  f"{net_b / net_a:.2f}x of AdamW's")
    out = dict(args=vars(args), bytes_per_param=bpp, peaks=peaks, summary=rows)
    with open(os.path.join(OUT_DIR, "adamw8bit_memory.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
