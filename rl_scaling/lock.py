"""One trainer per workdir: WORKDIR/trainer.lock names the holder (host, pid, start time).

Local workdirs: the holder keeps an exclusive `flock` on the file. The kernel drops it when the
process dies, however it dies (SIGKILL, a crash), so a dead holder never blocks a new trainer.

gs:// workdirs: the lock is an object created with `ifGenerationMatch=0` (the request fails if
the object exists), so of two trainers racing only one wins. The holder rewrites it every
HEARTBEAT_S seconds, each write matched to the generation it wrote last (a failed match means
another trainer took the lock over: this one stops). A lock is stale when its holder ran on this
host and its pid is gone, or when its heartbeat is older than STALE_S; a stale lock is deleted
with the generation read (so two trainers cannot both take it over) and created anew.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import time
import uuid

from rl_scaling import paths

log = logging.getLogger(__name__)

LOCK_NAME = "trainer.lock"
HEARTBEAT_S = 30.0
STALE_S = 300.0
_held: dict[str, "WorkdirLock"] = {}  # resolved workdir -> the lock this process holds on it


class LockHeld(RuntimeError):
    """Another live trainer holds the workdir."""


def _describe(holder: dict, path: str) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("started", 0)))
    return (f"pid {holder.get('pid')} on host {holder.get('host')!r} (since {since}; lock file {path}). "
            "Stop that trainer first; if it is gone for good, delete the lock file")


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError):
        return True  # someone else's process, or an unreadable pid: assume alive
    return True


def held(workdir: str) -> bool:
    return paths.resolve(workdir) in _held


def acquire(workdir: str) -> "WorkdirLock":
    """The lock on `workdir`, taken now, or the one this process already holds there."""
    workdir = paths.resolve(workdir)
    if workdir in _held:
        return _held[workdir]
    lock = (_GCSLock if paths.is_gcs(workdir) else _LocalLock)(workdir)
    lock.acquire()
    _held[workdir] = lock
    return lock


class WorkdirLock:
    def __init__(self, workdir: str):
        self.workdir, self.path = workdir, paths.join(workdir, LOCK_NAME)
        self.holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
                       "token": uuid.uuid4().hex}

    def refresh(self) -> None:
        """Keep the lock fresh (the training loop calls it every step; it writes rarely)."""

    def release(self) -> None:
        _held.pop(self.workdir, None)


class _LocalLock(WorkdirLock):
    def acquire(self) -> None:
        import fcntl

        paths.makedirs(self.workdir)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            try:
                holder = json.loads(paths.read_text(self.path) or "{}")
            except (OSError, ValueError):
                holder = {}
            raise LockHeld(f"workdir {self.workdir} is in use by another trainer: {_describe(holder, self.path)}") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps(self.holder).encode())
        os.fsync(fd)
        self.fd = fd

    def release(self) -> None:
        super().release()
        if getattr(self, "fd", None) is not None:
            os.close(self.fd)  # closing drops the flock; the file stays, naming the last holder
            self.fd = None


class _GCSLock(WorkdirLock):
    def __init__(self, workdir: str):
        super().__init__(workdir)
        self.fs = paths.gcs_filesystem()
        self.bucket, self.key = self.path[len("gs://"):].split("/", 1)
        self.generation, self.beat = None, 0.0

    def _write(self, if_generation: int) -> int:
        """Write the holder record if the object's generation is `if_generation` (0: absent);
        the new generation, or FileExistsError when the precondition fails."""
        self.holder["heartbeat"] = time.time()
        out = paths.storage_call("write", self.path, self.fs.call, "POST",
                                 f"{paths.endpoint()}/upload/storage/v1/b/{self.bucket}/o", uploadType="media",
                                 name=self.key, ifGenerationMatch=str(if_generation),
                                 data=json.dumps(self.holder).encode(),
                                 headers={"Content-Type": "application/octet-stream"}, json_out=True)
        return int(out["generation"])

    def _read(self):
        """(holder record, generation), or (None, None) when there is no lock object."""
        try:
            info = paths.storage_call("stat", self.path, self.fs.call, "GET", "b/{}/o/{}", self.bucket, self.key,
                                      json_out=True)
            _, body = paths.storage_call("read", self.path, self.fs.call, "GET", "b/{}/o/{}", self.bucket, self.key,
                                         alt="media", ifGenerationMatch=info["generation"])
        except FileNotFoundError:
            return None, None
        try:
            holder = json.loads(body)
        except ValueError:
            holder = {}
        return holder, int(info["generation"])

    def _stale(self, holder: dict) -> str:
        age = time.time() - float(holder.get("heartbeat", 0))
        if holder.get("host") == self.holder["host"] and not _pid_alive(holder.get("pid")):
            return f"its pid {holder.get('pid')} is not running on this host"
        if age > STALE_S:
            return f"its heartbeat is {age:.0f} s old (stale after {STALE_S:.0f} s)"
        return ""

    def acquire(self) -> None:
        for _ in range(5):
            holder, generation = self._read()  # read first: see a live holder before writing anything
            if holder is None:
                try:
                    self.generation, self.beat = self._write(0), time.time()
                    return
                except FileExistsError:
                    continue  # another trainer created it meanwhile: read it
            reason = self._stale(holder)
            if not reason:
                raise LockHeld(f"workdir {self.workdir} is in use by another trainer: {_describe(holder, self.path)}")
            log.warning("taking over the lock %s of pid %s on host %r: %s", self.path, holder.get("pid"),
                        holder.get("host"), reason)
            try:
                self.generation, self.beat = self._write(generation), time.time()
                return
            except FileExistsError:
                continue  # someone else took it over first
        raise LockHeld(f"could not take the lock {self.path}: it changed on every attempt")

    def refresh(self) -> None:
        if time.time() - self.beat < HEARTBEAT_S:
            return
        holder, generation = self._read()  # the token check: the precondition alone needs a store that honours it
        try:
            if (holder or {}).get("token") != self.holder["token"]:
                raise FileExistsError(self.path)
            self.generation, self.beat = self._write(generation), time.time()
        except FileExistsError:
            holder, _ = self._read()
            self.generation = None  # not ours any more: release must not delete it
            raise LockHeld(f"lost the lock on {self.workdir} to {_describe(holder or {}, self.path)}") from None

    def release(self) -> None:
        super().release()
        if self.generation is not None:
            try:
                paths.storage_call("delete", self.path, self.fs.call, "DELETE", "b/{}/o/{}", self.bucket, self.key,
                                   ifGenerationMatch=str(self.generation))
            except (FileNotFoundError, FileExistsError):
                pass  # gone or taken over: nothing of ours to delete
            self.generation = None
