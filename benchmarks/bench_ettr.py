"""Effective training time ratio (ETTR) of an N-GPU job per checkpoint method: measured restart, modelled scale.

    python benchmarks/bench_ettr.py [--size-gib 0.25] [--restart-runs 3] [--from-json bench_save.json]
        [--stall tierckpt=0.04,dcp_async=0.07] [--restore memory=0.25,peer=0.3,disk=0.4,s3=11.6,...]
        [--gpus 256,1024,4096,16384,65536] [--mttf 1024=7.9,16384=1.8] [--interval young|daly]
        [--restart-extra 0] [--s3-aggregate-gbps 1000] [--plot bench_ettr.png] [--out ettr.json]

ETTR is useful training time over wall time. Per method, with

* delta: the save stall per checkpoint (s): what the training loop blocks for, a ``bench_save.py``
  "stall" (save + the next step, less a plain step);
* R: the restart cost (s), from a failure to the end of the first training step: process start,
  ``import torch``, process-group init, model build, ``restore()`` from the method's tier, first step;
* M: the job's mean time to failure (s) at N GPUs;
* tau: the checkpoint interval (s of training between saves), Young's optimum
  ``tau = sqrt(2 * delta * M)`` or, with ``--interval daly``, Daly's higher-order one
  ``tau = sqrt(2 delta M) * [1 + (1/3) sqrt(delta / 2M) + (1/9) (delta / 2M)] - delta`` for
  ``delta < 2M`` (``tau = M`` otherwise);

the model is::

    ETTR = tau / (tau + delta) * max(0, 1 - (R + (tau + delta) / 2) / M)

the first factor the time lost to saving, the second the time lost per failure (the restart plus, on
average, half an interval of work since the last checkpoint) times failures per second (1 / M).

M at N GPUs is a line on log-log axes, ``M(N) = M1 * (N / N1) ** -k``, through Meta's published
figures (Kokolis et al., "Revisiting Reliability in Large-Scale Machine Learning Research Clusters",
HPCA 2025, from the clusters Llama 3 was trained on): 7.9 h at 1,024 GPUs, 1.8 h at 16,384 GPUs
(``--mttf``); k is fitted from the two points (about 0.53), and N outside them is extrapolated.

Measured here, in this run: the restart pieces that do not depend on the tier. A fresh Python process
(this script, ``--restart-child``) is started ``--restart-runs`` times; it prints a wall-clock stamp
after ``import torch``, after a gloo process group of world 1 is up (a FileStore, no port), after the
``_common.build_state(--size-gib)`` model and AdamW state are built, and after one more training step;
the medians of the phases are R's measured part. Given, not measured here: the save stall per method
(``--stall``, or the medians of a ``bench_save.py --out`` file through ``--from-json``) and
``restore()`` per tier (``--restore``; ``bench_restore.py`` prints these and writes no file). The
output says which figure came from where.

Scaling assumptions, kept simple: every GPU holds the same state (``--figures-gib`` per GPU, the size
the given stall and restore figures are for; they are not rescaled) and saves and restores its own
shard in parallel with every other, so the stall and the memory, peer and disk restore are the same
at every N. The measured model build and first step are for a ``--size-gib`` state, not rescaled to
``--figures-gib`` either (a small one keeps the run short). An S3 restore (tierckpt's and DCP's) also
reads every GPU's shard through one store: it takes at least ``N * figures-gib / --s3-aggregate-gbps``
(an assumed bandwidth; the store also takes every checkpoint's writes, and where they outlast tau the
output says the S3 rows are optimistic). The restart pieces are measured at world 1: rendezvous and
process-group init at N GPUs, failure detection and replacing a failed node are not in them
(``--restart-extra`` adds a fixed figure for those to every method). Each row assumes every failure
recovers from that tier, and that the tier holds the step saved one interval ago. Every job of more
than one process here is modelled, not measured.

``--plot PATH`` draws ETTR against N with matplotlib when it can be imported (it is not a dependency
of the project: without it the plot is skipped with a note).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

HERE = os.path.dirname(os.path.abspath(__file__))

# Meta's figures: (GPUs, job MTTF in hours)
META_MTTF = ((1024, 7.9), (16384, 1.8))
DEFAULT_GPUS = (256, 1024, 4096, 16384, 65536)
DEFAULT_STALL = {"tierckpt": 0.04, "dcp_async": 0.07}
DEFAULT_RESTORE = {"memory": 0.25, "peer": 0.3, "disk": 0.4, "s3": 11.6, "dcp_disk": 0.27, "dcp_s3": 11.6}
REFERENCES = (
    "ByteRobust (ByteDance) reports 97% ETTR for a training job on 9,600 GPUs",
    "AWS SageMaker HyperPod checkpointless training reports up to 95% training goodput and recovery "
    "in under 2 minutes",
)
PHASES = ("python start", "import torch", "process group init", "model build", "first step")


@dataclass(frozen=True)
class Method:
    """A checkpoint method as the model sees it: whose save stall it pays, which tier it restores from."""

    key: str
    label: str
    stall: str  # key into the stall figures
    restore: str  # key into the restore figures
    through_s3: bool = False  # the restore reads every GPU's shard through one store


METHODS = (
    Method("tierckpt_memory", "tierckpt, restore from memory", "tierckpt", "memory"),
    Method("tierckpt_peer", "tierckpt, restore from a peer", "tierckpt", "peer"),
    Method("tierckpt_disk", "tierckpt, restore from disk", "tierckpt", "disk"),
    Method("tierckpt_s3", "tierckpt, restore from S3", "tierckpt", "s3", True),
    Method("dcp_async_disk", "DCP async_save to disk", "dcp_async", "dcp_disk"),
    Method("dcp_async_s3", "DCP async_save to S3", "dcp_async", "dcp_s3", True),
)


# ---------------------------------------------------------------------------- the model
def mttf_fit(points: tuple[tuple[float, float], tuple[float, float]] = META_MTTF) -> tuple[float, float, float]:
    """(N1, M1, k) of the line ``M(N) = M1 * (N / N1) ** -k`` through two (GPUs, MTTF) points.

    Raises ValueError if the GPU counts are equal or a figure is not positive."""
    (n1, m1), (n2, m2) = points
    if min(n1, m1, n2, m2) <= 0 or n1 == n2:
        raise ValueError(f"two MTTF points at different, positive GPU counts are needed, got {points}")
    return n1, m1, math.log(m1 / m2) / math.log(n2 / n1)


def mttf_at(gpus: float, points: tuple[tuple[float, float], tuple[float, float]] = META_MTTF) -> float:
    """The job's mean time to failure at ``gpus`` GPUs, in the unit of the points' MTTF (hours for Meta's)."""
    n1, m1, k = mttf_fit(points)
    return m1 * (gpus / n1) ** -k


def young_interval(delta: float, mttf: float) -> float:
    """Young's optimal checkpoint interval ``sqrt(2 * delta * mttf)``: seconds, from seconds."""
    return math.sqrt(2.0 * max(delta, 0.0) * mttf)


def daly_interval(delta: float, mttf: float) -> float:
    """Daly's higher-order optimal checkpoint interval (seconds, from seconds); ``mttf`` once ``delta >= 2 mttf``."""
    delta = max(delta, 0.0)
    if delta >= 2.0 * mttf:
        return mttf
    x = delta / (2.0 * mttf)
    return math.sqrt(2.0 * delta * mttf) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - delta


def ettr(tau: float, delta: float, restart: float, mttf: float) -> float:
    """``tau / (tau + delta) * (1 - (restart + (tau + delta) / 2) / mttf)``, clamped at 0 (a fraction).

    Every argument in seconds: interval, save stall, restart cost (failure to first step), job MTTF.
    A free save (``delta == 0``) loses no work at an interval of 0: only the restarts count."""
    if mttf <= 0:
        return 0.0
    delta, tau = max(delta, 0.0), max(tau, 0.0)
    period = tau + delta
    saving = tau / period if period > 0 else 1.0
    return max(0.0, saving * (1.0 - (restart + period / 2.0) / mttf))


def s3_restore(per_gpu: float, gpus: float, gib_per_gpu: float, aggregate_gbps: float) -> float:
    """Seconds for every GPU to restore its shard from one store: one GPU's time (``per_gpu``), or the
    job's bytes (``gpus * gib_per_gpu`` GiB) at ``aggregate_gbps`` GB/s if that is longer (0: no bound)."""
    if aggregate_gbps <= 0:
        return per_gpu
    return max(per_gpu, gpus * gib_per_gpu * (1 << 30) / (aggregate_gbps * 1e9))


@dataclass(frozen=True)
class Point:
    """One method at one job size; every duration in seconds."""

    method: str
    gpus: int
    mttf: float
    delta: float
    restore: float
    restart: float
    tau: float
    ettr: float


def model(methods, stall: dict[str, float], restore: dict[str, float], restart_base: float, gpus,
          mttf_points=META_MTTF, interval: str = "young", gib_per_gpu: float = 1.0,
          s3_aggregate_gbps: float = 0.0) -> list[Point]:
    """ETTR of every method at every job size. ``restart_base``: the restart cost less the restore (s);
    ``mttf_points`` in hours. Raises KeyError for a method whose stall or restore figure is missing."""
    pick = young_interval if interval == "young" else daly_interval
    out = []
    for m in methods:
        for n in gpus:
            mttf = mttf_at(n, mttf_points) * 3600.0
            rest = restore[m.restore]
            if m.through_s3:
                rest = s3_restore(rest, n, gib_per_gpu, s3_aggregate_gbps)
            delta = max(stall[m.stall], 0.0)
            r = restart_base + rest
            tau = pick(delta, mttf)
            out.append(Point(m.key, n, mttf, delta, rest, r, tau, ettr(tau, delta, r, mttf)))
    return out


# ---------------------------------------------------------------------------- inputs
def parse_figures(text: str, what: str, known) -> dict[str, float]:
    """``key=seconds,key=seconds`` into a dict; raises ValueError on a malformed pair or an unknown key."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in known:
            raise ValueError(f"{what}: {part!r} is not one of {', '.join(known)}=<number>")
        out[key] = float(value)
    return out


def parse_mttf(text: str) -> tuple[tuple[float, float], tuple[float, float]]:
    """``GPUS=HOURS,GPUS=HOURS`` (exactly two points) into the points ``mttf_fit`` takes."""
    pts = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        n, sep, h = part.partition("=")
        if not sep:
            raise ValueError(f"--mttf: {part!r} is not GPUS=HOURS")
        pts.append((float(n), float(h)))
    if len(pts) != 2:
        raise ValueError(f"--mttf takes two GPUS=HOURS points, got {len(pts)}")
    return pts[0], pts[1]


def figures_from_json(path: str) -> tuple[dict[str, float], dict[str, float], float | None]:
    """(stall, restore, state GiB or None) from a file: a ``bench_save.py --out`` file (the median "stall" of
    its ``tierckpt`` and ``dcp_async`` methods, its state size), or ``{"stall": {...}, "restore": {...},
    "gib_per_gpu": x}`` (seconds). Raises OSError or ValueError for an unreadable file."""
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: not a JSON object")
    stall = {k: float(v) for k, v in (doc.get("stall") or {}).items() if k in DEFAULT_STALL}
    restore = {k: float(v) for k, v in (doc.get("restore") or {}).items() if k in DEFAULT_RESTORE}
    gib = doc.get("gib_per_gpu")
    for key, res in (doc.get("methods") or {}).items():
        if key in DEFAULT_STALL and res.get("stall"):
            stall[key] = statistics.median(res["stall"])
    if "methods" in doc:
        gib = (doc.get("machine") or {}).get("state_gib", gib)
    return stall, restore, None if gib is None else float(gib)


# ---------------------------------------------------------------------------- the measured restart
def restart_child(size_gib: float) -> int:
    """The restarted trainer: print a wall-clock stamp after each phase (``phase <name> <time.time()>``)."""
    stamp = lambda name: print(f"phase {name} {time.time():.6f}", flush=True)
    stamp("python start")
    import torch
    import torch.distributed as dist

    stamp("import torch")
    store = os.path.join(tempfile.mkdtemp(prefix="bench-ettr-"), "store")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    stamp("process group init")
    sys.path.insert(0, HERE)
    from _common import build_state

    ts = build_state(size_gib)
    stamp("model build")
    ts.step()
    stamp("first step")
    dist.destroy_process_group()
    shutil.rmtree(os.path.dirname(store), ignore_errors=True)
    return 0


def measure_restart(size_gib: float, runs: int, timeout: float = 300.0) -> dict[str, list[float]]:
    """Seconds of each restart phase, per fresh process, over ``runs`` processes. Raises RuntimeError when
    a process fails."""
    out: dict[str, list[float]] = {p: [] for p in PHASES}
    for _ in range(runs):
        t0 = time.time()
        p = subprocess.run([sys.executable, os.path.abspath(__file__), "--restart-child", "--size-gib", str(size_gib)],
                           capture_output=True, text=True, timeout=timeout)
        if p.returncode != 0:
            tail = (p.stderr.strip().splitlines() or [f"exit status {p.returncode}"])[-1]
            raise RuntimeError(f"the restart process failed: {tail}")
        stamps = {}
        for line in p.stdout.splitlines():
            if line.startswith("phase "):
                name, t = line[len("phase "):].rsplit(" ", 1)
                stamps[name] = float(t)
        prev = t0
        for name in PHASES:
            out[name].append(stamps[name] - prev)
            prev = stamps[name]
    return out


# ---------------------------------------------------------------------------- output
def _pct(x: float) -> str:
    return f"{100 * x:.2f}"


def _dur(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    """_common's table, repeated: _common imports torch, which only the restarted process here needs."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"
    return "\n".join([line(headers), "| " + " | ".join("-" * w for w in widths) + " |"] + [line(r) for r in rows])


def render(methods, points: list[Point], phases: dict[str, float], runs: int, sources: dict[str, str],
           stall, restore, a) -> str:
    base = sum(phases.values()) + a.restart_extra
    lines = [f"restart pieces, measured here (median of {runs} fresh processes, {a.size_gib} GiB state, world 1): "
             + ", ".join(f"{k} {v:.3f} s" for k, v in phases.items())
             + f" = {sum(phases.values()):.3f} s"
             + (f"; + {a.restart_extra:.3f} s given (--restart-extra)" if a.restart_extra else "")
             + (f" (the stall and restore figures are for {a.figures_gib:g} GiB per GPU)"
                if a.figures_gib != a.size_gib else ""),
             ""]
    rows = []
    for m in methods:
        s3 = " (one GPU; S3 bound below)" if m.through_s3 else ""
        rows.append([m.label, f"{stall[m.stall]:.3f}", sources[f"stall.{m.stall}"], f"{restore[m.restore]:.3f}{s3}",
                     sources[f"restore.{m.restore}"], f"{base + restore[m.restore]:.3f}"])
    lines.append(markdown_table(["method", "save stall δ s", "from", "restore() s", "from",
                                 "restart R s (measured pieces + restore)"], rows))
    lines.append("")
    gpus = sorted({p.gpus for p in points})
    by = {(p.method, p.gpus): p for p in points}
    head = ["ETTR % (interval τ)"] + [f"{n:,} GPUs, MTTF {by[(methods[0].key, n)].mttf / 3600:.2f} h" for n in gpus]
    rows = [[m.label] + [f"{_pct(by[(m.key, n)].ettr)} (τ {_dur(by[(m.key, n)].tau)})" for n in gpus] for m in methods]
    lines.append(markdown_table(head, rows))
    n1, m1, k = mttf_fit(a.mttf_points)
    (na, ha), (nb, hb) = a.mttf_points
    lines += [
        "",
        f"- ETTR = τ/(τ+δ) · (1 − (R + (τ+δ)/2) / M), "
        f"τ = {'sqrt(2δM) (Young)' if a.interval == 'young' else 'Daly'};"
        f" M(N) = {m1:g} h · (N/{n1:g})^-{k:.3f}, through {na:,g} GPUs = {ha:g} h and {nb:,g} GPUs = {hb:g} h"
        + (" (Meta's published figures)" if a.mttf_points == META_MTTF else " (given)") + "; other N extrapolated",
        f"- modelled, not measured: every job size above (this run restarts one process on "
        f"{os.cpu_count()} cores); the stall and restore are per GPU and the same at every N (each GPU saves and "
        f"restores its own {a.figures_gib:g} GiB shard in parallel)"
        + (f"; an S3 restore takes at least N · {a.figures_gib:g} GiB / {a.s3_aggregate_gbps:g} GB/s (assumed "
           f"aggregate store bandwidth, --s3-aggregate-gbps)" if a.s3_aggregate_gbps > 0 else "; S3 unbounded"),
        "- left out of the measured R (--restart-extra adds a figure for them): rendezvous and process-group "
        "init at N GPUs, failure detection, replacing a node; each row assumes every failure recovers from "
        "that tier, which holds the step saved one interval ago",
    ]
    s3 = [m for m in methods if m.through_s3]
    if s3 and a.s3_aggregate_gbps > 0:
        lines.append("- S3 restore at N: " + "; ".join(
            f"{m.label} " + ", ".join(f"{n:,}: {by[(m.key, n)].restore:.1f} s" for n in gpus) for m in s3))
        # the same store takes every checkpoint's bytes too: past this, S3 cannot hold every interval's step
        late = [(m, n) for m in s3 for n in gpus
                if s3_restore(0.0, n, a.figures_gib, a.s3_aggregate_gbps) > by[(m.key, n)].tau]
        if late:
            lines.append("- optimistic, not modelled: writing one checkpoint of the whole job to S3 takes longer "
                         "than τ for " + ", ".join(f"{m.label} at {n:,} GPUs" for m, n in late)
                         + "; there S3 holds an older step than the row assumes")
    lines.append("- references, from production jobs (their figures include the failure detection and node "
                 "replacement that R here leaves out):")
    lines += [f"  - {r}" for r in REFERENCES]
    return "\n".join(lines)


def plot(path: str, methods, points: list[Point]) -> str:
    """Draw ETTR (%) against GPUs to ``path`` (PNG); return a line that says what was written or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"no plot: matplotlib is not importable ({e}); install it to get {path}"
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m in methods:
        pts = sorted((p for p in points if p.method == m.key), key=lambda p: p.gpus)
        ax.plot([p.gpus for p in pts], [100 * p.ettr for p in pts], marker="o", label=m.label)
    ax.scatter([9600], [97], marker="*", s=120, color="black", zorder=5, label="ByteRobust: 97% on 9,600 GPUs")
    ax.axhline(95, color="grey", linestyle="--", linewidth=1, label="HyperPod checkpointless: up to 95% goodput")
    ax.set_xscale("log")
    gpus = sorted({p.gpus for p in points})
    ax.set_xticks(gpus, [f"{n:,}" for n in gpus])
    ax.minorticks_off()
    ax.set_xlabel("GPUs in the job (modelled)")
    ax.set_ylabel("ETTR %")
    ax.set_title("Effective training time ratio (MTTF from Meta's figures)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot written to {path}"


# ---------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--size-gib", type=float, default=0.25, help="state the measured restart builds (GiB)")
    ap.add_argument("--restart-runs", type=int, default=3, help="fresh processes timed (median of each phase)")
    ap.add_argument("--from-json", action="append", default=[], metavar="FILE",
                    help="stall (and restore) figures from a bench_save.py --out file, or {stall:, restore:}")
    ap.add_argument("--stall", default="", help=f"save stall per checkpoint, s (default "
                    f"{','.join(f'{k}={v}' for k, v in DEFAULT_STALL.items())})")
    ap.add_argument("--restore", default="", help=f"restore() per tier, s (default "
                    f"{','.join(f'{k}={v}' for k, v in DEFAULT_RESTORE.items())})")
    ap.add_argument("--figures-gib", type=float, default=1.0,
                    help="per-GPU state of the modelled job, the size the stall and restore figures are for (GiB)")
    ap.add_argument("--gpus", default=",".join(map(str, DEFAULT_GPUS)), help="job sizes to model")
    ap.add_argument("--mttf", default=",".join(f"{n}={h}" for n, h in META_MTTF),
                    help="two GPUS=HOURS points of job MTTF the log-log line goes through")
    ap.add_argument("--interval", choices=("young", "daly"), default="young", help="optimal interval formula")
    ap.add_argument("--restart-extra", type=float, default=0.0,
                    help="seconds added to every restart: detection, node replacement, rendezvous at N")
    ap.add_argument("--s3-aggregate-gbps", type=float, default=1000.0,
                    help="assumed aggregate S3 read bandwidth of the job, GB/s (0: no bound)")
    ap.add_argument("--methods", default=",".join(m.key for m in METHODS),
                    help=f"comma-separated subset of: {', '.join(m.key for m in METHODS)}")
    ap.add_argument("--plot", default="bench_ettr.png", help="PNG to draw (needs matplotlib; '' for none)")
    ap.add_argument("--out", help="write the inputs and every modelled point as JSON here")
    ap.add_argument("--restart-child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.restart_child:
        return restart_child(a.size_gib)

    try:
        a.mttf_points = parse_mttf(a.mttf)
        mttf_fit(a.mttf_points)
        gpus = [int(x) for x in a.gpus.split(",") if x.strip()]
        chosen = {k.strip() for k in a.methods.split(",") if k.strip()}
        unknown = chosen - {m.key for m in METHODS}
        if unknown:
            raise ValueError(f"unknown method(s) {sorted(unknown)}")
        methods = [m for m in METHODS if m.key in chosen]
        stall, restore = dict(DEFAULT_STALL), dict(DEFAULT_RESTORE)
        sources = {f"{kind}.{k}": "given (default)" for kind, figs in (("stall", stall), ("restore", restore))
                   for k in figs}
        for path in a.from_json:
            s, r, g = figures_from_json(path)
            stall.update(s)
            restore.update(r)
            src = f"given ({os.path.basename(path)}" + (f", {g:.3g} GiB state)" if g is not None else ")")
            sources.update({f"stall.{k}": src for k in s} | {f"restore.{k}": src for k in r})
        s, r = parse_figures(a.stall, "--stall", DEFAULT_STALL), parse_figures(a.restore, "--restore", DEFAULT_RESTORE)
    except (OSError, ValueError) as e:
        ap.error(str(e))
    stall.update(s)
    restore.update(r)
    sources.update({f"stall.{k}": "given (--stall)" for k in s} | {f"restore.{k}": "given (--restore)" for k in r})

    print(f"measuring the restart: {a.restart_runs} fresh processes, {a.size_gib} GiB state", file=sys.stderr,
          flush=True)
    per_run = measure_restart(a.size_gib, a.restart_runs)
    phases = {k: statistics.median(v) for k, v in per_run.items()}
    points = model(methods, stall, restore, sum(phases.values()) + a.restart_extra, gpus, a.mttf_points,
                   a.interval, a.figures_gib, a.s3_aggregate_gbps)
    print(render(methods, points, phases, a.restart_runs, sources, stall, restore, a))
    if a.plot:
        print(plot(a.plot, methods, points))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "restart_phases_s": per_run,
                       "stall_s": stall, "restore_s": restore, "sources": sources,
                       "points": [asdict(p) for p in points]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
