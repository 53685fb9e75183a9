"""The disk tier: a folder on local NVMe, written atomically and durably.

Every object is written to a temp file, fsynced, renamed into place and its
folder fsynced, so a crash at any point leaves either the old state or the new
one. Shards drained from the memory tier are copied inside the kernel
(``copy_file_range``, else ``sendfile``). With ``compress=True`` objects are
stored as LZ4 frames (``<key>.lz4``); reads decompress transparently.
"""

from __future__ import annotations

import errno
import io
import os

import lz4.frame

from ._folder import FolderTier
from .base import ObjectInfo, Source, TierBase
from .errors import KeyNotFoundError, TierError

__all__ = ["DiskTier"]

_LZ4 = ".lz4"


class DiskTier(FolderTier):
    """Shards and manifests in a local folder; see :mod:`tiers.base` for the contract."""

    name = "disk"

    def __init__(self, root: str | os.PathLike, *, compress: bool = False, durable: bool = True) -> None:
        super().__init__(root, durable=durable)
        self.compress = compress

    def _key_of(self, relpath: str) -> str | None:
        return relpath[: -len(_LZ4)] if relpath.endswith(_LZ4) else relpath

    def _file(self, key: str) -> str:
        plain = self.path(key)
        if self.compress:
            return plain + _LZ4
        return plain

    def _existing(self, key: str) -> tuple[str, bool]:
        plain = self.path(key)
        if os.path.exists(plain + _LZ4):
            return plain + _LZ4, True
        return plain, False

    def _write(self, fd: int, src: Source) -> int:
        if not self.compress:
            return super()._write(fd, src)
        size = os.stat(src).st_size if isinstance(src, (str, os.PathLike)) else memoryview(src).nbytes
        with os.fdopen(os.dup(fd), "wb") as raw, lz4.frame.LZ4FrameFile(
            raw, "wb", content_checksum=True, auto_flush=False, source_size=size
        ) as out:
            if isinstance(src, (str, os.PathLike)):
                n = 0
                with open(src, "rb") as f:
                    while chunk := f.read(64 << 20):
                        out.write(chunk)
                        n += len(chunk)
                return n
            mv = memoryview(src).cast("B")
            out.write(mv)
            return len(mv)

    def put(self, key: str, src: Source) -> int:
        n = super().put(key, src)
        # a key is stored in one form only: drop the other after the new one is in place
        other = self.path(key) + ("" if self.compress else _LZ4)
        try:
            os.unlink(other)
        except FileNotFoundError:
            pass
        return n

    def read_into(self, key: str, buf: memoryview, offset: int = 0) -> int:
        path, compressed = self._existing(key)
        if not compressed:
            return self._read_path(key, path, buf, offset)
        buf = memoryview(buf).cast("B")
        try:
            with lz4.frame.LZ4FrameFile(path, "rb") as f:
                # seek stops at the end of the data, so a short seek means offset is past it
                if offset and f.seek(offset) != offset:
                    raise TierError(errno.EINVAL, f"{key}: read at {offset} past its end")
                done = 0
                while done < len(buf):
                    n = f.readinto(buf[done:])
                    if not n:
                        raise TierError(errno.EINVAL, f"{key}: read of {len(buf)} bytes at {offset} past its end")
                    done += n
                return done
        except RuntimeError as e:  # lz4 reports a damaged frame this way
            raise TierError(errno.EIO, f"{key}: damaged LZ4 frame in {path} ({e})") from e

    def reader(self, key: str, offset: int = 0) -> io.BufferedIOBase:
        """A binary file of ``key``'s stored bytes (decompressed), positioned at ``offset``: for a caller that
        streams an object in pieces (one decompression pass, where ranged ``get`` calls would each start
        over). The caller closes it. Raises KeyNotFoundError when absent, TierError for a damaged frame."""
        path, compressed = self._existing(key)
        try:
            f = lz4.frame.LZ4FrameFile(path, "rb") if compressed else open(path, "rb")
        except FileNotFoundError as e:
            raise KeyNotFoundError(errno.ENOENT, f"{key} is not in the disk tier at {self.root}") from e
        try:
            if offset and f.seek(offset) != offset:
                raise TierError(errno.EINVAL, f"{key}: read at {offset} past its end")
        except RuntimeError as e:
            f.close()
            raise TierError(errno.EIO, f"{key}: damaged LZ4 frame in {path} ({e})") from e
        except BaseException:
            f.close()
            raise
        return f

    def local_file(self, key: str) -> str | None:
        path, compressed = self._existing(key)
        return None if compressed or not os.path.isfile(path) else path

    def get(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        path, compressed = self._existing(key)
        if not compressed or length is not None:
            return super().get(key, offset, length) if not compressed else TierBase.get(self, key, offset, length)
        try:
            with lz4.frame.LZ4FrameFile(path, "rb") as f:
                if offset and f.seek(offset) != offset:
                    raise TierError(errno.EINVAL, f"{key}: read at {offset} past its end")
                data = f.read()
                if offset and not data and f.tell() < offset:
                    raise TierError(errno.EINVAL, f"{key}: read at {offset} past its end")
                return data
        except FileNotFoundError as e:
            raise KeyNotFoundError(errno.ENOENT, f"{key} is not in the disk tier at {self.root}") from e
        except RuntimeError as e:
            raise TierError(errno.EIO, f"{key}: damaged LZ4 frame in {path} ({e})") from e

    def stat(self, key: str) -> ObjectInfo:
        path, compressed = self._existing(key)
        try:
            st = os.stat(path)
        except FileNotFoundError as e:
            raise KeyNotFoundError(errno.ENOENT, f"{key} is not in the disk tier at {self.root}") from e
        size = st.st_size
        if compressed:
            with open(path, "rb") as f:
                info = lz4.frame.get_frame_info(f.read(32))
            size = info.get("content_size") or 0
        return ObjectInfo(key, size, st.st_mtime)

    def delete(self, key: str) -> None:
        plain = self.path(key)
        self._delete_path(plain + _LZ4)
        self._delete_path(plain)
