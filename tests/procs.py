"""Helpers for end-to-end tests: real agent and trainer processes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TRAINER = os.path.join(HERE, "trainer.py")

sys.path.insert(0, ROOT)

from agents.config import socket_path_for  # noqa: E402
from agents.protocol import AgentClient  # noqa: E402


def env(**extra: str) -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = ROOT + os.pathsep + e.get("PYTHONPATH", "")
    e.setdefault("OMP_NUM_THREADS", "1")
    e.update(extra)
    return e


def ckpt_cmd(*args: str, check: bool = False, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the ``ckpt`` CLI as a user would (``python -m ckpt.cli`` under this interpreter)."""
    p = subprocess.run([sys.executable, "-m", "ckpt.cli", *args], capture_output=True, text=True,
                       env=env(), timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"ckpt {' '.join(args)} failed ({p.returncode}): {p.stderr}")
    return p


#: run in a child process: the ``ckpt`` CLI under an audit hook that counts the manifest and step index files
#: it opens, printed as ``OPENED {...}`` on stderr at exit
_COUNTING_CKPT = """
import atexit, json, sys
opened = {"manifests": 0, "indexes": 0}
def hook(event, args):
    if event == "open" and isinstance(args[0], str):
        if args[0].endswith("/manifest.json"): opened["manifests"] += 1
        elif args[0].endswith("/index.json"): opened["indexes"] += 1
sys.addaudithook(hook)
atexit.register(lambda: print("OPENED " + json.dumps(opened), file=sys.stderr))
from ckpt.cli import main
sys.exit(main(sys.argv[1:]))
"""


def ckpt_counting_opens(*args: str, timeout: float = 600) -> tuple[subprocess.CompletedProcess, dict[str, int]]:
    """Run the ``ckpt`` CLI as :func:`ckpt_cmd` does; also return how many manifest and step index files it
    opened (``{"manifests": n, "indexes": n}``)."""
    p = subprocess.run([sys.executable, "-c", _COUNTING_CKPT, *args], capture_output=True, text=True, env=env(),
                       timeout=timeout)
    opened = json.loads(p.stderr.split("OPENED ", 1)[1].splitlines()[0])
    p.stderr = "\n".join(ln for ln in p.stderr.splitlines() if not ln.startswith("OPENED "))
    return p, opened


def write_secret(path: str) -> str:
    """Write a fresh per-job secret to ``path`` (mode 0600, as agents require); return ``path``."""
    import secrets

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, secrets.token_hex(32).encode())
    finally:
        os.close(fd)
    return path


def start_agent(shm: str, *args: str, log: str | None = None, extra_env: dict | None = None,
                socket: str | None = None, prefix: list[str] | None = None) -> subprocess.Popen:
    """Start ``ckpt agent --shm SHM ARGS`` and wait until it answers (on ``socket``, when ARGS name one); its
    output goes to ``proc.log_path``. ``prefix`` runs it through another command (``ip netns exec NS``)."""
    log = log or os.path.join(os.path.dirname(shm), f"agent-{time.monotonic_ns()}.log")
    logf = open(log, "ab")
    proc = subprocess.Popen([*(prefix or []), sys.executable, "-m", "ckpt.cli", "agent", "--shm", shm, *args],
                            stdout=logf, stderr=subprocess.STDOUT, env=env(**(extra_env or {})))
    proc.log_path = log
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        c = AgentClient.try_connect(socket or socket_path_for(shm), timeout=2)
        if c is not None:
            c.close()
            return proc
        if proc.poll() is not None:
            logf.close()
            with open(log, errors="replace") as f:
                tail = f.read()[-3000:]
            raise AssertionError(f"agent exited with {proc.returncode}; log {log} ends:\n{tail}")
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("agent did not come up within 30 s")


def agent_call(shm: str, op: str, **kw) -> dict:
    with AgentClient(socket_path_for(shm), timeout=120) as c:
        return c.call(op, **kw)


def kill_torchrun(proc: subprocess.Popen) -> None:
    """kill -9 a torchrun started with ``start_new_session=True`` and its ranks."""
    try:
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
            for pid in f.read().split():
                os.kill(int(pid), signal.SIGKILL)
    except FileNotFoundError:
        pass
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


def flip_byte(path: str, at: int) -> None:
    """Flip bits of the byte at offset ``at`` of the file ``path`` in place (damage a stored copy)."""
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x5A]))


def kill9(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)


def run_trainer(*args: str, timeout: float = 240, hang: bool = False) -> subprocess.Popen | subprocess.CompletedProcess:
    """Run tests/trainer.py. With ``hang``: return the live process once it printed ``STAGED``."""
    cmd = [sys.executable, TRAINER, *args]
    if not hang:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=timeout)
        if p.returncode != 0:
            raise AssertionError(f"trainer failed ({p.returncode}):\n{p.stdout}\n{p.stderr}")
        return p
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("STAGED"):
            return proc
        if not line and proc.poll() is not None:
            raise AssertionError(f"trainer exited with {proc.returncode} before staging: {proc.stderr.read()}")
    proc.kill()
    raise AssertionError("trainer did not stage in time")


def read_events(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def losses(events: list[dict]) -> dict[int, str]:
    return {e["step"]: e["loss"] for e in events if "step" in e}


@contextlib.contextmanager
def closing_all(factory):
    """A fixture's maker: ``make(*args)`` builds ``factory(*args)``; every one built is closed at the end."""
    made = []

    def make(*a, **kw):
        c = factory(*a, **kw)
        made.append(c)
        return c

    try:
        yield make
    finally:
        for c in made:
            c.close()


class AgentGroup:
    """What the multi-node test clusters share: node ``i``'s agent process in ``procs[i]``, its memory folder
    ``shm(i)`` (the subclass's), its status and log, waiting for a condition, and stopping every agent."""

    procs: dict

    def shm(self, i: int) -> str:
        raise NotImplementedError

    def status(self, i: int) -> dict:
        return agent_call(self.shm(i), "status")

    def log(self, i: int) -> str:
        with open(self.procs[i].log_path, errors="replace") as f:
            return f.read()

    def wait_for(self, cond, what: str, timeout: float = 90.0) -> float:
        """Wait for ``cond()``; the seconds it took. On timeout, the agents' log tails are in the error."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if cond():
                return time.monotonic() - t0
            time.sleep(0.1)
        tails = {i: self.log(i)[-2000:] for i in self.procs}
        raise AssertionError(f"timed out waiting for {what}; agent logs: {tails}")

    def stop_agents(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                kill9(p)
