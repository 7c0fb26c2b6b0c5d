"""``VeScaleFabricStrategy`` on gloo worlds vs. a dense single-process reference.

Each rank runs Fabric inside the test harness' process group (the strategy sees an existing group
and the harness' RANK/WORLD_SIZE environment, as under torchrun).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from examples.gpt import GPT, GPTConfig
from lightning_vescale import VeScaleFabricStrategy
from lightning_vescale._lightning.sharding import is_sharded

CFG = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=2, n_embd=32, tie_weights=True)
LR = 1e-2


def _batches(n, ws):
    g = torch.Generator().manual_seed(11)
    return torch.randint(0, CFG.vocab_size, (n, ws, 2, CFG.block_size), generator=g)


def _reference(steps, accumulate=1, clip=None):
    """Dense single-process run on the same data: the mean over ranks (and micro-batches)."""
    ws = dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    xs = _batches(steps * accumulate, ws)
    out = []
    for s in range(steps):
        losses = []
        for a in range(accumulate):
            x = xs[s * accumulate + a]
            loss = sum(model(x[r], x[r]) for r in range(ws)) / (ws * accumulate)
            loss.backward()
            losses.append([model(x[r], x[r]).item() for r in range(ws)])
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        out.append(losses)
    return out


def _fabric(**kwargs):
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=dist.get_world_size(),
                    strategy=VeScaleFabricStrategy(**kwargs))
    fabric.launch()
    return fabric


def _train(fabric, model, opt, xs, steps, start=0, accumulate=1, clip=None):
    rank = dist.get_rank()
    out = []
    for s in range(start, start + steps):
        losses = []
        for a in range(accumulate):
            x = xs[s * accumulate + a][rank]
            last = a == accumulate - 1
            with fabric.no_backward_sync(model, enabled=not last):
                loss = model(x, x)
                fabric.backward(loss / accumulate)
            losses.append(loss.item())
        if clip is not None:
            fabric.clip_gradients(model, opt, max_norm=clip)
        opt.step()
        opt.zero_grad()
        out.append(losses)
    return out


def _run_separate_setup_and_checkpoint(tmp, kind):
    fabric = _fabric(state_dict_type=kind)
    torch.manual_seed(0)
    model = fabric.setup_module(GPT(CFG))
    assert is_sharded(model.module)
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1))
    xs = _batches(3, dist.get_world_size())
    first = _train(fabric, model, opt, xs, 2, clip=0.05)
    fabric.save(f"{tmp}/ckpt", {"model": model, "optimizer": opt, "step": 2})
    third = _train(fabric, model, opt, xs, 1, start=2, clip=0.05)
    # resume into fresh objects (another init): the next step must be the same
    torch.manual_seed(5)
    model2 = fabric.setup_module(GPT(CFG))
    opt2 = fabric.setup_optimizers(torch.optim.AdamW(model2.parameters(), lr=LR,
                                                     weight_decay=0.1))
    state = {"model": model2, "optimizer": opt2, "step": 0}
    rest = fabric.load(f"{tmp}/ckpt", state)
    resumed = _train(fabric, model2, opt2, xs, 1, start=2, clip=0.05)
    return first + third, resumed, state["step"], rest, _reference(3, clip=0.05)


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_fabric_matches_dense_and_resumes(worlds, tmp_path, kind):
    rank0 = worlds(2).run(_run_separate_setup_and_checkpoint, str(tmp_path), kind)
    for rank, (got, resumed, step, rest, ref) in enumerate(rank0):
        assert step == 2 and rest == {}
        for s in range(3):
            assert abs(got[s][0] - ref[s][0][rank]) <= 1e-5 * abs(ref[s][0][rank]), (got, ref)
        assert abs(resumed[0][0] - got[2][0]) <= 1e-6 * abs(got[2][0])


def _run_joint_setup_and_accumulation():
    fabric = _fabric()
    torch.manual_seed(0)
    model = GPT(CFG)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    model, opt = fabric.setup(model, opt)  # the optimizer is re-pointed at the shards
    xs = _batches(4, dist.get_world_size())
    from tests.lightning._lit import REDUCE_SCATTERS, count_reduce_scatters

    count_reduce_scatters()
    before = REDUCE_SCATTERS[0]
    got = _train(fabric, model, opt, xs, 2, accumulate=2)
    return got, _reference(2, accumulate=2), REDUCE_SCATTERS[0] - before


def test_fabric_joint_setup_and_no_backward_sync(worlds):
    for rank, (got, ref, reduce_scatters) in enumerate(
            worlds(2).run(_run_joint_setup_and_accumulation)):
        assert reduce_scatters == 3 * 2  # 3 groups x 2 steps: none on non-final micro-batches
        for s in range(2):
            for a in range(2):
                assert abs(got[s][a] - ref[s][a][rank]) <= 1e-5 * abs(ref[s][a][rank]), (got, ref)


class _Teacher(torch.nn.Module):
    """A plain (unsharded) module saved next to the sharded model: parameters and buffers."""

    def __init__(self, seed, extra=False):
        super().__init__()
        torch.manual_seed(seed)  # the same on every rank (a replicated module)
        self.lin = torch.nn.Linear(4, 4)
        self.norm = torch.nn.BatchNorm1d(4)
        with torch.no_grad():
            self.norm.running_mean.add_(seed)
            self.norm.num_batches_tracked.add_(seed)
        if extra:
            self.more = torch.nn.Linear(4, 2)


def _fresh(fabric):
    torch.manual_seed(5)
    model = fabric.setup_module(GPT(CFG))
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    return model, opt


def _error(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


def _save_with_teacher(fabric, path):
    torch.manual_seed(0)
    model = fabric.setup_module(GPT(CFG))
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    _train(fabric, model, opt, _batches(1, dist.get_world_size()), 1)
    teacher = _Teacher(1)
    fabric.save(path, {"model": model, "optim": opt, "teacher": teacher, "step": 1})
    return teacher


def _run_optimizer_key(tmp, kind):
    fabric = _fabric(state_dict_type=kind)
    path = f"{tmp}/ckpt"
    _save_with_teacher(fabric, path)
    m2, o2 = _fresh(fabric)
    strict = _error(lambda: fabric.load(path, {"model": m2, "optimizer": o2}))
    m2, o2 = _fresh(fabric)
    rest = fabric.load(path, {"model": m2, "optimizer": o2}, strict=False)
    return strict, len(o2.state), sorted(rest)


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_fabric_strict_load_names_a_missing_optimizer_key(worlds, tmp_path, kind):
    for strict, n_state, rest in worlds(2).run(_run_optimizer_key, str(tmp_path), kind):
        # strict: an error naming the requested key and the one the checkpoint has
        assert strict is not None and strict.startswith("KeyError") and "'optimizer'" in strict \
            and "['optim']" in strict, strict
        assert n_state == 0 and "step" in rest  # strict=False: the optimizer is left as it is


def _run_unsharded_modules(tmp, kind):
    fabric = _fabric(state_dict_type=kind)
    path = f"{tmp}/ckpt"
    teacher = _save_with_teacher(fabric, path)
    out = {}
    m2, o2 = _fresh(fabric)
    t2 = _Teacher(2)
    state = {"model": m2, "optim": o2, "teacher": t2, "step": 0}
    fabric.load(path, state)  # strict
    out["teacher"] = all(torch.equal(a, b) for a, b in
                         zip(teacher.state_dict().values(), t2.state_dict().values()))
    out["step"], out["optim_state"] = state["step"], len(o2.state)
    # a module the checkpoint does not have, and one whose keys differ
    out["absent_strict"] = _error(lambda: fabric.load(path, {"model": m2, "student": _Teacher(3)}))
    out["absent_lenient"] = _error(lambda: fabric.load(path, {"model": m2, "student": _Teacher(3)},
                                                       strict=False))
    bigger = _Teacher(4, extra=True)
    out["mismatch_strict"] = _error(lambda: fabric.load(path, {"model": m2, "teacher": bigger}))
    bigger = _Teacher(4, extra=True)
    fabric.load(path, {"model": m2, "teacher": bigger}, strict=False)
    out["mismatch_lenient"] = torch.equal(bigger.lin.weight, teacher.lin.weight) and \
        torch.equal(bigger.norm.running_mean, teacher.norm.running_mean)
    return out


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_fabric_round_trips_unsharded_modules(worlds, tmp_path, kind):
    for out in worlds(2).run(_run_unsharded_modules, str(tmp_path), kind):
        # a plain module saved with fabric.save is restored by fabric.load (params and buffers)
        assert out["teacher"] and out["step"] == 1 and out["optim_state"] > 0
        err = out["absent_strict"]
        assert err is not None and err.startswith("KeyError") and "'student'" in err, err
        assert out["absent_lenient"] is None
        err = out["mismatch_strict"]
        assert err is not None and "more." in err, err  # names the missing key(s)
        assert out["mismatch_lenient"]  # strict=False loads the keys that match
