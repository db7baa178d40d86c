"""One writer per output folder: an exclusive, non-blocking ``flock`` on ``<folder>/.lock``.

The lock goes with the process (a killed run leaves no stale lock behind: its ``.lock`` file
may remain, unlocked), a released lock removes its file, and a second run on the same folder
is refused at once with a message naming the folder and the pid of the run that holds it.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class FolderInUse(RuntimeError):
    """Another process writes to this folder."""


class DirLock:
    def __init__(self, folder: str | os.PathLike, what: str = "run"):
        self.path = Path(folder) / ".lock"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            self._f = open(self.path, "a+")
            try:
                fcntl.flock(self._f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self._f.seek(0)
                holder = self._f.read().strip() or "unknown"
                self._f.close()
                mine = " -- this same process, which holds it already" if holder == str(os.getpid()) else ""
                raise FolderInUse(f"{self.path.parent} is in use by another {what} (pid {holder}){mine}; wait for "
                                  "it to finish, or use another out_dir") from None
            # the holder before us removed the file as it released it: lock the file now at the path
            try:
                if os.stat(self.path).st_ino == os.fstat(self._f.fileno()).st_ino:
                    break
            except FileNotFoundError:
                pass
            self._f.close()
        self._f.seek(0)
        self._f.truncate()
        self._f.write(str(os.getpid()))
        self._f.flush()

    def release(self) -> None:
        """Unlock and remove ``.lock`` (removed while still held, so no other process can lock a
        file that is about to vanish)."""
        if not self._f.closed:
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
            self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()
