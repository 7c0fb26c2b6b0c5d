"""``dry_run(...)``: the engine (and FSDP2) as rank r of N under the fake group (see [dryrun])."""

from __future__ import annotations

import dataclasses
import resource
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_vescale.dryrun._run import OPTIMIZERS, EngineReport, run_step
from lightning_vescale.planner.presets import PRESETS, TransformerConfig, get_preset

__all__ = ["DryRunReport", "dry_run"]

ENGINES = ("vescale", "fsdp2")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DryRunReport:
    """The dry run of one rank: the settings and one :class:`EngineReport` per engine."""

    model: str
    world_size: int
    rank: int
    replicas: int
    batch_size: int
    seq_len: int
    optimizer: str
    settings: dict[str, str]
    engines: dict[str, EngineReport]
    #: engine -> why it did not run (e.g. AdamW8bit refuses FSDP2's ``Shard(0)`` parameters)
    skipped: dict[str, str]
    seconds: float
    host_max_rss_bytes: int

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def ratio(self, key: str = "peak_bytes") -> float | None:
        """ours / FSDP2 for ``peak_bytes`` or an ``after_step`` category (``None`` when either
        engine is missing or FSDP2's figure is 0)."""
        if "vescale" not in self.engines or "fsdp2" not in self.engines:
            return None

        def get(r: EngineReport) -> int:
            return r.peak_bytes if key == "peak_bytes" else r.after_step.get(key, 0)

        base = get(self.engines["fsdp2"])
        return get(self.engines["vescale"]) / base if base else None


def _model_builder(model: Any, hf_config: Any, init_args: dict[str, Any] | None,
                   overrides: dict[str, Any] | None
                   ) -> tuple[str, Callable[[], nn.Module]]:
    """(label, builder) for a preset name / TransformerConfig, an HF config, a
    ``module:Class`` path or a callable returning a module."""
    from lightning_vescale.dryrun import _models

    if hf_config is not None:
        import transformers
        cfg = hf_config
        if not isinstance(cfg, transformers.PretrainedConfig):
            cfg = transformers.AutoConfig.from_pretrained(str(cfg), local_files_only=True)
        for k, v in (overrides or {}).items():
            setattr(cfg, k, v)
        label = getattr(cfg, "_name_or_path", "") or type(cfg).__name__
        return label, lambda: _models.build_hf_model(cfg)
    if isinstance(model, str) and ":" in model:
        return model, lambda: _models.build_user_model(model, init_args)
    if isinstance(model, (str, TransformerConfig)):
        cfg = get_preset(model) if isinstance(model, str) else model
        if overrides:
            cfg = dataclasses.replace(cfg, **overrides)
        label = model if isinstance(model, str) else "TransformerConfig"
        return label, lambda: _models.PresetTransformer(cfg)
    if callable(model):
        return getattr(model, "__name__", "model"), model
    raise TypeError(
        f"model must be a preset name ({sorted(PRESETS)}), a TransformerConfig, "
        f"'package.module:Class' or a callable returning an nn.Module; got {model!r}")


