"""One run per run directory: an exclusive OS lock held for the run's lifetime.

`nla train` and `nla sft` hold `save_dir/.nla.lock` with `fcntl.flock` from start-up to
exit. The kernel releases the lock when the process dies, however it dies (kill -9
included), so a stale lock never blocks a rerun. The file holds the owner's PID, host
and start time, which a second run names in its one-line refusal. Under torchrun rank 0
holds the lock for the whole job.

flock is advisory and local: it excludes every nla process on this machine (and on
filesystems that forward flock, e.g. Lustre, recent NFS); it cannot stop a tool that
ignores it.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import socket
from pathlib import Path
from types import TracebackType

from nla_shell.io.config import ConfigError
from nla_shell.training import distributed

LOCK_NAME = ".nla.lock"


class RunDirBusy(ConfigError):
    """Another live process holds the run directory's lock."""


class RunDirLock:
    """Context manager: hold `save_dir`'s lock on rank 0 while the block runs.

    Entering creates `save_dir` if needed (a file there is a ConfigError) and takes the
    lock, or raises RunDirBusy naming the holder; under torchrun the outcome reaches every
    rank. Leaving removes the lock file, and `save_dir` itself if entering created it and
    the run wrote nothing there, so a run refused for bad input leaves nothing behind.
    """

    def __init__(self, save_dir: str | os.PathLike[str]) -> None:
        self.save_dir = Path(save_dir)
        self.path = self.save_dir / LOCK_NAME
        self._fd: int | None = None
        self._created_dir = False

    def __enter__(self) -> RunDirLock:
        distributed.on_main(self._acquire)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._fd is None:
            return
        # Unlink while still holding the lock: a waiter that opened the old file then sees
        # that it no longer is the path's file, and retries (see _acquire).
        self.path.unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None
        if self._created_dir:
            try:
                self.save_dir.rmdir()  # only if empty
            except OSError:
                pass

    def _acquire(self) -> None:
        if self.save_dir.exists() and not self.save_dir.is_dir():
            raise ConfigError(f"config key 'save_dir' = {str(self.save_dir)!r} is a file; give a directory")
        self._created_dir = not self.save_dir.exists()
        self.save_dir.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RunDirBusy(
                    f"config key 'save_dir' = {str(self.save_dir)!r} is in use by another nla run "
                    f"({self._holder()}); wait for it to finish or stop it, or choose another save_dir"
                ) from None
            try:
                same_file = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same_file = False
            if same_file:
                break
            os.close(fd)  # the holder removed this file as we locked it: lock the new one
        now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()} since {now}\n".encode())
        self._fd = fd

    def _holder(self) -> str:
        try:
            return self.path.read_text(encoding="utf-8").strip() or "a process that is starting up"
        except OSError:
            return "a process that just exited"
