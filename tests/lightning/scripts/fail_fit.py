"""A 2-rank fit with the default launcher in which one rank raises (failure-hardening tests).

    python tests/lightning/scripts/fail_fit.py OUT_DIR FAIL_RANK [--on-exception-checkpoint]

Lightning's subprocess launcher re-runs this script for rank 1, so every rank handles its own
exception (the path users get with ``strategy="vescale_fsdp"`` and with torchrun). ``FAIL_RANK``
raises ``RuntimeError("boom on rank <r>")`` in ``training_step`` at batch 1. Each rank writes
``OUT_DIR/pid_rank<r>`` (so the test can check that no process is left behind) and, when its fit
raised, prints ``FAILED rank=<r> after=<seconds since its own step-1 error or start> <error>``.
With ``--on-exception-checkpoint`` an ``OnExceptionCheckpoint(OUT_DIR/ckpt)`` is attached: its
collective save runs on the failing rank only (design note [failures] in ``strategy.py``).
"""

import os
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import OnExceptionCheckpoint  # noqa: E402

from lightning_vescale import VeScaleFSDPStrategy  # noqa: E402
from lightning_vescale._lightning import exception_agreement  # noqa: E402
from tests.lightning._lit import TinyGPT, dataloader, trainer  # noqa: E402

TIMEOUT = timedelta(seconds=float(os.environ.get("FAIL_FIT_TIMEOUT", "60")))
exception_agreement.EXCEPTION_AGREEMENT_WINDOW = timedelta(
    seconds=float(os.environ.get("FAIL_FIT_WINDOW", "3")))
RAISED_AT = [0.0]


class Failing(TinyGPT):
    def __init__(self, fail_rank: int) -> None:
        super().__init__()
        self.fail_rank = fail_rank

    def training_step(self, batch, batch_idx):
        if self.global_rank == self.fail_rank and batch_idx == 1:
            RAISED_AT[0] = time.monotonic()
            raise RuntimeError(f"boom on rank {self.global_rank}")
        return super().training_step(batch, batch_idx)


def main(out_dir: str, fail_rank: int, on_exception_checkpoint: bool) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    Path(out_dir, f"pid_rank{rank}").write_text(str(os.getpid()))
    callbacks = [OnExceptionCheckpoint(str(Path(out_dir, "ckpt")))] if on_exception_checkpoint \
        else []
    strategy = VeScaleFSDPStrategy(timeout=TIMEOUT)
    t = trainer(strategy, max_steps=3, callbacks=callbacks, enable_checkpointing=bool(callbacks))
    start = time.monotonic()
    try:
        t.fit(Failing(fail_rank), dataloader())
    except BaseException as e:
        after = time.monotonic() - (RAISED_AT[0] or start)
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(f"FAILED rank={rank} after={after:.1f} {type(e).__name__}: {first_line}",
              flush=True)
        raise
    print(f"FINISHED rank={rank}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), "--on-exception-checkpoint" in sys.argv[3:])
