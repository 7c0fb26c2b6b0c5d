"""torch's ``distribute_tensor`` imported by name *before* ``lightning_vescale`` (the usual order
at the top of a script, and FSDP2's rank-0 broadcast recipe) answers RaggedShard placements.

Run as a script by ``tests/distributed/test_ragged_import_order.py`` (a fresh interpreter: under
pytest ``lightning_vescale`` is imported long before any test). Prints ``OK`` on success.
"""

import sys

from torch.distributed.tensor import distribute_tensor  # noqa: I001  (the order under test)

assert "lightning_vescale" not in sys.modules, "the test needs torch's name bound first"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import Replicate  # noqa: E402

import lightning_vescale  # noqa: E402,F401  (installs RaggedShard support)
from lightning_vescale.placement import RaggedShard  # noqa: E402
from tests.harness import run_distributed  # noqa: E402

SHAPE = (6, 5)
LAYOUTS = (
    RaggedShard((0,), (2, 0, 4)),         # rows, a rank with none
    RaggedShard((0, 1), (0, 25, 5)),      # elements, rank 0 empty
    RaggedShard((0, 1), (10, 17, 3)),     # elements, units inside rows
)


def _dense(seed: int) -> torch.Tensor:
    return torch.arange(30, dtype=torch.float32).reshape(SHAPE) + 1000 * seed


def _expect(full: torch.Tensor, pl: RaggedShard, j: int) -> torch.Tensor:
    unit = full.numel() // sum(pl.local_units)
    start = sum(pl.local_units[:j]) * unit
    return full.flatten()[start:start + pl.local_units[j] * unit]


def _body_cut() -> bool:
    rank = dist.get_rank()
    meshes = {"1d": (init_device_mesh("cpu", (3,)), lambda pl: [pl], 0),
              "2d": (init_device_mesh("cpu", (1, 3), mesh_dim_names=("rep", "shard")),
                     lambda pl: [Replicate(), pl], 1)}
    for name, (mesh, placements_of, dim) in meshes.items():
        j = mesh.get_local_rank(dim)
        for pl in LAYOUTS:
            mine = _dense(rank)  # every rank's "full" differs: shows whose data arrives
            before = mine.clone()
            dt = distribute_tensor(mine, mesh, placements_of(pl))  # src_data_rank=0
            assert torch.equal(mine, before), (name, pl)
            assert dt.placements == tuple(placements_of(pl)), (name, dt.placements)
            assert torch.equal(dt.to_local(), _expect(_dense(0), pl, j)), (name, pl, rank)
            assert torch.equal(dt.full_tensor(), _dense(0)), (name, pl)
            own = distribute_tensor(mine, mesh, placements_of(pl), src_data_rank=None)
            assert torch.equal(own.to_local(), _expect(mine, pl, j)), (name, pl, rank)
            grad = distribute_tensor(mine.clone().requires_grad_(), mesh, placements_of(pl))
            assert grad.requires_grad and grad.is_leaf, (name, pl)
    return True


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(7, 11), nn.ReLU(), nn.Linear(11, 5))


def _body_rank0_broadcast() -> bool:
    """FSDP2's recipe: meta-device model, rank 0 holds the full state, distribute_tensor
    broadcasts it into each sharded parameter's placements, load_state_dict(assign=True)."""
    from lightning_vescale.fsdp import fully_shard

    rank = dist.get_rank()
    torch.manual_seed(0)
    ref = _model()
    with torch.device("meta"):
        model = _model()
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    assert any(isinstance(p.placements[0], RaggedShard) for p in model.parameters())
    full_sd = ref.state_dict() if rank == 0 else {
        k: torch.full_like(v, float("nan")) for k, v in ref.state_dict().items()}
    sharded = {}
    for name, meta_param in model.state_dict().items():
        dt = distribute_tensor(full_sd[name], meta_param.device_mesh, meta_param.placements,
                               src_data_rank=0)
        sharded[name] = nn.Parameter(dt)
    model.load_state_dict(sharded, assign=True)
    for name, p in model.named_parameters():
        assert torch.equal(p.full_tensor(), ref.state_dict()[name]), name
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model(x), ref(x))
    return True


def _check_identity() -> None:
    """Taught in place: one object under every name, torch's signature, idempotent."""
    import inspect

    import torch.distributed._state_dict_utils as sd_utils
    import torch.distributed.tensor as dt
    from torch.distributed.tensor import _api

    from lightning_vescale.placement import install

    install()  # a second call changes nothing
    for fn in (dt.distribute_tensor, _api.distribute_tensor, sd_utils.distribute_tensor):
        assert fn is distribute_tensor, fn
    assert distribute_tensor.__name__ == "distribute_tensor"
    params = inspect.signature(distribute_tensor).parameters
    assert [(p.name, p.kind.name, p.default) for p in params.values()] == [
        ("tensor", "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty),
        ("device_mesh", "POSITIONAL_OR_KEYWORD", None),
        ("placements", "POSITIONAL_OR_KEYWORD", None),
        ("src_data_rank", "KEYWORD_ONLY", 0)], params
    assert _api._lightning_vescale_distribute_tensor.__wrapped__.__code__.co_filename \
        == _api.__file__


if __name__ == "__main__":
    _check_identity()
    assert run_distributed(_body_cut, 3, timeout=120) == [True] * 3
    assert run_distributed(_body_rank0_broadcast, 3, timeout=120) == [True] * 3
    print("OK")
