"""Every example and config runs for a couple of steps, so none of them rots.

:data:`RUN` names each file under ``examples/`` and the test that runs it (here, in
``test_readme.py`` through the README's commands, or in ``test_cli_optimizers.py``);
:func:`test_every_example_file_is_run` fails for a file nobody runs. Scripts with Lightning's
default (subprocess) launcher re-execute ``sys.argv``, so they run as subprocesses; configs run
in-process with the fork launcher (``start_method=fork``), which costs ~2 s each.

Also here: the demo's validation metric (``torchmetrics`` perplexity, synced across ranks) equals
DDP's on the same data.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

import lightning_vescale  # noqa: F401
from examples.train_gpt import CharDataModule, GPTModule
from tests.examples._probe import Probe, load

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"

#: every file under examples/ -> where it is run
RUN = {
    "examples/__init__.py": "(package marker)",
    "examples/gpt.py": "imported by every other example and most tests",
    "examples/train_gpt.py": "test_readme (python examples/train_gpt.py) and the metric test here",
    "examples/cli.py": "test_readme (its commands) and test_cli_optimizers",
    "examples/fully_shard_torchrun.py": "test_readme (torchrun command)",
    "examples/quantized_comm.py": "test_readme (torchrun command)",
    "examples/memory_profile.py": "test_readme (memory_profile command)",
    "examples/llama.py": "test_llama_config_runs_tiny_on_cpu and test_readme (planner, multi-node)",
    "examples/trainer_usage.py": "test_trainer_usage_runs",
    "examples/optimizers.py": "test_optimizers_example_runs",
    "examples/fabric_gpt.py": "test_fabric_example_runs",
    "examples/hf_transformers.py": "test_hf_transformers_example (skipped without transformers)",
    "examples/slurm_llama.sbatch": "test_slurm_script_is_valid_bash",
    "examples/configs/gpt_vescale.yaml": "test_configs_run_tiny_on_cpu and test_readme",
    "examples/configs/adamw8bit.yaml": "test_configs_run_tiny_on_cpu and test_cli_optimizers",
    "examples/configs/muon.yaml": "test_configs_run_tiny_on_cpu and test_cli_optimizers",
    "examples/configs/soap.yaml": "test_cli_optimizers (the SOAP section)",
    "examples/configs/bf16_gpu.yaml": "test_configs_run_tiny_on_cpu (CPU, bf16-mixed)",
    "examples/configs/llama_8gpu_multinode.yaml": "test_llama_config_runs_tiny_on_cpu",
    "examples/configs/hsdp_llama_2x8gpu.yaml":
        "tests/lightning/test_hsdp_strategy.py (parsed; no GPUs here)",
    "examples/configs/tp_llama_2x8gpu.yaml": "test_tp_llama_config_runs_tiny_on_cpu",
    "examples/slurm_hsdp_2x8.sbatch": "tests/lightning/test_hsdp_strategy.py (bash -n)",
    "examples/multinode_trainer.py": "tests/lightning/test_hsdp_multinode.py (torchrun)",
    "examples/moe.py": "tests/examples/test_moe_example.py (Trainer, 2 CPU processes)",
    "examples/hf_finetune.py": "test_hf_finetune_example_runs (script) and "
                               "tests/lightning/test_hf_pretrained.py (its module and callback)",
    "examples/configs/moe_8gpu.yaml": "tests/examples/test_moe_example.py (toy size on CPU)",
}


def env() -> dict[str, str]:
    e = dict(os.environ, OMP_NUM_THREADS="1")
    e["PYTHONPATH"] = str(ROOT) + os.pathsep + e.get("PYTHONPATH", "")
    return e


def run(args: list[str], cwd: Path = ROOT, timeout: int = 300) -> str:
    """Run ``args`` (a command line) and return its stdout; fail with its output otherwise."""
    out = subprocess.run(args, cwd=cwd, env=env(), capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, f"{args}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def test_every_example_file_is_run():
    files = {str(p.relative_to(ROOT)) for p in (ROOT / "examples").rglob("*")
             if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}
    assert files == set(RUN), (f"not run by any test: {sorted(files - set(RUN))}; "
                               f"listed but gone: {sorted(set(RUN) - files)}")


@pytest.mark.slow  # a script in a fresh process: the second CI step
# -- scripts --------------------------------------------------------------------------------------
def test_trainer_usage_runs(tmp_path):
    run([sys.executable, str(ROOT / "examples/trainer_usage.py")], cwd=tmp_path)
    assert (tmp_path / "out" / "memory" / "memory_timeline_rank0.png").is_file()  # under out/
    # everything the example writes is under out/ (git-ignored), Lightning's logs too
    assert {p.name for p in tmp_path.iterdir()} == {"out"}
    assert (tmp_path / "out" / "lightning_logs").is_dir()


@pytest.mark.slow  # a script in a fresh process (twice): the second CI step
def test_train_gpt_resume_reports_its_own_steps_and_validates(tmp_path):
    """``--resume DIR --max-steps N``: it trains N minus the checkpoint's steps and says so, and
    prints the perplexity of the final model. It printed "in 8 steps" after 2 and "validation
    perplexity nan" (the resumed steps 7-8 miss every multiple of the validation interval 3)."""
    import re

    ckpt = tmp_path / "gpt_ckpt"
    common = [sys.executable, str(ROOT / "examples/train_gpt.py"), "--no-ddp", "--val-every", "3"]
    first = run(common + ["--max-steps", "6", "--save", str(ckpt)], cwd=tmp_path)
    assert "in 6 steps, validation perplexity" in first
    out = run(common + ["--max-steps", "8", "--resume", str(ckpt)], cwd=tmp_path)
    line = re.search(r"vescale_fsdp x2: loss (\S+) -> (\S+) in (\d+) steps \(resumed at step "
                     r"(\d+)\), validation perplexity (\S+)", out)
    assert line, out[-2000:]
    assert (int(line[3]), int(line[4])) == (2, 6)
    assert 1.0 < float(line[5]) < 65.0, line[0]  # finite: the final model was validated


