"""Start a node agent as a child process (the embedded default) and wait until it answers."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import time

from .config import Settings
from .protocol import AgentClient, AgentUnreachableError

__all__ = ["spawn_agent", "connect_or_spawn", "wait_stopped"]


def _private_folder(path: str) -> None:
    """Create ``path`` (mode 0700) if missing; a folder of this user's that others may enter becomes 0700."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid == os.getuid() and st.st_mode & 0o077:
        os.chmod(path, 0o700)


def _private_file(path: str, flags: int, mode: str):
    """Open ``path`` (created 0600; an existing file of this user's is tightened to 0600) as a file object."""
    fd = os.open(path, flags | os.O_CREAT, 0o600)
    try:
        st = os.fstat(fd)
        if st.st_uid == os.getuid() and st.st_mode & 0o077:
            os.fchmod(fd, 0o600)
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def spawn_agent(settings: Settings, *, idle_exit: float = 120.0, log_path: str | None = None,
                timeout: float = 60.0) -> subprocess.Popen:
    """Start ``python -m agents`` for ``settings``; return once its socket answers.

    The agent runs in its own session so a crash (or ``kill -9``) of the trainer
    that started it does not take the node's memory tier with it; it exits by
    itself after ``idle_exit`` seconds without a trainer connected and with
    nothing left to drain. Raises AgentUnreachableError if it does not come up.
    """
    _private_folder(settings.shm)
    log_path = log_path or os.path.join(settings.shm, ".agent.log")
    cmd = [sys.executable, "-m", "agents", "--settings-json", json.dumps(settings.to_dict()),
           "--embedded", "--idle-exit", str(idle_exit)]
    with _private_file(log_path, os.O_WRONLY | os.O_APPEND, "ab") as logf:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        client = AgentClient.try_connect(settings.socket_path, timeout=5)
        if client is not None:
            client.close()
            return proc
        if proc.poll() is not None:
            break
        time.sleep(0.02)
    if proc.poll() is None:
        proc.kill()
    try:
        with open(log_path, "rb") as f:
            tail = f.read()[-2000:].decode(errors="replace").strip().splitlines()[-3:]
    except OSError:
        tail = []
    raise AgentUnreachableError(f"the embedded agent did not start (log {log_path}): {' | '.join(tail)}")


def connect_or_spawn(settings: Settings, *, spawn: bool = True, idle_exit: float = 120.0) -> tuple[AgentClient, bool]:
    """Connect to the node's agent, starting one if none answers and ``spawn``.

    Returns ``(client, started)``. Local ranks racing here are serialised by a
    lock file, so exactly one agent is started per memory folder.
    """
    client = AgentClient.try_connect(settings.socket_path)
    if client is not None or not spawn:
        if client is None:
            raise AgentUnreachableError(
                f"no tierckpt agent answers on {settings.socket_path.replace(chr(0), '@')}: start `ckpt agent`"
            )
        return client, False
    _private_folder(settings.shm)
    with _private_file(os.path.join(settings.shm, ".spawn.lock"), os.O_WRONLY, "w") as lockf:
        fcntl.flock(lockf, fcntl.LOCK_EX)
        client = AgentClient.try_connect(settings.socket_path)
        if client is not None:
            return client, False
        spawn_agent(settings, idle_exit=idle_exit)
    return AgentClient(settings.socket_path), True


def wait_stopped(settings: Settings, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds until the agent of ``settings`` that was asked to stop is gone: its
    socket no longer answers and its memory folder's lock is free, so a new agent can take the folder.
    Returns whether it is gone."""
    deadline = time.monotonic() + timeout
    lock = os.path.join(settings.shm, ".agent.lock")
    while time.monotonic() < deadline:
        probe = AgentClient.try_connect(settings.socket_path, timeout=1)
        if probe is not None:
            probe.close()
        else:
            try:
                fd = os.open(lock, os.O_RDONLY)
            except FileNotFoundError:
                return True
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except OSError:
                pass  # still held: the agent is finishing its stop
            finally:
                os.close(fd)  # closing drops the probe's lock too
        time.sleep(0.02)
    return False
