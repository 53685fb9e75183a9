"""Two ranks save a state that is the same on both: DCP's dedup plans each replicated tensor on one rank.
With one tensor the other rank's plan is empty; with ``--two`` each rank writes one, so each rank's load
needs the other rank's shard (on another node, when the ranks run on two). Step 1 goes through
``dcp.save``, step 2 through ``dcp.async_save`` with the stager; then every rank loads each step back and
prints ``LOADED <step> <rank> <ok>`` and the tiers that served it.

    torchrun --nproc-per-node 2 tests/dcp_dedup_job.py --job J --shm DIR [--two]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import ckpt


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--job", required=True)
    p.add_argument("--shm", required=True)
    p.add_argument("--two", action="store_true", help="two replicated tensors: one written by each rank")
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    writer = ckpt.DcpWriter(a.job, shm=a.shm, spawn=False)

    def state(step: int) -> dict:
        sd = {"shared": torch.arange(10.0) * step}
        if a.two:
            sd["other"] = torch.arange(10.0) * step + 100
        return sd

    dcp.save(state(1), storage_writer=writer, checkpoint_id=1)
    dcp.async_save(state(2), storage_writer=writer, async_stager=ckpt.DcpStager(writer),
                   checkpoint_id=2, process_group=dist.new_group(backend="gloo")).result()
    writer.wait()
    for step in (1, 2):
        want = state(step)
        got = {k: torch.zeros(10) for k in want}
        reader = writer.reader(rewind=False)
        dcp.load(got, storage_reader=reader, checkpoint_id=step)
        ok = all(torch.equal(got[k], want[k]) for k in want)
        # one write of the whole line (print writes the text and the newline apart, and the two ranks share
        # the launcher's stdout: their lines could interleave)
        os.write(1, f"LOADED {step} {rank} {ok} {','.join(sorted({r.tier for r in reader.reports}))}\n".encode())
    writer.close()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
