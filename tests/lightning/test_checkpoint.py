"""Checkpoint helpers on gloo worlds: resharding (4 -> 2 -> 1), full files, atomic saves, errors.

The reference is the world that wrote the checkpoint: after loading, every parameter and every
optimizer state (gathered to full tensors) must be bit-identical, and one more optimizer step
must give the same parameters as the writer's own next step.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from examples.gpt import GPT, GPTConfig
from lightning_vescale import checkpoint as ckpt
from lightning_vescale._lightning.sharding import ShardGranularity, shard_model
from lightning_vescale.mesh import init_mesh
from lightning_vescale.optim import AdamW8bit, Muon

# fc/proj weights have 64*256 = 16384 elements: AdamW8bit quantizes them (block 256).
CFG = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=64, tie_weights=True)


def _setup(seed: int, blocks_opt: str = "adamw8bit"):
    torch.manual_seed(seed)
    model = GPT(CFG)
    shard_model(model, units=None, mesh=init_mesh("cpu", dist.get_world_size()),
                device=torch.device("cpu"), mp_policy=None,
                granularity=ShardGranularity(granularity=None, optimizer_block_size=256,
                                             min_block_numel=4096),
                reshard_after_forward=True)
    blocks = [p for n, p in model.named_parameters() if n.startswith("blocks.")]
    rest = [p for n, p in model.named_parameters() if not n.startswith("blocks.")]
    first = (AdamW8bit(blocks, lr=1e-2, weight_decay=0.1) if blocks_opt == "adamw8bit"
             else Muon(blocks, lr=2e-2, adamw_lr=1e-2))
    opts = {"optimizer_0": first,
            "optimizer_1": torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.1)}
    return model, opts


def _step(model, opts):
    g = torch.Generator().manual_seed(123)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.block_size), generator=g)
    loss = model(x, x)
    loss.backward()
    for o in opts.values():
        o.step()
        o.zero_grad()


def _full(model, opts):
    out = {"model": ckpt.model_state(model, full=True)}
    for k, o in opts.items():
        out[k] = ckpt.optimizer_state(model, o, full=True)
    return out


def _write(path, kind, blocks_opt="adamw8bit"):
    model, opts = _setup(seed=0, blocks_opt=blocks_opt)
    _step(model, opts)
    saved = _full(model, opts)
    tensors = {"model": ckpt.model_state(model, full=kind == "full"),
               **{k: ckpt.optimizer_state(model, o, full=kind == "full") for k, o in opts.items()}}
    if kind == "full":
        ckpt.save_full(path, {**tensors, "step": 1})
    else:
        ckpt.save_sharded(path, tensors, {"step": 1})
    _step(model, opts)
    return saved, ckpt.model_state(model, full=True)


def _read(path, kind, blocks_opt="adamw8bit"):
    model, opts = _setup(seed=1, blocks_opt=blocks_opt)  # everything must come from the file
    if kind == "full":
        data = torch.load(path, mmap=True, weights_only=False)
        ckpt.load_full_model_state(data["model"], model)
        for k, o in opts.items():
            ckpt.load_full_optimizer_state(data[k], model, o)
        meta = {"step": data["step"]}
    else:
        meta = ckpt.load_sharded(path, model, opts, model_key="model")
    loaded = _full(model, opts)
    _step(model, opts)
    return meta, loaded, ckpt.model_state(model, full=True)


def _assert_same(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_same(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    else:
        assert a == b


@pytest.mark.parametrize("kind,blocks_opt", [("sharded", "adamw8bit"), ("full", "adamw8bit"),
                                             ("sharded", "muon")])
def test_reshard_4_to_2_and_1(worlds, tmp_path, kind, blocks_opt):
    path = str(tmp_path / f"ckpt_{kind}")
    saved, after = worlds(4).run(_write, path, kind, blocks_opt)[0]
    assert saved["optimizer_0"]["state"]
    if blocks_opt == "adamw8bit":  # quantized states for the large block matrices
        assert any("exp_avg_codes" in s for s in saved["optimizer_0"]["state"].values())
    else:
        assert any("momentum_buffer" in s for s in saved["optimizer_0"]["state"].values())
    for ws in (2, 1):
        meta, loaded, stepped = worlds(ws).run(_read, path, kind, blocks_opt)[0]
        assert meta == {"step": 1}
        _assert_same(loaded, saved)
        for k, v in after.items():  # the next step matches the writer's next step
            torch.testing.assert_close(stepped[k], v, rtol=1e-6, atol=1e-7)


class _Unpicklable:
    def __reduce__(self):
        raise RuntimeError("boom: cannot pickle")


def _interrupted(path, kind):
    model, opts = _setup(seed=0)
    _step(model, opts)
    good = ckpt.model_state(model, full=True)
    full = kind == "full"
    state = {"model": ckpt.model_state(model, full=full)}
    (ckpt.save_full(path, {**state, "step": 1}) if full
     else ckpt.save_sharded(path, state, {"step": 1}))
    _step(model, opts)  # new values that must NOT reach the file
    bad = {"model": ckpt.model_state(model, full=full), "oops": _Unpicklable()}
    try:
        (ckpt.save_full(path, {**bad, "step": 2}) if full
         else ckpt.save_sharded(path, bad, {"step": 2}))
    except Exception as e:  # noqa: BLE001
        error = str(e)
    else:
        error = None
    fresh, _ = _setup(seed=1)
    if full:
        data = torch.load(path, weights_only=False)
        ckpt.load_full_model_state(data["model"], fresh)
        step = data["step"]
    else:
        step = ckpt.load_sharded(path, fresh, {}, model_key="model")["step"]
    return error, step, good, ckpt.model_state(fresh, full=True)


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_interrupted_save_keeps_previous_checkpoint(worlds, tmp_path, kind):
    path = tmp_path / "ckpt"
    error, step, good, loaded = worlds(2).run(_interrupted, str(path), kind)[0]
    assert error is not None
    assert step == 1
    _assert_same(loaded, good)
    # the failed save removed its hidden temporary: nothing but the checkpoint is left
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def _bad_paths(tmp):
    import pathlib

    model, _ = _setup(seed=0)
    errors = {}
    for name, fn in {
        "missing": lambda: ckpt.check_checkpoint_path(pathlib.Path(tmp) / "missing"),
        "plain_dir": lambda: ckpt.check_checkpoint_path(pathlib.Path(tmp)),
        "save_into_dir": lambda: ckpt.save_full(pathlib.Path(tmp), {}),
    }.items():
        try:
            fn()
        except Exception as e:  # noqa: BLE001
            errors[name] = (type(e).__name__, str(e))
    return errors


def test_bad_paths_give_clear_errors(worlds, tmp_path):
    (tmp_path / "something.txt").write_text("not a checkpoint")
    errors = worlds(2).run(_bad_paths, str(tmp_path))[0]
    assert errors["missing"][0] == "FileNotFoundError" and "does not exist" in errors["missing"][1]
    assert errors["plain_dir"][0] == "ValueError" and "not a sharded checkpoint" in \
        errors["plain_dir"][1]
    assert errors["save_into_dir"][0] == "IsADirectoryError"
