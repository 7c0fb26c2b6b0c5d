"""Failure hardening of the Lightning layer: a failing rank never leaves the others hanging, and a
failed checkpoint save never damages the previous checkpoint (design note [failures] in
``strategy.py``, atomic saves in ``lightning_vescale.checkpoint``).

Every run here is bounded: in-process fork-launcher fits run under a SIGALRM deadline that kills
the workers if it fires (the test then fails instead of hanging), subprocess runs under
``subprocess.run(timeout=...)``. The bound is well below the process-group ``timeout`` (30 s),
so "it ended with an error" also means "nobody waited for the timeout", except for the uneven
batches case, where the timeout is the mechanism (given 5 s there).
"""

from __future__ import annotations

import filecmp
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

from lightning_vescale import VeScaleFabricStrategy, VeScaleFSDPStrategy
from lightning_vescale import checkpoint as ckpt
from lightning_vescale._lightning.exception_agreement import all_ranks_arrive
from tests.lightning._lit import TinyGPT, dataloader, trainer

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = timedelta(seconds=30)
BOUND_S = 20.0  # a failing fit must end (error on every rank, workers gone) within this


# -- helpers ---------------------------------------------------------------------------------------
@contextmanager
def _deadline(seconds: float):
    """Raise TimeoutError in the main process if the block runs longer than ``seconds``."""
    def fire(signum: int, frame: Any) -> None:
        raise TimeoutError(f"the run did not end within {seconds} s: some rank hangs")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _fit_expecting_failure(model: pl.LightningModule, *, timeout: timedelta = TIMEOUT,
                           bound: float = BOUND_S, callbacks: tuple = (),
                           train_dataloader: Any = "default", **trainer_kwargs: Any
                           ) -> tuple[BaseException, float]:
    """Fork-launcher fit on 2 ranks that must fail: returns (error in the main process, seconds).

    Asserts it ended within ``bound`` and that no worker process is left alive.
    """
    pl.seed_everything(0, verbose=False)
    strategy = VeScaleFSDPStrategy(start_method="fork", timeout=timeout)
    t = trainer(strategy, callbacks=list(callbacks), **trainer_kwargs)
    start = time.monotonic()
    error: Optional[BaseException] = None
    try:
        with _deadline(bound):
            if train_dataloader == "default":
                t.fit(model, dataloader())
            else:
                t.fit(model, train_dataloader)
    except BaseException as e:  # noqa: BLE001
        error = e
    elapsed = time.monotonic() - start
    procs = getattr(strategy.launcher, "procs", [])
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not isinstance(error, TimeoutError), error
    assert not alive, f"{len(alive)} worker(s) still running after the fit raised"
    assert error is not None, "the fit was expected to fail"
    assert elapsed < bound
    return error, elapsed


