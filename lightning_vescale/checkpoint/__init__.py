"""Layer 5: checkpoints of ``fully_shard`` models, the two formats both strategies write.

The Trainer strategy and the Fabric strategy save and load through these functions; they work
on any module sharded with :func:`lightning_vescale.fsdp.fully_shard` (no Lightning needed), and
:func:`consolidate` turns a sharded checkpoint into a full one offline.

Design note [checkpoint-formats]
--------------------------------
Two formats, both keyed by the module's ``state_dict()`` names (FQNs):

*Sharded* (default) — a directory written by every rank in parallel with
``torch.distributed.checkpoint`` (DCP), no gather anywhere (``_sharded.py``):

* ``<dir>/.metadata`` + ``<dir>/__<rank>_0.distcp``: the tensors. Top-level keys are
  ``"state_dict"`` (the module's state dict: ``RaggedShard`` ``DTensor`` parameters, whose DCP
  chunks are the at most ``2d - 1`` rectangles of each rank's flat range, see
  ``lightning_vescale.placement``) and ``"optimizer_<i>"`` (the optimizer's own ``state_dict()``
  re-keyed from parameter indices to FQNs, so the file does not depend on parameter order).
  DCP records global shapes and chunk offsets, so any world size / layout can load it
  (resharding is DCP's read planning).
* ``<dir>/meta.pt``: everything else of the Lightning checkpoint (loops, callbacks, schedulers,
  precision scaler, hyper-parameters), written by rank 0 — Lightning's own sharded layout.

*Full* — one ``torch.save`` file from rank 0 in the plain single-process format (``_full.py``):
``state_dict`` holds full tensors under the same FQNs, optimizer states are the optimizer's
``state_dict()`` with full tensors and integer keys (parameter order). A plain ``nn.Module``/DDP
run can load it.

*Hugging Face* — ``save_safetensors(module, dir)`` / ``load_safetensors(module, path)``: the
safetensors shards plus ``model.safetensors.index.json`` that ``transformers`` reads and writes,
each rank reading and writing only its own byte ranges (design notes [safetensors-io],
[hf-load], [hf-save]). Model weights only.

Loading either format into a sharded module never materialises more than one full tensor per
rank at a time (full files are ``mmap``-ed and sliced to the rank's range; ``_state_dicts.py``).

Atomicity (``_files.py``): a save writes into a hidden temporary sibling
(``.<name>.tmp-<token>``); after a barrier, rank 0 renames it onto the final name (a file: one
``os.replace``; a directory: the old one is first renamed aside to ``.<name>.old-<token>``,
then removed; if the second rename fails the old one is renamed back). An interrupted save
therefore leaves the previous checkpoint at that path untouched. Only a process killed between
the two directory renames leaves the name empty; loading then points to the ``.old-``.

Cleanup of failed saves: a save that *fails* (raises) removes its temporary itself, on rank 0
and without any extra collective: DCP reports a write failure of any rank to every rank through
its own gather/broadcast, so when ``dcp.save`` raises on rank 0 every rank has finished writing
(or its process is gone); the full format and the publish step are rank 0's alone. A save that
is *killed* cannot clean up: its hidden temporary is removed by the next save to the same name
or by :func:`remove_checkpoint` (which the strategies' ``remove_checkpoint`` uses, so rotating
``ModelCheckpoint`` names do not pile them up), once its owner is provably gone: a live writer's
temporary is never removed ([checkpoint-leftovers]).
"""

from lightning_vescale.checkpoint._files import (
    check_checkpoint_path,
    is_sharded_checkpoint,
    remove_checkpoint,
)
from lightning_vescale.checkpoint._hf_load import (
    IncompatibleKeys,
    checkpoint_keys,
    load_safetensors,
)
from lightning_vescale.checkpoint._hf_save import save_safetensors
from lightning_vescale.checkpoint._full import consolidate, load_full, read_full, save_full
from lightning_vescale.checkpoint._peft import save_peft_adapter
from lightning_vescale.checkpoint._sharded import (
    count_sharded_optimizers,
    load_sharded,
    save_sharded,
    sharded_checkpoint_has,
)
from lightning_vescale.checkpoint._state_dicts import (
    load_full_model_state,
    load_full_optimizer_state,
    model_state,
    optimizer_state,
)

__all__ = [
    "IncompatibleKeys",
    "check_checkpoint_path",
    "checkpoint_keys",
    "consolidate",
    "count_sharded_optimizers",
    "is_sharded_checkpoint",
    "load_full",
    "load_full_model_state",
    "load_full_optimizer_state",
    "load_safetensors",
    "load_sharded",
    "model_state",
    "optimizer_state",
    "read_full",
    "remove_checkpoint",
    "save_full",
    "save_peft_adapter",
    "save_safetensors",
    "save_sharded",
    "sharded_checkpoint_has",
]
