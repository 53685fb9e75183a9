"""``ckpt demo``: train a small GPT-style model with tiered checkpoints, kill -9 it, restore, report.

What it does, all on this machine:
1. starts an S3-compatible server (moto) on 127.0.0.1, unless ``--s3`` names one;
2. starts a node agent: memory in a tmpfs folder, disk every 2 saves, S3 every 4;
3. trains, checkpointing every step, and ``kill -9``s the trainer mid-run;
4. restarts the trainer: it restores the newest step from memory and finishes;
5. prints which tier served the restore and how fast each tier reads that step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time


def _gpt(vocab: int = 512, dim: int = 256, layers: int = 4):
    import torch

    class GPT(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = torch.nn.Embedding(vocab, dim)
            self.pos = torch.nn.Embedding(64, dim)
            layer = torch.nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
            self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.head = torch.nn.Linear(dim, vocab)

        def forward(self, x):
            h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
            mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
            return self.head(self.blocks(h, mask=mask, is_causal=True))

    torch.manual_seed(0)
    return GPT()


def train(a: argparse.Namespace) -> int:
    """The demo's trainer process."""
    import torch

    import ckpt

    model = _gpt()
    optim = torch.optim.AdamW(model.parameters(), lr=3e-4)
    state = {"model": model, "optim": optim, "data": {"step": -1}}
    with ckpt.Checkpointer("demo-gpt", shm=a.shm, spawn=False) as ck:
        t0 = time.perf_counter()
        last = ck.restore(state)
        if last is not None:
            r = ck.last_restore
            print(json.dumps({"restored": last, "tier": r.tiers[0], "bytes": r.shards[0].nbytes,
                              "seconds": r.shards[0].seconds, "total_seconds": time.perf_counter() - t0}), flush=True)
        for step in range(0 if last is None else last + 1, a.steps):
            g = torch.Generator().manual_seed(step)
            x = torch.randint(0, 512, (8, 64), generator=g)
            loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            state["data"]["step"] = step
            t = time.perf_counter()
            fut = ck.save(step, state)
            blocked = time.perf_counter() - t
            print(json.dumps({"step": step, "loss": round(loss.item(), 4), "save_blocked_s": round(blocked, 4)}),
                  flush=True)
            if step == a.kill_at:
                fut.wait_staged()
                print(json.dumps({"staged": step}), flush=True)
                time.sleep(3600)
    return 0


def _wait_socket(shm: str, proc: subprocess.Popen) -> None:
    from agents.config import socket_path_for
    from agents.protocol import AgentClient

    for _ in range(600):
        c = AgentClient.try_connect(socket_path_for(shm), timeout=2)
        if c is not None:
            c.close()
            return
        if proc.poll() is not None:
            raise RuntimeError("the agent exited at start; see its log above")
        time.sleep(0.05)
    raise RuntimeError("the agent did not start within 30 s")


def start_local_s3(bucket: str) -> tuple[subprocess.Popen, str]:
    """Start an S3-compatible server (moto) on a free 127.0.0.1 port with ``bucket`` in it.

    Sets fake credentials in this process's environment where none are set. Returns the server
    process (the caller terminates it) and its endpoint URL.
    """
    import socket

    import boto3

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    for k, v in {"AWS_ACCESS_KEY_ID": "local", "AWS_SECRET_ACCESS_KEY": "local",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(k, v)
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    for _ in range(600):
        try:
            client.create_bucket(Bucket=bucket)
            return proc, endpoint
        except Exception:
            if proc.poll() is not None:
                break
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"the local S3 server on {endpoint} did not start")


