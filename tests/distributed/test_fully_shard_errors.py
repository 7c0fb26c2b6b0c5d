"""fully_shard rejects bad input with a clear error (run on a 1-rank gloo world)."""

from __future__ import annotations

import torch
from torch import nn

from tests.distributed.test_fully_shard_parity import build


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

    from lightning_vescale.fsdp import MixedPrecisionPolicy, fully_shard

    out = {}
    out["int_param"] = _expect(
        lambda: fully_shard(_WithParam(nn.Parameter(torch.ones(3, dtype=torch.long),
                                                    requires_grad=False))),
        TypeError, "'p'", "torch.int64", "register_buffer")
    out["bool_param"] = _expect(
        lambda: fully_shard(_WithParam(nn.Parameter(torch.ones(3, dtype=torch.bool),
                                                    requires_grad=False))),
        TypeError, "'p'", "torch.bool")
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
    out["nothing"] = _expect(lambda: fully_shard(nn.ReLU()), ValueError, "no parameters")
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
