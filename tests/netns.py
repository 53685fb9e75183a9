"""Several hosts on one machine: one Linux network namespace per node, each with its own address on a bridge.

Made and removed by the tests themselves (as root, with iproute2). Each node ``i`` is namespace
``<tag>n<i>`` with a veth pair whose host end ``<tag>v<i>`` hangs on the bridge ``<tag>b0``. A link goes
down by taking the host end down; a partition moves one side's host ends to a second bridge ``<tag>b1``,
so the two sides cannot reach each other while each side still reaches itself. The kernel's netem qdisc is
not available on these machines: latency and loss come from a userspace proxy where a test needs them.

Everything made is removed by :meth:`Hosts.close`, also when a test fails, and names carry the pid so two
runs never meet.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess

__all__ = ["Hosts", "unavailable"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None when they can)."""
    if shutil.which("ip") is None:
        return "iproute2's ip command is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"tkprobe{os.getpid()}"
    r = _ip("netns", "add", name, check=False)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


class Hosts:
    """``n`` namespaces on a bridge; ``addr(i)`` is node ``i``'s address."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.tag = f"tk{os.getpid() % 100000}{random.randrange(36 ** 2):02x}"[:9]
        # a /24 of 10.0.0.0/8 chosen at random: two runs on one machine do not share one
        self.net = f"10.{random.randrange(100, 250)}.{random.randrange(1, 250)}"
        self.bridges = [f"{self.tag}b0", f"{self.tag}b1"]
        self.made_ns: list[str] = []
        self.made_links: list[str] = []
        try:
            for br in self.bridges:
                _ip("link", "add", br, "type", "bridge")
                self.made_links.append(br)
                _ip("link", "set", br, "up")
            for i in range(n):
                self._host(i)
        except BaseException:
            self.close()
            raise

    def _host(self, i: int) -> None:
        ns, host, inner = self.ns(i), f"{self.tag}v{i}", f"{self.tag}i{i}"
        _ip("netns", "add", ns)
        self.made_ns.append(ns)
        _ip("link", "add", host, "type", "veth", "peer", "name", inner)
        self.made_links.append(host)
        _ip("link", "set", inner, "netns", ns)
        _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", inner)
        _ip("-n", ns, "link", "set", inner, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "set", host, "master", self.bridges[0])
        _ip("link", "set", host, "up")

    def add(self) -> int:
        """One more host on the bridge (a replacement machine, at a new address); returns its index."""
        self._host(self.n)
        self.n += 1
        return self.n - 1

    def ns(self, i: int) -> str:
        return f"{self.tag}n{i}"

    def addr(self, i: int) -> str:
        return f"{self.net}.{10 + i}"

    def gateway(self) -> str:
        """Give this (the tests') namespace an address on the main bridge, so it reaches the nodes; return it."""
        addr = f"{self.net}.1"
        _ip("addr", "replace", f"{addr}/24", "dev", self.bridges[0])
        return addr

    def ifname(self, i: int) -> str:
        """Node ``i``'s network interface, inside its namespace (for GLOO_SOCKET_IFNAME)."""
        return f"{self.tag}i{i}"

    def prefix(self, i: int) -> list[str]:
        """The command prefix that runs a program on node ``i``."""
        return ["ip", "netns", "exec", self.ns(i)]

    def link(self, i: int, up: bool) -> None:
        """Take node ``i``'s link down or bring it back."""
        _ip("link", "set", f"{self.tag}v{i}", "up" if up else "down")

    def partition(self, side: set[int]) -> None:
        """Cut ``side`` off from the other nodes (each side still reaches itself)."""
        for i in range(self.n):
            _ip("link", "set", f"{self.tag}v{i}", "master", self.bridges[1 if i in side else 0])

    def heal(self) -> None:
        for i in range(self.n):
            _ip("link", "set", f"{self.tag}v{i}", "master", self.bridges[0])
            _ip("link", "set", f"{self.tag}v{i}", "up")

    def close(self) -> None:
        for ns in self.made_ns:
            _ip("netns", "del", ns, check=False)  # takes its end of the veth pair, and so the pair, with it
        for link in reversed(self.made_links):
            _ip("link", "del", link, check=False)
        self.made_ns, self.made_links = [], []
