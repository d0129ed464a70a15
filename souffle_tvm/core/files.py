"""Cache files written atomically, and the one-line note a recomputed entry gets.

A cache entry is written to a temporary file in its own directory and renamed over its name
(``os.replace``, atomic on POSIX within one file system): a reader sees the old file, the new
one, or none, never a part. A process killed mid-write leaves at most a ``.<name>.*.tmp``
file beside it, which no reader opens. Not fsync'ed: a power loss can still leave an empty
or short file, which the readers check for (``is_elf``, JSON that does not parse) and
recompute, with a note, instead of failing.

Standard library only (the standalone GPU runtime uses it without TVM).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import warnings
from pathlib import Path

from ..errors import CacheWarning

ELF_MAGIC = b"\x7fELF"


def _temp_beside(path: Path) -> tuple[int, str]:
    return tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")


def atomic_write(path: str | os.PathLike, data: str | bytes) -> None:
    """Write ``data`` to ``path`` so that no reader ever sees a partial file."""
    path = Path(path)
    fd, tmp = _temp_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_copy(src: str | os.PathLike, path: str | os.PathLike) -> None:
    """Copy ``src`` to ``path`` (any file system) so that no reader ever sees a partial file."""
    path = Path(path)
    fd, tmp = _temp_beside(path)
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def is_elf(path: str | os.PathLike) -> bool:
    """Whether ``path`` starts like an ELF file (a cubin): an empty or cut file does not."""
    try:
        with open(path, "rb") as f:
            return f.read(len(ELF_MAGIC)) == ELF_MAGIC
    except OSError:
        return False


def note_recomputed(path: str | os.PathLike, why: str, action: str = "recomputing it") -> None:
    """Say, in one line, that a cache entry could not be used and what happens instead."""
    warnings.warn(f"cache entry {path} is unusable ({why}): {action}", CacheWarning, stacklevel=3)

