"""Reading a checkpoint's files without ever leaving its directory.

Design note [checkpoint-confinement]
------------------------------------
A DCP ``.metadata`` names the file of every stored item (``_StorageInfo.relative_path``), and a
checkpoint directory is something people download and share. torch's reader opens whatever path
it finds there: ``../x`` or ``/etc/x`` read files outside the checkpoint (and the integrity
manifest, which keys items by name, not by file, verifies them happily), a shard that is a
symbolic link is followed, a link to ``/dev/zero`` makes a whole-file read run until memory is
exhausted, and a FIFO blocks the load forever. So every file the loaders read goes through
:func:`open_inside`:

- the name must be relative, without ``..`` components; the path is resolved (links included)
  and must still be inside the resolved checkpoint directory (the directory itself may be a link,
  e.g. Lightning's ``last.ckpt``);
- the resolved path is opened with ``O_NOFOLLOW`` (a link swapped in meanwhile fails) and
  ``O_NONBLOCK`` (opening a FIFO does not wait for a writer), and the open file must be a
  regular file (``fstat`` → ``S_ISREG``): devices, FIFOs and sockets are refused;
- reads are bounded by what the checkpoint declares: an item's ``[offset, offset + length)`` must
  lie inside the file's size before anything is read, and a whole-file read takes at most the
  size the manifest records (:func:`read_inside`'s ``max_size``).

Every refusal is a :class:`CheckpointLoadError` naming the file. A missing file raises
``FileNotFoundError`` so that callers can say what the missing file means.
"""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path, PurePosixPath, PureWindowsPath

from lightning_vescale.checkpoint._errors import CheckpointLoadError

__all__ = ["resolve_inside", "open_inside", "read_inside"]

_OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
               | getattr(os, "O_BINARY", 0))


def resolve_inside(root: Path, name: str, what: str) -> Path:
    """The resolved path of ``root/name``; a :class:`CheckpointLoadError` if it is outside
    ``root`` (an absolute name, a ``..`` component, or a link pointing out)."""
    if not isinstance(name, str):
        raise CheckpointLoadError(
            f"The checkpoint {str(root)!r} names its {what} file {name!r}, not a file name: the "
            "checkpoint is damaged or crafted.")
    shown = Path(root) / name
    if (not name or PurePosixPath(name).is_absolute() or PureWindowsPath(name).is_absolute()
            or ".." in PurePosixPath(name.replace("\\", "/")).parts):
        raise CheckpointLoadError(
            f"The checkpoint {str(root)!r} names its {what} file {name!r}, a path outside the "
            "checkpoint directory: refusing to read it (a checkpoint's files are all inside its "
            "directory; the checkpoint is damaged or crafted).")
    real_root = Path(root).resolve()
    target = (real_root / name).resolve()
    if target != real_root and real_root not in target.parents:
        raise CheckpointLoadError(
            f"The checkpoint's {what} file {str(shown)!r} is a link to {str(target)!r}, outside "
            "the checkpoint directory: refusing to read it (copy the file into the checkpoint "
            "directory if it belongs there).")
    return target


def open_inside(root: Path, name: str, what: str) -> tuple[io.BufferedReader, int]:
    """Open ``root/name`` for reading, confined as design note [checkpoint-confinement] says.

    Returns the open file and its size. ``FileNotFoundError`` if it does not exist.
    """
    target = resolve_inside(root, name, what)
    shown = Path(root) / name
    try:
        fd = os.open(target, _OPEN_FLAGS)
    except FileNotFoundError:
        raise
    except OSError as err:  # ELOOP: replaced by a link since it was resolved
        raise CheckpointLoadError(
            f"Could not open the checkpoint's {what} file {str(shown)!r}: {err}") from err
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointLoadError(
                f"The checkpoint's {what} file {str(shown)!r} is not a regular file "
                f"({_kind(st.st_mode)}{f' at {str(target)!r}' if os.path.islink(shown) else ''}): "
                "refusing to read it.")
        return os.fdopen(fd, "rb"), st.st_size
    except BaseException:
        os.close(fd)
        raise


def read_inside(root: Path, name: str, what: str, *, max_size: int | None = None) -> bytes:
    """The whole of ``root/name`` (confined, see :func:`open_inside`), refused unread if it is
    larger than ``max_size`` bytes. ``FileNotFoundError`` if it does not exist."""
    stream, size = open_inside(root, name, what)
    with stream:
        if max_size is not None and size > max_size:
            raise CheckpointLoadError(
                f"The checkpoint's {what} file {str(Path(root) / name)!r} is {size:,} bytes, "
                f"more than the {max_size:,} its checkpoint allows: the file is damaged or "
                "crafted; refusing to read it.")
        return stream.read(size if max_size is None else min(size, max_size))


def _kind(mode: int) -> str:
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a regular file"
