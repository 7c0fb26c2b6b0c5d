"""Launching scripts as users do (``torchrun``, a script launcher) from tests, side by side.

Why it exists
-------------
The README commands and the multi-node tests start real launchers in fresh processes. Those
processes end with the interpreter's own finalisation, where gloo has a known abort
(:data:`GLOO_EXIT_ABORT`). Three tests met it after their work was complete; each had its own
copy of the string, its own idea of the cause and its own retry. This module holds the one
string, the one account of it and the one retry.

Contract
--------
* :func:`launch_side_by_side` starts several commands at once (the "nodes" of one run) and
  returns their exit codes and merged outputs; a command still running at the timeout, or left
  behind by another's failure, is killed.
* :func:`once_more_after_exit_abort` calls ``start`` and, only when the attempt failed with
  :data:`GLOO_EXIT_ABORT` *and* ``finished`` says its work was complete, calls it once more.
  Any other failure, an abort before the work was complete, and a second abort raise
  ``AssertionError`` with the outputs.
"""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path
from typing import Callable, Sequence

#: What a gloo process prints when it aborts while its interpreter finalises, after the script's
#: work is done: seen in CI after ``fully_shard_torchrun.py``, after Lightning's own
#: ``ddp_fork``/``ddp_spawn``, and in 1 of 13 local runs of ``quantized_comm.py`` and 2 of ~10
#: of the two-node HSDP test; 0 of 28 local runs of ``fully_shard_torchrun.py`` (16 of them with
#: both cores busy) reproduced it. The likely mechanism (pytorch/pytorch#179291): a gloo worker
#: thread still holds the last reference to a finished collective's tensor whose Python object
#: was dropped (torch 2.13 keeps such a tensor alive, owned by C++), and releasing it needs the
#: GIL, which a thread cannot take once the interpreter finalises. ``destroy_process_group()``
#: does not end those threads while a ``DeviceMesh`` lives, and torch's DTensor caches keep the
#: mesh alive, so a script cannot close the window itself (docs/troubleshooting.md).
GLOO_EXIT_ABORT = "terminate called without an active exception"


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a launcher's ``--master-port``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_side_by_side(argvs: Sequence[Sequence[str]], *, cwd: Path, env: dict[str, str],
                        timeout: float) -> tuple[list[int], list[str]]:
    """Start every ``argv`` at once; return their exit codes and outputs (stdout and stderr
    merged), in order. None is left running: at the timeout, the ones still running are killed
    (``subprocess.TimeoutExpired`` propagates)."""
    procs = [subprocess.Popen(list(argv), cwd=cwd, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for argv in argvs]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return [p.returncode for p in procs], outs


def once_more_after_exit_abort(start: Callable[[], tuple[list[int], list[str]]],
                               finished: Callable[[list[str]], bool]) -> list[str]:
    """``start()`` (exit codes, outputs); started once more only if it failed by
    :data:`GLOO_EXIT_ABORT` after ``finished(outputs)`` (its work) was complete. Returns the
    outputs of the attempt that exited 0; any other failure, or the abort twice, raises."""
    for attempt in (1, 2):
        codes, outs = start()
        if all(code == 0 for code in codes):
            return outs
        aborted = any(GLOO_EXIT_ABORT in out for out in outs)
        if attempt == 2 or not aborted or not finished(outs):
            raise AssertionError(f"exit codes {codes}\n" + "\n".join(o[-4000:] for o in outs))
    raise AssertionError("unreachable: the second attempt returns or raises")
