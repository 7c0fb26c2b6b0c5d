"""A MODEL (not a measurement) of per-step communication time: full sharding vs HSDP, ours vs FSDP2.

For a LLaMA-3-70B-shaped model (80 blocks, hidden 8192, FFN 28672, 64 heads / 8 KV heads, vocab
128256; one sharding group per block plus the root, as the strategies shard it) on 8 to 1,024
nodes of 8 GPUs, project the time one training step spends in collectives and in the copies
around them, for two layouts:

* full sharding: one shard group of all ``8 * nodes`` GPUs (it spans nodes);
* HSDP: shard inside a node (8 GPUs), replicate across nodes (all-reduce of the gradient shard
  over ``nodes`` ranks, one per node, each GPU on its own NIC: rail-aligned).

Per-rank sizes are not estimated: ours are the planner's (``plan_layout`` of every group's real
parameter shapes at the shard group's size, with the strategies' default granularity policy:
tensors of 4,096+ elements in 256-element blocks, :class:`ShardGranularity`); FSDP2's are its
``torch.chunk`` dim-0 layout (each tensor's dim 0 padded to a multiple of the shard size,
:func:`fsdp2_even_rowwise`). Padding is therefore what each engine really sends.

The model (stated in the printed header, overridable on the command line):

* ring all-gather / reduce-scatter over ``n`` ranks of a ``B``-byte full buffer:
  ``(n-1)/n * B / bw + (n-1) * latency``; ring all-reduce of ``B`` bytes:
  ``2 (n-1)/n * B / bw + 2 (n-1) * latency``;
* a ring inside a node runs at the NVLink figures, a ring that spans nodes at the inter-node
  figures (its slowest hop; with one NIC per GPU the 8 rails run 8 rings in parallel, so the
  per-GPU NIC bandwidth is the ring's bandwidth);
* dtypes: fp32 master parameters, bf16 all-gather/compute (``param_dtype``), fp32 reduce
  (``reduce_dtype``), so all-gathers move 2 bytes per element and reduce-scatters/all-reduces 4;
* one step: every block all-gathers twice (forward, and again in backward: resharded after
  forward) and reduce-scatters once; the root all-gathers once (kept for backward, both
  engines' default) and reduce-scatters once; ours also keeps the last block's parameters
  into backward (the engine's ``reshard_after_forward=None`` rule: one all-gather less per
  step) and all-reduces (MAX) one byte per parameter over all data-parallel ranks ("received a
  gradient" flags, one latency-bound collective, modelled as a binary tree:
  ``2 ceil(log2 n)`` latency steps); under HSDP every group all-reduces its fp32 gradient shard
  across the replicas (a ring);
* copies at an HBM bandwidth (bytes read + bytes written). Both engines cast the fp32 shard to
  bf16 before each all-gather and the bf16 unsharded gradients to fp32 before each
  reduce-scatter (ours: one whole-buffer cast, ``DBuffer``; FSDP2: fused into its copy-in).
  FSDP2 also copies every all-gather's output out of the interleaved buffer into per-parameter
  tensors (``split_with_sizes_copy``); ours does not (parameters are views into the buffer);
* nothing overlaps: the figures are the communication + copy work per step, not the time it
  adds to a step (both engines overlap it with compute); no NCCL tree/PAT algorithms, SHARP,
  congestion or kernel launch costs.

With ``--quantized`` a second table adds ours with ``CommPolicy(all_gather="int8",
reduce_scatter_dtype=bf16)`` (issue 25): every tensor the policy quantizes (2+ dims, 4,096+
elements) all-gathers one byte per element plus an fp32 scale per 256, the rest bf16; gradients
travel in bf16 (reduce-scatter and HSDP all-reduce); copies add the quantize (read the fp32
shard, write codes) and the dequantize (read the codes, write bf16 parameters) instead of the
cast. ZeRO++'s published volumes (Wang et al. 2023: 3M -> 0.75M per step against ZeRO-3 in
fp16, i.e. qwZ int8 forward all-gather, hpZ intra-node backward all-gather, qgZ int4
gradients) are printed beside it for scale; they are the paper's figures, not modelled here.

Run from the repository root::

    python -m benchmarks.hsdp_network_model
    python -m benchmarks.hsdp_network_model --quantized --markdown
    python -m benchmarks.hsdp_network_model --inter-bw-gbs 25 --inter-latency-us 15

Results: ``benchmarks/RESULTS_hsdp.md``.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch

from lightning_vescale._lightning.sharding import (
    DEFAULT_MIN_BLOCK_NUMEL,
    DEFAULT_OPTIMIZER_BLOCK_SIZE,
    ShardGranularity,
)
from lightning_vescale.planner import (
    PRESETS,
    TransformerConfig,
    fsdp2_even_rowwise,
    plan_layout,
    transformer_groups,
)

__all__ = [
    "ENGINES", "LAYOUTS", "NODES", "Network", "GroupSizes", "StepComm", "group_sizes",
    "model_step", "model_table", "report",
]

ENGINES = ("ours", "fsdp2")
LAYOUTS = ("full", "hsdp")
NODES = (8, 16, 32, 64, 128, 256, 512, 1024)
MASTER_BYTES = 4  # fp32 sharded parameters
PARAM_BYTES = 2  # bf16 all-gather / unsharded parameters and gradients
REDUCE_BYTES = 4  # fp32 reduce-scatter / all-reduce


@dataclass(frozen=True, kw_only=True)
class Network:
    """Alpha-beta figures of a cluster (bandwidths in bytes/s per GPU, latencies in seconds)."""

    gpus_per_node: int = 8
    intra_bw: float = 450e9  # NVLink 4 (H100 SXM), per GPU, one direction
    intra_latency: float = 2e-6
    inter_bw: float = 50e9  # one 400 Gb/s NIC per GPU
    inter_latency: float = 10e-6
    hbm_bw: float = 3.0e12  # effective copy bandwidth (H100 SXM peak: 3.35 TB/s)

    def link(self, ranks: int, spans_nodes: bool) -> tuple[float, float]:
        """``(bandwidth, latency)`` of a ring of ``ranks`` ranks."""
        if spans_nodes:
            return self.inter_bw, self.inter_latency
        return self.intra_bw, self.intra_latency

    def describe(self) -> str:
        return (f"intra-node {self.intra_bw / 1e9:g} GB/s per GPU, {self.intra_latency * 1e6:g} us "
                f"per ring step; inter-node {self.inter_bw / 1e9:g} GB/s per GPU "
                f"({self.inter_bw * 8 / 1e9:g} Gb/s NIC per GPU), "
                f"{self.inter_latency * 1e6:g} us per ring step; HBM {self.hbm_bw / 1e9:g} GB/s "
                f"for copies (read + write); {self.gpus_per_node} GPUs per node")


def ring_all_gather_s(full_bytes: float, n: int, bw: float, latency: float) -> float:
    """Ring all-gather (or reduce-scatter) of a ``full_bytes`` buffer over ``n`` ranks."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * full_bytes / bw + (n - 1) * latency


