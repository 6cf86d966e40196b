"""Files written so that a crash (or power loss) leaves the old version or the new one, never half of either."""

from __future__ import annotations

import os
from typing import BinaryIO, Callable


def write_atomically(path: str, write: Callable[[BinaryIO], None]) -> None:
    """``write`` to ``path + ".tmp"``, flush it to disk, rename it over ``path``, and flush the rename.

    A crash at any point leaves either the old file or the new one, complete (the fsync before the
    rename: else the rename can reach the disk before the data; the one after: else the rename can be lost).
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
