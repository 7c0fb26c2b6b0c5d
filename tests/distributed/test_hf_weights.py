"""Hugging Face weights in and out of ``fully_shard`` models (issue 27): ``load_safetensors`` gives
``transformers``' own logits at 1, 2 and 3 ranks (model built normally and on meta, plain and
HSDP meshes, sharded index and one file); training then ``save_safetensors`` is read back by
``from_pretrained`` and ``safetensors.torch.load_file`` bitwise equal to the trained shards."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.distributed._hf_helpers import load_counting_bytes

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

VOCAB = 96


def tiny_config(tied: bool = False):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=64, tie_word_embeddings=tied)


def write_reference(directory: str, *, tied: bool = False, max_shard_size: str = "20KB") -> None:
    """A random tiny Llama saved by ``save_pretrained`` (several shards + index)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(tiny_config(tied)).save_pretrained(directory, max_shard_size=max_shard_size)


def reference_logits(directory: str, x: torch.Tensor) -> torch.Tensor:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(directory)
    with torch.no_grad():
        return model(x).logits


def _shard_llama(model, mesh=None):
    from lightning_vescale.fsdp import fully_shard

    kw = {} if mesh is None else {"mesh": mesh}
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    return fully_shard(model, **kw)


def _build(meta: bool, tied: bool):
    from transformers import LlamaForCausalLM

    torch.manual_seed(123)  # other weights than the checkpoint's: loading must replace them all
    if meta:
        with torch.device("meta"):
            return LlamaForCausalLM(tiny_config(tied))
    return LlamaForCausalLM(tiny_config(tied))


def _load_body(directory: str, meta: bool, tied: bool, hsdp: bool):
    from lightning_vescale.checkpoint import load_safetensors
    from lightning_vescale.mesh import init_mesh

    mesh = init_mesh("cpu", replicas=2) if hsdp else None
    model = _shard_llama(_build(meta, tied), mesh)
    result = load_safetensors(model, directory)
    assert result.missing_keys == [] and result.unexpected_keys == []
    x = torch.arange(2 * 10).reshape(2, 10) % VOCAB
    with torch.no_grad():
        logits = model(x).logits
    return logits, reference_logits(directory, x)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("meta", [False, True], ids=["built", "meta"])
def test_logits_equal_transformers(worlds, world, meta, tmp_path):
    write_reference(str(tmp_path))
    for logits, ref in worlds(world).run(_load_body, str(tmp_path), meta, False, False):
        torch.testing.assert_close(logits, ref, rtol=0, atol=0)


def test_tied_embeddings_and_one_file(worlds, tmp_path):
    """A tied model written as one ``model.safetensors`` (no ``lm_head.weight`` in it)."""
    write_reference(str(tmp_path), tied=True, max_shard_size="5GB")
    assert sorted(os.listdir(tmp_path)).count("model.safetensors") == 1
    for logits, ref in worlds(2).run(_load_body, str(tmp_path), True, True, False):
        torch.testing.assert_close(logits, ref, rtol=0, atol=0)


def test_hsdp_mesh(worlds, tmp_path):
    write_reference(str(tmp_path))
    for logits, ref in worlds(4).run(_load_body, str(tmp_path), True, False, True):
        torch.testing.assert_close(logits, ref, rtol=0, atol=0)


def _train_save_body(src: str, dst: str, dtype):
    from lightning_vescale.checkpoint import load_safetensors, save_safetensors

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _shard_llama(_build(True, False))
    load_safetensors(model, src)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        g = torch.Generator().manual_seed(step * world + rank)
        x = torch.randint(0, VOCAB, (2, 12), generator=g)
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    save_safetensors(model, dst, max_shard_size="16KB", dtype=dtype)
    return {n: p.full_tensor() for n, p in model.named_parameters()}


@pytest.mark.parametrize("world", [2, 3])
def test_train_save_from_pretrained_bitwise(worlds, world, tmp_path):
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    src, dst = tmp_path / "src", tmp_path / "dst"
    write_reference(str(src))
    trained = worlds(world).run(_train_save_body, str(src), str(dst), None)[0]
    tiny_config().save_pretrained(dst)
    loaded = LlamaForCausalLM.from_pretrained(dst).state_dict()
    files = {}
    for name in sorted(os.listdir(dst)):
        if name.endswith(".safetensors"):
            files.update(load_file(dst / name))
    assert len([n for n in os.listdir(dst) if n.endswith(".safetensors")]) > 1
    assert sorted(files) == sorted(trained)
    for name, value in trained.items():
        assert torch.equal(loaded[name], value), name
        assert torch.equal(files[name], value), name


