"""fully_shard and the module API reject bad input with a clear error (1-rank gloo world)."""

from __future__ import annotations

import torch
from torch import nn

from tests.distributed._fully_shard_helpers import (
    build,
)


def _expect(fn, exc, *words):
    try:
        fn()
    except exc as e:  # noqa: PERF203
        msg = str(e)
        missing = [w for w in words if w not in msg]
        return None if not missing else f"{exc.__name__} lacks {missing}: {msg}"
    except Exception as e:  # noqa: BLE001
        return f"expected {exc.__name__}, got {type(e).__name__}: {e}"
    return f"expected {exc.__name__}, nothing raised"


class _WithParam(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.p = p


def _errors_body():
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    from lightning_vescale.fsdp import MixedPrecisionPolicy, fully_shard, get_state

    out = {}
    # (integer/bool parameters are sharded now, like FSDP2: tests/distributed/
    # test_fsdp2_compat_api.py)
    out["complex_param"] = _expect(
        lambda: fully_shard(_WithParam(nn.Parameter(torch.ones(3, dtype=torch.complex64)))),
        TypeError, "'p'", "complex")
    out["sparse_param"] = _expect(
        lambda: fully_shard(_WithParam(nn.Parameter(torch.eye(3).to_sparse()))),
        TypeError, "'p'", "dense")
    twice = nn.Linear(3, 3)
    fully_shard(twice)
    out["twice"] = _expect(lambda: fully_shard(twice), ValueError, "already called")
    theirs = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    fsdp2_fully_shard(theirs[0])
    out["fsdp2"] = _expect(lambda: fully_shard(theirs), ValueError, "PyTorch FSDP", "'0'")
    # FSDP2 allows a module without parameters of its own (it may still own the root hooks)
    out["nothing"] = None if get_state(fully_shard(nn.ReLU())).group is None else "a group?"
    gpt = build("gpt")
    fully_shard(gpt.tok_emb)  # owns the tied weight, which the head also uses
    out["tied_split"] = _expect(lambda: fully_shard(gpt), ValueError, "head.weight", "tied")
    out["granularity_key"] = _expect(
        lambda: fully_shard(nn.Linear(3, 3), granularity={"wieght": 3}), ValueError, "wieght",
        "weight")
    out["granularity_bad"] = _expect(
        lambda: fully_shard(nn.Linear(3, 3), granularity=0), ValueError, "granularity")
    out["mp_type"] = _expect(
        lambda: fully_shard(nn.Linear(3, 3), mp_policy="bf16"), TypeError, "mp_policy")
    out["mp_dtype"] = _expect(
        lambda: MixedPrecisionPolicy(param_dtype=torch.int8), TypeError, "param_dtype")
    out["not_module"] = _expect(lambda: fully_shard(torch.ones(3)), TypeError, "nn.Module")
    out["mesh"] = _expect(lambda: fully_shard(nn.Linear(3, 3), mesh="cpu"), ValueError, "mesh")
    # a group with no own parameters is fine when inner groups exist (root coordinator)
    root = nn.Sequential(nn.Linear(3, 3))
    fully_shard(root[0])
    fully_shard(root)
    out["root_ok"] = None
    return out


def test_clear_errors(worlds):
    out = worlds(1).run(_errors_body)[0]
    bad = {k: v for k, v in out.items() if v is not None}
    assert not bad, bad


def _bad_setter_args_body():
    from lightning_vescale.fsdp import fully_shard

    errors = []
    model = fully_shard(nn.Linear(4, 4))
    for call in (lambda: model.set_reshard_after_forward("no"),
                 lambda: model.set_prefetch(1),
                 lambda: fully_shard(nn.Linear(4, 4), granularity=lambda name, p: None)):
        try:
            call()
        except TypeError as e:
            errors.append(str(e))
    return errors


def test_setters_and_granularity_callable_check_types(worlds):
    for errors in worlds(1).run(_bad_setter_args_body):
        assert len(errors) == 3, errors
        assert "reshard_after_forward must be a bool, got 'no'" in errors[0]
        assert "must be a bool, got 1" in errors[1]
        assert "returned None for parameter 'weight'" in errors[2]


# -- a submodule called outside its group's forward (design note [fsdp-outside-call]) ----------
class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.block = nn.Linear(4, 4)

    def forward(self, x):
        return self.block(self.emb(x))


class _LitLike(nn.Module):
    """The LightningModule shape: the root group, the model a plain child (issue 33)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _Inner()

    def forward(self, x):
        return self.model(x)


def _outside_call_body():
    from lightning_vescale.fsdp import fully_shard

    torch.manual_seed(0)
    lm = _LitLike()
    ref = _Inner()
    ref.load_state_dict(lm.model.state_dict())
    fully_shard(lm.model.block)
    fully_shard(lm)
    x = torch.tensor([[1, 2, 3]])
    lm(x).sum().backward()  # a training step, then on_fit_end calls pl_module.model(...)
    out = {"outside": _expect(lambda: lm.model(x), RuntimeError, "Embedding ran while its "
                              "parameters are sharded", "_LitLike (the root module",
                              "unshard()", "pl_module.model")}
    lm.unshard()  # the way out the message names: gather the root group, call, reshard
    lm.model.block.unshard()
    out["unsharded_call"] = torch.equal(lm.model(x), ref(x)) or "values differ"
    lm.model.block.reshard()
    lm.reshard()
    out["inside"] = torch.equal(lm(x), ref(x)) or "values differ"
    return out


def test_submodule_called_outside_the_root_names_the_module_to_call(worlds):
    """Before: ``aten.embedding.default got mixed torch.Tensor and DTensor``."""
    out = worlds(1).run(_outside_call_body)[0]
    bad = {k: v for k, v in out.items() if v is not None and v is not True}
    assert not bad, bad
