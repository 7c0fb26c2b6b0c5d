"""Layer 4: Muon's parameter groups: routing, hyper-parameters and what they mean.

Which parameters Muon orthogonalises and which go to its AdamW fallback (:class:`Router`, with
:data:`DEFAULT_ADAMW_PATTERNS`); how a user's param group becomes complete groups of one kind
each (:func:`resolve_groups`); the checks of each kind's hyper-parameters (``ValueError`` /
``TypeError`` naming the setting); and what the step reads off a Muon parameter: its 2-D view
(:func:`matrix_shape`), the stack of matrices it is (:func:`matrix_stack`, design note
[muon-stacked-experts]) and each matrix's adjusted learning rate (:func:`adjusted_lr`, as
``torch.optim.Muon``). Nothing here touches tensor data: shapes, names and settings only.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_vescale.optim._newton_schulz import validate_ns_args

__all__ = [
    "DEFAULT_ADAMW_PATTERNS",
    "Router",
    "resolve_groups",
    "matrix_shape",
    "matrix_stack",
    "MATRIX_VIEWS",
    "adjusted_lr",
    "scalar",
    "check_muon_hparams",
    "check_adamw_hparams",
]

#: Regexes (``re.search`` on the parameter's qualified name) routed to AdamW by default:
#:
#: * embeddings: a name component that is, or has an ``_``-separated word that is, ``emb``,
#:   ``embed`` or ``embedding`` (plural too): ``tok_emb``, ``pos_emb``, ``embed_tokens``,
#:   ``word_embeddings``, ``embedding``; and GPT-2's ``wte``/``wpe``. Not ``ensemble``,
#:   ``membrane``, ``assembler``.
#: * the model's output head: a component ``lm_head`` or ``classifier`` anywhere, or a *top-level*
#:   ``head``/``output``/``fc_out`` (no component before it except the wrapper attributes
#:   ``model``, ``module``, ``_orig_mod``, ``_forward_module``, as in a LightningModule's
#:   ``self.model``). So ``head.weight`` and ``model.head.weight`` go to AdamW, but hidden
#:   layers named ``output`` (``encoder.layer.0.output.dense.weight``,
#:   ``blocks.0.attn.output.weight``) stay on Muon.
DEFAULT_ADAMW_PATTERNS: tuple[str, ...] = (
    r"(^|[._])(emb|embed|embedding)s?([._]|$)",
    r"(^|\.)(wte|wpe|lm_head|classifier)(\.|$)",
    r"^((model|module|_orig_mod|_forward_module)\.)*(head|output|fc_out)(\.|$)",
)

# The keys of a resolved group of each kind (besides "params", "param_names", "use_muon").
_MUON_KEYS = ("lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps",
             "adjust_lr_fn", "matrix_view")
_ADAMW_KEYS = ("lr", "betas", "eps", "weight_decay")
_ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
#: The values of Muon's ``matrix_view`` (see :func:`matrix_stack`).
MATRIX_VIEWS = ("auto", "stack", "flatten")

NamedParams = list[tuple[str | None, Tensor]]


# -------------------------------------------------------------------------------------------------
# Routing
# -------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Router:
    """Which kind a parameter without an explicit group flag goes to (see :class:`Muon`).

    ``muon_patterns`` match -> Muon (it must be >= 2-D); else ``adamw_patterns`` match -> AdamW;
    else ``ndim >= 2`` -> Muon, otherwise AdamW. Without a name only the shape rule applies.
    """

    muon: tuple[re.Pattern, ...]
    adamw: tuple[re.Pattern, ...]

    @classmethod
    def from_patterns(cls, muon_patterns: Sequence[str], adamw_patterns: Sequence[str]) -> Router:
        """Compile the patterns (``TypeError`` for a bare string, ``ValueError`` for a bad
        regex, naming the argument)."""
        if isinstance(muon_patterns, str) or isinstance(adamw_patterns, str):
            raise TypeError("muon_patterns and adamw_patterns must be sequences of regex "
                            "strings, e.g. adamw_patterns=('lm_head',), not a single string")
        return cls(muon=_compile_patterns(muon_patterns, "muon_patterns"),
                   adamw=_compile_patterns(adamw_patterns, "adamw_patterns"))

    def to_muon(self, name: str | None, p: Tensor) -> bool:
        """Whether parameter ``p`` (named ``name``, or ``None``) goes to Muon."""
        if name is not None and any(r.search(name) for r in self.muon):
            if p.ndim < 2:
                raise ValueError(f"muon_patterns matched parameter {name!r} of shape "
                                 f"{tuple(p.shape)}, but Muon needs >= 2-D parameters; narrow "
                                 "the pattern.")
            return True
        if name is not None and any(r.search(name) for r in self.adamw):
            return False
        return p.ndim >= 2


def resolve_groups(param_group: dict[str, Any], router: Router, muon_defaults: dict[str, Any],
                   adamw_defaults: dict[str, Any], *, named_optimizer: bool) -> list[dict]:
    """The complete group(s) a user's ``param_group`` becomes, each of one kind.

    A group with ``use_muon`` (bool) is of that kind and takes its kind's plain keys. A group
    without is routed per parameter by ``router`` and split in two (a Muon group first, also
    when nothing is routed at all); its plain keys go to the Muon half, ``adamw_``-prefixed ones
    to the AdamW half. Each result holds every key of its kind (the defaults under the group's
    own), ``use_muon``, and ``params`` as ``(name, tensor)`` pairs when all parameters are named
    (torch then keeps ``param_names``). ``named_optimizer``: the optimizer's groups carry
    ``param_names``, so an empty group gets an empty list of them. Everything is checked before
    anything is returned.
    """
    if not isinstance(param_group, dict):
        raise TypeError(f"param_group must be a dict, got {type(param_group).__name__}")
    group = dict(param_group)
    raw = group.pop("params")
    raw = [raw] if isinstance(raw, Tensor) else list(raw)
    named = [(x if isinstance(x, tuple) else (None, x)) for x in raw]
    if "param_names" in group:  # e.g. a group re-added from another optimizer
        names = list(group.pop("param_names"))
        named = [(n, p) for n, (_, p) in zip(names, named)]
    for name, p in named:
        if not isinstance(p, Tensor):
            raise TypeError(f"Muon can only optimize Tensors, got {type(p).__name__} "
                            f"for parameter {name!r}")
        if torch.is_complex(p):
            raise TypeError(f"Muon does not support complex parameters ({name!r})")
    if "use_muon" in group:
        use_muon = group.pop("use_muon")
        if not isinstance(use_muon, bool):
            raise TypeError(f"param group 'use_muon' must be a bool, got {use_muon!r}")
        parts = [(named, use_muon, group)]
    else:
        muon_kw = {k: v for k, v in group.items() if not k.startswith("adamw_")}
        adamw_kw = {k[len("adamw_"):]: v for k, v in group.items() if k.startswith("adamw_")}
        to_muon = [(n, p) for n, p in named if router.to_muon(n, p)]
        to_adamw = [(n, p) for n, p in named if not router.to_muon(n, p)]
        parts = []
        if to_muon or not to_adamw:
            parts.append((to_muon, True, muon_kw))
        if to_adamw:
            parts.append((to_adamw, False, adamw_kw))
    return [_resolve(part, use_muon, overrides, muon_defaults if use_muon else adamw_defaults,
                     named_optimizer=named_optimizer)
            for part, use_muon, overrides in parts]


def _resolve(named: NamedParams, use_muon: bool, overrides: dict[str, Any],
             defaults: dict[str, Any], *, named_optimizer: bool) -> dict[str, Any]:
    keys = _MUON_KEYS if use_muon else _ADAMW_KEYS
    unknown = sorted(set(overrides) - set(keys))
    if unknown:
        kind = "Muon" if use_muon else "AdamW"
        raise ValueError(f"unknown {kind} param-group option(s) {unknown}; a {kind} group "
                         f"accepts {list(keys)} (an auto-routed group takes the AdamW ones "
                         "with an 'adamw_' prefix)")
    group = {**defaults, **overrides, "use_muon": use_muon}
    where = f"param group (use_muon={use_muon})"
    if use_muon:
        group["ns_coefficients"] = tuple(group["ns_coefficients"])
        check_muon_hparams(group, where=where)
        for name, p in named:
            if p.ndim < 2:
                raise ValueError(f"parameter {name!r} of shape {tuple(p.shape)} is in a "
                                 "use_muon=True group, but Muon needs >= 2-D parameters; "
                                 "put it in a use_muon=False (AdamW) group.")
    else:
        group["betas"] = tuple(group["betas"])
        check_adamw_hparams(group, where=where, prefix="")
    has_names = all(n is not None for n, _ in named) and bool(named)
    if not has_names and any(n is not None for n, _ in named):
        raise ValueError("give names for all parameters or for none "
                         "(mix of (name, tensor) pairs and bare tensors)")
    group["params"] = [(n, p) for n, p in named] if has_names else [p for _, p in named]
    if not named and named_optimizer:
        group["param_names"] = []
    return group


# -------------------------------------------------------------------------------------------------
# What the step reads off a parameter
# -------------------------------------------------------------------------------------------------
def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """2-D view of a Muon parameter: ``(shape[0], prod(shape[1:]))``."""
    return int(shape[0]), math.prod(int(s) for s in shape[1:])


def matrix_stack(shape: Sequence[int], view: str = "auto") -> tuple[int, int, int]:
    """The matrices Muon orthogonalises for a parameter of ``shape``: ``(count, rows, cols)``,
    ``count`` matrices of ``rows x cols`` consecutive in the flat row-major tensor.

    Design note [muon-stacked-experts]
    ----------------------------------
    A mixture-of-experts layer often stores its experts as one ``(E, out, in)`` tensor. Each
    expert is its own linear map, so Muon must orthogonalise each ``(out, in)`` matrix on its own
    and scale its learning rate by that matrix's shape: exactly ``torch.optim.Muon`` on ``E``
    separate 2-D parameters. Flattening the stack to ``(E * out, in)`` mixes the experts'
    spectra (and scales the lr by ``E * out / in``): a different, wrong update. ``view``:

    * ``"auto"`` (default): 2-D as is; 3-D as a stack of ``shape[0]`` matrices
      ``(shape[1], shape[2])``; 4-D and more (convolutions ``(out, in, kh, kw)``) flattened to
      ``(shape[0], prod(shape[1:]))`` as before;
    * ``"stack"``: every leading dim is a stack dim: ``prod(shape[:-2])`` matrices
      ``(shape[-2], shape[-1])``;
    * ``"flatten"``: one ``(shape[0], prod(shape[1:]))`` matrix (the behaviour before stacks:
      the whole stack orthogonalised together).

    A param group's ``matrix_view`` key overrides the optimizer's default. Because the
    matrices are consecutive, a sharded stack is a list of matrices with their own rank
    ranges: under ``granularity="matrix"`` each lies whole on one rank and is orthogonalised
    there without communication; otherwise the owner plan balances whole experts (not whole
    stacks) across ranks (design note [distributed-muon] in ``muon.py``).
    """
    shape = tuple(int(s) for s in shape)
    if view not in MATRIX_VIEWS:
        raise ValueError(f"matrix_view must be one of {MATRIX_VIEWS}, got {view!r}")
    if view == "stack" or (view == "auto" and len(shape) == 3):
        return math.prod(shape[:-2]), shape[-2], shape[-1]
    rows, cols = matrix_shape(shape)
    return 1, rows, cols


def adjusted_lr(lr: float, adjust_lr_fn: str | None, rows: int, cols: int) -> float:
    """torch.optim.Muon's learning-rate adjustment, on the 2-D (flattened) shape."""
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, rows / cols))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(rows, cols))
    else:
        ratio = 1.0
    return lr * ratio