ring_reduce_scatter_s = ring_all_gather_s


def ring_all_reduce_s(nbytes: float, n: int, bw: float, latency: float) -> float:
    """Ring all-reduce of ``nbytes`` over ``n`` ranks (a reduce-scatter then an all-gather)."""
    return 2 * ring_all_gather_s(nbytes, n, bw, latency)


def tree_all_reduce_s(nbytes: float, n: int, bw: float, latency: float) -> float:
    """Tree all-reduce of a small ``nbytes`` message over ``n`` ranks: a reduce up and a
    broadcast down a binary tree, ``2 ceil(log2 n)`` latency-bound steps (what NCCL picks for
    latency-bound messages; the bytes are negligible)."""
    if n <= 1:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * (latency + nbytes / bw)


# ------------------------------------------------------------------------------------------------
# per-rank sizes: the planner's for ours, torch.chunk's for FSDP2
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class GroupSizes:
    """One sharding group at one shard-group size: per-rank shard elements of each engine."""

    name: str
    numel: int  # real parameters of the group
    shard: dict[str, int]  # engine -> per-rank (padded) shard elements
    tensors: int
    gathers: dict[str, int]  # engine -> all-gathers per step (2 = resharded after forward)


def default_granularity() -> ShardGranularity:
    """The strategies' default granularity policy (``granularity=None``)."""
    return ShardGranularity(granularity=None, optimizer_block_size=DEFAULT_OPTIMIZER_BLOCK_SIZE,
                            min_block_numel=DEFAULT_MIN_BLOCK_NUMEL)


