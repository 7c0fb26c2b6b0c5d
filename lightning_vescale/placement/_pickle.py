"""Pickling and deep-copying DTensors whose local tensor is a view at a storage offset.

Design note [dtensor-views-pickle]
----------------------------------
``fully_shard``'s parameters, gradients and flat optimizer states are DTensors whose local
tensors are 1-D views into one DBuffer shard, so all but the first sit at a non-zero storage
offset. torch 2.13's DTensor wrapper takes that offset from its local tensor, and
``Tensor.__reduce_ex__`` / ``Tensor.__deepcopy__`` recognise a wrapper subclass (which has no
storage of its own) only by ``data_ptr() == 0``. With an offset the wrapper's ``data_ptr()`` is
``offset * itemsize``, so torch takes it for a tensor with real storage and fails with
"Attempted to access the data pointer on an invalid python storage": ``torch.save(p)``,
``torch.save(model.state_dict())`` and ``copy.deepcopy(model)`` broke for every such
parameter. torch's own ``DTensor.from_local(base[4:8], ...)`` fails the same way.

:func:`wrap_reduce_ex` and :func:`wrap_deepcopy` (E5, registered by ``install()``) take torch's
wrapper-subclass branch for a DTensor with a non-zero storage offset, exactly as torch does for
one at offset 0: pickling rebuilds the wrapper from its metadata and its ``__dict__`` (the local
tensor, pickled as the view it is: its storage is written once per file however many views
share it), deep-copying clones the DTensor and deep-copies its ``__dict__`` (views of one
storage stay views of one copied storage). Every other tensor keeps torch's implementation.
"""

from __future__ import annotations

import copy
import copyreg
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

__all__ = ["wrap_deepcopy", "wrap_reduce_ex"]


def _needs_wrapper_path(t: torch.Tensor) -> bool:
    return (isinstance(t, DTensor) and t.storage_offset() != 0
            and not isinstance(t._local_tensor, torch._subclasses.fake_tensor.FakeTensor)
            and t.device.type != "meta")


def wrap_reduce_ex(original: Callable) -> Callable:
    """E5: ``DTensor.__reduce_ex__`` that pickles offset wrappers like offset-0 ones."""

    def __reduce_ex__(self: torch.Tensor, proto: int) -> Any:
        if not _needs_wrapper_path(self):
            return original(self, proto)
        state = torch._utils._get_obj_state(self)
        args = (type(self), self.dtype, tuple(self.size()), self.stride(), self.storage_offset(),
                self.layout, self.device, self.requires_grad)
        self._clear_non_serializable_cached_data()
        return (torch._tensor._rebuild_from_type_v2,
                (torch._utils._rebuild_wrapper_subclass, type(self), args, state))

    __reduce_ex__.__wrapped__ = original  # type: ignore[attr-defined]
    return __reduce_ex__


def wrap_deepcopy(original: Callable) -> Callable:
    """E5: ``DTensor.__deepcopy__`` that copies offset wrappers like offset-0 ones."""

    def __deepcopy__(self: torch.Tensor, memo: dict) -> Any:
        if not _needs_wrapper_path(self) or not self.is_leaf:
            return original(self, memo)  # (non-leaves: torch's error)
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new = self.clone()
            if self.requires_grad:
                new.requires_grad_()
            if self.grad is not None:
                new.grad = self.grad.__deepcopy__(memo)
            for slot in copyreg._slotnames(self.__class__):  # type: ignore[attr-defined]
                if hasattr(self, slot):
                    setattr(new, slot, copy.deepcopy(getattr(self, slot), memo))
            self._clear_non_serializable_cached_data()
            new.__dict__ = copy.deepcopy(self.__dict__, memo)
        memo[id(self)] = new
        return new

    __deepcopy__.__wrapped__ = original  # type: ignore[attr-defined]
    return __deepcopy__
