"""Trainer step time: ``strategy="vescale_fsdp"`` against ``strategy="ddp"`` at 2 ranks.

The same LightningModule and data through ``Trainer(strategy="vescale_fsdp")`` and
``Trainer(strategy="ddp")``, each with Lightning's default launcher (the script is re-run per
rank) and ``OMP_NUM_THREADS`` NOT exported (what a user gets by default; ``--keep-omp`` keeps the
caller's environment): every rank's thread count is what the launcher gives it, which is what
issue 33's oversubscription was about (ours used to leave all cores to every rank but 0: 2.5-33x
slower steps). Models (tiny configs, built from a config, no download):

* ``llama``: transformers ``LlamaForCausalLM``; ``gpt2``: ``GPT2LMHeadModel``; ``mixtral``:
  ``MixtralForCausalLM`` (4 experts, top 2);
* ``litgpt`` (when litgpt imports): litgpt's ``GPT`` under Fabric, ``VeScaleFabricStrategy``
  against Fabric's ``"ddp"``.

A step is ``on_train_batch_start`` to ``on_train_batch_end`` on rank 0 (forward, backward,
optimizer step); a run's figure is the median of its steps after ``--warmup``; the reported
figure is the median over ``--runs`` fresh commands (DDP and ours alternate, so both see the
same load). Each row also gives the runs' last losses (equal when ours computes DDP's floats)
and every rank's ``torch.get_num_threads()``. The load average is printed before and after.
``--one-group``: ours with ``sharding_units=[]`` (the whole model one sharding group: one
all-gather and one reduce-scatter per step instead of one per block, at the memory cost of
gathering every parameter at once; on gloo the default schedule now makes as few rendezvous
for models this small). ``--unfused``: ours with every gloo collective leaving on its own and
FSDP2's schedule (design notes [gloo-fused-exchange], [fsdp-gloo-fusion] off), for a
before/after on the same machine.

Run:  python -m benchmarks.trainer_vs_ddp [--models llama,gpt2,mixtral,litgpt] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("llama", "gpt2", "mixtral", "litgpt")


# ------------------------------------------------------------------------------------------------
# Worker: one training run (re-run per rank by Lightning's launcher)
# ------------------------------------------------------------------------------------------------
def _hf_model(name: str, a: argparse.Namespace) -> Any:
    import transformers as tf

    common = dict(vocab_size=a.vocab, num_hidden_layers=a.layers, num_attention_heads=4,
                  hidden_size=a.hidden, intermediate_size=2 * a.hidden,
                  max_position_embeddings=a.seq)
    if name == "llama":
        return tf.LlamaForCausalLM(tf.LlamaConfig(num_key_value_heads=2, **common))
    if name == "mixtral":
        return tf.MixtralForCausalLM(tf.MixtralConfig(num_key_value_heads=2, num_local_experts=4,
                                                      num_experts_per_tok=2, **common))
    if name == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=a.vocab, n_positions=a.seq,
                                                n_embd=a.hidden, n_layer=a.layers, n_head=4))
    raise ValueError(f"--models: unknown model {name!r}; choose from {MODELS}")


def _tokens(a: argparse.Namespace, world: int) -> Any:
    import torch

    n = world * a.batch * (a.warmup + a.steps)
    return torch.randint(0, a.vocab, (n, a.seq), generator=torch.Generator().manual_seed(0))


def _report(out: Path, rank: int, times: list[float], loss: float, a: argparse.Namespace,
            model: Any) -> None:
    import torch

    from lightning_vescale.fsdp import VeScaleFSDPModule

    (out / f"rank{rank}.json").write_text(json.dumps({
        "threads": torch.get_num_threads(), "omp": os.environ.get("OMP_NUM_THREADS"),
        "step_ms": 1e3 * statistics.median(times[a.warmup:]) if rank == 0 else None,
        "loss": loss,
        "groups": sum(isinstance(m, VeScaleFSDPModule) for m in model.modules())}))


#: ``--profile``: where rank 0's step time goes, by the file (or builtin) that spent it (cProfile
#: self time). First match wins; builtins (C functions) are classified by their name.
CATEGORIES = (
    ("collectives (waits + calls)", ("distributed_c10d", "torch/distributed/distributed_c10d",
                                     "c10d", "Work", "ProcessGroup")),
    ("engine (lightning_vescale fsdp/dbuffer/placement)",
     ("lightning_vescale/fsdp", "lightning_vescale/dbuffer", "lightning_vescale/_dbuffer",
      "lightning_vescale/placement", "lightning_vescale/_labels", "lightning_vescale/mesh")),
    ("strategy (lightning_vescale strategy, precision, optim)", ("lightning_vescale/",)),
    ("DDP wrapper (torch/nn/parallel)", ("torch/nn/parallel",)),
    ("Lightning loop + hooks", ("lightning/", "lightning_utilities")),
    ("optimizer (torch/optim)", ("torch/optim",)),
    ("DTensor dispatch (torch/distributed/tensor)", ("torch/distributed/tensor", "_dtensor")),
    ("model Python (transformers, torch.nn)", ("transformers/", "torch/nn/")),
)


def _category(filename: str, name: str) -> str:
    key = filename if filename != "~" else name
    for cat, needles in CATEGORIES:
        if any(n in key for n in needles):
            return cat
    return "operators + other (aten kernels, autograd engine, Python builtins)"


def _profile_breakdown(stats: Any, steps: int) -> dict[str, float]:
    """Self time per category, ms per step, from a ``pstats.Stats``."""
    out: dict[str, float] = {}
    for (filename, _, name), (_, _, tottime, _, _) in stats.stats.items():
        cat = _category(filename, name)
        out[cat] = out.get(cat, 0.0) + 1e3 * tottime / steps
    return out


def _trainer_worker(a: argparse.Namespace, out: Path) -> None:
    import lightning.pytorch as pl
    import torch

    import lightning_vescale  # noqa: F401  (registers strategy="vescale_fsdp")

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _hf_model(a.model, a)
            self.times: list[float] = []
            self.loss = float("nan")

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            (x,) = batch
            loss = self.model(input_ids=x, labels=x).loss
            self.loss = loss.item()
            return loss

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if profiler is not None and batch_idx >= a.warmup:
                profiler.enable()
            self._start = time.perf_counter()

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.times.append(time.perf_counter() - self._start)
            if profiler is not None:
                profiler.disable()

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    import cProfile

    profiler = cProfile.Profile() if a.profile else None
    pl.seed_everything(0, verbose=False)
    module = Module()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(_tokens(a, 2)),
                                       batch_size=a.batch)
    strategy: Any = a.strategy
    if a.strategy == "vescale_fsdp" and a.one_group:
        from lightning_vescale import VeScaleFSDPStrategy

        strategy = VeScaleFSDPStrategy(sharding_units=[])
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2,
                         max_steps=a.warmup + a.steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    with _fusion(a):
        trainer.fit(module, data)
    _report(out, trainer.global_rank, module.times, module.loss, a, module)
    if profiler is not None and trainer.global_rank == 0:
        import pstats

        with (out / "profile.txt").open("w") as f:
            stats = pstats.Stats(profiler, stream=f)
            stats.sort_stats("tottime").print_stats(40)
        (out / "profile.json").write_text(json.dumps(_profile_breakdown(stats, a.steps)))


def _fusion(a: argparse.Namespace) -> Any:
    """``--unfused``: every gloo collective of ours leaves on its own (design note
    [gloo-fused-exchange] off) and FSDP2's schedule ([fsdp-gloo-fusion] off)."""
    import contextlib

    from lightning_vescale._gloo_exchange import unfused

    return unfused() if a.unfused else contextlib.nullcontext()


