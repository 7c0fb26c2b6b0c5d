"""Publishing one ``save_safetensors`` save into its directory as one unit.

Design note [hf-publish]
------------------------
A Hugging Face directory is several files (shards, the index) that must all come from one save,
and ``from_pretrained`` reads whatever is there. Renaming fixed shard names
(``model-00001-of-00004.safetensors``) into place one by one mixed two saves: a kill after two
of four renames, or two saves into one directory at once, left shards of both under one index,
and the sizes matched. So:

* **Names unique to the save.** Each save has an identity, the ``save_id`` (hex, from rank 0's
  token). Its shards are named ``model-<save_id>-00001-of-00004.safetensors``, so they never
  overwrite a published file, and the id is in every shard's header ``__metadata__``, in the
  index's ``metadata`` and in ``.integrity.json``: a loader that finds two ids in one directory
  reports the mix instead of loading it (``_hf_files.open_checkpoint``). A save of one file is
  ``model.safetensors`` (what ``save_pretrained`` writes; one file is published by one rename).
* **One commit.** Rank 0, holding an exclusive ``flock`` on ``.model.safetensors.lock`` (so two
  saves publish one after the other, never interleaved), takes the previous ``.integrity.json``
  out first (put back if the save fails before its commit), then:
  several shards: renames them onto their new names (nothing published changes), writes the
  index by one ``os.replace`` and removes ``model.safetensors`` if an earlier one-file save left
  one; one file: ``os.replace`` onto ``model.safetensors``, then removes the index. Loaders
  prefer ``model.safetensors`` over the index when both exist (``transformers`` does; so does
  ``open_checkpoint``), so the commit is the one rename that makes the new save the one read:
  the index's for several shards (once the single file is gone), ``model.safetensors``'s for
  one. A kill at any step leaves the complete old save or the complete new one readable.
* **Clean-up after the commit.** Shards of earlier saves (any ``model*.safetensors`` the new
  save did not write) are removed; then ``.integrity.json`` is written. Temporaries of saves
  that were killed (``.<name>.tmp-<token>``, full size) are removed when their owner is provably
  gone, by the rule of design note [checkpoint-leftovers] (the token records rank 0's pid and
  host); a live writer's are kept. Shard names of a killed save that never committed are
  removed by the next save's clean-up (under the lock, no live save has unreferenced published
  names).

Where the file system has no ``flock`` (some network file systems), publishing proceeds without
it after a warning: a single save is still one unit, two saves at once into one directory may
then remove each other's shards (a load then fails naming the missing file, never a mix).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from lightning_vescale.checkpoint import _files
from lightning_vescale.checkpoint._hf_files import INDEX_NAME, SINGLE_NAME
from lightning_vescale.checkpoint._manifest import INTEGRITY_FILENAME

__all__ = ["LOCK_NAME", "SAVE_ID_KEY", "PublishedWithoutManifest", "publish_save",
           "save_id_of", "shard_names", "temp_name"]

#: The ``__metadata__`` / index ``metadata`` / manifest key holding a save's identity.
SAVE_ID_KEY = "save_id"
#: The lock file two saves into one directory serialize their publishing on (kept; empty).
LOCK_NAME = ".model.safetensors.lock"
#: Published files of ours (or ``save_pretrained``'s) a later save replaces.
_SHARD = re.compile(r"^model(-[0-9a-f]+)?(-\d{5}-of-\d{5})?\.safetensors$")
#: Hidden leftovers of a save: ``.<name>.tmp-<token>`` (and the ``.old-``/``.dead-`` kinds).
_LEFTOVER = re.compile(r"^\.(?P<name>model[^/]*\.safetensors(?:\.index\.json)?"
                       r"|\.integrity\.json)\.(?:tmp|old|dead)-")
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL, errno.EBADF)


class PublishedWithoutManifest(RuntimeError):
    """The save is published (the commit happened), but removing the earlier save's shards or
    writing ``.integrity.json`` failed."""


def save_id_of(token: str) -> str:
    """The save's identity: the hex part of rank 0's token ``<hex>.<pid>@<host>``."""
    return token.split(".", 1)[0]


def shard_names(save_id: str, n: int) -> list[str]:
    """The published names of a save of ``n`` files (see the design note)."""
    if n == 1:
        return [SINGLE_NAME]
    return [f"model-{save_id}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def temp_name(name: str, token: str) -> str:
    """The hidden temporary ``name`` is written under (owner recorded in ``token``)."""
    return f".{name}.tmp-{token}"


@contextmanager
def _directory_lock(root: Path) -> Iterator[None]:
    fd = os.open(root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as err:
            if err.errno not in _NO_LOCKS:
                raise
            warnings.warn(f"save_safetensors: the file system of {str(root)!r} has no flock "
                          f"({os.strerror(err.errno)}); publishing without the lock, so two "
                          "saves into this directory at once are not kept apart.", stacklevel=4)
        yield
    finally:
        os.close(fd)  # releases the lock (a killed process's too)


def _write_atomically(root: Path, name: str, data: bytes, token: str) -> None:
    tmp = root / temp_name(name, token)
    try:
        tmp.write_bytes(data)
        os.replace(tmp, root / name)
    except BaseException:
        _files.discard(tmp)
        raise


def publish_save(root: Path, names: list[str], token: str, index_bytes: Optional[bytes],
                 manifest: Callable[[], bytes]) -> None:
    """Rank 0: publish the save whose temporaries ``temp_name(n, token)`` for ``n`` in
    ``names`` are complete (design note [hf-publish]); ``index_bytes`` for several files,
    ``manifest()`` the new ``.integrity.json``. On an error before the commit the previous save
    is left as it was (its manifest put back) and this save's files are removed."""
    with _directory_lock(root):
        old_manifest = _take_out(root / INTEGRITY_FILENAME)
        committed = False
        try:
            if index_bytes is None:
                os.replace(root / temp_name(SINGLE_NAME, token), root / SINGLE_NAME)
                committed = True
                (root / INDEX_NAME).unlink(missing_ok=True)
            else:
                for name in names:
                    os.replace(root / temp_name(name, token), root / name)
                _write_atomically(root, INDEX_NAME, index_bytes, token)
                committed = True
                (root / SINGLE_NAME).unlink(missing_ok=True)
        except BaseException:
            if not committed:
                for name in names:
                    if name != SINGLE_NAME:
                        _files.discard(root / name)
                    _files.discard(root / temp_name(name, token))
                if old_manifest is not None:
                    _put_back(root, old_manifest, token)
            raise
        try:
            for p in root.iterdir():
                if _SHARD.match(p.name) and p.name not in names:
                    p.unlink(missing_ok=True)  # a shard of an earlier (or a killed) save
            _write_atomically(root, INTEGRITY_FILENAME, manifest(), token)
        except Exception as err:
            raise PublishedWithoutManifest(
                f"the save is published in {str(root)!r}, but finishing it failed "
                f"({type(err).__name__}: {err}); save again to write its {INTEGRITY_FILENAME}"
            ) from err
    discard_dead_leftovers(root)


def _take_out(path: Path) -> Optional[bytes]:
    """The bytes of ``path`` (``None`` if absent), which is removed: the old manifest must not
    describe the new files, even for an instant."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    path.unlink(missing_ok=True)
    return data


def _put_back(root: Path, data: bytes, token: str) -> None:
    try:
        _write_atomically(root, INTEGRITY_FILENAME, data, token)
    except OSError:
        pass  # best effort (a full disk): the old save loads unverified


def discard_dead_leftovers(root: Path) -> None:
    """Remove the hidden temporaries of killed saves into ``root`` whose owner is provably gone
    (design note [checkpoint-leftovers]); a live writer's are kept. Best effort."""
    try:
        names = {m["name"] for p in root.iterdir() if (m := _LEFTOVER.match(p.name))}
        for name in sorted(names):
            _files.discard_dead_leftovers(root / name)
    except OSError:
        pass

