"""Multi-node starts that cannot work, found before they wait for the timeout.

Design note [other-nodes]
-------------------------
``Trainer(num_nodes=2, devices=2)`` run as a plain ``python script.py`` on one host starts the
2 processes of this node and then waits in ``init_process_group`` for the other 2 for the whole
process-group timeout (30 minutes by default), printing only torch's ``MEMBER: 1/4, 2/4``.
Nobody starts them, and nobody could: with no launcher environment (torchrun, SLURM, ...) and no
``MASTER_PORT``, Lightning's default environment picks a *random free port* on this host, which
no other node can know. So that case is refused in the launching process, before any rank
starts, naming the commands that do start a multi-node run (:func:`check_other_nodes_can_join`).

Every other multi-node start may be right (``MASTER_ADDR``/``MASTER_PORT``/``NODE_RANK`` set by
hand on each node, torchrun, SLURM): there, while this process waits for the others to join,
:func:`waiting_for_other_nodes` prints every ``WAIT_MESSAGE_EVERY_S`` seconds what it waits for
and how the other nodes must be started, instead of waiting silently.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from lightning.fabric.plugins.environments import LightningEnvironment

__all__ = ["WAIT_MESSAGE_EVERY_S", "check_other_nodes_can_join", "waiting_for_other_nodes"]

#: How often a process waiting for other nodes to join says so (seconds).
WAIT_MESSAGE_EVERY_S = 30.0


def _how_to_start(num_nodes: int, devices: int) -> str:
    return (
        f"Start every node with a launcher: on each node i in 0..{num_nodes - 1}, `torchrun "
        f"--nnodes {num_nodes} --nproc-per-node {devices} --node-rank i --master-addr <node 0's "
        f"address> --master-port 29500 your_script.py`; or in a SLURM allocation `srun --nodes "
        f"{num_nodes} --ntasks-per-node {devices} python your_script.py`; or set MASTER_ADDR, "
        f"MASTER_PORT and NODE_RANK on every node and run the script on each")


def check_other_nodes_can_join(cluster_environment: Any, *, num_nodes: int, devices: int) -> None:
    """In the launching process: refuse a multi-node run that no other node can join.

    That is: ``num_nodes > 1``, Lightning's default environment launching the processes itself
    (no torchrun/SLURM/... environment, no ``LOCAL_RANK``), and no ``MASTER_PORT`` (nor
    ``STANDALONE_PORT``), so this host would listen on a random port. See [other-nodes].
    """
    if num_nodes <= 1:
        return
    if type(cluster_environment) is not LightningEnvironment:
        return  # a launcher or scheduler (torchrun, SLURM, LSF, ...) started and wired the ranks
    if cluster_environment.creates_processes_externally:
        return  # LOCAL_RANK set: the user launches every process
    if "MASTER_PORT" in os.environ or "STANDALONE_PORT" in os.environ:
        return  # a port the other nodes can be told: they may be started by hand
    raise RuntimeError(
        f"num_nodes={num_nodes} with devices={devices} needs {num_nodes * devices} processes, "
        f"but this command starts only this node's {devices}, and no other node can join it: no "
        "launcher environment (torchrun, SLURM, ...) was found and MASTER_PORT is not set, so "
        "this host would listen on a random port that no other node knows, and wait for the "
        f"process-group timeout. {_how_to_start(num_nodes, devices)}. For a single node, pass "
        "num_nodes=1.")


@contextlib.contextmanager
def waiting_for_other_nodes(cluster_environment: Any, *, num_nodes: int, devices: int,
                            global_rank: int,
                            every_s: float | None = None) -> Iterator[None]:
    """Around ``init_process_group``: while it waits (multi-node only), print every ``every_s``
    seconds (default :data:`WAIT_MESSAGE_EVERY_S`) what this process waits for ([other-nodes])."""
    if num_nodes <= 1:
        yield
        return
    every = WAIT_MESSAGE_EVERY_S if every_s is None else every_s
    done = threading.Event()
    start = time.monotonic()
    env = type(cluster_environment).__name__
    address = f"{cluster_environment.main_address}:{cluster_environment.main_port}"

    def remind() -> None:
        while not done.wait(every):
            print(
                f"[lightning_vescale] rank {global_rank}: still waiting after "
                f"{time.monotonic() - start:.0f} s for all {num_nodes * devices} processes "
                f"(num_nodes={num_nodes} x devices={devices}) to join at {address} "
                f"({env}). Every node must be started with the same settings and its own node "
                f"rank. {_how_to_start(num_nodes, devices)}.", file=sys.stderr, flush=True)

    thread = threading.Thread(target=remind, name="lightning_vescale-wait-for-nodes", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
