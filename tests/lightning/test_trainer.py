"""Trainer runs with ``strategy="vescale_fsdp"`` on CPU, 2 processes (fork launcher), vs. DDP.

What Lightning tests for its own FSDP/ModelParallel strategies, for ours: parity with DDP (fp32,
relative loss difference 1e-5), gradient accumulation and clipping by norm (correct across
ranks), resume from sharded and full checkpoints with the same loss trajectory, the full file
loadable by a plain ``nn.Module`` + optimizer, full <-> sharded conversion, ``configure_model``
sharding respected, meta-device init, optimizer-count mismatch errors.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from examples.gpt import GPT
from lightning_vescale import checkpoint as ckpt
from tests.lightning._lit import (
    CONFIG,
    SaveAtEnd,
    TinyGPT,
    assert_close_losses,
    count_reduce_scatters,
    dataloader,
    losses,
    trainer,
)

VESCALE = "vescale_fsdp_fork"
DDP = "ddp_fork"


def _fit(strategy, out_dir, tag, *, seed=0, ckpt_path=None, callbacks=(), model_kwargs=None,
         **trainer_kwargs):
    import lightning.pytorch as pl

    pl.seed_everything(seed, verbose=False)
    model = TinyGPT(out_dir=str(out_dir), tag=tag, **(model_kwargs or {}))
    t = trainer(strategy, callbacks=list(callbacks), **trainer_kwargs)
    t.fit(model, dataloader(), ckpt_path=ckpt_path)
    return t, model


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Shared runs: DDP and vescale for 2 epochs (6 steps); vescale 1 epoch + checkpoints."""
    out = tmp_path_factory.mktemp("trainer_runs")
    _fit(DDP, out, "ddp", max_epochs=2)
    top1 = ModelCheckpoint(dirpath=out / "top1", every_n_train_steps=2, save_top_k=1,
                           monitor="train_loss", mode="min")
    _fit(VESCALE, out, "vescale", max_epochs=2, enable_checkpointing=True, callbacks=[top1])
    paths = {"sharded": str(out / "epoch1.ckpt"), "full": str(out / "epoch1_full.ckpt")}
    _fit(VESCALE, out, "half", max_epochs=1, callbacks=[SaveAtEnd(paths)])
    return out, paths


def test_parity_with_ddp(runs):
    out, _ = runs
    ref = losses(out, "ddp")
    assert len(ref[0]) == 6
    assert_close_losses(losses(out, "vescale"), ref, rtol=1e-5)
    assert ref[0][-1] < ref[0][0]  # it trains


def test_accumulation_and_clip_norm_parity_with_ddp(tmp_path):
    kw = dict(max_steps=3, accumulate_grad_batches=2, gradient_clip_val=0.05,
              gradient_clip_algorithm="norm")
    _fit(DDP, tmp_path, "ddp", **kw)
    count_reduce_scatters()
    _fit(VESCALE, tmp_path, "vescale", **kw)
    assert_close_losses(losses(tmp_path, "vescale"), losses(tmp_path, "ddp"), rtol=1e-5)
    # non-final micro-batches skip the reduce-scatter: 3 groups (2 blocks + root) x 3 steps
    for r in range(2):
        assert torch.load(tmp_path / f"vescale_rs_rank{r}.pt") == 3 * 3


def test_model_checkpoint_callback_keeps_top_k_sharded_dirs(runs):
    out, _ = runs
    kept = sorted(p.name for p in (out / "top1").iterdir() if not p.name.startswith("."))
    assert kept == ["epoch=1-step=6.ckpt"]  # steps 2 and 4 were saved, then removed
    assert ckpt.is_sharded_checkpoint(out / "top1" / kept[0])


