"""Checkpoint trust at 2 ranks, through the loaders the strategies use (design note
[checkpoint-trust]): damaged files are named with the rank, crafted files are refused before
anything in them runs (each payload writes a marker file when unpickled).
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from examples.gpt import GPT, GPTConfig
from lightning_vescale import VeScaleFabricStrategy
from lightning_vescale import checkpoint as ckpt
from lightning_vescale._lightning.sharding import ShardGranularity, shard_model
from lightning_vescale.checkpoint._trust import INTEGRITY_FILENAME, CheckpointLoadError
from lightning_vescale.mesh import init_mesh

CFG = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=True)


class _WritesMarker:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def _sharded_model(seed: int):
    torch.manual_seed(seed)
    model = GPT(CFG)
    shard_model(model, units=None, mesh=init_mesh("cpu", dist.get_world_size()),
                device=torch.device("cpu"), mp_policy=None,
                granularity=ShardGranularity(granularity=None, optimizer_block_size=None,
                                             min_block_numel=0),
                reshard_after_forward=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.block_size), generator=torch.Generator()
                      .manual_seed(dist.get_rank()))
    model(x, x).backward()
    opt.step()
    return model, opt


def _save(path: Path, payload: object = None) -> None:
    model, opt = _sharded_model(0)
    optimizer = ckpt.optimizer_state(model, opt, full=False)
    if payload is not None:  # a hyper-parameter every loader reads back (a DCP byte entry)
        optimizer["param_groups"][0]["lr"] = payload
    tensors = {"state_dict": ckpt.model_state(model, full=False), "optimizer_0": optimizer}
    ckpt.save_sharded(path, tensors, {"global_step": 1})


def _load(path: Path, **kwargs) -> str | None:
    model, opt = _sharded_model(1)
    try:
        ckpt.load_sharded(path, model, {"optimizer_0": opt}, **kwargs)
    except CheckpointLoadError as err:
        return str(err)
    return None


def _item_file(path: Path, fqn_part: str) -> tuple[Path, int, int]:
    from lightning_vescale.checkpoint._trust import read_metadata

    for index, info in read_metadata(path).storage_data.items():
        if fqn_part in index.fqn and info.relative_path == "__1_0.distcp":
            return path / info.relative_path, info.offset, info.length
    raise AssertionError(fqn_part)


def _damage_and_load(directory: str, damage: str):
    path = Path(directory) / "ckpt"
    _save(path)
    dist.barrier()
    if dist.get_rank() == 0:
        if damage == "flip":
            file, offset, length = _item_file(path, "state_dict.blocks.0.mlp.fc.weight")
            data = bytearray(file.read_bytes())
            data[offset + length - 16] ^= 0x20  # inside the stored tensor's bytes
            file.write_bytes(bytes(data))
        elif damage == "truncate":
            file = path / "__1_0.distcp"
            file.write_bytes(file.read_bytes()[: file.stat().st_size // 3])
        elif damage == "delete":
            os.remove(path / "__1_0.distcp")
        elif damage == "metadata":
            (path / ".metadata").write_bytes((path / ".metadata").read_bytes()[:100])
        elif damage == "meta.pt":
            data = bytearray((path / "meta.pt").read_bytes())
            data[len(data) // 2] ^= 0x01
            (path / "meta.pt").write_bytes(bytes(data))
    dist.barrier()
    return _load(path)


@pytest.mark.parametrize("damage,expected", [
    ("flip", r"__1_0\.distcp is corrupted: item 'state_dict\.blocks\.0\.mlp\.fc\.weight'"),
    ("truncate", r"__1_0\.distcp is truncated"),
    ("delete", r"__1_0\.distcp is missing"),
    ("metadata", r"\.metadata fails its integrity check"),
    ("meta.pt", r"meta\.pt fails its integrity check"),
])
def test_damaged_files_are_named(worlds, tmp_path, damage, expected):
    import re

    errors = worlds(2).run(_damage_and_load, str(tmp_path), damage)
    for error in errors:
        assert error is not None and re.search(expected, error), error
    assert all(re.match(r"\[rank \d\] ", e) for e in errors), errors


def _crafted(directory: str, where: str):
    path = Path(directory) / "ckpt"
    marker = Path(directory) / f"marker-{where}"
    _save(path, _WritesMarker(str(marker)) if where == "bytes" else None)
    dist.barrier()
    if dist.get_rank() == 0 and where == "metadata":
        from lightning_vescale.checkpoint._trust import read_metadata

        metadata = read_metadata(path)
        metadata.planner_data = _WritesMarker(str(marker))  # an attacker's rewrite, manifest
        (path / ".metadata").write_bytes(pickle.dumps(metadata))  # removed to match
        os.remove(path / INTEGRITY_FILENAME)
    if dist.get_rank() == 0 and where == "meta.pt":
        torch.save({"global_step": 1, "evil": _WritesMarker(str(marker))}, path / "meta.pt")
        os.remove(path / INTEGRITY_FILENAME)
    dist.barrier()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no .integrity.json": expected here
        load_error = _load(path)
        fabric_error = _fabric_load(path)
        try:
            ckpt.consolidate(path)
            consolidate_error = None
        except CheckpointLoadError as err:
            consolidate_error = str(err)
    return load_error, fabric_error, consolidate_error, marker.exists()


def _fabric_load(path: Path) -> str | None:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=dist.get_world_size(),
                    strategy=VeScaleFabricStrategy())
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(GPT(CFG))
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    try:
        fabric.load(path, {"state_dict": model, "optimizer_0": opt}, strict=False)
    except CheckpointLoadError as err:
        return str(err)
    return None


@pytest.mark.parametrize("where", ["metadata", "bytes", "meta.pt"])
def test_crafted_checkpoints_are_refused_by_every_loader(worlds, tmp_path, where):
    results = worlds(2).run(_crafted, str(tmp_path), where)
    for load_error, fabric_error, consolidate_error, marker_exists in results:
        for error in (load_error, fabric_error, consolidate_error):
            assert error is not None and "weights_only=False" in error, error
        assert not marker_exists


def test_a_trainer_load_error_names_one_rank(tmp_path):
    """Issue 23: DCP hands a rank's CheckpointLoadError to the others pickled, and unpickling
    re-ran ``__init__`` there, which prefixed the receiving rank too: the Trainer's traceback
    read ``[rank 1] [rank 0] ... is corrupted``. Exactly one prefix, the finder's, everywhere."""
    import re

    from tests.lightning._lit import SaveAtEnd, TinyGPT, dataloader, trainer

    path = tmp_path / "s.ckpt"
    trainer("vescale_fsdp_fork", max_steps=1, callbacks=[SaveAtEnd({"sharded": str(path)})]
            ).fit(TinyGPT(), dataloader())
    from lightning_vescale.checkpoint._trust import read_metadata

    info = next(info for info in read_metadata(path).storage_data.values()
                if info.relative_path == "__1_0.distcp")
    data = bytearray((path / "__1_0.distcp").read_bytes())
    data[info.offset + info.length - 8] ^= 0x20  # rank 0 reads this item: it reports it
    (path / "__1_0.distcp").write_bytes(bytes(data))
    with pytest.raises(Exception) as raised:
        trainer("vescale_fsdp_fork", max_steps=2).fit(TinyGPT(), dataloader(),
                                                      ckpt_path=str(path))
    text = str(raised.value)  # the worker's whole traceback, causes included
    assert "fails its CRC-32 check" in text, text
    assert re.search(r"\[rank \d\] \[rank \d\]", text) is None, text
