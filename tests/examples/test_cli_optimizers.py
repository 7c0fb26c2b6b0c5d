"""Optimizers chosen in LightningCLI's ``optimizer:`` section (``examples/configs/``).

LightningCLI builds the optimizer from ``model.parameters()``: no names. For Muon that would
route the embeddings and the head by shape (to Newton–Schulz) instead of to its AdamW fallback.
The strategies give Muon the module's names (``Muon.bind_names``); these tests check that the
result is *exactly* ``Muon(self.named_parameters(), ...)``: the same groups and, on 2 ranks,
bitwise the same losses step after step.
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

import lightning_vescale  # noqa: F401  (registers the strategy names)
from examples.gpt import GPT, GPTConfig
from examples.train_gpt import GPTModule
from lightning_vescale.optim import AdamW8bit, Muon
from tests.examples._probe import Probe, describe_groups, load

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "configs"
MUON = dict(lr=0.02, weight_decay=0.1, adamw_lr=0.003, adamw_betas=(0.9, 0.95))  # muon.yaml
STEPS = 3


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))


# -- Muon.bind_names, single process ----------------------------------------------------------------
def test_bind_names_gives_exactly_the_named_optimizer():
    model = _gpt()
    named = Muon(model.named_parameters(), **MUON)
    unnamed = Muon(model.parameters(), **MUON)
    # by shape alone the embedding (tied with the head) is orthogonalised: what the fix prevents
    assert describe_groups(unnamed) != describe_groups(named)
    assert any(p is model.tok_emb.weight for p in unnamed.param_groups[0]["params"])
    assert unnamed.bind_names(model.named_parameters()) is True
    assert describe_groups(unnamed) == describe_groups(named)
    for a, b in zip(unnamed.param_groups, named.param_groups):
        assert [id(p) for p in a["params"]] == [id(p) for p in b["params"]]
    assert unnamed.bind_names(model.named_parameters()) is False  # named already: no change
    # and it steps like the named one
    x = torch.randint(0, 65, (4, 16), generator=torch.Generator().manual_seed(1))
    finals = []
    for bind in (False, True):
        m = _gpt()
        opt = Muon(m.parameters(), **MUON) if bind else Muon(m.named_parameters(), **MUON)
        if bind:
            opt.bind_names(m.named_parameters())
        m(x, x).backward()
        opt.step()
        finals.append([p.detach().clone() for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*finals))


def test_bind_names_keeps_an_lr_schedulers_keys_and_explicit_groups():
    model = _gpt()
    opt = Muon(model.parameters(), **MUON)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    opt.bind_names(model.named_parameters())
    assert [g["initial_lr"] for g in opt.param_groups] == [MUON["lr"], MUON["adamw_lr"]]
    sched.step()
    assert [g["lr"] for g in opt.param_groups] == [MUON["lr"] / 2, MUON["adamw_lr"] / 2]
    # explicit use_muon groups keep their routing and get names
    hidden = [p for n, p in model.named_parameters() if "blocks" in n and p.ndim == 2]
    rest = [p for n, p in model.named_parameters() if not ("blocks" in n and p.ndim == 2)]
    opt = Muon([{"params": hidden, "use_muon": True}, {"params": rest, "use_muon": False}])
    opt.bind_names(model.named_parameters())
    assert [len(g["param_names"]) for g in opt.param_groups] == [len(hidden), len(rest)]


def test_bind_names_errors_name_the_fix():
    model = _gpt()
    opt = Muon(model.parameters(), **MUON)
    with pytest.raises(ValueError, match="not in the given named_parameters"):
        opt.bind_names(list(model.named_parameters())[:3])
    assert "param_names" not in opt.param_groups[0]  # unchanged after the error
    model(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)).backward()
    opt.step()
    with pytest.raises(RuntimeError, match="before the first step"):
        opt.bind_names(model.named_parameters())


# -- through the Trainer: LightningCLI's optimizer section vs. the named optimizer ----------------
class NamedMuonGPT(GPTModule):
    def configure_optimizers(self):  # noqa: ANN201
        return Muon(self.named_parameters(), **MUON)


def _cli_args(*configs: str, shipped: bool = False) -> list[str]:
    """The command line of a config's header; ``shipped=False`` also shrinks the model (its
    width is not what the test is about), ``shipped=True`` keeps the config's model."""
    args = ["--config", str(CONFIGS / "gpt_vescale.yaml")]
    for c in configs:
        args += ["--config", str(CONFIGS / c)]
    return args + ["--trainer.strategy.init_args.start_method=fork",
                   f"--trainer.max_steps={STEPS}", "--trainer.enable_progress_bar=false",
                   "--trainer.enable_model_summary=false"] + ([] if shipped else
                                                               ["--model.n_embd=32"])


