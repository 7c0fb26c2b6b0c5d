"""The engine at N ranks on one machine: a dry run under torch's fake process group.

``dry_run(...)`` (and ``python -m lightning_vescale.dryrun``) runs one real training step of
``fully_shard`` (and of torch's FSDP2, side by side) as rank r of N on FakeTensors and reports
per-rank memory by category, the peak of live bytes and where it happens, padding, and the
collectives with their bytes (``write_chart``: a PNG of it). Design notes [dryrun],
[dryrun-tracker], [dryrun-models].
"""

from lightning_vescale.dryrun._api import DryRunReport, dry_run
from lightning_vescale.dryrun._chart import write_chart
from lightning_vescale.dryrun._report import format_report
from lightning_vescale.dryrun._run import EngineReport, run_step

__all__ = ["DryRunReport", "EngineReport", "dry_run", "format_report", "run_step",
           "write_chart"]
