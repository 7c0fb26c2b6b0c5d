"""Where checkpoints live on disk: path checks, atomic publish, cleanup of failed saves.

Design note [checkpoint-leftovers]
----------------------------------
Several writers can save to one name at once: a preempted job still alive while its restart
begins, or two jobs sharing a ``dirpath``. Each writes its own hidden temporary and publishes it
atomically, so the published checkpoint is always one whole save; the danger is the clean-up of
leftovers. Removing every ``.<name>.tmp-*`` sibling after a publish removed *live* writers'
temporaries too, and a rival's exchange landing during that ``rmtree`` emptied the freshly
published directory. So a sibling's name records its owner (``<token>.<pid>@<host>``, rank 0's
process) and is removed only when the owner is provably gone: a pid no longer alive on this host,
or, where that cannot be checked (another host; a name without an owner), older than
``STALE_AFTER_S``. The removal first renames the sibling to a unique ``.dead-`` name and deletes
only that, so it never runs through a path another writer might publish meanwhile.

The rules are those of design note [checkpoint-formats] (``lightning_vescale/checkpoint``):
a save writes into a hidden sibling ``.<name>.tmp-<token>`` and rank 0 publishes it at the final
name in one atomic step (:func:`publish`). Nothing here knows what is inside a checkpoint.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import glob
import io
import os
import re
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from lightning_vescale.mesh import all_reduce_anywhere

__all__ = [
    "METADATA_FILENAME",
    "is_sharded_checkpoint",
    "check_checkpoint_path",
    "remove_checkpoint",
]

METADATA_FILENAME = "meta.pt"  # same name as Lightning's ModelParallel/FSDP strategies
_DCP_METADATA = ".metadata"


# ------------------------------------------------------------------------------------------------
# Paths
# ------------------------------------------------------------------------------------------------
def is_sharded_checkpoint(path: Path) -> bool:
    """A directory with DCP metadata (a sharded checkpoint; a full one is a single file)."""
    path = Path(path)
    return path.is_dir() and (path / _DCP_METADATA).is_file()


def check_checkpoint_path(path: Path) -> Path:
    """Raise a clear error unless ``path`` is a checkpoint in one of our two formats."""
    path = Path(path)
    if not path.exists():
        aside = _hidden_siblings(path, "old")
        hint = (f" A previous checkpoint moved aside by an interrupted save exists at "
                f"{str(aside[-1])!r}: rename it to {path.name!r} to use it.") if aside else ""
        raise FileNotFoundError(
            f"Checkpoint path {str(path)!r} does not exist. Pass the path of a checkpoint file "
            f"(state_dict_type='full') or directory (state_dict_type='sharded').{hint}"
        )
    if path.is_dir() and not is_sharded_checkpoint(path):
        raise ValueError(
            f"The path {str(path)!r} is a directory but not a sharded checkpoint (it has no "
            f"{_DCP_METADATA!r} file). Point to a directory written by the vescale_fsdp strategy "
            "or to a single full checkpoint file."
        )
    return path


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _broadcast_object(obj: Any) -> Any:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return obj


# ------------------------------------------------------------------------------------------------
# Hidden siblings, removal
# ------------------------------------------------------------------------------------------------
# A hidden sibling's name records who made it: ``.<name>.<kind>-<token>.<pid>@<host>`` (rank 0's
# process, the only one that publishes or removes). Another save to the same name removes it
# only when that owner is provably gone (design note [checkpoint-leftovers]).
STALE_AFTER_S = 24 * 3600
"""Age after which a leftover whose owner cannot be checked (another host, or a name from before
owners were recorded) counts as dead. A save that runs longer than this while another job saves
to the same name could lose its temporary (and then fails; the published checkpoint is safe)."""

_OWNER = re.compile(r"^[0-9a-f]+(?:\.(?P<pid>\d+)@(?P<host>.+))?$")


def _hidden_siblings(path: Path, kind: str) -> list[Path]:
    """The ``.<name>.<kind>-<token>`` siblings of ``path`` (``kind``: ``"tmp"`` or ``"old"``)."""
    if not path.parent.is_dir():
        return []
    return sorted(path.parent.glob(f".{glob.escape(path.name)}.{kind}-*"))


def _sibling(path: Path, kind: str, token: str) -> Path:
    return path.with_name(f".{path.name}.{kind}-{token}")


def _new_token() -> str:
    """A fresh sibling token that names this process as the owner (see [checkpoint-leftovers])."""
    return f"{uuid.uuid4().hex[:10]}.{os.getpid()}@{socket.gethostname()}"


def temp_sibling(path: Path) -> Path:
    """Collective: the hidden temporary a save to ``path`` writes into (one name on all ranks)."""
    return _sibling(path, "tmp", _broadcast_object(_new_token()))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # exists (another user's), or cannot tell: treat as alive
    return True


def is_dead_leftover(sibling: Path, *, now: float | None = None) -> bool:
    """Whether the save that made ``sibling`` is provably over, so removing it cannot hurt a live
    writer: its owner process (recorded in the name) is gone from this host, or, where that
    cannot be checked, the sibling is older than :data:`STALE_AFTER_S`."""
    token = sibling.name.rsplit("-", 1)[-1] if "-" in sibling.name else ""
    owner = _OWNER.match(token)
    if owner and owner["pid"] and owner["host"] == socket.gethostname():
        return int(owner["pid"]) != os.getpid() and not _pid_alive(int(owner["pid"]))
    try:
        age = (time.time() if now is None else now) - sibling.lstat().st_mtime
    except FileNotFoundError:
        return False  # already gone (published or removed by its owner)
    return age > STALE_AFTER_S


def _remove_path(path: Path) -> None:
    """Remove a file, link or directory tree; a missing path is fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def discard(path: Path) -> None:
    """Best-effort :func:`_remove_path` (cleanup must never mask the error being handled)."""
    try:
        _remove_path(path)
    except OSError:
        pass


