"""A tier over a local folder: the body shared by the memory and disk tiers."""

from __future__ import annotations

import errno
import os
import threading
import uuid

from .base import ObjectInfo, Source, TierBase
from .errors import KeyNotFoundError, TierError, TierFullError

__all__ = ["FolderTier", "copy_file_into"]

_COPY_CHUNK = 1 << 30


def copy_file_into(src_fd: int, dst_fd: int, size: int) -> None:
    """Copy ``size`` bytes between two files inside the kernel (no user-space buffer)."""
    done = 0
    use_cfr = hasattr(os, "copy_file_range")
    while done < size:
        n = min(_COPY_CHUNK, size - done)
        try:
            if use_cfr:
                m = os.copy_file_range(src_fd, dst_fd, n, done, done)
            else:
                m = os.sendfile(dst_fd, src_fd, done, n)
        except OSError as e:
            # tmpfs → ext4 across devices is allowed on new kernels, refused on old ones
            if use_cfr and e.errno in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                use_cfr = False
                os.lseek(dst_fd, done, os.SEEK_SET)
                continue
            raise
        if m == 0:
            raise TierError(f"source file ended after {done} of {size} bytes")
        done += m


def _full(e: OSError, where: str) -> TierError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return TierFullError(e.errno, f"no space left in {where}: free space or lower retention (keep)")
    return TierError(e.errno, f"{where}: {e.strerror}")


class FolderTier(TierBase):
    """Objects as files below ``root``; see :class:`tiers.base.Tier` for the contract.

    ``durable``: fsync every file and its folder before the rename publishes it.
    Temp files are dot-files and never listed; anything under a dot-folder is
    private to the owner (the memory tier keeps its staging slots there).
    """

    name = "folder"

    def __init__(self, root: str | os.PathLike, *, durable: bool = False) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self.durable = durable
        os.makedirs(self.root, mode=0o700, exist_ok=True)  # private to its user, whoever creates it
        self._lock = threading.Lock()

    def describe(self) -> str:
        return self.root

    # -- key ↔ path --------------------------------------------------------------
    def path(self, key: str) -> str:
        """The file that holds ``key``. Refuses keys that could leave the root."""
        parts = key.split("/")
        if not key or any(p in ("", ".", "..") or p.startswith(".") for p in parts) or "\0" in key:
            raise KeyNotFoundError(errno.ENOENT, f"invalid key {key!r}")
        return os.path.join(self.root, *parts)

    def _file(self, key: str) -> str:
        return self.path(key)

    # -- Tier ------------------------------------------------------------------
    def put(self, key: str, src: Source) -> int:
        path = self._file(key)
        folder = os.path.dirname(path)
        tmp = os.path.join(folder, f".tmp-{uuid.uuid4().hex}")
        try:
            os.makedirs(folder, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                n = self._write(fd, src)
                if self.durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, path)
            if self.durable:
                self._fsync_dir(folder)
            return n
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if isinstance(e, TierError):
                raise
            raise _full(e, f"{self.name} tier at {self.root}") from e

    def _write(self, fd: int, src: Source) -> int:
        if isinstance(src, (str, os.PathLike)):
            with open(src, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size:
                    copy_file_into(f.fileno(), fd, size)
                return size
        mv = memoryview(src).cast("B")
        done = 0
        while done < len(mv):
            done += os.write(fd, mv[done : done + _COPY_CHUNK])
        return done

    @staticmethod
    def _fsync_dir(folder: str) -> None:
        dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def read_into(self, key: str, buf: memoryview, offset: int = 0) -> int:
        return self._read_path(key, self._file(key), buf, offset)

    def local_file(self, key: str) -> str | None:
        """The plain local file that holds ``key`` byte for byte, for zero-copy reads (mmap); None if absent."""
        path = self._file(key)
        return path if os.path.isfile(path) else None

    def get(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        if length is not None:
            return super().get(key, offset, length)
        # size and bytes from one open file, so a concurrent overwrite cannot tear the read
        try:
            with open(self._file(key), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if offset > size:
                    raise TierError(errno.EINVAL, f"{key}: read at {offset} past its end ({size})")
                f.seek(offset)
                return f.read()
        except FileNotFoundError as e:
            raise KeyNotFoundError(errno.ENOENT, f"{key} is not in the {self.name} tier at {self.root}") from e

    def _read_path(self, key: str, path: str, buf: memoryview, offset: int) -> int:
        buf = memoryview(buf).cast("B")
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError as e:
            raise KeyNotFoundError(errno.ENOENT, f"{key} is not in the {self.name} tier at {self.root}") from e
        try:
            size = os.fstat(fd).st_size
            if offset + len(buf) > size:
                raise TierError(errno.EINVAL, f"{key}: read of {len(buf)} bytes at {offset} past its end ({size})")
            done = 0
            while done < len(buf):
                n = os.preadv(fd, [buf[done : done + _COPY_CHUNK]], offset + done)
                if n == 0:
                    raise TierError(errno.EIO, f"{key}: file shrank while being read")
                done += n
            return done
        finally:
            os.close(fd)

    def list(self, prefix: str = "") -> list[str]:
        keys = []
        for folder, dirs, files in os.walk(self.root):
            rel = os.path.relpath(folder, self.root)
            base = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            # only the folders on the prefix's way are entered (one step's folder: three listings)
            dirs[:] = [d for d in dirs if not d.startswith(".") and (
                (base + d + "/").startswith(prefix) or prefix.startswith(base + d + "/"))]
            for f in files:
                if f.startswith("."):
                    continue
                key = self._key_of(base + f)
                if key is not None and key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def _key_of(self, relpath: str) -> str | None:
        return relpath

    def delete(self, key: str) -> None:
        self._delete_path(self._file(key))

    def _delete_path(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            return
        # drop the step folder once it is empty; a racing put recreates it
        folder = os.path.dirname(path)
        while folder != self.root:
            try:
                os.rmdir(folder)
            except OSError:
                break
            folder = os.path.dirname(folder)

    def stat(self, key: str) -> ObjectInfo:
        try:
            st = os.stat(self._file(key))
        except FileNotFoundError as e:
            raise KeyNotFoundError(errno.ENOENT, f"{key} is not in the {self.name} tier at {self.root}") from e
        return ObjectInfo(key, st.st_size, st.st_mtime)
