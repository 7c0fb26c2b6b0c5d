"""Text tables of a :class:`~lightning_vescale.dryrun.DryRunReport` (ours vs FSDP2)."""

from __future__ import annotations

from typing import Any

__all__ = ["format_report"]

_MIB = 1024 ** 2


def _mib(x: int) -> str:
    return f"{x / _MIB:11.1f}"


def format_report(report: Any) -> str:
    """Memory per rank by category (after the step, and the maxima at block boundaries), the
    peak and where, padding, collectives; with ours/FSDP2 ratios when both engines ran."""
    eng = report.engines
    names = list(eng)
    both = "vescale" in eng and "fsdp2" in eng
    head = (f"dry run: {report.model}, rank {report.rank} of {report.world_size}"
            f" (replicas {report.replicas}), batch {report.batch_size}x{report.seq_len},"
            f" optimizer {report.optimizer}"
            + "".join(f", {k}={v}" for k, v in report.settings.items()))
    cols = "".join(f"{n:>12}" for n in names) + ("  ours/FSDP2" if both else "")
    lines = [head, "", f"{'MiB per rank':44}{cols}"]

    def row(label: str, values: list[int]) -> None:
        cells = "".join(f"{_mib(v):>12}" for v in values)
        ratio = ""
        if both:
            a, b = values[names.index("vescale")], values[names.index("fsdp2")]
            ratio = f"  {a / b:10.3f}" if b else f"  {'-':>10}"
        lines.append(f"{label:44}{cells}{ratio}")

    for cat in ("params_sharded", "grads", "optimizer_states"):
        row(f"{cat} (after step)", [eng[n].after_step[cat] for n in names])
    for cat in ("params_unsharded", "grads", "comm_buffers"):
        row(f"{cat} (max at block boundary)", [eng[n].max_at_boundaries[cat] for n in names])
    row("padding", [eng[n].padding_bytes for n in names])
    row("peak live bytes (all)", [eng[n].peak_bytes for n in names])
    for n in names:
        lines.append(f"  peak of {n}: during {eng[n].peak_where}; live bytes by what made them:")
        for label, b in eng[n].peak_top[:6]:
            lines.append(f"    {b / _MIB:11.1f} MiB  {label}")
    lines.append("")
    lines.append("collectives per step (count, MiB in, MiB out)")
    fams = sorted({f for n in names for f in eng[n].collectives})
    for f in fams:
        cells = []
        for n in names:
            c, i, o = eng[n].collectives.get(f, [0, 0, 0])
            cells.append(f"{n}: {c:5d} {i / _MIB:11.1f} {o / _MIB:11.1f}")
        lines.append(f"  {f:16}" + "   ".join(cells))
    for n, why in getattr(report, "skipped", {}).items():
        lines.append(f"{n} did not run: {why[:300]}")
    lines.append("")
    rss_gib = report.host_max_rss_bytes / _MIB / 1024
    lines.append(f"host: {report.seconds:.1f} s, max RSS {rss_gib:.2f}"
                 " GiB; " + ", ".join(f"{n} step {eng[n].seconds:.1f} s" for n in names))
    return "\n".join(lines)
