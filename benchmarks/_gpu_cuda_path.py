"""The CUDA-path rows of ``python -m benchmarks.gpu_check`` (issue 28).

Each function runs on every rank of the check's world, takes the device, and returns one row
(``gpu_check._row``). They exercise what a world of one GPU never reaches through the local
shortcut or what only streams can show: offload with gradient accumulation, a CPU-built model
sharded on the GPU, ``set_post_optim_event`` from a side stream, fp16 with ``ShardedGradScaler``
and offload, and, with 2+ GPUs, reduce-scatter/GEMM overlap in a profiler trace and HSDP meshes.
Device-agnostic where the feature exists on the CPU, so ``tests/unit/test_gpu_check.py`` runs
them on gloo too; the stream and NCCL ones return ``SKIP`` there.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


def _g() -> Any:
    from benchmarks import gpu_check  # imported here: gpu_check imports this module

    return gpu_check


def _step_losses(model, device, steps: int, *, sharded: bool, accumulate: int = 1,
                 opt_cls=torch.optim.AdamW, after_step=None) -> list[float]:
    """Train ``steps`` steps of ``accumulate`` synced backwards each (the batches differ)."""
    g = _g()
    opt = opt_cls(model.parameters(), lr=1e-3)
    world = dist.get_world_size()
    data = g._batches(steps * accumulate, 2 * world, g.SMALL["block_size"],
                      g.SMALL["vocab_size"])
    losses = []
    for i, (x, y) in enumerate(data):
        if sharded:
            x, y = g._micro(x), g._micro(y)
        loss = model(x.to(device), y.to(device)) / accumulate
        loss.backward()
        value = loss.detach().float().clone()
        if sharded:
            dist.all_reduce(value)
            value /= world
        losses.append(value.item())
        if (i + 1) % accumulate == 0:
            if after_step is None:
                opt.step()
                opt.zero_grad(set_to_none=False)
            else:
                after_step(model, opt)
    return losses


def check_offload_accumulate(device: torch.device, steps: int = 3,
                             tol: float = 1e-5) -> dict[str, Any]:
    """CPU offload with two synced backwards per step and kept (zeroed) gradients: the reduced
    shard is added on the host (a device mismatch on CUDA before issue 28); then a full state
    dict, whose gathers of CPU shards go through the GPU on NCCL."""
    from lightning_vescale.checkpoint._state_dicts import model_state
    from lightning_vescale.fsdp import CPUOffloadPolicy

    g = _g()
    name = "CPU offload + gradient accumulation + full state dict"
    ref_model = g._small(device)
    ref = _step_losses(ref_model, device, steps, sharded=False, accumulate=2)
    model = g._shard(g._small(device), "vescale", device, offload_policy=CPUOffloadPolicy())
    got = _step_losses(model, device, steps, sharded=True, accumulate=2)
    d = g._rel(got, ref)
    on_cpu = all(p.to_local().device.type == "cpu" for p in model.parameters())
    full = model_state(model, full=True)  # a collective: every rank; rank 0 gets the tensors
    want = {k: v.detach().float().cpu() for k, v in ref_model.state_dict().items()}
    sd_diff = max((float((full[k].float() - want[k]).abs().max()) for k in full), default=0.0)
    ok = d <= tol and on_cpu and sd_diff <= 1e-4
    return g._row(name, PASS if ok else FAIL, f"max relative loss difference {d:.2e} vs single "
                  f"device (tolerance {tol:g}); shards on the CPU: {on_cpu}; full state dict "
                  f"vs single device: max abs difference {sd_diff:.1e}", max_rel=d)


def check_cpu_built(device: torch.device, steps: int = 3, tol: float = 1e-5) -> dict[str, Any]:
    """A model built on the CPU, then ``fully_shard`` without a mesh: the default mesh comes
    from the backend, and the shards and buffers live on the GPU (before: a CPU mesh over NCCL,
    or silent CPU training at world 1)."""
    g = _g()
    name = "CPU-built model + fully_shard"
    ref = _step_losses(g._small(device), device, steps, sharded=False)
    model = g._shard(g._small(torch.device("cpu")), "vescale", device)
    where = {p.to_local().device.type for p in model.parameters()}
    where |= {b.device.type for b in model.buffers()}
    mesh = next(model.parameters()).device_mesh.device_type
    got = _step_losses(model, device, steps, sharded=True)
    d = g._rel(got, ref)
    ok = where == {device.type} and mesh == device.type and d <= tol
    return g._row(name, PASS if ok else FAIL, f"mesh {mesh}, tensors on {sorted(where)}, max "
                  f"relative loss difference {d:.2e} (tolerance {tol:g})", max_rel=d)


def check_post_optim_event(device: torch.device, steps: int = 3) -> dict[str, Any]:
    """The optimizer steps on a side stream behind a long sleep kernel; with the event given
    to ``set_post_optim_event`` the next all-gathers wait for it: losses equal to the plain
    run, bitwise (before: the all-gather could read the old shards)."""
    g = _g()
    name = "set_post_optim_event (side-stream optimizer)"
    if device.type != "cuda":
        return g._row(name, SKIP, "needs CUDA streams")
    side = torch.cuda.Stream(device)

    def on_side(model, opt) -> None:
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # ~0.1 s: the forward would overtake the step
            opt.step()
            opt.zero_grad(set_to_none=False)
        model.set_post_optim_event(side.record_event())

    plain = _step_losses(g._shard(g._small(device), "vescale", device), device, steps,
                         sharded=True)
    got = _step_losses(g._shard(g._small(device), "vescale", device), device, steps,
                       sharded=True, after_step=on_side)
    torch.cuda.current_stream(device).wait_stream(side)
    same = got == plain
    return g._row(name, PASS if same else FAIL, "losses bitwise equal to the current-stream "
                  "run" if same else f"differ: {g._rel(got, plain):.2e}")


def check_fp16_scaler_offload(device: torch.device, steps: int = 3,
                              tol: float = 5e-2) -> dict[str, Any]:
    """fp16 parameters and reduction (pre/post divide factors), ``ShardedGradScaler`` and our
    ``clip_grad_norm_`` on CPU-offloaded gradients (their all-reduces go through the device
    on NCCL) against fp32 single-device training."""
    from lightning_vescale.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
    from lightning_vescale.precision import ShardedGradScaler, clip_grad_norm_

    g = _g()
    name = "fp16 + ShardedGradScaler + offload"
    ref = _step_losses(g._small(device), device, steps, sharded=False)
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16)
    model = g._shard(g._small(device), "vescale", device, mp_policy=policy,
                     offload_policy=CPUOffloadPolicy())
    scaler = ShardedGradScaler(device.type, init_scale=2.0**10)
    norms: list[float] = []

    def step(model, opt) -> None:
        scaler.unscale_(opt)
        norms.append(float(clip_grad_norm_(model.parameters(), 1.0)))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    losses = []
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = g._batches(steps, 2 * dist.get_world_size(), g.SMALL["block_size"],
                      g.SMALL["vocab_size"])
    for x, y in data:
        loss = model(g._micro(x).to(device), g._micro(y).to(device))
        scaler.scale(loss).backward()
        step(model, opt)
        value = loss.detach().float().clone()
        dist.all_reduce(value)
        losses.append(value.item() / dist.get_world_size())
    d = g._rel(losses, ref)
    ok = all(math.isfinite(v) for v in losses + norms) and d <= tol
    return g._row(name, PASS if ok else FAIL, f"max relative loss difference {d:.2e} vs fp32 "
                  f"single device (tolerance {tol:g}); scale {scaler.get_scale():g}; gradient "
                  f"norms finite: {all(math.isfinite(v) for v in norms)}", max_rel=d)


def _kernels(prof) -> list[tuple[str, float, float]]:
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out.append((e.name, e.time_range.start, e.time_range.end))
    return out


def check_overlap(device: torch.device) -> dict[str, Any]:
    """With 2+ GPUs: in a profiled backward of a larger GPT (bf16), some reduce-scatter kernel
    runs while a GEMM runs (the asynchronous reduce-scatter overlaps backward compute)."""
    from lightning_vescale.fsdp import MixedPrecisionPolicy
    from examples.gpt import GPT, GPTConfig

    g = _g()
    name = "reduce-scatter overlaps backward GEMMs"
    if device.type != "cuda" or dist.get_world_size() < 2:
        return g._row(name, SKIP, "needs 2+ CUDA devices")
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=65, block_size=512, n_layer=6, n_head=8, n_embd=1024)
    model = g._shard(GPT(cfg).to(device), "vescale", device, mp_policy=MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    x = torch.randint(0, 65, (4, 512), device=device)
    for _ in range(2):  # warm-up (records the orders, prefetching from the second)
        model(x, x).backward()
    torch.cuda.synchronize(device)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model(x, x).backward()
        torch.cuda.synchronize(device)
    ks = _kernels(prof)
    rs = [k for k in ks if "reducescatter" in k[0].lower().replace("_", "")]
    mm = [k for k in ks if any(w in k[0].lower() for w in ("gemm", "nvjet", "cutlass", "xmma"))]
    hits = sum(1 for r in rs if any(m[1] < r[2] and r[1] < m[2] for m in mm))
    ok = hits > 0
    return g._row(name, PASS if ok else FAIL, f"{hits} of {len(rs)} reduce-scatter kernels "
                  f"overlap one of {len(mm)} GEMM kernels", overlapping=hits)


def check_hsdp(device: torch.device, steps: int = 3, tol: float = 1e-5,
               wire_tol: float = 2e-2) -> dict[str, Any]:
    """With 2+ GPUs: HSDP on a (1, N) and an (N/2, 2) mesh ((2, 1) at N=2) against single-device
    training (the replica all-reduce on its side stream; gloo in the CPU test), and the second
    mesh again with bf16 gradients on the wire (``reduce_scatter_dtype``: the whole replica
    stage on the side stream, issue 35) within ``wire_tol``."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_vescale import CommPolicy

    g = _g()
    name = "HSDP meshes vs single device"
    n = dist.get_world_size()
    if n < 2:
        return g._row(name, SKIP, "needs 2+ devices")
    shapes = [(1, n), (n // 2, 2) if n >= 4 and n % 2 == 0 else (n, 1)]
    ref = _step_losses(g._small(device), device, steps, sharded=False)
    parts, worst = [], 0.0
    for shape in shapes:
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=("dp_replicate", "dp_shard"))
        got = _step_losses(g._shard(g._small(device), "vescale", device, mesh=mesh), device,
                           steps, sharded=True)
        d = g._rel(got, ref)
        worst = max(worst, d)
        parts.append(f"{shape}: {d:.2e}")
    wire = _step_losses(g._shard(g._small(device), "vescale", device, mesh=mesh,
                                 comm_policy=CommPolicy(reduce_scatter_dtype="bf16")),
                        device, steps, sharded=True)
    d_wire = g._rel(wire, ref)
    ok = worst <= tol and d_wire <= wire_tol
    return g._row(name, PASS if ok else FAIL, f"max relative loss difference "
                  f"{'; '.join(parts)} (tolerance {tol:g}); {shapes[-1]} bf16 wire: "
                  f"{d_wire:.2e} (tolerance {wire_tol:g})", max_rel=worst, wire_rel=d_wire)


CHECKS = (check_offload_accumulate, check_cpu_built, check_post_optim_event,
          check_fp16_scaler_offload, check_overlap, check_hsdp)