def dry_run(model: Any = "llama3-70b", *, world_size: int, rank: int = 0, replicas: int = 1,
            engines: tuple[str, ...] = ENGINES, batch_size: int = 1, seq_len: int = 4096,
            optimizer: str = "adamw", granularity: Any = None,
            reshard_after_forward: Any = None, mixed_precision: str | None = "bf16",
            comm_policy: Any = None, activation_checkpointing: bool = False,
            hf_config: Any = None,
            init_args: dict[str, Any] | None = None,
            overrides: dict[str, Any] | None = None) -> DryRunReport:
    """Run one training step of each engine in ``engines`` as rank ``rank`` of ``world_size``.

    Args:
        model: a preset name (``"llama3-70b"``, ``"gpt-oss-120b"``, ``"deepseek-v3"``, ...), a
            :class:`TransformerConfig`, ``"package.module:Class"`` (``init_args`` passed) or a
            callable returning an ``nn.Module`` whose forward takes token ids.
        world_size: the fake world's size.
        rank: this process's rank in it.
        replicas: HSDP replica count (a ``(replicas, world_size // replicas)`` mesh).
        engines: ``"vescale"`` (ours) and/or ``"fsdp2"`` (torch's).
        batch_size: the micro-batch's sequences of token ids.
        seq_len: their length.
        optimizer: ``"adamw"``, ``"adamw8bit"``, ``"muon"``, ``"soap"`` or ``"shampoo"``
            (FSDP2 runs the last four as well when they accept its ``Shard(0)`` DTensors;
            otherwise ``skipped`` says why).
        granularity: ``fully_shard``'s argument.
        reshard_after_forward: ``fully_shard``'s argument.
        comm_policy: ``fully_shard``'s argument (a ``CommPolicy``).
        activation_checkpointing: every block recomputes its forward in backward.
        mixed_precision: ``"bf16"`` (bf16 compute, fp32 reduce and master weights) or ``None``.
        hf_config: a transformers config (object, or path / cached model id): overrides
            ``model``; ``overrides`` set its attributes (or the preset's fields, e.g.
            ``{"layers": 2}``).

    The process must not have a default process group: the dry run creates the fake one and
    destroys it at the end.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
    if replicas < 1 or world_size % replicas:
        raise ValueError(f"replicas={replicas} must divide world_size={world_size}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}: choose one of {OPTIMIZERS}")
    for e in engines:
        if e not in ENGINES:
            raise ValueError(f"engines: unknown engine {e!r}; choose from {ENGINES}")
    if mixed_precision not in (None, "bf16"):
        raise ValueError(f"mixed_precision must be 'bf16' or None, got {mixed_precision!r}")
    if dist.is_initialized():
        raise RuntimeError("dry_run creates its own fake process group: call it in a process "
                           "without one (torch.distributed is already initialised here)")
    label, build = _model_builder(model, hf_config, init_args, overrides)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        # the engine's view checks compare data pointers, which FakeTensors lack (both 0)
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        reports, skipped = _run_engines(
            build, world_size=world_size, rank=rank, replicas=replicas, engines=engines,
            batch_size=batch_size, seq_len=seq_len, optimizer=optimizer,
            granularity=granularity, reshard_after_forward=reshard_after_forward,
            mixed_precision=mixed_precision, comm_policy=comm_policy,
            activation_checkpointing=activation_checkpointing)
    settings = {k: str(v) for k, v in (("granularity", granularity),
                                        ("reshard_after_forward", reshard_after_forward),
                                        ("mixed_precision", mixed_precision),
                                        ("comm_policy", comm_policy),
                                        ("activation_checkpointing",
                                         activation_checkpointing or None)) if v is not None}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return DryRunReport(model=label, world_size=world_size, rank=rank, replicas=replicas,
                        batch_size=batch_size, seq_len=seq_len, optimizer=optimizer,
                        settings=settings, engines=reports, skipped=skipped,
                        seconds=time.perf_counter() - t0, host_max_rss_bytes=rss)


def _run_engines(build: Callable[[], nn.Module], *, world_size: int, rank: int, replicas: int,
                 engines: tuple[str, ...], batch_size: int, seq_len: int, optimizer: str,
                 granularity: Any, reshard_after_forward: Any, mixed_precision: str | None,
                 comm_policy: Any, activation_checkpointing: bool
                 ) -> tuple[dict[str, EngineReport], dict[str, str]]:
    """Each engine's step under the fake group (created here, destroyed at the end)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lightning_vescale.fsdp import MixedPrecisionPolicy
    from lightning_vescale.mesh import init_mesh

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        mesh = init_mesh("cpu", replicas=replicas)
        if replicas > 1 and mesh.size(1) > 1:
            # HSDP's flattened group: a DeviceMesh computes coordinates with tensor ops, which
            # must be real ones; made here (outside the fake mode), cached by torch
            mesh._flatten()
        options: dict[str, Any] = {"reshard_after_forward": reshard_after_forward}
        if granularity is not None:
            options["granularity"] = granularity
        if comm_policy is not None:
            options["comm_policy"] = comm_policy
        if mixed_precision == "bf16":
            options["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        reports: dict[str, EngineReport] = {}
        skipped: dict[str, str] = {}
        for engine in engines:
            opts = dict(options)
            if engine == "fsdp2" and "mp_policy" in opts:
                from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
                opts["mp_policy"] = TorchMP(param_dtype=torch.bfloat16,
                                            reduce_dtype=torch.float32)
            with FakeTensorMode(allow_non_fake_inputs=True):
                def inputs() -> tuple[torch.Tensor, torch.Tensor]:  # token 0: values unused
                    ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
                    return ids, torch.zeros(batch_size, seq_len, dtype=torch.long)

                try:
                    reports[engine] = run_step(
                        engine=engine, build=build, mesh=mesh, inputs=inputs,
                        optimizer=optimizer, options=opts,
                        activation_checkpointing=activation_checkpointing)
                except TypeError as exc:  # an optimizer that refuses FSDP2's Shard(0) params
                    if engine == "vescale":
                        raise
                    skipped[engine] = f"{type(exc).__name__}: {exc}"
        return reports, skipped
    finally:
        dist.destroy_process_group()
        from lightning_vescale import mesh as _mesh
        from lightning_vescale.placement._ops import clear_sharding_caches
        _mesh._MESHES.clear()
        clear_sharding_caches()  # cached specs hold the fake ranks' meshes