def test_cli_optimizer_section_muon_equals_named_parameters_muon(tmp_path):
    from examples.cli import main

    cli = main(args=_cli_args("muon.yaml"), run=False)
    cli.trainer.callbacks.append(Probe(str(tmp_path), "cli"))
    cli.trainer.fit(cli.model, cli.datamodule)

    pl.seed_everything(0, verbose=False)  # what LightningCLI's seed_everything: 0 did
    model = NamedMuonGPT(n_embd=32)
    ref = main(args=_cli_args(), run=False).trainer  # the same Trainer settings, no optimizer
    ref.callbacks.append(Probe(str(tmp_path), "named"))
    ref.fit(model, cli.datamodule)

    cli_runs, named_runs = load(tmp_path, "cli"), load(tmp_path, "named")
    for a, b in zip(cli_runs, named_runs):
        assert a["groups"] == b["groups"]
        assert a["groups"][0][0]["use_muon"] and "model.tok_emb.weight" in \
            a["groups"][0][1]["param_names"]  # the embedding is on AdamW
        assert len(a["losses"]) == STEPS and a["losses"] == b["losses"]  # bitwise


def test_cli_optimizer_section_adamw8bit_trains_the_shards(tmp_path):
    from examples.cli import main

    cli = main(args=_cli_args("adamw8bit.yaml"), run=False)
    assert isinstance(cli.model.configure_optimizers(), AdamW8bit)
    cli.trainer.callbacks.append(Probe(str(tmp_path), "a8"))
    cli.trainer.fit(cli.model, cli.datamodule)
    for run in load(tmp_path, "a8"):
        assert len(run["losses"]) == STEPS and all(map(torch.isfinite, map(torch.tensor,
                                                                            run["losses"])))
        assert run["losses"][-1] < run["losses"][0]


# -- through Fabric: fabric.setup(model, Muon(model.parameters())) ---------------------------------
def _fabric_muon(named: bool, separate: bool):
    import torch.distributed as dist
    from lightning.fabric import Fabric

    from lightning_vescale import VeScaleFabricStrategy

    fabric = Fabric(accelerator="cpu", devices=dist.get_world_size(),
                    strategy=VeScaleFabricStrategy())
    fabric.launch()
    model = _gpt()
    if separate:  # setup_module, then the optimizer from the sharded module, then setup_optimizers
        model = fabric.setup_module(model)
        opt = fabric.setup_optimizers(Muon(model.named_parameters() if named else
                                           model.parameters(), **MUON))
    else:  # one call: the optimizer (built before sharding) is re-pointed, then named
        opt = Muon(model.named_parameters() if named else model.parameters(), **MUON)
        model, opt = fabric.setup(model, opt)
    x = torch.randint(0, 65, (3, 2, 4, 16), generator=torch.Generator().manual_seed(2))
    losses = []
    for step in range(3):
        xb = x[step, dist.get_rank()]
        loss = model(xb, xb)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return describe_groups(opt), losses


@pytest.mark.parametrize("separate", [False, True], ids=["setup", "setup_module"])
def test_fabric_gives_unnamed_muon_the_modules_names(worlds, separate):
    unnamed = worlds(2).run(_fabric_muon, False, separate)
    named = worlds(2).run(_fabric_muon, True, separate)
    for (groups_u, losses_u), (groups_n, losses_n) in zip(unnamed, named):
        # after setup_module, model.named_parameters() is the _FabricModule wrapper's, which
        # prefixes "_forward_module."; the strategy names by the module itself: routing is equal
        for g in groups_n:
            g["param_names"] = [n.removeprefix("_forward_module.") for n in g["param_names"]]
        assert groups_u == groups_n and "tok_emb.weight" in groups_n[1]["param_names"]
        assert losses_u == losses_n


# -- SOAP from the optimizer section, experts of the layout whole ---------------------------------
def test_cli_optimizer_section_soap_trains_whole_matrices(tmp_path):
    """soap.yaml as its header runs it (the model of gpt_vescale.yaml, n_embd=64: its (65, 64)
    embedding is no multiple of the 256 block, which SOAP does not care about)."""
    from examples.cli import main
    from lightning_vescale.optim import SOAP

    cli = main(args=_cli_args("soap.yaml", shipped=True), run=False)
    assert isinstance(cli.model.configure_optimizers(), SOAP)
    assert cli.trainer.strategy._granularity.granularity == "matrix"
    assert cli.model.hparams.n_embd == 64 and cli.trainer.strategy._optimizer_block_size == 256
    cli.trainer.callbacks.append(Probe(str(tmp_path), "soap"))
    cli.trainer.fit(cli.model, cli.datamodule)
    for run in load(tmp_path, "soap"):
        assert len(run["losses"]) == STEPS and all(map(torch.isfinite, map(torch.tensor,
                                                                            run["losses"])))
        # the first step only initialises SOAP's bases: the next ones train
        assert run["losses"][-1] < run["losses"][0]
