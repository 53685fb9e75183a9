"""Helpers shared by the benchmarks: a GPT-like training state, memory readings, tables.

Every duration is in seconds, every size in bytes unless a name says GiB.
"""

from __future__ import annotations

import ctypes
import gc
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

GiB = 1 << 30


# ---------------------------------------------------------------------------- machine
def machine_info() -> dict:
    """Cores, threads, CPU model, memory and the versions that shape the numbers."""
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = 0
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    shm = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
    return {
        "cores": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu,
        "ram_gib": round(mem / GiB, 1),
        "dev_shm_gib": round(shm.f_blocks * shm.f_frsize / GiB, 1) if shm else None,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "kernel": platform.release(),
    }


# ---------------------------------------------------------------------------- memory
def proc_mem(pid: int | str = "self") -> dict[str, int]:
    """RssAnon (private anonymous), RssFile, RssShmem (tmpfs / shared memory mapped) and VmRSS, in bytes."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                k, _, v = line.partition(":")
                if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


_libc = None


def settle_memory() -> None:
    """Collect garbage and hand free heap pages back, so RSS deltas show what is really held."""
    global _libc
    gc.collect()
    try:
        if _libc is None:
            _libc = ctypes.CDLL("libc.so.6")
        _libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def folder_bytes(path: str) -> int:
    """Bytes allocated under ``path``, each inode once (hard links share their pages)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except FileNotFoundError:
                continue
            key = (st.st_dev, st.st_ino)
            if key in seen:
                continue
            seen.add(key)
            total += st.st_blocks * 512
    return total


# ---------------------------------------------------------------------------- stats / tables
def median(xs: Iterable[float | None]) -> float | None:
    v = [x for x in xs if x is not None]
    return statistics.median(v) if v else None


def fmt(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "—"
    if x != 0 and abs(x) < 10 ** -digits:
        return f"{x:.1e}"
    return f"{x:.{digits}f}"


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b <= 0:
        return None
    return a / b


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"
    sep = "| " + " | ".join("-" * w for w in widths) + " |"
    return "\n".join([line(headers), sep] + [line(r) for r in rows])


# ---------------------------------------------------------------------------- the state
class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token and position embeddings, ``layers`` blocks, final layernorm, an untied LM head."""

    def __init__(self, vocab: int, d: int, layers: int, ctx: int) -> None:
        super().__init__()
        self.ctx = ctx
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, max(1, d // 64)) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


@dataclass
class TrainState:
    """A model, its AdamW optimizer (state already created) and one fixed batch."""

    model: GPT
    optim: torch.optim.Optimizer
    vocab: int
    d: int
    layers: int
    batch: tuple[int, int] = (1, 16)
    _x: torch.Tensor | None = None
    _y: torch.Tensor | None = None

    def set_batch(self, b: int, t: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.batch = (b, t)
        dev = self.model.head.weight.device
        self._x = torch.randint(0, self.vocab, (b, t), generator=g).to(dev)
        self._y = torch.randint(0, self.vocab, (b, t), generator=g).to(dev)

    def step(self) -> float:
        """One forward + backward + optimizer step; returns its duration."""
        t0 = time.perf_counter()
        logits = self.model(self._x)
        loss = F.cross_entropy(logits.flatten(0, 1), self._y.flatten())
        loss.backward()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor a checkpoint holds: parameters, then optimizer state (exp_avg, exp_avg_sq, step)."""
        out = [t.detach() for t in self.model.state_dict().values()]
        for st in self.optim.state.values():
            out.extend(v for v in st.values() if torch.is_tensor(v))
        return out

    def param_count(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def gpt_dims(size_gib: float, layers: int = 12, ctx: int = 128) -> tuple[int, int]:
    """(vocab, d) of the GPT whose float32 parameters plus AdamW state come to about ``size_gib``."""
    n = size_gib * GiB / 3 / 4  # float32 parameters
    d = max(64, round(math.sqrt(2 * n / 3 / (12 * layers)) / 64) * 64)
    block_params = layers * (12 * d * d + 13 * d)
    vocab = max(256, int((n - block_params - ctx * d - 2 * d) / (2 * d)))
    return vocab, d


def build_state(size_gib: float, layers: int = 12, ctx: int = 128, seed: int = 0,
                device: str = "cpu") -> TrainState:
    """A GPT-like model whose parameters are ~1/3 of ``size_gib`` and whose AdamW state is the other ~2/3.

    A third of the parameters sit in the embedding and the LM head (a few big
    tensors), the rest in ``layers`` blocks of 12 tensors each (big weights,
    small layernorm weights and biases). One optimizer step creates the state.
    """
    torch.manual_seed(seed)
    vocab, d = gpt_dims(size_gib, layers, ctx)
    model = GPT(vocab, d, layers, ctx).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ts = TrainState(model, optim, vocab, d, layers)
    ts.set_batch(1, 8)
    ts.step()
    return ts


def calibrate(ts: TrainState, target_s: float, log: Callable[[str], None] = print) -> float:
    """Pick the batch so one step takes about ``target_s``; return the measured step time (least of 5)."""

    def measure(b: int, t: int) -> float:
        ts.set_batch(b, t)
        ts.step()
        # the least of a few: other processes only ever add time
        return min(ts.step() for _ in range(5))

    ctx = ts.model.ctx
    small, big = 8, 64
    t_small, t_big = measure(1, small), measure(1, big)
    per_token = max((t_big - t_small) / (big - small), 1e-6)
    fixed = max(t_small - small * per_token, 0.0)
    tokens = int((target_s - fixed) / per_token) if target_s > fixed else small
    tokens = max(small, min(tokens, 64 * ctx))
    b = max(1, math.ceil(tokens / ctx))
    t = max(small, min(ctx, tokens // b))
    got = measure(b, t)
    log(f"calibration: {t_small:.3f} s at 8 tokens, {t_big:.3f} s at 64 tokens; "
        f"batch {b}x{t} -> {got:.3f} s per step (target {target_s} s)")
    return got


# ---------------------------------------------------------------------------- other load
_HZ = os.sysconf("SC_CLK_TCK")


def _proc_cpu(pid: int | str) -> float:
    """CPU seconds of a process (all threads), plus its reaped children's for ``self``."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = int(fields[11]) + int(fields[12])
    if pid == "self":
        ticks += int(fields[13]) + int(fields[14])
    return ticks / _HZ


def _busy_cpu() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    return (sum(v[:8]) - idle) / _HZ


class OtherLoad:
    """Cores that processes other than this one (and ``pids``) kept busy between ``start`` and ``stop``."""

    def __init__(self) -> None:
        self.pids: list[int] = []
        self._t = self._busy = self._own = 0.0

    def _own_cpu(self) -> float:
        return _proc_cpu("self") + sum(_proc_cpu(p) for p in self.pids)

    def start(self) -> None:
        self._t, self._busy, self._own = time.perf_counter(), _busy_cpu(), self._own_cpu()

    def stop(self) -> float:
        dt = time.perf_counter() - self._t
        other = (_busy_cpu() - self._busy) - (self._own_cpu() - self._own)
        return max(other, 0.0) / dt if dt > 0 else 0.0