@pytest.mark.slow  # a script in a fresh process: the second CI step
@pytest.mark.parametrize("optimizer,name", [("adamw8bit", "GPTAdamW8bit"), ("muon", "GPTMuon")])
def test_optimizers_example_runs(optimizer, name):
    out = run([sys.executable, "examples/optimizers.py", optimizer])
    assert f"{name}: 2 ranks, 10 steps" in out


@pytest.mark.slow  # a script in a fresh process: the second CI step
def test_fabric_example_runs(tmp_path):
    out = run([sys.executable, "examples/fabric_gpt.py", "--steps", "3",
               "--save", str(tmp_path / "ckpt")])
    assert "step 2: loss" in out and (tmp_path / "ckpt" / ".metadata").is_file()


@pytest.mark.slow  # a script in a fresh process: the second CI step
def test_hf_finetune_example_runs(tmp_path):
    """HF weights in (a random tiny Llama by save_pretrained), 3 steps, HF weights out."""
    from transformers import LlamaForCausalLM

    out = run([sys.executable, "examples/hf_finetune.py", "--steps", "3",
               "--out", str(tmp_path / "ft")])
    assert "fine-tuned 3 steps" in out
    start = LlamaForCausalLM.from_pretrained(tmp_path / "tiny_random_llama").state_dict()
    tuned = LlamaForCausalLM.from_pretrained(tmp_path / "ft").state_dict()
    assert sorted(start) == sorted(tuned)
    assert any(not torch.equal(start[k], tuned[k]) for k in start)  # trained, then saved


@pytest.mark.slow  # fresh processes: the second CI step
def test_hf_load_benchmark_runs_tiny(tmp_path):
    """``benchmarks/hf_load.py`` at toy size: ours at 1, 2 and 1-of-4 ranks, DCP's reader."""
    out = run([sys.executable, "-m", "benchmarks.hf_load", "--layers", "1", "--hidden", "64",
               "--mlp", "128", "--vocab", "256", "--repeats", "1", "--fake-world", "4",
               "--only", "ours:1,ours:2,ours:4,dcp_hf:2", "--dir", str(tmp_path)])
    rows = [line for line in out.splitlines() if line.startswith("| ours") or
            line.startswith("| dcp_hf")]
    assert len(rows) == 5, out


