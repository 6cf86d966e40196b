"""Files written so that a crash (or power loss) leaves the old version or the new one, never half of either."""

from __future__ import annotations

import errno
import os
from typing import Any, BinaryIO, Callable, Optional

# Errors that mean the disk (or a quota, or a file-size limit) is full: reported as such, with the path.
_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


class _Recording:
    """A binary file that remembers the first OSError of a write. Writers such as ``torch.save``
    turn it into an opaque ``RuntimeError`` ("file write failed"); this keeps the real cause."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.error: Optional[OSError] = None

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self._f.flush()

    def __getattr__(self, name: str) -> Any:  # tell, seek, fileno... as the file has them
        return getattr(self._f, name)


def _full_disk_error(path: str, cause: OSError) -> OSError:
    return OSError(
        cause.errno,
        f"{os.strerror(cause.errno)}: could not write {path} (its previous version, if any, is intact); "
        f"free some space there or choose another output directory",
    )


def write_atomically(path: str, write: Callable[[BinaryIO], None]) -> None:
    """``write`` to ``path + ".tmp"``, flush it to disk, rename it over ``path``, and flush the rename.

    A crash at any point leaves either the old file or the new one, complete (the fsync before the
    rename: else the rename can reach the disk before the data; the one after: else the rename can be lost).
    A full disk (``ENOSPC``, a quota, a file-size limit), wherever it strikes, is an ``OSError`` with
    that errno saying so and naming ``path``, whatever ``write`` made of it; the temporary file is removed.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = path + ".tmp"
    recording: Optional[_Recording] = None
    try:
        with open(tmp, "wb") as f:
            recording = _Recording(f)
            write(recording)  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.lexists(tmp):
            os.remove(tmp)
        cause = recording.error if recording is not None and recording.error is not None else e
        if isinstance(cause, OSError) and cause.errno in _FULL:
            raise _full_disk_error(path, cause) from e
        raise
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