def group_sizes(cfg: TransformerConfig, shard_world: int,
                policy: ShardGranularity | None = None, *,
                fsdp2_keeps_last_block: bool = False) -> list[GroupSizes]:
    """Plan every group of ``cfg`` (per block, then the root) over ``shard_world`` ranks.

    ``fsdp2_keeps_last_block``: give FSDP2 ``reshard_after_forward=False`` on the last block (as
    torchtitan sets by hand), so both engines gather the same number of times.
    """
    policy = policy or default_granularity()
    out = []
    groups = transformer_groups(cfg, "block")
    for k, (gname, params) in enumerate(groups):
        entries = [(n, s, policy(n, torch.empty(s, device="meta"))) for n, s in params]
        plan = plan_layout(entries, shard_world)
        fsdp2 = fsdp2_even_rowwise(params, shard_world)
        # The root keeps its parameters for backward (both engines' default); ours also keeps
        # the last block's (the last group of the forward: its backward comes first).
        root, last_block = k == len(groups) - 1, k == len(groups) - 2
        out.append(GroupSizes(name=gname, numel=plan.total_numel, tensors=len(params),
                              shard={"ours": plan.shard_size, "fsdp2": fsdp2.shard_size},
                              gathers={"ours": 1 if root or last_block else 2,
                                       "fsdp2": 1 if root or (last_block and
                                                              fsdp2_keeps_last_block) else 2}))
    return out


# ------------------------------------------------------------------------------------------------
# one step
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class StepComm:
    """Modelled communication and copy work of one step on one rank (seconds, bytes)."""

    engine: str
    layout: str
    nodes: int
    gpus: int
    shard_ranks: int
    replicas: int
    shard_elems: int  # per-rank padded shard, all groups
    real_elems: int  # parameters / shard_ranks
    ag_bytes: int  # full-buffer bytes of every all-gather in the step
    rs_bytes: int
    ar_bytes: int
    copy_bytes: int
    ag_s: float
    rs_s: float
    ar_s: float
    copy_s: float

    @property
    def comm_s(self) -> float:
        return self.ag_s + self.rs_s + self.ar_s

    @property
    def total_s(self) -> float:
        return self.comm_s + self.copy_s

    @property
    def padding(self) -> float:
        return 1 - self.real_elems / self.shard_elems


def model_step(engine: str, layout: str, nodes: int, sizes: list[GroupSizes],
               net: Network) -> StepComm:
    """Communication and copies of one step (``sizes`` planned at this layout's shard size)."""
    if engine not in ENGINES or layout not in LAYOUTS:
        raise ValueError(f"engine must be one of {ENGINES} and layout one of {LAYOUTS}, got "
                         f"engine={engine!r}, layout={layout!r}")
    gpus = nodes * net.gpus_per_node
    m, replicas = (gpus, 1) if layout == "full" else (net.gpus_per_node, nodes)
    bw, lat = net.link(m, spans_nodes=m > net.gpus_per_node)
    ar_bw, ar_lat = net.link(replicas, spans_nodes=True)
    ag_b = rs_b = ar_b = copy_b = 0
    ag_s = rs_s = ar_s = 0.0
    for g in sizes:
        s = g.shard[engine]
        full = m * s
        gathers = g.gathers[engine]
        ag_b += gathers * full * PARAM_BYTES
        ag_s += gathers * ring_all_gather_s(full * PARAM_BYTES, m, bw, lat)
        rs_b += full * REDUCE_BYTES
        rs_s += ring_reduce_scatter_s(full * REDUCE_BYTES, m, bw, lat)
        if replicas > 1:
            ar_b += s * REDUCE_BYTES
            ar_s += ring_all_reduce_s(s * REDUCE_BYTES, replicas, ar_bw, ar_lat)
        # both: cast the shard to bf16 before every all-gather, the bf16 gradients to fp32
        # before the reduce-scatter (read + write)
        copy_b += gathers * s * (MASTER_BYTES + PARAM_BYTES)
        copy_b += full * (PARAM_BYTES + REDUCE_BYTES)
        if engine == "fsdp2":  # copy-out of every all-gather into per-parameter tensors
            copy_b += gathers * full * 2 * PARAM_BYTES
    if engine == "ours":  # one all-reduce (MAX) of a byte per parameter: "got a gradient",
        # over every data-parallel rank at once (HSDP: the flattened replicate x shard group);
        # a latency-bound message, modelled as a tree
        flags = sum(g.tensors for g in sizes)
        ar_b += flags
        fbw, flat_ = net.link(gpus, spans_nodes=gpus > net.gpus_per_node)
        ar_s += tree_all_reduce_s(flags, gpus, fbw, flat_)
    real = sum(g.numel for g in sizes)
    return StepComm(engine=engine, layout=layout, nodes=nodes, gpus=gpus, shard_ranks=m,
                    replicas=replicas, shard_elems=sum(g.shard[engine] for g in sizes),
                    real_elems=math.ceil(real / m), ag_bytes=ag_b, rs_bytes=rs_b, ar_bytes=ar_b,
                    copy_bytes=copy_b, ag_s=ag_s, rs_s=rs_s, ar_s=ar_s,
                    copy_s=copy_b / net.hbm_bw)


