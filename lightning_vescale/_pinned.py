"""Pinned (page-locked) host memory: when to use it, and what it costs.

Design note [pinned-host]
-------------------------
A host-to-device copy from pageable memory goes through a driver staging buffer and may
synchronise the host; from pinned memory it is a DMA the stream orders (``non_blocking``).
Pinning needs an accelerator runtime (``pin_memory=True`` raises on a CPU-only build), so
:func:`should_pin` decides from the target device and ``torch.accelerator`` only: pure, and
testable without a GPU. Small host staging tensors (the root's gradient flags, one byte per
trainable parameter) come from torch's caching host allocator (:func:`host_source`): it keeps
each block until the copies recorded on it finish, so a fresh tensor per call is both cheap
(a cached block) and safe (never rewritten under an in-flight copy).

The caching host allocator rounds every pinned request up to a power of two (CUDA's
``CachingHostAllocator``; ``cudaHostAlloc`` of the rounded size), so pinned buffers of offloaded
shards use up to twice their nominal bytes of host memory: :func:`pinned_host_bytes` is what
a request really takes, and ``MemoryProfiler`` / the offload docs report both figures.
"""

from __future__ import annotations

import torch


def should_pin(device: torch.device) -> bool:
    """Whether a host tensor copied to ``device`` should be pinned: ``device`` is an
    accelerator (not the CPU, not meta) and an accelerator runtime exists to pin with."""
    if device.type in ("cpu", "meta"):
        return False
    return bool(torch.accelerator.is_available())


def host_source(data: bytes, device: torch.device) -> torch.Tensor:
    """A uint8 host tensor holding ``data``, to be copied to ``device``: pinned (from the
    caching host allocator) when :func:`should_pin`, else a zero-copy view of a bytearray
    (``frombuffer``: no ATen op, which the zero-copy tests count)."""
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if not should_pin(device) or not data:
        return t
    pinned = torch.empty(len(data), dtype=torch.uint8, pin_memory=True)
    return pinned.copy_(t)


def pinned_host_bytes(nbytes: int) -> int:
    """Host bytes a pinned request of ``nbytes`` takes in the caching host allocator: the next
    power of two (0 for 0)."""
    if nbytes <= 0:
        return 0
    return 1 << (nbytes - 1).bit_length()
