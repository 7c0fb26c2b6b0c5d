"""Loading a Hugging Face checkpoint: time and peak host memory per rank.

A random Llama (default ~110M parameters: 12 layers, width 768, MLP 2048, vocab 16000, fp32,
written by ``save_pretrained`` in 200 MB shards) is loaded by, each rank a fresh process:

* ``plain``: the naive single-process way, ``safetensors.torch.load_file`` of every shard, then
  ``model.load_state_dict`` into a model built normally (world 1 only);
* ``ours``: the model built on meta, ``fully_shard`` per decoder layer + root, then
  ``lightning_vescale.checkpoint.load_safetensors`` (storage allocation included in the time);
* ``init_then_load``: as ``ours``, but the shards are first initialised (``materialize``: every
  ``reset_parameters()``, group by group), as the strategies did before a strict
  ``pretrained_weights`` load skipped it (design note [pretrained-weights]);
* ``dcp_hf``: the same sharded model, storage allocated, then torch's distributed checkpoint
  ``dcp.load(model.state_dict(), storage_reader=HuggingFaceStorageReader(dir))``;
* ``naive_sharded``: the same sharded model, every rank ``load_file``-s the whole checkpoint
  and ``load_state_dict``-s it (our full-state-dict path cuts each tensor to the rank's range).

Phases, each timed (wall clock; the slowest rank of a run, the best of ``--repeats`` runs):
*build* makes the storage the rank will hold (plain: ``LlamaForCausalLM(config)``, the whole model
initialised as ``transformers`` does; the others: meta, ``fully_shard``, each rank's shards
allocated, first touch of the pages included) and *load* fills it from the checkpoint.
Memory: ``/proc/self/clear_refs`` (5) resets the high-water mark after the imports; ``VmHWM``
after the load is the peak RSS of build + load, reported minus the RSS before the build (the
~0.4 GB torch + transformers runtime), i.e. what the model and its loading cost. The shards are read once before the runs (page
cache warm for every method). ``--fake-world N --rank r`` runs one rank of an ``N``-rank layout in
one process (torch's fake process group: no peers, no collectives; ``load_safetensors`` needs
none), to measure a rank's memory for a model many times larger than its shard on two cores.

Run from the repository root (results: ``benchmarks/RESULTS_hf.md``)::

    python -m benchmarks.hf_load                      # ~110M params: world 1 and 2, fake world 8
    python -m benchmarks.hf_load --layers 2 --hidden 256 --vocab 4000 --repeats 1   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def _config(args: argparse.Namespace):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                       intermediate_size=args.mlp, num_hidden_layers=args.layers,
                       num_attention_heads=12 if args.hidden % 12 == 0 else 8,
                       num_key_value_heads=4, max_position_embeddings=512)


def make_checkpoint(args: argparse.Namespace) -> Path:
    """The benchmark checkpoint (written once; reused while the shape arguments are the same)."""
    import torch
    from transformers import LlamaForCausalLM

    out = Path(args.dir) / f"llama_l{args.layers}_h{args.hidden}_v{args.vocab}"
    if not (out / "model.safetensors.index.json").exists():
        torch.manual_seed(0)
        LlamaForCausalLM(_config(args)).save_pretrained(out, max_shard_size="200MB")
    return out


def _shard(model, mesh):
    from lightning_vescale.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _load_plain(model, ckpt: Path) -> None:
    from safetensors.torch import load_file

    sd = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        sd.update(load_file(f))
    model.load_state_dict(sd, strict=False)


def _load_dcp(model, ckpt: Path) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    alone = dist.get_backend() == "fake"  # DCP plans with collectives: one rank plans alone
    dcp.load(model.state_dict(), storage_reader=dcp.HuggingFaceStorageReader(str(ckpt)),
             no_dist=alone)


def _build(args: argparse.Namespace):
    """The model with storage for what this rank holds (plain: the whole model, initialised as
    ``transformers`` does; sharded: built on meta, sharded, each rank's shards allocated)."""
    import torch
    from transformers import LlamaForCausalLM

    from lightning_vescale._meta_buffers import allocate
    from lightning_vescale.fsdp import materialize
    from lightning_vescale.mesh import init_mesh

    if args.method == "plain":
        return LlamaForCausalLM(_config(args))
    with torch.device("meta"):
        model = LlamaForCausalLM(_config(args))
    if args.method == "init_then_load":
        return materialize(_shard(model, init_mesh("cpu")), torch.device("cpu"))
    return allocate(_shard(model, init_mesh("cpu")), torch.device("cpu"))


def rank_main(args: argparse.Namespace) -> dict:
    """One rank: the build phase, then the load phase, each timed; the peak RSS over both."""
    import safetensors.torch  # noqa: F401  (every import before the baseline: runtime, not model)
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401

    import lightning_vescale.fsdp  # noqa: F401
    from lightning_vescale.checkpoint import load_safetensors

    torch.set_num_threads(1)
    if args.method != "plain" and args.fake_world:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=args.rank,
                                world_size=args.fake_world)
    elif args.method != "plain":
        dist.init_process_group("gloo")
    base = _status("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    model = _build(args)
    t1 = time.perf_counter()
    load = {"plain": _load_plain, "naive_sharded": _load_plain, "dcp_hf": _load_dcp,
            "ours": lambda m, c: load_safetensors(m, c),
            "init_then_load": lambda m, c: load_safetensors(m, c)}[args.method]
    load(model, Path(args.ckpt))
    t2 = time.perf_counter()
    return {"method": args.method, "rank": int(os.environ.get("RANK", args.rank)),
            "build": t1 - t0, "seconds": t2 - t1, "peak_minus_base": _status("VmHWM") - base,
            "params": sum(p.numel() for p in model.parameters())}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shape_args(args: argparse.Namespace) -> list[str]:
    return ["--layers", str(args.layers), "--hidden", str(args.hidden), "--mlp", str(args.mlp),
            "--vocab", str(args.vocab)]


def launch(args: argparse.Namespace, ckpt: Path, method: str, world: int,
           fake_rank: int | None = None) -> list[dict]:
    """``world`` fresh processes (or one rank of a fake world), each printing its result."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world),
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "benchmarks.hf_load", "--worker", "--method", method,
           "--ckpt", str(ckpt), *_shape_args(args)]
    ranks = [fake_rank] if fake_rank is not None else list(range(world))
    procs = []
    for r in ranks:
        extra = ["--fake-world", str(world), "--rank", str(r)] if fake_rank is not None else []
        procs.append(subprocess.Popen(cmd + extra, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                                      cwd=ROOT, stdout=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=900)
        results = [json.loads(line[7:]) for line in stdout.splitlines()
                   if line.startswith("RESULT ")]
        if not results:  # (an exit-time gloo abort after the result was printed is harmless)
            raise RuntimeError(f"{method} world {world}: a rank failed ({p.returncode})")
        out += results
    return out


def _runs(args: argparse.Namespace) -> list[tuple[str, int, int | None]]:
    """(method, world, fake rank) of every measurement."""
    runs = [("plain", 1, None)]
    for world in (1, 2):
        runs += [("ours", world, None), ("init_then_load", world, None),
                 ("dcp_hf", world, None)]
    runs.append(("naive_sharded", 2, None))
    if args.fake_world:
        for method in ("ours", "dcp_hf", "naive_sharded"):
            runs += [(method, args.fake_world, 0), (method, args.fake_world, args.fake_world - 1)]
    if args.only:  # e.g. "ours:2,dcp_hf:2": rerun some rows
        wanted = {tuple(item.split(":")) for item in args.only.split(",")}
        runs = [r for r in runs if (r[0], str(r[1])) in wanted]
    return runs


def _row(method: str, world: int, fake: int | None, results: list[dict]) -> str:
    build = min(r["build"] for r in results)  # best of the repeats (slowest rank of each run)
    secs = min(r["seconds"] for r in results)
    peak = max(r["peak_minus_base"] for r in results)
    where = f"rank {fake} of {world} (fake group)" if fake is not None else f"world {world}"
    return (f"| {method} | {where} | {build:.2f} s | {secs:.2f} s | {build + secs:.2f} s | "
            f"{peak / 2**20:,.0f} MiB |")


def driver(args: argparse.Namespace) -> None:
    ckpt = make_checkpoint(args)
    size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    for f in ckpt.glob("*.safetensors"):
        f.read_bytes()  # page cache warm for every method
    print(f"checkpoint {ckpt}: {size / 2**20:,.0f} MiB")
    print("| method | ranks | build | load | build + load | peak RSS over the runtime, max "
          "rank |")
    print("| --- | --- | --- | --- | --- | --- |")
    totals: dict[tuple[str, int], float] = {}  # (method, world) -> best build + load (real ranks)
    for method, world, fake in _runs(args):
        results = []
        for _ in range(args.repeats):
            run = launch(args, ckpt, method, world, fake)
            results.append({"build": max(r["build"] for r in run),
                            "seconds": max(r["seconds"] for r in run),
                            "peak_minus_base": max(r["peak_minus_base"] for r in run),
                            "params": run[0]["params"]})
        print(_row(method, world, fake, results), flush=True)
        if fake is None:
            totals[(method, world)] = min(r["build"] + r["seconds"] for r in results)
    print(f"parameters: {results[0]['params']:,}")
    for (method, world), t in totals.items():  # each baseline against ours, same world
        if method != "ours" and ("ours", world) in totals:
            print(f"build + load, {method} / ours at world {world}: "
                  f"{t / totals[('ours', world)]:.2f}x")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--mlp", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=16000)
    p.add_argument("--dir", default=str(ROOT / "benchmarks" / "out"))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--fake-world", type=int, default=8)
    p.add_argument("--only", help="run only these METHOD:WORLD rows, e.g. 'ours:2,dcp_hf:2'")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--method", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        if "--fake-world" not in (argv or sys.argv):
            args.fake_world = 0
        print("RESULT " + json.dumps(rank_main(args)), flush=True)
        import torch.distributed as dist

        if dist.is_initialized():  # leave together (gloo aborts a rank whose peer left first)
            if dist.get_backend() == "gloo":
                dist.barrier()
            dist.destroy_process_group()
        return
    driver(args)


if __name__ == "__main__":
    main()