def model_table(cfg: TransformerConfig, nodes: tuple[int, ...] = NODES,
                net: Network | None = None, *,
                fsdp2_keeps_last_block: bool = False) -> list[dict[str, StepComm]]:
    """For every node count and layout, ``{"ours": StepComm, "fsdp2": StepComm}``."""
    net = net or Network()
    rows = []
    cache: dict[int, list[GroupSizes]] = {}
    for layout in LAYOUTS:
        for n in nodes:
            m = n * net.gpus_per_node if layout == "full" else net.gpus_per_node
            if m not in cache:
                cache[m] = group_sizes(cfg, m,
                                       fsdp2_keeps_last_block=fsdp2_keeps_last_block)
            rows.append({e: model_step(e, layout, n, cache[m], net) for e in ENGINES})
    return rows


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------
def _ms(s: float) -> str:
    return f"{s * 1e3:,.1f}"


def report(rows: list[dict[str, StepComm]], net: Network, cfg_name: str, nparams: int,
           markdown: bool = False) -> str:
    head = [
        f"MODEL, not a measurement: per-step communication + copy time per rank, {cfg_name} "
        f"({nparams / 1e9:.2f}B parameters), one group per block + root.",
        f"Network: {net.describe()}.",
        "Collectives: ring; all-gather/reduce-scatter (n-1)/n*B/bw + (n-1)*lat, all-reduce twice "
        "that; a ring spanning nodes runs at the inter-node figures. bf16 all-gather, fp32 "
        "reduce-scatter/all-reduce; blocks gather twice per step, the root once (ours: the "
        "last block once too); ours adds one all-reduce of a byte per parameter (grad flags) "
        "over all data-parallel ranks, latency-bound, as a binary tree (2*ceil(log2 n)*lat), "
        "counted under AR.",
        "Per-rank sizes: ours = plan_layout at the shard-group size (strategy default "
        "granularity), FSDP2 = torch.chunk dim-0 padding. Copies: casts in both engines + "
        "FSDP2's all-gather copy-out. No overlap with compute is modelled.",
        "",
    ]
    cols = ["layout", "nodes", "GPUs", "shard x repl", "pad ours", "pad FSDP2",
            "ours AG", "ours RS", "ours AR", "ours copy", "ours total",
            "FSDP2 AG", "FSDP2 RS", "FSDP2 AR", "FSDP2 copy", "FSDP2 total",
            "ours/FSDP2 comm", "ours/FSDP2 total"]
    body = []
    for r in rows:
        o, f = r["ours"], r["fsdp2"]
        body.append([
            "full sharding" if o.layout == "full" else "HSDP", str(o.nodes), str(o.gpus),
            f"{o.shard_ranks} x {o.replicas}", f"{o.padding:.3%}", f"{f.padding:.3%}",
            _ms(o.ag_s), _ms(o.rs_s), _ms(o.ar_s), _ms(o.copy_s), _ms(o.total_s),
            _ms(f.ag_s), _ms(f.rs_s), _ms(f.ar_s), _ms(f.copy_s), _ms(f.total_s),
            f"{o.comm_s / f.comm_s:.4f}", f"{o.total_s / f.total_s:.4f}",
        ])
    if markdown:
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(b) + " |" for b in body]
        return "\n".join(head + ["Times in ms per step per rank.", ""] + lines)
    w = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(cols)]
    lines = ["Times in ms per step per rank.",
             "  ".join(c.rjust(w[i]) for i, c in enumerate(cols))]
    lines += ["  ".join(v.rjust(w[i]) for i, v in enumerate(b)) for b in body]
    by = {(r["ours"].layout, r["ours"].nodes): r for r in rows}
    lines.append("")
    lines.append("HSDP / full sharding (ours, total): " + ", ".join(
        f"{n} nodes {by[('hsdp', n)]['ours'].total_s / by[('full', n)]['ours'].total_s:.3f}"
        for n in sorted({r['ours'].nodes for r in rows})))
    return "\n".join(head + lines)


