"""The dry run's PNG bar chart: memory per rank by category, ours beside FSDP2.

The bars are the report's own figures (the MemoryProfiler's categories after the step and
their maxima at block boundaries, and the peak of live bytes), nothing recomputed. matplotlib is
optional (the ``plot`` extra): :func:`write_chart` raises a ``RuntimeError`` naming the fix when
it is missing, before any work is lost (the CLI checks it before the dry run starts).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["CHART_BARS", "require_matplotlib", "write_chart"]

#: (label, where in an engine's report, category)
CHART_BARS = (
    ("sharded params\n(after step)", "after_step", "params_sharded"),
    ("gradients\n(after step)", "after_step", "grads"),
    ("optimizer states\n(after step)", "after_step", "optimizer_states"),
    ("unsharded params\n(max at boundary)", "max_at_boundaries", "params_unsharded"),
    ("gradients\n(max at boundary)", "max_at_boundaries", "grads"),
    ("comm buffers\n(max at boundary)", "max_at_boundaries", "comm_buffers"),
    ("peak of all\nlive bytes", "peak_bytes", ""),
)
_COLORS = {"vescale": "#1f77b4", "fsdp2": "#ff7f0e"}
_LABELS = {"vescale": "ours (fully_shard)", "fsdp2": "torch FSDP2"}


def require_matplotlib() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or a RuntimeError saying how to install it."""
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("the dry run's chart (--chart / write_chart) needs matplotlib: "
                           "pip install 'lightning_vescale[plot]' (or matplotlib>=3.8)") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _as_dict(report: Any) -> dict[str, Any]:
    return report if isinstance(report, dict) else report.as_dict()


def _value(engine: dict[str, Any], where: str, cat: str) -> int:
    return int(engine[where]) if where == "peak_bytes" else int(engine[where].get(cat, 0))


def write_chart(report: Any, path: str | Path, *, title: str | None = None) -> Path:
    """Draw ``report`` (a :class:`~lightning_vescale.dryrun.DryRunReport` or its
    ``as_dict()``, e.g. the CLI's ``--json`` output) as grouped bars, GiB per rank, with
    ours/FSDP2 above each pair when both engines ran; write the PNG to ``path``."""
    plt = require_matplotlib()
    rep = _as_dict(report)
    engines = rep["engines"]
    if not engines:
        raise ValueError("write_chart: the report has no engine results to draw")
    names = [n for n in ("vescale", "fsdp2") if n in engines]
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(10, 4.8))
    xs = range(len(CHART_BARS))
    gib = 1024 ** 3
    for i, n in enumerate(names):
        vals = [_value(engines[n], w, c) / gib for _, w, c in CHART_BARS]
        ax.bar([x + (i - (len(names) - 1) / 2) * width for x in xs], vals, width,
               label=_LABELS.get(n, n), color=_COLORS.get(n))
    if len(names) == 2:
        for x, (_, w, c) in zip(xs, CHART_BARS):
            a, b = (_value(engines[n], w, c) for n in names)
            if b:
                ax.annotate(f"{a / b:.2f}x", (x, max(a, b) / gib), ha="center",
                            va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(list(xs), [label for label, _, _ in CHART_BARS], fontsize=8)
    ax.set_ylabel("GiB per rank")
    ax.set_title(title or (f"{rep['model']}: rank {rep['rank']} of {rep['world_size']}, "
                           f"{rep['optimizer']}, batch {rep['batch_size']}x{rep['seq_len']}"))
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