class FailingGPT(TinyGPT):
    """Raises on ``fail_rank`` at ``where``: "training_step" (batch ``at``) or "configure_model"."""

    def __init__(self, fail_rank: int, where: str = "training_step", at: int = 1,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fail_rank, self.where, self.at = fail_rank, where, at

    def configure_model(self) -> None:
        if self.where == "configure_model" and self.global_rank == self.fail_rank:
            raise RuntimeError(f"boom in configure_model on rank {self.global_rank}")
        super().configure_model()

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.where == "training_step" and self.global_rank == self.fail_rank \
                and batch_idx == self.at:
            raise RuntimeError(f"boom on rank {self.global_rank}")
        return super().training_step(batch, batch_idx)


# -- (a) a rank raises in training_step ------------------------------------------------------------
@pytest.mark.parametrize("fail_rank", [0, 1])
def test_rank_raising_in_training_step_ends_the_fit(fail_rank):
    error, elapsed = _fit_expecting_failure(FailingGPT(fail_rank), max_steps=3)
    assert f"boom on rank {fail_rank}" in str(error)
    assert elapsed < TIMEOUT.total_seconds() / 2  # propagated, not timed out


def test_fork_launcher_on_exception_checkpoint_does_not_overwrite_with_untrained_weights(tmp_path):
    """The fork launcher runs `on_exception` hooks in the main process, whose model never trained:
    before the fix OnExceptionCheckpoint wrote the initial weights there (global_step 0), replacing
    whatever was at its path (the file a later run auto-resumes from)."""
    from lightning.pytorch.callbacks import OnExceptionCheckpoint

    with pytest.warns(UserWarning, match="Not saving the checkpoint.*untrained model"):
        error, _ = _fit_expecting_failure(FailingGPT(1), max_steps=3, enable_checkpointing=True,
                                          callbacks=(OnExceptionCheckpoint(str(tmp_path)),))
    assert "boom on rank 1" in str(error)
    assert not (tmp_path / "on_exception.ckpt").exists()


def _run_script(tmp_path: Path, fail_rank: int, *extra: str, bound: float = 120.0
                ) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "tests/lightning/scripts/fail_fit.py", str(tmp_path), str(fail_rank),
           *extra]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=bound)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"the default-launcher fit did not end within {bound} s")
    elapsed = time.monotonic() - start
    # rank 1 (a child of rank 0) must not outlive the run for long
    deadline = time.monotonic() + 15
    for r in range(2):
        assert (tmp_path / f"pid_rank{r}").is_file(), f"rank {r} never started:\n{out[-3000:]}"
        pid = int((tmp_path / f"pid_rank{r}").read_text())
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"rank {r} (pid {pid}) was left running")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, ""), elapsed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of ours counts as gone
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return Path(f"/proc/{pid}").exists() and "Z" not in _proc_state(pid)


def _proc_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return "Z"


@pytest.mark.slow
@pytest.mark.parametrize("fail_rank", [0, 1])
def test_default_launcher_rank_failure_ends_every_rank(tmp_path, fail_rank):
    """Every rank handles its own exception (default launcher / torchrun path)."""
    out, _ = _run_script(tmp_path, fail_rank)
    text = out.stdout
    assert out.returncode != 0, text[-3000:]
    assert f"FAILED rank={fail_rank}" in text and f"boom on rank {fail_rank}" in text, text[-3000:]
    assert "FINISHED" not in text


@pytest.mark.slow
def test_on_exception_checkpoint_on_one_failing_rank_does_not_wait_for_the_timeout(tmp_path):
    """Before the fix the failing rank sat in the checkpoint's collectives until the process-group
    timeout (30 min by default) and its peer in its all-gather: both died only at the timeout."""
    out, _ = _run_script(tmp_path, 1, "--on-exception-checkpoint")
    text = out.stdout
    assert out.returncode != 0, text[-3000:]
    line = next(ln for ln in text.splitlines() if ln.startswith("FAILED rank=1"))
    assert "is handling an exception (RuntimeError: boom on rank 1)" in line, line
    after = float(line.split("after=")[1].split()[0])
    assert after < 20, line  # agreement window (3 s here) + teardown, not the 60 s timeout
    assert not (tmp_path / "ckpt").exists()  # nothing half-written at the final name


# -- (b) a rank fails while a sharded checkpoint is being written ----------------------------------
class _SaveTwice(Callback):
    """Save to ``path`` after step 1 (kept as a reference copy), then again after step 2 with a
    failure injected on one rank at ``how``."""

    def __init__(self, path: Path, how: str) -> None:
        self.path, self.how = path, how

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == 1:
            trainer.save_checkpoint(self.path)
            if trainer.global_rank == 0:
                shutil.copytree(self.path, self.path.with_name("reference"))
            trainer.strategy.barrier()
        elif trainer.global_step == 2:
            _inject(self.how, trainer.global_rank)
            trainer.save_checkpoint(self.path)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if self.how == "hook" and trainer.global_step == 2 and trainer.global_rank == 1:
            raise RuntimeError("boom in on_save_checkpoint on rank 1")


