"""The flat step never reads a device scalar on the host (issue 35), checked on the CPU.

Fused ``_fused_adam(w)_`` take one ``step`` tensor per parameter; on CUDA those live on the
GPU. The flat step used to ``.tolist()`` them every call to learn which items may share a run:
one host sync per optimizer step. ``FakeTensorMode`` stands in for CUDA tensors (as in
``test_cuda_path.py``); a ``TorchFunctionMode`` records every host read (``tolist``, ``item``)
and a ``TorchDispatchMode`` every ``_local_scalar_dense``. The whole-step check that the
identity path stays bitwise is ``distributed/test_flat_step.py::
test_flat_step_device_scalars_bitwise``.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_vescale.placement._flat_step import _read_scalar_tensors

_READS = {"tolist", "item", "__bool__", "__float__", "__int__"}


class _HostReads(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _READS:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


class _ScalarDense(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _steps(device: str, n: int) -> list[torch.Tensor]:
    with FakeTensorMode():
        return [torch.zeros((), device=device) for _ in range(n)]


def test_device_step_tensors_are_not_read_on_the_host():
    steps = _steps("cuda", 5)
    per_item: list = []
    with _HostReads() as fn, _ScalarDense() as dispatch:
        ok = _read_scalar_tensors(steps, 5, per_item)
    assert (fn.reads, dispatch.count) == ([], 0)
    # served, and each item its own run: distinct tensors cannot be known equal without a read
    assert ok and len(per_item) == 1 and len(set(per_item[0])) == 5


def test_one_shared_device_scalar_cuts_nothing():
    (lr,) = _steps("cuda", 1)
    per_item: list = []
    with _HostReads() as fn:
        assert _read_scalar_tensors([lr] * 4, 4, per_item)
    assert fn.reads == [] and per_item == []


def test_device_tensors_that_are_not_scalars_take_the_normal_path():
    with FakeTensorMode():
        lst = [torch.zeros(2, device="cuda"), torch.zeros((), device="cuda")]
    assert not _read_scalar_tensors(lst, 2, [])


def test_cpu_step_values_are_still_read():
    """On the CPU a read is a memory load: equal steps join runs, different ones cut them."""
    per_item: list = []
    assert _read_scalar_tensors([torch.tensor(3.0)] * 3, 3, per_item) and per_item == []
    assert _read_scalar_tensors([torch.tensor(3.0), torch.tensor(3.0), torch.tensor(4.0)], 3,
                                per_item)
    assert [v for v, _ in per_item[0]] == [3.0, 3.0, 4.0]
