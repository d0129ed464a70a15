"""Cache files written atomically, and the one-line note a recomputed entry gets.

A cache entry is written to a temporary file in its own directory and renamed over its name
(``os.replace``, atomic on POSIX within one file system): a reader sees the old file, the new
one, or none, never a part. A process killed mid-write leaves at most a ``.<name>.*.tmp``
file beside it, which no reader opens. Not fsync'ed: a power loss can still leave an empty
or short file, which the readers check for (``is_elf``, JSON that does not parse) and
recompute, with a note, instead of failing.

Test hook: with ``SOUFFLE_TVM_CACHE_WRITE_PAUSE=<seconds>`` in the environment (read at each
write), ``atomic_write`` and ``atomic_copy`` write half of the entry to the temp file, flush
it, sleep that long, then write the rest and rename: the window between writing and renaming,
held open so that tests/test_cache_atomic.py can kill a writer, or race others, inside it.
Unset (the default), it costs one environment look-up per write.

Standard library only (the standalone GPU runtime uses it without TVM).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

from ..errors import CacheWarning

ELF_MAGIC = b"\x7fELF"
WRITE_PAUSE = "SOUFFLE_TVM_CACHE_WRITE_PAUSE"


def _temp_beside(path: Path) -> tuple[int, str]:
    return tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")


def _write_pause() -> float:
    return float(os.environ.get(WRITE_PAUSE) or 0)


def _write_paused(f, data: bytes, pause: float) -> None:
    """The test hook: half of ``data``, flushed (a reader could see it), the pause, the rest."""
    half = len(data) // 2
    f.write(data[:half])
    f.flush()
    time.sleep(pause)
    f.write(data[half:])


def atomic_write(path: str | os.PathLike, data: str | bytes) -> None:
    """Write ``data`` to ``path`` so that no reader ever sees a partial file."""
    path = Path(path)
    data = data.encode() if isinstance(data, str) else data
    pause = _write_pause()
    fd, tmp = _temp_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            if pause:
                _write_paused(f, data, pause)
            else:
                f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_copy(src: str | os.PathLike, path: str | os.PathLike) -> None:
    """Copy ``src`` to ``path`` (any file system) so that no reader ever sees a partial file."""
    path = Path(path)
    pause = _write_pause()
    fd, tmp = _temp_beside(path)
    try:
        if pause:
            with os.fdopen(fd, "wb") as f:
                _write_paused(f, Path(src).read_bytes(), pause)
        else:
            os.close(fd)
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


def cache_root() -> Path:
    """The project's cache folder (``$SOUFFLE_TVM_CACHE``, default ``~/.cache/souffle-tvm``)."""
    return Path(os.environ.get("SOUFFLE_TVM_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "souffle-tvm"))


def note_recomputed(path: str | os.PathLike, why: str, action: str = "recomputing it") -> None:
    """Say, in one line, that a cache entry could not be used and what happens instead."""
    warnings.warn(f"cache entry {path} is unusable ({why}): {action}", CacheWarning, stacklevel=3)