@pytest.mark.slow  # a script in a fresh process: the second CI step
def test_hf_transformers_example(tmp_path):
    if subprocess.run([sys.executable, "-c", "import transformers"],
                      capture_output=True).returncode != 0:
        out = subprocess.run([sys.executable, "examples/hf_transformers.py"], cwd=ROOT, env=env(),
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 1 and "pip install transformers" in out.stderr  # says why
        pytest.skip("transformers is not installed (the example says so and exits 1)")
    out = run([sys.executable, "examples/hf_transformers.py", "--steps", "3"])
    assert "LlamaForCausalLM: 2 ranks, 3 steps" in out


def test_slurm_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(ROOT / "examples/slurm_llama.sbatch")], check=True)
    text = (ROOT / "examples/slurm_llama.sbatch").read_text()
    assert "#SBATCH --nodes=4" in text and "#SBATCH --ntasks-per-node=8" in text
    cfg = (CONFIGS / "llama_8gpu_multinode.yaml").read_text()
    assert "num_nodes: 4" in cfg and "devices: 8" in cfg  # the launcher and the config agree


# -- configs (in-process, fork launcher) -----------------------------------------------------------
TINY_GPT = ["--trainer.strategy.init_args.start_method=fork", "--trainer.max_steps=2",
            "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]


@pytest.mark.slow  # a script in a fresh process: the second CI step
@pytest.mark.parametrize("configs,extra", [
    (["gpt_vescale.yaml"], []),
    (["gpt_vescale.yaml", "adamw8bit.yaml"], []),
    (["gpt_vescale.yaml", "muon.yaml"], []),
    (["gpt_vescale.yaml", "bf16_gpu.yaml"],  # CPU stands in for the GPUs; bf16-mixed stays
     ["--trainer.accelerator=cpu", "--trainer.devices=2", "--model.n_layer=2",
      "--model.n_head=2", "--model.n_embd=64", "--model.block_size=32", "--data.block_size=32",
      "--data.batch_size=4", "--data.length=64", "--data.val_length=16",
      "--trainer.val_check_interval=2"]),
], ids=["cpu_demo", "adamw8bit", "muon", "bf16_gpu"])
def test_configs_run_tiny_on_cpu(tmp_path, configs, extra):
    from examples.cli import main

    args = [a for c in configs for a in ("--config", str(CONFIGS / c))] + TINY_GPT + extra
    cli = main(args=args, run=False)
    cli.trainer.callbacks.append(Probe(str(tmp_path), "cfg"))
    cli.trainer.fit(cli.model, cli.datamodule)
    for rank in load(tmp_path, "cfg"):
        assert len(rank["losses"]) == 2 and all(map(lambda x: x == x, rank["losses"]))
        if "bf16_gpu.yaml" in configs:
            assert "val_ppl" in rank["metrics"]


LLAMA_TINY = ["--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.num_nodes=1",
              "--trainer.precision=32-true", "--trainer.max_steps=2", "--model.dim=64",
              "--model.n_layers=2", "--model.n_heads=4", "--model.n_kv_heads=2",
              "--model.ffn_dim=128", "--model.vocab_size=256", "--data.vocab_size=256",
              "--data.seq_len=32", "--data.num_samples=64", "--trainer.enable_progress_bar=false",
              "--trainer.enable_model_summary=false"]


@pytest.mark.slow  # a script in a fresh process: the second CI step
def test_llama_config_runs_tiny_on_cpu(tmp_path, monkeypatch):
    """The 8-GPU x 4-node config's code path at toy size: meta-device model, AdamW8bit built
    after sharding, a sharded ``last.ckpt`` that ``consolidate`` reads."""
    from examples.llama import main
    from lightning_vescale.checkpoint import consolidate

    monkeypatch.chdir(tmp_path)  # ModelCheckpoint writes to out/checkpoints/llama
    cli = main(args=["--config", str(CONFIGS / "llama_8gpu_multinode.yaml"), *LLAMA_TINY,
                     "--trainer.strategy.init_args.start_method=fork"], run=False)
    cli.trainer.callbacks.append(Probe(str(tmp_path), "llama"))
    cli.trainer.fit(cli.model, cli.datamodule)
    for rank in load(tmp_path, "llama"):
        assert len(rank["losses"]) == 2 and rank["groups"][0][0]["block_size"] == 256
    full = consolidate(tmp_path / "out" / "checkpoints" / "llama" / "last.ckpt")
    assert full["state_dict"]["model.layers.0.attention.wq.weight"].shape == (64, 64)


@pytest.mark.slow  # 4 forked ranks
def test_tp_llama_config_runs_tiny_on_cpu(tmp_path, monkeypatch):
    """The 2-node x 8-GPU FSDP + TP config at toy size on 4 CPU ranks as (dp 2, tp 2): the
    strategy's (data_parallel, tensor_parallel) mesh reaches ``configure_model``, which applies
    ``parallelize_llama``; the two ranks of a TP group train on one batch (equal losses), the
    two data-parallel ranks on two, and the matrices are tensor-parallel DTensors."""
    from examples.llama import main

    monkeypatch.chdir(tmp_path)
    cli = main(args=["--config", str(CONFIGS / "tp_llama_2x8gpu.yaml"), *LLAMA_TINY,
                     "--trainer.devices=4", "--trainer.strategy.init_args.tensor_parallel_size=2",
                     "--trainer.strategy.init_args.data_parallel_size=2",
                     "--trainer.strategy.init_args.start_method=fork"], run=False)
    cli.trainer.callbacks += [Probe(str(tmp_path), "tp"), _Placements(tmp_path)]
    cli.trainer.fit(cli.model, cli.datamodule)
    ranks = [r["losses"] for r in load(tmp_path, "tp", world_size=4)]
    assert all(len(r) == 2 and all(x == x for x in r) for r in ranks), ranks
    assert ranks[0] == ranks[1] and ranks[2] == ranks[3] and ranks[0] != ranks[2], ranks
    placements = torch.load(tmp_path / "tp_placements_rank0.pt")
    assert placements["model.layers.0.attention.wq.weight"] == ("RaggedShard", "Shard")
    assert placements["model.layers.0.feed_forward.w2.weight"] == ("RaggedShard", "Shard")
    assert placements["model.tok_embeddings.weight"] == ("RaggedShard",)


class _Placements(pl.Callback):
    """Each rank writes its parameters' placement types at the end of fit."""

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rows = {n: tuple(type(x).__name__ for x in p.placements)
                for n, p in pl_module.named_parameters()}
        torch.save(rows, self.out_dir / f"tp_placements_rank{trainer.global_rank}.pt")


# -- the demo's metric equals DDP's ------------------------------------------------------------------
def _fit(strategy: str, out: Path, tag: str) -> None:
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=4,
                         val_check_interval=4, num_sanity_val_steps=0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[Probe(str(out), tag)])
    trainer.fit(GPTModule(n_embd=32), CharDataModule(length=256, val_length=40, batch_size=8))