def test_save_in_bf16(worlds, tmp_path):
    from safetensors.torch import load_file

    src, dst = tmp_path / "src", tmp_path / "dst"
    write_reference(str(src))
    trained = worlds(2).run(_train_save_body, str(src), str(dst), torch.bfloat16)[0]
    files = {}
    for name in os.listdir(dst):
        if name.endswith(".safetensors"):
            files.update(load_file(dst / name))
    for name, value in trained.items():
        assert files[name].dtype == torch.bfloat16
        assert torch.equal(files[name], value.to(torch.bfloat16)), name


def _read_bytes_body(directory: str):
    """The tensor bytes this rank reads while loading."""
    return load_counting_bytes(_shard_llama(_build(True, False)), directory)


def test_each_rank_reads_about_its_share(worlds, tmp_path):
    """The tensor bytes read per rank add up to the checkpoint once (plus headers), not N times."""
    write_reference(str(tmp_path))
    data = sum(os.path.getsize(tmp_path / n) for n in os.listdir(tmp_path)
               if n.endswith(".safetensors"))
    read = worlds(2).run(_read_bytes_body, str(tmp_path))
    assert all(r < 0.7 * data for r in read), (read, data)
    assert sum(read) < 1.1 * data, (read, data)


def _load_save_body(src: str, dst: str, hsdp: bool, fail_rank: int | None):
    from lightning_vescale.checkpoint import _hf_save, load_safetensors, save_safetensors
    from lightning_vescale.mesh import init_mesh

    model = _shard_llama(_build(True, False), init_mesh("cpu", replicas=2) if hsdp else None)
    load_safetensors(model, src)
    original = _hf_save._write_owned
    if fail_rank == dist.get_rank():
        def broken(*args, **kwargs):
            raise OSError("No space left on device (simulated)")

        _hf_save._write_owned = broken
    try:
        save_safetensors(model, dst, max_shard_size="16KB")
    except (OSError, RuntimeError) as err:
        return f"{type(err).__name__}: {err}"
    finally:
        _hf_save._write_owned = original  # the forked ranks outlive this test
    return None


def test_hsdp_save_writes_each_range_once(worlds, tmp_path):
    """On a (2, 2) mesh only the first replica writes; the files equal the source's tensors."""
    from safetensors.torch import load_file

    src, dst = tmp_path / "src", tmp_path / "dst"
    write_reference(str(src))
    assert worlds(4).run(_load_save_body, str(src), str(dst), True, None) == [None] * 4
    ref, got = {}, {}
    for d, out in ((src, ref), (dst, got)):
        for name in os.listdir(d):
            if name.endswith(".safetensors"):
                out.update(load_file(d / name))
    assert sorted(ref) == sorted(got)
    assert all(torch.equal(ref[k], got[k]) for k in ref)


def test_a_failing_rank_fails_every_rank_and_leaves_nothing(worlds, tmp_path):
    src, dst = tmp_path / "src", tmp_path / "dst"
    write_reference(str(src))
    errors = worlds(2).run(_load_save_body, str(src), str(dst), False, 1)
    assert "simulated" in errors[1] and "failed on rank(s) [1]" in errors[0], errors
    assert sorted(os.listdir(dst)) == [], "the temporary files are removed"


def _torch_fsdp2_body(directory: str):
    """torch's own FSDP2 (Shard(0) DTensors): each rank reads only its rows."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    model = _build(False, False)
    for layer in model.model.layers:
        torch_fully_shard(layer)
    torch_fully_shard(model)
    counted = load_counting_bytes(model, directory)
    x = torch.arange(2 * 10).reshape(2, 10) % VOCAB
    with torch.no_grad():
        logits = model(x).logits
    return logits, reference_logits(directory, x), counted


def test_torch_fsdp2_model_reads_its_rows(worlds, tmp_path):
    write_reference(str(tmp_path))
    data = sum(os.path.getsize(tmp_path / n) for n in os.listdir(tmp_path)
               if n.endswith(".safetensors"))
    results = worlds(2).run(_torch_fsdp2_body, str(tmp_path))
    for logits, ref, _ in results:
        torch.testing.assert_close(logits, ref, rtol=0, atol=0)
    assert sum(r[2] for r in results) < 1.1 * data, [r[2] for r in results]
