"""``python -m lightning_vescale.consolidate IN OUT`` against the full format of the same run.

One 2-rank Trainer run (fork launcher) saves both formats at the same training state; the
command's output must hold exactly the full checkpoint's tensors, load with
``torch.load(weights_only=True)`` and into a plain module, refuse a checkpoint that holds other
objects unless ``--trust`` is given, and never overwrite without ``--force``.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

import lightning_vescale  # noqa: F401
from examples.train_gpt import CharDataModule, GPTModule
from lightning_vescale.consolidate import main
from tests.lightning._lit import SaveAtEnd, trainer

ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass
class Extra:  # a custom class in the hyper-parameters: not loadable with weights_only=True
    note: str = "custom object"


class GPTWithExtra(GPTModule):
    def __init__(self, extra: Extra | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.save_hyperparameters()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = tmp_path_factory.mktemp("consolidate")
    paths = {"sharded": str(out / "sharded.ckpt"), "full": str(out / "full.ckpt")}
    pl.seed_everything(0, verbose=False)
    trainer("vescale_fsdp_fork", max_steps=2, callbacks=[SaveAtEnd(paths)]).fit(
        GPTModule(n_embd=32), CharDataModule(length=64))
    extra = {"sharded": str(out / "extra.ckpt")}
    trainer("vescale_fsdp_fork", max_steps=1, callbacks=[SaveAtEnd(extra)]).fit(
        GPTWithExtra(Extra(), n_embd=32), CharDataModule(length=64))
    return out


def test_consolidate_equals_the_full_format(checkpoints, tmp_path, capsys):
    out = tmp_path / "consolidated.ckpt"
    assert main([str(checkpoints / "sharded.ckpt"), str(out)]) == 0
    assert "wrote full checkpoint" in capsys.readouterr().out
    got = torch.load(out, weights_only=True)  # plain torch, no lightning_vescale needed
    ref = torch.load(checkpoints / "full.ckpt", weights_only=True)
    assert got["state_dict"].keys() == ref["state_dict"].keys()
    for k, v in ref["state_dict"].items():
        assert torch.equal(got["state_dict"][k], v), k
    (g_opt,), (r_opt,) = got["optimizer_states"], ref["optimizer_states"]
    assert g_opt["state"].keys() == r_opt["state"].keys()
    for i, st in r_opt["state"].items():
        for key, v in st.items():
            assert torch.equal(torch.as_tensor(g_opt["state"][i][key]), torch.as_tensor(v))
    assert got["global_step"] == ref["global_step"] == 2

    weights = tmp_path / "weights.pt"
    assert main([str(checkpoints / "sharded.ckpt"), str(weights), "--state-dict-only"]) == 0
    model = GPTModule(n_embd=32)
    model.load_state_dict(torch.load(weights, weights_only=True))
    assert torch.equal(model.state_dict()["model.head.weight"],
                       ref["state_dict"]["model.head.weight"])


def test_consolidate_is_safe_by_default_and_trust_opts_out(checkpoints, tmp_path, capsys):
    out = tmp_path / "extra_full.ckpt"
    with pytest.raises(SystemExit):
        main([str(checkpoints / "extra.ckpt"), str(out)])
    err = capsys.readouterr().err
    assert "cannot consolidate" in err and "--trust" in err and not out.exists()
    assert main([str(checkpoints / "extra.ckpt"), str(out), "--trust"]) == 0
    assert "weights_only=False" in capsys.readouterr().out
    assert torch.load(out, weights_only=False)["hyper_parameters"]["extra"] == Extra()
    # --no-weights-only is the same opt-out; OUT is not replaced without --force
    with pytest.raises(SystemExit):
        main([str(checkpoints / "extra.ckpt"), str(out), "--no-weights-only"])
    assert "pass --force" in capsys.readouterr().err
    assert main([str(checkpoints / "extra.ckpt"), str(out), "--no-weights-only", "--force"]) == 0


def test_consolidate_runs_as_a_module(checkpoints, tmp_path):
    out = tmp_path / "cli.ckpt"
    run = subprocess.run([sys.executable, "-m", "lightning_vescale.consolidate",
                          str(checkpoints / "sharded.ckpt"), str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert out.is_file() and "model tensors" in run.stdout


def _fabric_save(directory: str) -> None:
    """2 ranks: one AdamW step, then ``fabric.save`` in both formats (as fabric_gpt.py --save)."""
    import torch.distributed as dist
    from lightning.fabric import Fabric

    from examples.gpt import GPT
    from lightning_vescale import VeScaleFabricStrategy
    from tests.lightning._lit import CONFIG

    fabric = Fabric(accelerator="cpu", devices=dist.get_world_size(),
                    strategy=VeScaleFabricStrategy())
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(GPT(CONFIG))
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    x = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.block_size),
                      generator=torch.Generator().manual_seed(dist.get_rank()))
    fabric.backward(model(x, x))
    opt.step()
    state = {"model": model, "optimizer": opt, "step": 3}
    fabric.save(str(Path(directory) / "sharded"), state)
    fabric.strategy._state_dict_type = "full"
    fabric.save(str(Path(directory) / "full.pt"), state)


def test_consolidate_keeps_a_fabric_checkpoints_keys(worlds, tmp_path, capsys):
    """Issue 23: a Fabric checkpoint consolidated to "0 model tensors" (only the Trainer's keys
    were kept). Every entry is kept under its own key and equals Fabric's own full format."""
    worlds(2).run(_fabric_save, str(tmp_path))
    out = tmp_path / "consolidated.pt"
    assert main([str(tmp_path / "sharded"), str(out)]) == 0
    printed = capsys.readouterr().out
    assert "'model': " in printed and "'optimizer': optimizer state" in printed, printed
    got = torch.load(out, weights_only=True)
    ref = torch.load(tmp_path / "full.pt", weights_only=True)
    assert got.keys() == ref.keys() == {"model", "optimizer", "step"} and got["step"] == 3
    assert got["model"].keys() == ref["model"].keys() and len(ref["model"]) > 0
    for k, v in ref["model"].items():
        assert torch.equal(got["model"][k], v), k
    assert got["optimizer"]["param_groups"] == ref["optimizer"]["param_groups"]
    assert got["optimizer"]["state"].keys() == ref["optimizer"]["state"].keys()
    for i, st in ref["optimizer"]["state"].items():
        for key, v in st.items():
            assert torch.equal(torch.as_tensor(got["optimizer"]["state"][i][key]),
                               torch.as_tensor(v)), (i, key)
    weights = tmp_path / "weights.pt"  # --state-dict-only takes the one module entry
    assert main([str(tmp_path / "sharded"), str(weights), "--state-dict-only"]) == 0
    assert torch.load(weights, weights_only=True).keys() == ref["model"].keys()