@pytest.mark.slow  # a script in a fresh process: the second CI step
def test_validation_perplexity_equals_ddps(tmp_path):
    """40 validation windows over 2 ranks, batches of 8: uneven last batches, and Lightning's
    distributed sampler on both sides. The metric is computed over all ranks' tokens."""
    _fit("vescale_fsdp_fork", tmp_path, "vescale")
    _fit("ddp_fork", tmp_path, "ddp")
    ours, ddp = load(tmp_path, "vescale"), load(tmp_path, "ddp")
    for a, b in zip(ours, ddp):
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-5)
        assert a["metrics"]["val_ppl"] == pytest.approx(b["metrics"]["val_ppl"], rel=1e-5)
    # synced: every rank reports the same value (the whole validation set's perplexity)
    assert ours[0]["metrics"]["val_ppl"] == ours[1]["metrics"]["val_ppl"]


@pytest.mark.slow  # fresh processes: the second CI step
def test_soap_benchmark_runs_tiny():
    """``benchmarks/soap.py`` at toy size: every variant; the matrix layout moves nothing while
    owner ranks and the naive SOAP on FSDP2's row layout move bytes, with equal results."""
    out = run([sys.executable, "benchmarks/soap.py", "--world-size", "2", "--d-model", "16",
               "--layers", "2", "--steps", "3", "--repeats", "1"])
    rows = {line.split("|")[2].strip(): line for line in out.splitlines()
            if line.startswith("| 2 |")}
    assert sorted(rows) == ["adamw", "shampoo-matrix", "soap-matrix", "soap-naive",
                            "soap-owners"], out
    assert rows["soap-matrix"].split("|")[5].strip() == "0.0"
    assert float(rows["soap-naive"].split("|")[5]) > 0
    assert float(rows["soap-owners"].split("|")[5]) > 0
    assert "max abs difference 0.00e+00" in out


@pytest.mark.slow  # a few short trainings: the second CI step
def test_soap_quality_benchmark_runs_tiny(tmp_path):
    out = run([sys.executable, "benchmarks/soap_quality.py", "--steps", "12", "--layers", "1",
               "--d-model", "16", "--block", "8", "--batch", "2", "--seeds", "0",
               "--out-dir", str(tmp_path)])
    assert "| soap |" in out and "| shampoo |" in out and "| muon |" in out
