"""Shared by the Hugging Face weight tests: a load that counts the tensor bytes it reads."""

from __future__ import annotations

from pathlib import Path

from torch import nn


def load_counting_bytes(model: nn.Module, path: str | Path) -> int:
    """``load_safetensors(model, path)``; the tensor bytes this rank read (every read goes
    through ``_safetensors_format._read_exactly``)."""
    from lightning_vescale.checkpoint import _safetensors_format as fmt
    from lightning_vescale.checkpoint import load_safetensors

    counted, original = [0], fmt._read_exactly

    def counting(stream, view, entry):
        counted[0] += len(view)
        return original(stream, view, entry)

    fmt._read_exactly = counting
    try:
        load_safetensors(model, path)
    finally:
        fmt._read_exactly = original
    return counted[0]