def discard_dead_leftovers(path: Path) -> None:
    """Remove the hidden ``.tmp-``/``.old-`` siblings of ``path`` whose saves are provably over
    (:func:`is_dead_leftover`); a live writer's are left alone. Best effort.

    Each is first renamed to a unique ``.<name>.dead-<token>`` and only that name is removed, so
    the removal never runs through a path that some writer could exchange into place meanwhile.
    """
    for stale in (_hidden_siblings(path, "tmp") + _hidden_siblings(path, "old")
                  + _hidden_siblings(path, "dead")):
        if not is_dead_leftover(stale):
            continue
        doomed = stale  # a ".dead-" name is already unique to the removal that made it
        if not stale.name.startswith(f".{path.name}.dead-"):
            doomed = _sibling(path, "dead", _new_token())
            try:
                os.rename(stale, doomed)
            except OSError:
                continue  # gone or moved meanwhile: not ours to chase
        discard(doomed)


def remove_checkpoint(path: Any) -> None:
    """Remove the checkpoint at ``path`` (a full file or a sharded directory) together with the
    hidden ``.<name>.tmp-*`` / ``.<name>.old-*`` siblings that failed or interrupted saves to
    that name left behind (only those whose saves are provably over: another job's save in
    progress to the same name keeps its temporary, see [checkpoint-leftovers]).

    Not a collective: call it on one rank (global rank 0), like Lightning's
    ``Strategy.remove_checkpoint``. A missing ``path`` is not an error; an error removing
    ``path`` itself is raised, the siblings are removed on a best-effort basis.
    """
    path = Path(path)
    _remove_path(path)
    discard_dead_leftovers(path)


# ------------------------------------------------------------------------------------------------
# Publishing
# ------------------------------------------------------------------------------------------------
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


