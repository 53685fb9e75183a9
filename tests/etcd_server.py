"""A real etcd cluster for the tests: ``n`` members on loopback ports, each with its own data folder."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.request

from s3util import free_port

__all__ = ["Etcd", "etcd_missing"]


def etcd_missing() -> str | None:
    """Why no etcd can be started here (None when it can)."""
    if shutil.which("etcd") is None:
        return "the etcd server is not installed (Debian: apt-get install etcd-server)"
    return None


class Etcd:
    """``n`` etcd members; ``endpoints`` is what ``--etcd`` takes. Stop and start members to make outages."""

    def __init__(self, root: str, n: int = 1) -> None:
        self.root = root
        self.n = n
        self.client = [free_port() for _ in range(n)]
        self.peer = [free_port() for _ in range(n)]
        self.cluster = ",".join(f"m{i}=http://127.0.0.1:{self.peer[i]}" for i in range(n))
        self.procs: dict[int, subprocess.Popen] = {}
        for i in range(n):
            self.start(i, wait=False)
        for i in range(n):
            self.wait_ready(i)

    @property
    def endpoints(self) -> str:
        return ",".join(f"http://127.0.0.1:{p}" for p in self.client)

    def start(self, i: int, wait: bool = True) -> None:
        data = os.path.join(self.root, f"etcd{i}")
        log = open(os.path.join(self.root, f"etcd{i}.log"), "ab")
        self.procs[i] = subprocess.Popen(
            ["etcd", "--name", f"m{i}", "--data-dir", data,
             "--listen-client-urls", f"http://127.0.0.1:{self.client[i]}",
             "--advertise-client-urls", f"http://127.0.0.1:{self.client[i]}",
             "--listen-peer-urls", f"http://127.0.0.1:{self.peer[i]}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer[i]}",
             "--initial-cluster", self.cluster, "--initial-cluster-state", "new",
             "--heartbeat-interval", "100", "--election-timeout", "1000"],
            stdout=log, stderr=subprocess.STDOUT)
        if wait:
            self.wait_ready(i)

    def wait_ready(self, i: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.client[i]}/v3/kv/range"
        while time.monotonic() < deadline:
            try:
                req = urllib.request.Request(url, data=json.dumps({"key": "AA=="}).encode(), method="POST")
                with urllib.request.urlopen(req, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.procs[i].poll() is not None:
                raise AssertionError(f"etcd member {i} exited: {open(os.path.join(self.root, f'etcd{i}.log')).read()[-2000:]}")
            time.sleep(0.1)
        raise AssertionError(f"etcd member {i} did not answer within {timeout:.0f} s")

    def stop(self, i: int) -> None:
        p = self.procs.pop(i, None)
        if p is not None and p.poll() is None:
            p.kill()
            p.wait(30)

    def close(self) -> None:
        for i in list(self.procs):
            self.stop(i)
