"""Multi-node for real: two ``torchrun`` launchers as two "nodes" on this machine (issue 13).

Each "node" is its own ``python -m torch.distributed.run --nnodes 2 --node-rank {0,1}
--nproc-per-node 2`` launcher; they rendezvous over 127.0.0.1 and run
``examples/multinode_trainer.py`` (a Trainer with ``num_nodes=2, devices=2``: Lightning's
``TorchElasticEnvironment``, ranks numbered node by node). The losses of every global rank must
equal those of one node with ``devices=4`` (``--nproc-per-node 4``) and of DDP, with HSDP
(``device_mesh=(2, 2)``: shard inside each node, replicate across nodes) and with full sharding.

Four launches (~20-60 s each on 2 cores): 2 nodes HSDP, 2 nodes full sharding, 1 node HSDP,
1 node DDP. Each launch gets a free port; the script barriers before
``destroy_process_group``.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.launch import free_port, launch_side_by_side, once_more_after_exit_abort

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "multinode_trainer.py"
STEPS = 3

pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _launch(out: Path, tag: str, *, nodes: int, devices: int, args: list[str]) -> list[str]:
    """Start ``nodes`` torchrun launchers side by side (one per "node"); return their outputs.
    Started once more only after gloo's exit-time abort with every rank's results written
    (``tests/launch.py``)."""
    results = [out / f"{tag}_rank{r}.pt" for r in range(nodes * devices)]

    def start() -> tuple[list[int], list[str]]:
        for path in results:
            path.unlink(missing_ok=True)
        port = str(free_port())
        return launch_side_by_side(
            [[sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
              "--node-rank", str(node), "--nproc-per-node", str(devices),
              "--master-addr", "127.0.0.1", "--master-port", port, str(SCRIPT),
              "--num-nodes", str(nodes), "--devices", str(devices), "--steps", str(STEPS),
              "--out", str(out), "--tag", tag, *args] for node in range(nodes)],
            cwd=out, env=_env(), timeout=400)

    return once_more_after_exit_abort(start, lambda _: all(p.is_file() for p in results))


def _losses(out: Path, tag: str) -> list[list[float]]:
    return [torch.load(out / f"{tag}_rank{r}.pt") for r in range(4)]


def _assert_close(a: list[list[float]], b: list[list[float]], rtol: float = 1e-5) -> None:
    for ra, rb in zip(a, b, strict=True):
        assert len(ra) == len(rb) == STEPS, (ra, rb)
        for x, y in zip(ra, rb):
            assert math.isfinite(x) and abs(x - y) <= rtol * abs(y), (a, b)


def test_two_torchrun_nodes_match_one_node_and_ddp(tmp_path):
    outs = _launch(tmp_path, "hsdp_2nodes", nodes=2, devices=2, args=["--device-mesh", "2", "2"])
    assert "vescale_fsdp 2x2 (mesh (2, 2))" in outs[0]  # node 0 holds global rank 0
    _launch(tmp_path, "full_2nodes", nodes=2, devices=2, args=[])
    out1 = _launch(tmp_path, "hsdp_1node", nodes=1, devices=4, args=["--device-mesh", "2", "2"])
    assert "vescale_fsdp 1x4 (mesh (2, 2))" in out1[0]
    _launch(tmp_path, "ddp_1node", nodes=1, devices=4, args=["--strategy", "ddp"])

    ddp = _losses(tmp_path, "ddp_1node")
    assert len({tuple(r) for r in ddp}) == 4  # each rank saw its own data
    assert ddp[0][-1] < ddp[0][0]  # it trains
    for tag in ("hsdp_2nodes", "full_2nodes", "hsdp_1node"):
        _assert_close(_losses(tmp_path, tag), ddp)