@functools.lru_cache(maxsize=1)
def _renameat2() -> Callable[..., int] | None:
    """libc's ``renameat2`` (Linux, glibc >= 2.28), or ``None`` where there is none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def exchange(a: Path, b: Path) -> bool:
    """Swap the paths ``a`` and ``b`` in one atomic step (``renameat2(RENAME_EXCHANGE)``).

    Returns ``False``, having changed nothing, where the platform or file system cannot
    (not Linux, or e.g. some network file systems); other errors raise ``OSError``.
    """
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, f"renameat2({str(a)!r}, {str(b)!r}, RENAME_EXCHANGE) failed: "
                       f"{os.strerror(err)}")


def publish(tmp: Path, final: Path) -> None:
    """Rank 0: move the finished ``tmp`` onto ``final`` without ever corrupting ``final``.

    A new name, or a file replacing a file, is one ``os.replace``. A checkpoint replacing a
    directory (or a directory replacing a file) is swapped in with one atomic exchange, so a
    process killed at any instant leaves a whole checkpoint at ``final``, the old or the new;
    the old one, now at ``tmp``, is removed after. Where the file system cannot exchange, the
    old one is renamed aside to ``.<name>.old-<token>`` first (a kill between the two renames
    leaves ``final`` missing and the previous checkpoint at the ``.old-`` name, which
    :func:`check_checkpoint_path` points to). After a successful publish the leftovers of killed
    saves to the same name (``.tmp-*``, ``.old-*``) are removed, those of live writers kept
    (:func:`discard_dead_leftovers`).
    """
    if final.exists() and (final.is_dir() or tmp.is_dir()):
        if exchange(tmp, final):
            discard(tmp)  # now the previous checkpoint
        else:
            old = _sibling(final, "old", _new_token())
            os.replace(final, old)
            try:
                os.replace(tmp, final)
            except BaseException:
                os.replace(old, final)  # put the previous checkpoint back: never leave it empty
                raise
            discard(old)
    else:
        os.replace(tmp, final)  # atomic for files (and for a new directory name)
    try:  # leftovers of killed saves; best effort: this must not fail a save that succeeded
        discard_dead_leftovers(final)
    except OSError:
        pass


def rank0_agreed(fn: Callable[[], Any], what: str) -> Any:
    """Run ``fn`` on rank 0 and make every rank agree on whether it worked.

    A failure on rank 0 must not leave the other ranks waiting in a later collective: the
    outcome is all-reduced, rank 0 re-raises its error and the others raise a pointer to it.
    """
    out, error = None, None
    if rank() == 0:
        try:
            out = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the agreement
            error = e
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32)
        all_reduce_anywhere(flag, op=dist.ReduceOp.MAX)  # NCCL: via the GPU ([mesh-device])
        failed = bool(flag.item())
    else:
        failed = error is not None
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(f"Rank 0 failed to {what}; see its traceback.")
    return out


# ------------------------------------------------------------------------------------------------
# Disk full
# ------------------------------------------------------------------------------------------------
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _causes(exc: BaseException, seen: set[int]) -> Any:
    """``exc``, its cause/context chain and, for DCP's ``CheckpointException``, every rank's
    failure (with their chains), depth first, each once."""
    stack = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):  # DCP: {rank: (exception, traceback summary)}
            for failure in failures.values():
                stack.append(failure[0] if isinstance(failure, tuple) else failure)


def find_no_space(exc: BaseException) -> OSError | None:
    """The "no space left" (or quota) ``OSError`` behind ``exc``, where there is one: torch's
    writers bury it under ``unexpected pos ...`` or DCP's ``CheckpointException ranks:...``."""
    for e in _causes(exc, set()):
        if isinstance(e, OSError) and e.errno in _NO_SPACE:
            return e
    return None


def raise_if_no_space(exc: BaseException, path: Path, what: str, aftermath: str) -> None:
    """Re-raise ``exc`` as ``OSError(ENOSPC)`` saying "No space left on <dir>" first, if a full
    disk (or quota) is behind it; otherwise return and let the caller report ``exc``."""
    cause = find_no_space(exc)
    if cause is None:
        return
    where = Path(path).parent
    try:
        free = f"; {shutil.disk_usage(where).free / 2**20:.1f} MiB free now"
    except OSError:
        free = ""
    raise OSError(
        cause.errno,
        f"No space left on {str(where)!r} ({os.strerror(cause.errno)}{free}) while {what} "
        f"{str(path)!r}. Free space there or save to another directory; {aftermath}.",
    ) from exc


def serialize(obj: Any) -> bytes:
    """``torch.save`` into bytes (fails early, before any file is written, if unpicklable)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()