# ------------------------------------------------------------------------------------------------
# quantized communication (issue 25): CommPolicy(all_gather="int8", reduce_scatter_dtype=bf16)
# ------------------------------------------------------------------------------------------------
CODE_BYTES = 1  # int8 codes
SCALE_BYTES = 4  # one fp32 scale per block
QUANT_BLOCK = 256
WIRE_BYTES = 2  # bf16 gradients on the wire
#: ZeRO++ (Wang et al., 2023): per-step volume 0.75M against ZeRO-3's 3M (fp16)
ZEROPP_VOLUME_RATIO = 0.75 / 3


def quantized_numel(cfg: TransformerConfig, min_numel: int = DEFAULT_MIN_BLOCK_NUMEL) -> list[int]:
    """Per group (as :func:`group_sizes`), the elements ``CommPolicy``'s default rule quantizes
    (floating tensors of 2+ dims and ``min_numel``+ elements)."""
    return [sum(math.prod(s) for _, s in params if len(s) >= 2 and math.prod(s) >= min_numel)
            for _, params in transformer_groups(cfg, "block")]


def model_step_quantized(layout: str, nodes: int, sizes: list[GroupSizes], qnumel: list[int],
                         net: Network) -> StepComm:
    """Ours with the int8 all-gather and bf16 gradients (see the module docstring); the same
    per-rank shard sizes as unquantized (the quantized tensors' own plan pads alike)."""
    base = model_step("ours", layout, nodes, sizes, net)
    m, replicas = base.shard_ranks, base.replicas
    bw, lat = net.link(m, spans_nodes=m > net.gpus_per_node)
    ar_bw, ar_lat = net.link(replicas, spans_nodes=True)
    ag_b = rs_b = copy_b = 0.0
    ag_s = rs_s = ar_s = 0.0
    ar_b = float(base.ar_bytes - sum(g.shard["ours"] for g in sizes) * REDUCE_BYTES
                 * (replicas > 1))
    for g, q in zip(sizes, qnumel):
        s, frac = g.shard["ours"], q / g.numel if g.numel else 0.0
        full, gathers = m * s, g.gathers["ours"]
        per_elem = frac * (CODE_BYTES + SCALE_BYTES / QUANT_BLOCK) + (1 - frac) * PARAM_BYTES
        ag_b += gathers * full * per_elem
        ag_s += gathers * ring_all_gather_s(full * per_elem, m, bw, lat)
        rs_b += full * WIRE_BYTES
        rs_s += ring_reduce_scatter_s(full * WIRE_BYTES, m, bw, lat)
        if replicas > 1:
            ar_b += s * WIRE_BYTES
            ar_s += ring_all_reduce_s(s * WIRE_BYTES, replicas, ar_bw, ar_lat)
        # quantize (read fp32 shard, write codes) and dequantize (read codes, write bf16) per
        # gather; the bf16 gradients travel as they are, summed into an fp32 shard
        copy_b += gathers * (s * (MASTER_BYTES + per_elem) + full * (per_elem + PARAM_BYTES))
        copy_b += full * WIRE_BYTES + s * REDUCE_BYTES
    flags_s = base.ar_s - sum(  # keep the flags' all-reduce of the unquantized model
        ring_all_reduce_s(g.shard["ours"] * REDUCE_BYTES, replicas, ar_bw, ar_lat)
        for g in sizes) if replicas > 1 else base.ar_s
    return StepComm(engine="ours int8", layout=layout, nodes=nodes, gpus=base.gpus,
                    shard_ranks=m, replicas=replicas, shard_elems=base.shard_elems,
                    real_elems=base.real_elems, ag_bytes=int(ag_b), rs_bytes=int(rs_b),
                    ar_bytes=int(ar_b), copy_bytes=int(copy_b), ag_s=ag_s, rs_s=rs_s,
                    ar_s=ar_s + flags_s, copy_s=copy_b / net.hbm_bw)


