"""Start-up time of each way to launch ranks on one machine (the README's launcher table).

For each launcher: ``examples/train_gpt.py``'s ``GPTModule`` at its defaults, 2 CPU processes,
one training step. Two figures, medians of ``--repeats`` fresh commands:

* *fit*: ``Trainer.fit`` from its call to the end of the step, as rank 0 measures it (for the
  ``vescale_fsdp`` launcher this includes re-running the script per rank; for fork/spawn the
  start of the workers);
* *whole command*: the command from ``exec`` to exit, Python's start and imports included.

The machine's load average is printed before and after: on a shared 2-core machine it moves
the figures by tens of percent, so it belongs beside them.

Run:  python -m benchmarks.launch_time [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = """
import sys, time, torch
torch.set_num_threads(1)
import lightning.pytorch as pl
import lightning_vescale  # noqa: F401
from examples.train_gpt import CharDataModule, GPTModule


def main():
    trainer = pl.Trainer(strategy=sys.argv[1], accelerator="cpu", devices=2, max_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    start = time.perf_counter()
    trainer.fit(GPTModule(), CharDataModule())
    if trainer.is_global_zero:
        print(f"FIT_SECONDS {time.perf_counter() - start:.3f}", flush=True)


if __name__ == "__main__":  # spawn re-imports this file in each worker
    main()
"""

LAUNCHERS = {
    "vescale_fsdp": lambda script: [sys.executable, script, "vescale_fsdp"],
    "vescale_fsdp_fork": lambda script: [sys.executable, script, "vescale_fsdp_fork"],
    "vescale_fsdp_spawn": lambda script: [sys.executable, script, "vescale_fsdp_spawn"],
    "torchrun": lambda script: [sys.executable, "-m", "torch.distributed.run",
                                "--nproc-per-node", "2", script, "vescale_fsdp"],
}


def _once(argv: list[str]) -> tuple[float, float]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    whole = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    fit = [float(line.split()[1]) for line in proc.stdout.splitlines()
           if line.startswith("FIT_SECONDS")]
    return fit[0], whole


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "one_step.py")
        Path(script).write_text(_SCRIPT)
        print(f"{'strategy=':<22}{'fit s':>8}{'whole s':>10}   (medians of {args.repeats})")
        for name, argv_of in LAUNCHERS.items():
            runs = [_once(argv_of(script)) for _ in range(args.repeats)]
            fit = statistics.median(r[0] for r in runs)
            whole = statistics.median(r[1] for r in runs)
            print(f"{name:<22}{fit:>8.1f}{whole:>10.1f}", flush=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