def test_checkpoint_formats_and_contents(runs):
    _, paths = runs
    sharded, full = paths["sharded"], paths["full"]
    assert ckpt.is_sharded_checkpoint(sharded)
    files = sorted(p.name for p in __import__("pathlib").Path(sharded).iterdir())
    assert files == [".integrity.json", ".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    meta = torch.load(f"{sharded}/meta.pt", weights_only=False)
    assert meta["global_step"] == 3 and "loops" in meta and "state_dict" not in meta
    assert "optimizer_states" not in meta and "lr_schedulers" in meta

    # the full file is a plain Lightning checkpoint: a bare nn.Module + AdamW load it
    checkpoint = torch.load(full, weights_only=False)
    assert checkpoint["global_step"] == 3
    state = {k.removeprefix("model."): v for k, v in checkpoint["state_dict"].items()}
    model = GPT(CONFIG)
    model.load_state_dict(state, strict=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    opt.load_state_dict(checkpoint["optimizer_states"][0])
    n_params = len(list(model.parameters()))
    assert len(opt.state) == n_params
    assert all(float(s["step"]) == 3 for s in opt.state.values())

    # sharded -> full conversion (offline, one process) gives the same tensors
    merged = ckpt.consolidate(sharded)
    assert merged["state_dict"].keys() == checkpoint["state_dict"].keys()
    for k, v in checkpoint["state_dict"].items():
        torch.testing.assert_close(merged["state_dict"][k], v, rtol=0, atol=0)
    a, b = merged["optimizer_states"][0], checkpoint["optimizer_states"][0]
    assert a["state"].keys() == b["state"].keys()
    for i in b["state"]:
        for key, v in b["state"][i].items():
            torch.testing.assert_close(a["state"][i][key], v, rtol=0, atol=0)
    assert [g["params"] for g in a["param_groups"]] == [g["params"] for g in b["param_groups"]]


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_resume_continues_the_same_trajectory(runs, tmp_path, kind):
    out, paths = runs
    _fit(VESCALE, tmp_path, "resumed", max_epochs=2, ckpt_path=paths[kind])
    resumed = losses(tmp_path, "resumed")
    uninterrupted = [r[3:] for r in losses(out, "vescale")]
    assert_close_losses(resumed, uninterrupted, rtol=1e-5)


def test_resume_with_another_optimizer_count_fails(runs, tmp_path):
    _, paths = runs
    with pytest.raises(Exception, match="configured 2 optimizers but the checkpoint contains 1"):
        _fit(VESCALE, tmp_path, "bad", max_epochs=2, ckpt_path=paths["sharded"],
             model_kwargs={"optimizers": 2})


def test_resume_from_a_weights_only_checkpoint_says_so(tmp_path):
    weights = ModelCheckpoint(dirpath=tmp_path / "w", save_weights_only=True, save_last=True)
    _fit(VESCALE, tmp_path, "w", max_steps=1, callbacks=(weights,), enable_checkpointing=True)
    with pytest.raises(Exception, match="save_weights_only"):
        _fit(VESCALE, tmp_path, "w2", max_steps=2, ckpt_path=str(tmp_path / "w" / "last.ckpt"))


def test_bad_checkpoint_path_is_a_clear_error(tmp_path):
    with pytest.raises(Exception, match="does not exist"):
        _fit(VESCALE, tmp_path, "bad", max_steps=1, ckpt_path=str(tmp_path / "nope.ckpt"))


@pytest.mark.parametrize("how", ["blocks", "blocks+root"])
def test_configure_model_sharding_is_respected_and_matches(runs, tmp_path, how):
    """Sharding done by the user in configure_model: same result as the strategy's default."""
    out, _ = runs
    count_reduce_scatters()
    _fit(VESCALE, tmp_path, "user", max_epochs=2,
         model_kwargs={"shard_in_configure_model": how})
    # not wrapped twice: 3 groups (2 blocks + one root) reduce-scatter once per step
    assert torch.load(tmp_path / "user_rs_rank0.pt") == 3 * 6
    assert_close_losses(losses(tmp_path, "user"), losses(out, "vescale"), rtol=1e-5)


def test_init_module_empty_init_materialises_on_meta(tmp_path):
    import lightning.pytorch as pl

    pl.seed_everything(0, verbose=False)
    t = trainer(VESCALE, max_steps=2)
    with t.init_module(empty_init=True):
        model = TinyGPT(out_dir=str(tmp_path), tag="meta")
    assert all(p.is_meta for p in model.parameters())
    t.fit(model, dataloader())
    # the main process gets rank 0's trained weights, with the tied embedding/head still tied
    assert not any(p.is_meta for p in model.parameters())
    assert model.model.head.weight is model.model.tok_emb.weight
    for rank_losses in losses(tmp_path, "meta"):
        assert len(rank_losses) == 2
        assert all(torch.isfinite(torch.tensor(rank_losses)))
        assert 3.0 < rank_losses[0] < 6.0  # ~ln(65) at init: a real (not garbage) init
