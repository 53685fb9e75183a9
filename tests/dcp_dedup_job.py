"""Two ranks save a state that is the same on both (one replicated tensor): DCP's dedup plans it on one rank,
so the other rank's plan is empty. Step 1 goes through ``dcp.save``, step 2 through ``dcp.async_save`` with
the stager; then every rank loads each step back and prints ``LOADED <step> <ok>``.

    torchrun --nproc-per-node 2 tests/dcp_dedup_job.py --job J --shm DIR
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
    a = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    writer = ckpt.DcpWriter(a.job, shm=a.shm, spawn=False)
    dcp.save({"shared": torch.arange(10.0)}, storage_writer=writer, checkpoint_id=1)
    dcp.async_save({"shared": torch.arange(10.0) * 2}, storage_writer=writer, async_stager=ckpt.DcpStager(writer),
                   checkpoint_id=2, process_group=dist.new_group(backend="gloo")).result()
    writer.wait()
    for step, want in ((1, torch.arange(10.0)), (2, torch.arange(10.0) * 2)):
        got = {"shared": torch.zeros(10)}
        dcp.load(got, storage_reader=writer.reader(rewind=False), checkpoint_id=step)
        print(f"LOADED {step} {rank} {torch.equal(got['shared'], want)}", flush=True)
    writer.close()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
