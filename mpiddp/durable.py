"""Files that are whole or absent, whatever happens while they are written (the writer killed,
the node losing power): checkpoints, snapshots, manifests. Imports nothing of MPI, so that
offline tools (``python -m mpiddp.checkpoint_convert``) can use it."""
from __future__ import annotations

import os
from typing import Any, BinaryIO, Callable


def fsync_dir(path: str) -> None:
    """Flush a directory's entries (a rename or a new file in it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: str, payload: bytes | Callable[[BinaryIO], Any]) -> None:
    """Write ``payload`` (bytes, or a function that writes to the open file, such as
    ``lambda f: torch.save(state, f)``) so that ``path`` either does not exist or holds all
    of it, whatever happens meanwhile: data to a temporary name, fsync, rename, fsync of the
    directory (a rename whose data is not on disk yet can survive a crash as an empty file)."""
    directory = os.path.dirname(os.path.abspath(path))
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            if callable(payload):
                payload(f)
            else:
                f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        # (A full disk, say: leave no half-written temporary file behind.)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(directory)