def _inject(how: str, rank: int) -> None:
    """Make this worker process (a fork) fail inside the save."""
    if how == "write" and rank == 1:  # one rank's storage fails inside DCP
        from torch.distributed.checkpoint.filesystem import _FileSystemWriter

        def write_data(self, plan, planner):
            raise OSError("injected: no space left on device (rank 1)")

        _FileSystemWriter.write_data = write_data
    elif how == "rename" and rank == 0:  # moving the new directory into place fails
        from lightning_vescale.checkpoint import _files

        # a file system without an atomic exchange: the two-rename fallback and its rollback
        _files.exchange = lambda a, b: False
        real = os.replace
        calls = []

        def replace(src, dst):
            calls.append(src)
            if len(calls) == 2:  # after the old checkpoint was moved aside
                raise OSError("injected: rename failed (rank 0)")
            return real(src, dst)

        os.replace = replace


@pytest.mark.parametrize("how", ["write", "hook", "rename"])
def test_failed_sharded_save_keeps_the_previous_checkpoint(tmp_path, how):
    path = tmp_path / "last.ckpt"
    error, _ = _fit_expecting_failure(TinyGPT(), callbacks=(_SaveTwice(path, how),), max_steps=4)
    # (whichever rank exits first is the error the main process reports)
    expected = {"write": ["injected: no space left"], "hook": ["boom in on_save_checkpoint"],
                "rename": ["injected: rename failed", "Rank 0 failed to publish"]}[how]
    assert any(e in str(error) for e in expected), str(error)[-2000:]
    # the checkpoint of step 1 is byte-for-byte what it was, and loadable
    reference = tmp_path / "reference"
    assert sorted(p.name for p in path.iterdir()) == sorted(p.name for p in reference.iterdir())
    match, mismatch, errors = filecmp.cmpfiles(path, reference,
                                               [p.name for p in reference.iterdir()], shallow=False)
    assert not mismatch and not errors
    full = ckpt.consolidate(path)
    assert full["global_step"] == 1 and "model.tok_emb.weight" in full["state_dict"]
    # nothing but hidden temporaries next to it (removed by the next save)
    visible = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert visible == ["last.ckpt", "reference"]


def test_resume_from_the_checkpoint_that_survived_a_failed_save(tmp_path):
    path = tmp_path / "last.ckpt"
    _fit_expecting_failure(TinyGPT(), callbacks=(_SaveTwice(path, "write"),), max_steps=4)
    pl.seed_everything(0, verbose=False)
    strategy = VeScaleFSDPStrategy(start_method="fork", timeout=TIMEOUT)
    with _deadline(BOUND_S):
        trainer(strategy, max_steps=3).fit(TinyGPT(out_dir=str(tmp_path), tag="resumed"),
                                           dataloader(), ckpt_path=str(path))
    for r in range(2):  # resumed at global step 1: steps 2 and 3 remain
        rank_losses = torch.load(tmp_path / f"resumed_rank{r}.pt")
        assert len(rank_losses) == 2 and all(3.0 < x < 6.0 for x in rank_losses), rank_losses


# -- (c) a rank skips or adds collectives ----------------------------------------------------------
def test_rank_raising_in_configure_model_ends_the_fit():
    error, _ = _fit_expecting_failure(FailingGPT(1, where="configure_model"), max_steps=2)
    assert "boom in configure_model on rank 1" in str(error)


class _Uneven(TinyGPT):
    """Rank 0 gets 3 batches, rank 1 gets 2 (no distributed sampler): rank 1 runs out first and
    enters end-of-fit collectives that rank 0 never matches."""

    def train_dataloader(self):
        return dataloader(world_size=1, steps_per_epoch=3 if self.global_rank == 0 else 2)


@pytest.mark.slow
def test_uneven_batches_fail_at_the_timeout_instead_of_hanging():
    timeout = timedelta(seconds=5)
    error, elapsed = _fit_expecting_failure(
        _Uneven(), timeout=timeout, bound=25.0, train_dataloader=None, max_epochs=1,
        use_distributed_sampler=False)
    # The rank whose collective times out fails first (gloo: "Timed out ..." or "Application
    # timeout caused pair closure"); its exit then fails the peer's collective ("Connection closed
    # by peer"). The launcher re-raises whichever exit it sees first, so either text is right; the
    # elapsed time below is what shows that the timeout, not a hang or anything faster, ended it.
    assert re.search(r"timed out|timeout|closed by peer", str(error), re.IGNORECASE), \
        str(error)[-2000:]
    assert elapsed >= timeout.total_seconds()  # the timeout, not anything faster, ended it