def _fabric_worker(a: argparse.Namespace, out: Path) -> None:
    import torch
    from lightning.fabric import Fabric
    from litgpt import GPT, Config

    from lightning_vescale import VeScaleFabricStrategy

    units = {"sharding_units": []} if a.one_group else {}
    strategy = VeScaleFabricStrategy(**units) if a.strategy == "vescale_fsdp" else a.strategy
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    fabric.seed_everything(0)
    config = Config(n_layer=a.layers, n_head=4, n_embd=a.hidden, block_size=a.seq,
                    vocab_size=a.vocab, padded_vocab_size=a.vocab)
    model = fabric.setup_module(GPT(config))
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    tokens = _tokens(a, fabric.world_size).view(-1, fabric.world_size, a.batch, a.seq)
    times, loss = [], float("nan")
    with _fusion(a):
        for step in tokens:
            x = step[fabric.global_rank]
            start = time.perf_counter()
            logits = model(x)
            value = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                                      x[:, 1:].flatten())
            fabric.backward(value)
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - start)
            loss = value.item()
    _report(out, fabric.global_rank, times, loss, a, model)


# ------------------------------------------------------------------------------------------------
# Driver
# ------------------------------------------------------------------------------------------------
def _once(a: argparse.Namespace, model: str, strategy: str, out: Path) -> list[dict]:
    out.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR")}
    if not a.keep_omp:
        env.pop("OMP_NUM_THREADS", None)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    argv = [sys.executable, "-m", "benchmarks.trainer_vs_ddp", "--worker", str(out),
            "--model", model, "--strategy", strategy, "--steps", str(a.steps),
            "--warmup", str(a.warmup), "--hidden", str(a.hidden), "--layers", str(a.layers),
            "--vocab", str(a.vocab), "--seq", str(a.seq), "--batch", str(a.batch)]
    if a.profile:
        argv.append("--profile")
    if a.one_group:
        argv.append("--one-group")
    if a.unfused:
        argv.append("--unfused")
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=a.timeout)
    records = [out / f"rank{r}.json" for r in range(2)]
    # Lightning's DDP launcher leaves its process group to the interpreter's finalisation, and
    # a gloo rank may then abort at exit (tests/lightning/test_thread_counts.py): the reference
    # run's timings are whole once every rank wrote its record. Ours get no such allowance.
    exit_abort = (strategy != "vescale_fsdp" and all(r.is_file() for r in records)
                  and "terminate called without an active exception" in proc.stderr)
    if proc.returncode != 0 and not exit_abort:
        raise RuntimeError(f"{model} {strategy} failed:\n"
                           f"{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    return [json.loads(r.read_text()) for r in records]


def _profile_main(a: argparse.Namespace) -> None:
    """``--profile``: one run per side per Trainer model; per category, ms/step DDP vs ours."""
    import tempfile

    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for model in [m for m in a.models.split(",") if m and m != "litgpt"]:
            got = {}
            for strategy in ("ddp", "vescale_fsdp"):
                out = Path(tmp) / f"{model}_{strategy}"
                ranks = _once(a, model, strategy, out)
                got[strategy] = (ranks[0]["step_ms"],
                                 json.loads((out / "profile.json").read_text()))
                if a.keep_profiles:
                    print((out / "profile.txt").read_text())
            print(f"\n{model}: rank 0, cProfile self time, ms/step (step median under the "
                  f"profiler: DDP {got['ddp'][0]:.1f}, ours {got['vescale_fsdp'][0]:.1f})")
            print("| category | DDP | ours | ours - DDP |\n| --- | ---: | ---: | ---: |")
            cats = sorted(set(got["ddp"][1]) | set(got["vescale_fsdp"][1]),
                          key=lambda c: -got["vescale_fsdp"][1].get(c, 0.0))
            for cat in cats:
                d, v = got["ddp"][1].get(cat, 0.0), got["vescale_fsdp"][1].get(cat, 0.0)
                print(f"| {cat} | {d:.2f} | {v:.2f} | {v - d:+.2f} |", flush=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def _available(model: str) -> bool:
    import importlib.util

    return importlib.util.find_spec("litgpt" if model == "litgpt" else "transformers") is not None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--runs", type=int, default=3, help="fresh commands per side (median)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3, help="untimed first steps per run")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=4, help="per rank")
    p.add_argument("--keep-omp", action="store_true",
                   help="keep OMP_NUM_THREADS from this environment (default: not exported)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per command")
    p.add_argument("--one-group", action="store_true",
                   help="ours with sharding_units=[]: the whole model one sharding group")
    p.add_argument("--unfused", action="store_true",
                   help="ours without the fused gloo exchange (design note "
                        "[gloo-fused-exchange]): one rendezvous per collective")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--strategy", help=argparse.SUPPRESS)
    p.add_argument("--keep-profiles", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--profile", action="store_true",
                   help="one run per side (Trainer models): rank 0's step time by category "
                        "(cProfile self time, ms/step; the profiler slows Python, both sides)")
    a = p.parse_args(argv)
    if a.worker:
        (_fabric_worker if a.model == "litgpt" else _trainer_worker)(a, Path(a.worker))
        return
    if a.profile:
        _profile_main(a)
        return

    import tempfile

    models = [m for m in a.models.split(",") if m]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        p.error(f"--models: unknown {unknown}; choose from {list(MODELS)}")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    print(f"OMP_NUM_THREADS: {os.environ.get('OMP_NUM_THREADS') if a.keep_omp else 'unset'}; "
          f"{a.runs} runs x {a.steps} steps (+{a.warmup} warm-up), 2 ranks, "
          f"batch {a.batch}x{a.seq}" + ("; ours: one sharding group" if a.one_group else "")
          + ("; ours: unfused gloo collectives" if a.unfused else ""))
    print("| model | DDP ms/step | ours ms/step | ours / DDP | last loss DDP / ours "
          "| threads per rank DDP / ours |")
    print("| --- | ---: | ---: | ---: | --- | --- |")
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            if not _available(model):
                print(f"| {model} | (not installed: skipped) | | | | |", flush=True)
                continue
            sides: dict[str, list[list[dict]]] = {"ddp": [], "vescale_fsdp": []}
            for run in range(a.runs):
                for strategy in sides:
                    sides[strategy].append(_once(a, model, strategy,
                                                 Path(tmp) / f"{model}_{strategy}_{run}"))
            ms = {s: statistics.median(r[0]["step_ms"] for r in runs) for s, runs in sides.items()}
            loss = {s: runs[-1][0]["loss"] for s, runs in sides.items()}
            threads = {s: "/".join(str(rank["threads"]) for rank in runs[-1])
                       for s, runs in sides.items()}
            name = f"{model} (Fabric)" if model == "litgpt" else model
            groups = sides["vescale_fsdp"][-1][0]["groups"]
            name += f", ours in {groups} group{'s' if groups != 1 else ''}"
            print(f"| {name} | {ms['ddp']:.1f} | {ms['vescale_fsdp']:.1f} | "
                  f"{ms['vescale_fsdp'] / ms['ddp']:.2f}x | {loss['ddp']:.6f} / "
                  f"{loss['vescale_fsdp']:.6f} | {threads['ddp']} / {threads['vescale_fsdp']} |",
                  flush=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