def scalar(x: Any) -> float:
    """A hyper-parameter that may be a 1-element tensor (a tensor ``lr``) as a Python number."""
    return x.item() if isinstance(x, Tensor) else x


# -------------------------------------------------------------------------------------------------
# Validation
# -------------------------------------------------------------------------------------------------
def check_muon_hparams(h: dict[str, Any], *, where: str) -> None:
    """Raise naming the bad Muon setting of ``h`` (a group or the defaults); ``where`` says
    which (``"Muon"``, ``"param group (use_muon=True)"``)."""
    lr = h["lr"]
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError(f"{where}: Tensor lr must have 1 element, got shape {tuple(lr.shape)}")
    _check_non_negative(h, ("lr", "momentum", "weight_decay"), where=where, prefix="")
    if h["adjust_lr_fn"] not in _ADJUST_LR_FNS:
        raise ValueError(f"{where}: adjust_lr_fn must be one of {_ADJUST_LR_FNS}, got "
                         f"adjust_lr_fn={h['adjust_lr_fn']!r}")
    if h.get("matrix_view", "auto") not in MATRIX_VIEWS:
        raise ValueError(f"{where}: matrix_view must be one of {MATRIX_VIEWS}, got "
                         f"matrix_view={h['matrix_view']!r} ('auto': a 3-D weight is a stack "
                         "of experts, each orthogonalised on its own)")
    if not isinstance(h["nesterov"], bool):
        raise TypeError(f"{where}: nesterov must be a bool, got nesterov={h['nesterov']!r}")
    validate_ns_args(h["ns_coefficients"], h["ns_steps"], h["eps"])


def check_adamw_hparams(h: dict[str, Any], *, where: str, prefix: str) -> None:
    """As :func:`check_muon_hparams` for the AdamW fallback's settings; ``prefix`` is how the
    user spelled them (``"adamw_"`` for the constructor's arguments)."""
    _check_non_negative(h, ("lr", "eps", "weight_decay"), where=where, prefix=prefix)
    betas = h["betas"]
    if len(betas) != 2 or not all(0.0 <= scalar(b) < 1.0 for b in betas):
        raise ValueError(f"{where}: {prefix}betas must be two floats in [0, 1), got {betas!r}")


def _check_non_negative(h: dict[str, Any], keys: Sequence[str], *, where: str,
                        prefix: str) -> None:
    for key in keys:
        if not scalar(h[key]) >= 0.0:
            raise ValueError(f"{where}: {prefix}{key} must be >= 0, got {prefix}{key}={h[key]!r}")


def _compile_patterns(patterns: Sequence[str], arg: str) -> tuple[re.Pattern, ...]:
    out = []
    for p in patterns:
        try:
            out.append(re.compile(p))
        except (re.error, TypeError) as e:
            raise ValueError(f"{arg}: {p!r} is not a valid regular expression ({e})") from e
    return tuple(out)