def test_only_refused_objects_suggest_trust(checkpoints, tmp_path, capsys):
    """Issue 23: "--trust loads it ..." followed every error, a failed checksum included, where
    it cannot help. It follows refusals only (the refused case is in the test above)."""
    import shutil

    from lightning_vescale.checkpoint._trust import read_metadata

    damaged = tmp_path / "damaged.ckpt"
    shutil.copytree(checkpoints / "sharded.ckpt", damaged)
    info = next(iter(read_metadata(damaged).storage_data.values()))
    data = bytearray((damaged / info.relative_path).read_bytes())
    data[info.offset + info.length - 4] ^= 0x10
    (damaged / info.relative_path).write_bytes(bytes(data))
    with pytest.raises(SystemExit):
        main([str(damaged), str(tmp_path / "out.ckpt")])
    err = capsys.readouterr().err
    assert "fails its CRC-32 check" in err and "--trust loads" not in err, err
    assert "[rank" not in err, err  # one process: no rank to name


def test_consolidate_to_safetensors(checkpoints, tmp_path, capsys):
    """``--format safetensors``: the model's tensors as HF shards + index, prefix stripped."""
    from safetensors.torch import load_file

    from lightning_vescale.checkpoint import load_safetensors

    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")  # the user's files in OUT are kept
    assert main([str(checkpoints / "sharded.ckpt"), str(out), "--format", "safetensors",
                 "--strip-prefix", "model.", "--max-shard-size", "20KB", "--dtype", "bf16"]) == 0
    assert "wrote Hugging Face safetensors" in capsys.readouterr().out
    ref = torch.load(checkpoints / "full.ckpt", weights_only=True)["state_dict"]
    shards = sorted(out.glob("*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").is_file()
    assert (out / "config.json").read_text() == "{}"
    got = {}
    for shard in shards:
        got.update(load_file(shard))
    assert sorted(got) == sorted(k[len("model."):] for k in ref if k.startswith("model."))
    for k, v in got.items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, ref["model." + k].to(torch.bfloat16))
    module = GPTModule(n_embd=32).model.to(torch.bfloat16)
    load_safetensors(module, out)  # and back into the plain model


def test_consolidate_to_safetensors_bad_prefix(checkpoints, tmp_path):
    with pytest.raises(SystemExit):
        main([str(checkpoints / "sharded.ckpt"), str(tmp_path / "hf"), "--format", "safetensors",
              "--strip-prefix", "nothing."])
