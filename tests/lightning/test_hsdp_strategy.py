"""The strategies' ``device_mesh`` argument (issue 13): forms, checks, LightningCLI, clipping.

Nothing here trains a model. Construction-time checks need no processes; the checks that need
the world (its size, a real ``DeviceMesh``) and the HSDP-aware gradient clipping run in forked
gloo worlds of 4 ranks. The Trainer/Fabric runs on 2-D meshes are in ``test_hsdp_trainer.py``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_vescale import VeScaleFabricStrategy, VeScaleFSDPStrategy
from lightning_vescale._lightning.device_mesh import build_device_mesh, validate_device_mesh

ROOT = Path(__file__).resolve().parents[2]
FACES = [VeScaleFSDPStrategy, VeScaleFabricStrategy]
HSDP_CONFIG = ROOT / "examples" / "configs" / "hsdp_llama_2x8gpu.yaml"


# -- construction ----------------------------------------------------------------------------------
@pytest.mark.parametrize("face", FACES, ids=lambda f: f.__name__)
@pytest.mark.parametrize("value,expected", [(None, None), ((2, 2), (2, 2)), ([2, 4], (2, 4)),
                                            ((1, 8), (1, 8))])
def test_accepted_forms(face, value, expected):
    assert face(device_mesh=value)._device_mesh_spec == expected


BAD = [
    (4, TypeError, r"device_mesh must be None .* \(replicas, shard_size\) pair .*got 4"),
    ("2x2", TypeError, r"device_mesh must be None .*got '2x2'"),
    ((2.0, 2), TypeError, r"device_mesh=\(2.0, 2\): the entries must be ints"),
    ((True, 2), TypeError, r"the entries must be ints"),
    ((4,), ValueError, r"device_mesh=\(4,\) has 1 entries; .*\(replicas, shard_size\) pair.*"
                       r"device_mesh=None \(or \(1, 4\)\)"),
    ((2, 2, 2), ValueError, r"has 3 entries.*tensor-parallel.*sub-mesh"),
    ((0, 4), ValueError, r"device_mesh=\(0, 4\): replicas \(0\) and shard_size \(4\) must be "
                         r"positive"),
    ([2, -1], ValueError, r"shard_size \(-1\) must be positive"),
]


@pytest.mark.parametrize("face", FACES, ids=lambda f: f.__name__)
@pytest.mark.parametrize("value,error,match", BAD, ids=lambda c: repr(c)[:20])
def test_bad_shape_fails_at_construction(face, value, error, match):
    with pytest.raises(error, match=match):
        face(device_mesh=value)


# -- against the world size (no process group needed for the tuple form) --------------------------
@pytest.mark.parametrize("spec,nodes,devices,match", [
    ((2, 3), 2, 2, r"device_mesh=\(2, 3\) describes 6 ranks \(replicas 2 x shard_size 3\) but "
                   r"the run has 4 processes \(num_nodes=2 x devices=2\): use device_mesh=\(2, "
                   r"2\) \(shard inside each node, replicate across the 2 nodes\)"),
    ((3, 1), 1, 4, r"describes 3 ranks .* 4 processes \(num_nodes=1 x devices=4\): use a pair "
                   r"whose product is 4, e.g. \(1, 4\), \(2, 2\), \(4, 1\), or device_mesh=None"),
    ((2, 8), 2, 4, r"describes 16 ranks .* 8 processes .*device_mesh=\(2, 4\)"),
])
def test_shape_not_matching_the_world_fails_at_setup(spec, nodes, devices, match):
    with pytest.raises(ValueError, match=match):
        build_device_mesh(spec, device_type="cpu", world_size=nodes * devices, num_nodes=nodes,
                          devices=devices)


def test_trainer_and_fabric_refuse_a_wrong_shape_before_launching(monkeypatch):
    """The connectors tell the strategy its devices and nodes, then configure the launcher: the
    shape is checked there, in the main process, before any rank starts."""
    import lightning.pytorch as pl

    monkeypatch.setenv("MASTER_PORT", "29514")  # num_nodes=2 by hand: other nodes can join
    from lightning.fabric import Fabric

    with pytest.raises(ValueError, match=r"device_mesh=\(2, 2\) describes 4 ranks .* the run has "
                                         r"2 processes \(num_nodes=1 x devices=2\)"):
        pl.Trainer(accelerator="cpu", devices=2, logger=False,
                   strategy=VeScaleFSDPStrategy(device_mesh=(2, 2), start_method="fork"))
    with pytest.raises(ValueError, match=r"describes 8 ranks .* 4 processes \(num_nodes=2 x "
                                         r"devices=2\): use device_mesh=\(2, 2\)"):
        pl.Trainer(accelerator="cpu", devices=2, num_nodes=2, logger=False,
                   strategy=VeScaleFSDPStrategy(device_mesh=(2, 4)))
    with pytest.raises(ValueError, match=r"describes 3 ranks .* 2 processes"):
        Fabric(accelerator="cpu", devices=2, strategy=VeScaleFabricStrategy(device_mesh=(3, 1)))
    t = pl.Trainer(accelerator="cpu", devices=2, num_nodes=2, logger=False,
                   strategy=VeScaleFSDPStrategy(device_mesh=(4, 1)))  # any shape that fits
    assert t.strategy._device_mesh_spec == (4, 1)


def _meshes_at_world_4():
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    out = {"2d_same": build_device_mesh(mesh, device_type="cpu", world_size=4, num_nodes=2,
                                        devices=2) is mesh}
    built = build_device_mesh((2, 2), device_type="cpu", world_size=4, num_nodes=2, devices=2)
    out["built"] = (tuple(built.shape), built.mesh_dim_names, list(built.get_coordinate()))
    flat = build_device_mesh((1, 4), device_type="cpu", world_size=4, num_nodes=1, devices=4)
    out["flat"] = (tuple(flat.shape), flat.mesh_dim_names)
    for name, bad in (("sub", mesh["dp_shard"]),
                      ("3d", init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("a", "b", "c")))):
        try:
            validate_device_mesh(bad)
            build_device_mesh(bad, device_type="cpu", world_size=4, num_nodes=2, devices=2)
        except ValueError as e:
            out[name] = str(e)
    return out


def test_device_mesh_objects(worlds):
    for rank, out in enumerate(worlds(4).run(_meshes_at_world_4)):
        assert out["2d_same"]  # a DeviceMesh of the right size is used as it is
        # (replicas, shard_size): consecutive ranks share a shard group (a node)
        assert out["built"] == ((2, 2), ("dp_replicate", "dp_shard"), [rank // 2, rank % 2])
        assert out["flat"] == ((4,), ("dp_shard",))  # one replica = full sharding, 1-D
        assert "covers 2 ranks but the run has 4 processes (num_nodes=2 x devices=2)" in out["sub"]
        assert "a 3-D DeviceMesh of shape (1, 2, 2)" in out["3d"]


# -- LightningCLI ------------------------------------------------------------------------------------
def test_lightning_cli_parses_a_list(tmp_path):
    from examples.cli import main

    cfg = tmp_path / "hsdp.yaml"
    cfg.write_text("trainer:\n  accelerator: cpu\n  devices: 4\n  logger: false\n  strategy:\n"
                   "    class_path: lightning_vescale.VeScaleFSDPStrategy\n    init_args:\n"
                   "      device_mesh: [2, 2]\n")
    cli = main(args=["--config", str(cfg)], run=False)
    assert isinstance(cli.trainer.strategy, VeScaleFSDPStrategy)
    assert cli.trainer.strategy._device_mesh_spec == (2, 2)
    cli = main(args=["--config", str(cfg), "--trainer.strategy.init_args.device_mesh=[4, 1]"],
               run=False)
    assert cli.trainer.strategy._device_mesh_spec == (4, 1)
    with pytest.raises(ValueError, match=r"replicas \(0\) and shard_size \(4\) must be positive"):
        main(args=["--config", str(cfg), "--trainer.strategy.init_args.device_mesh=[0, 4]"],
             run=False)


def test_the_2x8_hsdp_config_parses():
    """The 2 nodes x 8 GPUs config: parsed (no GPUs here, so the Trainer is not built), its
    strategy constructed, and its shape matching the launcher's nodes and devices."""
    import yaml
    from lightning.pytorch.cli import LightningCLI

    from examples.llama import LlamaModule, TokenDataModule

    class ParseOnly(LightningCLI):
        def instantiate_classes(self) -> None:
            pass

    cli = ParseOnly(LlamaModule, TokenDataModule, args=["--config", str(HSDP_CONFIG)], run=False,
                    save_config_kwargs={"overwrite": True})
    t = cli.config.trainer
    assert (t.num_nodes, t.devices) == (2, 8)
    assert t.strategy.class_path == "lightning_vescale.VeScaleFSDPStrategy"
    init = dict(vars(t.strategy.init_args))
    assert init["device_mesh"] == (2, 8)
    strategy = VeScaleFSDPStrategy(**{k: v for k, v in init.items() if v is not None})
    assert strategy._device_mesh_spec == (2, 8)
    raw = yaml.safe_load(HSDP_CONFIG.read_text())
    assert raw["trainer"]["strategy"]["init_args"]["device_mesh"] == [2, 8]


