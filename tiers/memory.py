"""The memory tier: this node's host memory, as files in a tmpfs folder (``/dev/shm``).

Besides the plain :class:`~tiers.base.Tier` methods it manages the staging
*slots* trainers copy into: one small ring of pre-faulted files per
``(job, rank)`` under ``<root>/.slots/``. A committed shard is a hard link to
its slot, so committing costs no copy and a slot is free exactly when no shard
links to it any more (``st_nlink == 1``) — a fact that survives an agent
restart without any bookkeeping.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import uuid

from ._folder import FolderTier
from .errors import KeyNotFoundError, TierFullError
from .keys import check_job, check_rank

__all__ = ["MemoryTier", "default_shm_root"]


def default_shm_root() -> str:
    """``/dev/shm/tierckpt-<uid>`` (or the temp folder where there is no /dev/shm)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else os.environ.get("TMPDIR", "/tmp")
    return os.path.join(base, f"tierckpt-{os.getuid()}")


def background_priority() -> None:
    """Give the calling thread the lowest CPU priority (Linux schedules each thread on its own): a thread
    that sizes, faults in or maps staging slots ahead of the saves then gives way to the training steps that
    run meanwhile, on the cores they share. ``TIERCKPT_NO_NICE=1`` leaves priorities alone."""
    if os.environ.get("TIERCKPT_NO_NICE"):
        return
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


class MemoryTier(FolderTier):
    """Shards and manifests in host memory (a tmpfs folder). Not durable by design."""

    name = "memory"
    in_host_memory = True

    def __init__(self, root: str | os.PathLike | None = None) -> None:
        super().__init__(root or default_shm_root(), durable=False)

    # -- staging slots -----------------------------------------------------------
    def slot_dir(self, job: str, rank: int) -> str:
        return os.path.join(self.root, ".slots", check_job(job), f"rank-{check_rank(rank)}")

    def slots(self, job: str, rank: int) -> list[str]:
        """Paths of the existing slots of ``(job, rank)``, oldest name first."""
        d = self.slot_dir(job, rank)
        try:
            names = sorted(n for n in os.listdir(d) if n.startswith("slot-"))
        except FileNotFoundError:
            return []
        return [os.path.join(d, n) for n in names]

    @staticmethod
    def slot_is_free(path: str) -> bool:
        """True when no committed shard links to the slot."""
        try:
            return os.stat(path).st_nlink == 1
        except FileNotFoundError:
            return False

    def prepare_slot(self, path: str, size: int, fault: bool = True) -> bool:
        """Size a slot to ``size`` bytes and, with ``fault``, fault its pages in now, not during a save; return
        whether every page is backed. Without ``fault`` the slot is only sized (and checked against the
        folder's free room): whoever writes it faults the pages in, and must allocate them first
        (``posix_fallocate``) to get ENOSPC rather than SIGBUS when memory runs out.

        Raises TierFullError when the folder has no room for the slot."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            st = os.fstat(fd)
            if st.st_size == size and st.st_blocks * 512 >= size:
                return True  # already sized and backed: a reused slot costs nothing here
            if not fault:
                vfs = os.fstatvfs(fd)
                missing = size - min(st.st_blocks * 512, size)
                if missing > vfs.f_bavail * vfs.f_frsize:
                    raise TierFullError(errno.ENOSPC, f"no room for a {size}-byte staging slot in {self.root}: "
                                        "enlarge /dev/shm or lower the memory retention (keep)")
            if st.st_size != size:
                os.ftruncate(fd, size)
            if not fault:
                return not size
            if size:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as e:
                    if e.errno in (errno.ENOSPC, errno.ENOMEM):
                        os.ftruncate(fd, 0)
                        raise TierFullError(
                            e.errno,
                            f"no room for a {size}-byte staging slot in {self.root}: "
                            "enlarge /dev/shm or lower the memory retention (keep)",
                        ) from e
                    raise
            return True
        finally:
            os.close(fd)

    def new_slot_path(self, job: str, rank: int, index: int) -> str:
        d = self.slot_dir(job, rank)
        os.makedirs(d, exist_ok=True)
        return os.path.join(d, f"slot-{index}")

    def adopt(self, key: str, slot: str) -> None:
        """Publish a filled slot as ``key`` (a hard link, atomically replacing any old object)."""
        path = self.path(key)
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".tmp-{uuid.uuid4().hex}")
        try:
            os.link(slot, tmp)
        except FileNotFoundError as e:
            raise KeyNotFoundError(errno.ENOENT, f"staging slot {slot} is gone") from e
        os.rename(tmp, path)

    def drop_slots(self, job: str, busy: "set[str] | frozenset[str]" = frozenset()) -> int:
        """Remove every free slot of ``job`` (none in ``busy``: slots leased to a trainer) and the folders
        left empty; return the bytes freed (used by gc and by an agent whose job ended)."""
        base = os.path.join(self.root, ".slots", check_job(job))
        if not os.path.isdir(base):
            return 0
        freed = 0
        for rank_dir in os.listdir(base):
            d = os.path.join(base, rank_dir)
            for n in os.listdir(d):
                p = os.path.join(d, n)
                if p in busy or not self.slot_is_free(p):
                    continue
                try:
                    st = os.stat(p)
                    os.unlink(p)
                except FileNotFoundError:
                    continue
                freed += st.st_blocks * 512
            try:
                os.rmdir(d)
            except OSError:
                pass  # a slot is still in use
        try:
            os.rmdir(base)
        except OSError:
            pass
        return freed
