"""Layer 4: optimizers that work on RaggedShard-sharded parameters without extra communication.

The optimizers:

* :class:`AdamW8bit` (``adamw8bit.py``): AdamW with block-wise 8-bit moments; blocks align with
  shard bounds, so states need no communication.
* :class:`SOAP` (``soap.py``): Adam in Shampoo's eigenbasis on whole matrices (local under
  ``granularity="matrix"``) and :class:`Shampoo` (``shampoo.py``, Adam grafting); their
  Kronecker factors are ``_kronecker.py``'s pure functions;
* :class:`Muon` (``muon.py``): Muon with an AdamW fallback; sharded matrices go whole to one
  load-balanced owner rank for Newton–Schulz and come back.
* :class:`FlatParamOptimizer` / :func:`flat_param_optimizer` (``_flat_params.py``): wraps
  ``torch.optim.Adam/AdamW/SGD`` so that they step a few flat views of the DBuffer shards
  instead of one tensor per parameter (bitwise the same result).

Their building blocks, importable from here (pure functions, no process group):

* block-wise 8-bit quantization (``_quant.py``): :data:`DEFAULT_BLOCK_SIZE`, :func:`num_blocks`,
  :func:`quantize_blockwise` / :func:`dequantize_blockwise`, the code maps, and the state type
  :class:`QuantizedMoment`;
* Newton–Schulz (``_newton_schulz.py``): :func:`newton_schulz` (the fast path, bitwise equal to
  ``torch.optim.Muon``'s), :func:`newton_schulz_reference`, :func:`newton_schulz_flops`;
* Muon's plan (``_muon_plan.py``): :func:`assign_owners`, :func:`plan_buckets`; its routing
  default :data:`DEFAULT_ADAMW_PATTERNS` (``_muon_groups.py``).

``_base.py`` holds what the optimizers share (local views, parameter layouts and checks, state
export/import for distributed checkpoint; design note [sharded-optimizer]): a new optimizer is
one module on top of it, plus one import line here.
"""

from lightning_vescale.optim._flat_params import (
    SUPPORTED_OPTIMIZERS,
    FlatParamOptimizer,
    flat_param_optimizer,
)
from lightning_vescale.optim._muon_groups import DEFAULT_ADAMW_PATTERNS
from lightning_vescale.optim._muon_plan import assign_owners, plan_buckets
from lightning_vescale.optim._newton_schulz import (
    DEFAULT_EPS,
    DEFAULT_NS_COEFFICIENTS,
    DEFAULT_NS_STEPS,
    newton_schulz,
    newton_schulz_flops,
    newton_schulz_reference,
)
from lightning_vescale.optim._quant import (
    DEFAULT_BLOCK_SIZE,
    CodeBook,
    QuantizedMoment,
    block_absmax,
    codebook,
    dequantize_blockwise,
    dynamic_code_map,
    num_blocks,
    quantize_blockwise,
    signed_code_map,
    unsigned_code_map,
)
from lightning_vescale.optim.adamw8bit import DEFAULT_MIN_8BIT_SIZE, AdamW8bit
from lightning_vescale.optim.muon import Muon
from lightning_vescale.optim.shampoo import Shampoo
from lightning_vescale.optim.soap import SOAP

__all__ = [
    # the optimizers
    "AdamW8bit",
    "Muon",
    "SOAP",
    "Shampoo",
    # torch's element-wise optimizers on flat shards
    "FlatParamOptimizer",
    "SUPPORTED_OPTIMIZERS",
    "flat_param_optimizer",
    # block-wise quantization (alphabetical)
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_MIN_8BIT_SIZE",
    "CodeBook",
    "QuantizedMoment",
    "block_absmax",
    "codebook",
    "dequantize_blockwise",
    "dynamic_code_map",
    "num_blocks",
    "quantize_blockwise",
    "signed_code_map",
    "unsigned_code_map",
    # Newton–Schulz and Muon's plan
    "DEFAULT_ADAMW_PATTERNS",
    "DEFAULT_EPS",
    "DEFAULT_NS_COEFFICIENTS",
    "DEFAULT_NS_STEPS",
    "assign_owners",
    "newton_schulz",
    "newton_schulz_flops",
    "newton_schulz_reference",
    "plan_buckets",
]
