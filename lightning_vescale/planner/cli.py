"""``python -m lightning_vescale.planner``: print the structure-aware layout of a model.

The model is either a transformer shape (``--preset`` and/or ``--config``; nothing is
allocated) or an import path ``pkg.module:ClassName`` instantiated on the meta device (an
``nn.Module`` or a ``LightningModule``; ``configure_model()`` is called when present). Each
sharding group (one per transformer block plus the root, or the whole model) is planned with
:func:`~lightning_vescale.planner.plan_buckets` as ``fully_shard`` plans it (one buffer, two, or
one per whole-matrix tensor when they pad less apart: design note [plan-buckets]), and the same
figures are printed for FSDP2-style even row-wise sharding and FSDP1-style flat sharding at the
same world size.

Examples::

    python -m lightning_vescale.planner --preset llama3-70b --world-size 1024
    python -m lightning_vescale.planner --preset llama3-70b --world-size 1024 --granularity row
    python -m lightning_vescale.planner --preset deepseek-v3 --grouping model --world-size 10000
    python -m lightning_vescale.planner --model my_pkg.models:GPT --init-args '{"n_layer": 4}'
    python -m lightning_vescale.planner --preset gpt-oss-120b --world-size 64 1024 10240 \
        --expert-granularity matrix        # MoE: every expert whole on one rank

The default ``--granularity`` is the one training uses (``fully_shard``'s and the strategies'
default, :func:`~lightning_vescale.planner.default_granularity`: element-wise, and multiples of
256 for tensors of 4096+ elements), so the layout printed is the one a default run builds;
``--granularity row`` etc. show other settings. Imports only layers 0-1 and torch (Lightning only
through a user model that needs
it).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lightning_vescale.planner._granularity import (
    DEFAULT_BLOCK_ALIGN,
    DEFAULT_BLOCK_MIN_NUMEL,
    GRANULARITY_FORMS,
    Granularity,
    check_granularity,
    default_granularity,
)
from lightning_vescale.planner._buckets import plan_buckets
from lightning_vescale.planner._layout import DEFAULT_ALIGN, LayoutPlan
from lightning_vescale.planner.baselines import fsdp1_flat, fsdp2_even_rowwise
from lightning_vescale.planner.presets import (
    PRESETS,
    TransformerConfig,
    get_preset,
    transformer_groups,
    with_overrides,
)

if TYPE_CHECKING:
    import torch.nn as nn

__all__ = ["PlanSummary", "build_parser", "main", "model_groups", "module_groups", "summarize",
           "with_expert_granularity"]

Group = list[tuple[str, tuple[int, ...]]]


# -- model -> groups -------------------------------------------------------------------------------
def module_groups(module: nn.Module, grouping: str = "block") -> list[tuple[str, Group]]:
    """Parameter shapes of ``module`` as sharding groups.

    ``grouping="block"``: each child of the ``nn.ModuleList`` holding the most parameters is a
    group (the transformer blocks), the remaining parameters form the root group; a module
    without a ``ModuleList`` is one group. ``"model"``: one group. Shared parameters count once.
    """
    import torch.nn as nn

    if grouping not in ("block", "model"):
        raise ValueError(f"grouping must be 'block' or 'model', got {grouping!r}")
    params = [(n, tuple(p.shape)) for n, p in module.named_parameters()]
    if not params:
        raise ValueError(f"{type(module).__name__} has no parameters to plan")
    if grouping == "model":
        return [("model", params)]
    best_name, best_list, best_count = None, None, 0
    for name, sub in module.named_modules():
        if isinstance(sub, nn.ModuleList):
            count = sum(p.numel() for p in sub.parameters())
            if count > best_count:
                best_name, best_list, best_count = name, sub, count
    if best_list is None:
        return [("model", params)]
    groups: list[tuple[str, Group]] = []
    taken: set[str] = set()
    for child_name, child in best_list.named_children():
        prefix = f"{best_name}.{child_name}." if best_name else f"{child_name}."
        members = [(n, s) for n, s in params if n.startswith(prefix) and n not in taken]
        if members:
            groups.append((prefix[:-1], members))
            taken.update(n for n, _ in members)
    root = [(n, s) for n, s in params if n not in taken]
    if root:
        groups.append(("root", root))
    return groups


def _instantiate(path: str, init_args: dict):
    import torch

    if ":" not in path:
        raise ValueError(f"--model must look like 'package.module:ClassName', got {path!r}")
    mod_name, _, attr = path.partition(":")
    try:
        obj = importlib.import_module(mod_name)
    except ImportError as exc:
        raise ValueError(f"--model {path!r}: cannot import module {mod_name!r}: {exc}") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"--model {path!r}: {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    _check_init_args(path, obj, init_args)
    with torch.device("meta"):
        model = obj(**init_args)
        if callable(getattr(model, "configure_model", None)):
            model.configure_model()
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"--model {path!r} built a {type(model).__name__}, not an nn.Module")
    return model


def _check_init_args(path: str, obj: object, init_args: dict) -> None:
    """``ValueError`` naming the missing (or unknown) constructor arguments of ``--model`` and
    how to give them, before anything is built."""
    try:
        sig = inspect.signature(obj)  # type: ignore[arg-type]
    except (TypeError, ValueError):  # a builtin or a C extension: let the call speak
        return
    try:
        sig.bind(**init_args)
    except TypeError as exc:
        params = [p for p in sig.parameters.values()
                  if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        required = [p.name for p in params if p.default is p.empty]
        example = ({name: init_args.get(name, "...") for name in required} if required else
                   {p.name: p.default for p in params[:1]})
        shown = sig.replace(return_annotation=inspect.Signature.empty)
        raise ValueError(
            f"--model {path!r}: {getattr(obj, '__name__', path)}{shown} cannot be called with "
            f"--init-args '{json.dumps(init_args)}' ({exc}). Give its arguments as a JSON "
            f"object: --init-args '{json.dumps(example, default=str)}'. JSON holds numbers, "
            "strings, lists and objects only: for an argument that must be another object (a "
            "config class), point --model at a function or class that builds the model from "
            "plain values.") from None


def model_groups(args: argparse.Namespace) -> tuple[str, list[tuple[str, Group]]]:
    """``(description, groups)`` for the parsed command line."""
    if args.model:
        if args.preset or args.config:
            raise ValueError("give either --model or --preset/--config, not both")
        init_args = json.loads(args.init_args) if args.init_args else {}
        if not isinstance(init_args, dict):
            raise ValueError(f"--init-args must be a JSON object, got {args.init_args!r}")
        model = _instantiate(args.model, init_args)
        return args.model, module_groups(model, args.grouping)
    overrides = json.loads(args.config) if args.config else {}
    if not isinstance(overrides, dict):
        raise ValueError(f"--config must be a JSON object, got {args.config!r}")
    if args.preset:
        config = with_overrides(get_preset(args.preset), **overrides)
        label = args.preset + (f" {overrides}" if overrides else "")
    elif overrides:
        try:
            config = TransformerConfig(**overrides)
        except TypeError as exc:
            raise ValueError(f"--config: {exc}") from exc
        label = "config"
    else:
        raise ValueError(f"give --preset (one of {sorted(PRESETS)}), --config or --model")
    return label, transformer_groups(config, args.grouping)


# -- figures ---------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class PlanSummary:
    """Figures of one scheme summed over the groups (per rank: what each rank stores/sends)."""

    scheme: str
    shard_elems: int  # sum over groups of S: elements per rank
    padding_ratio: float  # sum padding / sum buffer
    imbalance: float  # max over ranks of real elements / mean
    split_tensors: int  # tensors with a block cut across ranks
    seconds: float | None = None


def summarize(
    groups: list[tuple[str, Group]], world_size: int, granularity: Granularity | None, align: int
) -> tuple[list[LayoutPlan], list[PlanSummary]]:
    """Plan every group; return ``(plans, [planner, lower bound, fsdp2, fsdp1] summaries)``.

    Each group is planned as ``fully_shard`` builds it: :func:`~lightning_vescale.planner.
    plan_buckets`, so a group whose whole-matrix tensors get a buffer of their own (design note
    [plan-buckets]) contributes several plans; the lower bound is that of the buffers chosen."""
    if granularity is None:  # the training default, resolved per tensor
        groups = [(name, [(n, s, default_granularity(s)) for n, s in params])
                  for name, params in groups]
    t0 = time.perf_counter()
    plans = [plan for _, params in groups for plan in
             plan_buckets(params, world_size, granularity=granularity, align=align).plans]
    seconds = time.perf_counter() - t0
    total = sum(p.total_numel for p in plans)
    buffer = sum(p.buffer_size for p in plans)
    loads = [0] * world_size
    for p in plans:
        for r, x in enumerate(p.rank_loads()):
            loads[r] += x
    mean = total / world_size
    ours = PlanSummary(
        scheme="vescale planner", shard_elems=sum(p.shard_size for p in plans),
        padding_ratio=(buffer - total) / buffer, imbalance=max(loads) / mean, split_tensors=0,
        seconds=seconds,
    )
    lb_buffer = sum(p.lower_bound for p in plans) * world_size
    lower = PlanSummary(
        scheme="lower bound", shard_elems=sum(p.lower_bound for p in plans),
        padding_ratio=(lb_buffer - total) / lb_buffer, imbalance=float("nan"), split_tensors=0,
    )
    out = [ours, lower]
    for fn in (fsdp2_even_rowwise, fsdp1_flat):
        figs = [fn(params, world_size, granularity=granularity) for _, params in groups]
        fbuf = sum(f.buffer_size for f in figs)
        out.append(PlanSummary(
            scheme=figs[0].scheme, shard_elems=sum(f.shard_size for f in figs),
            padding_ratio=(fbuf - total) / fbuf,
            imbalance=sum(f.max_load for f in figs) / mean,
            split_tensors=sum(f.split_tensors for f in figs),
        ))
    return plans, out


def _fmt_table(rows: list[PlanSummary]) -> str:
    head = (f"  {'scheme':<20} {'S/rank (elems)':>16} {'padding':>9} {'max/mean load':>14} "
            f"{'split tensors':>14} {'plan time':>10}")
    lines = [head]
    for r in rows:
        imb = "-" if math.isnan(r.imbalance) else f"{r.imbalance:.4f}"
        sec = "-" if r.seconds is None else f"{r.seconds * 1e3:.1f} ms"
        lines.append(
            f"  {r.scheme:<20} {r.shard_elems:>16,} {100 * r.padding_ratio:>8.3f}% {imb:>14} "
            f"{r.split_tensors:>14} {sec:>10}"
        )
    return "\n".join(lines)


#: How the default granularity is printed: the strategies' setting it corresponds to.
_DEFAULT_WORDS = (f"default (element-wise, multiples of {DEFAULT_BLOCK_ALIGN} for tensors of "
                  f"{DEFAULT_BLOCK_MIN_NUMEL}+ elements: fully_shard's and the strategies' "
                  f"default, optimizer_block_size={DEFAULT_BLOCK_ALIGN})")


def _granularity_arg(text: str) -> int | str:
    """``--granularity``: an int when the text is a number, else the text; checked now, so a
    typo fails with the valid forms before anything is planned."""
    value = int(text) if text.strip().isdigit() else text
    try:
        check_granularity(value)
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lightning_vescale.planner",
        description="Structure-aware FSDP layout of a model, next to FSDP2 and FSDP1 sharding.",
    )
    src = p.add_argument_group("model")
    src.add_argument("--preset", choices=sorted(PRESETS), help="transformer shape preset")
    src.add_argument("--config", help="JSON TransformerConfig fields (override the preset), e.g. "
                     '\'{"hidden": 4096, "layers": 32, "heads": 32, "vocab": 32000, "ffn": 11008}\'')
    src.add_argument("--model", help="import path 'pkg.module:ClassName' (built on the meta device)")
    src.add_argument("--init-args", help="JSON keyword arguments for --model's class")
    p.add_argument("--grouping", choices=("block", "model"), default="block",
                   help="one group per transformer block + root (default) or the whole model")
    p.add_argument("--world-size", type=int, nargs="+", default=[8],
                   help="ranks (several values print several tables)")
    p.add_argument("--granularity", type=_granularity_arg, default=None,
                   help=f"{GRANULARITY_FORMS} (default: {_DEFAULT_WORDS})")
    p.add_argument("--expert-granularity", type=_granularity_arg, default=None,
                   help="granularity of stacked-expert (3-D) tensors, overriding --granularity "
                        "for them, e.g. 'matrix': every expert whole on one rank")
    p.add_argument("--align", type=int, default=DEFAULT_ALIGN,
                   help=f"collective alignment in elements (default {DEFAULT_ALIGN})")
    p.add_argument("--describe", action="store_true",
                   help="also print the full plan table of the largest group")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        label, groups = model_groups(args)
        for m in args.world_size:
            if m < 1:
                raise ValueError(f"--world-size must be >= 1, got {m}")
    except ValueError as exc:
        parser.error(str(exc))
    n_params = sum(math.prod(s) for _, g in groups for _, s in g)
    n_tensors = sum(len(g) for _, g in groups)
    print(f"model: {label}: {n_params:,} parameters, {n_tensors} tensors, {len(groups)} "
          f"group(s) ({args.grouping}); granularity="
          f"{_DEFAULT_WORDS if args.granularity is None else args.granularity}, align={args.align}")
    if args.expert_granularity is not None:
        print(f"stacked experts (3-D tensors): granularity={args.expert_granularity}")
        groups = with_expert_granularity(groups, args.expert_granularity, args.granularity)
    for m in args.world_size:
        try:
            plans, rows = summarize(groups, m, args.granularity if args.expert_granularity is None
                                    else 1, args.align)  # (per-tensor granularities given)
        except ValueError as exc:
            parser.error(str(exc))
        largest = max(plans, key=lambda p: p.buffer_size)
        print(f"\nworld size {m}:")
        print(_fmt_table(rows))
        exact = sum(p.exact for p in plans)
        optimal = sum(p.optimal for p in plans)
        split = f" ({len(plans) - len(groups)} groups keep whole matrices in a buffer of " \
            "their own)" if len(plans) > len(groups) else ""
        print(f"  buffers at the lower bound (provably optimal): {optimal}/{len(plans)}; "
              f"optimal for their order: {exact}/{len(plans)}{split}")
        if args.describe:
            print(_describe(largest))
    return 0


def with_expert_granularity(groups: list[tuple[str, Group]], expert: Granularity,
                            default: Granularity | None) -> list:
    """``groups`` with ``expert`` as the granularity of every 3-D (stacked-expert) tensor and
    ``default`` (``None``: the training default, resolved per tensor) for the others."""
    def gran(shape: tuple[int, ...]) -> Granularity:
        if len(shape) == 3:
            return expert
        return default_granularity(shape) if default is None else default
    return [(name, [(n, s, gran(s)) for n, s in params]) for name, params in groups]


def _describe(plan: LayoutPlan) -> str:
    return "\n  largest group:\n" + "\n".join("  " + line for line in plan.describe(24).splitlines())