# -- (d) bad user input ----------------------------------------------------------------------------
@pytest.mark.parametrize("cls", [VeScaleFSDPStrategy, VeScaleFabricStrategy])
def test_timeout_argument_is_validated(cls):
    with pytest.raises(ValueError, match=r"timeout must be positive, got -5 s.*timedelta"):
        cls(timeout=timedelta(seconds=-5))
    with pytest.raises(ValueError, match="timeout must be positive"):
        cls(timeout=timedelta(0))
    with pytest.raises(TypeError, match=r"timeout must be a datetime.timedelta.*"
                                        r"timeout=timedelta\(seconds=30\)"):
        cls(timeout=30)
    assert cls(timeout=None)._timeout is None
    assert cls(timeout=timedelta(seconds=7))._timeout == timedelta(seconds=7)


def test_other_bad_arguments_name_the_parameter():
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    with pytest.raises(ValueError, match="CheckpointIO plugin TorchCheckpointIO would be ignored"):
        VeScaleFSDPStrategy(checkpoint_io=TorchCheckpointIO())
    with pytest.raises(ValueError, match="CheckpointIO plugin AsyncCheckpointIO would be ignored"):
        pl.Trainer(strategy="vescale_fsdp", accelerator="cpu", devices=2,
                   plugins=[AsyncCheckpointIO()])
    with pytest.raises(ValueError, match="start_method must be one of"):
        VeScaleFSDPStrategy(start_method="thread")
    with pytest.raises(ValueError, match="granularity must be >= 1"):
        VeScaleFSDPStrategy(granularity=0)
    with pytest.raises(TypeError, match="granularity must be an int"):
        VeScaleFSDPStrategy(granularity=2.5)
    with pytest.raises(ValueError, match="optimizer_min_block_numel"):
        VeScaleFSDPStrategy(optimizer_min_block_numel=-1)
    with pytest.raises(ValueError, match="granularity=100 is not a multiple of "
                                         "optimizer_block_size=256.*Use granularity=256"):
        VeScaleFabricStrategy(granularity=100)


def test_sharding_units_matching_nothing_fail_on_every_rank_at_setup():
    pl.seed_everything(0, verbose=False)
    strategy = VeScaleFSDPStrategy(start_method="fork", timeout=TIMEOUT, sharding_units=["Nope"])
    t = trainer(strategy, max_steps=1)
    with _deadline(BOUND_S), pytest.raises(Exception, match=r"sharding_units entry 'Nope' matches "
                                                             r"no submodule"):
        t.fit(TinyGPT(), dataloader())
    assert not any(p.is_alive() for p in strategy.launcher.procs)


def test_exception_agreement_counts_every_rank(worlds):
    assert worlds(2).run(_agree_body) == [[True, False, False]] * 2


def _agree_body():
    all_arrive = all_ranks_arrive("t/all", dist.get_world_size(), timedelta(seconds=5))
    only_rank0 = (all_ranks_arrive("t/one", 2, timedelta(seconds=0.3))
                  if dist.get_rank() == 0 else False)
    dist.barrier()
    # Rank 1 gives up after 0.3 s; rank 0 arrives later and sees both counts: it must still
    # take the recorded decision (not all ranks) instead of entering a collective alone.
    if dist.get_rank() == 0:
        time.sleep(1.0)
    late = all_ranks_arrive("t/late", 2, timedelta(seconds=0.3))
    dist.barrier()
    return [all_arrive, only_rank0, late]


def test_missing_checkpoint_points_to_one_moved_aside_by_an_interrupted_save(tmp_path):
    (tmp_path / ".last.ckpt.old-0123456789").mkdir()  # a kill between the two renames
    with pytest.raises(FileNotFoundError, match=r"moved aside by an interrupted save exists at "
                                                r".*\.last\.ckpt\.old-0123456789"):
        ckpt.check_checkpoint_path(tmp_path / "last.ckpt")
