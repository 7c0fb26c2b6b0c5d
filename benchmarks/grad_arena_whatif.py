"""What-if: the peak-memory cost of one gradient arena across ``fully_shard`` groups.

``FlatParamOptimizer`` steps one flat tensor per ``fully_shard`` group because each group's
DBuffer shard and sharded gradient are separate storages. One tensor per param group would need
all groups' sharded gradients in one storage, allocated at the first reduce-scatter of a
backward instead of group by group. This script measures what that allocation order alone costs:
it patches ``DBuffer._ensure_grad_shard`` (in this process only; forked ranks inherit it) so
that the first sharded gradient allocated in a backward allocates every other live buffer's
too, then runs ``benchmarks.fsdp2_vs_vescale`` with the given arguments. Compare its "peak live
tensor memory" row with an unpatched run (``--baseline``). Results: ``RESULTS_fsdp.md``.

Run from the repository root::

    python -m benchmarks.grad_arena_whatif --n-layer 8 --n-embd 512 --n-head 8 --steps 2 --runs 1
    python -m benchmarks.grad_arena_whatif --baseline --n-layer 8 --n-embd 512 --n-head 8 --steps 2 --runs 1
"""

from __future__ import annotations

import sys

from benchmarks import fsdp2_vs_vescale
from lightning_vescale import dbuffer

_original = dbuffer.DBuffer._ensure_grad_shard


def _arena_order(self: dbuffer.DBuffer, zero: bool = True):  # noqa: ANN202 - a patch
    if self.grad_shard is None:  # the first gradient shard of this backward: all of them now
        for other in dbuffer.live_dbuffers():
            if (other is not self and other.grad_shard is None and other.shard.numel()
                    and other.dtype == self.dtype):
                _original(other, True)
    return _original(self, zero)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--baseline" in argv:
        argv.remove("--baseline")
    else:
        dbuffer.DBuffer._ensure_grad_shard = _arena_order  # type: ignore[method-assign]
        print("grad_arena_whatif: every sharded gradient allocated at the first reduce-scatter")
    fsdp2_vs_vescale.main(argv)


if __name__ == "__main__":
    main()