def run(a: argparse.Namespace) -> int:
    """The whole demo (see the module docstring)."""
    work = tempfile.mkdtemp(prefix="tierckpt-demo-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    disk = tempfile.mkdtemp(prefix="tierckpt-demo-disk-")
    shm = os.path.join(work, "shm")
    procs: list[subprocess.Popen] = []
    env = dict(os.environ)
    try:
        s3 = a.s3
        endpoint = a.s3_endpoint
        if s3 is None:
            moto, endpoint = start_local_s3("demo")
            procs.append(moto)
            env = dict(os.environ)
            s3 = "s3://demo/ckpt"
            print(f"• S3-compatible server (moto) on {endpoint}")
        agent_log = open(os.path.join(work, "agent.log"), "wb")
        agent = subprocess.Popen([sys.executable, "-m", "ckpt.cli", "agent", "--shm", shm, "--disk", disk,
                                  "--s3", s3, "--s3-endpoint", endpoint, "--disk-every", "2", "--s3-every", "4"],
                                 stdout=agent_log, stderr=subprocess.STDOUT, env=env)
        procs.append(agent)
        _wait_socket(shm, agent)
        print(f"• agent up: memory {shm}, disk {disk} (every 2nd save), {s3} (every 4th save)")
        cmd = [sys.executable, "-m", "ckpt._demo", "train", "--shm", shm, "--steps", str(a.steps)]
        trainer = subprocess.Popen(cmd + ["--kill-at", str(a.kill_at)], stdout=subprocess.PIPE, text=True, env=env)
        procs.append(trainer)
        blocked = []
        for line in trainer.stdout:
            ev = json.loads(line)
            if "loss" in ev:
                blocked.append(ev["save_blocked_s"])
                print(f"  step {ev['step']:3d}  loss {ev['loss']:.4f}  save blocked {ev['save_blocked_s'] * 1e3:6.1f} ms")
            if "staged" in ev:
                break
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        print(f"• kill -9 of the trainer after step {a.kill_at} was saved")
        out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, check=True).stdout
        events = [json.loads(x) for x in out.splitlines() if x.strip()]
        restored = next(e for e in events if "restored" in e)
        print(f"• restarted: restored step {restored['restored']} from {restored['tier']} "
              f"and trained on to step {a.steps - 1}")
        _ = subprocess.run([sys.executable, "-m", "ckpt.cli", "list", "demo-gpt", "--shm", shm], env=env)
        print()
        print(_tier_table(shm, disk, s3, endpoint, restored))
        return 0
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


def _tier_table(shm: str, disk: str, s3: str, endpoint: str, restored: dict) -> str:
    """Read the newest step that each tier holds from that tier alone, timed (median of 3)."""
    import statistics

    from recovery import fetch_shard, plan_restore, scan_tier
    from tiers import DiskTier, MemoryTier
    from tiers.s3 import S3Tier

    rows = [f"restore by the trainer: step {restored['restored']} from {restored['tier']}: "
            f"{restored['bytes'] / 2**20:.1f} MiB read and verified in {restored['seconds'] * 1e3:.1f} ms, "
            f"restart to first step {restored['total_seconds']:.2f} s", "",
            "| tier | step | MiB | read + verify, median of 3 (ms) | GB/s |", "|---|---|---|---|---|"]
    for tier in (MemoryTier(shm), DiskTier(disk), S3Tier.from_url(s3, endpoint_url=endpoint)):
        inv = scan_tier(tier, "demo-gpt")
        done = inv.complete_steps("demo-gpt")
        if not done:
            rows.append(f"| {tier.name} | - | - | - | - |")
            continue
        plan = plan_restore([inv], "demo-gpt", done[-1])
        size = plan.manifest.shard(0).size
        times = []
        for _ in range(3):
            buf = bytearray(size)
            times.append(fetch_shard(plan, 0, memoryview(buf)).seconds)
        t = statistics.median(times)
        rows.append(f"| {tier.name} | {done[-1]} | {size / 2**20:.1f} | {t * 1e3:.1f} | {size / t / 1e9:.2f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ckpt._demo")
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--shm", required=True)
    t.add_argument("--steps", type=int, default=12)
    t.add_argument("--kill-at", type=int, default=-1)
    r = sub.add_parser("run")
    add_run_args(r)
    a = p.parse_args(argv)
    return train(a) if a.cmd == "train" else run(a)


def add_run_args(r: argparse.ArgumentParser) -> None:
    r.add_argument("--steps", type=int, default=12)
    r.add_argument("--kill-at", type=int, default=8)
    r.add_argument("--s3", help="use this s3://bucket/prefix instead of starting a local S3 server")
    r.add_argument("--s3-endpoint")


if __name__ == "__main__":
    sys.exit(main())
