"""The trainer ↔ agent control protocol: JSON lines over the node agent's Unix socket.

One request per line, one response per line, in order, on a connection that
stays open for the trainer's lifetime (the agent releases a dead trainer's
staging leases when its connection closes)::

    → {"op": "hello", "job": J, "run": U}              (``job``: optional, a trainer of J; ``run``: its run's id)
    ← {"ok": true, "version": 1, "settings": {...}, "pid": 123, "embedded": false}
    → {"op": "begin", "job": J, "rank": R, "world": W, "nbytes": N, "wait": true}
    ← {"ok": true, "slot": "/dev/shm/.../slot-0", "ring": [...]}        or {"ok": true, "skip": "why"}
      (``ring``: the rank's slots already sized to N and faulted in, for the trainer to map ahead)
      (with "wait": false the agent answers at once, skipping, when no slot is free; with "fault": false it
      only sizes the slot, checking there is room, and the trainer faults it in while it copies; the answer
      carries J's background errors, each once, unless "errors": false (a lease taken ahead in the background))
    → {"op": "commit", "job": J, "step": S, "rank": R, "world": W, "slot": P,
       "nbytes": N, "entries": [...], "save_index": I, "metadata": {...}, "every_tier": false, "run": U}
      (``every_tier``: a forced save, written to every lower tier whatever its save_index; ``run``: the
      run that wrote the step, kept in its manifest's metadata)
    ← {"ok": true, "errors": [...]}                      background errors of J, each once
    → {"op": "wait", "job": J, "step": S|null, "timeout": T}
    ← {"ok": true, "done": true, "errors": [...]}

Also: ``release`` (give a lease back), ``errors``, ``list``, ``status``,
``delete``, ``shutdown`` (``if_alone``: only if no other trainer is connected; ``if_idle``: nor anything
being written, nor a crashed job's memory kept), ``end`` (``job``, ``rank``, ``agreed``: this trainer's
ranks agreed the job ended cleanly; once every rank on the node ended it, an embedded agent frees the job's
memory tier, see ``keep_memory_after_close``), ``crashed`` (``job``, ``why``: this trainer leaves without a
clean end; the agent keeps the job's memory tier for ``keep_after_crash`` s, answering
``{"steps": [...], "bytes": N, "seconds": S|null}``; a connection that closes without ``end`` counts the
same), ``takeover`` (``job``, ``step``, ``run``, ``shared``: a run that did not restore saves ``step``
first, so the steps of other runs from ``step`` on are dropped, from S3 too with ``shared``; answers
``{"dropped": {tier: [steps]}}``); ``prefetch`` (the warm restore's report, waiting up to ``timeout`` s
for it) and ``rewind`` (``job``, ``step``, ``run``: the job resumed from ``step``, so later steps in
memory are dropped), both called by a restore, and ``lower`` (``job``: the newest step of it that any tier
could hold, as far as the agent knows, so a restore from memory can skip S3).
A failed request answers ``{"ok": false, "error": <type>, "message": <one line>}``; the client raises :class:`AgentError`.
Lines are limited to ``MAX_LINE`` bytes.

Trust: the socket is a file in a folder only the agent's user may enter (never the abstract namespace, which
has no permissions), and each end checks the other's uid from the socket's credentials (``SO_PEERCRED``):
the agent answers a connection from another user with one ``PermissionError`` line and closes it, and the
client refuses an agent that runs as another user (:class:`UntrustedPeerError`). Root is trusted by both.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
from typing import Any

__all__ = ["PROTOCOL_VERSION", "MAX_LINE", "AgentError", "AgentUnreachableError", "AgentClient", "RequestError",
           "UnknownLayoutError", "UntrustedPeerError", "peer_credentials", "trusted_uid"]

PROTOCOL_VERSION = 1
MAX_LINE = 64 << 20


class AgentError(RuntimeError):
    """The agent refused or failed a request; ``kind`` is its error type name."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class AgentUnreachableError(ConnectionError):
    """No agent answers on the socket."""


class RequestError(ValueError):
    """The agent's side: a request is malformed or not allowed; answered to the client, never fatal."""


class UnknownLayoutError(RequestError):
    """A commit names a layout by digest that this agent does not hold: the trainer sends its entries again."""


class UntrustedPeerError(PermissionError):
    """The other end of the agent's socket runs as another user; nothing was sent to it."""


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a connected Unix socket (``SO_PEERCRED``)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def trusted_uid(uid: int) -> bool:
    """True for this process's own user and for root (who can read the memory folder anyway)."""
    return uid in (os.getuid(), 0)


def _connect(path: str, timeout: float | None) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
    except OSError as e:
        s.close()
        shown = path.replace("\0", "@")
        raise AgentUnreachableError(
            f"no tierckpt agent answers on {shown}: start one with `ckpt agent` or check --shm"
        ) from e
    try:
        _pid, uid, _gid = peer_credentials(s)
    except (OSError, AttributeError) as e:  # AttributeError: a platform without SO_PEERCRED
        s.close()
        raise AgentUnreachableError(f"cannot tell who listens on {path} ({e}): the agent needs Linux") from e
    if not trusted_uid(uid):
        s.close()
        raise UntrustedPeerError(
            f"the process listening on {path} runs as uid {uid}, not as you (uid {os.getuid()}): "
            "refusing to talk to it; stop it, or use your own --shm / --socket")
    return s


class AgentClient:
    """A blocking client of one agent; thread-safe (one request at a time per client)."""

    def __init__(self, socket_path: str, *, timeout: float | None = 600.0) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        self._sock = _connect(socket_path, timeout)
        self._file = self._sock.makefile("rb")
        self._lock = threading.Lock()

    def call(self, op: str, io_timeout: float | None = None, **kw: Any) -> dict:
        """Send one request; return the response, or raise AgentError / AgentUnreachableError."""
        line = json.dumps({"op": op, **kw}, separators=(",", ":")).encode() + b"\n"
        with self._lock:
            try:
                self._sock.settimeout(io_timeout if io_timeout is not None else self.timeout)
                self._sock.sendall(line)
                resp = self._file.readline(MAX_LINE)
            except OSError as e:
                raise AgentUnreachableError(f"lost the connection to the agent during {op!r}: {e}") from e
        if not resp:
            raise AgentUnreachableError(f"the agent closed the connection during {op!r} (did it exit?)")
        msg = json.loads(resp)
        if not msg.get("ok"):
            raise AgentError(msg.get("error", "AgentError"), msg.get("message", "agent error"))
        return msg

    def close(self) -> None:
        try:
            self._file.close()
            self._sock.close()
        except OSError:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @classmethod
    def try_connect(cls, socket_path: str, timeout: float | None = 600.0) -> "AgentClient | None":
        """A client, or None when nothing listens on the socket."""
        try:
            return cls(socket_path, timeout=timeout)
        except AgentUnreachableError:
            return None
