"""A small multi-process harness for CPU/gloo tests.

Why it exists
-------------
Every distributed test needs N ranks with a process group. Starting them with ``spawn`` or
``torchrun`` costs seconds per test; ``fork`` costs ~50 ms (see ``../shared/TESTING.md``).
:class:`World` forks ``world_size`` ranks *once*, initialises a gloo process group in each (with a
timeout, so a hung collective becomes an error), and then runs many sub-cases in them.

Contract
--------
* ``World(n).run(fn, *args, **kwargs)`` calls ``fn(*args, **kwargs)`` on every rank and returns
  the list of per-rank return values (rank order). Return values travel as ``torch.save`` bytes,
  so return plain tensors / python objects (no DTensors: call ``.to_local()``/``.full_tensor()``).
* ``fn`` is sent to the ranks by pickle, so it must be a module-level function of a module the
  ranks have imported. Ranks are forked lazily on the first ``run`` (i.e. after pytest imported
  the test module), so module-level test helpers always qualify.
* If any rank raises, ``run`` raises :class:`RankError` carrying that rank's traceback, and the
  world is torn down (the other ranks may be stuck in a collective); the next ``run`` forks a
  fresh world. If the ranks do not all answer within ``timeout`` seconds the world is killed and
  :class:`TimeoutError` is raised. Nothing can hang the test session.
* :func:`run_distributed` is the one-shot form (fork, run, tear down) for a single case.

Inside ``fn``, ``torch.distributed`` is initialised; ``torch.set_num_threads(1)`` is in effect.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

DEFAULT_PG_TIMEOUT_S = 60.0
DEFAULT_RUN_TIMEOUT_S = 180.0


class RankError(RuntimeError):
    """A rank raised inside a :meth:`World.run` call."""


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


def _rank_main(rank: int, world_size: int, init_file: str, pg_timeout_s: float,
               tasks: "mp.Queue", results: "mp.Queue") -> None:
    torch.set_num_threads(1)
    os.environ["RANK"] = str(rank)
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
    except BaseException:  # noqa: BLE001 - report whatever broke start-up
        results.put((rank, "err", traceback.format_exc()))
        return
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, args, kwargs = item
        try:
            out = fn(*args, **kwargs)
            results.put((rank, "ok", _dumps(out)))
        except BaseException:  # noqa: BLE001 - the parent re-raises it with the traceback
            results.put((rank, "err", traceback.format_exc()))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass


class World:
    """``world_size`` forked gloo ranks that stay up between :meth:`run` calls."""

    def __init__(self, world_size: int, *, pg_timeout_s: float = DEFAULT_PG_TIMEOUT_S,
                 run_timeout_s: float = DEFAULT_RUN_TIMEOUT_S) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.pg_timeout_s = pg_timeout_s
        self.run_timeout_s = run_timeout_s
        self._procs: list[mp.Process] = []
        self._tasks: list[mp.Queue] = []
        self._results: mp.Queue | None = None
        self._tmpdir: str | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    def _start(self) -> None:
        ctx = mp.get_context("fork")
        self._tmpdir = tempfile.mkdtemp(prefix="lv_world_")
        init_file = os.path.join(self._tmpdir, "pg_init")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = []
        for rank in range(self.world_size):
            p = ctx.Process(
                target=_rank_main,
                args=(rank, self.world_size, init_file, self.pg_timeout_s, self._tasks[rank],
                      self._results),
                daemon=True,
            )
            p.start()
            self._procs.append(p)

    def close(self) -> None:
        """Stop all ranks (politely, then by force)."""
        for q, p in zip(self._tasks, self._procs):
            if p.is_alive():
                try:
                    q.put(None)
                except Exception:  # noqa: BLE001
                    pass
        deadline = time.monotonic() + 5.0
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        self._kill()

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        self._procs = []
        self._tasks = []
        self._results = None
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    def __enter__(self) -> "World":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- running -------------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
            **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results."""
        if not self._procs:
            self._start()
        assert self._results is not None
        for q in self._tasks:
            q.put((fn, args, kwargs))
        timeout = self.run_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        outs: dict[int, Any] = {}
        errors: dict[int, str] = {}
        while len(outs) + len(errors) < self.world_size:
            remaining = deadline - time.monotonic()
            if errors:
                # Give the other ranks a moment to fail too (their errors are often the useful
                # ones), but never wait for a rank stuck in a collective with a dead peer.
                remaining = min(remaining, 3.0)
            if remaining <= 0:
                break
            try:
                rank, status, payload = self._results.get(timeout=remaining)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead and not errors:
                    errors.update({r: f"rank {r} died (exit code {self._procs[r].exitcode})"
                                   for r in dead})
                break
            if status == "ok":
                outs[rank] = _loads(payload)
            else:
                errors[rank] = payload
        if errors or len(outs) < self.world_size:
            self._kill()
            name = getattr(fn, "__qualname__", repr(fn))
            if errors:
                detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
                raise RankError(f"{name} failed on rank(s) {sorted(errors)}:\n{detail}")
            missing = sorted(set(range(self.world_size)) - set(outs))
            raise TimeoutError(f"{name}: rank(s) {missing} did not answer within {timeout:.0f}s")
        return [outs[r] for r in range(self.world_size)]


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any,
                    timeout: float | None = None, **kwargs: Any) -> list[Any]:
    """Fork a fresh ``World(world_size)``, run ``fn`` once on every rank, tear it down."""
    with World(world_size) as world:
        return world.run(fn, *args, timeout=timeout, **kwargs)
