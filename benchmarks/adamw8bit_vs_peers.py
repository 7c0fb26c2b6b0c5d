"""AdamW8bit side by side with established 8-bit AdamWs (bitsandbytes, torchao) and fp32 AdamW.

Optional dependencies, imported lazily: ``pip install bitsandbytes torchao``; a missing one is
skipped with a message. All run on CPU (bitsandbytes >= 0.50 has a pure-torch CPU backend;
torchao compiles its step with ``torch.compile``, so its first step is slow and reported
separately).

1. Step time of the optimizer alone (fixed random gradients, median over ``--timed-steps`` after
   warm-up) on a GPT of ``examples/gpt.py``, and, for AdamW8bit, the same parameters laid out in
   one flat buffer (as a ``DBuffer`` shard is), which takes the one-span fast path.
2. Optimizer state bytes per parameter, from the state tensors (codes, scales, code maps).
3. Final loss: the small GPT trained ``--steps`` steps with each optimizer, same seed and data
   (final training loss = mean of the last 10 steps; held-out = another sampling seed).

Run:  python benchmarks/adamw8bit_vs_peers.py          (~5-8 min on 1 CPU core, torchao compile)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)

from benchmarks._lm import build_gpt, train_lm  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402
from lightning_vescale.optim import AdamW8bit  # noqa: E402

OUT_DIR = os.path.join(ROOT, "benchmarks", "out")
HP = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


def available() -> dict:
    """name -> optimizer factory(params, **hp) for the peers that import."""
    out = {"torch AdamW (fp32)": lambda ps, **hp: torch.optim.AdamW(ps, **hp),
           "lightning_vescale AdamW8bit": lambda ps, **hp: AdamW8bit(ps, **hp)}
    try:
        import bitsandbytes as bnb

        out[f"bitsandbytes {bnb.__version__} AdamW8bit"] = \
            lambda ps, **hp: bnb.optim.AdamW8bit(ps, **hp)
    except Exception as err:  # noqa: BLE001 - any import failure means "skip"
        print(f"bitsandbytes not available ({type(err).__name__}: {err}); skipped "
              "(pip install bitsandbytes)")
    try:
        import torchao
        from torchao.optim import AdamW8bit as AoAdamW8bit

        out[f"torchao {torchao.__version__} AdamW8bit"] = lambda ps, **hp: AoAdamW8bit(ps, **hp)
    except Exception as err:  # noqa: BLE001
        print(f"torchao not available ({type(err).__name__}: {err}); skipped "
              "(pip install torchao)")
    return out


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer state (tensor subclasses: their inner tensors)."""
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor) -> None:
        nonlocal total
        if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
            names, _ = t.__tensor_flatten__()
            for n in names:
                add(getattr(t, n))
            return
        key = t.untyped_storage().data_ptr()
        if key in seen and key != 0:
            return
        seen.add(key)
        total += t.untyped_storage().nbytes()

    for st in opt.state.values():
        for k, v in st.items():
            if k != "step" and isinstance(v, torch.Tensor):
                add(v)
    return total


def _model(args) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=args.time_layers, n_head=8, n_embd=args.time_d_model,
                         block_size=64))


def _flat_params(model: GPT, align: int = 256) -> None:
    """Re-home params and grads into one flat buffer each, at block-aligned offsets."""
    ps = list(model.parameters())
    offsets, off = [], 0
    for p in ps:
        offsets.append(off)
        off += -(-p.numel() // align) * align
    pbuf, gbuf = torch.zeros(off), torch.zeros(off)
    for p, o in zip(ps, offsets):
        pbuf[o:o + p.numel()].copy_(p.detach().reshape(-1))
        p.data = pbuf[o:o + p.numel()].view_as(p)
        p.grad = gbuf[o:o + p.numel()].view_as(p)


def step_times(factories: dict, args) -> dict:
    out = {}
    cases = [(name, f, False) for name, f in factories.items()]
    cases.insert(2, ("lightning_vescale AdamW8bit, flat buffer (fast path)",
                     factories["lightning_vescale AdamW8bit"], True))
    for name, factory, flat in cases:
        model = _model(args)
        if flat:
            _flat_params(model)
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            if p.grad is None:
                p.grad = torch.empty_like(p)
            p.grad.copy_(torch.randn(p.shape, generator=g) * 1e-2)
        opt = factory(model.parameters(), **HP)
        t0 = time.perf_counter()
        opt.step()
        first = time.perf_counter() - t0
        for _ in range(2):
            opt.step()
        times = []
        for _ in range(args.timed_steps):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
        n = sum(p.numel() for p in model.parameters())
        out[name] = dict(step_ms=statistics.median(times) * 1e3, first_step_s=first,
                         state_bytes=state_bytes(opt), params=n)
        print(f"   {name:52s} {out[name]['step_ms']:8.1f} ms/step  (first step "
              f"{first:6.2f} s)  {out[name]['state_bytes'] / n:6.3f} B/param", flush=True)
    return out


def final_loss(factory, args, seed: int) -> dict:
    model = build_gpt(args.layers, args.d_model, args.block, seed)
    run = train_lm(model, factory(model.parameters(), **HP), steps=args.steps, batch=args.batch,
                   block=args.block, seed=seed)
    return dict(final_train=run["final_train"], held_out=run["eval_loss"], losses=run["losses"],
                seconds=run["seconds"])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-d-model", type=int, default=256)
    ap.add_argument("--time-layers", type=int, default=4)
    ap.add_argument("--timed-steps", type=int, default=10)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    os.makedirs(OUT_DIR, exist_ok=True)
    factories = available()

    n = sum(p.numel() for p in _model(args).parameters())
    print(f"1+2. optimizer step time and state bytes/param, GPT {n / 1e6:.2f}M params, CPU, "
          f"1 thread")
    times = step_times(factories, args)
    print(f"3. final loss, GPT d={args.d_model} L={args.layers}, {args.steps} steps, lr "
          f"{HP['lr']}, seeds {args.seeds}")
    losses = {}
    for name, factory in factories.items():
        runs = [final_loss(factory, args, s) for s in args.seeds]
        losses[name] = dict(final_train=statistics.mean(r["final_train"] for r in runs),
                            held_out=statistics.mean(r["held_out"] for r in runs),
                            seconds=statistics.mean(r["seconds"] for r in runs),
                            curves=[r["losses"] for r in runs])
        print(f"   {name:40s} final train {losses[name]['final_train']:.4f}  held-out "
              f"{losses[name]['held_out']:.4f}  ({losses[name]['seconds']:.0f} s/run)", flush=True)
    ref = losses["torch AdamW (fp32)"]
    print("   relative to fp32 AdamW (final train / held-out):")
    for name, r in losses.items():
        print(f"   {name:40s} {r['final_train'] / ref['final_train'] - 1:+.2%} / "
              f"{r['held_out'] / ref['held_out'] - 1:+.2%}")
    out = dict(args=vars(args), step_times=times, losses=losses)
    with open(os.path.join(OUT_DIR, "adamw8bit_vs_peers.json"), "w") as f:
        json.dump(out, f)
    return out


if __name__ == "__main__":
    main()