def quantized_report(cfg: TransformerConfig, rows: list[dict[str, StepComm]],
                     net: Network) -> str:
    """Ours unquantized, ours int8 + bf16 wire and FSDP2 (bf16 all-gather, fp32 reduce) per
    layout and node count: communication time and bytes per step per rank (a model)."""
    cache: dict[int, list[GroupSizes]] = {}
    qn = quantized_numel(cfg)
    lines = ["", "Quantized communication (CommPolicy int8 all-gather + bf16 gradients; MODEL):",
             "| layout | nodes | FSDP2 bf16 comm (ms) | ours comm (ms) | ours int8 comm (ms) | "
             "int8 / FSDP2 comm | int8 / FSDP2 bytes | int8 total incl. copies (ms) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        o, f = r["ours"], r["fsdp2"]
        m = o.shard_ranks
        if m not in cache:
            cache[m] = group_sizes(cfg, m)
        q = model_step_quantized(o.layout, o.nodes, cache[m], qn, net)
        fb = f.ag_bytes + f.rs_bytes + f.ar_bytes
        qb = q.ag_bytes + q.rs_bytes + q.ar_bytes
        lines.append(f"| {'full sharding' if o.layout == 'full' else 'HSDP'} | {o.nodes} | "
                     f"{_ms(f.comm_s)} | {_ms(o.comm_s)} | {_ms(q.comm_s)} | "
                     f"{q.comm_s / f.comm_s:.3f} | {qb / fb:.3f} | {_ms(q.total_s)} |")
    lines.append(f"ZeRO++ (published, not modelled): {ZEROPP_VOLUME_RATIO:.2f}x ZeRO-3's fp16 "
                 "volume per step (qwZ + hpZ + qgZ); qwZ alone halves the forward all-gather.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama3-70b", choices=sorted(PRESETS))
    p.add_argument("--nodes", type=int, nargs="+", default=list(NODES))
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--intra-bw-gbs", type=float, default=450.0)
    p.add_argument("--intra-latency-us", type=float, default=2.0)
    p.add_argument("--inter-bw-gbs", type=float, default=50.0)
    p.add_argument("--inter-latency-us", type=float, default=10.0)
    p.add_argument("--hbm-gbs", type=float, default=3000.0)
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    p.add_argument("--quantized", action="store_true",
                   help="also model CommPolicy(all_gather='int8', reduce_scatter_dtype=bf16)")
    p.add_argument("--fsdp2-keeps-last-block", action="store_true",
                   help="FSDP2 with reshard_after_forward=False on the last block (torchtitan's "
                        "setting): the same all-gather count as ours")
    a = p.parse_args(argv)
    net = Network(gpus_per_node=a.gpus_per_node, intra_bw=a.intra_bw_gbs * 1e9,
                  intra_latency=a.intra_latency_us * 1e-6, inter_bw=a.inter_bw_gbs * 1e9,
                  inter_latency=a.inter_latency_us * 1e-6, hbm_bw=a.hbm_gbs * 1e9)
    cfg = PRESETS[a.preset]
    nparams = sum(math.prod(s) for _, g in transformer_groups(cfg, "model") for _, s in g)
    rows = model_table(cfg, tuple(a.nodes), net, fsdp2_keeps_last_block=a.fsdp2_keeps_last_block)
    print(report(rows, net, a.preset, nparams, a.markdown))
    if a.quantized:
        print(quantized_report(cfg, rows, net))
    if a.fsdp2_keeps_last_block:
        print("FSDP2 modelled with reshard_after_forward=False on the last block.")


if __name__ == "__main__":
    main()
