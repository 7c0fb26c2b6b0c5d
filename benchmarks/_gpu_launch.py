"""How ``benchmarks/gpu_check.py`` runs its worlds within a bounded time, row by row.

A GPU session gets a few minutes of device time. A first run on a new machine is exactly where a
collective may never complete (a mismatched NCCL call, a stream waiting on an event nobody
records), and a run killed from outside leaves neither ``RESULTS_gpu.md`` nor a hint of which
row hung. So:

* every rank's process group gets a timeout of :data:`COLLECTIVE_TIMEOUT` (NCCL's default is
  10 minutes), so a hung collective becomes an error in its row;
* rank 0 prints each row's verdict the moment it has it (:func:`row_reporter`) and keeps the
  rows so far in ``rank0.partial.json``: whatever stops the run, the output so far names the
  last row that finished;
* :func:`spawn_within` kills a world that overruns its deadline; ``main`` then reports the rows
  it has plus one FAIL row for the time-out, and still writes the results file.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = ["COLLECTIVE_TIMEOUT", "row_reporter", "read_rows", "spawn_within"]

#: The process group's timeout in the check worlds: a collective that never completes fails its
#: row after this long instead of blocking the run for NCCL's default 10 minutes.
COLLECTIVE_TIMEOUT = timedelta(seconds=90)


def row_reporter(out_dir: str, rank: int, world: int) -> Callable[[dict[str, Any]], None]:
    """A callback for each finished row: rank 0 prints it at once and appends it to
    ``rank0.partial.json`` (the other ranks stay quiet)."""
    rows: list[dict[str, Any]] = []
    started = time.monotonic()

    def report(row: dict[str, Any]) -> None:
        if rank != 0:
            return
        rows.append(row)
        elapsed = time.monotonic() - started
        detail = " ".join(str(row.get("detail", "")).split())[:160]
        print(f"gpu_check: [world {world}, {elapsed:5.1f} s] {row['status']} {row['check']}: "
              f"{detail}", flush=True)
        Path(out_dir, "rank0.partial.json").write_text(json.dumps(rows))

    return report


def read_rows(out_dir: str | Path) -> dict[str, Any]:
    """Rank 0's results of a world: the final file, else the rows it finished (partial)."""
    final, partial = Path(out_dir, "rank0.json"), Path(out_dir, "rank0.partial.json")
    if final.is_file():
        return json.loads(final.read_text())
    rows = json.loads(partial.read_text()) if partial.is_file() else []
    return {"rows": rows, "perf": []}


def spawn_within(world: int, fn: Callable[..., None], args: tuple, seconds: float) -> None:
    """``fn(rank, *args)`` in ``world`` spawned processes (CUDA cannot be forked), killed after
    ``seconds``: then :class:`TimeoutError`. A process that fails re-raises as torch's
    ``ProcessRaisedException`` (the others are terminated by torch)."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=args, nprocs=world, start_method="spawn", join=False)
    deadline = time.monotonic() + seconds
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join(5)
            raise TimeoutError(f"world of {world} process(es) still running after {seconds:.0f} "
                               "s: killed (the last row it printed is the last one finished)")
