"""PNG timeline of one rank's memory, with the phases marked (matplotlib, imported lazily).

Top panel: the device figure at each phase boundary (line) and each phase's peak (a bar over the
phase's span), on a background coloured by phase, the phase named in the legend and written over
its first span. Bottom panel: the breakdown at each boundary as stacked bars (parameters sharded /
unsharded, gradients, optimizer states, communication buffers, activations/other).

Only the object-oriented matplotlib API is used (``Figure`` + the Agg canvas), so plotting neither
changes the global backend nor needs a display.
"""

from __future__ import annotations

from collections.abc import Sequence

from lightning_vescale.callbacks._memory_accounting import CATEGORIES, MemorySample

__all__ = ["PHASE_COLORS", "PLOT_HINT", "plot_timeline"]

PLOT_HINT = (
    "MemoryProfiler(plot_dir=...) needs matplotlib; install it with "
    "`pip install 'lightning-vescale[plot]'` (or `pip install matplotlib`), or set plot_dir=None."
)

PHASE_COLORS: dict[str, str] = {
    "forward": "#4C72B0",
    "backward": "#DD8452",
    "optimizer_step": "#55A868",
    "checkpoint_save": "#C44E52",
    "other": "#BBBBBB",
}
_CAT_COLORS = {
    "params_sharded": "#1f77b4",
    "params_unsharded": "#aec7e8",
    "grads": "#ff7f0e",
    "optimizer_states": "#2ca02c",
    "comm_buffers": "#9467bd",
    "activations_other": "#c7c7c7",
}
_CAT_LABELS = {
    "params_sharded": "params (sharded)",
    "params_unsharded": "params (unsharded)",
    "grads": "gradients",
    "optimizer_states": "optimizer states",
    "comm_buffers": "comm. buffers",
    "activations_other": "activations/other",
}
_MIB = float(1 << 20)


def plot_timeline(samples: Sequence[MemorySample], path: str, *, rank: int,
                  source: str = "") -> list[str]:
    """Write the timeline PNG to ``path``; return the legend labels of the phase panel.

    Each sample ``i`` closes a phase that spans ``[i - 1, i]`` on the x axis (boundary index).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as err:  # pragma: no cover - checked at setup already
        raise ModuleNotFoundError(PLOT_HINT) from err

    fig = Figure(figsize=(12, 6.5), dpi=110)
    FigureCanvasAgg(fig)
    ax, ax2 = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    xs = list(range(len(samples)))
    seen: list[str] = []
    for i, s in enumerate(samples):
        color = PHASE_COLORS.get(s.phase, "#888888")
        ax.axvspan(i - 1, i, color=color, alpha=0.18, lw=0)
        if s.phase_peak is not None:
            ax.hlines(s.phase_peak / _MIB, i - 1, i, colors=color, lw=2.5)
        if s.phase not in seen:  # name each phase over its first span
            seen.append(s.phase)
            ax.text(i - 0.5, 0.03, s.phase, transform=ax.get_xaxis_transform(), ha="center",
                    va="bottom", fontsize=7, color=color, rotation=90, fontweight="bold")
    cur = [s.current / _MIB if s.current is not None else float("nan") for s in samples]
    ax.plot(xs, cur, "k.-", lw=1, ms=3, label="current")
    phases = [p for p in PHASE_COLORS if p in seen] + [p for p in seen if p not in PHASE_COLORS]
    handles = [Patch(color=PHASE_COLORS.get(p, "#888888"), alpha=0.6, label=f"{p} (peak)")
               for p in phases]
    handles.append(ax.get_lines()[-1])
    legend = ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8,
                       title="phase", title_fontsize=8)
    ax.set_ylabel("MiB")
    ax.set_title(f"rank {rank} memory timeline: {source}", fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)

    for i, s in enumerate(samples):
        ax2.axvspan(i - 1, i, color=PHASE_COLORS.get(s.phase, "#888888"), alpha=0.10, lw=0,
                    zorder=0)
    bottoms = [0.0] * len(samples)
    for cat in list(CATEGORIES) + ["activations_other"]:
        vals = []
        for s in samples:
            if s.breakdown is None:
                vals.append(0.0)
            elif cat == "activations_other":
                vals.append(max(0.0, (s.activations_other or 0) / _MIB))
            else:
                vals.append(getattr(s.breakdown, cat) / _MIB)
        if any(vals):  # each bar sits on the phase it closes
            label = _CAT_LABELS[cat]
            if cat == "activations_other" and source.startswith("process"):
                label = "RSS - tensors (runtime)"  # CPU: mostly the torch runtime, see the table
            ax2.bar([x - 0.5 for x in xs], vals, bottom=bottoms, width=0.8,
                    color=_CAT_COLORS[cat], label=label, zorder=2)
            bottoms = [b + v for b, v in zip(bottoms, vals)]
    ax2.set_ylabel("MiB at phase end")
    ax2.set_xlabel("phases of the profiled batches, in order (bars: breakdown when the phase ends)")
    if ax2.get_legend_handles_labels()[0]:
        handles2, labels2 = ax2.get_legend_handles_labels()
        ax2.legend(handles2[::-1], labels2[::-1], loc="upper left", bbox_to_anchor=(1.01, 1.0),
                   fontsize=8, title="breakdown", title_fontsize=8)
    ax2.grid(True, axis="y", alpha=0.3)
    # batch numbers on the x axis where each profiled batch starts
    ticks = [i for i, s in enumerate(samples) if s.phase == "forward"]
    if ticks and len(ticks) <= 40:
        ax2.set_xticks([i - 1 for i in ticks])
        ax2.set_xticklabels([f"batch {samples[i].batch}" for i in ticks], fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    return [t.get_text() for t in legend.get_texts()]