# -- gradient clipping counts each element once on an HSDP mesh --------------------------------------
def _clip_on_2d_mesh():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from lightning_vescale.precision import clip_grad_norm_

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    shard = mesh.get_local_rank(1)
    torch.manual_seed(0)
    full = [torch.randn(6, 3), torch.randn(4)]  # the same on every rank
    params = []
    for f in full:
        p = torch.nn.Parameter(DTensor.from_local(f.chunk(2)[shard].clone(), mesh,
                                                  (Replicate(), Shard(0)), run_check=False))
        p.grad = DTensor.from_local(f.chunk(2)[shard].clone(), mesh, (Replicate(), Shard(0)),
                                    run_check=False)
        params.append(p)
    total = clip_grad_norm_(params, max_norm=1.0)
    expected = math.sqrt(sum(float(f.pow(2).sum()) for f in full))
    clipped = [p.grad.full_tensor() for p in params]
    return float(total), expected, [c - f / expected for c, f in zip(clipped, full)], \
        dist.get_world_size()


def test_clip_grad_norm_counts_each_element_once_on_an_hsdp_mesh(worlds):
    for total, expected, diffs, world in worlds(4).run(_clip_on_2d_mesh):
        assert world == 4
        assert abs(total - expected) <= 1e-5 * expected, (total, expected)  # not x sqrt(2)
        assert all(float(d.abs().max()) < 1e-5 for d in diffs)


def test_the_2x8_slurm_script_is_valid_bash_and_matches_the_config():
    import subprocess

    script = ROOT / "examples" / "slurm_hsdp_2x8.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "#SBATCH --nodes=2" in text and "#SBATCH --ntasks-per-node=8" in text
    assert "srun python examples/llama.py fit --config examples/configs/hsdp_llama_2x8gpu.yaml" \
        in text
    cfg = HSDP_CONFIG.read_text()
    assert "num_nodes: 2" in cfg and "devices: 8" in cfg and "device_mesh: [2, 8]" in cfg
